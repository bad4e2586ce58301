"""Deployable models: :func:`save` writes a directory that :func:`load` turns back into a
callable module in another process.

The directory holds the ``torch.export`` program (``program.pt2``), ``metadata.json``
(every layer: type, geometry, dtype, device, tables by name, parameter-server URL and
table, GPU cache size, tuning; the format's version) and ``tables.safetensors``, the rows
of the tables private to the model (a GPULayer's own table). Shared tables are not
copied: :func:`load` attaches them by name on the node it runs on (a SharedMemBlock, a
host cache) or connects the parameter server's URL, so a loaded model shares the node's
tables with every other replica.

The program calls the layers through the ops of :mod:`gpu.ops`, which find their layer
through the layer's id buffer; :func:`load` builds the layers again and writes their ids
into the loaded program's buffers. With ``aot=True`` the directory holds an AOTInductor
package (``package.pt2``, :mod:`gpu.export.aot`) in place of the program; :func:`load`
points the package's id constants at the layers it built.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Self

import torch

from gpu import ops
from gpu.cuda.devices import resolve_device
from gpu.errors import (
    BadArgumentError,
    ExportError,
    FormatVersionError,
    MissingTableError,
    ShapeMismatchError,
)
from gpu.export import aot as aoti
from gpu.export import metadata as md
from gpu.layer_config import LayerType
from gpu.layers import NVEmbedding, NVEmbeddingBag, _NVBase
from gpu.stacks.closed import close_all
from hostcache import HostCache, SharedMemBlock
from hostcache.errors import SegmentNotFoundError
from nvecache.common.rows import RowFormat
from psclient import connect
from psclient.errors import TableNotFoundError

__all__ = ["ExportError", "FormatVersionError", "LoadedModel", "MissingTableError",
           "ShapeMismatchError", "load", "save"]

_CLASSES = {"NVEmbedding": NVEmbedding, "NVEmbeddingBag": NVEmbeddingBag}


def _dynamic_shapes(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every tensor argument's first dimension left to export (``Dim.AUTO``)."""
    auto = torch.export.Dim.AUTO
    return tuple({0: auto} if isinstance(a, torch.Tensor) and a.dim() > 0 else None
                 for a in args)


def save(model: torch.nn.Module, example_args: tuple[Any, ...], path: str | os.PathLike[str],
         *, aot: bool = False, dynamic: bool = True) -> Path:
    """Export ``model`` (called as ``model(*example_args)``) into the directory ``path``.

    Args:
        model: a module holding NVEmbedding / NVEmbeddingBag layers (open ones).
        example_args: positional arguments of one call.
        path: the directory to write (created; files of an earlier export are replaced).
        aot: write an AOTInductor package (``package.pt2``, compiled for the device of
            the example arguments) instead of the program. A GPULayer's lookup (a
            HostLayer's on the CPU; not max bags, not ``validate=True`` on CUDA, not a
            quantized table, which its kernels dequantize) is compiled into the package;
            the other layers' lookups stay calls into Python.
        dynamic: let every tensor argument's first dimension (the batch) vary.

    Returns:
        The directory.

    Raises:
        ExportError: a layer is closed or reads a table that cannot be exported (a
            DistMemBlock), or AOTInductor could not compile the model.
    """
    if not isinstance(example_args, tuple):
        raise BadArgumentError("example_args must be a tuple of the model's positional "
                               "arguments")
    entries, private, inline = [], {}, []
    for name, module in model.named_modules():
        if isinstance(module, _NVBase):
            entry, rows = md.describe(name, module)
            entries.append(entry)
            if rows is not None:
                private[entry["table"]["key"]] = rows.cpu().contiguous()
            args = aoti.inline_args(module) if aot else None
            if args is not None:
                entry["inline"] = {"index": len(inline), "stride": list(args[0].stride())}
                inline.append((module, args))
    shapes = _dynamic_shapes(example_args) if dynamic else None
    if aot:  # NOTE: the GPULayers' tables and flags lead the inputs (aoti.Traced)
        for entry in entries:
            entry["id_buffer"] = aoti.PREFIX + entry["id_buffer"]
        tables = tuple(a[0] for _, a in inline), tuple(a[1] for _, a in inline)
        program = torch.export.export(
            aoti.Traced(model, [m for m, _ in inline]), tables + example_args,
            dynamic_shapes=None if shapes is None else (
                (None,) * len(inline), (None,) * len(inline), shapes), strict=False)
    else:
        program = torch.export.export(model, example_args, dynamic_shapes=shapes)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    written, stale = (aoti.PACKAGE, md.PROGRAM) if aot else (md.PROGRAM, aoti.PACKAGE)
    if aot:
        aoti.compile_package(program, out / written)
    else:
        torch.export.save(program, out / written)
    (out / stale).unlink(missing_ok=True)
    tables = out / md.TABLES
    if private:
        from safetensors.torch import save_file
        save_file(private, str(tables))
    elif tables.exists():
        tables.unlink()
    meta = {"format": md.FORMAT, "version": md.version_of(entries), "torch": torch.__version__,
            "aot": aot, "program": None if aot else md.PROGRAM,
            "package": aoti.PACKAGE if aot else None, "layers": entries}
    (out / md.METADATA).write_text(json.dumps(meta, indent=1))
    return out


