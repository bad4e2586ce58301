"""Every tier reads how a row is stored from nvecache.common.rows: the GPU cache, the
distributed table, the registered views, the miss resolver, the loader and the service
config; and the library holds one dtype whitelist, the one there."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from nvecache.common import rows
from nvecache.common.rows import RowFormat

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("gpu", "psclient", "hostcache", "nvecache")
ROW_DTYPE_NAMES = set(rows.DTYPES)
ALL_CHOICES = "torch.float32, torch.float16, torch.bfloat16, torch.float64"
LAYER_CHOICES = "torch.float32, torch.float16, torch.bfloat16"


def _dtype_names_in(node: ast.AST) -> set[str]:
    """The row dtype names an element of a literal spells (``torch.float16``, ``"float16"``)."""
    if isinstance(node, ast.Attribute) and node.attr in ROW_DTYPE_NAMES:
        return {node.attr}
    if isinstance(node, ast.Constant) and node.value in ROW_DTYPE_NAMES:
        return {str(node.value)}
    return set()


def _whitelists(path: Path) -> list[int]:
    """Lines of the literals (tuple, list, set, dict keys or values) in ``path`` that spell
    two or more row dtypes: a local dtype whitelist."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elements: list[ast.AST] = list(node.elts)
        elif isinstance(node, ast.Dict):
            elements = [k for k in node.keys if k is not None] + list(node.values)
        else:
            continue
        names: set[str] = set()
        for e in elements:
            names |= _dtype_names_in(e)
        if len(names) >= 2:
            found.append(node.lineno)
    return found


def test_the_library_holds_one_dtype_whitelist(tmp_path: Path) -> None:
    lists = {str(p.relative_to(ROOT)): lines
             for pkg in LIBRARY for p in sorted((ROOT / pkg).rglob("*.py"))
             if (lines := _whitelists(p))}
    assert list(lists) == ["nvecache/common/rows.py"], lists
    # the checker sees each way a whitelist is written, and not one dtype alone
    probe = tmp_path / "probe.py"
    probe.write_text("A = (torch.float32, torch.float16)\nB = {'float16': 2, 'bfloat16': 2}\n"
                     "C = {torch.bfloat16: '<i2', torch.float64: '<f8'}\nD = [\"float32\"]\n"
                     "E = (torch.float32, torch.int64)\n")
    assert _whitelists(probe) == [1, 2, 3]


# --- the GPU cache ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(rows.DTYPES))
@pytest.mark.parametrize("dim", [1, 7, 129])
def test_a_gpu_cache_sizes_its_slots_by_the_row_format(name: str, dim: int) -> None:
    from gpu.cache.gpu_cache import GPUCache

    fmt = RowFormat(name, dim)
    cache = GPUCache(1 << 16, dim, fmt.torch_dtype, backend="torch")
    assert cache.row_format == fmt
    assert cache.row_bytes == fmt.row_bytes
    assert cache.slot_bytes == 8 + 4 + fmt.row_bytes
    assert cache.capacity == (1 << 16) // cache.slot_bytes // 8 * 8
    keys = torch.arange(5)
    cache.insert(keys, torch.full((5, dim), 1.5, dtype=fmt.torch_dtype))
    values, hit = cache.lookup(keys)
    assert values.dtype == fmt.torch_dtype and bool(hit.any())


def test_a_gpu_cache_refuses_what_no_table_stores_with_its_own_errors() -> None:
    from gpu.cache.gpu_cache import GPUCache
    from gpu.errors import BadArgumentError, GPUError

    for bad in (torch.int8, torch.complex64, "float32", None):
        with pytest.raises(BadArgumentError,
                           match=f"dtype must be one of {ALL_CHOICES}; got") as info:
            GPUCache(1 << 16, 4, bad)  # type: ignore[arg-type]
        assert isinstance(info.value, GPUError)
    with pytest.raises(BadArgumentError, match="dim must be an int in 1.."):
        GPUCache(1 << 16, RowFormat.MAX_DIM + 1, torch.float32)
    cache = GPUCache(1 << 16, 4, torch.float16, backend="torch")
    keys, offsets = torch.arange(4), torch.tensor([0, 2, 4])
    with pytest.raises(BadArgumentError, match=f"out_dtype must be one of {ALL_CHOICES}"):
        cache.lookup_pooled(keys, offsets, out_dtype=torch.int32)
    pooled, _ = cache.lookup_pooled(keys, offsets, out_dtype=torch.float32)
    assert pooled.dtype == torch.float32


# --- the distributed table ----------------------------------------------------------------


