"""``hostcache serve`` at start: the parameter-server tables it opens (and creates only when
its config says so), and a table too large for /dev/shm, each refused with one line that
says what to change and with nothing left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import psclient
from hostcache import SharedMemoryFullError, segment
from nvecache.apps.errors import PSTableMissingError
from nvecache.apps.service import NodeService, ServiceConfig, ServiceConfigError, build_config
from tests.test_failures import DIM, rows_of, write_config

ROOT = Path(__file__).resolve().parents[2]
#: rows x dim of a table far larger than any /dev/shm (4 TiB of float32 rows)
HUGE_ROWS, HUGE_DIM = 1 << 32, 256


@pytest.fixture
def store(tmp_path: Path, table_name: str) -> str:
    """A file:// parameter server holding one loaded table, named like the test table."""
    url = f"file://{tmp_path / 'ps'}"
    ps = psclient.connect(url, table=table_name, dim=DIM, dtype=torch.float32)
    keys = torch.arange(10)
    ps.insert(keys, rows_of(keys, 0))
    ps.close()
    return url


def config_file(tmp_path: Path, tables: list[dict[str, Any]]) -> Path:
    return write_config(tmp_path / "node.toml", {"state_dir": str(tmp_path / "state"),
                                                 "metrics_port": -1}, tables)


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    """``hostcache serve --config FILE`` as a user runs it (a subprocess)."""
    return subprocess.run([sys.executable, "-m", "nvecache.apps.cli", "serve", "--config",
                           str(config)], cwd=ROOT, capture_output=True, text=True, timeout=120)


def shm_entries(*names: str) -> list[str]:
    return [p for n in names for p in (segment.shm_path(n), segment.lock_path(n))
            if Path(p).exists()]


def tables_of(cfg: ServiceConfig) -> list[str]:
    return [t.name for t in cfg.tables]


# -- parameter-server tables --------------------------------------------------------------------


def test_a_missing_ps_table_is_an_error_and_nothing_is_created(
        tmp_path: Path, table_name: str, store: str) -> None:
    typo = table_name + "-typo"
    cfg = build_config(config_file(tmp_path, [
        {"kind": "linear", "name": f"{table_name}-lin", "rows": 64, "dim": DIM},
        {"name": table_name, "capacity": 1024, "dim": DIM, "ps_url": store, "ps_table": typo},
    ]), env={})
    with pytest.raises(PSTableMissingError) as err:
        NodeService(cfg).start()
    msg = str(err.value)
    assert f"parameter-server table {typo!r} does not exist" in msg
    assert f"psclient load {store} --table {typo}" in msg and "ps_create = true" in msg
    assert typo not in psclient.list_tables(store)  # the typo made no table
    assert shm_entries(*tables_of(cfg)) == []  # the linear table before it was not created
    # the lock was let go: a service with the right name starts
    ok = NodeService(build_config(config_file(tmp_path, [
        {"name": table_name, "capacity": 1024, "dim": DIM, "ps_url": store}]), env={}))
    ok.start()
    ok.stop()
    assert shm_entries(table_name) == []


def test_the_cli_reports_a_missing_ps_table_in_one_line(
        tmp_path: Path, table_name: str, store: str) -> None:
    typo = table_name + "-typo"
    done = serve(config_file(tmp_path, [
        {"name": table_name, "capacity": 1024, "dim": DIM, "ps_url": store, "ps_table": typo}]))
    err = done.stderr.strip()
    assert done.returncode == 2, err
    assert err.startswith(f"hostcache: error: table {table_name!r}: parameter-server table "
                          f"{typo!r} does not exist") and "\n" not in err
    assert typo not in psclient.list_tables(store)
    assert shm_entries(table_name) == []


def test_ps_create_creates_the_missing_table_with_the_configured_schema(
        tmp_path: Path, table_name: str, store: str) -> None:
    new = table_name + "-new"
    cfg = build_config(config_file(tmp_path, [
        {"name": table_name, "capacity": 1024, "dim": DIM, "dtype": "float16",
         "ps_url": store, "ps_table": new, "ps_create": True}]), env={})
    assert cfg.tables[0].ps_create is True
    service = NodeService(cfg)
    service.start()
    try:
        assert service.health()[0]
    finally:
        service.stop()
    ps = psclient.connect(store, table=new)
    assert (ps.dim, ps.dtype, ps.size()) == (DIM, torch.float16, 0)
    ps.close()


# -- a table larger than /dev/shm ---------------------------------------------------------------


def test_serve_says_to_lower_the_capacity_of_a_table_too_large_for_shm(
        tmp_path: Path, table_name: str) -> None:
    done = serve(config_file(tmp_path, [
        {"name": table_name, "capacity": HUGE_ROWS, "dim": HUGE_DIM}]))
    err = done.stderr.strip()
    assert done.returncode == 2, err
    assert err.startswith(f"hostcache: error: table {table_name!r} needs 4,") and "\n" not in err
    assert "lower its capacity in the config" in err
    assert "overcommit" not in err  # no such config field
    assert shm_entries(table_name) == []


