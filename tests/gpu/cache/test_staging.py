"""``gpu.stacks.misses.staging.PinnedStaging``: a buffer refilled on another stream than its last
copy out waits for that copy; what comes back from the device lands in the same pinned
memory each time (CUDA only: on the CPU nothing is staged)."""

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



@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.float16])
def test_receive_brings_a_device_tensors_bytes_back_and_reuses_the_buffer(
        dtype: torch.dtype) -> None:
    dev = torch.device("cuda")
    staging = PinnedStaging(dev)
    g = torch.Generator(device=dev).manual_seed(3)
    for n in (1, 17, 4099, 70_001, 5):
        src = torch.randint(0, 2 if dtype == torch.bool else 100, (n,), device=dev,
                            generator=g).to(dtype)
        got = staging.receive(src)
        torch.cuda.current_stream(dev).synchronize()
        want = src.cpu().view(torch.uint8).numpy()
        assert got.shape == want.shape and (got == want).all()
    # NOTE: a later call reads into the same pinned memory (no allocation a call)
    first = staging.receive(torch.ones(8, dtype=torch.bool, device=dev))
    again = staging.receive(torch.zeros(8, dtype=torch.bool, device=dev))
    torch.cuda.current_stream(dev).synchronize()
    assert first.ctypes.data == again.ctypes.data and not again.any()
