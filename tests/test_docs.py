"""Every runnable block of README.md and docs/*.md runs as pasted and leaves nothing behind.

A fenced block is run by its language:

* ```python: ``python -c BLOCK`` in a fresh interpreter (on the CPU here, on CUDA where the
  block picks it and a GPU is present), against the Redis at 127.0.0.1:6379;
* ```bash: ``bash -e -o pipefail -c BLOCK`` (the project's console scripts on ``PATH``);
* ```toml: a node-service config, checked with ``hostcache serve --config FILE --check``.

Each runs in a fresh working directory with ``TMPDIR`` inside it. After it: no segment or
lock file it created is left in /dev/shm (its own ``NVEC_SHM_LOG``), no Redis key of a
table it names (or of the demo's ``demo<pid>-`` tables) that was not there before, and no
``file://`` store it names outside its directory. The blocks use fixed names, so one
pytest session at a time runs them (a machine-wide flock).

A block that cannot run everywhere says so in an HTML comment on the line before it:
``<!-- requires: gpu -->`` (also ``multigpu``, ``mpirun``, ``docker``, ``aoti``: skipped
with that reason where it is missing; ``torchrun``: run as a script by torchrun, two ranks), and
``<!-- run-from: checkout -->`` runs it from the repository's root (paths like
``examples/...``). ``<!-- not-runnable: REASON -->`` marks the few that are not meant to
be run (fragments, installs, a service that runs until stopped); ```yaml and ```json
blocks must carry one, since nothing here runs them. ```text and plain ``` blocks are
output and diagrams, never run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch

from hostcache import segment, shmlog
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REDIS_URL = "redis://127.0.0.1:6379/0"
#: languages this test runs; blocks in MARKED_ONLY languages must carry a marker
RUNNERS = ("python", "bash", "toml")
MARKED_ONLY = ("yaml", "yml", "json", "sh", "shell", "console")
#: what each requirement needs, and whether this machine has it
REQUIREMENTS = {
    "gpu": ("a CUDA GPU", lambda: torch.cuda.is_available()),
    "multigpu": ("two CUDA GPUs", lambda: torch.cuda.device_count() >= 2),
    "torchrun": ("torchrun (comes with torch)", lambda: True),
    "mpirun": ("mpirun and mpi4py (as root: OMPI_ALLOW_RUN_AS_ROOT=1 and "
               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, which Open MPI asks for)",
               lambda: shutil.which("mpirun") is not None and _importable("mpi4py")
               and (os.geteuid() != 0 or os.environ.get("OMPI_ALLOW_RUN_AS_ROOT") == "1"
                    == os.environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"))),
    # the session's probe (tests/aot_probe.py), asked through its fixture in the test
    "aoti": ("a torch whose AOTInductor loads packages (tests/aot_probe.py)", None),
    # NOTE: opt-in: these blocks build images and start containers that outlive the test
    "docker": ("docker, and NVEC_DOCS_DOCKER=1 (the blocks start containers)",
               lambda: shutil.which("docker") is not None
               and os.environ.get("NVEC_DOCS_DOCKER") == "1"),
}
#: what a block prints, where the doc says so: (text in the block, text in its stdout)
PRINTS = [("found = bag.update(", "tensor([ True, False]"),
          ("hit = hostcache_lookup(reg, keys)", "tensor([ True,  True, False]"),
          ("cached.pop(key, None)", "[0, 1, 2, 4, 5, 6, 8, 9]")]
_MARKER = re.compile(r"^<!--\s*(.*?)\s*-->$")
_FENCE = re.compile(r"^```(\S*)\s*$")


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Block:
    """One fenced block of a markdown file, with the marker on the line before it."""

    path: Path
    line: int
    lang: str
    text: str
    marks: tuple[tuple[str, str], ...]

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def mark(self, key: str) -> str | None:
        return next((v for k, v in self.marks if k == key), None)

    @property
    def requires(self) -> list[str]:
        return re.split(r"[\s,]+", self.mark("requires") or "") if self.mark("requires") else []


def _parse_marks(comment: str) -> tuple[tuple[str, str], ...]:
    marks = []
    for part in re.split(r";\s*(?=[a-z-]+:)", comment):  # a reason may hold a ";"
        key, _, value = part.partition(":")
        marks.append((key.strip(), value.strip()))
    return tuple(marks)


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` (top level: a fence at the start of a line)."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(before)
        marks = _parse_marks(marker.group(1)) if marker else ()
        out.append(Block(path, i + 1, opened.group(1), "\n".join(lines[i + 1:end]) + "\n",
                         marks))
        i = end + 1
    return out


ALL = [b for p in DOCS for b in blocks_of(p)]
RUNNABLE = [b for b in ALL if b.lang in RUNNERS and b.mark("not-runnable") is None]


def test_every_block_is_run_or_marked_with_a_known_reason() -> None:
    """Markers use the known keys and requirements; a yaml/json block says why it is not
    run; the blocks found are the ones the docs hold."""
    for b in ALL:
        for key, value in b.marks:
            assert key in {"requires", "run-from", "not-runnable"}, f"{b.id}: marker {key!r}"
            assert value, f"{b.id}: marker {key!r} without a value"
        assert set(b.requires) <= set(REQUIREMENTS), f"{b.id}: requires {b.requires}"
        assert b.mark("run-from") in (None, "checkout"), f"{b.id}: run-from"
        if b.lang in MARKED_ONLY:
            assert b.mark("not-runnable"), f"{b.id}: a {b.lang} block nothing runs, unmarked"
    assert {b.path.name for b in RUNNABLE} >= {"README.md", "hostcache.md", "psclient.md"}


def test_nothing_refers_to_files_outside_the_repository() -> None:
    """What a user gets is the repository: no doc, test, example or module names a path
    beside the checkout."""
    outside = re.compile(r"\.\./shared\b|\bshared/[A-Z][A-Z-]+\.(md|txt)")
    roots = ["README.md", "docs", "tests", "examples", "bench", "nvecache", "gpu", "hostcache",
             "psclient", ".ci", "pyproject.toml"]
    found = []
    for name in roots:
        top = ROOT / name
        for f in [top] if top.is_file() else sorted(top.rglob("*")):
            if f.suffix not in {".py", ".md", ".toml", ".sh", ""} or not f.is_file():
                continue
            if f == Path(__file__).resolve() or "__pycache__" in f.parts:
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if outside.search(line):
                    found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


@contextlib.contextmanager
def _machine_wide_lock() -> Iterator[None]:
    """The docs' blocks use fixed table names: one pytest session at a time runs them (an
    flock on the temp directory itself, so no lock file is left behind)."""
    fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _table_of(key: str) -> str:
    """``psc:{T}:schema``, ``psc:{T:p}...`` -> ``T``."""
    return re.split(r"[:}]", key[len("psc:{"):], maxsplit=1)[0]


def _block_may_create(block: Block, table: str) -> bool:
    """Whether the block names the table (a quoted name, ``--table T``), or it is one of
    the demo's (``demo<pid>-user``): other sessions' tables are never touched."""
    named = re.search(rf"[\"']{re.escape(table)}[\"']|--table {re.escape(table)}\b", block.text)
    return named is not None or re.match(r"demo\d+-", table) is not None


def _stores_named(block: Block) -> list[Path]:
    return [Path(p) for p in re.findall(r"file://(/[^\s\"'`)]+)", block.text)]


def _command(block: Block, tmp_path: Path) -> list[str]:
    if block.lang == "python" and "torchrun" in block.requires:
        script = tmp_path / "block.py"
        script.write_text(block.text)
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                f"--master-port={free_port()}", str(script)]
    if block.lang == "python":
        return [sys.executable, "-c", block.text]
    if block.lang == "bash":
        return ["bash", "-e", "-o", "pipefail", "-c", block.text]
    config = tmp_path / "node.toml"
    config.write_text(block.text)
    return [sys.executable, "-m", "nvecache.apps.cli", "serve", "--config", str(config), "--check"]


def _check_config_printout(block: Block, stdout: str) -> None:
    """``--check`` printed the config: every table of the block, modes in octal as the
    block spells them."""
    config = tomllib.loads(block.text)
    tables = [*config.get("hostcache", []), *config.get("linear", [])]
    printed = json.loads(stdout)["tables"]
    assert [t["name"] for t in printed] == [t["name"] for t in tables]
    assert [t["mode"] for t in printed] == [t.get("mode", "0600") for t in tables]


@pytest.mark.redis
@pytest.mark.parametrize("block", [
    pytest.param(b, id=b.id, marks=[getattr(pytest.mark, r) for r in b.requires
                                    if r in ("gpu", "multigpu")])
    for b in RUNNABLE])
def test_every_block_runs_as_pasted_and_leaves_nothing(block: Block, tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    for need in block.requires:
        what, present = REQUIREMENTS[need]
        if not (request.getfixturevalue("aoti_loads") if present is None else present()):
            pytest.skip(f"{block.id} needs {what}")
    work = tmp_path / "work"
    (work / "tmp").mkdir(parents=True)
    log = tmp_path / "shm.log"
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "TMPDIR": str(work / "tmp"), shmlog.ENV: str(log),
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    cwd = ROOT if block.mark("run-from") == "checkout" else work
    outside = [p for p in _stores_named(block) if not p.exists()]
    if block.lang == "toml":  # --check creates nothing: not even the state dir
        outside += [p for p in [Path(tomllib.loads(block.text).get("state_dir", "/"))]
                    if not p.exists()]
    r = redis.Redis.from_url(REDIS_URL)
    with _machine_wide_lock():
        keys_before = set(r.scan_iter(match="psc:*"))
        try:
            done = subprocess.run(_command(block, tmp_path), cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=420)
        finally:
            left_keys = sorted(k.decode() for k in set(r.scan_iter(match="psc:*")) - keys_before
                               if _block_may_create(block, _table_of(k.decode())))
            if left_keys:
                r.delete(*left_keys)
            left_shm = shmlog.leftovers(str(log), segment.SHM_DIR)
            for entry in left_shm:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(segment.SHM_DIR, entry))
            left_outside = [str(p) for p in outside if p.exists()]
            for p in outside:
                shutil.rmtree(p, ignore_errors=True)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    assert left_shm == [], f"{block.id} left in /dev/shm: {left_shm}"
    assert left_keys == [], f"{block.id} left Redis keys: {left_keys[:10]}"
    assert left_outside == [], f"{block.id} created outside its directory: {left_outside}"
    for in_block, in_stdout in PRINTS:
        if in_block in block.text:
            assert in_stdout in done.stdout, done.stdout[-2000:]
    if block.lang == "toml":
        _check_config_printout(block, done.stdout)
