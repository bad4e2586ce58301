"""The AOTInductor form of an export (``gpu.export.save(..., aot=True)``): the exported
program compiled into a package (``package.pt2``: a shared library and the model's
constants) that runs without the Python interpreter walking the graph.

The layers' lookups stay the :mod:`gpu.ops` custom ops: the package calls them through
its proxy executor (the dispatcher), so each lookup is a call into Python. The layers'
id buffers must stay constants of the package, not values folded into its kernels, so
that :func:`bind` can point them at the layers built in the loading process: the package
is compiled with Inductor's constant inlining off (``CONSTANT_CONFIGS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gpu import ops
from gpu.errors import ExportError
from gpu.layers import _NVBase

#: the package's file in an export directory
PACKAGE = "package.pt2"

#: keep every buffer a constant the loader can replace (no uniform-value folding, no
#: inlining of small constants): the id buffers are one-element tensors
CONSTANT_CONFIGS: dict[str, Any] = {"joint_graph_constant_folding": False,
                                    "always_keep_tensor_constants": True}


def compile_package(program: torch.export.ExportedProgram, path: Path,
                    id_buffers: list[str]) -> None:
    """Compile ``program`` into the package ``path``; check that every id buffer is one of
    its constants."""
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs=dict(CONSTANT_CONFIGS))
    except Exception as e:  # noqa: BLE001 - the compiler's errors have no common root
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ExportError(f"AOTInductor could not compile the model ({type(e).__name__}: "
                          f"{first}): save with aot=False") from e
    missing = sorted(set(id_buffers) - set(_open(path, -1).get_constant_fqns()))
    if missing:
        path.unlink(missing_ok=True)
        raise ExportError(f"the AOTInductor package folded the id buffers {missing} into "
                          "its code: save with aot=False")


def _open(path: Path, device_index: int) -> Any:
    if not path.is_file():
        raise ExportError(f"{path} is missing: the AOTInductor package of the export; save "
                          "the model again")
    try:
        return torch._inductor.aoti_load_package(str(path), device_index=device_index)
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or ["(no message)"])[0]
        raise ExportError(f"the AOTInductor package {path} cannot be loaded here "
                          f"({first}): save the model again on this node") from None


class Package(torch.nn.Module):
    """An AOTInductor package whose id buffers name the given layers of this process;
    called as the exported model was. An op's error is raised as itself."""

    def __init__(self, path: Path, layers: dict[str, _NVBase], id_buffers: dict[str, str],
                 device: torch.device | None) -> None:
        super().__init__()
        cuda = [d for d in ([device] if device is not None else
                            [layer.device for layer in layers.values()]) if d.type == "cuda"]
        index = cuda[0].index if cuda and cuda[0].index is not None else -1
        self.runner = _open(path, index)
        compiled = self.runner.get_metadata().get("AOTI_DEVICE_KEY")
        if device is not None and compiled is not None and compiled != device.type:
            raise ExportError(f"the AOTInductor package {path} was compiled for {compiled}, "
                              f"not {device.type}: save the model on {device.type} with "
                              "aot=True, or load with device=None")
        fqns = set(self.runner.get_constant_fqns())
        constants = {}
        for path_, layer in layers.items():
            fqn = id_buffers[path_]
            if fqn not in fqns:
                raise ExportError(f"the AOTInductor package {path} has no constant {fqn!r} "
                                  f"for layer {path_!r}")
            # the layer's own buffer, not a copy: its id is read without a device sync
            constants[fqn] = layer.nvecache_id
        self.runner.load_constants(constants, check_full_update=False, user_managed=True)

    def forward(self, *args: Any) -> Any:
        with ops.typed_errors():
            return self.runner(*args)
