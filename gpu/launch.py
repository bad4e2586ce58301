"""Launching a compiled Triton kernel without the JIT's per-call work.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument, hashes a cache
key and builds launch metadata on every call: on the H200 machine that costs several times
the launch itself, and more than a serving-size lookup's kernel runs (bench/RESULTS.md,
"Per-call path (H200)", "Where the host time goes").
:class:`DirectLaunch` binds once: the first call of a variant goes through the JIT (which
compiles it or loads it from Triton's cache), later calls hand the compiled kernel's
launcher the arguments directly, as torch inductor's generated launchers do.

What keeps a direct launch exact: the variant is chosen by the caller's ``key``, which
names the constexprs it passes and the element types of its tensors, plus what the JIT
specializes the other arguments on: each pointer's 16-byte alignment, and whether each
integer is 1 or a multiple of 16 (an integer that does not fit in 32 bits takes the JIT's
path). A launch
hook (a profiler) or the interpreter takes the JIT path too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_INT32_MAX = (1 << 31) - 1


def _active(hook: Any) -> bool:
    """Whether a Triton launch hook would do anything (Triton 3.6 keeps an empty
    ``HookChain`` there; older versions None)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


class DirectLaunch:
    """One Triton kernel's compiled variants, launched with as little host work as possible.

    Args:
        kernel: The ``@triton.jit`` function; its constexpr parameters come last; its
            first argument a tensor on the device it runs on.
        num_warps: Warps per program.
    """

    def __init__(self, kernel: Any, *, num_warps: int = 4) -> None:
        self._kernel = kernel
        self._num_warps = num_warps
        self._variants: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}
        import triton  # NOTE: lazy: only kernel modules build these

        self._knobs = triton.knobs
        self._interpret = bool(triton.knobs.runtime.interpret)
        #: the current stream's handle for a device index (what Triton's own launch asks)
        self._raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def __call__(self, grid: tuple[int, ...], args: Sequence[Any],
                 constexprs: dict[str, Any], key: tuple[Any, ...]) -> None:
        """Launch over ``grid`` (1 to 3 dims) with runtime ``args`` in parameter order and
        ``constexprs`` by name (``num_warps`` among them, or the default); ``key`` names
        the constexprs and the tensors' element types (the same key, the same values and
        dtypes)."""
        if "num_warps" not in constexprs:
            constexprs = {**constexprs, "num_warps": self._num_warps}
        runtime = self._knobs.runtime
        if self._interpret or _active(runtime.launch_enter_hook) or \
                _active(runtime.launch_exit_hook):
            self._kernel[grid](*args, **constexprs)
            return
        device = args[0].device.index
        # NOTE: a compiled kernel's function handle belongs to the device it was loaded on
        spec: list[Any] = [key, device]
        for a in args:
            if isinstance(a, torch.Tensor):
                spec.append(a.data_ptr() & 15 == 0)
            elif isinstance(a, int):
                if not -_INT32_MAX <= a <= _INT32_MAX:
                    # NOTE: a 64-bit integer is another specialization: the JIT's path
                    self._kernel[grid](*args, **constexprs)
                    return
                spec.append((a == 1, a & 15 == 0))
        full = tuple(spec)
        variant = self._variants.get(full)
        if variant is None:
            compiled = self._kernel[grid](*args, **constexprs)
            if hasattr(compiled, "result"):  # an asynchronous compile
                compiled = compiled.result()
            order = [self._kernel.arg_names[i] for i in sorted(self._kernel.constexprs)]
            self._variants[full] = (compiled, tuple(constexprs[n] for n in order))
            return  # the JIT launched it
        compiled, cx = variant
        stream = self._raw_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *cx)
