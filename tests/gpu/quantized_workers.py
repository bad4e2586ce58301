"""Spawned writer of tests/gpu/quantized/test_linear_quantized_races.py: a process writing versions
of a quantized SharedMemBlock's rows while the test's process looks them up."""

from __future__ import annotations

from typing import Any

import torch

from hostcache import SharedMemBlock


def version_rows(keys: torch.Tensor, version: int, dim: int) -> torch.Tensor:
    """Rows of ``keys`` as write ``version`` writes them: each element ``size`` or
    ``-size / 2`` (``size`` naming key and version), laid out by a mask of the version's
    own. The payload holds the version's mask (two writes' halves make a mask of neither)
    and the scale and bias its size (a payload decoded with another write's parameters
    moves every element off every version's row): a torn row reads as no version."""
    g = torch.Generator().manual_seed(1000 + version)
    mask = torch.rand(dim, generator=g) < 0.5
    mask[0], mask[1] = False, True  # NOTE: both values in every row
    size = 1.0 + 0.01 * keys.float()[:, None] + 3.0 * (version % 7)
    return torch.where(mask[None, :], size, -0.5 * size)


def write_versions(name: str, versions: int, started: Any, stop: Any, last: Any,
                   pause: float = 0.0) -> None:
    """Once the reader has ``started``, write versions ``1 .. versions`` of every row of the
    block ``name``, over and over (after ``versions``, 1 again), until ``stop`` is set;
    then put the last version written in ``last`` (a shared int). Even versions in one
    span, odd ones row by row in a shuffled order (the block's two write paths). The
    reader stops it after a number of reads, so that a slow reader (the interpreter on
    the CPU) races as many writes as a fast one. ``pause``: seconds between writes (a
    paced writer: ``bench/quantized/probe_seqlock_race.py``)."""
    with SharedMemBlock.attach(name) as mb:
        keys = torch.arange(mb.num_rows)
        started.wait()
        v = 0
        while not stop.is_set() or v == 0:
            v = v % versions + 1
            if v % 2 == 0:
                mb.write(keys, version_rows(keys, v, mb.dim))
            else:
                shuffled = keys[torch.randperm(keys.numel())]
                mb.write(shuffled, version_rows(shuffled, v, mb.dim))
            if pause > 0:
                stop.wait(pause)
        last.value = v


def die_in_section(name: str, rows: int, ready: Any) -> None:
    """Take the block's writer lock, open a write section of its first ``rows`` rows (their
    versions odd), set ``ready`` and wait there to be killed."""
    import threading

    from hostcache import row_versions

    with SharedMemBlock.attach(name) as mb, mb.exclusive():
        versions = mb.versions
        assert versions is not None
        with row_versions.section(versions, slice(0, rows)):
            ready.set()
            threading.Event().wait()  # NOTE: until killed


def hold_section(name: str, version: int, ready: Any, release: Any) -> None:
    """Take the block's writer lock and open a write section of all its rows; write the
    first half of each row's stored bytes of write ``version`` (the rows torn: new payload
    bytes beside old ones and old parameters), set ``ready``, wait for ``release``, then
    write the rest and close the section."""
    from hostcache import row_versions
    from nvecache.common import quant

    with SharedMemBlock.attach(name) as mb, mb.exclusive():
        versions = mb.versions
        assert versions is not None
        keys = torch.arange(mb.num_rows)
        stored = quant.encode(version_rows(keys, version, mb.dim), mb.row_format)
        half = stored.shape[1] // 2
        with row_versions.section(versions, slice(0, mb.num_rows)):
            mb.tensor[:, :half] = stored[:, :half]
            ready.set()
            release.wait()
            mb.tensor[:, half:stored.shape[1]] = stored[:, half:]
