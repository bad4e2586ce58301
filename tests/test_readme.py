"""README stays true: CI runs README's test command verbatim, and every ```python block
runs as pasted."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from apps.cli import build_parser
from hostcache import segment

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks[:2]]


def test_ci_runs_readmes_test_command_verbatim() -> None:
    main_job, tests = _commands()
    assert "pytest" in tests and "hostcache demo" in main_job
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_main_job_names_a_real_subcommand() -> None:
    main_job, _ = _commands()
    argv = main_job.split("hostcache ", 1)[1].split()
    args = build_parser().parse_args(argv)
    assert args.replicas == 2 and args.seconds == 20


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


@contextlib.contextmanager
def _machine_wide_lock() -> Iterator[None]:
    """The README's blocks use fixed table names: one pytest session at a time runs them
    (an flock on the temp directory itself, so no lock file is left behind)."""
    fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@pytest.mark.redis
@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_every_python_block_of_the_readme_runs_as_pasted(index: int, tmp_path: Path) -> None:
    """Each ```python block, run alone in a fresh interpreter (on the CPU here, on CUDA
    where a GPU is present), exits 0 and leaves no table behind."""
    block = _python_blocks()[index]
    names = set(re.findall(r'"(example_[a-z]+)"', block))
    with _machine_wide_lock():
        done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        if "found = bag.update(" in block:  # update() says what it did: the key it created
            assert "tensor([ True, False]" in done.stdout  # first was found, the other not
        assert not names & set(segment.list_names())
        r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        assert not [k for n in names for k in r.scan_iter(match=f"psc:{{{n}*")]

