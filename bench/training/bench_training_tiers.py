"""Training a Hierarchical layer (GPU cache -> shared HostCache -> parameter server).

Default layer arguments except the tables: a parameter server holding the table (rows
stored with their RowwiseAdagrad state, ``optimizer.row_width(dim, float32)`` columns),
a host cache of a fifth of the rows, a GPU cache of a twentieth. fp32, Zipf 1.05 keys,
distinct batches. Over a ``file://`` parameter server (its default durable commits, and
``?sync=false``: ``ps`` is ``file_nosync``) and over Redis (``--redis-url``, a fresh
table dropped at the end; a record saying why when none answers):

1. ``training_steps``: training steps/s and keys/s (one step: ``layer(keys).backward(gout)``
   with the fused ``gpu.optim.RowwiseAdagrad``, ``gout`` a fixed random gradient), wall
   clock over back-to-back steps, and p50/p99 of one step followed by a device sync
   (steps and lookups alternating, so drift falls on both), against the same layer's
   inference lookup of the same batches under ``torch.no_grad()``: ``*_over_lookup`` is
   a step's time over a lookup's.
2. ``trained_row_propagation``: how soon a serving replica (a spawned process, an
   inference layer over the same host cache and parameter server:
   bench/training/training_replica.py)
   serves a trained row. The trainer trains steps that touch a few probe keys, recording
   ``time.monotonic()`` when backward returns; the replica loops lookups of the probes and
   records the first lookup that returns a changed row of that step (and the one that
   returns every probe changed). The trainer starts the next step once the replica saw all
   of them. Lags in microseconds (a sighting before backward returned counts 0 and is
   counted in ``seen_before_return``).

Prints one JSON line per figure. Run: ``python bench/training/bench_training_tiers.py [--quick]``;
without CUDA it runs on the CPU at small sizes (figures then say "cpu") with one torch
thread (``--threads``): with torch's default of one per core, the layer's worker thread
and the replica stall torch's parallel kernels on a small machine (steps of 100+ ms among
steps of 10 ms).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psclient  # noqa: E402
from bench.training.training_replica import serve  # noqa: E402
from bench.workloads import ZipfKeys  # noqa: E402
from gpu import LayerType, NVEmbedding, optim  # noqa: E402
from gpu.train import wide  # noqa: E402
from hostcache import HostCache  # noqa: E402

CTX = mp.get_context("spawn")
ALPHA = 1.05
#: bytes a GPU cache line takes beside its row (key, version, policy)
LINE_EXTRA = 12


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def redis_reachable(url: str) -> str | None:
    """None when a Redis answers at ``url``, else why not (one line)."""
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2).ping()
    except (redis.RedisError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


class Tables:
    """A parameter-server table and a host cache of stored rows (value + state)."""

    def __init__(self, ps: Any, ps_url: str, table: str, hc: HostCache, rows: int,
                 dim: int, width: int) -> None:
        self.ps, self.ps_url, self.table, self.hc = ps, ps_url, table, hc
        self.rows, self.dim, self.width = rows, dim, width

    @property
    def cache_bytes(self) -> int:
        """A GPU cache of a twentieth of the rows."""
        return self.rows // 20 * (self.width * 4 + LINE_EXTRA)


@contextlib.contextmanager
def tables(redis_url: str | None, rows: int, dim: int, width: int, file_query: str = ""
           ) -> Iterator[Tables]:
    """A fresh table (``file://`` in a temporary directory with the options of
    ``file_query``, or on ``redis_url``) loaded with random rows and zero state, and a
    host cache of a fifth of them; the table dropped, the segment unlinked and the
    directory removed on exit, error or not."""
    name = f"bench-train-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = tempfile.mkdtemp(prefix="nvec-bench-train-")
    url = redis_url or f"file://{tmp}/ps{file_query}"
    try:
        ps = psclient.connect(url, table=name, dim=width, dtype=torch.float32)
        try:
            gen = torch.Generator().manual_seed(0)
            ps.load(wide.pad(torch.randn(rows, dim, generator=gen), width), progress=False)
            hc = HostCache.create(name, capacity=rows // 5, dim=width)
            try:
                yield Tables(ps, url, name, hc, rows, dim, width)
            finally:
                hc.close()
                HostCache.unlink(name)
        finally:
            ps.drop()  # NOTE: closes the client; a Redis table outlives the run otherwise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def trainer(t: Tables, device: torch.device) -> NVEmbedding:
    return NVEmbedding(t.rows, t.dim, torch.float32, LayerType.Hierarchical,
                       gpu_cache_size=t.cache_bytes, host_cache=t.hc, storage=t.ps,
                       optimize_for_training=True, optimizer=optim.RowwiseAdagrad(),
                       device=device)


def sync_of(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def p50_p99(ts: list[float]) -> tuple[float, float]:
    """(p50, p99) in microseconds of times in seconds."""
    ts = sorted(ts)
    return ts[len(ts) // 2] * 1e6, ts[min(len(ts) - 1, int(len(ts) * 0.99))] * 1e6


def back_to_back(fn: Callable[[torch.Tensor], Any], batches: list[torch.Tensor],
                 sync: Callable[[], None], min_s: float) -> tuple[float, int]:
    """(seconds per call, calls): wall clock over back-to-back calls on distinct batches,
    at least two passes over them and ``min_s``."""
    sync()
    calls, t0 = 0, time.perf_counter()
    while calls < 2 * len(batches) or time.perf_counter() - t0 < min_s:
        fn(batches[calls % len(batches)])
        calls += 1
    sync()
    return (time.perf_counter() - t0) / calls, calls


def interleaved(fns: list[Callable[[torch.Tensor], Any]], batches: list[torch.Tensor],
                sync: Callable[[], None], reps: int) -> list[tuple[float, float]]:
    """(p50, p99) in microseconds of each of ``fns``, one call each in turn, each followed
    by ``sync``; each fn visits the batches from its own offset."""
    ts: list[list[float]] = [[] for _ in fns]
    sync()
    for i in range(reps):
        for j, fn in enumerate(fns):
            b = batches[(i + j * len(batches) // len(fns)) % len(batches)]
            t0 = time.perf_counter()
            fn(b)
            sync()
            ts[j].append(time.perf_counter() - t0)
    return [p50_p99(x) for x in ts]


def hit_rates(layer: NVEmbedding, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``fn()``'s result and the per-tier hit rates of the lookups it made."""
    a = layer.stats()
    out = fn()
    b = layer.stats()
    rates: dict[str, Any] = {}
    for tier, key in (("gpu", "gpu"), ("host", "host"), ("ps", "storage")):
        before, after = getattr(a, key), getattr(b, key)
        if before is None or after is None:
            rates[tier] = None
            continue
        h, m = after.hits - before.hits, after.misses - before.misses
        rates[tier] = h / (h + m) if h + m else None
    return out, rates


