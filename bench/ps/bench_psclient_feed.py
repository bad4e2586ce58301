"""The atomic change feed's price and speed: write paths before/after, follow wake-up latency.

Write paths (one Redis, ``--url``): psclient's layout-2 writes (one Lua step per partition
chunk: rows and the feed record together, :mod:`psclient.redis.scripts`) against the layout-1
path they replaced, kept here only to be measured: the same pre-encoded commands through the
same dispatcher (``HSET`` / the ``HEXISTS`` update script / ``HDEL`` per chunk), then a
separate ``XADD`` pipeline of the changed keys (insert: every key of a chunk where ``HSET``
created fewer fields than sent). Also a Lua insert that sends one bulk ``HSET`` and notices
every key of a chunk that overwrote anything (``bulk``: cheaper, a superset). The variants
alternate in rounds on the same table; each figure is the median over the rounds of the best
of ``reps``.

Wake-up latency: a follower process blocks in ``follow(cursor, block_ms=2000)``; the writer
updates one key at random 5-25 ms intervals; latency = the follower's return minus the
writer's ``update()`` return (one machine, one clock; it can be negative: the follower can
wake before the writer has read its reply). Standalone Redis and a 3-master cluster
(``--cluster-url``, or one started here from ``redis-server`` on free loopback ports).

    python bench/ps/bench_psclient_feed.py [--quick] [--url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psclient  # noqa: E402
from psclient.codec import group_by_partition  # noqa: E402
from psclient.redis import resp  # noqa: E402
from psclient.redis.dispatch import Cmd  # noqa: E402
from psclient.redis.scripts import _NOTICE  # noqa: E402
from tests.servers import start_cluster  # noqa: E402

_OLD_UPDATE = b"""
local out = {}
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    out[#out + 1] = '1'
  else
    out[#out + 1] = '0'
  end
end
return table.concat(out)
"""

_BULK_INSERT = _NOTICE + b"""
local n = (#ARGV - 1) / 2
if redis.call('HSET', KEYS[1], unpack(ARGV, 2)) < n then
  local ks = {}
  for i = 2, #ARGV, 2 do ks[#ks + 1] = ARGV[i] end
  notice('k', table.concat(ks))
end
return 0
"""


def emit(**rec: object) -> None:
    print(json.dumps(rec), flush=True)


def encode(ps: Any, lead: bytes, nlead: int, tails: list[bytes], keys: np.ndarray,
           values: torch.Tensor | None) -> tuple[np.ndarray, list[Cmd]]:
    """psclient's per-chunk encoding (as RedisParameterServer._batch) with any command."""
    order, bounds = group_by_partition(keys, ps.schema.partitions)
    ks = keys[order]
    if values is None:
        rec, per_key = resp.field_records(ks), 1
    else:
        rows = values.view(torch.uint8).numpy().reshape(keys.size, -1)
        rec, per_key = resp.field_value_records(ks, rows[order]), 2
    raw, size, ck = resp.as_buffer(rec), rec.dtype.itemsize, 512
    cmds = []
    bl = bounds.tolist()
    for p in np.flatnonzero(bounds[1:] > bounds[:-1]).tolist():
        for s in range(bl[p], bl[p + 1], ck):
            e = min(bl[p + 1], s + ck)
            head = b"*%d\r\n%b%b" % (nlead + per_key * (e - s), lead, tails[p])
            cmds.append(Cmd(p, s, e, [head, raw[s * size:e * size]]))
    return ks, cmds


class Layout1:
    """The layout-1 write path: rows by pipelined commands, then a separate XADD."""

    def __init__(self, ps: Any, client: Any) -> None:
        self.ps, self.r = ps, client
        self.stream = f"bench-old-feed:{uuid.uuid4().hex[:8]}"
        self.parts = [resp.bulk(k) for k in ps.part_keys]

    def _feed(self, keys: np.ndarray) -> None:
        keys = np.unique(keys)
        pipe = self.r.pipeline(transaction=False)
        for a in range(0, keys.size, 4096):
            pipe.xadd(self.stream, {"k": keys[a:a + 4096].astype("<i8").tobytes()},
                      maxlen=1000, approximate=True)
        pipe.execute()

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        ks, cmds = encode(self.ps, resp.bulk(b"HSET"), 2, self.parts, keys.numpy(), values)
        added = self.ps._run(cmds)
        changed = [ks[c.start:c.stop] for c, n in zip(cmds, added, strict=True)
                   if int(n) < c.stop - c.start]
        if changed:
            self._feed(np.concatenate(changed))

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        lead = resp.bulk(b"EVAL") + resp.bulk(_OLD_UPDATE) + resp.bulk(b"1")
        ks, cmds = encode(self.ps, lead, 4, self.parts, keys.numpy(), values)
        flags = np.frombuffer(b"".join(self.ps._run(cmds)), dtype=np.uint8) == ord("1")
        if flags.any():
            self._feed(ks[flags])

    def erase(self, keys: torch.Tensor) -> None:
        ks, cmds = encode(self.ps, resp.bulk(b"HDEL"), 2, self.parts, keys.numpy(), None)
        self.ps._run(cmds)
        self._feed(ks)


class BulkInsert:
    """Layout 2 with a bulk-HSET insert script (a superset notice)."""

    def __init__(self, ps: Any) -> None:
        self.ps = ps
        maxlen = resp.bulk(b"1000")
        self.tails = [resp.bulk(k) + resp.bulk(k + b":changes") + resp.bulk(k + b":last")
                      + maxlen for k in ps.part_keys]

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        lead = resp.bulk(b"EVAL") + resp.bulk(_BULK_INSERT) + resp.bulk(b"3")
        _, cmds = encode(self.ps, lead, 7, self.tails, keys.numpy(), values)
        self.ps._run(cmds)


def timed(fn: Any, prep: Any = None) -> float:
    if prep is not None:
        prep()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_writes(url: str, batch: int, dim: int, reps: int, rounds: int) -> None:
    import redis

    rng = np.random.default_rng(0)
    keys = torch.from_numpy(rng.choice(2**40, size=batch, replace=False).astype(np.int64))
    vals = torch.randn(batch, dim)
    table = f"bench-feed-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(url)
    ps = psclient.connect(url, table=table, dim=dim)
    old, bulk = Layout1(ps, r), BulkInsert(ps)
    fresh = iter(range(1, 1 << 30))
    paths: dict[str, dict[str, Any]] = {
        "layout1": {"insert-new": lambda: old.insert(keys + (next(fresh) << 41), vals),
                    "insert-overwrite": lambda: old.insert(keys, vals),
                    "update": lambda: old.update(keys, vals),
                    "erase": lambda: old.erase(keys)},
        "layout2": {"insert-new": lambda: ps.insert(keys + (next(fresh) << 41), vals),
                    "insert-overwrite": lambda: ps.insert(keys, vals),
                    "update": lambda: ps.update(keys, vals),
                    "erase": lambda: ps.erase(keys)},
        "layout2-bulk-insert": {"insert-new": lambda: bulk.insert(keys + (next(fresh) << 41),
                                                                  vals),
                                "insert-overwrite": lambda: bulk.insert(keys, vals)},
    }
    refill = lambda: ps.insert(keys, vals)  # noqa: E731 -- erase needs the rows back
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for op in ("insert-new", "insert-overwrite", "update", "erase"):
            for path, ops in paths.items():
                if op not in ops:
                    continue
                prep = refill if op in ("erase", "update", "insert-overwrite") else None
                best = min(timed(ops[op], prep) for _ in range(reps))
                results.setdefault((path, op), []).append(batch / best)
    for (path, op), rates in results.items():
        base = results.get(("layout1", op))
        emit(bench="psclient-redis-writes", path=path, op=op, rows_per_s=float(np.median(rates)),
             rounds=[round(x) for x in rates],
             vs_layout1_median=(float(np.median(np.array(rates) / np.array(base)))
                                if base and path != "layout1" else None))
    ps.drop()
    r.delete(old.stream)
    r.close()


def _follower(url: str, table: str, cursor: str, out: Any, stop: Any) -> None:
    with psclient.connect(url, table=table) as ps:
        while not stop.is_set():
            b = ps.follow(cursor, block_ms=2000)
            now = time.time_ns()
            cursor = b.cursor
            if b.keys.numel():
                out.send((b.keys.tolist(), now, b.newest_ns))


def bench_wakeup(url: str, kind: str, samples: int) -> None:
    table = f"bench-wake-{uuid.uuid4().hex[:8]}"
    ps = psclient.connect(url, table=table, dim=8)
    ps.insert(torch.arange(samples), torch.zeros(samples, 8))
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    proc = ctx.Process(target=_follower, args=(url, table, ps.follow().cursor, send, stop))
    proc.start()
    time.sleep(3.0)  # NOTE: the follower imports torch and blocks before the first write
    rng = np.random.default_rng(1)
    wrote: dict[int, int] = {}
    seen: dict[int, tuple[int, int]] = {}
    for i in range(samples):
        time.sleep(float(rng.uniform(0.005, 0.025)))
        ps.update(torch.tensor([i]), torch.ones(1, 8))
        wrote[i] = time.time_ns()
        while recv.poll(0):
            ks, t, newest = recv.recv()
            for k in ks:
                seen[k] = (t, newest)
    deadline = time.monotonic() + 5
    while len(seen) < samples and time.monotonic() < deadline:
        if recv.poll(0.1):
            ks, t, newest = recv.recv()
            for k in ks:
                seen[k] = (t, newest)
    stop.set()
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    if not seen:
        emit(bench="psclient-follow-wakeup", store=kind, samples=0, error="no wake-up seen")
        return
    lat = np.array([(seen[i][0] - wrote[i]) / 1e6 for i in wrote if i in seen])
    lag = np.array([(seen[i][0] - seen[i][1]) / 1e6 for i in wrote if i in seen])
    emit(bench="psclient-follow-wakeup", store=kind, samples=len(lat), missing=samples - len(lat),
         p50_ms=float(np.percentile(lat, 50)), p99_ms=float(np.percentile(lat, 99)),
         max_ms=float(lat.max()),
         commit_to_return_p50_ms=float(np.percentile(lag, 50)),
         commit_to_return_p99_ms=float(np.percentile(lag, 99)),
         note="follower return minus writer's update() return; commit_to_return: minus the "
              "entry's server TIME (FeedBatch.newest_ns)")
    ps.drop()
    ps.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--url", default=os.environ.get("NVEC_BENCH_REDIS_URL",
                                                    "redis://127.0.0.1:6379/0"))
    ap.add_argument("--cluster-url", default=None)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--skip-writes", action="store_true", help="only the wake-up latency")
    a = ap.parse_args()
    emit(bench="config", batch=a.batch, dim=a.dim, cpus=os.cpu_count(),
         date=time.strftime("%Y-%m-%d"))
    if not a.skip_writes:
        bench_writes(a.url, a.batch, a.dim, 2 if a.quick else 4, 3 if a.quick else 6)
    samples = 100 if a.quick else 300
    bench_wakeup(a.url, "redis", samples)
    if a.cluster_url:
        bench_wakeup(a.cluster_url, "redis-cluster", samples)
        return
    with tempfile.TemporaryDirectory() as tmp:
        url, nodes = start_cluster(Path(tmp))
        try:
            bench_wakeup(url, "redis-cluster (3 masters, started here)", samples)
        finally:
            for n in nodes:
                n.kill()


if __name__ == "__main__":
    main()