def test_a_linear_table_too_large_for_shm_names_its_rows(tmp_path: Path, table_name: str) -> None:
    cfg = build_config(config_file(tmp_path, [
        {"kind": "linear", "name": table_name, "rows": HUGE_ROWS, "dim": HUGE_DIM}]), env={})
    with pytest.raises(SharedMemoryFullError, match="lower its rows in the config") as err:
        NodeService(cfg).start()
    assert "overcommit" not in str(err.value)
    assert err.value.needed > err.value.free
    assert shm_entries(table_name) == []


# -- quantized host caches ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_a_quantized_host_cache_over_a_float32_table(tmp_path: Path, table_name: str,
                                                     store: str, fmt: str) -> None:
    """``dtype = "int8"`` (or fp8) and ``ps_dtype = "float32"``: the service creates the
    quantized cache, warms it with the server's rows encoded (a row with a NaN left out),
    and a Hierarchical layer over both reads the round trip from either tier."""
    from gpu import LayerType, NVEmbedding
    from hostcache import HostCache
    from nvecache.common import quant
    from nvecache.common.rows import RowFormat

    ps = psclient.connect(store, table=table_name)
    bad = rows_of(torch.tensor([3]), 0)
    bad[0, 1] = float("nan")
    ps.update(torch.tensor([3]), bad, allow_nonfinite=True)
    ps.close()
    cfg = build_config(config_file(tmp_path, [
        {"name": table_name, "capacity": 1024, "dim": DIM, "dtype": fmt, "ps_url": store,
         "ps_dtype": "float32", "warmup": "all"}]), env={})
    assert (cfg.tables[0].dtype, cfg.tables[0].ps_format) == (fmt, "float32")
    service = NodeService(cfg)
    service.start()
    try:
        keys = torch.arange(10)
        f = RowFormat(fmt, DIM)
        want = quant.decode(quant.encode(rows_of(keys, 0), f), f)
        with HostCache.attach(table_name) as hc:
            assert hc.quantized and hc.row_format == f
            assert hc.contains(keys).tolist() == [k != 3 for k in range(10)]
            values, _ = hc.lookup(keys)
            held = keys != 3
            assert torch.equal(values[held], want[held])
            with psclient.connect(store, table=table_name) as server, \
                    NVEmbedding(10, DIM, torch.float32, LayerType.Hierarchical, host_cache=hc,
                                storage=server, device="cpu") as layer:
                got = layer(keys)  # NOTE: key 3 from the server, as it holds it
                assert torch.equal(got[held], want[held])
                assert bool(torch.isnan(got[3, 1]))
    finally:
        service.stop()
    assert shm_entries(table_name) == []


def test_a_quantized_host_cache_over_a_table_of_its_format_holds_the_servers_bytes(
        tmp_path: Path, table_name: str, store: str) -> None:
    """An int8 host cache over an int8 table: the warm-up fills it with the server's stored
    bytes (what a layer's fills take), so it reads back what the server reads back, bit
    for bit, not the server's rows encoded once more (which differ for some rows)."""
    from hostcache import HostCache
    from nvecache.common import quant

    new = table_name + "-q8"
    keys = torch.arange(64)
    rows = torch.randn(64, DIM, generator=torch.Generator().manual_seed(4)) * 3
    with psclient.connect(store, table=new, dim=DIM, dtype=torch.int8) as ps:
        ps.insert(keys, rows)
        served, _ = ps.lookup(keys)
        fmt = ps.schema.row_format
    again = quant.decode(quant.encode(served, fmt), fmt)
    assert not torch.equal(again, served)  # NOTE: the old rule's rows: not the server's
    cfg = build_config(config_file(tmp_path, [
        {"name": table_name, "capacity": 1024, "dim": DIM, "dtype": "int8", "ps_url": store,
         "ps_table": new, "warmup": "all"}]), env={})
    service = NodeService(cfg)
    service.start()
    try:
        with HostCache.attach(table_name) as hc:
            values, hit = hc.lookup(keys)
            assert bool(hit.all())
            assert torch.equal(values, served)
    finally:
        service.stop()
        with psclient.connect(store, table=new) as ps:
            ps.drop()
    assert shm_entries(table_name) == []


def test_a_quantized_ps_table_is_created_in_its_format(tmp_path: Path, table_name: str,
                                                       store: str) -> None:
    new = table_name + "-q"
    cfg = build_config(config_file(tmp_path, [
        {"name": table_name, "capacity": 1024, "dim": DIM, "dtype": "float8_e4m3fn",
         "ps_url": store, "ps_table": new, "ps_create": True}]), env={})
    service = NodeService(cfg)
    service.start()
    service.stop()
    ps = psclient.connect(store, table=new)
    assert (ps.dim, ps.dtype, ps.quantized) == (DIM, torch.float8_e4m3fn, True)
    ps.close()
    with pytest.raises(ServiceConfigError, match=r"\[\[hostcache\]\] tables"):
        build_config(config_file(tmp_path, [
            {"kind": "linear", "name": table_name, "rows": 8, "dim": DIM, "dtype": "int8"}]),
            env={})
