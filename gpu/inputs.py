"""Checks of what users pass to the layers: typed errors naming the argument."""

from __future__ import annotations

import functools

import torch

from gpu.cuda.devices import same_device
from gpu.errors import BadArgumentError, NonFiniteValuesError
from gpu.layer_config import DATA_TYPES, PoolingMode
from nvecache.common import rows
from nvecache.common.finite import nonfinite_message, nonfinite_rows
from nvecache.common.keys import key_problem


def positive_int(name: str, value: object, *, zero: bool = False) -> int:
    """``value`` if it is an int > 0 (``zero``: >= 0), else a :class:`BadArgumentError`
    naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        bound = ">= 0" if zero else "> 0"
        raise BadArgumentError(f"{name} must be an int {bound}; got {value!r}")
    return value


def check_dtype(dtype: object, *, name: str = "data_type",
                allowed: tuple[str, ...] = DATA_TYPES) -> torch.dtype:
    """A torch dtype a layer computes in (``allowed``: stored names of
    ``nvecache.common.rows``); a :class:`BadArgumentError` naming the argument otherwise."""
    try:
        if isinstance(dtype, torch.dtype):
            return rows.torch_dtype(rows.dtype_name(dtype, allowed))
    except rows.RowFormatError:
        pass
    choices = ", ".join(f"torch.{n}" for n in allowed)
    raise BadArgumentError(f"{name} must be one of {choices}; got {dtype!r}")


def check_row_format(dtype: object, dim: int, *, name: str = "dtype",
                     allowed: tuple[str, ...] = DATA_TYPES) -> rows.RowFormat:
    """How rows of ``dtype`` (checked as :func:`check_dtype` does) and ``dim`` elements are
    stored; a :class:`BadArgumentError` for a dim no table can hold."""
    try:
        return rows.RowFormat(rows.dtype_name(check_dtype(dtype, name=name, allowed=allowed)),
                              dim)
    except rows.RowFormatError as e:
        raise BadArgumentError(str(e)) from None


def check_keys(keys: object, device: torch.device, *, name: str = "input") -> torch.Tensor:
    """int64 keys on the layer's device (any shape)."""
    problem = key_problem(keys, device=device, any_shape=True)
    if problem is not None:
        raise BadArgumentError(f"{name} {problem}")
    assert isinstance(keys, torch.Tensor)
    return keys


def check_range(keys: torch.Tensor, num_rows: int, *, name: str = "input") -> None:
    """Every key in ``[0, num_rows)`` (linear tables); one host sync."""
    if keys.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(keys))  # one host sync
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise BadArgumentError(
            f"{name} holds key {bad}, outside [0, {num_rows}) of this linear table"
        )


@functools.lru_cache(maxsize=64)
def _even_offsets(nbags: int, per_bag: int, device: torch.device) -> torch.Tensor:
    """Bag boundaries ``[0, per_bag, ..., nbags * per_bag]`` of 2-D input, made once per
    shape: building them on every call cost two launches and host time comparable to the
    pooled kernel's own (bench/RESULTS.md, "Layers (H200)", "Figures cited by the code").
    Shared, so never written; ready on every stream (the host waits once for it)."""
    full = torch.arange(0, nbags + 1, dtype=torch.int64) * per_bag
    full = full.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return full


def _check_traced_offsets(full: torch.Tensor, n: int, include_last_offset: bool) -> None:
    """The offsets checks of :func:`bags` while tracing (compile, export): torch._check
    on the values, which a traced program asserts when it runs, instead of a Python
    branch on them (a branch on data is refused by export)."""
    first = full[0].item()
    torch._check(first == 0, lambda: "offsets must start at 0")
    torch._check(full.max().item() <= n, lambda: "offsets go past the input")
    if include_last_offset:
        torch._check(full[-1].item() == n, lambda: "the last offset must be the input's "
                     "length with include_last_offset=True")
    if full.shape[0] > 1:
        torch._check((full[1:] < full[:-1]).sum().item() == 0,
                     lambda: "offsets must be non-decreasing")


