#!/usr/bin/env bash
# The whole test suite on a GPU machine (CUDA, PyTorch and Triton installed; no registry
# reachable). First, here: `bash bench/device/prepare_device.sh` (fills the git-ignored .whl/ with
# the wheels that machine lacks and a redis-server); then run this there with .whl carried:
#   bash bench/device/run_suite_on_gpu.sh [pytest args...]     (default: -n 8)
# It installs the wheels and this checkout (no dependencies fetched), starts the packed
# redis-server when no Redis answers on 127.0.0.1:6379 (and puts it on PATH for the tests
# that start their own), and runs pytest from the project
# root; the log goes to $OUT/suite.log (default ./out). The whole suite takes longer than one
# device call allows (about 11 min on 15 workers; one half took more than 430 s): SUITE_PART=1/3,
# then 2/3 and 3/3, runs every third test file (sorted paths), the parts together the whole
# suite (any i/n the same way).
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/device_env.sh
# the packed redis-server by name too, for the tests that start private servers or a cluster
[ -x .whl/redis/bin/redis-server ] && export PATH=$PWD/.whl/redis/bin:$PATH
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
  || { echo "pip install -e . failed (see $OUT/install.log)"; exit 1; }
nvidia-smi -L | tee "$OUT/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"gpus", torch.cuda.device_count())' | tee -a "$OUT/env.txt"
[ $# -gt 0 ] || set -- -n 8
if [ -n "${SUITE_PART:-}" ]; then
  mapfile -t FILES < <(find tests -name 'test_*.py' | sort |
    awk -v i="${SUITE_PART%/*}" -v n="${SUITE_PART#*/}" '(NR - 1) % n == i - 1')
  set -- "$@" "${FILES[@]}"
fi
python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/suite.log" | tail -60
exit "${PIPESTATUS[0]}"
