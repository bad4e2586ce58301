"""Writes of a quantized linear table racing lookups of it.

* In this process (a writer thread, readers on other threads; on CUDA each on its own
  stream): the table's read/write gate keeps every row whole: each row a lookup returns is
  the decoded row of one complete write (random rows per version: a payload read with
  another version's scale or bias decodes to none of them), and once the write returned,
  the new one.
* From another process (spawned): a writer process cycles a quantized SharedMemBlock's rows
  through versions, every row constant (``k * 1000 + version``), while a LinearUVM layer and
  a GPULayer of this process read it: each row read is the decoded row of some written
  version of its own key (its parameters are its own row's, from one write), and after the
  writer finished, the last. The gate is per process, so a lookup racing a write from
  another process may read a row's payload with another write's parameters: constant rows
  store the same payload at every version, so that reads as one whole version (rows whose
  payload changes are ordered by the application, as plain rows are: docs/layers.md,
  "Threads and streams").
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import pytest
import torch

from gpu import LayerType, NVEmbedding
from nvecache.common.rows import RowFormat
from tests.gpu import quantized_workers
from tests.gpu.layer_tables import DEVICES, race
from tests.gpu.quantized_tables import FORMATS, cache_bytes, quantized_block, reference
from tests.gpu.test_layer_writes import on_own_stream

CTX = mp.get_context("spawn")
ROWS, DIM = 8, 13


def hashed(rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[...]``: a hash of each float32 row's bits (the last dim)."""
    mult = torch.randint(1, 1 << 62, (rows.shape[-1],),
                         generator=torch.Generator().manual_seed(7))
    return (rows.float().contiguous().view(torch.int32).long() * mult).sum(-1)


def versions_of(n: int) -> torch.Tensor:
    """``[n, ROWS, DIM]`` float32: random rows per version."""
    return torch.stack([torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(v)) * 5
                        for v in range(n)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["own", "memblock"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_a_write_in_this_process_never_tears_a_row(fmt: torch.dtype, kind: str,
                                                   device: str) -> None:
    writes = 60
    table = versions_of(writes + 1)
    as_read = torch.stack([reference(rows, fmt, torch.float32) for rows in table])
    allowed = hashed(as_read)  # [versions, ROWS]: each version's rows as the table reads them
    keys = torch.arange(ROWS, device=device)
    with quantized_block(ROWS, DIM, fmt, table[0]) as mb:
        if kind == "own":
            writer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device=device,
                                 weight_init=table[0], weight_dtype=fmt)
            readers = [writer, writer]
        else:
            writer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device=device,
                                 storage=mb)
            readers = [NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, storage=mb,
                                   device=device, gpu_cache_size=cache_bytes(DIM, torch.float32)),
                       writer]
        acked, seen = [0], []
        done = threading.Event()
        # NOTE: the writes start once a lookup has returned, so that lookups overlap them
        # however fast the writes are
        first_read = threading.Event()

        def write() -> None:
            try:
                first_read.wait()
                for v in range(1, writes + 1):
                    on_own_stream(device, lambda v=v: writer.update(keys, table[v].to(device)))
                    acked[0] = v
            finally:
                done.set()

        def read(layer: Any) -> None:
            try:
                while not done.is_set():
                    floor = acked[0]
                    got = hashed(on_own_stream(device, lambda: layer(keys)).cpu())
                    match = got[None, :] == allowed  # [versions, ROWS]
                    assert bool(match.any(dim=0).all()), "a row of no version (torn)"
                    version = match.int().argmax(dim=0)
                    assert bool((version >= floor).all()), (floor, version.tolist())
                    seen.append(version)
                    first_read.set()
            finally:
                first_read.set()  # NOTE: a reader that failed does not hold the writer

        race(write, read, readers, done)
        assert seen, "no lookup ran"
        for layer in {id(r): r for r in readers}.values():
            assert torch.equal(layer(keys).cpu(), as_read[writes])
            layer.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_a_writer_process_racing_lookups_leaves_whole_rows(fmt: torch.dtype,
                                                           device: str) -> None:
    writes = 400
    keys = torch.arange(ROWS)
    f = RowFormat(fmt, DIM)
    every = torch.stack([reference(quantized_workers.constant_rows(keys, v, DIM), fmt,
                                   torch.float32)[:, 0] for v in range(writes + 1)])
    with quantized_block(ROWS, DIM, fmt, quantized_workers.constant_rows(keys, 0, DIM)) as mb:
        started, done = CTX.Event(), CTX.Event()
        proc = CTX.Process(target=quantized_workers.write_versions,
                           args=(mb.name, writes, started, done))
        proc.start()
        layers = [NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, storage=mb,
                              device=device, gpu_cache_size=cache_bytes(DIM, torch.float32)),
                  NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, storage=mb,
                              device=device)]
        try:
            dev_keys = keys.to(device)
            reads = []
            while not done.is_set() or len(reads) < 2:
                reads.append(layers[len(reads) % 2](dev_keys).cpu())
                started.set()  # NOTE: the writer starts once a lookup has run
                if not proc.is_alive() and not done.is_set():
                    break
            proc.join(timeout=120)
            assert proc.exitcode == 0
            got = torch.stack(reads)  # [reads, ROWS, DIM]
            # each row one value (its payload and parameters from one write) ...
            assert bool((got == got[:, :, :1]).all()), "a row with unequal elements"
            # ... which its own key had at some version
            for r in range(ROWS):
                assert bool(torch.isin(got[:, r, 0], every[:, r]).all()), (
                    f"key {r} read a value it never had: {got[:, r, 0].unique().tolist()[:8]}")
            # once the writer is done, the last version
            for layer in layers:
                assert torch.equal(layer(dev_keys).cpu()[:, 0], every[writes])
            assert f.quantized
        finally:
            if proc.is_alive():
                proc.kill()
            for layer in layers:
                layer.close()
