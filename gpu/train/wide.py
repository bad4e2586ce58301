"""Rows stored with their optimizer state: ``[w (dim) | state]`` in the table's dtype.

State is float32; in a 16-bit table each float32 takes two elements, bit for bit (they
are never read as numbers of the table's dtype: a lookup returns the first ``dim``
columns only).
"""

from __future__ import annotations

from typing import Any

import torch


def split(rows: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 copies of the rows' values ``[U, dim]`` and state ``[U, S]``."""
    w = rows[:, :dim].float()
    tail = rows[:, dim:]
    if tail.shape[1] == 0:
        return w, w.new_zeros(w.shape[0], 0)
    if rows.dtype == torch.float32:
        return w, tail.clone()
    return w, tail.clone(memory_format=torch.contiguous_format).view(torch.float32)


def join(w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows ``[U, dim + width of s]`` of ``dtype`` from float32 ``w`` and ``s``
    (``w`` rounded once)."""
    if dtype == torch.float32 or s.shape[1] == 0:
        return torch.cat([w, s], dim=1).to(dtype)
    return torch.cat([w.to(dtype), s.contiguous().view(dtype)], dim=1)


def pad(rows: torch.Tensor, width: int) -> torch.Tensor:
    """``rows`` with zero columns to ``width`` (a fresh row's state is zero)."""
    extra = width - rows.shape[-1]
    return rows if extra == 0 else torch.nn.functional.pad(rows, (0, extra))


def stored(weight_init: Any, default_row: Any, dim: int, width: int, dtype: torch.dtype
           ) -> tuple[Any, Any]:
    """A layer's ``weight_init`` and ``default_row`` as stored rows of ``width`` (zero
    state)."""
    if isinstance(weight_init, torch.Tensor) and weight_init.dim() == 2:
        weight_init = pad(weight_init.detach(), width)
    if default_row is not None:
        row = torch.as_tensor(default_row, dtype=dtype)
        if row.dim() == 0:
            row = row.expand(dim)
        if row.dim() == 1 and row.shape[0] == dim:
            default_row = pad(row, width)
    return weight_init, default_row
