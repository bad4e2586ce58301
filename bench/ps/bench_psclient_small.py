"""Small parameter-server lookups over Redis: p50 and p99 per call at 1 to 4,096 keys.

A serving process's Hierarchical lookup asks the parameter server for its few misses, so
at these sizes a Redis lookup's host time (encoding, the pool, decoding) weighs as much as
the round trip. One table of 200k x 128 fp32 rows in the given Redis; per size, distinct
uniform keys (16 batches cycled), ``lookup``, ``lookup_stored`` and ``lookup`` with 10% of
the keys absent; then the Python function calls per lookup (cProfile) at 1, 64 and 1,024
keys. ``--root DIR`` also times another checkout (the tree before a change, from ``git
archive``) in alternating rounds, each in its own process: the table is the same, the
figures are medians over the rounds. Run: ``python bench/ps/bench_psclient_small.py [--url
redis://127.0.0.1:6379/0] [--root DIR] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROWS = 200_000
SIZES = (1, 64, 256, 1024, 2048, 4096)

ROUND = r"""
import cProfile, json, pstats, sys, time
root, url, table, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sizes = [int(v) for v in sys.argv[5].split(",")]
sys.path.insert(0, root)
import numpy as np, torch
import psclient
ps = psclient.connect(url, table=table, dim=128, dtype=torch.float32)
if ps.size() != rows:
    ps.clear()
    keys = torch.arange(rows)
    vals = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    for i in range(0, rows, 8192):
        ps.insert(keys[i:i + 8192], vals[i:i + 8192])
rng = np.random.default_rng(7)
def batches(n, miss):
    out = []
    for _ in range(16):
        k = rng.choice(rows, n, replace=False).astype(np.int64)
        k[rng.random(n) < miss] += rows  # NOTE: absent keys
        out.append(torch.from_numpy(k))
    return out
def timed(fn, bs, reps):
    for b in bs[:4]:
        fn(b)
    ts = []
    for i in range(reps):
        t = time.perf_counter(); fn(bs[i % 16]); ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e6, ts[int(len(ts) * 0.99)] * 1e6
got, calls = {}, {}
for n in sizes:
    reps = 400 if n <= 256 else 200 if n <= 2048 else 100
    for name, miss in (("lookup", 0.0), ("lookup_stored", 0.0), ("lookup_10pct_miss", 0.1)):
        fn = ps.lookup_stored if name == "lookup_stored" else ps.lookup
        got[f"{name}/{n}"] = timed(fn, batches(n, miss), reps)
for n in (1, 64, 1024):
    b = batches(n, 0.0)[0]
    pr = cProfile.Profile(); pr.enable()
    for _ in range(50):
        ps.lookup(b)
    pr.disable()
    calls[n] = pstats.Stats(pr).total_calls / 50
ps.close()
print(json.dumps({"pkg": psclient.__file__, "t": got, "calls": calls}))
"""


def one_round(root: str, url: str, table: str) -> dict:
    done = subprocess.run([sys.executable, "-c", ROUND, root, url, table, str(ROWS),
                           ",".join(map(str, SIZES))],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": root})
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["pkg"].startswith(root), res["pkg"]  # NOTE: the checkout asked for
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--root", help="also time this checkout, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[2])
    roots = {"this": here, **({"other": str(Path(args.root).resolve())} if args.root else {})}
    table = f"bench-small-{os.getpid()}"
    runs: dict[str, list[dict]] = {k: [] for k in roots}
    try:
        for _ in range(args.rounds):
            for label, root in roots.items():
                runs[label].append(one_round(root, args.url, table))
    finally:
        sys.path.insert(0, here)
        import psclient

        with psclient.connect(args.url, table=table) as ps:
            ps.drop()
    for case in runs["this"][0]["t"]:
        line = {"bench": "psclient_small", "case": case}
        for label, rs in runs.items():
            line[f"{label}_p50_us"] = round(statistics.median(r["t"][case][0] for r in rs), 1)
            line[f"{label}_p99_us"] = round(statistics.median(r["t"][case][1] for r in rs), 1)
        if "other" in runs:
            line["ratio_this_over_other"] = round(line["this_p50_us"] / line["other_p50_us"], 2)
        print(json.dumps(line))
    for label, rs in runs.items():
        print(json.dumps({"bench": "psclient_small", "root": label,
                          "calls_per_lookup": rs[-1]["calls"]}))


if __name__ == "__main__":
    main()
