#!/usr/bin/env bash
# The seqlock probe on a GPU machine in one run of about 200 s (first `bash
# bench/device/prepare_device.sh` here; carry .whl): what a GPU sees of a quantized block's
# versions while a writer process writes flat out, how often the kernels' own seqlock round
# is judged torn, then the three readers' torn lookups (bench/quantized/probe_seqlock_race.py).
# Logs to $OUT/seqlock.log; ROUNDS=N recompiles the lookups' kernels with another bound.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/device_env.sh
nvidia-smi -L | tee "$OUT/env.txt"
probe() {
  echo "== $*" | tee -a "$OUT/seqlock.log"
  timeout "$1" python3 bench/quantized/probe_seqlock_race.py "${@:2}" >>"$OUT/seqlock.log" 2>&1 \
    || echo "(exit $?)" >>"$OUT/seqlock.log"
}
probe 60 versions --polls 1000000
probe 60 rounds --polls 100000
probe 90 readers --seconds 60 ${ROUNDS:+--rounds "$ROUNDS"}
grep -v '^  ' "$OUT/seqlock.log" | tail -40
