"""N replica processes: ONE shared host cache against PRIVATE host caches of the same memory.

For N = 1, 2, 4 spawned replica processes, each runs a Hierarchical ``NVEmbedding``
(private device-side cache -> host cache -> embedded ``file://`` parameter server) on its
own Zipf-1.05 key stream over the same popularity (one node, one population of keys):

* ``shared``: one ``HostCache`` of capacity C that every replica attaches;
* ``private`` (the baseline): N ``HostCache`` s of capacity C / N, one per replica, so the
  host tier holds the same total memory.

Each configuration warms up, then measures for a fixed time: aggregate lookups/s (keys/s
over all replicas), per-tier hit rates over the measured window, and memory from ``/proc``
(each replica's unique set size and its RSS / PSS of the host segments; the segments'
resident bytes from their /dev/shm files). A line per configuration, then the
shared/private ratio per N. On a machine with CUDA the same runs again with
``device="cuda"``, replica r on GPU ``r % device_count`` (one replica per GPU on a
multi-GPU machine; ``--devices cuda`` skips the CPU runs).

Replicas use one torch thread each and stay alive across configurations (spawned once).
Each configuration runs ``--rounds`` times (shared and private alternating, each round
with fresh caches) and the median round is reported, since a shared 2-core machine drifts.
``--quick`` runs in about half a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
import time
import uuid
from typing import Any

import torch

from hostcache import HostCache
from nvecache.apps.demo.memory import process_memory, segment_resident_bytes

CTX = mp.get_context("spawn")
results: list[dict[str, Any]] = []


def emit(rec: dict[str, Any]) -> None:
    results.append(rec)
    print(json.dumps(rec), flush=True)


# -- the replica process ----------------------------------------------------------------------


def replica(rank: int, ps_url: str, table: str, commands: Any, replies: Any) -> None:
    """Replica body: runs configurations sent on ``commands`` until ``None`` arrives."""
    from gpu import LayerType, NVEmbedding
    from nvecache.apps.demo.workload import ZipfKeys
    from psclient import connect

    torch.set_num_threads(1)
    ps = connect(ps_url, table=table)
    replies.put(("up", rank))
    while (spec := commands.get()) is not None:
        device = torch.device(spec["device"])
        if device.type == "cuda" and device.index is None:  # one replica per GPU
            device = torch.device("cuda", rank % torch.cuda.device_count())
        hc = HostCache.attach(spec["cache"])
        emb = NVEmbedding(ps.size(), ps.dim, torch.float32, LayerType.Hierarchical,
                          gpu_cache_size=spec["gpu_cache_bytes"], host_cache=hc, storage=ps,
                          device=device)
        keys = ZipfKeys(spec["num_keys"], spec["alpha"], popularity_seed=0,
                        seed=1000 * spec["run"] + rank)
        # NOTE: fresh draws every batch: cycling through a few pre-drawn batches would shrink
        # the working set to what they hold and inflate every hit rate
        batch = spec["batch"]
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        replies.put(("ready", rank))
        commands.get()  # go
        t0 = time.monotonic()
        while time.monotonic() - t0 < spec["warm_s"]:
            emb(keys.sample(batch).to(device))
        sync()
        before = emb.stats()
        n = 0
        t1 = time.monotonic()
        while time.monotonic() - t1 < spec["measure_s"]:
            emb(keys.sample(batch).to(device))
            n += batch
        sync()
        elapsed = time.monotonic() - t1
        after = emb.stats()
        mem = process_memory("self", [spec["cache"]])
        replies.put(("done", rank, {
            "keys": n, "elapsed_s": elapsed, "gpu": _delta(before, after, "gpu"),
            "host": _delta(before, after, "host"), "ps": _delta(before, after, "storage"),
            "uss": mem.uss,
            "segment_rss": sum(m.rss for m in mem.segments),
            "segment_pss": sum(m.pss for m in mem.segments),
        }))
        commands.get()  # release: every replica measured its memory while all were mapped
        emb.close()
        hc.close()
    ps.close()


def _delta(before: Any, after: Any, tier: str) -> tuple[int, int]:
    """(hits, misses) of one tier between two ``layer.stats()``."""
    a, b = getattr(after, tier), getattr(before, tier)
    return a.hits - b.hits, a.misses - b.misses


class Pool:
    """N replica processes, spawned once, each with its own command queue."""

    def __init__(self, n: int, ps_url: str, table: str) -> None:
        self.replies = CTX.Queue()
        self.commands = [CTX.Queue() for _ in range(n)]
        self.procs = [CTX.Process(target=replica, args=(r, ps_url, table, self.commands[r],
                                                        self.replies), daemon=True)
                      for r in range(n)]
        for p in self.procs:
            p.start()
        self._collect("up", n)

    def _collect(self, kind: str, n: int) -> list[Any]:
        got: list[Any] = [None] * n
        for _ in range(n):
            msg = self.replies.get(timeout=300)
            if msg[0] != kind:
                raise RuntimeError(f"replica {msg[1]} sent {msg[0]!r}, expected {kind!r}")
            got[msg[1]] = msg[2] if len(msg) > 2 else True
        return got

    def run(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run one configuration on the first len(specs) replicas; their results."""
        n = len(specs)
        for r, spec in enumerate(specs):
            self.commands[r].put(spec)
        self._collect("ready", n)
        for r in range(n):
            self.commands[r].put("go")
        out = self._collect("done", n)
        return out

    def release(self, n: int) -> None:
        for r in range(n):
            self.commands[r].put("release")

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


