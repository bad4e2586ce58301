"""Accumulate on Redis: read, add, compare-and-set, and again for rows that changed.

Redis's scripts cannot add float16 or bfloat16 rows the way every other tier does (in
float32, rounded once: :mod:`nvecache.common.accumulate`), so the addition happens in the
client and the server only swaps rows: :data:`psclient.redis.scripts.ACCUMULATE` writes a
key's new row where the stored row is still the one read (byte for byte), in one script per
partition chunk, with the change-feed notice and the table's marker check of every write.
A row another writer changed between the read and the swap is left alone and flagged; the
client reads it again, adds to what it finds and swaps again. So each row's addition is
one atomic step, and a concurrent accumulate or update of the row never loses it: of two
writers racing on a row, one swap succeeds and the other retries on its result.

Every key is swapped, found or not, so the script's marker check refuses an accumulate on
a dropped table as it refuses any write. A swap command sent twice (its pipeline resent
after a lost connection) answers its receipt the second time, so no addition is applied
twice either.

A quantized table (``int8``, ``float8_e4m3fn``) is accumulated the same way, on its stored
bytes: the client decodes the row it read, adds the float32 sum of its deltas, encodes the
result with stochastic rounding (:func:`psclient.quantized.add_rows`) and swaps it for
the bytes it read; a round retried on a changed row draws its rounding again. This
optimistic compare-and-set was chosen over doing the addition in a Lua script (which
would need the codec's float32 arithmetic, rounding and fp8 tables written again in Lua,
where numbers are doubles: its bytes would not be :mod:`nvecache.common.quant`'s) and
over ``WATCH``/``MULTI``/``EXEC`` (a ``WATCH`` covers a whole partition hash, so every
write to any row of the partition would abort the transaction, and a cluster would need
one connection per watched slot): the compare covers exactly the rows the write touches,
one script per partition chunk on a cluster as on one server, and a row's values are a
function of its bytes, so equal bytes mean the row holds the values that were read (a
row changed and changed back to the same bytes holds the same values: adding to it is
still right).
Rows whose sum cannot be encoded (a float32 overflow) are refused before any swap of the
round that computed them (the first round: before anything is written).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from nvecache.common.accumulate import added, sum_duplicates
from nvecache.common.lazy import lazy_import
from psclient.codec import group_by_partition
from psclient.errors import PSServerError
from psclient.redis import resp, scripts
from psclient.redis.dispatch import Cmd

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch", globals())

#: rounds of read-and-swap before a key whose row keeps changing under it is given up
MAX_ROUNDS = 10_000

Read = Callable[[np.ndarray], "tuple[torch.Tensor, torch.Tensor]"]
Swap = Callable[[np.ndarray, "torch.Tensor", "torch.Tensor"], np.ndarray]
#: ``add(stored rows, summed deltas, their keys) -> the stored rows to write``
Add = Callable[["torch.Tensor", "torch.Tensor", np.ndarray], "torch.Tensor"]


def _added(rows: torch.Tensor, sums: torch.Tensor, _keys: np.ndarray) -> torch.Tensor:
    return added(rows, sums)


def compare_and_add(keys: np.ndarray, deltas: torch.Tensor, dtype: torch.dtype, read: Read,
                    swap: Swap, where: str, add: Add = _added) -> torch.Tensor:
    """Add ``deltas`` to the rows of ``keys`` that exist, each row atomically.

    Args:
        keys: int64 ``[N]``, duplicates allowed (their deltas are summed).
        deltas: ``[N, dim]``, the table's dtype or its accumulator dtype.
        dtype: the table's dtype (a quantized table's: its format's; the deltas are summed
            in its accumulator dtype, float32).
        read: a lookup of stored rows: ``(rows, found)`` of distinct keys (a missing key's
            row zeros).
        swap: one compare-and-set per key, ``(keys, rows read, rows to write)``; uint8 flags
            ``1`` written, ``0`` missing, ``r`` changed since the read.
        where: ``table 'T' at URL``, for messages.
        add: the stored rows to write from those read and the summed deltas (default:
            added in the accumulator dtype, rounded once; a quantized table's:
            :func:`psclient.quantized.add_rows`); what it raises ends the accumulate
            before that round's swap.

    Returns:
        bool ``[N]``: which keys existed (and were added to).
    """
    ukeys, sums, inverse = sum_duplicates(torch.from_numpy(keys), deltas, dtype)
    uk = ukeys.numpy()
    existed = np.zeros(uk.size, dtype=bool)
    todo = np.arange(uk.size)
    for _ in range(MAX_ROUNDS):
        # NOTE: a key found missing is swapped too, as a row of zeros (what a lookup reads
        # for it): the script answers '0' if it is still missing; one written meanwhile is
        # read again unless its row is zeros, which the sum is then rightly added to
        rows, _ = read(uk[todo])
        flags = swap(uk[todo], rows, add(rows, sums[torch.from_numpy(todo)], uk[todo]))
        existed[todo[flags == ord("1")]] = True
        todo = todo[flags == ord("r")]
        if todo.size == 0:
            break
    else:
        raise PSServerError(
            f"{where}: the rows of {todo.size} key(s) (the first: {int(uk[todo[0]])}) changed "
            f"under accumulate {MAX_ROUNDS} times in a row; the other keys were added to. "
            "Add to those keys again once fewer writers change them at once")
    return torch.from_numpy(existed[inverse.numpy()])


def swap_commands(keys: np.ndarray, old: torch.Tensor, new: torch.Tensor,
                  part_keys: list[bytes], opts: dict[str, Any], token: str
                  ) -> tuple[np.ndarray, list[Cmd]]:
    """The compare-and-set commands of distinct ``keys``: ``(order, commands)``, one
    ``EVAL`` of :data:`~psclient.redis.scripts.ACCUMULATE` per chunk of ``chunk_keys`` keys
    of a partition, over the keys sorted by partition (``keys[order]``).

    Each command has a receipt id of its own: a random batch id and the command's first
    key's place.
    """
    order, bounds = group_by_partition(keys, len(part_keys))
    first, second = (t.view(torch.uint8).numpy().reshape(keys.size, -1)[order]
                     for t in (old, new))
    rec = resp.field_row_pair_records(keys[order], first, second)
    size = rec.dtype.itemsize
    raw = resp.as_buffer(rec)  # NOTE: one buffer; commands send slices of it (no copy)
    lead = resp.bulk(b"EVAL") + resp.bulk(scripts.ACCUMULATE) + resp.bulk(b"7")
    rest = b"".join(resp.bulk(str(a).encode())
                    for a in (opts["changes_maxlen"], token, scripts.RECEIPT_MS))
    batch = os.urandom(8).hex().encode()
    ck = opts["chunk_keys"]
    bl = bounds.tolist()
    cmds: list[Cmd] = []
    for p in np.flatnonzero(bounds[1:] > bounds[:-1]).tolist():
        pk = part_keys[p]
        named = b"".join(map(resp.bulk, scripts.partition_keys(pk)))
        for s in range(bl[p], bl[p + 1], ck):
            e = min(bl[p + 1], s + ck)
            receipt = resp.bulk(b"%b-%d" % (batch, s))
            head = b"*%d\r\n%b%b%b%b" % (14 + 3 * (e - s), lead, named, rest, receipt)
            cmds.append(Cmd(p, s, e, [head, raw[s * size:e * size]]))
    return order, cmds
