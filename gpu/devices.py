"""Device arguments: one resolution rule for every module of the ``gpu`` package."""

from __future__ import annotations

import torch

from .errors import BadArgumentError, CUDAUnavailableError


def resolve_device(device: object) -> torch.device:
    """``None`` (the current CUDA device, else the CPU), ``"cpu"``, ``"cuda"``,
    ``"cuda:N"``, an int or a ``torch.device`` -> a ``torch.device`` with an index on CUDA.

    Raises:
        BadArgumentError: not a CPU or CUDA device, or an index this process cannot see.
        CUDAUnavailableError: a CUDA device without CUDA.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
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
