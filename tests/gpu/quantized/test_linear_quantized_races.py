"""Writes of a quantized linear table racing lookups of it.

* In this process (a writer thread, readers on other threads; on CUDA each on its own
  stream): the table's read/write gate keeps every row whole: each row a lookup returns is
  the decoded row of one complete write (random rows per version: a payload read with
  another version's scale or bias decodes to none of them), and once the write returned,
  the new one.
* From another process (spawned): a writer process cycles a quantized SharedMemBlock's rows
  through versions (each version's payload a mask of its own, its scale and bias a size of
  its own: a payload decoded with another write's parameters, or torn between two writes,
  reads as no version) until a LinearUVM layer, a GPULayer and the block's own ``read``
  have read it a fixed number of times each in this process: each row read is some
  written version of its own key (a failure names the readers that tore), and after the
  writer stopped, the last one written, read by those three and (on the CPU) by the
  gather kernel under Triton's interpreter. The gate is per process; across processes the
  rows' seqlock versions keep them whole (``hostcache.row_versions``), and a writer killed
  inside its section neither hangs the readers nor leaves its rows odd once the next
  writer has repaired them.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import pytest
import torch

from gpu import LayerType, NVEmbedding
from gpu.kernels.triton_access import kernel_module, triton_available
from hostcache import row_versions
from nvecache.common.rows import RowFormat
from tests.gpu import quantized_workers
from tests.gpu.layer_tables import DEVICES, race
from tests.gpu.layers.test_layer_writes import on_own_stream
from tests.gpu.quantized_tables import FORMATS, cache_bytes, quantized_block, reference

CTX = mp.get_context("spawn")
ROWS, DIM = 8, 13
#: how long the cross-process race runs at most once a tenth of its reads are done
RACE_SECONDS = 45.0


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
    writes, rows, dim = 600, 64, 512
    # NOTE: reads per reader, the writer writing all the while: a GPU reads in tens of
    # microseconds, the interpreter in tens of milliseconds; the race also ends after
    # RACE_SECONDS (on an H100, the writer running, a GPU layer's lookup here took 8 ms
    # at the median and the block's CPU read 30-45 ms), having raced at least a tenth of
    # those reads
    per_reader = 2000 if device == "cuda" else 40
    keys = torch.arange(rows)
    f = RowFormat(fmt, dim)
    # [versions, rows]: each version's rows as the table reads them, hashed
    every = hashed(torch.stack([reference(quantized_workers.version_rows(keys, v, dim), fmt,
                                          torch.float32) for v in range(writes + 1)]))
    with quantized_block(rows, dim, fmt, quantized_workers.version_rows(keys, 0, dim)) as mb:
        started, stop, last = CTX.Event(), CTX.Event(), CTX.Value("i", -1)
        proc = CTX.Process(target=quantized_workers.write_versions,
                           args=(mb.name, writes, started, stop, last))
        proc.start()
        layers = [NVEmbedding(rows, dim, torch.float32, LayerType.LinearUVM, storage=mb,
                              device=device, gpu_cache_size=cache_bytes(dim, torch.float32)),
                  NVEmbedding(rows, dim, torch.float32, LayerType.GPULayer, storage=mb,
                              device=device)]
        readers = [*layers, lambda k: mb.read(k.cpu())]
        names = ["LinearUVM", "GPULayer", "SharedMemBlock.read"]
        after = list(readers)
        if device == "cpu" and triton_available():
            # NOTE: the kernels' reads, interpreted, read the last version; they do not
            # race: a read takes seconds there, longer than the writer leaves a row alone,
            # so it would read again round after round (its bound: stored_rows.ROUNDS)
            gather = kernel_module("gather", interpret=True).gather
            after.append(lambda k: gather(k, mb.tensor, None, host_table=False,
                                          fmt=mb.read_format, out_dtype=torch.float32))
        try:
            dev_keys = keys.to(device)
            reads = []
            deadline = time.monotonic() + RACE_SECONDS
            while (len(reads) < per_reader * len(readers) and proc.is_alive()
                   and (time.monotonic() < deadline
                        or len(reads) < per_reader * len(readers) // 10)):
                reads.append(hashed(readers[len(reads) % len(readers)](dev_keys).cpu()))
                started.set()  # NOTE: the writer starts once a lookup has run
            stop.set()
            proc.join(timeout=120)
            assert proc.exitcode == 0 and 1 <= last.value <= writes
            got = torch.stack(reads)  # [reads, rows]
            # every row read is its own key's row at some version: its payload and its
            # parameters from one write
            torn = torch.stack([~torch.isin(got[:, r], every[:, r]) for r in range(rows)], 1)
            by_reader = {name: int(torn[i::len(readers)].any(1).sum())
                         for i, name in enumerate(names)}
            assert not bool(torn.any()), (
                f"{int(torn.any(1).sum())} of {len(reads)} reads hold rows that are no "
                f"version of their key ({int(torn.sum())} rows; torn reads by reader: "
                f"{by_reader}; other keys' versions among them: "
                f"{int((torn & torch.isin(got, every)).sum())})")
            # once the writer is done, the last version
            for read in after:
                assert torch.equal(hashed(read(dev_keys).cpu()), every[last.value])
            assert f.quantized
        finally:
            if proc.is_alive():
                proc.kill()
            for layer in layers:
                layer.close()


def test_readers_wait_out_a_live_writer_that_holds_its_section() -> None:
    # a writer process holds a write section open, its rows torn, longer than a CPU
    # reader reads rows again unlocked (row_versions.WAIT_SECONDS): the readers then wait
    # on the writer lock, and return the rows whole once the writer closed its section
    rows, dim, fmt = 16, 40, torch.int8
    keys = torch.arange(rows)
    old = quantized_workers.version_rows(keys, 2, dim)
    with quantized_block(rows, dim, fmt, old) as mb:
        layers = [NVEmbedding(rows, dim, torch.float32, LayerType.GPULayer, storage=mb,
                              device="cpu"),
                  NVEmbedding(rows, dim, torch.float32, LayerType.LinearUVM, storage=mb,
                              device="cpu", gpu_cache_size=cache_bytes(dim, torch.float32))]
        ready, release = CTX.Event(), CTX.Event()
        proc = CTX.Process(target=quantized_workers.hold_section,
                           args=(mb.name, 5, ready, release))
        proc.start()
        got: dict[int, torch.Tensor] = {}
        readers = [*layers, mb.read]
        threads = [threading.Thread(target=lambda i=i, r=r: got.__setitem__(i, r(keys)))
                   for i, r in enumerate(readers)]
        try:
            assert ready.wait(timeout=120), f"the writer never began (exit {proc.exitcode})"
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=4 * row_versions.WAIT_SECONDS)
            # NOTE: a reader that took the torn rows would be done by now
            assert all(t.is_alive() for t in threads), sorted(got)
            release.set()
            for t in threads:
                t.join(timeout=120)
            proc.join(timeout=120)
            assert proc.exitcode == 0 and not any(t.is_alive() for t in threads)
            new = reference(quantized_workers.version_rows(keys, 5, dim), fmt, torch.float32)
            for i in range(len(readers)):
                assert torch.equal(got[i], new), i
        finally:
            release.set()
            proc.join(timeout=120)
            if proc.is_alive():
                proc.kill()
            for layer in layers:
                layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_writer_killed_inside_its_section_neither_hangs_readers_nor_stays(
        device: str) -> None:
    rows, dim, fmt = 16, 40, torch.int8
    keys = torch.arange(rows)
    values = quantized_workers.version_rows(keys, 3, dim)
    as_read = reference(values, fmt, torch.float32)
    with quantized_block(rows, dim, fmt, values) as mb:
        ready = CTX.Event()
        proc = CTX.Process(target=quantized_workers.die_in_section, args=(mb.name, 8, ready))
        proc.start()
        try:
            assert ready.wait(timeout=120), f"the writer never began (exit {proc.exitcode})"
        finally:
            proc.kill()
            proc.join(timeout=30)
        versions = mb.versions
        assert versions is not None
        assert bool((versions[:8] % 2 == 1).all()) and bool((versions[8:] % 2 == 0).all())
        assert mb.writer_pid == proc.pid
        layers = [NVEmbedding(rows, dim, torch.float32, LayerType.GPULayer, storage=mb,
                              device=device),
                  NVEmbedding(rows, dim, torch.float32, LayerType.LinearUVM, storage=mb,
                              device=device, gpu_cache_size=cache_bytes(dim, torch.float32))]
        try:
            # readers wait a bounded time for the dead writer's rows, then take them as
            # they are (here unchanged: it wrote nothing); a CPU reader (mb.read, and on
            # the CPU the layers) takes the writer lock for them, which repairs the
            # section: every version even, every cache told
            repairs = mb.repairs
            for read in [*layers, lambda k: mb.read(k.cpu())]:
                assert torch.equal(read(keys.to(device)).cpu(), as_read)
            assert mb.writer_pid == 0 and mb.repairs == repairs + 1
            assert bool((versions % 2 == 0).all())
            mb.write(torch.tensor([15]), values[15:])
            assert mb.repairs == repairs + 1
            for layer in layers:
                assert torch.equal(layer(keys.to(device)).cpu(), as_read)
        finally:
            for layer in layers:
                layer.close()
