"""The machine code of a Triton kernel compiled for sm_90 without a GPU: Triton compiles
it with the ptxas it ships, and the ``cuobjdump`` beside that disassembles it. Used by the
compile tests (``tests/gpu/kernels/test_kernels_compile.py``) and the load-form probe
(``bench/quantized/probe_row_requests.py --sass``)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#: the disassembler Triton ships beside its ptxas
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def sass_text(fn: Any, sig: dict[str, str], cx: dict[str, Any], options: dict[str, Any],
              attrs: dict[tuple[int, ...], list[list[Any]]] | None = None) -> str:
    """``cuobjdump -sass`` of ``fn`` compiled for sm_90 with signature ``sig``, constexprs
    ``cx``, launch ``options`` and argument ``attrs`` (``{(index,): [["tt.divisibility",
    16]]}``: what a launch specializes). Raises FileNotFoundError where Triton ships no
    ``cuobjdump``."""
    if not CUOBJDUMP.exists():
        raise FileNotFoundError(f"no cuobjdump beside Triton ({CUOBJDUMP})")
    compiled = triton.compile(ASTSource(fn, sig, cx, attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], check=True,
                              capture_output=True, text=True).stdout