def bags(
    keys: torch.Tensor,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None,
    mode: PoolingMode,
    include_last_offset: bool,
    dtype: torch.dtype,
    device: torch.device,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Normalise embedding_bag input to (flat keys [N], offsets [B + 1], weights [N] | None).

    Semantics are torch.nn.functional.embedding_bag's: 2-D input is one bag per row and
    takes no offsets; 1-D input needs offsets (starting at 0, non-decreasing, within N);
    ``include_last_offset`` makes the last offset the end of the last bag.
    """
    check_keys(keys, device)
    if keys.dim() == 2:
        if offsets is not None:
            raise BadArgumentError("offsets must be None when input is 2-D (one bag per row)")
        nbags, per_bag = keys.shape
        flat = keys.reshape(-1)
        full = (torch.arange(0, nbags + 1, dtype=torch.int64, device=device) * per_bag
                if torch.compiler.is_compiling() else _even_offsets(nbags, per_bag, device))
    elif keys.dim() == 1:
        if offsets is None:
            raise BadArgumentError("offsets are required when input is 1-D")
        offsets = check_keys(offsets, device, name="offsets")
        if offsets.dim() != 1 or offsets.numel() == 0:
            raise BadArgumentError(f"offsets must be 1-D and non-empty; got shape "
                                   f"{tuple(offsets.shape)}")
        flat = keys
        n = keys.numel()
        if include_last_offset:
            full = offsets
            if offsets.numel() < 1:
                raise BadArgumentError("offsets must hold at least one value")
        elif not torch.compiler.is_compiling():
            full = torch.nn.functional.pad(offsets, (0, 1), value=n)  # no host round trip
        else:  # NOTE: pad's value would make the input's length a constant of the graph
            full = torch.cat([offsets, offsets.new_ones(1) * n])
        if not validate and device.type != "cpu":
            pass  # NOTE: the caller opted out of the host syncs; the pooled kernel clamps
            # each bag's bounds to the keys (gpu.kernels.cache_pooled)
        elif torch.compiler.is_compiling():
            _check_traced_offsets(full, n, include_last_offset)
        elif int(full[0]) != 0:
            raise BadArgumentError(f"offsets must start at 0; got {int(full[0])}")
        elif int(offsets.max()) > n or (include_last_offset and int(full[-1]) != n):
            raise BadArgumentError(
                f"offsets go past the input: an offset is {int(offsets.max())}, the input "
                f"has {n} keys"
            )
        elif full.numel() > 1 and bool((full[1:] < full[:-1]).any()):
            raise BadArgumentError("offsets must be non-decreasing")
    else:
        raise BadArgumentError(f"input must be 1-D (with offsets) or 2-D; got shape "
                               f"{tuple(keys.shape)}")
    if per_sample_weights is not None:
        if mode != "sum":
            raise BadArgumentError(
                f"per_sample_weights are only supported with mode='sum'; the layer's mode is "
                f"{mode!r}"
            )
        if not isinstance(per_sample_weights, torch.Tensor):
            raise BadArgumentError("per_sample_weights must be a torch.Tensor")
        if tuple(per_sample_weights.shape) != tuple(keys.shape):
            raise BadArgumentError(
                f"per_sample_weights must have the input's shape {tuple(keys.shape)}; got "
                f"{tuple(per_sample_weights.shape)}"
            )
        if per_sample_weights.dtype != dtype:
            raise BadArgumentError(
                f"per_sample_weights must have the layer's dtype {dtype}; got "
                f"{per_sample_weights.dtype}"
            )
        if not same_device(per_sample_weights, device):
            raise BadArgumentError(f"per_sample_weights must be on {device}")
        per_sample_weights = per_sample_weights.reshape(-1)
    return flat.contiguous(), full.contiguous(), per_sample_weights


def check_values(values: object, n: int, dim: int, dtype: torch.dtype, *,
                 keys: torch.Tensor | None = None, allow_nonfinite: bool = False
                 ) -> torch.Tensor:
    """Rows for a write: [n, dim] of the layer's dtype (any device; moved by the caller),
    holding no NaN or infinity unless ``allow_nonfinite`` (on a CUDA tensor that check is
    one host sync: writes only, never lookups).

    Raises:
        BadArgumentError: not such a tensor.
        NonFiniteValuesError: a row holds NaN or an infinity (how many rows, the first one's
            key from ``keys``).
    """
    if not isinstance(values, torch.Tensor):
        raise BadArgumentError(f"values must be a torch.Tensor; got {type(values).__name__}")
    if values.dtype != dtype:
        raise BadArgumentError(f"values must have the layer's dtype {dtype}; got {values.dtype}")
    if tuple(values.shape) != (n, dim):
        raise BadArgumentError(f"values must have shape [{n}, {dim}]; got {tuple(values.shape)}")
    if not allow_nonfinite:
        bad = nonfinite_rows(values)
        if bad is not None:
            raise NonFiniteValuesError(nonfinite_message(bad, keys))
    return values