class LoadedModel(torch.nn.Module):
    """An exported model loaded by :func:`load`: call it as the model was called.

    ``layers`` maps each layer's path in the original model to the layer built again;
    ``close()`` (or leaving a ``with`` block) closes them and the tables attached for them.
    """

    def __init__(self, program: torch.nn.Module, layers: dict[str, _NVBase],
                 tables: list[Any]) -> None:
        super().__init__()
        self.program = program
        #: not submodules: the program holds the graph, these serve its ops
        self._layers = layers
        self._tables = tables

    @property
    def layers(self) -> dict[str, _NVBase]:
        return dict(self._layers)

    def forward(self, *args: Any) -> Any:
        return self.program(*args)

    def close(self) -> None:
        """Close the layers, then the tables attached for them; idempotent."""
        layers, self._layers = self._layers, {}
        tables, self._tables = self._tables, []
        close_all(list(layers.values()) + tables)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _geometry_check(what: str, rows: int | None, dim: int, dtype: torch.dtype,
                    entry: dict[str, Any]) -> None:
    want_dim, want_dtype = entry["embedding_size"], md.dtype_of(entry)
    want_rows = entry["num_embeddings"] if rows is not None else None
    if dim != want_dim or dtype != want_dtype or rows != want_rows:
        got = f"dim={dim}, dtype={dtype}" + (f", rows={rows}" if rows is not None else "")
        want = f"dim={want_dim}, dtype={want_dtype}" + (
            f", rows={want_rows}" if rows is not None else "")
        raise ShapeMismatchError(f"{what} has {got}; the exported layer "
                                 f"{entry['path']!r} was built over {want}")


def _read_meta(root: Path) -> dict[str, Any]:
    try:
        meta = json.loads((root / md.METADATA).read_text())
    except FileNotFoundError:
        raise ExportError(f"{root} holds no {md.METADATA}: not a gpu.export directory") \
            from None
    if meta.get("format") != md.FORMAT:
        raise ExportError(f"{root / md.METADATA} is not a gpu.export metadata file")
    version = meta.get("version")
    if not isinstance(version, int) or version > md.FORMAT_VERSION:
        raise FormatVersionError(f"{root} was written in format version {version}; this "
                                 f"library reads up to {md.FORMAT_VERSION}: upgrade nvecache")
    return meta


