"""Checkpoints of the layers: ``state_dict`` / ``load_state_dict``, torch's and DCP's.

A GPULayer's, LinearUVM layer's or HostLayer's state is ``<prefix>weight``: its linear
table's rows as a tensor where they live (the layer's own tensor, a user's storage tensor
itself, a ``SharedMemBlock``'s rows, a ``DistMemBlock``'s rows), a view, no copy;
``torch.distributed.checkpoint`` saves it and loads into it in place. A Hierarchical
layer's state is ``<prefix>_extra_state``: the names of its tables (host cache,
parameter-server URL and table), no rows.

Loading writes rows through the layer's write path (a shared table's write is announced to
every process, whose GPU caches drop the rows), a chunk at a time: the memory a load adds
is one chunk, whatever the table's size, with a progress bar on a terminal for large
tables. Every check (shape, dtype, finiteness, the tables named) runs before the first
row is written, so a checkpoint that does not fit raises :class:`StateDictError` naming
the table and leaves it as it was. A ``weight`` that is the layer's own view (after
``dcp.load`` filled it in place) is not copied: its rows are announced as written.

A ``DistMemBlock`` built over a torch process group of several ranks is a table every rank
maps whole; its ``weight`` is a ``DTensor`` sharded by rows over the group (``Shard(0)``,
torch.chunk's split, :func:`share`), each rank's local part a view of its share, so that
``dcp.save`` writes every row once and ``dcp.load`` fills each rank's share in place. A
plain tensor loaded on every rank of such a table is written by each rank for its share
only; every rank checks the whole tensor first, so all of them accept it or none does.

A quantized table's ``weight`` (a quantized ``SharedMemBlock``'s, a ``DistMemBlock``'s,
a GPULayer's own table stored with ``weight_dtype=``) is its stored bytes, uint8
``[num_rows, stored_bytes]`` (each row's payload and its float32 parameters,
``nvecache.common.rows.RowFormat``), a view as any table's: a checkpoint round-trips bit
for bit, and DCP loads it in place. Loading takes those bytes as they are (once they decode
to finite rows) or float rows ``[num_rows, embedding_size]`` of any float dtype, quantized
as they are written (an ``nn.Embedding`` checkpoint into a quantized layer). A plain layer
refuses stored bytes (their format is not its rows'): load them into a layer over a table
of that format.

A layer trained with a fused optimizer (:mod:`gpu.optim`) stores its state beside each
row; its ``weight`` is the rows without it (a strided view), and loading rows starts
their state over (the state itself persists in the tables).

A checkpoint of ``torch.nn.Embedding`` / ``nn.EmbeddingBag`` has the same key, ``weight``,
and loads into any layer of the same shape and dtype (a Hierarchical layer: inserted into
its tiers, the parameter server first). TorchRec's names map through :func:`from_torchrec`.

The layer classes (:mod:`gpu.layers`) take their ``_save_to_state_dict``,
``_load_from_state_dict``, ``get_extra_state`` and ``set_extra_state`` from here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from gpu.errors import GroupError, LayerClosedError, StateDictError
from gpu.stacks.protocol import LinearState, NamedState
from gpu.train import wide
from nvecache.common import quant
from nvecache.common.rows import RowFormat, is_plain

if TYPE_CHECKING:
    from gpu.layers import _NVBase

logger = logging.getLogger(__name__)

__all__ = ["StateDictError", "check_state_dict", "from_torchrec", "share"]

#: bytes of rows a load holds at once (beside the table and the checkpoint)
CHUNK_BYTES = 64 << 20
#: tables from this size show a progress bar while they load (on a terminal only)
PROGRESS_BYTES = 1 << 30
#: the version of the extra state's layout
FORMAT = 1

WEIGHT = "weight"
EXTRA = "_extra_state"


def _stack(layer: _NVBase) -> Any:
    """The layer's stack, or LayerClosedError for a closed layer."""
    stack = layer._tiers
    if not isinstance(stack, LinearState | NamedState):
        stack.check_pending()  # NOTE: a closed layer's stand-in raises LayerClosedError
        raise LayerClosedError(f"{type(layer).__name__} has no table to checkpoint")
    return stack


