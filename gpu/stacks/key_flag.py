"""Out-of-range keys caught on the device, reported without a host sync.

A linear table's lookup kernels read row ``key`` only for ``0 <= key < num_rows``; with
the default ``validate=False`` they also write an offending key into a
:class:`KeyErrorFlag`: one int64 of pinned host memory the GPU writes through its mapped
address (a :class:`~gpu.cuda.host_word.HostWord`: a store over the host link, made only when a
key is bad). The host reads it with a plain memory load, no copy and no stream wait, at
the start of the layer's next call and in :meth:`raise_pending`: the error surfaces at
the next call after the kernel has run, and at once after any synchronizing call
(``layer.synchronize()``). The rows of those keys read as zeros; nothing else changed.
On the CPU the layers check every key before the lookup instead (the flag stays 0).
"""

from __future__ import annotations

import torch

from gpu.cuda.host_word import HostWord
from gpu.errors import BadArgumentError
from gpu.inputs import check_range

#: no bad key seen (a bad key is never 0: row 0 exists in every table)
CLEAR = 0


class KeyErrorFlag:
    """The slot a layer's kernels report an out-of-range key in.

    Args:
        device: The layer's device (CPU: a plain host tensor, never written by a kernel).
        num_rows: Rows of the table, for the message.
        what: The argument name used in the message.
    """

    def __init__(self, device: torch.device, num_rows: int, what: str = "input") -> None:
        self.num_rows = num_rows
        self.what = what
        self._word = HostWord(device, "the layer's key-error flag")
        #: what the kernels write (a CUDA tensor over the pinned host word)
        self.device_view = self._word.device_view

    def raise_pending(self) -> None:
        """Raise (and clear) a bad key reported by an earlier lookup, if any.

        Raises:
            BadArgumentError: naming the key; the lookup that met it returned zero rows
                for it.
        """
        bad = self._word.read()
        if bad == CLEAR:
            return
        self._word.write(CLEAR)
        raise BadArgumentError(
            f"an earlier lookup's {self.what} held key {bad}, outside [0, {self.num_rows}) "
            "of this linear table; its rows read as zeros. Filter the keys, or pass "
            "validate=True to check every call on the host (one sync per call)"
        )


class RangeCheck:
    """How a linear table's lookups check their keys: on the host before each lookup (the
    CPU, ``validate=True``: one sync, the typed error at once), or on the device through
    a :class:`KeyErrorFlag` (CUDA by default: no sync, the error at the next call)."""

    def __init__(self, device: torch.device, num_rows: int) -> None:
        self.num_rows = num_rows
        self._cpu = device.type == "cpu"
        self.flag = KeyErrorFlag(device, num_rows)
        self.on_host = self._cpu

    def set_validate(self, validate: bool) -> None:
        self.on_host = bool(validate) or self._cpu

    @property
    def err(self) -> torch.Tensor | None:
        """The flag the kernels write (None when keys are checked on the host)."""
        return None if self.on_host else self.flag.device_view

    def __call__(self, keys: torch.Tensor) -> None:
        """Before a lookup: check ``keys`` (host), or raise what an earlier one met."""
        if self.on_host:
            check_range(keys, self.num_rows)
        else:
            self.flag.raise_pending()