# -- the benchmark ----------------------------------------------------------------------------


def rate(hm: tuple[int, int]) -> float | None:
    return hm[0] / (hm[0] + hm[1]) if hm[0] + hm[1] else None


def configuration(pool: Pool, *, device: str, n: int, mode: str, run: int,
                  args: argparse.Namespace, capacity: int) -> dict[str, Any]:
    prefix = f"bench-rep-{uuid.uuid4().hex[:8]}"
    names = [prefix] if mode == "shared" else [f"{prefix}-{r}" for r in range(n)]
    per_cache = capacity if mode == "shared" else capacity // n
    caches = [HostCache.create(name, capacity=per_cache, dim=args.dim) for name in names]
    try:
        spec = {"device": device, "gpu_cache_bytes": args.gpu_cache_kib << 10,
                "num_keys": args.rows, "alpha": args.alpha, "batch": args.batch,
                "warm_s": args.warm, "measure_s": args.seconds, "run": run}
        specs = [{**spec, "cache": names[0] if mode == "shared" else names[r]}
                 for r in range(n)]
        got = pool.run(specs)
        resident = sum(segment_resident_bytes(name) for name in names)
        pool.release(n)
    finally:
        for c in caches:
            c.close()
            HostCache.unlink(c.name)

    def total(tier: str) -> tuple[int, int]:
        return sum(g[tier][0] for g in got), sum(g[tier][1] for g in got)

    return {
        "bench": "replicas", "device": device, "replicas": n, "mode": mode,
        "gpus": min(n, torch.cuda.device_count()) if device == "cuda" else 0,
        "host_capacity_total": per_cache * len(names), "host_capacity_per_cache": per_cache,
        "keys_per_s": sum(g["keys"] / g["elapsed_s"] for g in got),
        "hit_rate_gpu": rate(total("gpu")), "hit_rate_host": rate(total("host")),
        "hit_rate_ps": rate(total("ps")),
        # keys that went all the way to the parameter server, per key looked up
        "ps_fraction": sum(total("ps")) / max(1, sum(total("gpu"))),
        "host_resident_bytes": resident,
        "replica_uss_bytes": [g["uss"] for g in got],
        "replica_segment_rss_bytes": [g["segment_rss"] for g in got],
        "replica_segment_pss_bytes": [g["segment_pss"] for g in got],
        "rows": args.rows, "dim": args.dim, "alpha": args.alpha, "batch": args.batch,
        "measure_s": args.seconds,
    }


