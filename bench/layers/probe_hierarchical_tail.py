"""What the slow calls of a Hierarchical layer did: each call of bench_hierarchical's
``file://`` workload (1M x 128 fp32 rows, GPU cache 5%, host cache 20%, fresh Zipf 1.05
batches, default arguments, a sync after each call) timed and tagged with the admission
work it queued (a whole round, or a split round's start / bucket sort / table half), the
time its steps took (the misses' reads, and inside them the host-cache and parameter-server
resolve, the GPU's read of the host cache, stream syncs, the pinned copies, the worker
submissions; the offer), and how long the host-cache worker ran during it. Prints one JSON
line per batch size: percentiles, the calls by what they queued, each step's mean, the
slowest calls with their steps. Timed once the per-key loops are compiled
(``twin_calls_timed``: calls their numpy twins answered while timed).

Works on older checkouts too (the tags it cannot find are never set): run it from the
tree to measure, on a CUDA machine::

    python bench/layers/probe_hierarchical_tail.py [--sizes 4096,65536] [--calls 600] \
        [--no-gc] [--switch-interval S] [--host-share P] [--sample-ms MS] \
        [--no-split] [--torch-threads N] [--worker-threads N]

``--sample-ms MS`` starts a thread that, every MS milliseconds while a call runs, notes
where the calling thread and every other live thread of the process stand (innermost
frame of this project or torch, ``sys._current_frames``); the slowest calls then list their
most frequent places. It perturbs the timings (the sampler takes the GIL): for finding
what a slow call waits on, not for figures.

``--no-gc`` and ``--switch-interval`` test two suspects of the slow calls: a collection of
Python's cyclic garbage collector, and the GIL handed back to the lookup only after the
interpreter's switch interval when the host-cache worker holds it; ``--host-share`` gives
the worker fewer fills (not the default: for finding the cause, not for figures).

Every call also records what the OS did meanwhile (``os`` in the slowest calls, and
``os_mean`` over all calls and over the slowest 1%): the process's minor / major page faults
and involuntary context switches, the calling thread's, the process's CPU time, and the
cgroup's CPU throttling (``nr_throttled``, ``throttled_usec`` of ``cpu.stat``, where the
machine has one): a call stalled by a CPU quota, by faults or by preemption shows there.

``--no-split`` and ``--torch-threads`` test the suspects the sampler pointed at (the slow
64k calls spend their time in the row mirror's read, its chunks on the
``nvecache.common.fanout`` pool's threads, while the worker fills): ``--no-split`` reads
every batch of the row mirror and the host cache on the calling thread alone;
``--torch-threads N`` sets ``torch.set_num_threads(N)`` (the intra-op threads the worker's
CPU tensor operations may fan out to, competing with those readers for cores);
``--worker-threads N`` sets it on the host-cache worker's thread alone (with OpenMP the
intra-op team size is a per-thread setting; the calling thread keeps its own, reported as
``torch_threads``): which thread's fan-out matters.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psclient  # noqa: E402
from bench.workloads import ZipfKeys  # noqa: E402

try:  # NOTE: an older tree's bench/workloads.py lacks it
    from bench.workloads import compiled_loops  # noqa: E402
except ImportError:
    compiled_loops = None  # type: ignore[assignment]
from gpu import InsertPolicy, LayerType, NVEmbedding  # noqa: E402
from hostcache import HostCache  # noqa: E402

DIM = 128


class Tags:
    """What the current call did, set by the wrapped methods (the calling thread only);
    the worker's busy intervals."""

    def __init__(self) -> None:
        self.call: dict[str, float] = {}
        self.main = threading.get_ident()
        self.worker: list[tuple[float, float]] = []

    def add(self, tag: str, seconds: float = 0.0) -> None:
        if threading.get_ident() == self.main:
            self.call[tag] = self.call.get(tag, 0.0) + seconds


