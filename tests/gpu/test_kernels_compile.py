"""Every Triton kernel variant the layers launch compiles for a CUDA GPU, checked without one.

On the CPU the kernels run in Triton's interpreter, which executes the Python body and
never compiles it, so a kernel the compiler refuses (the installed Triton's, or an older
one's: Triton 3.6 would not make a called function's string default a constexpr, and every
quantized-capable kernel failed on the first GPU run) passes every CPU test. Here the
layers' lookups run on the CPU through the Triton backend (the service's warm-up:
:func:`nvecache.apps.service.compiled.warm_kernels`, every layer type over tables of each
format, row and pooled, hits and misses; and the GPU's read of a host cache of each
format, in each output dtype); each distinct launch (kernel, argument types,
constexprs, options) is recorded and compiled to PTX for sm_90 by ``triton.compile``,
which needs no device.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from gpu import TierConfig  # noqa: E402
from gpu.cuda.registration import register  # noqa: E402
from gpu.kernels.host_reads import hostcache_lookup  # noqa: E402
from gpu.kernels.triton_access import kernel_module  # noqa: E402
from hostcache import HostCache  # noqa: E402
from nvecache.apps.service.compiled import read_dtypes, warm_kernels  # noqa: E402
from nvecache.common.rows import torch_dtype  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the GPU suite compiles and runs them itself")

#: (dim, stored format, table kind) of the tables whose readers are launched
TABLES = [(16, "float32", "hostcache"), (17, "bfloat16", "linear"), (16, "int8", "linear"),
          (16, "float8_e4m3fn", "hostcache")]
#: launch options that are not kernel parameters
OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")


def _launch(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[str, str, dict[str, str], dict[str, Any], dict[str, Any]]:
    """(kernel module stem, kernel name, signature, constexprs, options) of one launch."""
    py = fn.fn
    stem = py.__module__.rsplit(".", 1)[-1].removesuffix("_interpreted")
    fn = getattr(kernel_module(stem, interpret=False), py.__name__)  # NOTE: its parameters
    names = fn.arg_names
    values = dict(zip(names, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k in names})
    for p in fn.params:
        if p.name not in values and p.default is not inspect.Parameter.empty:
            values[p.name] = p.default
    sig: dict[str, str] = {}
    cx: dict[str, Any] = {}
    for p in fn.params:
        v = values.get(p.name)
        if p.is_constexpr or v is None:
            sig[p.name] = "constexpr"
            cx[p.name] = v
        else:
            sig[p.name] = mangle_type(v)
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    return stem, py.__name__, sig, cx, options


@pytest.fixture(scope="module")
def launches() -> Iterator[dict[tuple[Any, ...], tuple[Any, ...]]]:
    seen: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    run = InterpretedFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        stem, name, sig, cx, options = _launch(self, args, kwargs)
        key = (stem, name, tuple(sig.items()), repr(sorted(cx.items())),
               tuple(sorted(options.items())))
        seen.setdefault(key, (stem, name, sig, cx, options))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(InterpretedFunction, "run", record)
    cpu, triton_backend = torch.device("cpu"), TierConfig(cache_backend="triton")
    try:
        for dim, dtype, kind in TABLES:
            # NOTE: small tables and batches: the interpreter runs every launch
            warm_kernels(dim, dtype, kind, cpu, triton_backend, rows=96, small=16, large=48)
            if kind == "hostcache":
                _host_reads(dim, dtype)
    finally:
        mp.undo()
    yield seen


def _host_reads(dim: int, dtype: str) -> None:
    """The GPU's reads of a host cache of stored format ``dtype``, in every dtype the
    layers read it in."""
    outs = read_dtypes(dtype)
    hc = HostCache.create(f"kernels-compile-{dim}-{dtype}", capacity=256, dim=dim,
                          dtype=torch_dtype(dtype))
    try:
        rows = torch.randn(100, dim)  # NOTE: a quantized cache takes float32 rows
        hc.insert(torch.arange(100), rows if hc.quantized else rows.to(outs[0]))
        reg = register(hc, torch.device("cpu"))
        try:
            for out in outs:
                hostcache_lookup(reg, torch.arange(150), backend="triton", out_dtype=out)
        finally:
            reg.close()
    finally:
        hc.close()
        HostCache.unlink(hc.name)


def test_the_lookups_launch_every_kernel_module(launches: dict) -> None:
    stems = {stem for stem, *_ in launches.values()}
    assert {"cache_lookup", "cache_pooled", "cache_insert", "gather", "host_tier"} <= stems, \
        stems


def test_every_launched_variant_compiles_for_sm90(launches: dict) -> None:
    failed = []
    for stem, name, sig, cx, options in launches.values():
        fn = getattr(kernel_module(stem, interpret=False), name)
        try:
            compiled = triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", 90, 32),
                                      options=options)
        except Exception as e:  # noqa: BLE001 - every failing variant named at once
            failed.append(f"{stem}.{name} {cx}: {type(e).__name__}: {str(e)[-300:]}")
            continue
        assert "ptx" in compiled.asm
    assert not failed, "\n".join(failed)
