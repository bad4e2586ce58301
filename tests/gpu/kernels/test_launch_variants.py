"""gpu.kernels.launch.DirectLaunch's (and BoundLaunch's) choice of compiled variant, on any machine.

A direct launch only runs on CUDA (tests/gpu/kernels/test_launch.py checks it there against
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

    def __init__(self, log: list[tuple[Any, ...]], cx: dict[str, Any],
                 grids: list[tuple[Any, ...]]) -> None:
        self._log, self._cx, self._grids = log, cx, grids

    def launch(self, gx: int, gy: int, gz: int, stream: int, function: object, *rest: Any
               ) -> None:
        # rest: coop, pdl, 2 scratch, 4 metadata, the runtime arguments, the constexprs
        self._log.append(("direct", self._cx["WIDTH"], rest[8:]))
        self._grids.append(("direct", (gx, gy, gz)))


class _Compiled:
    def __init__(self, log: list[tuple[Any, ...]], cx: dict[str, Any],
                 grids: list[tuple[Any, ...]]) -> None:
        self.function = object()
        self.packed_metadata = None
        self.run = _Run(log, cx, grids)


class _Kernel:
    """A stand-in for ``@triton.jit def k(x_ptr, n, WIDTH: tl.constexpr)``."""

    arg_names = ["x_ptr", "n", "WIDTH"]
    constexprs = [2]

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        #: each launch's grid: ("jit", the grid given) or ("direct", (gx, gy, gz))
        self.grids: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def jit(*args: Any, **cx: Any) -> _Compiled:
            self.log.append(("jit", cx["WIDTH"], args))
            self.grids.append(("jit", grid))
            return _Compiled(self.log, cx, self.grids)

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


class _TwoTensorKernel(_Kernel):
    """A stand-in for ``k(x_ptr, n, t_ptr, m, WIDTH: tl.constexpr)``: a bound launch's
    shape (x and n given per call, the table t and its size m bound)."""

    arg_names = ["x_ptr", "n", "t_ptr", "m", "WIDTH"]
    constexprs = [4]


def _bound(kernel: _Kernel, table: torch.Tensor, grid_dims: int = 1
           ) -> tuple[Any, list[int]]:
    """A BoundLaunch over a counting DirectLaunch: (the launch, how many calls reached the
    DirectLaunch, a one-element list)."""
    from gpu.kernels.launch import BoundLaunch, DirectLaunch

    reached = [0]

    class Counting(DirectLaunch):
        def __call__(self, *args: Any, **kw: Any) -> Any:
            reached[0] += 1
            return super().__call__(*args, **kw)

    dl = Counting(kernel)
    dl._current_device = lambda: -1
    dl._raw_stream = lambda device: 0
    return BoundLaunch(dl, (table, 0, table, 7), {"WIDTH": 4}, ("k",), (0, 1),
                       grid_dims=grid_dims), reached


def test_a_bound_launch_calls_directly_once_its_variant_is_known() -> None:
    """gpu.kernels.launch.BoundLaunch's written per-call function: a specialization seen
    before (each pointer's alignment, each integer's == 1 and multiple of 16) launches
    with the fixed arguments as bound and the varying ones in place, without the
    DirectLaunch path; any other goes through it and is kept once it launched directly."""
    kernel = _TwoTensorKernel()
    table = torch.zeros(32)
    bl, reached = _bound(kernel, table)
    base = torch.zeros(40)
    aligned, off = base[:8], base[1:9]
    plan = [(aligned, 32), (aligned, 48), (off, 32), (aligned, 1), (off, 16), (aligned, 32),
            (off, 32), (aligned, 1), (aligned, 1)]
    for x, n in plan:
        bl(3, x, n)
    assert [what for what, _, _ in kernel.log] == [
        "jit",     # (aligned, 32): compiled
        "direct",  # (aligned, 48): the DirectLaunch's variant, now kept by the bound launch
        "jit",     # (off, 32): another alignment
        "jit",     # (aligned, 1): n == 1 is another specialization
        "direct",  # (off, 16): found by the DirectLaunch, kept
        "direct", "direct",  # (aligned, 32), (off, 32): the bound launch's own call
        "direct", "direct"]  # (aligned, 1) twice: kept at the first, then direct
    assert reached[0] == 6 and bl.variants == 3
    # the direct call: the varying arguments in place, the bound ones as addresses
    assert kernel.log[6][2] == (off.data_ptr(), 32, table.data_ptr(), 7, 4)
    assert kernel.log[5][2] == (aligned.data_ptr(), 32, table.data_ptr(), 7, 4)


def test_a_bound_launch_takes_the_jit_path_for_wide_integers_and_hooks() -> None:
    import triton

    kernel = _TwoTensorKernel()
    table = torch.zeros(32)
    bl, reached = _bound(kernel, table)
    x = torch.zeros(8)
    for _ in range(3):
        bl(1, x, 64)
    assert bl.variants == 1 and reached[0] == 2
    for _ in range(2):  # NOTE: an integer past 32 bits is another specialization: never kept
        bl(1, x, 1 << 40)
    assert bl.variants == 1 and reached[0] == 4
    assert [w for w, _, _ in kernel.log[-2:]] == ["jit", "jit"]
    chain = triton.knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton's launch hooks are not a chain")
    hook_calls: list[object] = []

    def hook(*args: object) -> None:
        hook_calls.append(args)

    chain.add(hook)
    try:
        bl(1, x, 64)  # NOTE: a known variant, but a hook: the JIT's path
    finally:
        chain.remove(hook)
    assert reached[0] == 5 and kernel.log[-1][0] == "jit"
    bl(1, x, 64)  # the hook gone: direct again, without the DirectLaunch
    assert reached[0] == 5 and kernel.log[-1][0] == "direct"


def test_a_bound_launch_over_a_2d_grid_passes_both_dimensions() -> None:
    """``grid_dims=2``: ``launch(gx, gy, *values)``, the JIT given the grid ``(gx, gy)``
    and a direct launch ``(gx, gy, 1)``; the varying arguments as with one dimension."""
    kernel = _TwoTensorKernel()
    table = torch.zeros(32)
    bl, reached = _bound(kernel, table, grid_dims=2)
    x = torch.zeros(8)
    bl(5, 3, x, 32)  # compiled through the JIT
    bl(6, 2, x, 32)  # the DirectLaunch's variant, kept
    bl(7, 4, x, 32)  # the bound launch's own call
    assert kernel.grids == [("jit", (5, 3)), ("direct", (6, 2, 1)), ("direct", (7, 4, 1))]
    assert reached[0] == 2 and bl.variants == 1
    assert kernel.log[-1][2] == (x.data_ptr(), 32, table.data_ptr(), 7, 4)
    with pytest.raises(ValueError, match="grid_dims"):
        _bound(kernel, table, grid_dims=3)
