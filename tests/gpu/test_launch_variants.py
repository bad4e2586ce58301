"""gpu.kernels.launch.DirectLaunch's choice of compiled variant, on any machine.

A direct launch only runs on CUDA (tests/gpu/test_launch.py checks it there against
torch). Which compiled variant a call gets is bookkeeping, checked here with a stand-in
for a ``@triton.jit`` kernel that records what it compiled and what each launch was
given: the same key with other constexprs must compile and launch another variant
(a key that left one out once ran a 5-float table's row reads with 8-float rows).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu.kernels.triton_access import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="gpu.kernels.launch needs the "
                                "triton package (its knobs)")


class _Run:
    """What a compiled kernel's launcher exposes (Triton 3.5-3.6 layout)."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self, log: list[tuple[Any, ...]], cx: dict[str, Any]) -> None:
        self._log, self._cx = log, cx

    def launch(self, gx: int, gy: int, gz: int, stream: int, function: object, *rest: Any
               ) -> None:
        # rest: coop, pdl, 2 scratch, 4 metadata, the runtime arguments, the constexprs
        self._log.append(("direct", self._cx["WIDTH"], rest[8:]))


class _Compiled:
    def __init__(self, log: list[tuple[Any, ...]], cx: dict[str, Any]) -> None:
        self.function = object()
        self.packed_metadata = None
        self.run = _Run(log, cx)


class _Kernel:
    """A stand-in for ``@triton.jit def k(x_ptr, n, WIDTH: tl.constexpr)``."""

    arg_names = ["x_ptr", "n", "WIDTH"]
    constexprs = [2]

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def jit(*args: Any, **cx: Any) -> _Compiled:
            self.log.append(("jit", cx["WIDTH"], args))
            return _Compiled(self.log, cx)

        return jit


def _launcher(kernel: _Kernel) -> Any:
    from gpu.kernels.launch import DirectLaunch

    launch = DirectLaunch(kernel)
    # NOTE: a CPU tensor stands in for the device's: device -1 is then "current"
    launch._current_device = lambda: -1
    launch._raw_stream = lambda device: 0
    return launch


def test_the_same_key_with_other_constexprs_gets_its_own_variant() -> None:
    kernel = _Kernel()
    launch = _launcher(kernel)
    x = torch.zeros(4)
    for width in (8, 5, 8, 5):  # new dicts each call, as keyword arguments give
        launch((1,), (x, 4), {"WIDTH": width}, ("a key without WIDTH",))
    for width in (8, 5):
        launch((1,), (x, 4), {"WIDTH": width}, ("a key without WIDTH",))
    assert [(what, width) for what, width, _ in kernel.log] == [
        ("jit", 8), ("jit", 5), ("direct", 8), ("direct", 5), ("direct", 8), ("direct", 5)]
    # a direct launch passes the tensor as its address and the variant's own constexprs
    _, width, rest = kernel.log[-1]
    assert rest == (x.data_ptr(), 4, 5)


def test_a_cached_constexpr_dict_and_a_pointer_alignment_pick_variants() -> None:
    kernel = _Kernel()
    launch = _launcher(kernel)
    cx = {"WIDTH": 4}  # one dict object per key, as the layer kernels keep them
    base = torch.zeros(16)
    aligned, off = base[:8], base[1:9]  # 4 bytes off 16-byte alignment
    assert aligned.data_ptr() % 16 == 0 and off.data_ptr() % 16 == 4
    for t in (aligned, off, aligned, off):
        launch((1,), (t, 8), cx, ("k",))
    assert [what for what, _, _ in kernel.log] == ["jit", "jit", "direct", "direct"]
    # an integer outside 32 bits is the JIT's, every time
    launch((1,), (aligned, 1 << 40), cx, ("k",))
    launch((1,), (aligned, 1 << 40), cx, ("k",))
    assert [what for what, _, _ in kernel.log[4:]] == ["jit", "jit"]
