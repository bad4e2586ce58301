"""A writer SIGKILLed at random points never leaves a changed row unannounced.

A writer process runs random insert/update/erase batches (1 to 3000 keys) of rows that encode
``[key, version]`` and is killed with SIGKILL at random moments, many times. Then a follower
that took its cursor before the first writer started must have been told every key whose
row differs from the initial ``[key, 0]`` (changed or erased). The test uses ``changes()``
only, so it also runs against layout 1 (rows written, then a separate ``XADD``), where it
fails: a writer killed between the two leaves rows changed that no follower hears of.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch

import psclient
from tests.psclient.workers import versioned_writer_forever

N_KEYS = 4000
KILLS = int(os.environ.get("PSC_KILLS", "25"))


@pytest.mark.slow
def test_killed_writer_leaves_no_change_unannounced(store_url: str, table_name: str) -> None:
    ps = psclient.connect(store_url, table=table_name, dim=2, dtype=torch.float64,
                          changes_maxlen=1_000_000)
    try:
        keys = torch.arange(N_KEYS)
        ps.insert(keys, torch.stack([keys.double(), torch.zeros(N_KEYS, dtype=torch.float64)], 1))
        space = torch.arange(2 * N_KEYS)             # the writers' keys: overwrites and new rows
        before = ps.lookup(space)
        _, cursor = ps.changes()
        ctx = mp.get_context("spawn")
        rnd = random.Random(1234)
        missed_rounds = []
        changed_total = 0
        for round_ in range(KILLS):
            ready = ctx.Event()
            proc = ctx.Process(target=versioned_writer_forever,
                               args=(store_url, table_name, N_KEYS, round_, round_ * 1_000_000,
                                     ready))
            proc.start()
            assert ready.wait(60), "the writer never finished a batch"
            time.sleep(rnd.uniform(0.0, 0.3))
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL
            # what a follower at the cursor taken before this writer is told ...
            told: set[int] = set()
            while True:
                got, nxt = ps.changes(cursor, limit=4096)
                told.update(got.tolist())
                if got.numel() == 0 and nxt == cursor:
                    break
                cursor = nxt
            # ... must cover every row that existed before it and differs now
            after = ps.lookup(space)
            assert torch.equal(after[0][after[1], 0], space[after[1]].double()), "a torn row"
            existed = before[1]
            differs = existed & (~after[1] | (after[0][:, 1] != before[0][:, 1]))
            changed = set(space[differs].tolist())
            changed_total += len(changed)
            missed = sorted(changed - told)
            if missed:
                missed_rounds.append((round_, len(missed), len(changed), missed[:5]))
            before = after
        assert changed_total > N_KEYS, "the writers changed too little to test anything"
        assert not missed_rounds, (
            f"after {len(missed_rounds)} of {KILLS} kills, rows that changed were never "
            f"announced on the change feed: (round, missed, changed, e.g.) {missed_rounds}")
    finally:
        ps.drop()
        ps.close()
