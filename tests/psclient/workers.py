"""Spawn-safe worker functions for multi-process psclient tests (importable by children)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import psclient


def file_writer_forever(url: str, table: str, ready: Any) -> None:
    """Rewrite all 512 rows with a growing value, forever (until killed)."""
    with psclient.connect(url, table=table) as ps:
        i = 0
        while True:
            ps.insert(torch.arange(512), torch.full((512, 8), float(i)))
            ready.set()
            i += 1


def file_reader(url: str, table: str, rounds: int) -> str:
    """Read all rows ``rounds`` times; every lookup must see one whole committed batch."""
    with psclient.connect(url, table=table) as ps:
        for _ in range(rounds):
            got, found = ps.lookup(torch.arange(512))
            if not bool(found.all()):
                return "missing rows"
            if not torch.equal(got, got[:, :1].expand(-1, 8)):
                return "torn row"
            if got.unique().numel() != 1:  # one read transaction sees one whole batch
                return "torn batch"
    return "ok"


def versioned_writer_forever(url: str, table: str, n_keys: int, seed: int, version: int,
                             ready: Any) -> None:
    """Random insert/update/erase batches of rows ``[key, version]`` (float64), forever.

    Versions only grow (from ``version``), so a row differs from the initial ``[key, 0]``
    once any write touched it. Keys come from ``[0, 2 * n_keys)``: inserts both overwrite
    and create rows. Runs until killed.
    """
    rng = np.random.default_rng(seed)
    sizes = [1, 5, 100, 700, 3000]
    with psclient.connect(url, table=table, changes_maxlen=1_000_000) as ps:
        while True:
            n = int(rng.choice(sizes))
            keys = torch.from_numpy(rng.integers(0, 2 * n_keys, n, dtype=np.int64))
            version += 1
            rows = torch.stack([keys.double(), torch.full((n,), float(version),
                                                          dtype=torch.float64)], 1)
            op = int(rng.integers(0, 3))
            if op == 0:
                ps.insert(keys, rows)
            elif op == 1:
                ps.update(keys, rows)
            else:
                ps.erase(keys)
            ready.set()


#: the key :func:`mirror_writer_held` inserts (committed to LMDB, never to the mirror)
HELD_KEY = 1000


def mirror_writer_held(url: str, table: str, held: Any) -> None:
    """Insert :data:`HELD_KEY` into a file:// table and stop inside the row mirror's update
    that follows LMDB's commit (its GEN odd, the writer lock held), say so, and stay there
    until killed: a writer caught mid-write. The mirror's put loop is what hangs."""
    import threading

    from psclient.file import mirror_loops

    def put_and_hang(*_: Any) -> int:
        held.set()
        threading.Event().wait()
        return 0

    mirror_loops.put = put_and_hang  # NOTE: this child's mirror writes hang in their loop
    with psclient.connect(url, table=table) as ps:
        ps.insert(torch.tensor([HELD_KEY]), torch.full((1, ps.dim), 3.0, dtype=ps.dtype))
