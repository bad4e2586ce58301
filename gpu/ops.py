"""The layers' lookups as torch custom ops, so ``torch.compile(model, fullgraph=True)``
traces a model holding them without a graph break.

``nvecache::rows`` and ``nvecache::pooled`` take the keys (and bags) plus a handle: a
small int naming the layer's tier stack in this process (:func:`register`). Their fake
implementations give the output's shape and dtype, so the compiler never runs a lookup
while tracing. Eager calls do not go through the ops (a custom op's dispatch costs
host time a serving call does not need); a layer's ``forward`` takes them only while
``torch.compiler.is_compiling()``.

CUDA graphs: a GPULayer's lookup is one kernel, safe to capture, so
``torch.compile(mode="reduce-overhead")`` replays it. The other stacks do host work per
call (following the shared table's changes, admissions), which a replay would skip: their
ops carry ``torch.Tag.cudagraph_unsafe`` where torch has it, so the compiler keeps them out
of its graphs. A closed layer takes a new handle (:func:`unregister`): a compiled model
traces it again instead of replaying a graph of its lookup, and the op raises.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

from gpu.errors import BadArgumentError

_lock = threading.Lock()
_next = itertools.count(1)
_stacks: dict[int, weakref.ReferenceType[Any]] = {}
_meta: dict[int, tuple[int, torch.dtype, bool]] = {}

_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def register(stack: Any) -> int:
    """A handle for ``stack`` (a :class:`gpu.stacks.protocol.LayerStack`, with its
    ``dim``, ``dtype`` and ``layer_type``);
    forgotten when the stack is garbage collected (a closed layer's: :func:`unregister`)."""
    with _lock:
        handle = next(_next)
        _meta[handle] = (stack.dim, stack.dtype, stack.layer_type == "GPULayer")

        def forget(_: object, h: int = handle) -> None:
            _stacks.pop(h, None)
            _meta.pop(h, None)

        _stacks[handle] = weakref.ref(stack, forget)
    return handle


def unregister(handle: int, closed: Any) -> int:
    """Forget the stack behind ``handle``: its layer was closed, and ``closed`` is the
    layer's stand-in, whose ``rows``/``pooled`` raise its closed error.

    ``handle`` names ``closed`` from now on, and so does the handle returned, the layer's
    new one: a compiled model guards on the layer's handle, so it traces again (a CUDA
    graph holding the closed layer's lookup is never replayed) and its op raises. Both are
    forgotten when ``closed`` is garbage collected.
    """
    with _lock:
        if handle in _stacks:

            def forget(_: object, h: int = handle) -> None:
                _stacks.pop(h, None)
                _meta.pop(h, None)

            _stacks[handle] = weakref.ref(closed, forget)
    return register(closed)


def _gone(handle: int) -> BadArgumentError:
    return BadArgumentError(f"no layer with handle {handle} in this process (it was "
                            "garbage collected): build the model again")


def _stack(handle: int) -> Any:
    ref = _stacks.get(handle)
    stack = ref() if ref is not None else None
    if stack is None:
        raise _gone(handle)
    return stack


def _geometry(handle: int) -> tuple[int, torch.dtype, bool]:
    meta = _meta.get(handle)
    if meta is None:
        raise _gone(handle)
    return meta


def rows(keys: torch.Tensor, handle: int) -> torch.Tensor:
    """Rows ``[N, dim]`` of flat int64 ``keys`` from the layer's stack, through the op
    that fits it (a GPULayer's may be captured in a CUDA graph)."""
    if _geometry(handle)[2]:
        return table_rows(keys, handle)
    return stack_rows(keys, handle)


@torch.library.custom_op("nvecache::table_rows", mutates_args=())
def table_rows(keys: torch.Tensor, handle: int) -> torch.Tensor:
    """A GPULayer's lookup: one kernel, no host work a CUDA graph replay would skip."""
    with torch.no_grad():
        return _stack(handle).rows(keys)


@torch.library.custom_op("nvecache::stack_rows", mutates_args=(), tags=_UNSAFE)
def stack_rows(keys: torch.Tensor, handle: int) -> torch.Tensor:
    """A cached stack's lookup (host work per call: not for CUDA graphs)."""
    with torch.no_grad():
        return _stack(handle).rows(keys)


@table_rows.register_fake
def _table_rows_fake(keys: torch.Tensor, handle: int) -> torch.Tensor:
    dim, dtype, _ = _geometry(handle)
    return keys.new_empty((keys.shape[0], dim), dtype=dtype)


@stack_rows.register_fake
def _stack_rows_fake(keys: torch.Tensor, handle: int) -> torch.Tensor:
    return _table_rows_fake(keys, handle)


@torch.library.custom_op("nvecache::pooled", mutates_args=(), tags=_UNSAFE)
def pooled(keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
           handle: int, mode: str) -> torch.Tensor:
    """Pooled rows ``[B, dim]`` of bags ``offsets`` (``[B + 1]``, last offset included)."""
    with torch.no_grad():
        return _stack(handle).pooled(keys, offsets, weights, mode)


@pooled.register_fake
def _pooled_fake(keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                 handle: int, mode: str) -> torch.Tensor:
    dim, dtype, _ = _geometry(handle)
    return keys.new_empty((offsets.shape[0] - 1, dim), dtype=dtype)
