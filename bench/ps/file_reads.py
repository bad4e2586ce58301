"""The ``file://`` store's reference reads: what its lookup is compared with.

Kept out of the library (``psclient.file.backend`` has one read path, from the row mirror
or one LMDB transaction over the distinct keys): the earlier per-key read, py-lmdb's
batched ``getmulti`` and LMDB's search alone, used by ``bench/ps/bench_psclient.py`` and, as
the reference, by ``tests/psclient``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from psclient.codec import be_bytes_to_keys, be_key_bytes
from psclient.errors import CorruptValueError


def getmulti_lookup(ps: Any, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same lookup through py-lmdb's native batched read, ``Cursor.getmulti``: one call
    for every distinct key (a found key comes back as a ``(key, value)`` tuple, a missing
    one is left out), assembled with numpy. Kept here as the measured alternative.

    NOTE: reads the backend's private environment (LMDB allows one per process).
    """
    u, inv = np.unique(keys, return_inverse=True)
    with ps._env.begin(db=ps._rows) as txn:
        got = txn.cursor().getmulti(be_key_bytes(u))
    rb = ps.schema.row_bytes
    vals = np.zeros(u.size, dtype=f"V{rb}")
    found = np.zeros(u.size, dtype=bool)
    if got:
        ks, vs = zip(*got, strict=True)
        pos = np.searchsorted(u, be_bytes_to_keys(b"".join(ks)))
        vals[pos] = np.frombuffer(b"".join(vs), dtype=vals.dtype)
        found[pos] = True
    return vals[inv], found[inv]


def assemble_rows(
    replies: list[bytes | None], order: np.ndarray, keys: np.ndarray, schema: Any, table: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference assembly of a lookup result: one stored value (or ``None`` for a miss)
    per key, in the order ``keys[order]``, into ``(values, found)`` in the caller's key
    order, missing rows zeros (the library assembles from distinct keys:
    ``psclient.codec.assemble_distinct_rows``).

    Raises:
        CorruptValueError: a stored value does not have the row length; names the key.
    """
    n, rb = len(replies), schema.row_bytes
    obj = np.empty(n, dtype=object)
    obj[order] = replies
    found = obj != None  # noqa: E711 -- elementwise comparison on an object array
    obj[~found] = bytes(rb)  # NOTE: a miss reads as a zero row
    ordered = obj.tolist()
    lengths = np.fromiter(map(len, ordered), dtype=np.int64, count=n)
    bad = np.flatnonzero(lengths != rb)
    if bad.size:
        raise CorruptValueError(
            f"table {table!r}, key {int(keys[bad[0]])}: stored value has "
            f"{int(lengths[bad[0]])} bytes, expected {rb} (dim {schema.dim} x {schema.dtype}); "
            f"{bad.size} bad value(s) in this batch: rewrite them with insert() or drop the table")
    flat = np.fromiter(ordered, dtype=f"V{rb}", count=n).view(np.uint8)
    values = torch.from_numpy(flat).view(schema.torch_dtype)
    return values.reshape(n, schema.dim), torch.from_numpy(found.astype(bool))


def lookup_per_key(ps: Any, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The earlier file:// read path, kept as the reference that tests and this benchmark
    compare the lookup with: one ``txn.get`` per key in key order, duplicates included,
    assembled by :func:`assemble_rows`.

    NOTE: reads the backend's private environment (LMDB allows one per process).
    """
    order = np.argsort(keys, kind="stable")
    with ps._env.begin(db=ps._rows) as txn:
        replies = list(map(txn.get, be_key_bytes(keys[order])))
    return assemble_rows(replies, order, keys, ps.schema, ps.table)


def search_only(ps: Any, keys: np.ndarray) -> int:
    """LMDB's B-tree search alone: ``getmulti(values=False)`` finds every key in C and
    copies no value (a ceiling for any read path through LMDB's API)."""
    with ps._env.begin(db=ps._rows) as txn:
        return len(txn.cursor().getmulti(be_key_bytes(np.sort(keys)), values=False))
