"""gpu/errors.py is the one home of the package's errors; the names modules exported
before stay importable there and are the same classes."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import gpu
from gpu import errors

#: (module, name) pairs that users and docs import errors from
OLD_HOMES = [
    ("gpu", "DestructionOrderError"),
    ("gpu", "GPUError"),
    ("gpu", "BadArgumentError"),
    ("gpu.dist.distmem", "DestructionOrderError"),
    ("gpu.dist.groups", "GroupError"),
    ("gpu.dist.vmm", "VMMError"),
    ("gpu.dist.vmm", "PeerAccessError"),
    ("gpu.cuda.runtime", "CUDACallError"),
    ("gpu.cuda.registration", "HostRegError"),
    ("gpu.cuda.registration", "RegistrationClosedError"),
    ("gpu.cuda.registration", "HostRegisterUnsupportedError"),
    ("gpu.cuda.registration", "ForkedProcessError"),
    ("gpu.cuda.registration", "ViewNotAvailableError"),
    ("gpu.kernels.host_reads", "TritonNotInstalledError"),
]

#: loaded only through gpu.kernels.triton_access.kernel_module (they import triton at their top)
KERNEL_MODULES = {"cache_lookup", "cache_insert", "cache_probe",
                  "key_hash", "host_tier"}


@pytest.mark.parametrize(("module", "name"), OLD_HOMES)
def test_old_names_are_the_classes_of_gpu_errors(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_every_error_of_the_package_is_defined_in_gpu_errors() -> None:
    for info in pkgutil.walk_packages(gpu.__path__, "gpu."):
        if info.name.rsplit(".", 1)[-1] not in KERNEL_MODULES:
            importlib.import_module(info.name)
    seen, todo = set(), [errors.GPUError]
    while todo:
        cls = todo.pop()
        seen.add(cls)
        todo.extend(c for c in cls.__subclasses__() if c not in seen)
    ours = {c for c in seen if c.__module__.split(".")[0] == "gpu"}
    assert {c.__module__ for c in ours} == {"gpu.errors"}
    assert len(ours) >= 18


def test_argument_errors_are_value_errors_too() -> None:
    assert issubclass(errors.BadArgumentError, ValueError)
    assert issubclass(errors.ViewNotAvailableError, ValueError)
    assert issubclass(errors.KeyNotFoundError, KeyError)