def get_extra_state(layer: _NVBase) -> dict[str, Any]:
    """What a layer is, and for a Hierarchical layer the names of its tables (no rows),
    from its construction record (``layer.spec``)."""
    _stack(layer)  # NOTE: a closed layer raises LayerClosedError
    spec = layer.spec
    state: dict[str, Any] = {"format": FORMAT, "layer_type": spec.layer_type.name,
                             "num_embeddings": spec.num_embeddings,
                             "embedding_size": spec.embedding_size,
                             "dtype": str(spec.data_type)}
    hc, ps = spec.table("hostcache"), spec.table("ps")
    if hc is not None or ps is not None:
        state.update(dim=spec.embedding_size, dtype=str(spec.data_type))
    if hc is not None:
        state["host_cache"] = hc.name
    if ps is not None:
        state.update(table=ps.name, url=ps.url or None)
    return state


def _mismatch(layer: _NVBase, stack: Any, what: str) -> StateDictError:
    return StateDictError(f"checkpoint does not fit {type(layer).__name__} "
                          f"({layer.layer_type.name}) over {stack.table_label()}: {what}; "
                          "nothing was written (load a checkpoint of this table)")


def set_extra_state(layer: _NVBase, state: Any) -> None:
    """Check a saved extra state against the layer: same layer type, row geometry and
    parameter-server table. A host cache or URL of another name is fine (a node's cache,
    a server's address); nothing is written."""
    stack = _stack(layer)
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise _mismatch(layer, stack, f"its extra state is not a layer's (format {FORMAT})")
    mine = get_extra_state(layer)
    for field in ("layer_type", "embedding_size", "dtype", "table"):
        if field in mine and field in state and state[field] != mine[field]:
            raise _mismatch(layer, stack, f"{field} is {state[field]!r}, the layer's "
                                          f"{mine[field]!r}")
    if "table" in state and "table" not in mine:
        raise _mismatch(layer, stack, f"it names parameter-server table {state['table']!r}; "
                                      "the layer has no parameter server")
    for field in ("host_cache", "url"):
        if state.get(field) != mine.get(field):
            logger.info("checkpoint's %s is %r, this layer's %r", field, state.get(field),
                        mine.get(field))


def save_to_state_dict(layer: _NVBase, destination: dict[str, Any], prefix: str,
                       keep_vars: bool) -> None:
    """``<prefix>weight`` (a linear table's view, no copy) or ``<prefix>_extra_state``."""
    stack = _stack(layer)
    if isinstance(stack, LinearState):
        block = _sharded_block(stack)
        view = _view(layer, stack)
        destination[prefix + WEIGHT] = view if block is None else _sharded_view(block, view)
    else:
        destination[prefix + EXTRA] = get_extra_state(layer)


def _view(layer: _NVBase, stack: LinearState) -> torch.Tensor:
    """The table's rows without their optimizer state (a view: no copy); a quantized
    table's stored bytes."""
    view = stack.table_view()
    if view.shape[1] == layer.embedding_size or _format(stack) is not None:
        return view
    return view[:, :layer.embedding_size]


def _format(stack: Any) -> RowFormat | None:
    """The quantized format of a linear stack's table (None: plain, or no linear table)."""
    return stack.table_format() if isinstance(stack, LinearState) else None


def _shape_problem(layer: _NVBase, value: torch.Tensor, fmt: RowFormat | None,
                   key: str) -> str | None:
    """What keeps ``value`` from being loaded as the layer's rows (None: nothing)."""
    want = (layer.num_embeddings, layer.embedding_size)
    got = f"{key} is {list(value.shape)} {value.dtype}"
    if fmt is not None:
        if (value.dtype == torch.uint8 and tuple(value.shape) == (want[0], fmt.stored_bytes)
                or tuple(value.shape) == want and is_plain(value.dtype)):
            return None
        return (f"{got}; the layer's table is stored {fmt.dtype}: load its stored bytes "
                f"[{want[0]}, {fmt.stored_bytes}] torch.uint8 (its state_dict's) or float "
                f"rows [{want[0]}, {want[1]}] (quantized as they are written)")
    if tuple(value.shape) == want and value.dtype == layer.data_type:
        return None
    hint = ("; uint8 rows are a quantized table's stored bytes: load them into a layer over "
            "a table of that format" if value.dtype == torch.uint8 else "")
    return f"{got}, the layer's table [{want[0]}, {want[1]}] {layer.data_type}{hint}"


def _spans(rows: int, row_bytes: int, first: int = 0) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    for start in range(first, rows, step):
        yield start, min(rows, start + step)


