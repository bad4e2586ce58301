#!/usr/bin/env bash
# One multi-GPU machine run (issue 7): topology, the GPU + multigpu tests (the seed snippet
# under torchrun among them), the seed snippet under mpirun where installed, bench_multigpu
# and replicas one per GPU.
# Usage: bash bench/device/run_on_multigpu.sh [quick]   (first `bash bench/device/prepare_device.sh` here: .whl/, carried)
set -uo pipefail
source "$(dirname "$0")/device_env.sh" "$@"
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())'
  python3 -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>&1 | tail -1
  command -v mpirun || echo "no mpirun"; } 2>&1 | tee "$OUT/env.txt"
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/hostcache/test_cache.py \
  2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
if command -v mpirun >/dev/null; then
  timeout 120 mpirun --allow-run-as-root -n 2 python3 examples/seed_linear_uvm.py 2>&1 \
    | tail -8 | tee "$OUT/seed_mpirun.log"
fi
timeout 300 python3 bench/multigpu/bench_multigpu.py $Q 2>&1 | tee "$OUT/multigpu.jsonl" | cut -c1-600
timeout 200 python3 bench/host/bench_replicas.py --devices cuda --replicas 1,2 --rounds 1 $Q 2>&1 \
  | tee "$OUT/replicas.jsonl" | cut -c1-400