def median_record(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median lookups/s, plus every round's lookups/s."""
    ordered = sorted(recs, key=lambda r: r["keys_per_s"])
    mid = dict(ordered[(len(ordered) - 1) // 2])
    mid["keys_per_s_rounds"] = [r["keys_per_s"] for r in recs]
    mid["hit_rate_host_rounds"] = [r["hit_rate_host"] for r in recs]
    return mid


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small table, short runs")
    p.add_argument("--replicas", default="1,2,4", help="replica counts (default 1,2,4)")
    p.add_argument("--rows", type=int, help="keys in the table (default 500k; quick 200k)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--devices", default="cpu,cuda",
                   help="device kinds to run (default cpu,cuda; cuda only where available)")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--batch", type=int, default=8192, help="keys per lookup")
    p.add_argument("--host-fraction", type=float, default=0.2,
                   help="total host cache capacity, fraction of the table (default 0.2)")
    p.add_argument("--gpu-cache-kib", type=int, default=1024,
                   help="private device cache per replica, KiB (default 1024)")
    p.add_argument("--warm", type=float, help="warm-up seconds (default 4; quick 1.5)")
    p.add_argument("--seconds", type=float, help="measured seconds (default 5; quick 1.5)")
    p.add_argument("--rounds", type=int,
                   help="rounds per configuration, shared and private alternating; the median "
                        "round is reported (default 3; quick 1)")
    args = p.parse_args()
    args.rows = args.rows or (200_000 if args.quick else 500_000)
    args.warm = args.warm if args.warm is not None else (1.5 if args.quick else 4.0)
    args.seconds = args.seconds if args.seconds is not None else (1.5 if args.quick else 5.0)
    args.rounds = args.rounds or (1 if args.quick else 3)
    counts = [int(x) for x in args.replicas.split(",")]
    devices = [d for d in args.devices.split(",") if d != "cuda" or torch.cuda.is_available()]
    capacity = int(args.rows * args.host_fraction)

    from psclient import connect

    state = tempfile.mkdtemp(prefix="bench-replicas-")
    ps_url = f"file://{state}/ps"
    table = "bench_replicas"
    try:
        ps = connect(ps_url, table=table, dim=args.dim, dtype=torch.float32)
        ps.load(torch.randn(args.rows, args.dim, generator=torch.Generator().manual_seed(0)),
                progress=False)
        ps.close()
        pool = Pool(max(counts), ps_url, table)
        try:
            run = 0
            for device in devices:
                for n in counts:
                    rounds: dict[str, list[dict[str, Any]]] = {"shared": [], "private": []}
                    for r in range(args.rounds):  # alternate the order: drift hits both
                        for mode in ("shared", "private") if r % 2 == 0 else ("private",
                                                                               "shared"):
                            run += 1
                            rounds[mode].append(configuration(
                                pool, device=device, n=n, mode=mode, run=run, args=args,
                                capacity=capacity))
                    pair = {mode: median_record(recs) for mode, recs in rounds.items()}
                    for rec in pair.values():
                        emit(rec)
                    s, q = pair["shared"], pair["private"]
                    emit({"bench": "replicas_ratio", "device": device, "replicas": n,
                          "keys_per_s_ratio": s["keys_per_s"] / q["keys_per_s"],
                          "hit_rate_host_shared": s["hit_rate_host"],
                          "hit_rate_host_private": q["hit_rate_host"],
                          "ps_fraction_private_over_shared": q["ps_fraction"]
                          / max(1e-12, s["ps_fraction"]),
                          "host_resident_ratio": s["host_resident_bytes"]
                          / max(1, q["host_resident_bytes"]),
                          "rounds": args.rounds})
        finally:
            pool.close()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    summary(args)


def summary(args: argparse.Namespace) -> None:
    print(f"\nreplicas: shared vs private host caches of the same total memory "
          f"({args.rows:,} keys x dim {args.dim}, Zipf {args.alpha:g}, host capacity "
          f"{args.host_fraction:.0%} of the keys, device cache {args.gpu_cache_kib} KiB per "
          f"replica, batch {args.batch:,}; {os.cpu_count()} CPUs, {platform.machine()})")
    print(f"{'device':6} {'N':>2} {'mode':8} {'Mkeys/s':>8} {'device hit':>10} "
          f"{'host hit':>9} {'host MiB':>9} {'USS MiB/replica':>16}")
    for r in results:
        if r["bench"] != "replicas":
            continue
        uss = sum(r["replica_uss_bytes"]) / len(r["replica_uss_bytes"]) / 2**20
        print(f"{r['device']:6} {r['replicas']:>2} {r['mode']:8} {r['keys_per_s'] / 1e6:8.3f} "
              f"{100 * (r['hit_rate_gpu'] or 0):9.1f}% {100 * (r['hit_rate_host'] or 0):8.1f}% "
              f"{r['host_resident_bytes'] / 2**20:9.1f} {uss:16.1f}")
    for r in results:
        if r["bench"] == "replicas_ratio":
            print(f"{r['device']:6} {r['replicas']:>2} shared/private: lookups/s x"
                  f"{r['keys_per_s_ratio']:.2f}, host hit rate "
                  f"{100 * (r['hit_rate_host_shared'] or 0):.1f}% vs "
                  f"{100 * (r['hit_rate_host_private'] or 0):.1f}%, keys to the parameter "
                  f"server x{1 / r['ps_fraction_private_over_shared']:.2f}")


if __name__ == "__main__":
    main()
