#!/usr/bin/env bash
# The seqlock probes on a GPU machine in one run of about 250 s (first `bash
# bench/device/prepare_device.sh` here; carry .whl): what reading random rows of a block
# costs by load form (bench/quantized/probe_row_requests.py), what each form of GPU load sees of a
# quantized block's versions while a writer process writes flat out
# (bench/quantized/probe_host_loads.py), how often the kernels' own seqlock round is judged
# torn, then the three readers' torn lookups (bench/quantized/probe_seqlock_race.py).
# Logs to $OUT/seqlock.log; ROUNDS=N recompiles the lookups' kernels with another bound.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/device_env.sh
nvidia-smi -L | tee "$OUT/env.txt"
probe() {
  echo "== $*" | tee -a "$OUT/seqlock.log"
  timeout "$1" python3 "bench/quantized/$2" "${@:3}" >>"$OUT/seqlock.log" 2>&1 \
    || echo "(exit $?)" >>"$OUT/seqlock.log"
}
probe 90 probe_row_requests.py
probe 60 probe_host_loads.py
probe 60 probe_seqlock_race.py rounds --polls 100000
probe 90 probe_seqlock_race.py readers --seconds 60 ${ROUNDS:+--rounds "$ROUNDS"}
grep -v '^  ' "$OUT/seqlock.log" | tail -40
