"""Every stored byte decodes in the kernels as torch decodes it: the device functions that
read quantized rows (``gpu/kernels/stored_rows.py``), through the gather, compiled on
CUDA and interpreted on the CPU, against :func:`nvecache.common.quant.decode`.

Each of the 256 byte values sits in a row's payload (fp8's two NaN bytes excepted: the
tables refuse NaN on write), under per-row parameters of every kind the codecs meet:
1 and 0, scales and biases that round the product and the sum, a negative scale and
float32 subnormal parameters (a compiled multiply that flushed subnormals to zero would
fail here, as would an exponent or sign misplaced by a bit trick).
"""

from __future__ import annotations

import pytest
import torch

from gpu.kernels.triton_access import kernel_module
from nvecache.common import quant
from nvecache.common.rows import RowFormat

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                        reason="needs a CUDA GPU")])]
#: (scale, bias) per row; fp8 rows take the scale only
PARAMS = [(1.0, 0.0), (0.37, -1.3), (3.0e-3, 7.77), (-2.5, 0.1), (1.0e-39, 2.0e-39),
          (6.1e5, -3.3e5)]


def _table(fmt: RowFormat, device: str) -> torch.Tensor:
    """Stored bytes ``[len(PARAMS) * 2, stored_bytes]``: every byte value in the payloads
    (two rows per parameter pair, ``dim`` 128 each), the parameters after them."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if fmt.dtype == "float8_e4m3fn":
        values[values.view(torch.float8_e4m3fn).float().isnan()] = 0
    rows = torch.zeros(len(PARAMS) * 2, fmt.stored_bytes, dtype=torch.uint8)
    rows[:, :fmt.dim] = values.view(2, 128).repeat(len(PARAMS), 1)
    par = torch.tensor([p for p in PARAMS for _ in range(2)], dtype=torch.float32)
    npar = fmt.meta_bytes // 4
    rows[:, fmt.meta_offset:fmt.meta_offset + fmt.meta_bytes] = \
        par[:, :npar].contiguous().view(torch.uint8)
    return rows.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_every_byte_under_every_kind_of_parameter_decodes_as_torch_does(
        device: str, dtype: str) -> None:
    fmt = RowFormat(dtype, 128)
    table = _table(fmt, device)
    gk = kernel_module("gather", interpret=device == "cpu")
    keys = torch.arange(table.shape[0], device=device)
    got = gk.gather(keys, table, None, host_table=False, fmt=fmt, out_dtype=torch.float32)
    want = quant.decode(table.cpu(), fmt, torch.float32)
    assert want.abs().max() > 0 and (want[8:12] != 0).any()  # NOTE: subnormal rows decode
    same = got.cpu().view(torch.int32) == want.view(torch.int32)
    bad = (~same).nonzero()
    assert same.all(), [(int(r), int(c), float(got[r, c]), float(want[r, c]))
                        for r, c in bad[:8]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("code", [2, 3])
def test_both_fp8_decodes_read_every_byte_as_torch_does(
        device: str, code: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """float8_e4m3fn rows decoded from their bits (``QUANT`` 2, any GPU) and by the GPU's
    own conversion (3: compute capability 8.9 and later, and the interpreter): the same
    floats, bit for bit, under every kind of scale."""
    if device == "cuda" and code == 3 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the e4m3 conversion needs compute capability 8.9 or later")
    fmt = RowFormat("float8_e4m3fn", 128)
    table = _table(fmt, device)
    gk = kernel_module("gather", interpret=device == "cpu")
    # NOTE: the process's choice set, and the gather's kept constexprs forgotten
    monkeypatch.setitem(gk.codec_constexprs.__globals__, "_fp8", code)
    monkeypatch.setattr(gk, "_CONSTEXPRS", {})
    keys = torch.arange(table.shape[0], device=device)
    got = gk.gather(keys, table, None, host_table=False, fmt=fmt, out_dtype=torch.float32)
    assert [cx["QUANT"] for cx in gk._CONSTEXPRS.values()] == [code]
    want = quant.decode(table.cpu(), fmt, torch.float32)
    same = got.cpu().view(torch.int32) == want.view(torch.int32)
    bad = (~same).nonzero()
    assert same.all(), [(int(r), int(c), float(got[r, c]), float(want[r, c]))
                        for r, c in bad[:8]]
