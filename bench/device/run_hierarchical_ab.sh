#!/usr/bin/env bash
# Same-run A/B of the Hierarchical layer over `file://` between another tree and this one:
# bench/layers/bench_hierarchical.py's run() (1M x 128 fp32 rows, GPU cache 5%, host cache
# 20%, fresh Zipf 1.05 batches, default arguments; p50/p99 a call, back to back, hit rates)
# in a fresh process per tree, the trees alternating ROUNDS times (default 1), after each
# tree's per-key loops were compiled once (their numba cache filled: no twin timed).
# The other tree is an unpacked checkout kept in an ignored folder and carried, e.g. here:
#   mkdir -p .ab/old && git archive OLD_COMMIT | tar -x -C .ab/old
# then on the GPU machine (carry .whl and .ab):
#   [ROUNDS=2] [SIZES=1024,4096,16384,65536] [CALLS=300] \
#     bash bench/device/run_hierarchical_ab.sh .ab/old
# Output: $OUT/hier_ab.jsonl (each line tagged with its tree and round), and a table of the
# medians over rounds.
set -uo pipefail
cd "$(dirname "$0")/../.."
OLD=${1:?usage: run_hierarchical_ab.sh OTHER_TREE}
[ -d "$OLD/gpu" ] || { echo "$OLD is not a checkout (no gpu/ in it)"; exit 2; }
source bench/device/device_env.sh
OUT=$(cd "$OUT" && pwd)
ROUNDS=${ROUNDS:-1} SIZES=${SIZES:-1024,4096,16384,65536} CALLS=${CALLS:-300}
SITE=$([ -d /tmp/site ] && echo /tmp/site: || echo)
HERE=$PWD
# each tree's per-key loops compiled into its numba cache first (the cache sits beside the
# source), so that neither tree's timed calls run the numpy twins while a compile goes on
for tree in "$OLD" "$HERE"; do
  (cd "$tree" && PYTHONPATH=$SITE$PWD python3 -c "
import importlib
from nvecache.common import loop_gate
for m in ('hostcache.table_twin', 'psclient.file.mirror_twin', 'gpu.stacks.misses.miss_twin'):
    importlib.import_module(m)
made = getattr(loop_gate, 'gates', lambda: tuple(getattr(loop_gate, '_GATES', ())))()
print('$tree', [(g.module, g.wait(600)) for g in made])
" 2>>"$OUT/hier_ab.err") || echo "compiling $tree's loops failed (see $OUT/hier_ab.err)"
done
for r in $(seq 1 "$ROUNDS"); do
  for tree in "$OLD" "$HERE"; do
    name=$([ "$tree" = "$HERE" ] && echo this || echo other)
    (cd "$tree" && PYTHONPATH=$SITE$PWD python3 -c "
import sys, tempfile
from bench.layers.bench_hierarchical import run
with tempfile.TemporaryDirectory() as tmp:
    run(f'file://{tmp}/ps', 'file', 1 << 20, [int(s) for s in '$SIZES'.split(',')], $CALLS)
" 2>>"$OUT/hier_ab.err") | sed "s/^{/{\"tree\": \"$name\", \"round\": $r, /" \
      >>"$OUT/hier_ab.jsonl"
  done
done
python3 - "$OUT/hier_ab.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
keys = ("p50_us", "p99_us", "p99_over_own_p50", "back_to_back_mkeys_s", "torch_p50_us",
        "gpu_hit_rate", "host_hit_rate")
print("tree  bench  batch  " + "  ".join(keys))
groups = {}
for r in rows:
    groups.setdefault((r["tree"], r["bench"], r["batch"]), []).append(r)
for (tree, bench, batch), rs in sorted(groups.items()):
    cells = []
    for k in keys:
        vals = [r[k] for r in rs if r.get(k) is not None]
        cells.append(f"{statistics.median(vals):.3f}" if vals else "-")
    print(tree, bench, batch, *cells)
EOF
tail -5 "$OUT/hier_ab.err"
