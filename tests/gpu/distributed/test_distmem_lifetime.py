"""Nothing of a DistMemBlock stays in /dev/shm, however its processes end (gpu.dist.journal).

Each test runs the block in a child process where the way it ends matters (an exit with
the block alive, SIGKILL, SIGTERM, a fork), on the CPU twin.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu import BadArgumentError, DistMemBlock, LayerType, NVEmbedding
from gpu.dist.groups import GroupError
from gpu.dist.journal import GENERATED, reap_orphaned_journals
from hostcache import segment
from tests.gpu import distmem_holder
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[3]


def entries(name: str) -> list[str]:
    """The segment and lock file of ``name`` that exist in /dev/shm."""
    return [p for p in (segment.shm_path(name), segment.lock_path(name)) if os.path.exists(p)]


def lock_inodes(name: str) -> set[int]:
    """Inodes of the lock files of ``name`` this process holds open, found through
    /proc/self/fd (a journal's lock file has no name once the block is built: the link
    reads "<path> (deleted)")."""
    path = segment.lock_path(name)
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in (path, path + " (deleted)"):
                found.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # the descriptor of the listing itself, closed meanwhile
            continue
    return found


def remove(name: str) -> None:
    for p in entries(name):
        os.unlink(p)


def holder(mode: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.gpu.distmem_holder", mode], cwd=ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, **env})


def read_report(proc: subprocess.Popen[str]) -> tuple[str, bool]:
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert len(line) == 2, f"the holder said {line!r} (exit status {proc.poll()})"
    return line[0], line[1] == "True"


def kill(proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == -sig


def test_a_block_has_no_name_in_dev_shm_once_built() -> None:
    block = DistMemBlock(64, 4, devices="cpu")
    try:
        assert GENERATED.fullmatch(block.name)
        assert entries(block.name) == []
        block.write(torch.tensor([1, 2]), torch.ones(2, 4))  # the journal still works
        keys, _, _ = block.changes_since(0)
        assert sorted(keys.tolist()) == [1, 2]
    finally:
        block.close()


def test_a_given_name_is_free_again_once_the_block_is_built(table_name) -> None:
    with DistMemBlock(8, 4, devices="cpu", name=table_name) as a:
        assert entries(table_name) == []
        with DistMemBlock(8, 4, devices="cpu", name=table_name) as b:  # no clash
            a.write(torch.tensor([1]), torch.ones(1, 4))
            assert b.changes_since(0)[0].numel() == 0  # two blocks, two journals


SCRIPT = """
import sys
import torch
from gpu import DestructionOrderError, DistMemBlock, GPUError, LayerType, NVEmbedding

class Adapter:  # keeps its blocks for the life of the process, as a test suite might
    blocks = []

block = DistMemBlock(100, 4, devices="cpu")
Adapter.blocks.append(block)
print(block.name, flush=True)
try:
    NVEmbedding(100, 8, torch.float32, LayerType.LinearUVM, storage=block, device="cpu")
except GPUError:
    pass  # refused, as expected
layer = NVEmbedding(100, 4, torch.float32, LayerType.LinearUVM, storage=block, device="cpu")
if sys.argv[1] == "raise":
    block.close()  # DestructionOrderError: the layer still uses the block
"""


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_block_alive_at_exit_leaves_nothing(how) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, how], cwd=ROOT, text=True,
                         capture_output=True, timeout=120)
    name = out.stdout.split()[0]
    try:
        assert (out.returncode != 0) == (how == "raise"), out.stderr[-2000:]
        if how == "raise":
            assert "DestructionOrderError" in out.stderr
        assert entries(name) == []
    finally:
        remove(name)


def test_a_refused_layer_and_a_dropped_block_leave_nothing() -> None:
    block = DistMemBlock(100, 4, devices="cpu")
    name = block.name
    with pytest.raises(BadArgumentError):
        NVEmbedding(100, 8, torch.float32, LayerType.LinearUVM, storage=block, device="cpu")
    block.close()  # no layer registered itself: the block closes
    assert entries(name) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_process_leaves_nothing(sig) -> None:
    proc = holder("solo")
    name = None
    try:
        name, exists = read_report(proc)
        assert not exists
        kill(proc, sig)
        assert entries(name) == []
    finally:
        proc.kill()
        proc.wait()
        if name:
            remove(name)


def test_killed_ranks_of_a_group_leave_nothing() -> None:
    env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [holder("group", RANK=str(r), LOCAL_RANK=str(r), **env) for r in range(2)]
    names: list[str] = []
    try:
        for p in procs:
            names.append(read_report(p)[0])
        assert names[0] == names[1]
        for p in procs:
            kill(p)
        assert entries(names[0]) == []
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for n in set(names):
            remove(n)


def test_a_journal_left_by_a_kill_inside_the_constructor_is_reaped_by_the_next_block():
    proc = holder("window")
    name = None
    try:
        name, exists = read_report(proc)
        assert exists  # created, not yet unlinked: the one window a kill can hit
        assert name not in reap_orphaned_journals()  # its creator is alive: it stays
        assert len(entries(name)) == 2
        kill(proc)
        with DistMemBlock(10, 4, devices="cpu"):  # the next block reaps it
            pass
        assert entries(name) == []
    finally:
        proc.kill()
        proc.wait()
        if name:
            remove(name)


def test_a_forked_child_writing_the_block_uses_the_same_lock_and_leaves_no_lock_file():
    block = DistMemBlock(10, 4, devices="cpu")
    parent_inodes = lock_inodes(block.name)
    assert len(parent_inodes) == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write a row (the journal takes its writer lock), report
        status = 1
        try:
            os.close(r)
            block.write(torch.tensor([4]), torch.full((1, 4), 7.0))
            os.write(w, " ".join(map(str, sorted(lock_inodes(block.name)))).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r) as f:
        child_ino = f.read()
    _, status = os.waitpid(pid, 0)
    try:
        assert status == 0
        assert set(map(int, child_ino.split())) == parent_inodes  # one lock for both
        assert entries(block.name) == []  # and no lock file made up by name
        assert torch.equal(block.read(torch.tensor([4])), torch.full((1, 4), 7.0))
        assert 4 in block.changes_since(0)[0].tolist()
    finally:
        block.close()
        remove(block.name)



class BreaksInJournal(distmem_holder.StopInJournal):
    """A one-process communicator whose broadcast after the journal's creation fails."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def bcast(self, obj, root=0):
        if obj is None and self.name is not None:
            raise self.error
        return super().bcast(obj, root)


@pytest.mark.parametrize("error", [GroupError("the group broke"), KeyboardInterrupt()])
def test_a_construction_failing_after_the_journal_was_created_leaves_nothing(error) -> None:
    comm = BreaksInJournal(error)
    with pytest.raises(type(error)):
        DistMemBlock(10, 4, devices="cpu", group=comm)
    assert comm.name is not None and entries(comm.name) == []
