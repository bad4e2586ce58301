"""Launching a compiled Triton kernel without the JIT's per-call work.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument, hashes a cache
key and builds launch metadata on every call: more host time than the launch itself, and
more than a serving-size lookup's kernel runs (bench/RESULTS.md, "Per-call path (H200)",
"Where the host time goes").
:class:`DirectLaunch` binds once: the first call of a variant goes through the JIT (which
compiles it or loads it from Triton's cache), later calls hand the compiled kernel's
launcher the arguments directly, as torch inductor's generated launchers do: tensors as
their addresses (the launcher would otherwise call ``data_ptr()`` and query the pointer
for each), straight to its C function when the variant needs no scratch buffers.

What keeps a direct launch exact: the variant is chosen by the caller's ``key``, which
names the constexprs it passes and the element types of its tensors, plus what the JIT
specializes the other arguments on: each pointer's 16-byte alignment, and whether each
integer is 1 or a multiple of 16 (an integer that does not fit in 32 bits takes the JIT's
path). A found variant's constexprs are checked against the call's (the same dict object
is the cheap case: callers keep one per key), so a key that leaves one out costs a second
variant, never a launch with another call's constants. A launch hook (a profiler) or the
interpreter takes the JIT path too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_INT32_MAX = (1 << 31) - 1

#: every kernel a DirectLaunch was made for, by its qualified name (see loaded_variants)
_KERNELS: dict[str, Any] = {}


def _qualified(kernel: Any) -> str:
    fn = getattr(kernel, "fn", kernel)  # NOTE: a JITFunction wraps the Python function
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def loaded_variants() -> dict[str, int]:
    """The variants Triton holds loaded in this process, per kernel launched through a
    :class:`DirectLaunch` (by the kernel's qualified name, summed over devices; a kernel
    with none loaded is left out). For watching warm-up: a call that loads no new variant
    leaves this unchanged."""
    counts: dict[str, int] = {}
    for name, kernel in list(_KERNELS.items()):
        caches = getattr(kernel, "device_caches", None) or {}
        n = sum(len(c[0]) for c in list(caches.values()))
        if n:
            counts[name] = n
    return counts


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
        _KERNELS.setdefault(_qualified(kernel), kernel)
        #: spec -> (launcher, its leading arguments, the constexprs' values after the
        #: runtime arguments, the constexprs the variant was compiled with)
        self._variants: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...], tuple[Any, ...],
                                                    dict[str, Any]]] = {}
        import triton  # NOTE: lazy: only kernel modules build these

        self._knobs = triton.knobs
        self._interpret = bool(triton.knobs.runtime.interpret)
        #: the current stream's handle for a device index (what Triton's own launch asks)
        self._raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        #: the current CUDA device's index (cheaper than torch.cuda.current_device())
        self._current_device: Any = getattr(torch._C, "_cuda_getDevice", None)

    @property
    def variants(self) -> int:
        """How many variants this launcher launches directly (each compiled once, through
        the JIT)."""
        return len(self._variants)

    def __call__(self, grid: tuple[int, ...], args: Sequence[Any],
                 constexprs: dict[str, Any], key: tuple[Any, ...]
                 ) -> tuple[Any, tuple[Any, ...], list[Any], tuple[Any, ...]] | None:
        """Launch over ``grid`` (1 to 3 dims) with runtime ``args`` in parameter order and
        ``constexprs`` by name (``num_warps`` among them, or the default); ``key`` names
        the constexprs and the tensors' element types (the same key, the same values and
        dtypes). The first tensor argument is on the device it runs on, made current for
        the launch if it is not. Returns how the variant was launched directly
        (``(launch, head, args as passed, tail)``, for :class:`BoundLaunch`), or None when
        it went through the JIT."""
        runtime = self._knobs.runtime
        if self._interpret or _active(runtime.launch_enter_hook) or \
                _active(runtime.launch_exit_hook):
            self._jit(grid, args, constexprs)
            return None
        device = args[0].get_device()
        if device != self._current_device():
            # NOTE: a compiled kernel's function handle belongs to the device it was loaded
            # on, and the launch goes to the current context
            with torch.cuda.device(device):
                self(grid, args, constexprs, key)
            return None
        spec: list[Any] = [key, device]
        # NOTE: the launcher takes pointers as ints: no attribute call and no pointer query
        # per tensor on the C side (the tensors outlive the call: the caller holds them)
        call = list(args)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                ptr = call[i] = a.data_ptr()
                spec.append(ptr & 15 == 0)
            elif isinstance(a, int):
                if not -_INT32_MAX <= a <= _INT32_MAX:
                    # NOTE: a 64-bit integer is another specialization: the JIT's path
                    self._jit(grid, args, constexprs)
                    return None
                spec.append((a == 1, a & 15 == 0))
        full = tuple(spec)
        variant = self._variants.get(full)
        if variant is not None and variant[3] is not constexprs and variant[3] != constexprs:
            # NOTE: the caller's key did not name every constexpr (its contract): told apart
            # by their values, never launched with another call's (a variant compiled for
            # dim == BLOCK_D, run on a narrower table, writes past each row)
            full = (*full, tuple(sorted(constexprs.items())))
            variant = self._variants.get(full)
        if variant is None:
            self._variants[full] = (*self._compile(grid, args, constexprs), constexprs)
            return None  # the JIT launched it
        launch, head, tail, _ = variant
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        launch(grid[0], g1, g2, self._raw_stream(device), *head, *call, *tail)
        return launch, head, call, tail

    def _jit(self, grid: tuple[int, ...], args: Sequence[Any],
             constexprs: dict[str, Any]) -> Any:
        if "num_warps" not in constexprs:
            constexprs = {**constexprs, "num_warps": self._num_warps}
        return self._kernel[grid](*args, **constexprs)

    def _compile(self, grid: tuple[int, ...], args: Sequence[Any],
                 constexprs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
        """Launch through the JIT (compiling or loading the variant); returns how later
        launches of the variant call its launcher: ``(launch, head, tail)``, called as
        ``launch(gx, gy, gz, stream, *head, *args, *tail)``."""
        compiled = self._jit(grid, args, constexprs)
        if hasattr(compiled, "result"):  # an asynchronous compile
            compiled = compiled.result()
        full = {"num_warps": self._num_warps, **constexprs}
        order = [self._kernel.arg_names[i] for i in sorted(self._kernel.constexprs)]
        tail = tuple(full[n] for n in order)
        run = compiled.run
        meta = (compiled.packed_metadata, None, None, None)  # no launch metadata, no hooks
        flags = [getattr(run, n, None) for n in ("launch_cooperative_grid", "launch_pdl")]
        c_launch = getattr(run, "launch", None)
        if c_launch is not None and None not in flags and \
                not getattr(run, "global_scratch_size", 1) and \
                not getattr(run, "profile_scratch_size", 1):
            # NOTE: the C launch itself (Triton 3.5-3.6's CudaLauncher layout): its Python
            # __call__ only adds scratch buffers, and this variant has none
            return c_launch, (compiled.function, *flags, None, None, *meta), tail
        return run, (compiled.function, *meta), tail


class BoundLaunch:
    """A :class:`DirectLaunch` whose arguments mostly repeat from call to call (a cache's
    tables, a layer's flags): their addresses and specializations are taken once, and a
    call hands over only the ``varying`` ones (by parameter index), over a 1-D grid (or,
    with ``grid_dims=2``, a 2-D one: ``launch(gx, gy, *values)``).

    The per-call path is a function written for this binding when it is made (as Triton's
    own argument binder and torch inductor's launchers are generated): each varying
    argument's address or value taken and specialized in straight-line code, the fixed
    ones passed as constants, no loop, list or merge per call (bench/RESULTS.md,
    "Per-call path"). ``launch(grid, *values)`` and ``launch.call(grid, *values)`` are the
    same call; hot callers keep ``call``.

    A call whose varying arguments specialize differently (another pointer alignment, an
    integer that is 1 or crosses a multiple of 16), a launch hook, the interpreter or
    another current device: the whole :class:`DirectLaunch` path, whose variant is then
    kept too. The fixed arguments must keep their storage while this object lives (the
    object holds them).

    Args:
        launch: The kernel's launcher.
        args: Every runtime argument in parameter order (those at ``varying`` are
            placeholders until a call gives them; a placeholder's type, tensor or int, is
            the type each call passes there).
        constexprs: As for :class:`DirectLaunch`, one dict kept by the caller.
        key: As for :class:`DirectLaunch`.
        varying: Indices into ``args`` that each call passes, in that order.
        grid_dims: 1 (``launch(grid, *values)``) or 2 (``launch(gx, gy, *values)``).
    """

    def __init__(self, launch: DirectLaunch, args: Sequence[Any], constexprs: dict[str, Any],
                 key: tuple[Any, ...], varying: tuple[int, ...], grid_dims: int = 1) -> None:
        if grid_dims not in (1, 2):
            raise ValueError(f"grid_dims must be 1 or 2; got {grid_dims!r}")
        device = next(a for a in args if isinstance(a, torch.Tensor)).get_device()
        #: the varying arguments' specialization -> (launch, head, tail)
        self._variants: dict[tuple[bool, ...], tuple[Any, tuple[Any, ...], tuple[Any, ...]]]
        self._variants = {}
        self._fallback = _Fallback(launch, args, constexprs, key, varying, self._variants)
        #: the per-call path (see the class docs)
        self.call = _bound_call(launch, args, varying, device, self._variants,
                                self._fallback, grid_dims)

    @property
    def variants(self) -> int:
        """How many specializations of the varying arguments this launch calls directly
        (0: every call so far took the :class:`DirectLaunch` path)."""
        return len(self._variants)

    def __call__(self, *grid_and_values: Any) -> None:
        self.call(*grid_and_values)


class _Fallback:
    """A :class:`BoundLaunch`'s path through :class:`DirectLaunch` (kept apart from its
    generated call, so the two never reference each other: dropping a BoundLaunch frees
    its tables at once, without waiting for the cycle collector)."""

    def __init__(self, launch: DirectLaunch, args: Sequence[Any], constexprs: dict[str, Any],
                 key: tuple[Any, ...], varying: tuple[int, ...],
                 variants: dict[tuple[bool, ...], Any]) -> None:
        self._launch, self._cx, self._key = launch, constexprs, key
        self._args = list(args)  # NOTE: holds the fixed tensors
        self._varying, self._variants = varying, variants

    def __call__(self, grid: tuple[int, ...], values: tuple[Any, ...],
                 spec: tuple[bool, ...] | None) -> None:
        """Launch through :class:`DirectLaunch`; keep the variant under ``spec`` (None: a
        64-bit integer, never kept)."""
        args = list(self._args)
        for i, v in zip(self._varying, values, strict=True):
            args[i] = v
        used = self._launch(grid, args, self._cx, self._key)
        if used is not None and spec is not None:
            self._variants[spec] = (used[0], used[1], used[3])


def _bound_call(launch: DirectLaunch, args: Sequence[Any], varying: tuple[int, ...],
                device: int, variants: dict[tuple[bool, ...], Any], fallback: _Fallback,
                grid_dims: int) -> Any:
    """Write a :class:`BoundLaunch`'s per-call function: its parameters the varying
    arguments, the fixed ones constants (tensors as their addresses), the specialization
    (each pointer's 16-byte alignment, each integer's ``== 1`` and multiple of 16) built
    in one expression. Only names made here from indices go into the source."""
    names = [f"v{j}" for j in range(len(varying))]
    consts: dict[str, Any] = {}
    passed, spec, body = [], [], []
    ints = []
    for i, a in enumerate(args):
        if i in varying:
            v = names[varying.index(i)]
            if isinstance(a, torch.Tensor):
                body.append(f"    p{v} = {v}.data_ptr()")
                passed.append(f"p{v}")
                spec.append(f"p{v} & 15 == 0")
            else:
                passed.append(v)
                ints.append(v)
                spec += [f"{v} == 1", f"{v} & 15 == 0"]
        else:
            consts[f"f{i}"] = a.data_ptr() if isinstance(a, torch.Tensor) else a
            passed.append(f"f{i}")
    fits = " and ".join(f"-M <= {v} <= M" for v in ints) or "True"
    key = ", ".join(spec) + ("," if len(spec) == 1 else "")
    grid, dims = ("gx, gy", "gx, gy, 1") if grid_dims == 2 else ("grid", "grid, 1, 1")
    src = "\n".join([
        f"def call({grid}, {', '.join(names)}):",
        *body,
        f"    if {fits}:",
        f"        spec = ({key})",
        "        variant = variants.get(spec)",
        "        if variant is not None and not (active(rt.launch_enter_hook) or",
        "                active(rt.launch_exit_hook)) and current() == dev:",
        "            run, head, tail = variant",
        f"            run({dims}, stream(dev), *head, {', '.join(passed)}, *tail)",
        "            return",
        f"        fallback(({grid},), ({', '.join(names)},), spec)",
        "        return",
        f"    fallback(({grid},), ({', '.join(names)},), None)",
    ])
    if launch._interpret:  # NOTE: the interpreter has no compiled launcher: always the JIT
        src = f"def call({grid}, {', '.join(names)}):\n" \
              f"    fallback(({grid},), ({', '.join(names)},), None)"
    scope = {"variants": variants, "fallback": fallback, "active": _active,
             "rt": launch._knobs.runtime, "current": launch._current_device, "dev": device,
             "stream": launch._raw_stream, "M": _INT32_MAX, **consts}
    exec(compile(src, f"<BoundLaunch {_qualified(launch._kernel)}>", "exec"), scope)  # noqa: S102
    return scope["call"]
