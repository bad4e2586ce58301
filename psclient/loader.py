"""Bulk loading: a tensor, a ``.npy`` / ``.safetensors`` file or an iterator of chunks."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from .errors import BadArgumentError, BadValuesError

if TYPE_CHECKING:
    from .base import ParameterServer

log = logging.getLogger(__name__)


class _RowSource:
    """Random access to the rows of a 2-D tensor-like source, sliced chunk by chunk."""

    def __init__(self, n: int, dim: int, dtype: torch.dtype, get: Any) -> None:
        self.n, self.dim, self.dtype, self.get = n, dim, dtype, get


def open_rows(source: object, tensor: str | None) -> _RowSource:
    """Open a tensor, array, ``.npy`` or ``.safetensors`` source without reading its rows."""
    if isinstance(source, np.ndarray):
        source = torch.from_numpy(source)
    if isinstance(source, torch.Tensor):
        t = source
        if t.dim() != 2:
            raise BadValuesError(f"source tensor must be [N, dim], got {list(t.shape)}")
        return _RowSource(t.shape[0], t.shape[1], t.dtype, lambda a, b: t[a:b].cpu())
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise BadArgumentError(f"no such file: {str(path)!r}")
        if path.suffix == ".npy":
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
            except ValueError as e:
                raise BadArgumentError(f"{str(path)!r} is not a plain .npy array: {e}") from e
            if arr.ndim != 2:
                raise BadValuesError(f"{str(path)!r} holds shape {list(arr.shape)}, need [N, dim]")
            dt = torch.from_numpy(np.empty(0, dtype=arr.dtype)).dtype
            return _RowSource(arr.shape[0], arr.shape[1], dt,
                              lambda a, b: torch.from_numpy(np.array(arr[a:b])))
        if path.suffix == ".safetensors":
            return _open_safetensors(path, tensor)
        raise BadArgumentError(
            f"cannot load {str(path)!r}: use a .npy or .safetensors file (or pass a tensor)"
        )
    raise BadArgumentError(f"unsupported load source of type {type(source).__name__}")


def _open_safetensors(path: Path, tensor: str | None) -> _RowSource:
    from safetensors import safe_open

    f = safe_open(str(path), framework="pt")  # NOTE: memory-maps; slices read lazily
    names = list(f.keys())
    if tensor is None:
        if len(names) != 1:
            raise BadArgumentError(
                f"{str(path)!r} holds tensors {names}: pass tensor=NAME (--tensor NAME)"
            )
        tensor = names[0]
    if tensor not in names:
        raise BadArgumentError(f"{str(path)!r} has no tensor {tensor!r}; it holds {names}")
    sl = f.get_slice(tensor)
    shape = sl.get_shape()
    if len(shape) != 2:
        raise BadValuesError(f"tensor {tensor!r} in {str(path)!r} is {shape}, need [N, dim]")
    dt = f.get_slice(tensor)[0:0].dtype
    return _RowSource(shape[0], shape[1], dt, lambda a, b: sl[a:b].contiguous())


def _chunks(ps: ParameterServer, source: object, keys: torch.Tensor | None,
            tensor: str | None, batch_size: int) -> tuple[int | None, Iterator[tuple[Any, Any]]]:
    if isinstance(source, (torch.Tensor, np.ndarray, str, Path)):
        rows = open_rows(source, tensor)
        if rows.dim != ps.dim or rows.dtype != ps.dtype:
            raise BadValuesError(
                f"source rows are [{rows.n}, {rows.dim}] {rows.dtype}, table {ps.table!r} holds "
                f"dim {ps.dim} {ps.dtype}: convert the data or load into another table"
            )
        if keys is None:
            keys = torch.arange(rows.n, dtype=torch.int64)
        elif not isinstance(keys, torch.Tensor) or tuple(keys.shape) != (rows.n,):
            raise BadArgumentError(f"keys must be an int64 tensor of shape [{rows.n}]")

        def gen() -> Iterator[tuple[Any, Any]]:
            for a in range(0, rows.n, batch_size):
                b = min(rows.n, a + batch_size)
                yield keys[a:b], rows.get(a, b)

        return rows.n, gen()
    if isinstance(source, Iterable):
        if keys is not None:
            raise BadArgumentError("keys= is not used with an iterator: yield (keys, values)")

        def split() -> Iterator[tuple[Any, Any]]:
            for item in source:
                try:
                    k, v = item
                except (TypeError, ValueError) as e:
                    raise BadArgumentError("an iterator source must yield (keys, values)") from e
                for a in range(0, len(k), batch_size):
                    yield k[a:a + batch_size], v[a:a + batch_size]

        return None, split()
    raise BadArgumentError(f"unsupported load source of type {type(source).__name__}")


def load_into(ps: ParameterServer, source: object, *, keys: torch.Tensor | None,
              tensor: str | None, batch_size: int, progress: bool) -> int:
    """Insert every row of ``source`` into ``ps``; see :meth:`ParameterServer.load`."""
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise BadArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    total, chunks = _chunks(ps, source, keys, tensor, batch_size)
    loaded = 0
    with tqdm(total=total, unit="rows", unit_scale=True, disable=not progress,
              desc=f"load {ps.table}") as bar:
        for k, v in chunks:
            ps.insert(k, v)
            loaded += len(k)
            bar.update(len(k))
    log.info("loaded %d rows into table %r", loaded, ps.table)
    return loaded
