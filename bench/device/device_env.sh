# Sourced by the run_on_*.sh scripts: output folder, wheels the GPU machine lacks, env.
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
# never NVLink multicast: it can take a shared host's GPUs down (the device tool's KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
Q=${1:-}; [ "$Q" = quick ] && Q=--quick || Q=
# a packed redis-server (bench/device/pack_redis.sh) when no Redis answers on 127.0.0.1:6379
if [ -x .whl/redis/redis-server ] && ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
  LD_LIBRARY_PATH=$PWD/.whl/redis .whl/redis/redis-server --bind 127.0.0.1 --port 6379 \
    --save "" --appendonly no --daemonize yes --logfile "$(cd "$OUT" && pwd)/redis.log" \
    || echo "packed redis-server did not start (see $OUT/redis.log)"
fi
