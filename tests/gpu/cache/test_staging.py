"""``gpu.stacks.misses.staging.PinnedStaging``: a buffer refilled on another stream than its last
copy
out waits for that copy (CUDA only: on the CPU nothing is staged)."""

from __future__ import annotations

import pytest
import torch

from gpu.stacks.misses.staging import PinnedStaging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (pinned copies to the device)")


def test_a_refill_on_another_stream_waits_for_the_last_copy_out() -> None:
    dev = torch.device("cuda")
    staging = PinnedStaging(dev)
    n = 1 << 20
    first, second = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with torch.cuda.stream(first):
        # NOTE: the first stream is kept busy on the GPU, so its copy is still queued
        # when the second stream refills the buffer (no host-side wait involved)
        torch.cuda._sleep(200_000_000)
        staging.take(n)[:] = 1
        got_first = staging.send(n)
    with torch.cuda.stream(second):
        staging.take(n)[:] = 2
        got_second = staging.send(n)
    torch.cuda.synchronize(dev)
    assert bool((got_first == 1).all()) and bool((got_second == 2).all())

