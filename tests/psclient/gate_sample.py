"""A loop module for tests/psclient/backends/test_loop_gate.py: one compiled loop and its
warm_up."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def total(a: np.ndarray) -> int:
    s = 0
    for x in a:
        s += x
    return s


def warm_up() -> None:
    total(np.arange(3, dtype=np.int64))
