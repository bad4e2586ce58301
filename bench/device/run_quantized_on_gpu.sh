#!/usr/bin/env bash
# Issue 36's device figures in one run of under 560 s (first `bash bench/device/prepare_device.sh`
# here; carry .whl): every part of bench_quantized_layers.py, each under its own time
# limit; JSON lines to $OUT/quantized.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/device_env.sh
nvidia-smi -L | tee "$OUT/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$OUT/env.txt"
# each part under its own limit (seconds) and table size (LinearUVM: 4M rows, a 2 GiB
# float32 block, ten times its 10% GPU cache; the others the bench's defaults)
run_part() {
  timeout "$2" python3 bench/quantized/bench_quantized_layers.py --only "$1" --reps "${REPS:-200}" \
    "${@:3}" 2>&1 | tee -a "$OUT/quantized.jsonl" | cut -c1-300
}
run_part gpulayer 110
run_part seed 80
run_part linear_uvm 170 --rows 4194304
run_part hierarchical 170
