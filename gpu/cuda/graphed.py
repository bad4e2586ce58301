"""A fixed piece of GPU work replayed from a CUDA graph: its host cost paid once.

Some work a layer repeats has the same tensors and shapes every time, only their contents
change: a warm LinearUVM cache's admission round inserts the same miss-log buffers into
the same cache. Launched op by op it costs the calling thread several times what the GPU
spends on it (two sorts, a search, a dozen allocations and five launches: bench/
RESULTS.md, "Per-call path (H200)"), and that lands on the one lookup that triggers it.
Captured once into a CUDA graph, each run is one graph launch on the caller's stream.

The owner captures at a moment it chooses (a layer at its construction, after an eager
run has loaded the kernels: nothing may compile during a capture), on a side stream in
``thread_local`` mode; the graph keeps its temporaries in a memory pool of its own. Until
then, and inside someone else's capture (a model captured whole), the work runs eagerly,
so it becomes part of that graph. A capture that fails leaves the work eager for good
(logged once), the results the same.

torch puts the device's default CUDA generator in capture mode for the length of any
capture: another thread drawing random numbers on that device meanwhile gets an error
from torch. And a failed capture leaves it there; here the generator is given back a
copy of its state, so random numbers keep working after a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


class GraphedCall:
    """``fn()`` (same tensors every call, results only in them) run from a CUDA graph once
    :meth:`capture` succeeded, eagerly before.

    Args:
        fn: The work: ops on tensors that live as long as this object, no host sync, no
            host-side state that changes between calls.
        device: The device it runs on (on the CPU it is never captured: always eager).
    """

    def __init__(self, fn: Callable[[], None], device: torch.device) -> None:
        self._fn = fn
        self._device = device
        self._graph: Any = None

    @property
    def graphed(self) -> bool:
        """Whether calls replay a captured graph."""
        return self._graph is not None

    def __call__(self) -> None:
        if self._graph is None or torch.cuda.is_current_stream_capturing():
            self._fn()  # NOTE: inside a caller's capture: recorded into its graph
            return
        self._graph.replay()

    def capture(self) -> bool:
        """Capture the work (nothing runs); returns whether later calls replay it. Call
        it after one eager run (the kernels loaded), never inside another capture."""
        if self._graph is not None or torch.cuda.is_current_stream_capturing():
            return self._graph is not None
        index = self._device.index if self._device.index is not None \
            else torch.cuda.current_device()
        rng = torch.cuda.default_generators[index]
        saved = rng.clone_state()
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(caller)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._fn()
                finally:
                    graph.capture_end()
        except RuntimeError as e:
            # NOTE: torch skips the generator's capture epilogue when a capture fails:
            # left so, every later random draw on the device would raise
            rng.graphsafe_set_state(saved)
            logger.warning("capturing %r into a CUDA graph failed (%s); it runs eagerly",
                           self._fn, e)
            return False
        caller.wait_stream(side)
        self._graph = graph
        return True
