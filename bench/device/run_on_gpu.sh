#!/usr/bin/env bash
# One GPU-machine run: the GPU tests and the GPU benchmarks, output under $OUT (default ./out).
# Usage: bash bench/device/run_on_gpu.sh [quick]   (first `bash bench/device/prepare_device.sh` here: .whl/, carried)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" "$@"
nvidia-smi -L | tee "$OUT/env.txt"
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)' | tee -a "$OUT/env.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/hostcache/test_cache.py \
  2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
timeout 150 python3 bench/layers/bench_layers.py $Q 2>&1 | tee "$OUT/layers.jsonl" | cut -c1-400
timeout 120 python3 -m nvecache.apps.cli demo --replicas 2 --seconds 10 --device cuda \
  --out "$OUT/demo" 2>&1 | tail -25 | tee "$OUT/demo.log"
