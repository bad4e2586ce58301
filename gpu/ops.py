"""The layers' lookups as torch custom ops, so ``torch.compile(model, fullgraph=True)``
traces a model holding them without a graph break, and ``torch.export`` saves a program
that a fresh process can load (``gpu.export``).

``nvecache::table_rows``, ``nvecache::stack_rows`` and ``nvecache::pooled`` take the keys
(and bags), the layer's id buffer and the layer's geometry (``dim``, ``dtype``). The id
buffer is a one-element int64 tensor registered on the layer (:func:`id_buffer`); it holds
the id under which :func:`register` keeps the layer's tier stack in this process. Being a
buffer, not a constant, the id travels with the program as data: a program loaded in
another process is pointed at that process's layers by writing their ids into it
(:func:`bind`), without tracing again. Ids are drawn from a per-process random base, so
an id written by another process names no layer here and raises a typed error. The fake
implementations take the output's shape and dtype from the arguments, so the compiler
never runs a lookup while tracing. Eager calls do not go through the ops (a custom op's
dispatch costs host time a serving call does not need); a layer's ``forward`` takes them
only while ``torch.compiler.is_compiling()`` (compile and export).

An AOTInductor package (``gpu.export.save(..., aot=True)``) calls the ops from C++ through
its proxy executor and reports their errors as a ``RuntimeError`` with the text only; its
runner calls it within :func:`typed_errors`, which raises the op's own error again.

The id is read from the buffer once per write of it: :func:`bind` remembers the value on
the tensor with the buffer's version counter, so a buffer on a CUDA device costs no
device sync per call.

CUDA graphs: a GPULayer's lookup is one kernel, safe to capture, so
``torch.compile(mode="reduce-overhead")`` replays it. The other stacks do host work per
call (following the shared table's changes, admissions), which a replay would skip: their
ops carry ``torch.Tag.cudagraph_unsafe`` where torch has it, so the compiler keeps them out
of its graphs. A closed layer's id names its closed stand-in (:func:`unregister`), whose
calls raise; the layer then takes the capturable op no more (a compiled model guards on
that choice and traces again, so a CUDA graph of the lookup is never replayed).
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from gpu.errors import BadArgumentError

_lock = threading.Lock()
#: ids of this process: a random base, so another process's ids name no layer here
_next = itertools.count((secrets.randbits(30) << 20) + 1)
_stacks: dict[int, weakref.ReferenceType[Any]] = {}
_meta: dict[int, tuple[int, torch.dtype, bool]] = {}

#: within typed_errors(): the error an op raised in this thread
_failure = threading.local()

_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
#: the attribute on an id buffer holding ``(version, id)`` of its last write by bind()
_SEEN = "_nvecache_layer_id"


def _track(handle: int, stack: Any, graph_safe: bool) -> None:
    def forget(_: object, h: int = handle) -> None:
        _stacks.pop(h, None)
        _meta.pop(h, None)

    _stacks[handle] = weakref.ref(stack, forget)
    _meta[handle] = (stack.dim, stack.dtype, graph_safe)


def register(stack: Any) -> int:
    """An id for ``stack`` (a :class:`gpu.stacks.protocol.LayerStack`, with its
    ``dim``, ``dtype`` and ``layer_type``);
    forgotten when the stack is garbage collected (a closed layer's: :func:`unregister`)."""
    with _lock:
        handle = next(_next)
        _track(handle, stack, stack.layer_type == "GPULayer")
    return handle


def unregister(handle: int, closed: Any) -> int:
    """Point ``handle`` at ``closed``, the closed layer's stand-in, whose ``rows`` and
    ``pooled`` raise its closed error; returns ``handle``. Forgotten when ``closed`` is
    garbage collected."""
    with _lock:
        if handle in _stacks:
            _track(handle, closed, False)
    return handle


def graph_safe(handle: int) -> bool:
    """Whether the layer of ``handle`` takes the op a CUDA graph may capture (an open
    GPULayer)."""
    meta = _meta.get(handle)
    return bool(meta and meta[2])


def id_buffer(handle: int, device: torch.device) -> torch.Tensor:
    """The one-element int64 buffer a layer registers, holding ``handle``."""
    buf = torch.tensor([handle], dtype=torch.int64, device=device)
    bind(buf, handle)
    return buf


def bind(buf: torch.Tensor, handle: int) -> None:
    """Write ``handle`` into the id buffer ``buf`` (a loaded program's, or a layer's)."""
    with torch.no_grad():
        buf.fill_(handle)
    setattr(buf, _SEEN, (buf._version, handle))


def _handle_of(layer: torch.Tensor) -> int:
    seen = getattr(layer, _SEEN, None)
    if seen is not None and seen[0] == layer._version:
        return int(seen[1])
    handle = int(layer.reshape(-1)[0])  # NOTE: a buffer not written by bind(): read once
    setattr(layer, _SEEN, (layer._version, handle))
    return handle


def _gone(handle: int) -> BadArgumentError:
    return BadArgumentError(f"no layer with handle {handle} in this process (it was "
                            "garbage collected, or the program was saved by another "
                            "process: load it with gpu.export.load): build the model again")


def _stack(layer: torch.Tensor) -> Any:
    handle = _handle_of(layer)
    ref = _stacks.get(handle)
    stack = ref() if ref is not None else None
    if stack is None:
        raise _gone(handle)
    return stack


def _call(layer: torch.Tensor, method: str, *args: Any) -> torch.Tensor:
    """``method`` of the layer's stack on ``args``; within :func:`typed_errors`, an error
    it raises is kept for the caller."""
    try:
        with torch.no_grad():
            return getattr(_stack(layer), method)(*args)
    except BaseException as e:
        if getattr(_failure, "capture", False):
            _failure.error = e
        raise


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Run a caller that reports the ops' errors as a ``RuntimeError`` with their text
    only (an AOTInductor package calls the ops from C++): the error an op raised within
    is raised again as itself."""
    _failure.error, _failure.capture = None, True
    try:
        yield
    except RuntimeError:
        error = _failure.error
        if error is None:
            raise
        raise error from None
    finally:
        _failure.error, _failure.capture = None, False


def _geometry(handle: int) -> tuple[int, torch.dtype, bool]:
    meta = _meta.get(handle)
    if meta is None:
        raise _gone(handle)
    return meta


def _as_buffer(handle: int | torch.Tensor, keys: torch.Tensor
               ) -> tuple[torch.Tensor, int, torch.dtype, bool]:
    """An int handle (a direct call) as an id buffer plus its layer's geometry."""
    if isinstance(handle, torch.Tensor):
        raise BadArgumentError("pass dim= and dtype= with an id buffer")
    dim, dtype, safe = _geometry(handle)
    return id_buffer(handle, keys.device), dim, dtype, safe


def rows(keys: torch.Tensor, layer: int | torch.Tensor, dim: int | None = None,
         dtype: torch.dtype | None = None, *, safe: bool | None = None) -> torch.Tensor:
    """Rows ``[N, dim]`` of flat int64 ``keys`` from the layer's stack, through the op
    that fits it (``safe``: a GPULayer's, which may be captured in a CUDA graph).

    ``layer`` is the layer's id buffer (with its ``dim`` and ``dtype``), or its int id."""
    if dim is None or dtype is None or safe is None:
        layer, dim, dtype, safe = _as_buffer(layer, keys)
    assert isinstance(layer, torch.Tensor)
    op = table_rows if safe else stack_rows
    return op(keys, layer, dim, dtype)


#: the ops' library: plain dispatcher registrations (a ``torch.library.custom_op`` wraps
#: each call in autograd and dynamo-disable layers, host time a lookup does not need)
_LIB = torch.library.Library("nvecache", "DEF")
_LIB.define("table_rows(Tensor keys, Tensor layer, int dim, ScalarType dtype) -> Tensor")
_LIB.define("stack_rows(Tensor keys, Tensor layer, int dim, ScalarType dtype) -> Tensor",
            tags=_UNSAFE)
_LIB.define("pooled(Tensor keys, Tensor offsets, Tensor? weights, Tensor layer, str mode, "
            "int dim, ScalarType dtype) -> Tensor", tags=_UNSAFE)


def _rows_kernel(keys: torch.Tensor, layer: torch.Tensor, dim: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``table_rows`` (a GPULayer's lookup: one kernel, no host work a CUDA graph replay
    would skip) and ``stack_rows`` (a cached stack's: host work per call); a training
    layer's stored rows less their optimizer state."""
    rows = _call(layer, "rows", keys)
    return rows if rows.shape[1] == dim else rows[:, :dim].contiguous()


def _rows_fake(keys: torch.Tensor, layer: torch.Tensor, dim: int,
               dtype: torch.dtype) -> torch.Tensor:
    return keys.new_empty((keys.shape[0], dim), dtype=dtype)


for _name in ("table_rows", "stack_rows"):
    _LIB.impl(_name, _rows_kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"nvecache::{_name}", _rows_fake, lib=_LIB)
table_rows = torch.ops.nvecache.table_rows.default
stack_rows = torch.ops.nvecache.stack_rows.default


def pooled(keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
           layer: int | torch.Tensor, mode: str, dim: int | None = None,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pooled rows ``[B, dim]`` of bags ``offsets`` (``[B + 1]``, last offset included);
    ``layer`` as :func:`rows` takes it."""
    if dim is None or dtype is None:
        layer, dim, dtype, _ = _as_buffer(layer, keys)
    assert isinstance(layer, torch.Tensor)
    return pooled_op(keys, offsets, weights, layer, mode, dim, dtype)


def _pooled_kernel(keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                   layer: torch.Tensor, mode: str, dim: int, dtype: torch.dtype
                   ) -> torch.Tensor:
    """Pooled rows ``[B, dim]`` of bags ``offsets`` (``[B + 1]``, last offset included)."""
    return _call(layer, "pooled", keys, offsets, weights, mode)


def _pooled_fake(keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                 layer: torch.Tensor, mode: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return keys.new_empty((offsets.shape[0] - 1, dim), dtype=dtype)


_LIB.impl("pooled", _pooled_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("nvecache::pooled", _pooled_fake, lib=_LIB)
pooled_op = torch.ops.nvecache.pooled.default


# NOTE: training (gpu.train): ``train_rows`` is the lookup with autograd history. Its
# differentiable input is the layer's anchor, a zero-element tensor that requires grad
# (the FBGEMM way: no gradient of the table's shape is ever made); its backward calls
# ``train_step``, which applies the layer's step (a fused optimizer, or ``layer.weight``'s
# sparse gradient for a torch optimizer) and returns the anchor's empty gradient, so the
# step is an output of the compiled backward and never dropped as dead code.
_LIB.define("train_rows(Tensor keys, Tensor layer, Tensor anchor, int dim, ScalarType dtype)"
            " -> Tensor", tags=_UNSAFE)
_LIB.define("train_step(Tensor keys, Tensor grad, Tensor layer) -> Tensor", tags=_UNSAFE)
#: training layers' step appliers by handle (gpu.train.step.Trainer), held weakly
_trainers: dict[int, weakref.ReferenceType[Any]] = {}


def register_trainer(handle: int, trainer: Any) -> None:
    """Name ``trainer`` (with ``step(keys, grad)``) as the step of the layer of
    ``handle``, for ``train_step``."""
    def forget(_: object, h: int = handle) -> None:
        _trainers.pop(h, None)

    _trainers[handle] = weakref.ref(trainer, forget)


def train_rows(keys: torch.Tensor, layer: torch.Tensor, anchor: torch.Tensor, dim: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[N, dim]`` of flat ``keys`` whose backward trains the layer (see above)."""
    return train_rows_op(keys, layer, anchor, dim, dtype)


def _train_rows_kernel(keys: torch.Tensor, layer: torch.Tensor, anchor: torch.Tensor,
                       dim: int, dtype: torch.dtype) -> torch.Tensor:
    return _rows_kernel(keys, layer, dim, dtype)


def _train_rows_fake(keys: torch.Tensor, layer: torch.Tensor, anchor: torch.Tensor,
                     dim: int, dtype: torch.dtype) -> torch.Tensor:
    return keys.new_empty((keys.shape[0], dim), dtype=dtype)


def _train_step_kernel(keys: torch.Tensor, grad: torch.Tensor, layer: torch.Tensor
                       ) -> torch.Tensor:
    handle = _handle_of(layer)
    ref = _trainers.get(handle)
    trainer = ref() if ref is not None else None
    if trainer is None:
        raise _gone(handle)
    try:
        trainer.step(keys, grad)
    except BaseException as e:
        if getattr(_failure, "capture", False):
            _failure.error = e
        raise
    return grad.new_empty(0, dtype=torch.float32)


def _train_step_fake(keys: torch.Tensor, grad: torch.Tensor, layer: torch.Tensor
                     ) -> torch.Tensor:
    return grad.new_empty(0, dtype=torch.float32)


def _train_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    keys, layer = inputs[0], inputs[1]
    ctx.save_for_backward(keys, layer)


def _train_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    keys, layer = ctx.saved_tensors
    return None, None, train_step_op(keys, grad, layer), None, None


_LIB.impl("train_rows", _train_rows_kernel, "CompositeExplicitAutograd")
_LIB.impl("train_step", _train_step_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("nvecache::train_rows", _train_rows_fake, lib=_LIB)
torch.library.register_fake("nvecache::train_step", _train_step_fake, lib=_LIB)
torch.library.register_autograd("nvecache::train_rows", _train_backward,
                                setup_context=_train_setup, lib=_LIB)
train_rows_op = torch.ops.nvecache.train_rows.default
train_step_op = torch.ops.nvecache.train_step.default
