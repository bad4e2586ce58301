"""The instructions a kernel variant spends per row element, read without a GPU.

A GPULayer's lookups (row and pooled, over a table of each format) run on the CPU through
the Triton backend; each launch of the kernels named is recorded with its constexprs and
its arguments' specialization (16-byte divisibility, as the compiled launcher computes
it), compiled for sm_90 by ``triton.compile`` and disassembled with the ``cuobjdump``
Triton ships. Printed per variant: the SASS opcodes of the whole kernel, counted, and
divided by the row elements a thread handles per loop step (``BLOCK_K * BLOCK_D /
threads``) where that step is the kernel's only loop. A decode is judged by its opcodes
(a conversion such as ``I2F`` issues on a pipe at a quarter of the float adds' rate);
time on a GPU is still the figure.

Run: ``python bench/kernels/kernel_sass.py [--dim 128] [--kernel _pooled_kernel]``. Needs Triton
with its bundled CUDA tools (no GPU, no driver).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from gpu import LayerType, NVEmbedding, NVEmbeddingBag, TierConfig  # noqa: E402
from gpu.kernels.triton_access import kernel_module  # noqa: E402

#: launch options that are not kernel parameters
OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")
FORMATS = {"float32": None, "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _variant(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The compile inputs of one interpreted launch of ``fn``: its compiled twin, the
    signature, constexprs, options and the divisibility attributes of its arguments."""
    py = fn.fn
    stem = py.__module__.rsplit(".", 1)[-1].removesuffix("_interpreted")
    jit = getattr(kernel_module(stem, interpret=False), py.__name__)
    values = dict(zip(jit.arg_names, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k in jit.arg_names})
    sig: dict[str, str] = {}
    cx: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, p in enumerate(jit.params):
        v = values.get(p.name, p.default if p.default is not inspect.Parameter.empty
                       else None)
        if p.is_constexpr or v is None:
            sig[p.name], cx[p.name] = "constexpr", v
            continue
        sig[p.name] = mangle_type(v)
        _, key = native_specialize_impl(BaseBackend, v, p.is_const, not p.do_not_specialize,
                                        not p.do_not_specialize_on_alignment)
        if isinstance(key, str) and "D" in key:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return {"stem": stem, "name": py.__name__, "jit": jit, "sig": sig, "cx": cx,
            "attrs": attrs, "options": {k: v for k, v in kwargs.items() if k in OPTIONS}}


def record(kernels: set[str], dim: int) -> dict[str, dict[str, Any]]:
    """The variants of ``kernels`` a GPULayer (row and pooled, sum) launches over a table
    of each format, by format."""
    seen: dict[str, dict[str, Any]] = {}
    fmt_now = [""]
    run = InterpretedFunction.run

    def rec(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if self.fn.__name__ in kernels:
            seen.setdefault(f"{self.fn.__name__} {fmt_now[0]}", _variant(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = rec
    try:
        for name, wd in FORMATS.items():
            fmt_now[0] = name
            out = torch.float32 if wd is None else torch.float16
            init = torch.randn(4096, dim).to(out)
            common = {"weight_dtype": wd, "weight_init": init, "device": "cpu",
                      "tuning": TierConfig(cache_backend="triton")}
            layers = [NVEmbeddingBag(4096, dim, out, LayerType.GPULayer, mode="sum", **common),
                      NVEmbedding(4096, dim, out, LayerType.GPULayer, **common)]
            try:
                for layer in layers:
                    layer(torch.randint(0, 4096, (4, 256)))
            finally:
                for layer in layers:
                    layer.close()
    finally:
        InterpretedFunction.run = run
    return seen


def opcodes(v: dict[str, Any], workdir: Path) -> collections.Counter[str]:
    """The SASS opcodes (with their modifiers) of variant ``v`` compiled for sm_90."""
    compiled = triton.compile(ASTSource(v["jit"], v["sig"], v["cx"], v["attrs"]),
                              target=GPUTarget("cuda", 90, 32), options=v["options"])
    cubin = workdir / f"{v['name']}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    # NOTE: an instruction may carry a predicate (``@P0``, ``@!PT``): masked loads do
    return collections.Counter(re.findall(
        r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)", sass))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--kernel", action="append",
                    help="kernel names (default: _pooled_kernel and the gather's)")
    args = ap.parse_args(argv)
    kernels = set(args.kernel or ["_pooled_kernel", "_gather_kernel"])
    with tempfile.TemporaryDirectory() as tmp:
        for label, v in sorted(record(kernels, args.dim).items()):
            ops = opcodes(v, Path(tmp))
            cx = v["cx"]
            threads = 32 * v["options"].get("num_warps", 4)
            per = cx.get("BLOCK_K", 0) * cx.get("BLOCK_D", 0) / threads
            print(json.dumps({
                "variant": label, "BLOCK_K": cx.get("BLOCK_K"), "BLOCK_D": cx.get("BLOCK_D"),
                "threads": threads, "elements_per_thread_step": per,
                "total": sum(ops.values()), "opcodes": dict(ops.most_common(16))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
