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
which needs no device. A replica's lookups over tables, caches and batches sized unlike
the warm-up's launch no variant it did not (Triton compiles one per constexprs and per
specialization of its other arguments: an integer's 1 or 16-divisibility, a pointer's
16-byte alignment), so a node whose service warmed up compiles nothing while serving.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from gpu import LayerType, NVEmbedding, NVEmbeddingBag, TierConfig  # noqa: E402
from gpu.cuda.registration import register  # noqa: E402
from gpu.kernels.host_reads import hostcache_lookup  # noqa: E402
from gpu.kernels.triton_access import kernel_module  # noqa: E402
from hostcache import HostCache, SharedMemBlock  # noqa: E402
from nvecache.apps.service.compiled import read_dtypes, warm_kernels  # noqa: E402
from nvecache.common.rows import torch_dtype  # noqa: E402
from tests.conftest import fresh_name  # noqa: E402
from tests.gpu.sass import sass_text  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the GPU suite compiles and runs them itself")

#: (dim, stored format, table kind) of the tables whose readers are launched
TABLES = [(16, "float32", "hostcache"), (17, "bfloat16", "linear"), (16, "int8", "linear"),
          (16, "float8_e4m3fn", "hostcache")]
#: launch options that are not kernel parameters
OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")


def _launch(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[str, str, dict[str, str], dict[str, Any], dict[str, Any], tuple[Any, ...]]:
    """(kernel module stem, kernel name, signature, constexprs, options, specialization)
    of one launch: the specialization as the compiled kernel's launcher computes it (each
    argument's type and key, or, unless the kernel declines it, its value where it is 1)."""
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
    spec: list[Any] = []
    for p in fn.params:
        v = values.get(p.name)
        if p.is_constexpr or v is None:
            sig[p.name] = "constexpr"
            cx[p.name] = v
        else:
            sig[p.name] = mangle_type(v)
            spec.append((p.name, *native_specialize_impl(
                BaseBackend, v, p.is_const, not p.do_not_specialize,
                not p.do_not_specialize_on_alignment)))
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    return stem, py.__name__, sig, cx, options, tuple(spec)


class Recorder:
    """Every distinct launch while installed, by phase: ``variants[phase]`` holds each
    launch's (kernel, signature, constexprs, options, specialization); ``launches`` one
    entry per compiled kernel (specializations aside) to compile."""

    def __init__(self) -> None:
        self.phase = ""
        self.variants: dict[str, set[tuple[Any, ...]]] = {}
        self.launches: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def record(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        stem, name, sig, cx, options, spec = _launch(fn, args, kwargs)
        key = (stem, name, tuple(sig.items()), repr(sorted(cx.items())),
               tuple(sorted(options.items())))
        self.launches.setdefault(key, (stem, name, sig, cx, options))
        self.variants.setdefault(self.phase, set()).add((*key, spec))


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    run = InterpretedFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        rec.record(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(InterpretedFunction, "run", record)
    cpu, triton_backend = torch.device("cpu"), TierConfig(cache_backend="triton")
    try:
        rec.phase = "warm-up"
        for dim, dtype, kind in TABLES:
            # NOTE: small tables and batches: the interpreter runs every launch
            warm_kernels(dim, dtype, kind, cpu, triton_backend, rows=96, small=16, large=48)
            if kind == "hostcache":
                _host_reads(dim, dtype)
        rec.phase = "replica"
        _replica(cpu, triton_backend)
    finally:
        mp.undo()
    yield rec


@pytest.fixture(scope="module")
def launches(recorder: Recorder) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    return recorder.launches


def _replica(device: torch.device, tuning: TierConfig) -> None:
    """A replica's layers over tables and caches sized unlike the warm-up's (the first two
    TABLES' formats), looked up in batches of odd sizes, one key too, row and pooled."""
    # NOTE: names of this process's own: xdist workers may each build this module's fixture
    hc = HostCache.create(fresh_name("kc-replica-hc"), capacity=500, dim=16)
    mb = SharedMemBlock.create(fresh_name("kc-replica-mb"), num_rows=300, dim=16,
                               dtype=torch.int8)
    g = torch.Generator().manual_seed(1)
    try:
        hc.insert(torch.arange(200), torch.randn(200, 16, generator=g))
        mb.write(torch.arange(300), torch.randn(300, 16, generator=g))
        common = {"device": device, "tuning": tuning}
        hier = {"host_cache": hc, "gpu_cache_size": 64 * 40, "default_row": 0.0, **common}
        layers = [
            NVEmbedding(1000, 16, torch.float32, LayerType.Hierarchical, **hier),
            NVEmbeddingBag(1000, 16, torch.float32, LayerType.Hierarchical, **hier),
            NVEmbedding(300, 16, torch.float16, LayerType.LinearUVM, storage=mb,
                        gpu_cache_size=16 * 40, **common),
            NVEmbeddingBag(300, 16, torch.bfloat16, LayerType.GPULayer,
                           weight_init=torch.randn(300, 16, generator=g).bfloat16(),
                           weight_dtype=torch.int8, **common),
        ]
        try:
            for n in (3, 70, 33, 70, 1, 45):
                keys = torch.randint(0, 300, (n,), generator=g)
                for layer in layers:
                    if isinstance(layer, NVEmbeddingBag):
                        layer(keys, torch.arange(0, n, 10))
                    else:
                        layer(keys)
        finally:
            for layer in layers:
                layer.close()
    finally:
        hc.close()
        HostCache.unlink(hc.name)
        mb.close()
        SharedMemBlock.unlink(mb.name)


def _host_reads(dim: int, dtype: str) -> None:
    """The GPU's reads of a host cache of stored format ``dtype``, in every dtype the
    layers read it in."""
    outs = read_dtypes(dtype)
    hc = HostCache.create(fresh_name(f"kc-{dim}-{dtype}"), capacity=256, dim=dim,
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


def test_a_replica_launches_no_variant_the_warm_up_did_not(recorder: Recorder) -> None:
    warmed, served = recorder.variants["warm-up"], recorder.variants["replica"]
    assert {v[:2] for v in served} >= {("cache_insert", "_insert_plan_kernel"),
                                       ("cache_lookup", "_lookup_kernel")}
    new = served - warmed
    assert not new, "\n".join(f"{v[0]}.{v[1]} {v[5]}" for v in sorted(new, key=str))


#: a SASS instruction: optional predicate guard, opcode, operands
_SASS = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@(!?)(U?P\d|PT)\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_OFFSET = re.compile(r"\[R\d+\.64(?:\+(0x[0-9a-f]+))?\]")


def _sass(stem: str, name: str, sig: dict, cx: dict, options: dict) -> list[tuple]:
    """(guard predicate or None, opcode, operands) of a variant compiled for sm_90, by
    the ``cuobjdump`` Triton ships."""
    fn = getattr(kernel_module(stem, interpret=False), name)
    try:
        text = sass_text(fn, sig, cx, options)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return [(None if g in (None, "PT") or neg else g, op, args)
            for neg, g, op, args in _SASS.findall(text)]


#: a register or predicate operand (``R12``, ``UR4``, ``P3``, ``!P3``, ``R6.64``, ``R2.reuse``)
_OPERAND = re.compile(r"\bU?[RP]\d+\b")
#: opcodes whose first two operands are both written (a predicate and a register, or a
#: register and a predicate: a warp shuffle's)
_TWO_OUT = ("ISETP", "FSETP", "DSETP", "HSETP", "PLOP3", "LOP3", "SHFL")


def _operands(op: str, args: str) -> tuple[list[str], list[str]]:
    """(written, read) registers and predicates of one SASS instruction (RZ and PT, the
    constants, are neither)."""
    parts = [a.strip() for a in args.split(",")]
    head = op.split(".")[0]  # NOTE: REDUX (a warp's reduction into a register) is not RED
    if head.startswith("ST") or head in ("RED", "BAR", "BRA", "EXIT") or not parts[0]:
        return [], _OPERAND.findall(args)
    outs = 2 if op.startswith(_TWO_OUT) and re.match(r"U?P\d|PT", parts[0]) else 1
    written = [r for p in parts[:outs] for r in _OPERAND.findall(p) if "[" not in p]
    return written, _OPERAND.findall(",".join(parts[outs:]))


def test_a_versioned_row_is_loaded_only_after_its_version_arrived(launches: dict) -> None:
    """Every load of a versioned row's payload or parameters, in the compiled gather,
    is guarded by a predicate computed from the versions loaded before it: the machine
    code keeps the order the seqlock needs (ptxas folded an earlier form's opaque zero
    and issued the row's loads beside the version's). Computed from: through any chain
    of instructions, shared memory included (a row's verdict crosses the program's
    threads there), followed by taint: whatever is written from a value computed from a
    version is computed from it, and a load from shared memory after such a value was
    stored there."""
    variants = [v for v in launches.values()
                if v[0] == "gather" and v[3].get("SEQ") and v[3].get("QUANT")]
    assert variants, "no versioned gather was launched"
    for stem, name, sig, cx, options in variants:
        seq = cx["SEQ"]
        tainted: set[str] = set()  # registers and predicates computed from a version
        shared = False  # such a value was stored to shared memory
        row_loads = 0
        for guard, op, args in _sass(stem, name, sig, cx, options):
            written, read = _operands(op, args)
            if op.startswith("LDG") and ".STRONG.SYS" in op:
                off = _OFFSET.search(args)
                if off and int(off.group(1) or "0", 16) == seq:
                    tainted.update(written)
                    continue
                row_loads += 1
                assert guard in tainted, (
                    f"{name} {cx}: a row load ({op} {args}) not guarded by a predicate "
                    f"from its version (guard {guard})")
                tainted.difference_update(written)
                continue
            from_version = any(r in tainted for r in read) or (op.startswith("LDS") and shared)
            if op.startswith("STS") and from_version:
                shared = True
            if from_version:
                tainted.update(written)
            elif guard is None:
                tainted.difference_update(written)  # NOTE: written anew from other values
        assert row_loads, f"{name} {cx}: no row load found"


def test_a_host_cache_probe_loads_its_keys_only_after_the_fence(launches: dict) -> None:
    """The compiled probe of a registered host cache (its fence on, as on a GPU) loads
    the bucket's versions before its ``fence.acq_rel.sys`` and the bucket's keys after
    it: the fence takes the versions as its input (so it waits for them) and an SM
    issues in order, so no key is read before the version that judges it. (The fence's
    opaque zero is folded by ptxas: the key addresses carry no dependency; the fence
    orders.) The versions and the keys are the probe's only system-scope loads, as many
    of each per thread: a key load moved above the fence unbalances the two counts."""
    variants = [v for v in launches.values() if v[1] == "probe_kernel"]
    assert variants, "no host cache probe was launched"
    for stem, name, sig, cx, options in variants:
        cx = dict(cx, FENCE=True)  # NOTE: the interpreter's launches compile it out
        before, after, fences = 0, 0, 0
        for _guard, op, _args in _sass(stem, name, sig, cx, options):
            if op.startswith("MEMBAR") and op.endswith(".SYS"):
                fences += 1
            elif op.startswith("LDG") and ".STRONG.SYS" in op:
                if fences:
                    after += 1
                else:
                    before += 1
        assert fences, f"{name} {cx}: no system-scope fence"
        assert before == after > 0, (
            f"{name} {cx}: {before} system-scope loads before the fence, {after} after")
