#!/usr/bin/env bash
# One GPU-machine run for the LinearUVM path (issues 4 and 5): the GPU tests, the cache
# kernels' linear part (fused vs page-ordered misses) and the LinearUVM layer (sync-free
# admissions), output under $OUT (default ./out). Fits one 600 s device call.
# Usage: bash bench/device/run_linear_on_gpu.sh [quick]   (first `bash bench/device/prepare_device.sh` here: .whl/, carried)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" "$@"
nvidia-smi -L | tee "$OUT/env.txt"
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -30 \
  | tee "$OUT/gpu_tests.log"
timeout 150 python3 bench/kernels/bench_gpu_cache.py --only linear $Q 2>&1 \
  | tee "$OUT/gpu_cache_linear.jsonl" | cut -c1-600
timeout 150 python3 bench/layers/bench_layers.py --only linear $Q 2>&1 \
  | tee "$OUT/layers_linear.jsonl" | cut -c1-600