class OsCounters:
    """Counters the OS keeps that a stalled call moves: page faults, preemptions, CPU time,
    the cgroup's CPU throttling (cgroup v2's ``cpu.stat`` or v1's, when readable)."""

    STAT_FILES = ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat",
                  "/sys/fs/cgroup/cpu,cpuacct/cpu.stat")

    def __init__(self) -> None:
        self.stat = next((p for p in self.STAT_FILES if os.access(p, os.R_OK)), None)

    def _cgroup(self) -> dict[str, float]:
        if self.stat is None:
            return {}
        out = {}
        with open(self.stat) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "nr_throttled":
                    out[k] = float(v)
                elif k == "throttled_usec":
                    out["throttled_us"] = float(v)
                elif k == "throttled_time":  # NOTE: cgroup v1, nanoseconds
                    out["throttled_us"] = float(v) / 1e3
        return out

    def snapshot(self) -> dict[str, float]:
        p = resource.getrusage(resource.RUSAGE_SELF)
        t = resource.getrusage(resource.RUSAGE_THREAD)
        return {"minflt": p.ru_minflt, "majflt": p.ru_majflt, "nivcsw": p.ru_nivcsw,
                "main_nivcsw": t.ru_nivcsw, "main_nvcsw": t.ru_nvcsw,
                "cpu_us": (p.ru_utime + p.ru_stime) * 1e6, **self._cgroup()}

    @staticmethod
    def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: round(b[k] - a[k], 1) for k in a if k in b}


def place(frame: Any) -> str:
    """The innermost frame of this project (or torch, numpy) on a thread's stack, as
    ``file:line function``, with the frame above it."""
    root = str(Path(__file__).resolve().parents[2])
    names = []
    f = frame
    while f is not None and len(names) < 2:
        path = f.f_code.co_filename
        if path.startswith(root) or "torch" in path or "numpy" in path or "threading" in path:
            short = path[len(root) + 1:] if path.startswith(root) else path.rsplit("/", 2)[-1]
            names.append(f"{short}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    return " < ".join(names) or "?"


class Sampler:
    """Every ``period`` seconds, while ``busy`` is set, where each live thread stands
    (by thread name; the calling thread as ``main``), counted per call."""

    def __init__(self, tags: Tags, period: float) -> None:
        self.tags, self.period = tags, period
        self.busy = threading.Event()
        self.samples: collections.Counter[str] = collections.Counter()
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="probe-sampler", daemon=True)
        self.thread.start()

    def begin(self) -> None:
        self.samples = collections.Counter()
        self.busy.set()

    def end(self) -> collections.Counter[str]:
        self.busy.clear()
        return self.samples

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop:
            self.busy.wait()
            time.sleep(self.period)
            if not self.busy.is_set():
                continue
            names = {t.ident: t.name for t in threading.enumerate()}
            counts = self.samples
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                who = "main" if ident == self.tags.main else names.get(ident, "?")
                where = place(frame)
                if who != "main" and where.startswith("threading.py"):
                    continue  # NOTE: an idle thread waiting for work
                counts[f"{who}: {where}"] += 1

    def close(self) -> None:
        self._stop = True
        self.busy.set()


def wrap(cls: Any, name: str, tags: Tags, tag: str | Callable[[Any], str | None],
         worker: bool = False) -> None:
    """Wrap ``cls.name`` (if it exists) to tag the call, time it, or (``worker``) record
    its interval on the host-cache worker."""
    fn = getattr(cls, name, None)
    if fn is None:
        return

    def wrapped(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*a, **k)
        t1 = time.perf_counter()
        if worker:
            tags.worker.append((t0, t1))
        else:
            label = tag(out) if callable(tag) else tag
            if label:
                tags.add(label, t1 - t0)
        return out

    setattr(cls, name, wrapped)


#: the steps inside a call's reads, timed (not tags of what the call queued)
STEPS = ("offer", "reads", "resolve", "read_ps", "gpu_read", "stream_sync", "send", "submit")


