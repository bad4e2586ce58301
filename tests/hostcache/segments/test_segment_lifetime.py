"""Segments and lock files: nothing outlives what it belongs to (failed creations, tables
removed under an attacher, forks, orphan lock files), and the shared-memory log."""

from __future__ import annotations

import os

import pytest
import torch

from hostcache import HostCache, SegmentNotFoundError, SharedMemBlock, layout, segment, shmlog


def entries(name: str) -> list[str]:
    return [p for p in (segment.shm_path(name), segment.lock_path(name)) if os.path.exists(p)]


def test_a_creation_that_fails_while_initialising_leaves_no_segment_and_no_lock(
        table_name: str) -> None:
    geo = layout.plan(layout.KIND_LINEAR, capacity=4, dim=2, dtype=torch.float32)

    def failing_init(mapping: segment.Mapping, geo: layout.Geometry) -> None:
        assert len(entries(table_name)) == 2  # the segment and its lock file exist here
        raise KeyboardInterrupt  # e.g. Ctrl-C while a big table is being initialised

    with pytest.raises(KeyboardInterrupt):
        segment.create(table_name, geo, init=failing_init)
    assert entries(table_name) == []


def test_attaching_a_table_removed_meanwhile_leaves_no_lock_file(table_name: str) -> None:
    SharedMemBlock.create(table_name, num_rows=4, dim=2).close()
    mapping, geo = segment.attach(table_name)  # mapped; now `hostcache rm` runs
    segment.unlink(table_name)
    try:
        with pytest.raises(SegmentNotFoundError, match="removed"):
            SharedMemBlock(table_name, mapping, geo)  # the rest of attach()
    finally:
        mapping.close()
    assert entries(table_name) == []


def test_a_missing_lock_file_of_an_existing_table_is_made_again(table_name: str) -> None:
    SharedMemBlock.create(table_name, num_rows=4, dim=2, mode=0o640).close()
    os.unlink(segment.lock_path(table_name))
    try:
        with SharedMemBlock.attach(table_name) as mb:
            mb.write(torch.tensor([1]), torch.ones(1, 2))
        assert os.stat(segment.lock_path(table_name)).st_mode & 0o777 == 0o640
    finally:
        segment.unlink(table_name)
    assert entries(table_name) == []


def test_unlink_removes_a_lock_file_left_without_its_segment(table_name: str) -> None:
    segment.open_lock_file(table_name).close()
    segment.unlink(table_name)  # what `hostcache rm --force NAME` calls
    assert entries(table_name) == []
    with pytest.raises(SegmentNotFoundError):
        segment.unlink(table_name)  # nothing left: a missing table is still an error


def test_a_forked_child_locks_its_own_table_after_the_name_was_reused(
        table_name: str) -> None:
    old = HostCache.create(table_name, capacity=64, dim=2)
    old_ino = old.lock_inode
    HostCache.unlink(table_name)  # removed while `old` is attached,
    new = HostCache.create(table_name, capacity=64, dim=2)  # and created again
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child writes through the old handle: the old table's lock
        status = 1
        try:
            os.close(r)
            old.insert(torch.tensor([5]), torch.ones(1, 2))
            os.write(w, str(old.lock_inode).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r) as f:
        child_ino = f.read()
    _, status = os.waitpid(pid, 0)
    try:
        assert os.waitstatus_to_exitcode(status) == 0
        assert int(child_ino) == old_ino
        assert int(child_ino) != new.lock_inode
        assert bool(old.lookup(torch.tensor([5]))[1].all())
    finally:
        old.close()
        new.close()
        HostCache.unlink(table_name)


def test_the_log_records_what_was_created_and_names_only_those_still_there(
        table_name: str, tmp_path, monkeypatch) -> None:
    log = str(tmp_path / "shm.log")
    monkeypatch.setenv(shmlog.ENV, log)
    a, b = table_name + "a", table_name + "b"
    SharedMemBlock.create(a, num_rows=1, dim=1).close()
    SharedMemBlock.create(b, num_rows=1, dim=1).close()
    files = {os.path.basename(p) for n in (a, b) for p in entries(n)}
    assert {name for _, name in shmlog.recorded(log)} == files
    assert shmlog.leftovers(log) == sorted(files)
    segment.unlink(a)
    monkeypatch.delenv(shmlog.ENV)  # `b` again, by someone this log does not cover
    segment.unlink(b)
    SharedMemBlock.create(b, num_rows=1, dim=1).close()
    try:
        assert shmlog.leftovers(log) == []  # same names, other inodes: not ours
    finally:
        segment.unlink(b)
