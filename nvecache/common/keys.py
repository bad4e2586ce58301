"""The one rule for a batch of keys, shared by every tier (psclient is the lowest).

Keys are int64 in a ``torch.Tensor``: 1-D for the tables and the parameter server, any shape
for a layer's input; on the CPU for the host tier and the parameter server, on the layer's or
cache's device for the GPU tier. :func:`key_problem` says what is wrong in words a caller can
act on; each package raises it as its own typed error (``BadKeysError``, ``hostcache``'s and
``gpu``'s ``BadArgumentError``).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from nvecache.common.lazy import lazy_import

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch", globals())

#: The one int64 no table stores: ``INT64_MIN`` marks an empty slot of the host cache
#: (``hostcache.layout.EMPTY_KEY`` is this value), so every tier refuses to write it.
RESERVED_KEY = -(1 << 63)

#: What to tell a caller who passed :data:`RESERVED_KEY`.
RESERVED_KEY_RULE = (f"key {RESERVED_KEY} (INT64_MIN) is reserved to mark empty slots; "
                     "map it to another key")


def key_problem(keys: object, *, device: torch.device | None = None,
                any_shape: bool = False) -> str | None:
    """What is wrong with ``keys`` as a batch of keys (None: nothing).

    Args:
        keys: what the caller passed.
        device: where the keys must be (default the CPU; a CUDA device without an index
            means any GPU).
        any_shape: any shape is fine (a layer's input); else 1-D.

    Returns:
        A phrase to follow the argument's name ("must be ...; got ...: fix with ..."), or
        None when ``keys`` is a valid batch.
    """
    shape = "" if any_shape else "1-D "
    if not isinstance(keys, torch.Tensor):
        return f"must be a {shape}torch.Tensor of int64 keys; got {type(keys).__name__}"
    if keys.dtype != torch.int64:
        return f"must have dtype torch.int64; got {keys.dtype} (convert with .long())"
    if not any_shape and keys.dim() != 1:
        return f"must be 1-D [N]; got shape {tuple(keys.shape)} (flatten with .reshape(-1))"
    if device is None:
        device = _cpu()
    kd = keys.device  # NOTE: once: each read builds a torch.device (layers call this per lookup)
    if kd != device and (kd.type != device.type or device.index is not None):
        return (f"must be on {device}; got {kd} (move them with "
                f".to({str(device)!r}))")
    return None


@cache
def _cpu() -> torch.device:
    """``torch.device("cpu")``, made once, by the first check (not at import: no torch)."""
    return torch.device("cpu")
