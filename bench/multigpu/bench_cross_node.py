"""Cross-node propagation: an update acknowledged on node A, served by node B's replicas.

Two nodes on one machine (hostcache node namespaces), one parameter server (standalone
Redis, and a 3-master Redis Cluster started for the run when ``redis-server`` is here). For
each update rate, a writer on node A updates rows through a Hierarchical layer; node B's
service follows the feed; a prober on B records when each watched update is first served, a
replica on B looks random keys up. One JSON line per run: propagation p50 / p99 / max (from
``update()`` returning on A to B serving the new row), the rate the writer reached, node B's
lookup throughput, updates never served and wrong rows (both must be 0).

Usage: ``python bench/multigpu/bench_cross_node.py [--quick] [--redis-url URL] [--no-cluster]``
(goals, issue 17: p99 <= 50 ms at 10k rows/s and <= 200 ms at 100k rows/s).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.multigpu import cross_node  # noqa: E402
from tests.servers import REDIS_SERVER, RedisProc, start_cluster  # noqa: E402


def measure(url: str, backend: str, rate: float, seconds: float) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="xnode-"))
    try:
        res = cross_node.run(url, root, table=f"xn-{uuid.uuid4().hex[:8]}", rate=rate,
                             seconds=seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ms = 1e3
    return {"bench": "cross_node", "backend": backend, "target_rows_per_s": rate,
            "rows_per_s": round(res.rows_per_s), "updates_watched": int(res.lags_s.size),
            "p50_ms": round(res.percentile(50) * ms, 2),
            "p99_ms": round(res.percentile(99) * ms, 2),
            "max_ms": round(float(res.lags_s.max()) * ms, 2) if res.lags_s.size else None,
            "b_lookup_keys_per_s": round(res.b_keys_per_s), "unseen": res.unseen,
            "bad_rows": res.bad_rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs (seconds)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--no-cluster", action="store_true", help="standalone Redis only")
    args = ap.parse_args()
    seconds = 3.0 if args.quick else 15.0
    rates = [10_000.0] if args.quick else [10_000.0, 100_000.0]
    targets = [("redis", args.redis_url)]
    cluster: list[RedisProc] = []
    root = Path(tempfile.mkdtemp(prefix="xnode-cluster-"))
    try:
        if not args.no_cluster and REDIS_SERVER:
            url, cluster = start_cluster(root)
            targets.append(("redis-cluster", url))
        for backend, url in targets:
            for rate in rates:
                t0 = time.monotonic()
                rec = measure(url, backend, rate, seconds)
                rec["wall_s"] = round(time.monotonic() - t0, 1)
                print(json.dumps(rec), flush=True)
    finally:
        for n in cluster:
            n.kill()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
