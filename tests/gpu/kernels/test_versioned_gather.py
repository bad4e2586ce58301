"""The gather of a versioned table (a quantized ``SharedMemBlock``'s rows, which another
process may write) in its three launches (``gpu/kernels/gather.py``): the rows' versions,
the rows, the versions again and the rows whose versions moved read again. Compiled on
CUDA, interpreted on the CPU.

The race itself (a writer process against the layers) is
``tests/gpu/quantized/test_linear_quantized_races.py``; here each launch is driven alone,
so that the check's verdict is tested on versions set by hand: a row whose first version
was odd, or changed before the check, is read again and its output row replaced; a row
whose version held keeps what the gather wrote.
"""

from __future__ import annotations

import pytest
import torch

from gpu.kernels.triton_access import kernel_module
from hostcache import row_versions
from tests.gpu.quantized_tables import quantized_block, reference

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                        reason="needs a CUDA GPU")])]


def _on(table: torch.Tensor, device: str) -> torch.Tensor:
    """The block's stored rows on ``device``, with their padded row stride, so that each
    row's version (in the padding) comes along: ``table.to(device)`` would copy the
    stored bytes alone, contiguous, versions left behind."""
    if device == "cpu":
        return table
    stride = table.stride(0)
    whole = torch.as_strided(table, (table.shape[0], stride), (stride, 1)).to(device)
    return whole[:, :table.shape[1]]


def _gk(device: str):  # noqa: ANN202 - the kernel module
    return kernel_module("gather", interpret=device == "cpu")


def _launches(gk, keys: torch.Tensor, table: torch.Tensor, fmt, out: torch.Tensor,  # noqa: ANN001
              ver: torch.Tensor, step: str) -> None:
    """One of the three launches of a versioned gather, through the JIT."""
    n = keys.numel()
    cx, _ = gk._constexprs(fmt.dim, False, False, table.dtype, out.dtype, fmt,
                           gk.DEFAULT_TILES)
    vcx, ccx = gk._seq_constexprs(cx)
    common = (keys, n, table, table.shape[0], table.stride(0))
    bk = cx["BLOCK_K"]
    if step == "versions":
        gk._versions_kernel[((n + gk._VERSIONS_BLOCK - 1) // gk._VERSIONS_BLOCK,)](
            *common, ver, **vcx)
    elif step == "rows":
        gk._gather_kernel[((n + bk - 1) // bk,)](*common, out, keys, keys, **cx)
    else:
        gk._verify_kernel[((n + bk - 1) // bk,)](*common, ver, out, **ccx)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_rows_whose_versions_moved_are_read_again_and_the_others_kept(
        fmt: torch.dtype, device: str) -> None:
    rows, dim = 40, 37
    values = torch.randn(rows, dim, generator=torch.Generator().manual_seed(3))
    gk = _gk(device)
    with quantized_block(rows, dim, fmt, values) as mb:
        table = _on(mb.tensor, device)
        keys = torch.tensor([5, 0, 39, 5, 17, 40, -3, 22], device=device)
        inside = (keys >= 0) & (keys < rows)
        expected = torch.zeros(keys.numel(), dim)
        expected[inside.cpu()] = reference(values, fmt, torch.float32)[keys[inside].cpu()]
        fmt_r = mb.read_format
        out = torch.full((keys.numel(), dim), 7.0, device=device)
        ver = torch.full((keys.numel(),), -5, dtype=torch.int32, device=device)
        _launches(gk, keys, table, fmt_r, out, ver, "versions")
        versions = row_versions.versions_in(table, fmt_r.stored_bytes).cpu()
        assert torch.equal(ver.cpu()[inside.cpu()], versions[keys[inside].cpu()])
        assert bool((ver.cpu()[~inside.cpu()] == 0).all())
        _launches(gk, keys, table, fmt_r, out, ver, "rows")
        assert torch.equal(out.cpu(), expected)
        # a row read inside a write section (its first version odd), one whose version
        # moved, one whose version held but whose output row the gather did not write
        # (a stand-in that the check must leave as it is)
        out[1] = 9.0    # key 0: first version odd
        out[2] = -9.0   # key 39: version moved
        out[4] = 5.0    # key 17: version held
        ver[1] += 1
        ver[2] -= 2
        _launches(gk, keys, table, fmt_r, out, ver, "check")
        want = expected.clone()
        want[4] = 5.0
        assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_the_three_launches_read_what_the_block_reads_in_every_shape(device: str) -> None:
    gk = _gk(device)
    for fmt in (torch.int8, torch.float8_e4m3fn):
        for rows, dim in ((1, 1), (33, 128), (70, 513)):
            values = torch.randn(rows, dim, generator=torch.Generator().manual_seed(dim))
            with quantized_block(rows, dim, fmt, values) as mb:
                table = _on(mb.tensor, device)
                keys = torch.randint(-2, rows + 2, (3 * rows + 1,),
                                     generator=torch.Generator().manual_seed(rows))
                inside = (keys >= 0) & (keys < rows)
                want = torch.zeros(keys.numel(), dim)
                want[inside] = mb.read(keys[inside])
                for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
                    got = gk.gather(keys.to(device), table, None, host_table=False,
                                    fmt=mb.read_format, out_dtype=out_dtype)
                    assert torch.equal(got.cpu(), want.to(out_dtype)), (fmt, rows, dim,
                                                                       out_dtype)
