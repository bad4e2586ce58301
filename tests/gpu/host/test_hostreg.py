"""Tests of gpu.cuda.registration: CPU views on every machine, CUDA registration on GPU machines."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpu.cuda.registration import (
    ForkedProcessError,
    RegistrationClosedError,
    ViewNotAvailableError,
    pointer_is_registered,
    register,
)
from gpu.errors import BadArgumentError, CUDAUnavailableError, GPUError
from hostcache import HostCache, SharedMemBlock, layout

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False) and cuda-python",
)


@pytest.fixture
def cache(table_name: str):
    hc = HostCache.create(table_name, capacity=512, dim=6, ways=8)
    yield hc
    hc.close()
    HostCache.unlink(table_name)


@pytest.fixture
def block(table_name: str):
    mb = SharedMemBlock.create(table_name, num_rows=300, dim=5, dtype=torch.float16)
    yield mb
    mb.close()
    SharedMemBlock.unlink(table_name)


def _slot_of(hc: HostCache, key: int) -> int:
    keys = hc.buffer[hc.geometry.keys_off :][: hc.geometry.slots * 8].view(torch.int64)
    return int((keys == key).nonzero().item())


# -- CPU: every machine -----------------------------------------------------------------


def test_cpu_views_alias_the_segment(cache: HostCache) -> None:
    with register(cache, device="cpu") as reg:
        assert reg.device == torch.device("cpu")
        rows, keys, versions = reg.rows(), reg.keys(), reg.versions()
        g = cache.geometry
        assert rows.shape == (g.slots, g.dim) and rows.dtype == g.dtype
        assert rows.data_ptr() == cache.buffer.data_ptr() + g.rows_off
        assert keys.data_ptr() == cache.buffer.data_ptr() + g.keys_off
        assert bool((keys == layout.EMPTY_KEY).all())
        # a write through the table shows in the views ...
        cache.insert(torch.tensor([7]), torch.full((1, g.dim), 3.5))
        s = _slot_of(cache, 7)
        assert int(keys[s]) == 7 and int(versions[s]) % 2 == 0 and int(versions[s]) > 0
        assert torch.equal(rows[s], torch.full((g.dim,), 3.5))
        # ... and a write through a view shows in the table
        rows[s] = 9.0
        values, hit = cache.lookup(torch.tensor([7]))
        assert bool(hit[0]) and torch.equal(values[0], torch.full((g.dim,), 9.0))
        assert int(reg.header()[layout.W_MAGIC]) == layout.MAGIC
        assert reg.ring_seq().shape == reg.ring_keys().shape == (g.ring_capacity,)
        assert reg.counters().dtype == torch.int32
        assert torch.equal(reg.view("keys"), keys)


def test_linear_table_views(block: SharedMemBlock) -> None:
    with register(block, device="cpu") as reg:
        rows = reg.rows()
        assert rows.shape == (300, 5) and rows.dtype == torch.float16
        assert rows.stride() == block.tensor.stride()
        block.write(torch.tensor([4, 299]), torch.ones(2, 5, dtype=torch.float16))
        assert torch.equal(rows[[4, 299]], torch.ones(2, 5, dtype=torch.float16))
        with pytest.raises(ViewNotAvailableError, match="linear table"):
            reg.keys()
        with pytest.raises(ViewNotAvailableError):
            reg.versions()


def test_close_is_idempotent_and_views_outlive_it(cache: HostCache) -> None:
    reg = register(cache, device="cpu")
    view = reg.rows()
    reg.close()
    reg.close()  # double close is safe
    assert reg.closed
    with pytest.raises(RegistrationClosedError, match="register"):
        reg.rows()
    with pytest.raises(RegistrationClosedError):
        _ = reg.address
    cache.insert(torch.tensor([1]), torch.ones(1, 6))
    assert float(view.sum()) == 6.0  # the view still reads the shared pages


def test_table_closed_before_registration_keeps_memory_mapped(table_name: str) -> None:
    hc = HostCache.create(table_name, capacity=64, dim=4)
    try:
        hc.insert(torch.tensor([5]), torch.full((1, 4), 2.0))
        reg = register(hc, device="cpu")
        rows = reg.rows()
        hc.close()  # wrong order, but nothing is unmapped under the registration
        assert float(rows.sum()) == 8.0
        reg.close()
        del rows
    finally:
        HostCache.unlink(table_name)


def test_registering_twice_shares_one_registration(cache: HostCache) -> None:
    a = register(cache, device="cpu")
    b = register(cache, device="cpu")
    assert (a.address, a.size, a.chunks) == (b.address, b.size, b.chunks)
    a.close()
    assert a.closed and not b.closed
    assert b.rows().shape[0] == cache.geometry.slots
    b.close()


@pytest.mark.gpu
@needs_cuda
def test_registering_twice_on_cuda_shares_one_registration(cache: HostCache) -> None:
    """CUDA refuses to register a range twice: the second registration is the first's,
    still in place when the first handle closes and gone once the second does."""
    a = register(cache, device="cuda")
    b = register(cache, device="cuda")
    base = a.chunks[0]
    assert (a.address, a.size, a.chunks) == (b.address, b.size, b.chunks)
    a.close()
    assert a.registered and b.registered and pointer_is_registered(base, "cuda")
    b.close()
    gc.collect()
    assert not a.registered and not pointer_is_registered(base, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_a_registration_dropped_while_a_graph_is_captured_never_strands_its_address(
        table_name: str) -> None:
    """A CUDA graph captured in global mode refuses cudaHostUnregister on every thread, and
    a garbage collection can drop a registration's last handle meanwhile: its mapping must
    stay until the registration is undone, so that no later mapping at that address meets
    a registration of memory gone (cudaErrorHostMemoryAlreadyRegistered)."""
    x = torch.zeros(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    names = [f"{table_name}-{i}" for i in range(3)]
    blocks = [SharedMemBlock.create(name, num_rows=64, dim=16) for name in names]
    regs = [register(mb, device="cuda") for mb in blocks]
    bases = [reg.chunks[0] for reg in regs]
    # NOTE: earlier tests' garbage is collected now, not inside the capture (a finalizer of
    # theirs that calls CUDA would invalidate it): inside, only this test's handles go
    gc.collect()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):  # NOTE: torch's default: global capture mode
        y = x + 1
        for name, mb in zip(names, blocks, strict=True):
            regs.pop(0).close()
            gc.collect()
            mb.close()
            SharedMemBlock.unlink(name)
    del blocks
    gc.collect()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x + 1)
    # NOTE: new mappings of the same size land at the addresses just freed, if any were
    for i in range(2 * len(names)):
        name = f"{table_name}-again-{i}"
        mb = SharedMemBlock.create(name, num_rows=64, dim=16)
        try:
            with register(mb, device="cuda") as reg:
                assert pointer_is_registered(reg.chunks[0], "cuda")
        finally:
            mb.close()
            SharedMemBlock.unlink(name)
    gc.collect()
    assert not any(pointer_is_registered(base, "cuda") for base in bases)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_bytes": 1000}, "multiple of 4096"),
        ({"chunk_bytes": 0}, "multiple of 4096"),
        ({"chunk_bytes": 512 << 30}, "below 512 GiB"),
        ({"chunk_bytes": 4096.0}, "must be an int"),
        ({"device": "meta"}, "CPU or CUDA"),
        ({"device": "nonsense"}, "device must be"),
    ],
)
def test_bad_arguments_raise_typed_errors(cache: HostCache, kwargs: dict, match: str) -> None:
    with pytest.raises(BadArgumentError, match=match) as info:
        register(cache, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, GPUError)


def test_not_a_table_and_closed_table_are_refused(table_name: str) -> None:
    with pytest.raises(BadArgumentError, match="HostCache or hostcache.SharedMemBlock"):
        register(torch.zeros(10))
    hc = HostCache.create(table_name, capacity=16, dim=2)
    hc.close()
    HostCache.unlink(table_name)
    with pytest.raises(BadArgumentError, match="cannot register"):
        register(hc, device="cpu")


def test_bad_view_name(cache: HostCache) -> None:
    with register(cache, device="cpu") as reg, pytest.raises(BadArgumentError, match="view"):
        reg.view("weights")  # type: ignore[arg-type]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_cuda_device_without_cuda_is_refused(cache: HostCache) -> None:
    with pytest.raises(CUDAUnavailableError, match="device='cpu'"):
        register(cache, device="cuda")
    reg = register(cache)  # device=None falls back to the CPU
    assert reg.device.type == "cpu" and not reg.registered
    assert pointer_is_registered(reg.address) is False
    reg.close()


def test_cpu_registration_makes_no_cuda_call(table_name: str) -> None:
    """In a fresh interpreter: CPU registration imports neither cuda-python nor CUDA."""
    script = textwrap.dedent(
        f"""
        import sys, types, torch

        class Tripwire(types.ModuleType):  # cuda-python's runtime: any CUDA call fails
            def __getattr__(self, name):
                if name.startswith("cuda"):
                    raise AssertionError(f"a CPU registration called CUDA: {{name}}")
                raise AttributeError(name)

        # NOTE: after torch's import (torch imports cuda-python where it is installed);
        # every CUDA call of ours goes through cuda-python's runtime module
        cuda, bindings, rt = (types.ModuleType("cuda"), types.ModuleType("cuda.bindings"),
                              Tripwire("cuda.bindings.runtime"))
        cuda.bindings, cuda.cudart, bindings.runtime = bindings, rt, rt
        sys.modules.update({{"cuda": cuda, "cuda.bindings": bindings,
                            "cuda.bindings.runtime": rt, "cuda.cudart": rt}})
        from hostcache import HostCache
        from gpu.cuda import registration as hostreg
        from gpu.kernels import host_reads as host_kernels
        hc = HostCache.create({table_name!r}, capacity=64, dim=4)
        try:
            hc.insert(torch.arange(10), torch.ones(10, 4))
            with hostreg.register(hc, device="cpu") as reg:
                v, h = host_kernels.hostcache_lookup(reg, torch.arange(20))
                assert int(h.sum()) == 10
            assert not torch.cuda.is_initialized()
        finally:
            hc.close()
            HostCache.unlink({table_name!r})
        print("ok")
        """
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
        cwd=str(Path(__file__).resolve().parents[3]),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


# -- CUDA: GPU machines -------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_views_are_zero_copy_both_ways(cache: HostCache) -> None:
    g = cache.geometry
    with register(cache, device="cuda") as reg:
        assert reg.registered and reg.device.type == "cuda"
        rows, keys = reg.rows(), reg.keys()
        assert rows.is_cuda and rows.data_ptr() == reg.address + g.rows_off
        cache.insert(torch.tensor([11]), torch.full((1, g.dim), 1.25))
        s = _slot_of(cache, 11)
        assert int(keys[s].item()) == 11  # the CPU's write, read by the GPU
        rows[s] = 4.0  # a GPU write ...
        torch.cuda.synchronize()
        values, hit = cache.lookup(torch.tensor([11]))  # ... read by the CPU
        assert bool(hit[0]) and torch.equal(values[0], torch.full((g.dim,), 4.0))


@pytest.mark.gpu
@needs_cuda
def test_cuda_registration_in_several_chunks(block: SharedMemBlock) -> None:
    block.write(torch.arange(300), torch.randn(300, 5).to(torch.float16))
    with register(block, device="cuda", chunk_bytes=4 * 4096) as reg:
        assert len(reg.chunks) == -(-reg.size // (4 * 4096)) > 1
        assert torch.equal(reg.rows().cpu(), block.tensor)
        assert all(pointer_is_registered(c, "cuda") for c in reg.chunks)


def _vm_pinned_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmPin:"):
                return int(line.split()[1])
    return 0


@pytest.mark.gpu
@needs_cuda
def test_register_unregister_20_times_leaves_nothing_pinned(table_name: str) -> None:
    # NOTE: three independent checks: cudaPointerGetAttributes says "unregistered" after
    # each close; registering the same range again succeeds (CUDA refuses a range that is
    # still registered); VmPin (pages pinned by drivers) comes back to where it was.
    hc = HostCache.create(table_name, capacity=1 << 15, dim=128)  # ~17 MiB
    try:
        before = _vm_pinned_kib()
        for _ in range(20):
            reg = register(hc, device="cuda", chunk_bytes=1 << 22)
            chunks = reg.chunks
            assert len(chunks) > 1 and all(pointer_is_registered(c, "cuda") for c in chunks)
            reg.close()
            assert not reg.registered
            assert not any(pointer_is_registered(c, "cuda") for c in chunks)
        assert _vm_pinned_kib() - before < 1024
    finally:
        hc.close()
        HostCache.unlink(table_name)


@pytest.mark.gpu
@needs_cuda
def test_views_keep_the_registration_alive(cache: HostCache) -> None:
    reg = register(cache, device="cuda")
    base = reg.chunks[0]
    view = reg.rows()[1:3]  # a tensor derived from a view keeps it too
    reg.close()
    assert reg.registered and pointer_is_registered(base, "cuda")
    assert float(view.float().sum().item()) == 0.0
    del view
    gc.collect()
    assert not reg.registered and not pointer_is_registered(base, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_fork_after_cuda_init_is_refused(cache: HostCache) -> None:
    reg = register(cache, device="cuda")
    try:
        pid = os.fork()
        if pid == 0:  # child: CUDA state inherited through fork must not be used
            code = 1
            try:
                try:
                    register(cache, device="cuda")
                except ForkedProcessError:
                    try:
                        reg.rows()
                    except ForkedProcessError:
                        code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert reg.rows().is_cuda  # the parent's registration is unaffected
    finally:
        reg.close()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA GPUs")
def test_one_process_registers_once_for_every_gpu(block: SharedMemBlock) -> None:
    """Layers on several GPUs of one process share one portable registration."""
    block.write(torch.arange(300), torch.arange(1500, dtype=torch.float16).view(300, 5))
    regs = [register(block, f"cuda:{d}") for d in range(torch.cuda.device_count())]
    views = [r.rows() for r in regs]
    assert len({v.data_ptr() for v in views}) == 1  # one device address for every GPU
    assert [v.device.index for v in views] == list(range(len(regs)))
    for v in views:
        assert torch.equal(v[:300].cpu(), block.tensor)
    views[1][7] = 9.0  # a write through one GPU's view is the host row
    torch.cuda.synchronize(1)
    assert float(block.tensor[7, 0]) == 9.0 and float(views[0][7, 0].cpu()) == 9.0
    del views, v  # the loop variable holds a view (and the registration) too
    for r in regs:
        r.close()
    gc.collect()
    assert not pointer_is_registered(block.buffer.data_ptr(), "cuda:0")
