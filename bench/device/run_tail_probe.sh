#!/usr/bin/env bash
# Why the slowest 64k-key Hierarchical calls stall: bench/layers/probe_hierarchical_tail.py
# run four ways in fresh processes (plain; `--no-split`: the row mirror's and the host
# cache's reads on the calling thread alone; `--torch-threads 1`; `--worker-threads 1`:
# torch's intra-op team of one on the host-cache worker's thread alone), each call with the OS
# counters a stall moves (faults, preemptions, the cgroup's CPU throttling). Before them, what
# the machine gives the process: CPUs visible, affinity, torch's intra-op threads, the
# cgroup's CPU quota. On the GPU machine (carry .whl):
#   [SIZES=65536] [CALLS=600] bash bench/device/run_tail_probe.sh
# Output: $OUT/tail_<way>.jsonl and .err; a summary of each way on stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/device/device_env.sh
SIZES=${SIZES:-65536} CALLS=${CALLS:-600} OTHER=${1:-}
if [ -n "$OTHER" ] && [ ! -d "$OTHER/gpu" ]; then
  echo "$OTHER is not a checkout (no gpu/ in it)"; exit 2
fi
SITE=$([ -d /tmp/site ] && echo /tmp/site: || echo)
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c 'import os, torch; print("torch", torch.__version__, "intra-op threads",
  torch.get_num_threads(), "cpu_count", os.cpu_count(), "affinity",
  len(os.sched_getaffinity(0)))'
for f in /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu/cpu.cfs_quota_us; do
  [ -r "$f" ] && echo "$f: $(cat "$f")"
done
for way in ${OTHER:+other-plain} plain no-split torch-threads-1 worker-threads-1; do
  tree=$PWD
  case $way in
    other-plain) args=(); tree=$(cd "$OTHER" && pwd) ;;
    plain) args=() ;;
    no-split) args=(--no-split) ;;
    torch-threads-1) args=(--torch-threads 1) ;;
    worker-threads-1) args=(--worker-threads 1) ;;
  esac
  echo "== $way"
  (cd "$tree" && PYTHONPATH=$SITE$tree timeout 140 python3 \
    bench/layers/probe_hierarchical_tail.py --sizes "$SIZES" --calls "$CALLS" ${PROBE_ARGS:-} "${args[@]}") \
    > "$OUT/tail_$way.jsonl" 2> "$OUT/tail_$way.err"
  echo "rc $?"; tail -2 "$OUT/tail_$way.err"
  python3 - "$OUT/tail_$way.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    d = json.loads(line)
    print(f"  {d['batch']} keys: p50 {d['p50_us']:.0f} p90 {d['p90_us']:.0f} "
          f"p99 {d['p99_us']:.0f} us (p99/p50 {d['p99_us'] / d['p50_us']:.2f}), "
          f"twin calls timed {d.get('twin_calls_timed')}, worker busy "
          f"{d['worker_busy_share']:.2f}")
    print("  os per call:", d.get("os_mean"))
    for s in d["slowest"][:6]:
        print("  slow:", {k: v for k, v in s.items() if k != "where"})
PY
done
