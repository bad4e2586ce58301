#!/usr/bin/env bash
# Pack this machine's redis-server with the shared libraries it needs (all but glibc's)
# into .whl/redis/, which the device runs carry along (`carry: [".whl"]`); device_env.sh
# starts it on 127.0.0.1:6379 when no Redis answers there, for the Hierarchical layer's
# Redis benchmark on the GPU machine (which has no Redis of its own). Glibc comes from the
# GPU machine: if its glibc is older than this one's, the server does not start and the
# benchmark records why. bin/redis-server (below) starts it by name with its own libraries.
set -euo pipefail
cd "$(dirname "$0")/../.."
exe=$(command -v redis-server)
dest=.whl/redis
rm -rf "$dest" && mkdir -p "$dest"
cp "$exe" "$dest/redis-server"
ldd "$exe" | awk '/=> \// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;
    *) cp -L "$lib" "$dest/" ;;
  esac
done
# bin/redis-server: the server with its own libraries, for whatever starts one by name
# (PATH=$PWD/.whl/redis/bin:$PATH: the test servers, a local cluster for the benchmarks),
# without putting those libraries in front of anyone else's
mkdir -p "$dest/bin"
cat >"$dest/bin/redis-server" <<'SH'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")/..
LD_LIBRARY_PATH=$here exec "$here/redis-server" "$@"
SH
chmod +x "$dest/bin/redis-server"
du -sh "$dest"