def instrument(tags: Tags) -> None:
    from gpu.kernels import host_reads
    from gpu.stacks.misses import admission, host_filler, read_paths, resolver, staging

    wrap(admission.PendingAdmissions, "_round", tags, "round")
    wrap(admission.PendingAdmissions, "_insert", tags, "own_round")
    wrap(admission.PendingAdmissions, "offer", tags, "offer")
    wrap(read_paths.HostReads, "serve", tags, "reads")
    wrap(read_paths.DeviceReads, "serve", tags, "reads")
    wrap(resolver.Resolver, "resolve", tags, "resolve")
    wrap(resolver.Resolver, "read_ps", tags, "read_ps")
    wrap(host_reads, "hostcache_lookup", tags, "gpu_read")  # NOTE: imported at each call
    wrap(torch.cuda.Stream, "synchronize", tags, "stream_sync")
    wrap(staging.PinnedStaging, "send", tags, "send")
    wrap(host_filler.HostFiller, "submit", tags, "submit")
    wrap(resolver.Resolver, "_fill", tags, "", worker=True)
    wrap(resolver.Resolver, "_report_hits", tags, "", worker=True)
    try:
        from gpu.stacks.misses import split_round
    except ImportError:
        return
    wrap(split_round.SplitRound, "start", tags, "split_start")
    wrap(split_round.SplitRound, "poll", tags, lambda applied: "split_apply" if applied
         else None)