def _tables_file(root: Path, entries: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    if not any(e["table"]["kind"] == "private" for e in entries):
        return {}
    from safetensors.torch import load_file
    try:
        return load_file(str(root / md.TABLES))
    except FileNotFoundError:
        raise MissingTableError(f"{root / md.TABLES} is missing: the private tables of "
                                "the exported model") from None


def _layer_args(entry: dict[str, Any], private: dict[str, torch.Tensor],
                device: torch.device, opened: list[Any]) -> dict[str, Any]:
    """The keyword arguments that build the layer of ``entry`` again; tables it attaches
    are appended to ``opened``."""
    table = entry["table"]
    kw: dict[str, Any] = {"device": device, "validate": entry["validate"],
                          "tuning": md.tuning_of(entry.get("tuning")),
                          "gpu_cache_size": entry["gpu_cache_size"],
                          "insert_policy": md.policy_of(entry)}
    if "mode" in entry:
        kw.update(mode=entry["mode"], include_last_offset=entry["include_last_offset"])
    kind = table["kind"]
    if kind == "private":
        rows = private.get(table["key"])
        if rows is None:
            raise MissingTableError(f"private table {table['key']!r} is not in "
                                    f"{md.TABLES}")
        shape = tuple(rows.shape)
        stored = md.weight_dtype_of(entry)
        if stored is not None:  # NOTE: the table's stored bytes, as the layer's state_dict
            fmt = RowFormat(entry["weight_dtype"], entry["embedding_size"])
            if shape != (entry["num_embeddings"], fmt.stored_bytes) or rows.dtype != torch.uint8:
                raise ShapeMismatchError(
                    f"private table {table['key']!r} is {list(shape)} {rows.dtype}; the "
                    f"exported layer {entry['path']!r} stores its table {fmt.dtype}: "
                    f"[{entry['num_embeddings']}, {fmt.stored_bytes}] torch.uint8")
            kw["weight_dtype"] = stored
        else:
            _geometry_check(f"private table {table['key']!r}", shape[0] if len(shape) == 2
                            else -1, shape[-1], rows.dtype, entry)
        if entry["layer_type"] == LayerType.GPULayer.name:
            kw["weight_init"] = rows
        else:
            kw["storage"] = rows
    elif kind == "memblock":
        try:
            block = SharedMemBlock.attach(table["name"])
        except SegmentNotFoundError as e:
            raise MissingTableError(f"SharedMemBlock {table['name']!r} of layer "
                                    f"{entry['path']!r} cannot be attached: {e}") from None
        opened.append(block)
        # NOTE: a quantized block is read in any layer dtype (the layer takes its format)
        _geometry_check(f"SharedMemBlock {table['name']!r}", block.num_rows, block.dim,
                        md.dtype_of(entry) if block.quantized else block.dtype, entry)
        kw["storage"] = block
    else:
        kw.update(default_row=entry.get("default_row"))
        if table["host_cache"] is not None:
            try:
                hc = HostCache.attach(table["host_cache"])
            except SegmentNotFoundError as e:
                raise MissingTableError(f"host cache {table['host_cache']!r} of layer "
                                        f"{entry['path']!r} cannot be attached: {e}") from None
            opened.append(hc)
            g = hc.geometry
            _geometry_check(f"host cache {table['host_cache']!r}", None, g.dim,
                            md.dtype_of(entry) if hc.quantized else g.dtype, entry)
            kw["host_cache"] = hc
        if table["ps_url"] is not None:
            try:
                ps = connect(table["ps_url"], table=table["ps_table"])
            except TableNotFoundError as e:
                raise MissingTableError(f"parameter server table {table['ps_table']!r} of "
                                        f"layer {entry['path']!r}: {e}") from None
            opened.append(ps)
            _geometry_check(f"parameter server table {table['ps_table']!r}", None, ps.dim,
                            md.dtype_of(entry) if ps.quantized else ps.dtype, entry)
            kw["storage"] = ps
    return kw


def load(path: str | os.PathLike[str], *, device: object = None) -> LoadedModel:
    """Load an export directory written by :func:`save` (in any process of the node).

    Args:
        path: the directory.
        device: where to build the layers (default: the device each was exported on).

    Returns:
        A :class:`LoadedModel`: the program with its layers built again and bound.

    Raises:
        FormatVersionError: written by a newer format version.
        MissingTableError: a shared table (by name or URL) or the private tables' file is
            missing.
        ShapeMismatchError: a table's rows, dim or dtype are not the exported layer's.
        ExportError: not an export directory.
    Nothing stays open when it raises.
    """
    root = Path(path)
    meta = _read_meta(root)
    entries = meta["layers"]
    private = _tables_file(root, entries)
    opened: list[Any] = []
    layers: dict[str, _NVBase] = {}
    try:
        for entry in entries:
            dev = resolve_device(device if device is not None else entry["device"])
            kw = _layer_args(entry, private, dev, opened)
            cls = _CLASSES[entry["class"]]
            layers[entry["path"]] = cls(entry["num_embeddings"], entry["embedding_size"],
                                        md.dtype_of(entry), LayerType[entry["layer_type"]],
                                        **kw)
        if meta.get("package"):
            inline = sorted((e for e in entries if "inline" in e),
                            key=lambda e: e["inline"]["index"])
            program: torch.nn.Module = aoti.Package(
                root / meta["package"], layers, {e["path"]: e["id_buffer"] for e in entries},
                None if device is None else resolve_device(device),
                [(e["path"], e["inline"]["stride"]) for e in inline])
        else:
            program = _program(root / meta["program"], entries, layers)
    except BaseException:
        with contextlib.suppress(Exception):
            close_all(list(layers.values()) + opened)
        raise
    return LoadedModel(program, layers, opened)


def _program(file: Path, entries: list[dict[str, Any]], layers: dict[str, _NVBase]
             ) -> torch.nn.Module:
    """The torch.export program of ``file`` with its id buffers bound to ``layers``."""
    program = torch.export.load(file).module()
    for entry in entries:
        try:
            buf = program.get_buffer(entry["id_buffer"])
        except AttributeError:
            raise ExportError(f"the program {file} has no buffer {entry['id_buffer']!r} "
                              f"for layer {entry['path']!r}") from None
        ops.bind(buf, layers[entry["path"]]._op)
    return program
