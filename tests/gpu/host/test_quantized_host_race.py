"""A writer process updates a quantized host cache while this process reads it: through a
Hierarchical layer (its GPU cache, the host cache read on the CPU, or on CUDA by the GPU
read kernel) and through the host-tier kernels themselves (under Triton's interpreter on
the CPU, compiled on CUDA). Every row read is one whole written row, decoded: never a
payload of one write read with another's scale or bias, nor two writes' halves."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from gpu import LayerType, NVEmbedding
from gpu.cuda.registration import register
from gpu.kernels import host_reads as hk
from gpu.kernels.triton_access import triton_available
from gpu.tier_config import TierConfig
from hostcache import HostCache
from nvecache.common.rows import QUANTIZED
from tests.gpu import quant_host_writer as qw
from tests.gpu.layer_tables import DEVICES

CTX = mp.get_context("spawn")
FORMATS = [getattr(torch, name) for name in QUANTIZED]
KEYS = 300
#: the keys the writer writes; the others stay as written first. A lookup under Triton's
#: interpreter takes longer than the writer takes to write them all again: its reads of
#: written keys are misses (as they must be), and its hits those of the other keys
WRITTEN = 3 * KEYS // 4
#: layer lookups made while the writer writes (and host-tier kernel lookups: fewer under the
#: interpreter, which is slow)
LOOKUPS = 60
KERNEL_LOOKUPS = {"cpu": 6, "cuda": 60}


def _whole(got: torch.Tensor, want: torch.Tensor, default: float | None) -> torch.Tensor:
    """Per row of ``got`` ``[N, DIM]``: whether it is one version's row of ``want``
    ``[V, N, DIM]`` bit for bit (or, with ``default``, the default row: a miss)."""
    g = got.cpu().contiguous().view(torch.uint8)
    w = want.contiguous().view(torch.uint8)
    ok = (g[None] == w).all(dim=2).any(dim=0)
    if default is not None:
        ok |= (got.cpu().float() == default).all(dim=1)
    return ok


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_reads_racing_a_writer_are_whole_rows(table_name: str, fmt: torch.dtype,
                                              dtype: torch.dtype, device: str) -> None:
    keys = torch.arange(KEYS)
    hc = HostCache.create(table_name, capacity=8 * KEYS, dim=qw.DIM, dtype=fmt, ways=8)
    started, done, rounds = CTX.Event(), CTX.Event(), CTX.Value("q", 0)
    writer = CTX.Process(target=qw.writer,
                         args=(table_name, keys[:WRITTEN], started, done, rounds))
    try:
        hc.insert(keys, qw.version_rows(keys, 0))
        assert bool(hc.contains(keys).all())
        want = qw.expected(keys, hc.row_format, dtype)
        # NOTE: on CUDA the GPU read kernel reads every miss of the host cache
        tuning = TierConfig(admit_batches=1, host_gpu_read_keys=1)
        writer.start()
        assert started.wait(120)
        torn = raced = 0
        with NVEmbedding(KEYS, qw.DIM, dtype, LayerType.Hierarchical, host_cache=hc,
                         default_row=-1.0, gpu_cache_size=2 * KEYS * (qw.DIM * 4 + 16),
                         tuning=tuning, device=device) as layer:
            dk = keys.to(device)
            for _ in range(LOOKUPS):
                got = layer(dk)
                torn += int((~_whole(got, want, -1.0)).sum())
                # NOTE: rows of written keys read while the writer wrote (not a miss)
                raced += int((got[:WRITTEN].cpu().float() != -1.0).any(dim=1).sum())
            host_hits = layer.stats().host.hits
        kernel_hits = kernel_raced = 0
        if triton_available() or device == "cuda":
            with register(hc, device=device) as reg:
                for _ in range(KERNEL_LOOKUPS[device]):
                    values, hit = hk.triton_lookup(reg, dk, out_dtype=dtype)
                    hit = hit.cpu()
                    torn += int((hit & ~_whole(values, want, None)).sum())
                    assert not values[~hit.to(values.device)].any()  # a miss reads as zeros
                    kernel_hits += int(hit.sum())
                    kernel_raced += int(hit[:WRITTEN].sum())
        assert writer.is_alive()  # NOTE: it wrote all along
        done.set()
        writer.join(timeout=120)
        assert writer.exitcode == 0 and rounds.value > 1
        assert torn == 0
        assert host_hits > 0 and raced > 0
        if device == "cuda":
            assert kernel_raced > 0
        if triton_available() or device == "cuda":
            assert kernel_hits > 0
    finally:
        done.set()
        if writer.is_alive() or writer.exitcode is None:
            writer.join(timeout=120)
        hc.close()
        HostCache.unlink(table_name)
