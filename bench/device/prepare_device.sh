#!/usr/bin/env bash
# Fill .whl/ (git-ignored; pass `carry: [".whl"]` to the device runs) with what the GPU
# machine lacks: CPython 3.12 manylinux wheels of the packages below (device_env.sh
# installs them into /tmp/site there) and this machine's redis-server with its libraries
# (bench/device/pack_redis.sh). Run it here, before the first device call of a session.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_5_x86_64 -d .whl \
  posix_ipc==1.3.2 redis==8.1.0 hiredis==3.5.0 lmdb==3.0.0 \
  pytest-redis==5.0.1 mirakuru==3.1.0 port-for==1.1.1
bash bench/device/pack_redis.sh
ls .whl && du -sh .whl
