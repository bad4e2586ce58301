"""One int64 of pinned host memory that kernels write through its mapped address.

The host reads it with a plain memory load: no copy, no torch dispatch. A kernel's store
to it crosses the host link, so kernels write it only when there is something to say (a
bad key: gpu.stacks.key_flag). What was written is visible to the host once the writing kernel
has finished (after a stream or event synchronization, or at any later point the host
knows the kernel ran). On the CPU it is a plain tensor.
"""

from __future__ import annotations

import torch


class HostWord:
    """A host word a device's kernels can write.

    Args:
        device: Where the kernels run (CPU: a plain host tensor).
        what: What it holds, for the error message if mapping it fails.
    """

    def __init__(self, device: torch.device, what: str) -> None:
        if device.type == "cuda":
            host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            from gpu.cuda import runtime as _cuda
            from gpu.cuda.registration import DeviceArray

            ptr = int(_cuda.call("cudaHostGetDevicePointer", host.data_ptr(), 0,
                                 detail=f"mapping {what}"))
            #: what the kernels write (a CUDA tensor over the pinned host word)
            self.device_view = torch.as_tensor(DeviceArray(host, ptr, (1,), (8,), "<i8"),
                                               device=device)
        else:
            host = torch.zeros(1, dtype=torch.int64)
            self.device_view = host
        self._host = host
        self._word = host.numpy()  # NOTE: a plain load per read, no torch dispatch

    def read(self) -> int:
        return int(self._word[0])

    def write(self, value: int) -> None:
        self._word[0] = value