def steps(t: Tables, backend: str, device: torch.device, sizes: list[int], count: int,
          reps: int, min_s: float) -> None:
    """Figure 1 at each batch size (see the module docstring)."""
    layer = trainer(t, device)
    try:
        for n in sizes:
            z = ZipfKeys(t.rows, ALPHA, seed=n)
            batches = [z.sample(n).to(device) for _ in range(count)]
            gen = torch.Generator().manual_seed(n)
            gout = torch.randn(n, t.dim, generator=gen).to(device)
            got = one_size(layer, batches, gout, sync_of(device), reps, min_s)
            emit(bench="training_steps", ps=backend, device=device.type, rows=t.rows,
                 dim=t.dim, stored_width=t.width, dtype="float32", alpha=ALPHA, batch=n,
                 optimizer="RowwiseAdagrad", distinct_batches=count, per_call_reps=reps,
                 torch_threads=torch.get_num_threads(), **got)
    finally:
        layer.close()


def one_size(layer: NVEmbedding, batches: list[torch.Tensor], gout: torch.Tensor,
             sync: Callable[[], None], reps: int, min_s: float) -> dict[str, Any]:
    """Figure 1's fields for one batch size."""
    n = batches[0].numel()

    def step(keys: torch.Tensor) -> None:
        layer(keys).backward(gout)

    def lookup(keys: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return layer(keys)

    for b in batches:  # NOTE: warm: kernels compiled, caches at steady state
        step(b)
        lookup(b)
    layer.flush()
    (t_look, looks), look_rates = hit_rates(
        layer, lambda: back_to_back(lookup, batches, sync, min_s))
    (t_step, stepped), step_rates = hit_rates(
        layer, lambda: back_to_back(step, batches, sync, min_s))
    (s50, s99), (l50, l99) = interleaved([step, lookup], batches, sync, reps)
    uniq = sum(int(torch.unique(b).numel()) for b in batches) / len(batches)
    return {"unique_keys_per_batch": round(uniq, 1), "steps_timed": stepped,
            "lookups_timed": looks, "train_steps_per_s": 1 / t_step,
            "train_keys_per_s": n / t_step, "lookup_calls_per_s": 1 / t_look,
            "lookup_keys_per_s": n / t_look, "step_over_lookup": t_step / t_look,
            "train_p50_us": s50, "train_p99_us": s99, "lookup_p50_us": l50,
            "lookup_p99_us": l99, "p50_step_over_lookup": s50 / l50,
            "train_hit_rate": step_rates, "lookup_hit_rate": look_rates,
            "skipped_rows": layer.skipped_rows()}


def _next(out: Any, proc: Any, timeout: float, what: str) -> tuple[Any, ...]:
    """The replica's next record; its error (or death) raised as a RuntimeError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg: tuple[Any, ...] = out.get(timeout=min(1.0, max(0.01, deadline -
                                                                 time.monotonic())))
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the replica exited (code {proc.exitcode}) while the "
                                   f"trainer waited for {what}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} from the replica in {timeout:.0f} s") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"the replica failed:\n{msg[1]}")
        return msg


def propagation(t: Tables, backend: str, device: torch.device, n: int, measured: int,
                warm: int, probes_n: int) -> None:
    """Figure 2 (see the module docstring)."""
    gen = torch.Generator().manual_seed(7)
    probes = torch.randperm(t.rows, generator=gen)[:probes_n]
    z = ZipfKeys(t.rows, ALPHA, seed=11)
    total = warm + measured
    batches = [torch.cat([probes, z.sample(n - probes_n)]).to(device) for _ in range(total)]
    gout = torch.randn(n, t.dim, generator=gen).to(device)
    sync = sync_of(device)
    layer = trainer(t, device)
    stop, out = CTX.Event(), CTX.Queue()
    proc = CTX.Process(target=serve, args=(
        t.hc.name, t.ps_url, t.table, t.rows, t.width, t.dim, t.cache_bytes, str(device),
        probes, stop, out), daemon=True)
    try:
        layer(batches[0])  # NOTE: the trainer's kernels compiled before the replica starts
        sync()
        proc.start()
        _next(out, proc, 300, "its first lookup")
        first, every, early, step_s = [], [], 0, []
        stale = 0
        for i, keys in enumerate(batches):
            t0 = time.monotonic()
            layer(keys).backward(gout)
            written = time.monotonic()
            msg = _next(out, proc, 60, f"step {i}'s rows (a probe row never changed?)")
            if msg[0] != "seen" or msg[1] != i:
                raise RuntimeError(f"the replica sent {msg[:2]} at step {i}")
            if i < warm:
                continue
            stale += msg[4]
            early += msg[2] < written
            first.append(max(0.0, msg[2] - written))
            every.append(max(0.0, msg[3] - written))
            step_s.append(written - t0)
        stop.set()
        done = _next(out, proc, 60, "its last rows")
        while done[0] != "done":  # NOTE: nothing changes after the last step: not expected
            done = _next(out, proc, 60, "its last rows")
        with torch.no_grad():
            mine = layer(probes.to(device)).cpu()
        f50, f99 = p50_p99(first)
        a50, a99 = p50_p99(every)
        m50, m99 = p50_p99(step_s)
        emit(bench="trained_row_propagation", ps=backend, device=device.type, rows=t.rows,
             dim=t.dim, stored_width=t.width, batch=n, probe_keys=probes_n,
             steps=measured, warm_steps=warm, first_changed_p50_us=f50,
             first_changed_p99_us=f99, all_probes_p50_us=a50, all_probes_p99_us=a99,
             seen_before_return=int(early), stale_reads=int(stale),
             step_p50_us=m50, step_p99_us=m99, replica_lookups=done[1],
             torch_threads=torch.get_num_threads(),
             final_rows_match=bool(torch.equal(torch.from_numpy(done[2]), mine)))
    finally:
        stop.set()
        if proc.pid is not None:  # NOTE: started
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        out.cancel_join_thread()
        out.close()
        layer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, a minute or so")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--redis-url", default=os.environ.get("NVEC_BENCH_REDIS_URL",
                                                        "redis://127.0.0.1:6379/0"),
                   help="Redis for the second parameter server (skipped, with a record "
                        "saying why, when none answers)")
    p.add_argument("--rows", type=int, default=None, help="keys in the table")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the trainer (default: 1 on the CPU, where the "
                        "layer's worker thread and a replica share the cores; torch's "
                        "default on CUDA)")
    p.add_argument("--only", choices=["steps", "propagation"], action="append",
                   help="run only these figures (repeatable); default both")
    args = p.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    full = dev.type == "cuda" and not args.quick
    if args.threads or dev.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    if args.quick:
        dim, rows, sizes, count, reps, min_s, prop_steps = 32, 1 << 15, [1024], 8, 20, 0.2, 10
    elif full:
        dim, rows, sizes, count, reps, min_s, prop_steps = (128, 1 << 20, [4096, 16384], 32,
                                                            200, 1.0, 50)
    else:  # the CPU at small sizes
        dim, rows, sizes, count, reps, min_s, prop_steps = (128, 1 << 16, [4096, 16384], 8,
                                                            20, 0.5, 50)
    rows = args.rows or rows
    width = optim.RowwiseAdagrad().row_width(dim, torch.float32)
    parts = args.only or ["steps", "propagation"]
    why = redis_reachable(args.redis_url)
    # NOTE: file:// commits are durable by default (sync=True: an fsync per write
    # transaction, one per training step); "file_nosync" is the same store with sync=false
    for backend, url, query in (("file", None, ""), ("file_nosync", None, "?sync=false"),
                                ("redis", args.redis_url, "")):
        if url is not None and why is not None:
            for bench in parts:
                emit(bench="training_steps" if bench == "steps" else "trained_row_propagation",
                     ps=backend, skipped=f"no Redis at {url}: {why}")
            continue
        with tables(url, rows, dim, width, query) as t:
            if "steps" in parts:
                steps(t, backend, dev, sizes, count, reps, min_s)
            if "propagation" in parts:
                propagation(t, backend, dev, sizes[0], prop_steps, warm=3, probes_n=16)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
