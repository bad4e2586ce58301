"""Same-run A/B of two checkouts: the three layer types at 1k and 64k keys per call.

Each checkout is timed in its own fresh process, through the public API only (so that an
older checkout runs it unchanged), with default layer arguments:

* GPULayer: a 1M x 128 fp32 table in HBM, against ``nn.Embedding`` on the same keys;
* LinearUVM: the table in a registered ``SharedMemBlock``, a GPU cache of a tenth of it;
* Hierarchical: a ``file://`` parameter server holding the table, a host cache of a fifth,
  a GPU cache of a twentieth.

Per call: p50 and p99 wall clock of one call and a device sync, over distinct Zipf 1.05
batches after a warm-up, and ``nn.Embedding``'s p50 on the same batches in the same
process. The checkouts alternate (A B A B ...) so the machine's drift falls on both.

With ``--dtype int8`` (or ``float8_e4m3fn``) the linear table is stored quantized and the
layers timed are those reading it: a GPULayer over the ``SharedMemBlock`` (every key read
over the host link) and the LinearUVM, against ``nn.Embedding`` over the table's rows as
they read (dequantized).

Run on a CUDA machine::

    python bench/layers/bench_ab_layers.py --a /path/to/old/checkout --b . \
        [--rounds 2] [--dtype int8]

It prints one JSON line per (checkout, round, layer, size) and a table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DIM = 128
ROWS = 1 << 20
SIZES = (1 << 10, 1 << 16)


def _compiled_loops() -> None:
    """Wait until the per-key loops the checkout has asked for are compiled (timed calls
    measure them, not their numpy twins): either tree's own gates, whatever its age."""
    try:
        from nvecache.common import loop_gate
    except ImportError:
        return  # NOTE: a tree whose loops compile before its first lookup
    made = getattr(loop_gate, "gates", lambda: tuple(getattr(loop_gate, "_GATES", ())))()
    for g in made:
        if g.twin_picks:
            g.wait(600)


def _child(calls: int, device: str, rows: int, warm: int, dtype_name: str) -> None:
    """Time the three layer types (of a quantized table: the two over the linear one)
    with the checkout first on ``sys.path``."""
    import torch

    import psclient
    from gpu import LayerType, NVEmbedding
    from hostcache import HostCache, SharedMemBlock

    dev = torch.device(device)
    dtype = getattr(torch, dtype_name)
    quantized = dtype != torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(rows, DIM, generator=gen)
    ranks = torch.arange(1, rows + 1, dtype=torch.float64).pow(-1.05)
    perm = torch.randperm(rows, generator=gen)

    def batch(n: int) -> torch.Tensor:
        return perm[torch.multinomial(ranks, n, replacement=True, generator=gen)].to(dev)

    def timed(fn: Any, batches: list[torch.Tensor]) -> tuple[float, float]:
        ts = []
        sync()
        for b in batches:
            t0 = time.perf_counter()
            fn(b)
            sync()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        return ts[len(ts) // 2] * 1e6, ts[min(len(ts) - 1, int(len(ts) * 0.99))] * 1e6

    tag = f"ab-{os.getpid()}"
    tmp = tempfile.mkdtemp(prefix="nvec-ab-")
    mb = SharedMemBlock.create(tag + "-lin", num_rows=rows, dim=DIM, dtype=dtype)
    ps = psclient.connect(f"file://{tmp}/ps", table=tag, dim=DIM, dtype=torch.float32)
    hc = HostCache.create(tag, capacity=rows // 5, dim=DIM)
    layers = {}
    try:
        mb.write(torch.arange(rows), weights)
        # NOTE: the rows as the layers read them (a quantized table's dequantized)
        base = torch.nn.Embedding.from_pretrained(mb.read(torch.arange(rows)).to(dev))
        if quantized:
            layers["gpulayer_shm"] = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer,
                                                 storage=mb, device=dev)
        else:
            ps.load(weights, progress=False)
            layers["gpulayer"] = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer,
                                             weight_init=weights, device=dev)
        layers["linear_uvm"] = NVEmbedding(rows, DIM, torch.float32, LayerType.LinearUVM,
                                           gpu_cache_size=rows // 10 * (DIM * 4 + 12),
                                           storage=mb, device=dev)
        if not quantized:
            layers["hierarchical"] = NVEmbedding(
                rows, DIM, torch.float32, LayerType.Hierarchical,
                gpu_cache_size=rows // 20 * (DIM * 4 + 12), host_cache=hc, storage=ps,
                device=dev)
        for name, layer in layers.items():
            for n in SIZES:
                for b in [batch(n) for _ in range(max(4, warm // n))]:
                    layer(b)
                layer.flush()
                _compiled_loops()
                batches = [batch(n) for _ in range(calls)]
                if not torch.equal(layer(batches[0]), base(batches[0])):
                    raise SystemExit(f"{name} returned wrong rows")
                p50, p99 = timed(layer, batches)
                t50, _ = timed(base, batches)
                print(json.dumps({"layer": name, "keys": n, "p50_us": p50, "p99_us": p99,
                                  "torch_p50_us": t50}), flush=True)
    finally:
        for layer in layers.values():
            close = getattr(layer, "close", None)
            if close is not None:
                close()
        hc.close()
        HostCache.unlink(tag)
        mb.close()
        SharedMemBlock.unlink(tag + "-lin")
        ps.drop()
        ps.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="checkout A (the baseline)")
    ap.add_argument("--b", required=True, help="checkout B")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    ap.add_argument("--rows", type=int, default=ROWS)
    ap.add_argument("--warm", type=int, default=8 << 20, help="keys looked up before timing")
    ap.add_argument("--dtype", default="float32", choices=("float32", "int8", "float8_e4m3fn"),
                    help="the linear table's format")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, args.child)
        _child(args.calls, args.device, args.rows, args.warm, args.dtype)
        return 0
    rows: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for rnd in range(args.rounds):
        for label, tree in (("A", args.a), ("B", args.b)):
            tree = str(Path(tree).resolve())
            env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
            out = subprocess.run([sys.executable, __file__, "--a", args.a, "--b", args.b,
                                  "--calls", str(args.calls), "--device", args.device,
                                  "--rows", str(args.rows), "--warm", str(args.warm),
                                  "--dtype", args.dtype, "--child", tree],
                                 env=env, cwd=tree, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stdout, out.stderr, file=sys.stderr)
                return 1
            for line in out.stdout.splitlines():
                rec = json.loads(line)
                rec.update(checkout=label, round=rnd)
                print(json.dumps(rec), flush=True)
                rows.setdefault((rec["layer"], label, rec["keys"]), []).append(rec)
    print(f"\n{'layer':<14}{'keys':>7}{'A p50':>11}{'B p50':>11}{'B/A':>7}{'A p99':>11}"
          f"{'B p99':>11}{'torch p50':>11}")
    for layer in ("gpulayer", "gpulayer_shm", "linear_uvm", "hierarchical"):
        for n in SIZES:
            a, b = rows.get((layer, "A", n)), rows.get((layer, "B", n))
            if not a or not b:
                continue

            def med(recs: list[dict[str, float]], key: str) -> float:
                return statistics.median(r[key] for r in recs)

            print(f"{layer:<14}{n:>7}{med(a, 'p50_us'):>11.1f}{med(b, 'p50_us'):>11.1f}"
                  f"{med(b, 'p50_us') / med(a, 'p50_us'):>7.2f}{med(a, 'p99_us'):>11.1f}"
                  f"{med(b, 'p99_us'):>11.1f}{med(a + b, 'torch_p50_us'):>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
