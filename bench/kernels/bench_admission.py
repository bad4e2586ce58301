"""GPU-cache admission: hit rates of a LinearUVM layer's cache with and without the warm cap.

The layer admits its misses in rounds; once its cache has been offered
``TierConfig.warm_capacities`` (4) times as many keys as it has slots, a round brings in
at most ``TierConfig.warm_round_fraction`` (1/8) of the slots, a random sample of the
round's miss occurrences. The baseline, measured in the same run on the same key streams,
is the uncapped rule (fraction 1.0: a round may replace the whole cache). Also shown:
``InsertPolicy(gpu=0.1)`` (a random tenth of the misses admitted).

Hit rates depend only on the cache's placement rules, which the CPU twin and the Triton
kernels share exactly, so this runs on the CPU (small rows: dim 4). Workload: Zipf 1.05
over ``rows`` keys, fresh draws for every batch; GPU cache 0.3%, 1% and 10% of the rows;
batches of 0.4% and 6.25% of the rows (64k and 1M keys of a 16M-row table, scaled).

Run: ``python bench/kernels/bench_admission.py [--quick]``. One JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu import InsertPolicy, LayerType, NVEmbedding, TierConfig  # noqa: E402
from nvecache.apps.demo.workload import ZipfKeys  # noqa: E402

DIM = 4


def hit_rate(table: torch.Tensor, cache_fraction: float, batch: int, prob: float,
             warm: int, measured: int, fraction: float) -> float:
    rows = table.shape[0]
    cache_bytes = int(rows * cache_fraction) * (8 + 4 + DIM * 4)
    z = ZipfKeys(rows, 1.05, popularity_seed=0, seed=5)
    layer = NVEmbedding(rows, DIM, torch.float32, LayerType.LinearUVM,
                        gpu_cache_size=cache_bytes, storage=table, device="cpu",
                        insert_policy=InsertPolicy(gpu=prob),
                        tuning=TierConfig(warm_round_fraction=fraction))
    for _ in range(warm):
        layer(z.sample(batch))
    before = layer.stats().gpu
    for _ in range(measured):
        layer(z.sample(batch))
    after = layer.stats().gpu
    hits, misses = after.hits - before.hits, after.misses - before.misses
    return hits / max(1, hits + misses)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller table, fewer batches")
    p.add_argument("--rows", type=int, help="table rows (default 2**21; quick 2**18)")
    args = p.parse_args(argv)
    rows = args.rows or (1 << 18 if args.quick else 1 << 21)
    table = torch.randn(rows, DIM)
    configured = TierConfig().warm_round_fraction
    out: list[dict[str, Any]] = []
    for cache_fraction in (0.003, 0.01, 0.1):
        for share in (0.004, 0.0625):
            batch = max(256, int(rows * share))
            warm = 60 if share < 0.01 else 30
            measured = 8 if args.quick else 20
            rec: dict[str, Any] = {"bench": "admission", "rows": rows,
                                   "cache_fraction": cache_fraction, "batch": batch}
            for label, frac, prob in (("uncapped", 1.0, 1.0), ("warm_cap", configured, 1.0),
                                      ("admit_0.1", configured, 0.1)):
                rec[f"hit_{label}"] = round(hit_rate(table, cache_fraction, batch, prob,
                                                     warm, measured, frac), 4)
            rec["gain_points"] = round(100 * (rec["hit_warm_cap"] - rec["hit_uncapped"]), 1)
            print(json.dumps(rec), flush=True)
            out.append(rec)
    worst = min(r["gain_points"] for r in out)
    print(f"warm cap {configured:g}: hit-rate change vs uncapped from {worst:+.1f} to "
          f"{max(r['gain_points'] for r in out):+.1f} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
