"""Segment ownership: names, modes, attach validation of foreign or damaged segments."""

from __future__ import annotations

import os
import stat

import numpy as np
import posix_ipc
import pytest
import torch

from hostcache import (
    BadNameError,
    CorruptedHeaderError,
    GeometryMismatchError,
    HostCache,
    LayoutVersionError,
    SegmentExistsError,
    SegmentNotFoundError,
    SharedMemBlock,
    layout,
    segment,
)


@pytest.mark.parametrize("name", ["", "a/b", "x" * 101, "sp ace", "..", "ümlaut", None, 5])
def test_invalid_names_are_refused(name: object) -> None:
    with pytest.raises(BadNameError):
        HostCache.create(name, capacity=8, dim=2)  # type: ignore[arg-type]
    with pytest.raises(BadNameError):
        HostCache.attach(name)  # type: ignore[arg-type]


def test_segment_and_lock_file_are_0600_by_default(table_name: str) -> None:
    old = os.umask(0)
    try:
        hc = HostCache.create(table_name, capacity=8, dim=2)
    finally:
        os.umask(old)
    try:
        for path in (segment.shm_path(table_name), segment.lock_path(table_name)):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
            assert os.stat(path).st_uid == os.getuid()
        assert hc.geometry.creator_uid == os.getuid()
    finally:
        hc.close()
        HostCache.unlink(table_name)
    assert not os.path.exists(segment.shm_path(table_name))
    assert not os.path.exists(segment.lock_path(table_name))


def test_explicit_group_mode_is_exact_whatever_the_umask(table_name: str) -> None:
    old = os.umask(0o022)
    try:
        block = SharedMemBlock.create(table_name, num_rows=4, dim=2, mode=0o660)
    finally:
        os.umask(old)
    with block:
        try:
            for path in (segment.shm_path(table_name), segment.lock_path(table_name)):
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o660, path
        finally:
            SharedMemBlock.unlink(table_name)


def test_create_twice_and_attach_missing(table_name: str) -> None:
    with pytest.raises(SegmentNotFoundError, match="create"):
        HostCache.attach(table_name)
    with HostCache.create(table_name, capacity=8, dim=2):
        try:
            with pytest.raises(SegmentExistsError):
                HostCache.create(table_name, capacity=8, dim=2)
            with pytest.raises(SegmentExistsError):
                SharedMemBlock.create(table_name, num_rows=8, dim=2)
        finally:
            HostCache.unlink(table_name)
    with pytest.raises(SegmentNotFoundError):
        HostCache.unlink(table_name)


def test_kind_mismatch(table_name: str) -> None:
    with SharedMemBlock.create(table_name, num_rows=8, dim=2):
        try:
            with pytest.raises(GeometryMismatchError, match="linear"):
                HostCache.attach(table_name)
            with pytest.raises(GeometryMismatchError, match="num_rows|capacity"):
                SharedMemBlock.attach(table_name, num_rows=9)
        finally:
            SharedMemBlock.unlink(table_name)


def _raw_segment(name: str, payload: bytes, size: int) -> None:
    mem = posix_ipc.SharedMemory(segment.posix_name(name), posix_ipc.O_CREX, 0o600, size)
    os.pwrite(mem.fd, payload, 0)
    mem.close_fd()


def test_foreign_segment_is_refused_not_reinterpreted(table_name: str) -> None:
    _raw_segment(table_name, b"NOTOURS!" + b"\x07" * 100, 1 << 16)
    try:
        with pytest.raises(CorruptedHeaderError, match="magic"):
            HostCache.attach(table_name)
    finally:
        segment.unlink(table_name)


def test_tiny_segment_is_refused(table_name: str) -> None:
    _raw_segment(table_name, b"x", 64)
    try:
        with pytest.raises(CorruptedHeaderError, match="too small"):
            HostCache.attach(table_name)
    finally:
        segment.unlink(table_name)


def _poke_header(name: str, word: int, value: int) -> None:
    mem = posix_ipc.SharedMemory(segment.posix_name(name))
    os.pwrite(mem.fd, np.int64(value).tobytes(), word * 8)
    mem.close_fd()


@pytest.mark.parametrize(
    ("word", "value", "error", "match"),
    [
        (layout.W_VERSION, layout.LAYOUT_VERSION + 1, LayoutVersionError, "layout version"),
        (layout.W_DIM, 3, CorruptedHeaderError, "checksum"),
        (layout.W_SIZE, 1, None, None),  # a dynamic word: not part of the checksum
    ],
)
def test_damaged_header(table_name: str, word: int, value: int, error, match) -> None:
    hc = HostCache.create(table_name, capacity=8, dim=2)
    hc.close()
    try:
        _poke_header(table_name, word, value)
        if error is None:
            HostCache.attach(table_name).close()
        else:
            with pytest.raises(error, match=match):
                HostCache.attach(table_name)
    finally:
        HostCache.unlink(table_name)


def test_truncated_segment_is_refused(table_name: str) -> None:
    hc = HostCache.create(table_name, capacity=4096, dim=8)
    hc.close()
    try:
        mem = posix_ipc.SharedMemory(segment.posix_name(table_name))
        os.ftruncate(mem.fd, layout.HEADER_BYTES * 2)
        mem.close_fd()
        with pytest.raises(CorruptedHeaderError, match="truncated"):
            HostCache.attach(table_name)
    finally:
        HostCache.unlink(table_name)


def test_layout_is_aligned_for_gpu_reads() -> None:
    for dim, dtype in [(3, torch.float32), (128, torch.float32), (7, torch.float16)]:
        geo = layout.plan(layout.KIND_HOST_CACHE, capacity=1000, dim=dim, dtype=dtype, ways=8)
        assert geo.rows_off % layout.PAGE == 0
        assert geo.row_stride % 16 == 0 and geo.row_stride >= geo.row_bytes
        for off in (geo.keys_off, geo.versions_off, geo.counters_off, geo.ring_seq_off):
            assert off % layout.PAGE == 0
        assert geo.total_size >= geo.rows_off + geo.slots * geo.row_stride


def test_views_outlive_a_closed_handle(table_name: str) -> None:
    mb = SharedMemBlock.create(table_name, num_rows=4, dim=2)
    try:
        view = mb.tensor
        mb.write(torch.tensor([1]), torch.tensor([[3.0, 4.0]]))
        mb.close()
        assert view[1].tolist() == [3.0, 4.0]  # mapping stays while a view lives
    finally:
        SharedMemBlock.unlink(table_name)


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(path) for line in f)


def test_a_closed_mapping_stays_mapped_while_a_torch_view_of_it_lives(table_name: str) -> None:
    """Only a torch view of the segment left (what a CUDA registration holds): closing the
    mapping must not unmap the pages under it; the last view and handle going does."""
    import gc

    SharedMemBlock.create(table_name, num_rows=1024, dim=4).close()
    try:
        mapping, geo = segment.attach(table_name)
        view = mapping.tensor(geo.rows_off, 16, torch.float32)
        view.fill_(7.0)
        mapping.close()
        assert _mapped(segment.shm_path(table_name))
        assert view.sum().item() == 112.0  # the pages are still the segment's
        del view, mapping
        gc.collect()
        assert not _mapped(segment.shm_path(table_name))
    finally:
        SharedMemBlock.unlink(table_name)
