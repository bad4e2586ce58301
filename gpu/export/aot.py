"""The AOTInductor form of an export (``gpu.export.save(..., aot=True)``): the exported
program compiled into a package (``package.pt2``: a shared library and the model's
constants) that runs without the Python interpreter walking the graph.

A GPULayer's (and a HostLayer's on the CPU) lookup is compiled into the package: the model
is traced within :func:`gpu.traced_lookup.binding`, its tables and key-error flags passed as
inputs of the graph (:class:`Traced`), so a call runs those lookups from C++ with no
Python per lookup; the loading process passes the tables of the layers it built (the
package holds no rows). The other layers' lookups stay the :mod:`gpu.ops` custom ops: the
package calls them through its proxy executor (the dispatcher), so each is a call into
Python. Their id buffers must stay constants of the package, not values folded into its
kernels, so that :func:`bind` can point them at the layers built in the loading process:
the package is compiled with Inductor's constant inlining off (``CONSTANT_CONFIGS``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from gpu import ops, traced_lookup
from gpu.errors import ExportError, ShapeMismatchError
from gpu.layers import _NVBase

#: the package's file in an export directory
PACKAGE = "package.pt2"

#: keep every buffer a constant the loader can replace (no uniform-value folding, no
#: inlining of small constants): the id buffers are one-element tensors
CONSTANT_CONFIGS: dict[str, Any] = {"joint_graph_constant_folding": False,
                                    "always_keep_tensor_constants": True}


#: the prefix of the model's names in the traced wrapper (:class:`Traced`)
PREFIX = "model."


def inline_args(layer: _NVBase) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(table, flag)`` when ``layer``'s lookup compiles into a package as torch ops: a
    GPULayer (or HostLayer) whose table its device reads as a tensor (not quantized: the
    kernels that gather its rows dequantize them), keys checked on the device, sum or mean
    bags."""
    if getattr(layer, "mode", "sum") == "max":
        return None  # NOTE: a max bag's zero rows for bad keys are not torch's max
    args = getattr(layer._tiers, "inline_args", None)
    return args() if args is not None else None


class Traced(torch.nn.Module):
    """``model`` called with the tables and key-error flags of ``layers`` as leading inputs,
    returning its output and the flags' new values: what an AOTInductor export traces (the
    tables are inputs, never constants of the package)."""

    def __init__(self, model: torch.nn.Module, layers: list[_NVBase]) -> None:
        super().__init__()
        self.model = model
        self._ids = [id(layer) for layer in layers]

    def forward(self, tables: tuple[torch.Tensor, ...], flags: tuple[torch.Tensor, ...],
                *args: Any) -> Any:
        bound = [traced_lookup.Bound(t, f) for t, f in zip(tables, flags, strict=True)]
        with traced_lookup.binding(dict(zip(self._ids, bound, strict=True))):
            out = self.model(*args)
        return out, tuple(b.flag for b in bound)


def compile_package(program: torch.export.ExportedProgram, path: Path) -> None:
    """Compile ``program`` into the package ``path``."""
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs=dict(CONSTANT_CONFIGS))
    except Exception as e:  # noqa: BLE001 - the compiler's errors have no common root
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ExportError(f"AOTInductor could not compile the model ({type(e).__name__}: "
                          f"{first}): save with aot=False") from e


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
    """An AOTInductor package whose id buffers name the given layers of this process, and
    which reads the tables of ``inline`` (layer paths with the table strides the package
    was compiled for, in its input order); called as the exported model was. An op's error
    is raised as itself."""

    def __init__(self, path: Path, layers: dict[str, _NVBase], id_buffers: dict[str, str],
                 device: torch.device | None, inline: list[tuple[str, list[int]]]) -> None:
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
        self._inline = [layers[p] for p, _ in inline]
        self._on_cpu = any(layer.device.type == "cpu" for layer in self._inline)
        for (name, stride), layer in zip(inline, self._inline, strict=True):
            _check_inline(path, name, stride, layer)
        read = {p for p, _ in inline}
        for path_, layer in layers.items():
            fqn = id_buffers[path_]
            if path_ in read or fqn not in fqns:
                continue  # NOTE: read as an input, or never called (its op's output unused)
            # the layer's own buffer, not a copy: its id is read without a device sync
            constants[fqn] = layer.nvecache_id
        self.runner.load_constants(constants, check_full_update=False, user_managed=True)
        #: the package's output layout (read once: the runner's own call parses it per call)
        out_spec = pytree.treespec_loads(self.runner.loader.get_call_spec()[1])
        self._out_spec = out_spec.children_specs[0]

    def _run(self, tables: list[torch.Tensor], flags: list[torch.Tensor], args: tuple[Any, ...]
             ) -> tuple[Any, list[torch.Tensor]]:
        """The package on flat inputs: the model's output and the flags' new values."""
        leaves = list(args) if all(isinstance(a, torch.Tensor) for a in args) else [
            x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        with ops.typed_errors():
            flat = self.runner.loader.boxed_run([*tables, *flags, *leaves])
        cut = len(flat) - len(flags)
        return pytree.tree_unflatten(flat[:cut], self._out_spec), flat[cut:]

    def forward(self, *args: Any) -> Any:
        _raise_pending(self._inline)  # NOTE: a closed layer raises here too
        tables, flags = [], []
        with contextlib.ExitStack() as gates:
            for layer in self._inline:
                stack = layer._tiers
                table, flag = stack.inline_args()
                tables.append(table)
                flags.append(flag)
                gates.enter_context(stack._gate)
            out, reported = self._run(tables, flags, args)
        for flag, value in zip(flags, reported, strict=True):
            flag.copy_(value)  # NOTE: on CUDA a copy on the stream, no sync
        if self._on_cpu:
            _raise_pending(self._inline)  # NOTE: the CPU raises a bad key at once
        return out


def _check_inline(path: Path, name: str, stride: list[int], layer: _NVBase) -> None:
    """The package can pass ``layer``'s table as it was compiled to read it."""
    args = inline_args(layer)
    if args is None:
        raise ExportError(f"the AOTInductor package {path} reads the table of layer {name!r} "
                          "as an input, which the layer built here cannot pass (another "
                          "table kind, or validate=True on CUDA): save the model again")
    if list(args[0].stride()) != stride:
        raise ShapeMismatchError(f"the table of layer {name!r} is laid out with strides "
                                 f"{list(args[0].stride())}; the AOTInductor package {path} "
                                 f"was compiled for {stride}: export the model again over "
                                 "this table")


def _raise_pending(layers: list[_NVBase]) -> None:
    """Raise the first error the layers' earlier lookups reported; every layer's report is
    taken (one call of the package is one call of each layer)."""
    first: BaseException | None = None
    for layer in layers:
        try:
            layer._tiers.check_pending()
        except BaseException as e:  # noqa: BLE001 - the others' reports are taken too
            first = first or e
    if first is not None:
        raise first