def share(num_rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows ``start .. stop`` of ``rank``'s share of a table sharded by rows over ``world``
    ranks: torch.chunk's split, as ``DTensor``'s ``Shard(0)`` makes it (the last shares may
    be short or empty)."""
    size = -(-num_rows // world)
    start = min(num_rows, rank * size)
    return start, min(num_rows, start + size)


def _sharded_block(stack: Any) -> Any:
    """The stack's ``DistMemBlock`` when it spans a torch process group of several ranks
    (its checkpoint is a ``DTensor``), else None."""
    from gpu.dist.distmem import DistMemBlock
    from gpu.dist.groups import TorchGroup

    block = stack.table_block() if isinstance(stack, LinearState) else None
    if isinstance(block, DistMemBlock) and isinstance(block.group, TorchGroup) \
            and block.world_size > 1:
        return block
    return None


def _sharded_view(block: Any, view: torch.Tensor) -> torch.Tensor:
    """``view`` (the whole table) as a ``DTensor`` over the block's group, ``Shard(0)``,
    whose local part is this rank's share of ``view`` (a view, no copy)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    pg = block.group.pg if block.group.pg is not None else dist.group.WORLD
    if pg is None or not block.group.alive():
        raise GroupError(f"the process group of DistMemBlock {block.name!r} is gone; take "
                         "the state_dict before destroying the group")
    mesh = DeviceMesh.from_group(pg, view.device.type)
    start, stop = share(block.num_rows, block.world_size, block.rank)
    return DTensor.from_local(view[start:stop], mesh, [Shard(0)], run_check=False,
                              shape=view.shape, stride=view.stride())


def _local_part(value: torch.Tensor) -> torch.Tensor | None:
    """A ``DTensor``'s local part, None for any other tensor."""
    if type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):
        return None
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else None


def _own_share(stack: Any, value: torch.Tensor) -> tuple[int, int] | None:
    """Rows ``(start, stop)`` when ``value`` is a ``DTensor`` whose local part is this
    rank's share of the layer's table itself (as its state_dict gave it), else None."""
    local = _local_part(value)
    block = None if local is None else _sharded_block(stack)
    if local is None or block is None:
        return None
    start, stop = share(block.num_rows, block.world_size, block.rank)
    return (start, stop) if _same_memory(local, stack.table_view()[start:stop]) else None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def check_rows(layer: _NVBase, value: Any, key: str) -> torch.Tensor:
    """``value`` as the layer's rows, or StateDictError naming the table; reads the rows
    once (a chunk at a time) for NaN and infinities, writes nothing."""
    stack = _stack(layer)
    if not isinstance(value, torch.Tensor):
        raise _mismatch(layer, stack, f"{key} is a {type(value).__name__}, not a tensor")
    fmt = _format(stack)
    problem = _shape_problem(layer, value, fmt, key)
    if problem is not None:
        raise _mismatch(layer, stack, problem)
    if _local_part(value) is not None:
        if _own_share(stack, value) is None:
            raise _mismatch(layer, stack, f"{key} is a DTensor that is not this layer's "
                                          "state_dict view (dcp.load into "
                                          "model.state_dict(), or pass value.full_tensor())")
        return value  # NOTE: this rank's share is the table's rows already
    if isinstance(stack, LinearState) and _same_memory(value, _view(layer, stack)):
        return value  # NOTE: the rows are the table's already
    stored = fmt if value.dtype == torch.uint8 else None
    row_bytes = layer.embedding_size * (4 if stored else value.element_size())
    for start, stop in _spans(value.shape[0], row_bytes):
        part = value[start:stop] if stored is None else quant.decode(value[start:stop], stored)
        if not bool(torch.isfinite(part).all()):
            raise _mismatch(layer, stack, f"{key} holds NaN or an infinity in rows "
                                          f"{start}..{stop}")
    return value


