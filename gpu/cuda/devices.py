"""Device arguments: one resolution rule for every module of the ``gpu`` package."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from gpu.errors import BadArgumentError, CUDAUnavailableError


def resolve_device(device: object) -> torch.device:
    """``None`` (the current CUDA device, else the CPU), ``"cpu"``, ``"cuda"``,
    ``"cuda:N"``, an int ``N`` (``cuda:N``) or a ``torch.device`` -> a ``torch.device``
    with an index on CUDA.

    Raises:
        BadArgumentError: not a CPU or CUDA device, a negative index, or an index this
            process cannot see.
        CUDAUnavailableError: a CUDA device (an int too) without CUDA.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        # NOTE: torch.device(int) means the current accelerator, and raises without one
        if device < 0:
            raise BadArgumentError(f"a CUDA device index must be >= 0; got {device}")
        device = torch.device("cuda", device)
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as e:
        raise BadArgumentError(
            f"device must be 'cpu', 'cuda', 'cuda:N' or an int; got {device!r}"
        ) from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise BadArgumentError(f"device must be a CPU or CUDA device; got {dev}")
    if not torch.cuda.is_available():
        raise CUDAUnavailableError(
            f"device {dev} was asked for but torch.cuda is not available here; pass "
            "device='cpu' (no CUDA call is made) or run on a GPU machine"
        )
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise BadArgumentError(
            f"device {dev}: this process sees {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def same_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` lives on ``device`` (CUDA: the same index)."""
    return t.device.type == device.type and (
        device.type == "cpu" or t.device.index == device.index
    )


_F = TypeVar("_F", bound=Callable[..., Any])


def on_tensor_device(fn: _F) -> _F:
    """Run ``fn`` with the CUDA device of its first tensor argument current.

    Triton launches on the current device and stream; a layer or cache on ``cuda:1`` in a
    process whose current device is ``cuda:0`` would otherwise launch on the wrong GPU
    (Triton then refuses the pointers). Costs one ``current_device()`` call when the
    device is already current.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for a in args:
            if isinstance(a, torch.Tensor):
                # NOTE: torch._C's getter: torch.cuda.current_device() costs more host time
                # a call (bench/RESULTS.md, "Per-call path")
                if a.is_cuda and a.device.index != torch._C._cuda_getDevice():
                    with torch.cuda.device(a.device):
                        return fn(*args, **kwargs)
                break
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
