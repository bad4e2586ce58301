"""Parameter-server client throughput against its baselines, in one run.

Redis (``--url``): psclient lookups of 8k distinct keys (``--lookup-batch``) against
``redis-benchmark``'s pipelined MGET over the same 8k stored 512-byte values, alternated in
rounds; then 64k-key batches (``--batch``) of dim-128 fp32 rows against ``redis-benchmark``
(pipelined GET/SET of 512-byte values, same server: the server's ceiling) and a naive
redis-py pipeline of GET/SET per key. Also the raw layout choice: HMGET/HSET over hash
partitions against MGET/MSET over plain keys, and HMGET replies read off the socket in bulk
(psclient.redis.wire) against redis-py's parser.

file:// : lookups of 8k distinct keys of a 1M-row table (``--file-rows``), read from the
row mirror (psclient.file.mirror), against the LMDB read it falls back to
(``FileParameterServer._lookup_lmdb``), the per-key reference path
(:func:`lookup_per_key`), py-lmdb's native batched read
(``Cursor.getmulti``) and LMDB's search alone, alternated in rounds; a batch with
duplicate keys; a plain in-memory dict of the same rows; the embedded-store choice, LMDB
against SQLite (WAL), for the same batches.

Prints one JSON line per result; ratios are against the baseline measured in this run.

    python bench/ps/bench_psclient.py [--quick] [--url redis://127.0.0.1:6379/0]
        [--skip-redis] [--skip-file] [--lookup-batch 8192] [--file-rows 1048576]
        [--lmdb-floor /tmp/lmdb_search_floor]   # cc ... bench/ps/lmdb_search_floor.c, see there
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psclient  # noqa: E402
from bench.ps.file_reads import getmulti_lookup, lookup_per_key, search_only  # noqa: E402
from psclient.codec import (  # noqa: E402
    group_by_partition,
    le_key_bytes,
    row_bytes_list,
)
from psclient.redis import resp  # noqa: E402
from psclient.redis.wire import run_row_pipeline  # noqa: E402


def emit(**rec: object) -> None:
    print(json.dumps(rec), flush=True)


def best_rate(fn: Callable[[], object], rows: int, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return rows / best


def redis_benchmark(host: str, port: int, test: str, n: int, keyspace: int = 0,
                    db: int = 0) -> float | None:
    """redis-benchmark's rows/s for ``test``; ``keyspace`` > 0 adds ``-r keyspace`` (random
    keys ``key:%012d`` below it) instead of one hot key."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    rand = ["-r", str(keyspace)] if keyspace else []
    out = subprocess.run(
        [exe, "-h", host, "-p", str(port), "--dbnum", str(db), "-t", test, "-d", "512",
         "-P", "64", "-n", str(n), *rand, "-q", "--csv"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells[0].upper() == test.upper():
            return float(cells[1])
    return None


def redis_benchmark_mget(host: str, port: int, n: int, keyspace: int, per: int = 16,
                         db: int = 0) -> float | None:
    """redis-benchmark's rows/s for ``MGET`` of ``per`` random keys below ``keyspace`` per
    command (``-P 64``): the server's batched-read ceiling over psclient's working set."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    out = subprocess.run(
        [exe, "-h", host, "-p", str(port), "--dbnum", str(db), "-P", "64",
         "-n", str(max(1, n // per)), "-r", str(keyspace), "-q", "--csv",
         "MGET", *(["key:__rand_int__"] * per)],
        capture_output=True, text=True, timeout=120, check=True).stdout
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells[0].upper().startswith("MGET"):
            return float(cells[1]) * per
    return None


def bench_redis(url: str, batch: int, dim: int, reps: int, bench_n: int, rounds: int) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    db = int(parts.path.strip("/") or 0)
    cmd = (f"redis-benchmark -h {host} -p {port} --dbnum {db} -t get,set -d 512 -P 64 "
           f"-n {bench_n} -q --csv")
    rb_get = redis_benchmark(host, port, "get", bench_n, db=db)
    rb_set = redis_benchmark(host, port, "set", bench_n, db=db)
    emit(bench="redis-benchmark", op="get", rows_per_s=rb_get, command=cmd,
         note="one hot key (key:__rand_int__): every GET reads the same cached 512 bytes")
    emit(bench="redis-benchmark", op="set", rows_per_s=rb_set, command=cmd)
    # NOTE: the same ceiling over a working set like psclient's: `batch` distinct 512-byte
    # keys (key:000000000000 ...), written first by SET -r, read by GET -r (random keys).
    rnd_names = [b"key:%012d" % i for i in range(batch)]
    redis_benchmark(host, port, "set", 16 * batch, keyspace=batch, db=db)
    rb_get_rnd = redis_benchmark(host, port, "get", bench_n, keyspace=batch, db=db)
    emit(bench="redis-benchmark", op="get-random", rows_per_s=rb_get_rnd,
         command=f"{cmd.replace('get,set', 'get')} -r {batch}",
         note=f"random keys over {batch} stored 512-byte values (psclient's working set)")

    rng = np.random.default_rng(0)
    keys = torch.from_numpy(rng.choice(2**40, size=batch, replace=False).astype(np.int64))
    vals = torch.randn(batch, dim)
    table = f"bench-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(url)

    # naive redis-py pipeline: one GET/SET per key, plain string keys
    names = [f"{table}:n:{k}".encode() for k in keys.tolist()]
    vb = row_bytes_list(vals)

    def naive_set() -> None:
        p = r.pipeline(transaction=False)
        for nm, v in zip(names, vb, strict=True):
            p.set(nm, v)
        p.execute()

    def naive_get() -> None:
        p = r.pipeline(transaction=False)
        for nm in names:
            p.get(nm)
        p.execute()

    naive_ins = best_rate(naive_set, batch, reps)
    naive_look = best_rate(naive_get, batch, reps)
    for i in range(0, batch, 4096):
        r.delete(*names[i:i + 4096])
    emit(bench="naive-redis-py-pipeline", op="set", rows_per_s=naive_ins)
    emit(bench="naive-redis-py-pipeline", op="get", rows_per_s=naive_look)

    # raw layouts: HMGET/HSET per partition chunk vs MGET/MSET per partition chunk
    kn = keys.numpy()
    order, bounds = group_by_partition(kn, 64)
    kb = le_key_bytes(kn[order])
    vs = row_bytes_list(vals, order)
    plain = [f"{table}:{{{p}}}:".encode() + k for p, k in
             zip(np.repeat(np.arange(64), np.diff(bounds)).tolist(), kb, strict=True)]

    def run_layout(cmd: str) -> None:
        p = r.pipeline(transaction=False)
        for part in range(64):
            for s in range(int(bounds[part]), int(bounds[part + 1]), 1024):
                e = min(int(bounds[part + 1]), s + 1024)
                hkey = f"{table}:h:{{{part}}}"
                if cmd == "HSET" or cmd == "MSET":
                    args: list[object] = [None] * (2 * (e - s))
                    args[0::2] = kb[s:e] if cmd == "HSET" else plain[s:e]
                    args[1::2] = vs[s:e]
                else:
                    args = list(kb[s:e] if cmd == "HMGET" else plain[s:e])
                if cmd in ("HSET", "HMGET"):
                    p.execute_command(cmd, hkey, *args)
                else:
                    p.execute_command(cmd, *args)
        p.execute()

    mem0 = int(r.info("memory")["used_memory"])
    for cmd in ("HSET", "HMGET", "MSET", "MGET"):
        rate = best_rate(lambda c=cmd: run_layout(c), batch, reps)
        mem = int(r.info("memory")["used_memory"])
        extra = {"bytes_per_row": (mem - mem0) / batch} if cmd.endswith("SET") else {}
        mem0 = mem
        emit(bench="layout", op=cmd, rows_per_s=rate, note="one pipeline, 1024 keys/command",
             **extra)
    bench_read_paths(r, table, kn[order], bounds, 4 * dim, reps)
    r.delete(*[f"{table}:h:{{{p}}}" for p in range(64)])
    for i in range(0, batch, 4096):
        r.delete(*plain[i:i + 4096])

    # psclient
    with psclient.connect(url, table=table, dim=dim) as ps:
        fresh = iter(range(1, 1 << 30))

        def insert_fresh() -> None:
            base = next(fresh) << 20
            ps.insert(keys + base, vals)

        ins_new = best_rate(insert_fresh, batch, reps)
        ps.insert(keys, vals)
        ins_over = best_rate(lambda: ps.insert(keys, vals), batch, reps)
        perm = keys[torch.randperm(batch)]
        got, found = ps.lookup(perm[:8])
        assert bool(found.all())
        # NOTE: the machine is shared and noisy: alternate the ceiling and psclient lookups
        # in rounds and compare each round's pair (and the best of each).
        ratios, looks, gets, ratios_rnd, gets_rnd = [], [], [], [], []
        mgets, ratios_mget = [], []
        for _ in range(rounds):
            g = redis_benchmark(host, port, "get", bench_n, db=db)
            g_rnd = redis_benchmark(host, port, "get", bench_n, keyspace=batch, db=db)
            g_mget = redis_benchmark_mget(host, port, bench_n, batch, db=db)
            look = best_rate(lambda: ps.lookup(perm), batch, reps)
            looks.append(look)
            if g_mget:
                mgets.append(g_mget)
                ratios_mget.append(look / g_mget)
            if g and g_rnd:
                gets.append(g)
                ratios.append(look / g)
                gets_rnd.append(g_rnd)
                ratios_rnd.append(look / g_rnd)
        # NOTE: like for like with the hot-key ceiling: a batch of 1024 distinct keys, each
        # asked batch/1024 times (the server reads cached rows, as redis-benchmark GET does).
        hot = keys[:1024].repeat(max(1, batch // 1024))
        look_hot = best_rate(lambda: ps.lookup(hot), hot.numel(), reps)
        ps.drop()
    for i in range(0, batch, 4096):
        r.unlink(*rnd_names[i:i + 4096])
    emit(bench="psclient-redis", op="insert-new", rows_per_s=ins_new,
         vs_redis_benchmark_set=ins_new / rb_set if rb_set else None,
         vs_naive=ins_new / naive_ins)
    emit(bench="psclient-redis", op="insert-overwrite", rows_per_s=ins_over,
         vs_redis_benchmark_set=ins_over / rb_set if rb_set else None,
         vs_naive=ins_over / naive_ins, note="overwrites also append keys to the change feed")
    emit(bench="psclient-redis", op="lookup", rows_per_s=max(looks),
         redis_benchmark_get_best=max(gets) if gets else None,
         vs_redis_benchmark_get_best=max(looks) / max(gets) if gets else None,
         vs_redis_benchmark_get_per_round=[round(x, 3) for x in ratios],
         vs_redis_benchmark_get_median=float(np.median(ratios)) if ratios else None,
         redis_benchmark_get_random_best=max(gets_rnd) if gets_rnd else None,
         vs_redis_benchmark_get_random_best=max(looks) / max(gets_rnd) if gets_rnd else None,
         vs_redis_benchmark_get_random_per_round=[round(x, 3) for x in ratios_rnd],
         redis_benchmark_mget16_random_best=max(mgets) if mgets else None,
         vs_redis_benchmark_mget16_random_best=max(looks) / max(mgets) if mgets else None,
         vs_redis_benchmark_mget16_random_per_round=[round(x, 3) for x in ratios_mget],
         vs_naive=max(looks) / naive_look,
         goal=">= 0.70 of redis-benchmark over the same working set (MGET x16, random keys)")
    emit(bench="psclient-redis", op="lookup-hot-1024-keys", rows_per_s=look_hot,
         vs_redis_benchmark_get_best=look_hot / max(gets) if gets else None,
         note="1024 distinct keys repeated to the batch size: the server's working set is "
              "cached, as with redis-benchmark's one hot key")


def bench_redis_lookup(url: str, batch: int, dim: int, reps: int, bench_n: int,
                       rounds: int) -> None:
    """psclient lookups of ``batch`` distinct keys against redis-benchmark's pipelined MGET
    (16 random keys per command, ``-P 64``) over ``batch`` stored 512-byte values: the same
    working set and value size on the same server, alternated in ``rounds``."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    db = int(parts.path.strip("/") or 0)
    redis_benchmark(host, port, "set", 16 * batch, keyspace=batch, db=db)  # key:0..batch-1
    rng = np.random.default_rng(2)
    keys = torch.from_numpy(rng.choice(2**40, size=batch, replace=False).astype(np.int64))
    table = f"bench-{uuid.uuid4().hex[:8]}"
    looks, mgets, ratios = [], [], []
    with psclient.connect(url, table=table, dim=dim) as ps:
        ps.insert(keys, torch.randn(batch, dim))
        perm = keys[torch.randperm(batch)]
        got, found = ps.lookup(perm)
        assert bool(found.all())
        for _ in range(rounds):
            g = redis_benchmark_mget(host, port, bench_n, batch, db=db)
            look = best_rate(lambda: ps.lookup(perm), batch, reps)
            looks.append(look)
            if g:
                mgets.append(g)
                ratios.append(look / g)
        ps.drop()
    r = redis.Redis.from_url(url)
    names = [b"key:%012d" % i for i in range(batch)]
    for i in range(0, batch, 4096):
        r.unlink(*names[i:i + 4096])
    emit(bench="psclient-redis", op=f"lookup-{batch}-distinct", rows_per_s=max(looks),
         rows_per_s_per_round=[round(x) for x in looks],
         redis_benchmark_mget16_per_round=[round(x) for x in mgets],
         vs_redis_benchmark_mget16_per_round=[round(x, 3) for x in ratios],
         vs_redis_benchmark_mget16_median=float(np.median(ratios)) if ratios else None,
         vs_redis_benchmark_mget16_best=max(looks) / max(mgets) if mgets else None,
         command=f"redis-benchmark -h {host} -p {port} --dbnum {db} -P 64 "
                 f"-n {max(1, bench_n // 16)} -r {batch} -q --csv MGET key:__rand_int__ x16",
         goal=">= 0.8 of redis-benchmark MGET over the same working set",
         goal_met=bool(ratios) and float(np.median(ratios)) >= 0.8)


def bench_read_paths(r: redis.Redis, table: str, keys: np.ndarray, bounds: np.ndarray,
                     row_bytes: int, reps: int, rounds: int = 10) -> None:
    """HMGET replies read off the socket in bulk against redis-py's parser, alternated.

    The rows are the layout bench's hashes (``{table}:h:{p}``, one pipeline per partition,
    run one after another), copied into one array as a lookup does: what
    psclient.redis.wire's bulk read saves per batch, in rows/s and in client CPU.
    """
    pipes = []
    for part in range(64):
        a, b = int(bounds[part]), int(bounds[part + 1])
        hkey = f"{table}:h:{{{part}}}".encode()
        payload: list[bytes | memoryview] = []
        for s in range(a, b, 512):
            e = min(b, s + 512)
            payload += [resp.header(2 + e - s, b"HMGET", hkey),
                        resp.as_buffer(resp.field_records(keys[s:e]))]
        pipes.append((payload, len(range(a, b, 512)), (b - a) * (row_bytes + 16)))
    out = np.empty(keys.size, dtype=f"V{row_bytes}")  # NOTE: rows land here, as in a lookup

    def read(bulk: bool) -> None:
        pos = 0
        for payload, ncmds, expect in pipes:
            for reply in run_row_pipeline(r, payload, ncmds, expect, row_bytes, bulk=bulk):
                m = len(reply)
                if isinstance(reply, np.ndarray):
                    out[pos:pos + m] = reply
                else:
                    out[pos:pos + m] = np.fromiter(reply, dtype=out.dtype, count=m)
                pos += m
        assert pos == keys.size

    wall: dict[str, list[float]] = {"bulk": [], "parser": []}
    cpu: dict[str, list[float]] = {"bulk": [], "parser": []}
    for _ in range(rounds):
        for mode in wall:
            for _ in range(reps):
                c0, t0 = time.process_time(), time.perf_counter()
                read(mode == "bulk")
                wall[mode].append(time.perf_counter() - t0)
                cpu[mode].append(time.process_time() - c0)
    rate = {m: keys.size / float(np.median(wall[m])) for m in wall}
    for mode in wall:
        emit(bench="hmget-read", op=mode, rows_per_s=rate[mode],
             client_cpu_ms_per_batch=1e3 * float(np.median(cpu[mode])),
             vs_parser=rate[mode] / rate["parser"],
             note="replies to rows, medians over alternated rounds; one pipeline per "
                  "partition, 512 keys per command, sequential")


def lmdb_floor(exe: str, store: str, table: str, keys: np.ndarray, threads: int) -> object:
    """bench/ps/lmdb_search_floor.c (built by the user) on the same store and keys: LMDB's own
    lookup rate from C, no Python."""
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        keys.astype("<i8").tofile(f.name)
        out = subprocess.run([exe, store, f"rows:{table}", f.name, str(threads)],
                             capture_output=True, text=True, timeout=300, check=True).stdout
    return json.loads(out)


def bench_file(insert_batch: int, lookup_batch: int, dim: int, reps: int, total: int,
               rounds: int, floor_exe: str | None = None) -> None:
    """file:// at ``lookup_batch`` distinct keys of a ``total``-row table: the lookup against
    the per-key reference path, py-lmdb's getmulti and LMDB's search alone, alternated in
    ``rounds`` (and LMDB from C when ``floor_exe`` is given); then a dict of the same rows
    and SQLite (WAL) on the same batches."""
    rng = np.random.default_rng(1)
    keys = torch.from_numpy(rng.choice(2**40, size=total, replace=False).astype(np.int64))
    vals = torch.randn(total, dim)
    probe = keys[torch.from_numpy(rng.choice(total, size=lookup_batch, replace=False))]
    # NOTE: a batch with duplicates, as a serving batch has: 1024 distinct keys repeated
    hot = keys[:1024].repeat(max(1, lookup_batch // 1024))
    tmp = tempfile.mkdtemp(prefix="psc-bench-")
    try:
        with psclient.connect(f"file://{tmp}/lmdb", table="bench", dim=dim) as ps:
            t = time.perf_counter()
            for a in range(0, total, insert_batch):
                ps.insert(keys[a:a + insert_batch], vals[a:a + insert_batch])
            ins_rate = total / (time.perf_counter() - t)
            pn = probe.numpy()
            want, want_found = lookup_per_key(ps, pn)
            got, found = ps.lookup(probe)
            assert bool(found.all()) and torch.equal(found, want_found)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            gm_vals, gm_found = getmulti_lookup(ps, pn)
            assert gm_found.all() and gm_vals.tobytes() == got.numpy().tobytes()
            lmdb_got, _ = ps._lookup_lmdb(pn)
            assert torch.equal(lmdb_got.view(torch.uint8), got.view(torch.uint8))
            runs: dict[str, list[float]] = {"lookup": [], "lmdb": [], "per-key": [],
                                            "getmulti": [], "search-only": []}
            for _ in range(rounds):
                runs["lookup"].append(best_rate(lambda: ps.lookup(probe), lookup_batch, reps))
                runs["lmdb"].append(best_rate(lambda: ps._lookup_lmdb(pn), lookup_batch, reps))
                runs["per-key"].append(
                    best_rate(lambda: lookup_per_key(ps, pn), lookup_batch, reps))
                runs["getmulti"].append(
                    best_rate(lambda: getmulti_lookup(ps, pn), lookup_batch, reps))
                runs["search-only"].append(
                    best_rate(lambda: search_only(ps, pn), lookup_batch, reps))
            if floor_exe:
                for threads in (1, 2):
                    emit(bench="lmdb-from-c", op=f"lookup-{lookup_batch}-distinct",
                         table_rows=total, **lmdb_floor(floor_exe, f"{tmp}/lmdb", "bench",
                                                        np.sort(pn), threads),
                         command=f"{floor_exe} STORE rows:bench KEYS {threads}")
            hn = hot.numpy()
            hot_new = best_rate(lambda: ps.lookup(hot), hot.numel(), reps)
            hot_old = best_rate(lambda: lookup_per_key(ps, hn), hot.numel(), reps)
            ratios = [a / b for a, b in zip(runs["lookup"], runs["per-key"], strict=True)]
            look = max(runs["lookup"])
        emit(bench="psclient-file(lmdb)", op="insert", rows_per_s=ins_rate, table_rows=total,
             batch=insert_batch, note="a durable commit (sync=True) per batch")
        emit(bench="psclient-file(lmdb)", op=f"lookup-{lookup_batch}-distinct",
             rows_per_s=look, table_rows=total,
             rows_per_s_per_round=[round(x) for x in runs["lookup"]],
             lmdb_path_rows_per_s=max(runs["lmdb"]),
             vs_lmdb_path_median=float(np.median([a / b for a, b in zip(
                 runs["lookup"], runs["lmdb"], strict=True)])),
             per_key_rows_per_s=max(runs["per-key"]),
             vs_per_key_per_round=[round(x, 3) for x in ratios],
             vs_per_key_median=float(np.median(ratios)),
             getmulti_rows_per_s=max(runs["getmulti"]),
             vs_getmulti=look / max(runs["getmulti"]),
             lmdb_search_only_rows_per_s=max(runs["search-only"]),
             goal=">= 5M rows/s", goal_met=look >= 5e6)
        emit(bench="psclient-file(lmdb)", op=f"lookup-{lookup_batch}-of-1024-distinct",
             rows_per_s=hot_new, per_key_rows_per_s=hot_old, vs_per_key=hot_new / hot_old,
             note="duplicate keys: the lookup reads each distinct key once")

        # baseline: a plain in-memory dict of key -> row bytes, same rows and probe
        d = dict(zip(keys.tolist(), row_bytes_list(vals), strict=True))

        def dict_lookup() -> torch.Tensor:
            got = list(map(d.get, probe.tolist()))
            flat = np.frombuffer(b"".join(got), dtype=np.float32)
            return torch.from_numpy(flat.copy()).view(lookup_batch, dim)

        dict_rate = best_rate(dict_lookup, lookup_batch, reps)
        d.clear()  # NOTE: 1M row objects: give the memory back before SQLite
        emit(bench="in-memory-dict", op=f"lookup-{lookup_batch}-distinct", rows_per_s=dict_rate,
             table_rows=total, lmdb_over_dict=look / dict_rate)

        # embedded-store choice: SQLite (WAL, INTEGER PRIMARY KEY) for the same batches
        db = sqlite3.connect(f"{tmp}/sqlite.db")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v BLOB NOT NULL)")
        rows = list(zip(keys.tolist(), row_bytes_list(vals), strict=True))
        t = time.perf_counter()
        for a in range(0, total, insert_batch):
            with db:
                db.executemany("INSERT OR REPLACE INTO t VALUES (?, ?)",
                               rows[a:a + insert_batch])
        sq_ins = total / (time.perf_counter() - t)
        pj = json.dumps(probe.tolist())

        def sq_lookup() -> None:
            db.execute("SELECT t.k, t.v FROM json_each(?) j JOIN t ON t.k = j.value",
                       (pj,)).fetchall()

        sq_look = best_rate(sq_lookup, lookup_batch, reps)
        db.close()
        emit(bench="sqlite-wal", op="insert", rows_per_s=sq_ins,
             lmdb_over_sqlite=ins_rate / sq_ins)
        emit(bench="sqlite-wal", op=f"lookup-{lookup_batch}-distinct", rows_per_s=sq_look,
             lmdb_over_sqlite=look / sq_look)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few repetitions (seconds)")
    ap.add_argument("--url", default=os.environ.get("NVEC_BENCH_REDIS_URL",
                                                    "redis://127.0.0.1:6379/0"))
    ap.add_argument("--batch", type=int, default=65536,
                    help="keys per batch of the Redis runs and of file:// inserts")
    ap.add_argument("--lookup-batch", type=int, default=8192,
                    help="distinct keys per lookup of the 8k-key runs (Redis and file://)")
    ap.add_argument("--file-rows", type=int, default=None,
                    help="rows of the file:// table (default 1M; 128k with --quick)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--skip-file", action="store_true")
    ap.add_argument("--lmdb-floor", metavar="BIN", default=None,
                    help="bench/ps/lmdb_search_floor.c built: LMDB's lookup rate from C as well")
    a = ap.parse_args()
    reps = 3 if a.quick else 10
    rounds = 2 if a.quick else 5
    file_rows = a.file_rows or (1 << 17 if a.quick else 1 << 20)
    emit(bench="config", batch=a.batch, lookup_batch=a.lookup_batch, file_rows=file_rows,
         dim=a.dim, dtype="float32", reps=reps, cpus=os.cpu_count(),
         date=time.strftime("%Y-%m-%d"), load_avg=os.getloadavg())
    if not a.skip_redis:
        bench_n = 200_000 if a.quick else 1_000_000
        try:
            bench_redis_lookup(a.url, a.lookup_batch, a.dim, reps, bench_n, rounds)
            bench_redis(a.url, a.batch, a.dim, reps, bench_n, rounds)
        except (redis.RedisError, psclient.PSClientError) as e:
            emit(bench="psclient-redis", skipped=f"no Redis at {a.url}: {e}")
    if not a.skip_file:
        bench_file(a.batch, a.lookup_batch, a.dim, reps, file_rows, rounds, a.lmdb_floor)


if __name__ == "__main__":
    main()