def pct(ts: list[float], q: float) -> float:
    return ts[min(len(ts) - 1, int(len(ts) * q))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="4096,65536")
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the probe itself")
    ap.add_argument("--no-gc", action="store_true",
                    help="Python's cyclic garbage collector off while calls are timed")
    ap.add_argument("--host-share", type=float, default=None, metavar="P",
                    help="InsertPolicy(host=P): admit a fraction P of the parameter "
                         "server's rows to the host cache (the worker's fills; default: "
                         "the layer's default, every row)")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="sys.setswitchinterval(S) (the GIL's hand-over interval, 5 ms by "
                         "default) for the whole run")
    ap.add_argument("--sample-ms", type=float, default=None, metavar="MS",
                    help="note every MS ms where each thread stands while a call runs "
                         "(the slowest calls then list their most frequent places)")
    ap.add_argument("--no-split", action="store_true",
                    help="the row mirror's and the host cache's reads on the calling thread "
                         "alone (not split over the fanout pool)")
    ap.add_argument("--torch-threads", type=int, default=None, metavar="N",
                    help="torch.set_num_threads(N) for the whole run")
    ap.add_argument("--worker-threads", type=int, default=None, metavar="N",
                    help="torch.set_num_threads(N) on the host-cache worker's thread only")
    args = ap.parse_args(argv)
    worker_threads: list[int] = []
    if args.worker_threads is not None:
        from gpu.stacks.misses import host_filler

        run = host_filler._Worker._run

        def run_narrow(self: Any) -> None:
            torch.set_num_threads(args.worker_threads)
            worker_threads.append(torch.get_num_threads())
            run(self)

        host_filler._Worker._run = run_narrow  # type: ignore[method-assign]
    if args.no_split:
        from hostcache import cache as host_cache_module
        from psclient.file import mirror as mirror_module

        def alone(fn: Callable[[int, int], Any], n: int, min_chunk: int = 0) -> list[Any]:
            return [fn(0, n)]

        host_cache_module.split_run = alone  # type: ignore[assignment]
        mirror_module.split_run = alone  # type: ignore[assignment]
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("probe_hierarchical_tail needs a CUDA GPU", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = args.rows
    tags = Tags()
    counters = OsCounters()
    instrument(tags)
    sampler = None if args.sample_ms is None else Sampler(tags, args.sample_ms / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        table = f"probe-tail-{os.getpid()}"
        ps = psclient.connect(f"file://{tmp}/ps", table=table, dim=DIM, dtype=torch.float32)
        ps.load(torch.randn(rows, DIM, generator=torch.Generator().manual_seed(1)),
                progress=False)
        hc = HostCache.create(table, capacity=rows // 5, dim=DIM)
        try:
            policy = ({} if args.host_share is None
                      else {"insert_policy": InsertPolicy(host=args.host_share)})
            emb = NVEmbedding(rows, DIM, torch.float32, LayerType.Hierarchical,
                              gpu_cache_size=rows // 20 * (DIM * 4 + 12), host_cache=hc,
                              storage=ps, device=dev, **policy)
            z = ZipfKeys(rows, 1.05, seed=4)
            for n in [int(s) for s in args.sizes.split(",")]:
                for _ in range(max(1, (16 << 20) // n)):
                    emb(z.sample(n).to(dev))
                batches = [z.sample(n).to(dev) for _ in range(args.calls)]
                twins = compiled_loops() if compiled_loops is not None else 0
                sync()
                calls = []
                tags.worker.clear()
                if args.no_gc:
                    gc.collect()
                    gc.disable()
                for b in batches:
                    tags.call = {}
                    if sampler is not None:
                        sampler.begin()
                    c0 = counters.snapshot()
                    t0 = time.perf_counter()
                    emb(b)
                    sync()
                    t1 = time.perf_counter()
                    tags.call["os"] = counters.delta(c0, counters.snapshot())
                    if sampler is not None:
                        tags.call = {**tags.call, "@": sampler.end()}
                    calls.append((t1 - t0, t0, t1, tags.call))
                gc.enable()
                worker = list(tags.worker)
                twins = compiled_loops() - twins if compiled_loops is not None else None
                report(n, calls, worker, {"no_gc": args.no_gc,
                                          "switch_interval_s": sys.getswitchinterval(),
                                          "host_share": args.host_share,
                                          "no_split": args.no_split,
                                          "torch_threads": torch.get_num_threads(),
                                          "worker_threads": worker_threads[-1:],
                                          "twin_calls_timed": twins})
            emb.close()
        finally:
            if sampler is not None:
                sampler.close()
            hc.close()
            HostCache.unlink(table)
            ps.drop()
            ps.close()
    return 0


def os_mean(calls: list[tuple[float, float, float, dict[str, Any]]]) -> dict[str, float]:
    """Each OS counter's mean change per call over ``calls``."""
    keys = calls[0][3].get("os", {}).keys() if calls else ()
    return {k: round(statistics.mean(c[3]["os"][k] for c in calls), 2) for k in keys}


def report(n: int, calls: list[tuple[float, float, float, dict[str, float]]],
           worker: list[tuple[float, float]], setup: dict[str, Any]) -> None:
    def overlap(t0: float, t1: float) -> float:
        return sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in worker)

    ts = sorted(c[0] for c in calls)
    kinds: dict[str, list[float]] = {}
    for dt, _, _, tg in calls:
        kind = "+".join(sorted(k for k in tg if k not in STEPS and k not in ("@", "os"))) \
            or "plain"
        kinds.setdefault(kind, []).append(dt)
    slow = sorted(calls, key=lambda c: -c[0])[:12]
    print(json.dumps({
        "bench": "hierarchical_tail", "batch": n, "calls": len(calls), **setup,
        "p50_us": pct(ts, 0.5) * 1e6, "p90_us": pct(ts, 0.9) * 1e6,
        "p99_us": pct(ts, 0.99) * 1e6,
        "by_kind_us": {k: {"calls": len(v), "p50": statistics.median(v) * 1e6,
                           "max": max(v) * 1e6} for k, v in sorted(kinds.items())},
        "mean_offer_us": statistics.mean(c[3].get("offer", 0.0) for c in calls) * 1e6,
        "mean_reads_us": statistics.mean(c[3].get("reads", 0.0) for c in calls) * 1e6,
        "mean_step_us": {k: statistics.mean(c[3].get(k, 0.0) for c in calls) * 1e6
                         for k in STEPS},
        "os_mean": {"all": os_mean(calls),
                    "slowest_1pct": os_mean(sorted(calls, key=lambda c: -c[0])[
                        :max(1, len(calls) // 100)])},
        "worker_busy_share": sum(b - a for a, b in worker) / max(1e-9, calls[-1][2] - calls[0][1]),
        "slowest": [{"us": round(dt * 1e6), "worker_us": round(overlap(t0, t1) * 1e6),
                     **{k: round(v * 1e6) for k, v in tg.items() if k not in ("@", "os")},
                     **({"os": tg["os"]} if "os" in tg else {}),
                     **({"where": dict(tg["@"].most_common(10))} if "@" in tg else {})}
                    for dt, t0, t1, tg in slow],
    }), flush=True)


if __name__ == "__main__":
    sys.exit(main())
