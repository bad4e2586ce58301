"""How long a host-cache fill keeps other threads of the process from running Python.

A Hierarchical layer's worker thread fills the shared host cache with the rows its
lookups read from the parameter server (``HostCache.insert(..., overwrite=False,
since=...)``, gpu.stacks.misses.host_filler), and reports the GPU's host-cache hits to
its policy. A lookup thread needs the GIL between its own steps; this measures what a
fill leaves it: a ticker thread asks for the GIL every 0.2 ms while fills of N rows (in
chunks of 7,000, as several lookups' worth merged) run on the main thread, and the
longest gap between its ticks is how long the fill held the GIL at a stretch.

    python bench/host/probe_fill_gil.py [--capacity 209715] [--sizes 8192,65536,131072]

Prints one JSON line per size (fill time p50 / max, the ticker's longest gap, gaps over
1 ms). CPU only; a fresh host cache is created and unlinked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hostcache import HostCache  # noqa: E402
from hostcache.table_twin import GATE as LOOPS  # noqa: E402

DIM = 128
CHUNK = 7000


class Ticker:
    """A thread that wakes every 0.2 ms and records the gaps between its wake-ups."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.0002)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--capacity", type=int, default=209715)
    ap.add_argument("--sizes", default="8192,65536,131072")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    name = f"probe-fill-gil-{os.getpid()}"
    hc = HostCache.create(name, capacity=args.capacity, dim=DIM)
    gen = torch.Generator().manual_seed(0)
    space = 5 * args.capacity
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = torch.randn(max(sizes), DIM, generator=gen)
    ticker = None
    try:
        full = torch.randperm(space, generator=gen)[:args.capacity]
        for i in range(0, full.numel(), 8192):  # a full cache: fills evict, as in serving
            k = full[i:i + 8192]
            hc.insert(k, rows[:k.numel()])
        # NOTE: the compiled loops, as a serving process has them (until they are loaded
        # their numpy twins run, which hold the GIL far longer)
        LOOPS.ask()
        compiled = LOOPS.wait(600)
        ticker = Ticker()
        for n in sizes:
            times = []
            ticker.gaps.clear()
            for _ in range(args.reps):
                keys = torch.randint(0, space, (n,), generator=gen)
                parts = [(keys[i:i + CHUNK], rows[i:i + min(CHUNK, n - i)])
                         for i in range(0, n, CHUNK)]
                t0 = time.perf_counter()
                hc.insert(torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts]),
                          overwrite=False, since=hc.change_cursor, allow_nonfinite=True)
                times.append(time.perf_counter() - t0)
            gaps = list(ticker.gaps)
            print(json.dumps({
                "bench": "host_fill_gil", "rows": n, "capacity": args.capacity,
                "fill_p50_ms": statistics.median(times) * 1e3, "fill_max_ms": max(times) * 1e3,
                "ticker_max_gap_ms": max(gaps, default=0.0) * 1e3,
                "ticker_gaps_over_1ms": sum(g > 1e-3 for g in gaps),
                "switch_interval_ms": sys.getswitchinterval() * 1e3,
                "compiled_loops": compiled}), flush=True)
    finally:
        if ticker is not None:
            ticker.stop()
        hc.close()
        HostCache.unlink(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
