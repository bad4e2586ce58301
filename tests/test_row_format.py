"""The one description of a stored row (nvecache.common.rows) and the tiers that read it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from nvecache.common import rows
from nvecache.common.rows import RowFormat, RowFormatError

ODD_DIMS = [1, 3, 7, 13, 33, 127, 129, 1000]


def test_the_whitelist_names_sizes_and_codes() -> None:
    assert rows.DTYPES == {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
    # the host segments' header codes are stored: they never change
    assert {n: rows.code_of(n) for n in rows.DTYPES} == {
        "float32": 1, "float16": 2, "bfloat16": 3, "float64": 4}
    assert all(rows.name_of_code(rows.code_of(n)) == n for n in rows.DTYPES)
    assert set(rows.LAYER_DTYPES) == set(rows.DTYPES) - {"float64"}
    for name, size in rows.DTYPES.items():
        assert rows.torch_dtype(name) == getattr(torch, name)
        assert torch.empty((), dtype=rows.torch_dtype(name)).element_size() == size
        assert rows.numpy_dtype(name).itemsize == size


@pytest.mark.parametrize("dtype", list(rows.DTYPES))
@pytest.mark.parametrize("dim", ODD_DIMS)
def test_the_arithmetic_of_every_dtype_and_odd_dims(dtype: str, dim: int) -> None:
    fmt = RowFormat(dtype, dim)
    t = torch.zeros(2, dim, dtype=getattr(torch, dtype))
    assert fmt.itemsize == t.element_size()
    assert fmt.row_bytes == t[0].numel() * t.element_size() == dim * rows.DTYPES[dtype]
    assert fmt.meta_bytes == 0
    assert fmt.stored_bytes == fmt.row_bytes + fmt.meta_bytes
    assert fmt.stride % rows.ROW_ALIGN == 0
    assert fmt.stored_bytes <= fmt.stride < fmt.stored_bytes + rows.ROW_ALIGN
    assert fmt.torch_dtype == t.dtype
    # the numpy dtype holds the row's bytes exactly (bfloat16: its bits)
    bits = t.view(torch.int16) if dtype == "bfloat16" else t
    assert bits.numpy().dtype == fmt.numpy_dtype


@pytest.mark.parametrize("dtype", list(rows.QUANTIZED))
@pytest.mark.parametrize("dim", ODD_DIMS)
def test_quantized_rows_carry_aligned_parameters_after_the_payload(dtype: str, dim: int
                                                                   ) -> None:
    fmt = RowFormat(dtype, dim)
    assert fmt.quantized and not RowFormat("float32", dim).quantized
    assert fmt.itemsize == 1 and fmt.row_bytes == dim
    assert fmt.meta_bytes == (8 if dtype == "int8" else 4)  # float32 scale (and bias)
    assert fmt.meta_offset % 4 == 0 and dim <= fmt.meta_offset < dim + 4
    assert fmt.stored_bytes == fmt.meta_offset + fmt.meta_bytes
    assert fmt.stride % rows.ROW_ALIGN == 0 and fmt.stored_bytes <= fmt.stride
    assert fmt.torch_dtype == getattr(torch, dtype)
    assert rows.name_of_code(fmt.code) == dtype


def test_quantized_geometry_by_hand() -> None:
    int8 = RowFormat("int8", 128)
    assert (int8.meta_offset, int8.stored_bytes, int8.stride) == (128, 136, 144)
    assert int8.stride <= 1.1 * (128 + 8)  # an int8 row of dim 128: within 10% of its bytes
    assert RowFormat("float8_e4m3fn", 128).stride == 144
    assert (RowFormat("int8", 5).meta_offset, RowFormat("int8", 5).stride) == (8, 16)
    assert RowFormat("float8_e4m3fn", 12).stride == 16
    assert {n: rows.code_of(n) for n in rows.QUANTIZED} == {"int8": 5, "float8_e4m3fn": 6}
    assert rows.FORMATS == (*rows.DTYPES, *rows.QUANTIZED)


def test_aligned_strides_by_hand() -> None:
    assert RowFormat("float32", 1).stride == 16
    assert RowFormat("float32", 4).stride == 16
    assert RowFormat("float32", 5).stride == 32
    assert RowFormat("float16", 9).stride == 32
    assert RowFormat("float64", 2).stride == 16
    assert rows.align_up(0) == 0 and rows.align_up(17) == 32 and rows.align_up(5, 4) == 8


@pytest.mark.parametrize(("given", "name"), [
    (torch.float32, "float32"), (torch.bfloat16, "bfloat16"), ("torch.float16", "float16"),
    ("fp16", "float16"), ("half", "float16"), ("bf16", "bfloat16"), ("FP32", "float32"),
    ("double", "float64"), ("float", "float32"), ("float64", "float64"),
])
def test_names_and_aliases(given: object, name: str) -> None:
    assert rows.dtype_name(given) == name
    assert RowFormat(given, 8).dtype == name  # type: ignore[arg-type]
    assert RowFormat(given, 8) == RowFormat(name, 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [torch.int64, torch.int16, "int4", "uint8", None, 4,
                                 b"float32"])
def test_an_unsupported_dtype_is_a_typed_error_naming_the_choices(bad: object) -> None:
    with pytest.raises(RowFormatError, match="use one of float32, float16, bfloat16, float64, "
                                             "int8, float8_e4m3fn"):
        RowFormat(bad, 8)  # type: ignore[arg-type]
    with pytest.raises(RowFormatError):
        rows.dtype_name(bad)
    assert issubclass(RowFormatError, ValueError)


@pytest.mark.parametrize("quantized", [torch.int8, "int8", torch.float8_e4m3fn, "fp8"])
def test_the_plain_whitelist_is_the_default_one(quantized: object) -> None:
    """A tier that does not name the quantized formats never takes one as plain numbers."""
    with pytest.raises(RowFormatError, match="use one of float32, float16, bfloat16, float64 "):
        rows.dtype_name(quantized)
    assert rows.dtype_name(quantized, rows.FORMATS) in rows.QUANTIZED


def test_a_restricted_whitelist() -> None:
    assert rows.dtype_name(torch.float16, rows.LAYER_DTYPES) == "float16"
    with pytest.raises(RowFormatError, match="use one of float32, float16, bfloat16 "):
        rows.dtype_name(torch.float64, rows.LAYER_DTYPES)


@pytest.mark.parametrize("dim", [0, -1, True, 2.0, "8", None, RowFormat.MAX_DIM + 1])
def test_a_bad_dim_is_a_typed_error(dim: object) -> None:
    with pytest.raises(RowFormatError, match="dim must be an int"):
        RowFormat("float32", dim)  # type: ignore[arg-type]


def test_numpy_ints_are_dims_and_formats_are_frozen_values() -> None:
    fmt = RowFormat("float16", np.int64(12))  # type: ignore[arg-type]
    assert fmt.dim == 12 and type(fmt.dim) is int
    assert fmt == RowFormat("float16", 12) and hash(fmt) == hash(RowFormat("fp16", 12))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fmt.dim = 3  # type: ignore[misc]


@pytest.mark.parametrize("code", [0, 7, 99, -1, None])
def test_an_unknown_code_is_a_typed_error(code: object) -> None:
    with pytest.raises(RowFormatError, match="no row format has the code"):
        rows.name_of_code(code)  # type: ignore[arg-type]


def test_the_module_needs_neither_torch_nor_numpy() -> None:
    code = ("import sys\nfrom nvecache.common import rows\n"
            "f = rows.RowFormat('bf16', 7)\n"
            "print(f.stride, f.code, sorted(rows.DTYPES), 'torch' in sys.modules, "
            "'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["16", "3", "['bfloat16',", "'float16',", "'float32',", "'float64']",
                   "False", "False"]


# --- every package turns the common error into its own typed argument error ---------------


def test_psclient_maps_the_error_to_its_root() -> None:
    from psclient.errors import BadArgumentError, PSClientError
    from psclient.schema import DTYPE_ITEMSIZES, DTYPES, TableSchema, dtype_name

    with pytest.raises(BadArgumentError, match="unsupported dtype") as info:
        dtype_name(torch.int8)
    assert isinstance(info.value, PSClientError)
    with pytest.raises(BadArgumentError):
        TableSchema(dim=4, dtype="int8")
    assert dict(DTYPE_ITEMSIZES) == rows.DTYPES and list(DTYPES) == list(rows.DTYPES)
    assert DTYPES["bfloat16"] == torch.bfloat16


def test_hostcache_maps_the_error_to_its_root() -> None:
    from hostcache import layout
    from hostcache.errors import BadArgumentError, HostCacheError

    with pytest.raises(BadArgumentError, match="dtype must be one of torch.float32") as info:
        layout.plan(layout.KIND_LINEAR, capacity=4, dim=4, dtype=torch.int16)
    assert isinstance(info.value, HostCacheError)
    # both kinds store quantized rows too, recorded by their format's name
    for kind, ways in ((layout.KIND_HOST_CACHE, 4), (layout.KIND_LINEAR, 0)):
        geo = layout.plan(kind, capacity=4, dim=4, dtype=torch.int8, ways=ways)
        assert geo.dtype_name == "int8" and geo.row_stride == RowFormat("int8", 4).stride


def test_gpu_maps_the_error_to_its_root() -> None:
    from gpu.errors import BadArgumentError, GPUError
    from gpu.inputs import check_dtype

    assert check_dtype(torch.bfloat16) == torch.bfloat16
    assert check_dtype(torch.float64, allowed=tuple(rows.DTYPES)) == torch.float64
    for bad in (torch.float64, torch.int8, "float32", None):
        with pytest.raises(BadArgumentError, match="data_type must be one of") as info:
            check_dtype(bad)
        assert isinstance(info.value, GPUError)


# --- the tiers read the one format --------------------------------------------------------


@pytest.mark.parametrize("dtype", list(rows.DTYPES))
@pytest.mark.parametrize("dim", [1, 3, 13, 129])
def test_a_host_segment_and_a_table_schema_store_rows_as_the_format_says(
        dtype: str, dim: int) -> None:
    from hostcache import layout
    from psclient.schema import TableSchema

    fmt = RowFormat(dtype, dim)
    for kind, extra in ((layout.KIND_LINEAR, {}), (layout.KIND_HOST_CACHE, {"ways": 8})):
        geo = layout.plan(kind, capacity=10, dim=dim, dtype=getattr(torch, dtype),
                          ring_capacity=16, **extra)
        assert geo.row_format == fmt
        assert (geo.elem_size, geo.row_bytes, geo.row_stride) == (
            fmt.itemsize, fmt.row_bytes, fmt.stride)
        assert geo.rows_off % layout.PAGE == 0
        assert geo.total_size >= geo.rows_off + geo.slots * fmt.stride
        header = np.zeros(layout.HEADER_WORDS, dtype=np.int64)
        layout.write(header, geo, uid=0)
        assert header[layout.W_DTYPE] == rows.code_of(dtype)
        assert header[layout.W_ROW_STRIDE] == fmt.stride
        back = layout.read(header, name="t", segment_size=geo.total_size)
        assert back.dtype_name == dtype and back.dtype == fmt.torch_dtype
    schema = TableSchema(dim=dim, dtype=dtype)
    assert schema.row_format == fmt and schema.row_bytes == fmt.stored_bytes
