#!/usr/bin/env bash
# Issue 36's device figures in one run (first `bash bench/prepare_device.sh` here; carry
# .whl): every part of bench_quantized_layers.py, each under its own time limit, then the
# host-tier gather and the per-call path of the plain layers (to check that the quantized
# formats cost the plain path nothing), output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
nvidia-smi -L | tee "$OUT/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$OUT/env.txt"
for part in gpulayer seed linear_uvm hierarchical; do
  timeout "${PART_LIMIT:-150}" python3 bench/bench_quantized_layers.py --only "$part" 2>&1 \
    | tee -a "$OUT/quantized.jsonl" | cut -c1-300
done