@pytest.mark.parametrize("name", rows.LAYER_DTYPES)
def test_a_dist_block_lays_rows_out_by_the_row_format(name: str, table_name: str) -> None:
    from gpu import DistMemBlock

    fmt = RowFormat(name, 13)
    with DistMemBlock(40, 13, fmt.torch_dtype, devices=["cpu"] * 2, name=table_name) as block:
        assert block.row_format == fmt and block.row_bytes == fmt.row_bytes
        assert block.shard_bytes * 2 >= 40 * fmt.row_bytes
        want = torch.linspace(-3, 3, 40 * 13).view(40, 13).to(fmt.torch_dtype)
        block.write(torch.arange(40), want)
        view = block.view()
        assert view.dtype == fmt.torch_dtype and torch.equal(view, want)
        assert view.stride() == (13, 1)


def test_a_dist_block_refuses_what_a_layer_does_not_compute_in(table_name: str) -> None:
    """A layer dtype or a quantized format (read dequantized); nothing else."""
    from gpu import BadArgumentError, DistMemBlock

    choices = f"{LAYER_CHOICES}, torch.int8, torch.float8_e4m3fn"
    for bad in (torch.float64, torch.int16, torch.uint8):
        with pytest.raises(BadArgumentError, match=f"dtype must be one of {choices}; got {bad}"):
            DistMemBlock(4, 4, bad, devices="cpu", name=table_name)


# --- registered host views and the miss resolver ------------------------------------------


@pytest.mark.parametrize("name", list(rows.DTYPES))
def test_registered_rows_step_by_the_format_stride(name: str, table_name: str) -> None:
    from gpu.cuda.registration import register
    from hostcache import SharedMemBlock

    fmt = RowFormat(name, 5)
    block = SharedMemBlock.create(table_name, num_rows=30, dim=5, dtype=fmt.torch_dtype)
    try:
        with register(block, device="cpu") as reg:
            view = reg.rows()
            assert view.dtype == fmt.torch_dtype and view.shape == (30, 5)
            assert view.stride(0) * fmt.itemsize == fmt.stride
            want = torch.arange(10, dtype=torch.float32).view(2, 5).to(fmt.torch_dtype)
            block.write(torch.tensor([3, 29]), want)
            assert torch.equal(view[[3, 29]], want)
            del view
    finally:
        block.close()
        SharedMemBlock.unlink(table_name)


@pytest.mark.parametrize("name", rows.LAYER_DTYPES)
def test_the_resolver_moves_rows_as_the_format_s_payload_bytes(name: str) -> None:
    from gpu.layer_config import InsertPolicy
    from gpu.stacks.misses.counters import MissCounters
    from gpu.stacks.misses.host_filler import HostFiller
    from gpu.stacks.misses.resolver import Resolver

    fmt = RowFormat(name, 9)
    default = torch.linspace(-1, 1, 9).to(fmt.torch_dtype)
    counts = MissCounters()
    res = Resolver(None, None, default, fmt.torch_dtype, 9, InsertPolicy(), HostFiller("t"),
                   1, counts)
    assert res.row_format == fmt and res.row_bytes == fmt.row_bytes
    out = np.zeros((3, res.row_bytes), np.uint8)
    found = res.resolve(np.array([4, 8, 15], np.int64), out, 0)
    assert found is not None and not found.any() and counts.default_rows == 3
    assert torch.equal(res.as_rows(out), default.expand(3, 9))


# --- the loader and the service config ----------------------------------------------------


def test_the_loader_names_the_table_dtype_it_refuses_to_convert_to() -> None:
    from psclient.errors import BadValuesError
    from psclient.loader import check_rows, open_rows

    src = open_rows(torch.zeros(2, 4, dtype=torch.float32))
    for name in ("bfloat16", "float16", "float64"):
        with pytest.raises(BadValuesError, match=f"table 't' holds {name}: convert them"):
            check_rows(src, 4, rows.torch_dtype(name), table="t", convert=False)
    check_rows(src, 4, torch.bfloat16, table="t", convert=True)
    bad = open_rows(torch.zeros(2, 4, dtype=torch.complex64))
    with pytest.raises(BadValuesError, match="a table holds one of float32, float16, bfloat16"):
        check_rows(bad, 4, torch.float32, table="t", convert=True)


@pytest.mark.parametrize("name", list(rows.DTYPES))
def test_a_service_table_takes_every_stored_dtype(name: str) -> None:
    from nvecache.apps.service.config import table_from_dict

    t = table_from_dict("linear", {"name": "t", "dim": 4, "rows": 8, "dtype": name},
                        "linear[0]")
    assert t.dtype == name and t.torch_dtype == rows.torch_dtype(name)
    assert t.geometry().row_format == RowFormat(name, 4)


@pytest.mark.parametrize("bad", ["int8", "fp16", 4, ["float32"], None])
def test_a_service_table_refuses_another_dtype_naming_the_field(bad: object) -> None:
    from nvecache.apps.errors import ServiceConfigError
    from nvecache.apps.service.config import table_from_dict

    with pytest.raises(ServiceConfigError, match=r"linear\[0\] \(t\)\.dtype: must be one of "
                       r"\['bfloat16', 'float16', 'float32', 'float64'\]"):
        table_from_dict("linear", {"name": "t", "dim": 4, "rows": 8, "dtype": bad},
                        "linear[0]")
