"""What a closed layer holds in place of its tier stack.

``close()`` swaps the layer's stack for a :class:`ClosedStack` (and points the layer's
custom-op handle at it, :func:`gpu.ops.unregister`), so the lookup path stays as it was:
no flag is tested on each call; the first method the layer reaches raises
:class:`~gpu.errors.LayerClosedError`, eager or compiled.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

from gpu.errors import LayerClosedError


class ClosedStack:
    """A closed layer's stand-in for its stack: every operation of
    :class:`gpu.stacks.protocol.LayerStack` raises LayerClosedError (but ``close``).

    Args:
        what: The layer as its error names it (e.g. ``"NVEmbedding (LinearUVM)"``).
        stack: The stack it replaces (its geometry is kept: a model compiled before the
            close still traces; nothing else of it is referenced).
    """

    rows_any_shape = False

    def __init__(self, what: str, stack: Any) -> None:
        self._what = what
        self.layer_type: str = stack.layer_type
        self.dim: int = stack.dim
        self.dtype: torch.dtype = stack.dtype
        self.device: torch.device = stack.device

    def _raise(self, *_: object, **__: object) -> NoReturn:
        raise LayerClosedError(f"this {self._what} layer was closed (layer.close()): its "
                               "tables are released; build a new layer to keep serving")

    rows = pooled = update = insert = erase = accumulate = in_cache = clear = flush = _raise
    stats = check_pending = _raise

    @property
    def tiers(self) -> NoReturn:
        """The tiers a per-tier write names: gone with the layer."""
        self._raise()

    @property
    def validate(self) -> bool:
        """Keys are not checked any more: every lookup raises."""
        return False

    @validate.setter
    def validate(self, value: bool) -> None:
        pass

    def close(self) -> None:
        """Already closed: nothing to do."""


def close_all(tables: list[Any]) -> None:
    """Close each table, then raise the first error any close raised."""
    error: BaseException | None = None
    for table in tables:
        try:
            table.close()
        except BaseException as e:  # noqa: BLE001 - the others still close
            error = error or e
    if error is not None:
        raise error
