"""Triton's cache key remembered per node (gpu/kernels/triton_start.py): the same key as
Triton's own function, read back by a fresh process instead of re-hashing Triton, and
computed again whenever Triton's files change."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.kernels.triton_start import fingerprint, remembered

ROOT = Path(__file__).resolve().parents[3]


def _tree(root: Path) -> Path:
    for part, name, body in [("_C", "libtriton.so", b"\x7fELF" * 64),
                             ("compiler", "compiler.py", b"x = 1\n"),
                             ("backends/nvidia", "driver.py", b"y = 2\n"),
                             ("language", "core.py", b"z = 3\n")]:
        (root / part).mkdir(parents=True, exist_ok=True)
        (root / part / name).write_bytes(body)
    return root


def test_fingerprint_follows_every_change_to_the_files(tmp_path: Path) -> None:
    root = _tree(tmp_path / "triton")
    first = fingerprint(root, "3.6.0")
    assert fingerprint(root, "3.6.0") == first
    assert fingerprint(root, "3.6.1") != first
    seen = {first}
    lib = root / "_C" / "libtriton.so"
    lib.write_bytes(lib.read_bytes() + b"\0")  # NOTE: rebuilt library, another size
    seen.add(fingerprint(root, "3.6.0"))
    st = lib.stat()
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # same size, newer
    seen.add(fingerprint(root, "3.6.0"))
    (root / "language" / "extra.py").write_text("w = 4\n")
    seen.add(fingerprint(root, "3.6.0"))
    (root / "compiler" / "compiler.py").unlink()
    seen.add(fingerprint(root, "3.6.0"))
    assert len(seen) == 5
    (root / "language" / "__pycache__").mkdir()  # NOTE: bytecode written on first import
    (root / "language" / "__pycache__" / "core.cpython-312.pyc").write_bytes(b"\0" * 16)
    assert fingerprint(root, "3.6.0") in seen


def test_remembered_computes_once_per_fingerprint(tmp_path: Path) -> None:
    calls: list[int] = []

    def compute() -> str:
        calls.append(1)
        return f"key-{len(calls)}"

    where = tmp_path / "cache" / "nvecache"
    assert remembered(where, "a" * 64, compute) == "key-1"
    assert remembered(where, "a" * 64, compute) == "key-1"
    assert len(calls) == 1
    assert remembered(where, "b" * 64, compute) == "key-2"  # NOTE: Triton changed
    assert len(calls) == 2
    files = sorted(where.iterdir())
    assert [f.read_text() for f in files] == ["key-1", "key-2"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE(where.stat().st_mode) == 0o700


def test_unwritable_directory_still_gives_the_key(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # NOTE: a file where the directory would go
    calls: list[int] = []

    def compute() -> str:
        calls.append(1)
        return "k"

    assert remembered(blocker / "nvecache", "c" * 64, compute) == "k"
    assert remembered(blocker / "nvecache", "c" * 64, compute) == "k"
    assert len(calls) == 2  # NOTE: nothing remembered, nothing broken


SCRIPT = r"""
import json, sys
from pathlib import Path
import triton
from triton.runtime import cache
original = cache.triton_key
from gpu.kernels.triton_access import triton_available
assert triton_available()
key = cache.triton_key()
out = {"installed": cache.triton_key is not original, "key": key}
if sys.argv[1] == "compare":
    out["same_as_triton"] = key == original()
print(json.dumps(out))
"""


def _run(cache_dir: Path, mode: str) -> dict:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fresh_processes_share_triton_s_own_key(tmp_path: Path) -> None:
    first = _run(tmp_path, "compare")
    assert first["installed"] and first["same_as_triton"]
    (memo,) = (tmp_path / "nvecache").iterdir()
    assert memo.read_text() == first["key"]
    # NOTE: the next process reads the key back: a planted value proves it is not re-hashed
    memo.write_text("planted")
    assert _run(tmp_path, "read")["key"] == "planted"


PRIME = r"""
import json, sys
import torch
from gpu.kernels import triton_start
from gpu.kernels.triton_access import triton_available
assert triton_available()
triton_start.prime()
before = set(sys.modules)
from triton.runtime.jit import mangle_type
mangle_type(torch.zeros(3, dtype=torch.int8))  # NOTE: what a first launch specializes
print(json.dumps({"new_modules": sorted(set(sys.modules) - before)}))
"""


def test_prime_leaves_the_first_launch_nothing_to_import(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", PRIME], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["new_modules"] == []
    (memo,) = (tmp_path / "nvecache").iterdir()  # NOTE: the key was computed and remembered
    assert memo.read_text()
