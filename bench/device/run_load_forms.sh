#!/usr/bin/env bash
# Same-call A/B of forms of gpu/kernels/stored_rows.py (how the kernels load a quantized
# block's rows, versions and parameters) on a GPU machine, first `bash
# bench/device/prepare_device.sh` here, then, carrying .whl and the folder that holds the
# forms (git-ignored, e.g. .ab/, filled with `git show COMMIT:gpu/kernels/stored_rows.py`):
#   bash bench/device/run_load_forms.sh .ab/A.py .ab/C.py
# Each form is copied into place in turn, ROUNDS times (default 2) alternating A B A B, so
# the machine's drift falls on every form, and timed by the LinearUVM bench over int8 and
# fp8 blocks (4M rows, 10% GPU cache, 256k and 1M keys, us a call back to back); then
# each form meets the writer-process race test. The tree's own module is put back at the
# end. JSON lines to $OUT/forms.jsonl (the bench's stderr to $OUT/forms.err), a table of
# medians at the end.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/device_env.sh
[ $# -gt 0 ] || { echo "usage: $0 FORM.py [FORM.py ...]"; exit 2; }
nvidia-smi -L | tee "$OUT/env.txt"
own=$(mktemp) && cp gpu/kernels/stored_rows.py "$own"
trap 'cp "$own" gpu/kernels/stored_rows.py' EXIT
for round in $(seq "${ROUNDS:-2}"); do
  for form in "$@"; do
    cp "$form" gpu/kernels/stored_rows.py
    timeout "${LIMIT:-150}" python3 bench/quantized/bench_quantized_layers.py --only linear_uvm \
      --rows 4194304 --reps 50 2>>"$OUT/forms.err" | grep '"layer"' \
      | sed "s|^{|{\"form\": \"$form\", \"round\": $round, |" >>"$OUT/forms.jsonl"
  done
done
for form in "$@"; do
  cp "$form" gpu/kernels/stored_rows.py
  echo "== race test, $form"
  timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider \
    tests/gpu/quantized/test_linear_quantized_races.py 2>&1 | tail -2
done
[ -s "$OUT/forms.err" ] && { echo "== the bench's stderr (last lines; all in $OUT/forms.err)"; tail -5 "$OUT/forms.err"; }
python3 - "$OUT/forms.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
cells: dict = {}
for r in rows:
    cells.setdefault((r["form"], r["layer"], r["keys"]), []).append(r["us_per_call"])
print(f"{'form':24s} {'layer':14s} {'keys':>8s} {'us (median)':>12s} runs")
for (form, layer, keys), us in sorted(cells.items()):
    print(f"{form:24s} {layer:14s} {keys:8d} {statistics.median(us):12.1f} {len(us)}")
PY
