"""Argument checks shared by the host tables: typed errors, nothing changed on failure."""

from __future__ import annotations

import torch

from hostcache.errors import BadArgumentError, NonFiniteValuesError
from hostcache.layout import EMPTY_KEY
from nvecache.common.finite import nonfinite_message, nonfinite_rows
from nvecache.common.keys import RESERVED_KEY_RULE, key_problem


def check_keys(keys: object, *, what: str = "keys") -> torch.Tensor:
    """Keys as an int64 1-D CPU tensor, or a :class:`BadArgumentError` saying what to pass
    (the host tier reads keys on the CPU; CUDA keys go through the gpu package's kernels)."""
    problem = key_problem(keys)
    if problem is not None:
        raise BadArgumentError(f"{what} {problem}")
    assert isinstance(keys, torch.Tensor)
    return keys.contiguous()


def check_cache_keys(keys: object) -> torch.Tensor:
    """Like :func:`check_keys`, and refuses the reserved empty-slot key."""
    keys = check_keys(keys)
    # NOTE: the reserved key is INT64_MIN: a minimum tells, and numpy's is one call where
    # torch's comparison and reduction are two dispatched ops (bench/RESULTS.md, "Host cache")
    if keys.numel() and int(keys.numpy().min()) == EMPTY_KEY:
        raise BadArgumentError(RESERVED_KEY_RULE)
    return keys


def check_finite(values: torch.Tensor, keys: torch.Tensor, *, allow_nonfinite: bool,
                 key_word: str = "key") -> None:
    """Rows a write stores hold no NaN or infinity, unless the caller allows them.

    Raises:
        NonFiniteValuesError: how many rows hold one, and the first one's key (``index``
            of a linear table); nothing was written.
    """
    if allow_nonfinite:
        return
    bad = nonfinite_rows(values)
    if bad is not None:
        raise NonFiniteValuesError(nonfinite_message(bad, keys, key_word=key_word))


def check_values(
    values: object, n: int, dim: int, dtype: torch.dtype, *, what: str = "values"
) -> torch.Tensor:
    """Values as a [n, dim] CPU tensor of exactly ``dtype``."""
    if not isinstance(values, torch.Tensor):
        raise BadArgumentError(f"{what} must be a torch.Tensor; got {type(values).__name__}")
    if values.dtype != dtype:
        raise BadArgumentError(
            f"{what} must have the table's dtype {dtype}; got {values.dtype} (convert with .to())"
        )
    if values.device.type != "cpu":
        raise BadArgumentError(f"{what} must be on the CPU; got {values.device}")
    if tuple(values.shape) != (n, dim):
        raise BadArgumentError(
            f"{what} must have shape [{n}, {dim}] (one row per key); got {tuple(values.shape)}"
        )
    return values


def check_indices(indices: object, num_rows: int) -> torch.Tensor:
    """Row indices of a linear table: int64 1-D CPU, every one in ``[0, num_rows)``."""
    idx = check_keys(indices, what="indices")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_rows):
        bad = idx[(idx < 0) | (idx >= num_rows)][:5].tolist()
        raise BadArgumentError(
            f"indices must be in [0, {num_rows}); got out-of-range values such as {bad}"
        )
    return idx


def dedup_last(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct keys, the position of each one's last occurrence, and the inverse map."""
    unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    positions = torch.arange(keys.numel(), dtype=torch.int64)
    last = torch.full((unique.numel(),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, positions, reduce="amax")
    return unique, last, inverse