def load_rows(layer: _NVBase, value: torch.Tensor, key: str) -> None:
    """Write checked rows (:func:`check_rows`) into the layer's table, a chunk at a time,
    through its write path (a ``DistMemBlock`` over several ranks: this rank's share only,
    :func:`share`); rows already in place are announced instead; a progress bar on a
    terminal for a large table."""
    from tqdm import tqdm

    stack = _stack(layer)
    pad = _format(stack) is None  # NOTE: a quantized table has no optimizer state
    rows, row_bytes = value.shape[0], value.shape[1] * value.element_size()
    first, mine = 0, _own_share(stack, value)
    if mine is not None:  # a DTensor that dcp.load filled: this rank's share, in place
        inplace = True
        first, rows = mine
    else:
        inplace = isinstance(stack, LinearState) and _same_memory(value, _view(layer, stack))
        block = None if inplace else _sharded_block(stack)
        if block is not None:  # a plain tensor on every rank: each writes its share
            first, rows = share(block.num_rows, block.world_size, block.rank)
    big = (rows - first) * row_bytes >= PROGRESS_BYTES
    with torch.no_grad(), tqdm(total=rows - first, unit="row", unit_scale=True, leave=False,
                               desc=f"loading {key}", disable=None if big else True) as bar:
        for start, stop in _spans(rows, row_bytes, first):
            if inplace:
                stack.rows_changed(start, stop)
            else:
                part = value[start:stop]
                stack.write_rows(start, (wide.pad(part, layer.row_width) if pad else part)
                                 .contiguous())
            bar.update(stop - start)


def load_from_state_dict(layer: _NVBase, state_dict: Mapping[str, Any], prefix: str,
                         local_metadata: dict[str, Any], strict: bool,
                         missing_keys: list[str], unexpected_keys: list[str],
                         error_msgs: list[str]) -> None:
    """torch's per-module load: check every entry of the layer, then write its rows."""
    stack = _stack(layer)
    wkey, xkey = prefix + WEIGHT, prefix + EXTRA
    if xkey in state_dict:
        set_extra_state(layer, state_dict[xkey])
    value = state_dict.get(wkey)
    if value is not None:
        load_rows(layer, check_rows(layer, value, wkey), wkey)
    elif isinstance(stack, LinearState):
        missing_keys.append(wkey)
    elif xkey not in state_dict:
        missing_keys.append(xkey)
    if strict:
        for k in state_dict:
            if k.startswith(prefix) and k not in (wkey, xkey) and \
                    k[len(prefix):].split(".", 1)[0] not in layer._modules:
                unexpected_keys.append(k)


def _layer_entries(model: torch.nn.Module) -> Iterator[tuple[str, _NVBase]]:
    from gpu.layers import _NVBase

    for name, module in model.named_modules():
        if isinstance(module, _NVBase):
            yield (name + "." if name else ""), module


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Check every layer's entries of ``state_dict`` against the layers of ``model``
    (shape, dtype, finiteness, tables named) without writing anything: call it before
    ``model.load_state_dict`` so that a checkpoint that does not fit a later layer leaves
    the earlier ones unwritten too.

    Raises:
        StateDictError: an entry does not fit its layer (the first one met).
    """
    for prefix, layer in _layer_entries(model):
        if prefix + EXTRA in state_dict:
            set_extra_state(layer, state_dict[prefix + EXTRA])
        if prefix + WEIGHT in state_dict:
            check_rows(layer, state_dict[prefix + WEIGHT], prefix + WEIGHT)


#: the TorchRec modules' state_dict names of a table's rows
TORCHREC_GROUPS = ("embedding_bags", "embeddings")


def from_torchrec(state_dict: Mapping[str, Any], layers: Mapping[str, _NVBase]) -> list[str]:
    """Load tables of a TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection``
    state dict into layers: ``[<module>.]embedding_bags.<table>.weight`` (or
    ``embeddings.<table>.weight``) into ``layers[<table>]``. Every table is found and
    checked before any is written.

    Returns:
        The state-dict keys loaded, in the order of ``layers``.

    Raises:
        StateDictError: a table of ``layers`` is not in ``state_dict`` (or twice), or its
            rows do not fit its layer; no layer was written.
    """
    found: dict[str, str] = {}
    for table, layer in layers.items():
        tails = [f"{group}.{table}.{WEIGHT}" for group in TORCHREC_GROUPS]
        keys = [k for k in state_dict if any(k == t or k.endswith("." + t) for t in tails)]
        if len(keys) != 1:
            got = "no key" if not keys else f"keys {keys}"
            raise StateDictError(f"TorchRec table {table!r}: the state dict has {got} ending "
                                 f"in {' or '.join(tails)}; nothing was written")
        check_rows(layer, state_dict[keys[0]], keys[0])
        found[table] = keys[0]
    for table, layer in layers.items():
        load_rows(layer, state_dict[found[table]], found[table])
    return list(found.values())
