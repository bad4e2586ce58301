"""The one rule for adding deltas to rows, shared by every tier's ``accumulate``.

A batch's deltas are summed per distinct key first (duplicates add up, in their order in
the batch), in the accumulator dtype: float32 for float32, float16 and bfloat16 rows,
float64 for float64 rows. A row is then read as that dtype, its summed delta added, and
the result rounded to the row's dtype once. So a float16 or bfloat16 row gets one rounding
per call, however many times its key repeats, and every tier (parameter server, host
cache, linear tables, GPU cache) computes the same bits for the same call.

A quantized row (int8, float8_e4m3fn) takes float32 deltas: it is decoded to float32, its
summed delta added, and the sum encoded with stochastic rounding
(:func:`nvecache.common.quant.encode_sum`), so deltas under half a quantization step add up
over many calls instead of rounding away; every tier that stores quantized rows applies
that one function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype deltas are summed and added in for rows of ``dtype``."""
    import torch  # NOTE: here, not at import: command lines that write no rows load no torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def delta_problem(deltas: object, n: int, dim: int, dtype: torch.dtype,
                  device: str | None = "cpu") -> str | None:
    """What is wrong with ``deltas`` for ``n`` keys of rows ``[dim]`` of ``dtype`` (None:
    nothing). Deltas are a ``[n, dim]`` tensor of the rows' dtype or of their accumulator
    dtype (float32 deltas for a float16 table are added without rounding them first), on
    a ``device`` of that type (None: any)."""
    import torch

    if not isinstance(deltas, torch.Tensor):
        return f"deltas must be a torch.Tensor; got {type(deltas).__name__}"
    if device is not None and deltas.device.type != device:
        return f"deltas must be on the {device.upper()}; got {deltas.device}"
    allowed = (dtype, accumulator(dtype))
    if deltas.dtype not in allowed:
        names = " or ".join(dict.fromkeys(str(d) for d in allowed))
        return (f"deltas must be {names} (the table's dtype or its accumulator); got "
                f"{deltas.dtype}: convert with deltas.to({allowed[-1]})")
    if tuple(deltas.shape) != (n, dim):
        return (f"deltas must have shape [{n}, {dim}] (one delta row per key); got "
                f"{list(deltas.shape)}")
    return None


def check_deltas(deltas: object, keys: torch.Tensor, dim: int, dtype: torch.dtype, *,
                 allow_nonfinite: bool, errors: tuple[type[Exception], type[Exception]],
                 device: str | None = "cpu", key_word: str = "key") -> None:
    """Refuse ``deltas`` for ``keys`` (:func:`delta_problem`), or deltas holding NaN or an
    infinity unless ``allow_nonfinite``, with the caller's error classes ``(bad argument,
    non-finite values)`` and a message saying what to do."""
    from nvecache.common.finite import nonfinite_message, nonfinite_rows

    problem = delta_problem(deltas, keys.numel(), dim, dtype, device)
    if problem is not None:
        raise errors[0](problem)
    bad = None if allow_nonfinite else nonfinite_rows(deltas)  # type: ignore[arg-type]
    if bad is not None:
        raise errors[1](nonfinite_message(bad.cpu(), keys.cpu(), what="deltas",
                                          key_word=key_word))


def sum_duplicates(keys: torch.Tensor, deltas: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(distinct keys ascending, each one's summed delta, each key's distinct index)``.

    Args:
        keys: int64 ``[N]`` (any device).
        deltas: ``[N, dim]`` on the keys' device.
        dtype: the rows' dtype: the sums are in its :func:`accumulator` dtype.
    """
    import torch

    ukeys, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    acc = accumulator(dtype)
    sums = torch.zeros((ukeys.numel(), deltas.shape[1]), dtype=acc, device=deltas.device)
    sums.index_add_(0, inverse, deltas.to(acc))
    return ukeys, sums, inverse


def added(rows: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """``rows`` plus their summed deltas, added in the accumulator dtype and rounded to the
    rows' dtype once: a new tensor."""
    return (rows.to(sums.dtype) + sums).to(rows.dtype)


def add_at(table: torch.Tensor, idx: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Add ``deltas`` to rows ``idx`` of ``table`` (a linear table's rows, on the device of
    ``idx`` and ``deltas``) by the rule above, in place; returns the distinct rows changed.
    The caller keeps other writers of those rows out meanwhile."""
    uidx, sums, _ = sum_duplicates(idx, deltas, table.dtype)
    table.index_copy_(0, uidx, added(table.index_select(0, uidx), sums))
    return uidx
