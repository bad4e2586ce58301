"""Bulk loading: a tensor, a ``.npy`` / ``.safetensors`` / raw binary file, a DCP checkpoint
directory, or an iterator.

Sources are opened without reading their rows (files are memory-mapped) and read chunk by
chunk. A raw binary file is rows of the table's ``dim`` and dtype (a quantized table's:
float32) back to back, in the machine's (little-endian) byte order, with no header: its
size must be a whole number of rows. Keys default to ``0..N-1``, or to the ``keys`` tensor
of a ``.safetensors`` file that holds one beside its rows (as ``psclient dump`` writes
them); a keys source (a tensor, an int ``.npy``, a ``.safetensors`` file's ``keys`` or a
raw file of little-endian int64) gives one key per row instead. A
``torch.distributed.checkpoint`` directory gives the 2-D tensor named by its fully
qualified name (``tensor="emb.weight"``), or its only 2-D tensor, read piece by piece
(:mod:`psclient.dcp_source`).

A file is read as the format it is given (or its suffix names) only if its first bytes say
it is one: an ``.npz`` archive, a torch ``.pt`` file or anything else is refused with a line
that says what the file is and what is read. A load refuses, before its first insert, keys
given to more than one row (unless ``duplicates="last"``), the reserved key ``INT64_MIN``,
and rows holding NaN or infinite values (unless ``allow_nonfinite``; a quantized table
refuses them always); :mod:`psclient.load_checks` holds those checks, and
:mod:`psclient.load_fit` whether the rows fit the table: a quantized table quantizes float
rows as they are inserted, or takes its own stored bytes (a dump of it) as they are.

Messages name the arguments the way the caller spells them: ``tensor=NAME`` for the Python
API, ``--tensor NAME`` for the ``psclient`` command (``cli=True``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from nvecache.common.rows import QUANTIZED, RowFormat, RowFormatError
from psclient.codec import check_keys
from psclient.dcp_source import open_dcp
from psclient.errors import BadArgumentError, BadKeysError, BadValuesError
from psclient.load_checks import StreamCensus, census, check_duplicates_arg, not_a, sniff
from psclient.load_fit import check_finite_rows, check_rows, stored_bytes, stored_chunk

if TYPE_CHECKING:  # NOTE: for annotations only: base imports this module
    from psclient.base import ParameterServer

log = logging.getLogger(__name__)

#: file formats :func:`open_rows` reads; ``None`` picks one by the file's suffix
FileFormat = Literal["npy", "safetensors", "raw", "dcp"]
FORMATS: tuple[str, ...] = ("npy", "safetensors", "raw", "dcp")
#: the tensor of a ``.safetensors`` file that holds its rows' keys (as ``psclient dump``
#: writes them)
KEYS_TENSOR = "keys"
#: suffixes read as raw binary rows when no format is given
RAW_SUFFIXES = (".bin", ".raw")

_Get = Callable[[int, int], torch.Tensor]


def _arg(cli: bool, api: str, flag: str) -> str:
    return flag if cli else api


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RowSource:
    """Random access to the rows of a 2-D source, sliced chunk by chunk."""

    def __init__(self, n: int, dim: int, dtype: torch.dtype, get: _Get, what: str,
                 stored: RowFormat | None = None) -> None:
        #: rows, elements per row, row dtype
        self.n, self.dim, self.dtype = n, dim, dtype
        #: ``get(a, b)``: rows ``a..b-1`` as a contiguous CPU tensor
        self.get = get
        #: how messages name the source
        self.what = what
        #: the quantized format whose stored bytes the rows are, where the file says so (a
        #: ``.safetensors`` dump of a quantized table: uint8 rows, psclient.load_fit)
        self.stored = stored


class KeySource:
    """Random access to the int64 keys of a load, one per row."""

    def __init__(self, n: int, get: _Get, distinct: int) -> None:
        self.n, self.get = n, get
        #: how many distinct keys there are (``n`` less the repeats)
        self.distinct = distinct


class Loaded(int):
    """What a load did: the rows it read (the ``int`` itself), :attr:`distinct`: the distinct
    keys it stored, and :attr:`duplicates`: the rows that repeated an earlier row's key (the
    last row of a key is the one stored)."""

    distinct: int
    duplicates: int

    def __new__(cls, rows: int, distinct: int) -> Loaded:
        self = super().__new__(cls, rows)
        self.distinct, self.duplicates = distinct, rows - distinct
        return self


def _torch_dtype(np_dtype: np.dtype, what: str) -> torch.dtype:
    try:
        return torch.from_numpy(np.empty(0, dtype=np_dtype.newbyteorder("="))).dtype
    except TypeError as e:
        raise BadValuesError(f"{what} holds {np_dtype} values, which torch cannot read") from e


def _file(source: str | Path) -> Path:
    path = Path(source)
    if not path.is_file():
        raise BadArgumentError(f"no such file: {str(path)!r}")
    return path


def file_format(path: str | Path, fmt: str | None, *, cli: bool = False) -> str:
    """The format of a rows file: ``fmt`` if given, else by suffix (``.npy``,
    ``.safetensors``; ``.bin``/``.raw`` are raw rows); a directory is a DCP checkpoint.

    Raises:
        BadArgumentError: an unknown format, or a suffix that names none.
    """
    if fmt is not None:
        if fmt not in FORMATS:
            raise BadArgumentError(f"unknown file format {fmt!r}: use one of {', '.join(FORMATS)}")
        return fmt
    if Path(path).is_dir():
        return "dcp"
    suffix = Path(path).suffix.lower()
    if suffix in (".npy", ".safetensors"):
        return suffix[1:]
    if suffix in RAW_SUFFIXES:
        return "raw"
    found = sniff(Path(path)) if Path(path).is_file() else None
    if found in ("zip", "pickle"):  # NOTE: an .npz or a torch .pt: say so, not "no format"
        raise not_a(Path(path), "npy", found, cli=cli)
    raise BadArgumentError(
        f"cannot tell the format of {str(path)!r}: use a .npy, .safetensors, .bin or .raw file, "
        f"or say it with {_arg(cli, 'format=', '--format')} (npy, safetensors or raw)"
    )


def open_rows(source: object, tensor: str | None = None, *, format: str | None = None,  # noqa: A002
              dim: int | None = None, dtype: torch.dtype | None = None,
              cli: bool = False) -> RowSource:
    """Open a tensor, array or rows file without reading its rows.

    Args:
        source: a ``[N, dim]`` tensor or array, or a path.
        tensor: the tensor's name inside a ``.safetensors`` file, or its fully qualified
            name in a DCP checkpoint.
        format: ``npy``, ``safetensors``, ``raw`` or ``dcp``; default: by the file's suffix
            (a directory: ``dcp``).
        dim, dtype: the geometry of a raw file's rows (required for raw files).
        cli: name arguments as the ``psclient`` command's flags in messages.

    Raises:
        BadArgumentError: no such file, unknown format, unreadable file.
        BadValuesError: the source is not 2-D, or a raw file is not whole rows.
    """
    if isinstance(source, np.ndarray):
        source = torch.from_numpy(source)
    if isinstance(source, torch.Tensor):
        t = source
        if t.dim() != 2:
            raise BadValuesError(f"source tensor must be [N, dim], got {list(t.shape)}")
        return RowSource(t.shape[0], t.shape[1], t.dtype, lambda a, b: t[a:b].cpu().contiguous(),
                         "the source tensor")
    if isinstance(source, (str, Path)):
        if format == "dcp" or (format is None and Path(source).is_dir()):
            n, width, dt, get, what = open_dcp(source, tensor, cli=cli)
            return RowSource(n, width, dt, get, what)
        path = _file(source)
        fmt = file_format(path, format, cli=cli)
        found = sniff(path)
        if fmt == "npy":
            return _open_npy(path, found, cli)
        if fmt == "safetensors":
            if found != "safetensors":
                raise not_a(path, fmt, found, cli=cli)
            return _open_safetensors(path, tensor, cli)
        if found in ("npy", "zip", "safetensors"):  # NOTE: raw rows may start like a pickle
            raise not_a(path, "raw", found, cli=cli)
        if dim is None or dtype is None:
            raise BadArgumentError(
                f"{str(path)!r} is raw rows: say their geometry with "
                f"{_arg(cli, 'the table (dim=, dtype=)', '--dim and --dtype')}"
            )
        return _open_raw(path, dim, dtype)
    raise BadArgumentError(f"unsupported load source of type {type(source).__name__}")


def _load_npy(path: Path, found: str | None, what: str, cli: bool) -> np.ndarray:
    """A ``.npy`` file memory-mapped, or why it cannot be (never numpy's pickle advice)."""
    if found != "npy":
        raise not_a(path, "npy", found, what=what, cli=cli)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        if "allow_pickle" in str(e) or "Python objects" in str(e):  # NOTE: an object array
            raise BadArgumentError(
                f"{what} holds Python objects, not numbers: save a numeric array (e.g. "
                "numpy.save(path, rows.astype('float32'))) and load that file") from None
        raise BadArgumentError(f"{what} is a damaged .npy file ({e}): write it again") from e
    return arr


def _open_npy(path: Path, found: str | None, cli: bool) -> RowSource:
    arr = _load_npy(path, found, repr(str(path)), cli)
    if arr.ndim != 2:
        raise BadValuesError(f"{str(path)!r} holds shape {list(arr.shape)}, need [N, dim]")
    dt = _torch_dtype(arr.dtype, repr(str(path)))
    native = arr.dtype.newbyteorder("=")
    return RowSource(arr.shape[0], arr.shape[1], dt,
                     lambda a, b: torch.from_numpy(np.array(arr[a:b], dtype=native)),
                     repr(str(path)))


def _open_raw(path: Path, dim: int, dtype: torch.dtype) -> RowSource:
    row_bytes = dim * dtype.itemsize
    size = path.stat().st_size
    if size % row_bytes:
        raise BadValuesError(
            f"{str(path)!r} is {size} bytes, not a whole number of rows of {dim} x {_name(dtype)} "
            f"({row_bytes} bytes each): check the file and the row geometry"
        )
    n = size // row_bytes
    if n == 0:
        return RowSource(0, dim, dtype, lambda a, b: torch.empty(0, dim, dtype=dtype),
                         repr(str(path)))
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=(n, row_bytes))
    return RowSource(n, dim, dtype,
                     lambda a, b: torch.from_numpy(np.array(mm[a:b])).view(dtype),
                     repr(str(path)))


def _open_safetensors(path: Path, tensor: str | None, cli: bool) -> RowSource:
    try:
        f = safe_open(str(path), framework="pt")  # NOTE: memory-maps; slices read lazily
    except (SafetensorError, OSError) as e:
        raise BadArgumentError(f"{str(path)!r} is not a .safetensors file: {e}") from e
    names = list(f.keys())
    if tensor is None:
        rows = [n for n in names if n != KEYS_TENSOR]
        if len(rows) == 1 and len(names) == 2:  # NOTE: rows and their keys: the rows
            names = rows
        if len(names) != 1:
            raise BadArgumentError(
                f"{str(path)!r} holds tensors {names}: name one with "
                f"{_arg(cli, 'tensor=NAME', '--tensor NAME')}"
            )
        tensor = names[0]
    if tensor not in f.keys():
        raise BadArgumentError(f"{str(path)!r} has no tensor {tensor!r}; it holds "
                               f"{list(f.keys())}")
    sl = f.get_slice(tensor)
    shape = sl.get_shape()
    if len(shape) != 2:
        raise BadValuesError(f"tensor {tensor!r} in {str(path)!r} is {shape}, need [N, dim]")
    dt = f.get_slice(tensor)[0:0].dtype
    return RowSource(shape[0], shape[1], dt, lambda a, b: sl[a:b].contiguous(),
                     f"tensor {tensor!r} of {str(path)!r}",
                     _stored_format(f.metadata() or {}, dt, shape[1]))


def _stored_format(meta: dict[str, str], dtype: torch.dtype, width: int) -> RowFormat | None:
    """The quantized format a ``.safetensors`` file's metadata names for its uint8 rows
    (``dtype`` and ``dim``, as ``psclient dump`` writes them), when its rows are that
    format's stored bytes; else None."""
    if dtype != torch.uint8 or meta.get("dtype") not in QUANTIZED:
        return None
    try:
        fmt = RowFormat(meta["dtype"], int(meta.get("dim", "")))
    except (ValueError, RowFormatError):
        return None
    return fmt if fmt.stored_bytes == width else None


def _safetensors_keys(path: Path, what: str) -> np.ndarray:
    """The ``keys`` tensor of a ``.safetensors`` file, read whole (8 bytes a row)."""
    try:
        with safe_open(str(path), framework="np") as f:
            if KEYS_TENSOR not in f.keys():
                raise BadKeysError(f"{what} has no {KEYS_TENSOR!r} tensor; it holds "
                                   f"{list(f.keys())}")
            return np.asarray(f.get_tensor(KEYS_TENSOR))
    except (SafetensorError, OSError) as e:
        raise BadKeysError(f"{what} cannot be read: {e}") from e


def file_keys(source: object, keys: object, fmt: str | None, tensor: str | None = None
              ) -> object:
    """The keys of a load: ``keys`` if given, else the source itself where it is a
    ``.safetensors`` file that holds a ``keys`` tensor beside the rows read (``tensor``),
    else None (row ``i`` gets key ``i``)."""
    if keys is not None or not isinstance(source, (str, Path)):
        return keys
    path = Path(source)
    if (tensor == KEYS_TENSOR or not path.is_file() or sniff(path) != "safetensors"
            or fmt not in (None, "safetensors")):
        return None
    try:
        with safe_open(str(path), framework="np") as f:
            return source if KEYS_TENSOR in f.keys() else None
    except (SafetensorError, OSError):
        return None


def open_keys(source: object, n: int, *, cli: bool = False,
              duplicates: str = "refuse") -> KeySource:
    """Open the keys of ``n`` rows: a tensor or array, an integer ``.npy`` file, or a raw file
    of little-endian int64; every key is read once (sorted in a copy) to count them.

    Raises:
        BadKeysError: not 1-D integers, not exactly ``n`` of them, or the reserved
            ``INT64_MIN`` among them.
        DuplicateKeysError: keys repeat and ``duplicates`` is ``"refuse"``.
        BadArgumentError: no such file, or a file that is not what its name says.
    """
    check_duplicates_arg(duplicates)
    what = "keys"
    arr: Any
    if isinstance(source, torch.Tensor):
        source = source.detach().cpu().numpy()
    if isinstance(source, (str, Path)):
        path = _file(source)
        what = f"keys file {str(path)!r}"
        found = sniff(path)
        if found == "safetensors":
            arr = _safetensors_keys(path, what)
        elif path.suffix.lower() == ".npy":
            arr = _load_npy(path, found, what, cli)
        elif found in ("npy", "zip"):
            raise not_a(path, "raw", found, what=what, cli=cli)
        else:
            size = path.stat().st_size
            if size % 8:
                raise BadKeysError(f"{what} is {size} bytes, not a whole number of int64 keys "
                                   "(8 bytes each, little-endian)")
            arr = (np.memmap(path, dtype="<i8", mode="r") if size
                   else np.empty(0, dtype="<i8"))
    elif isinstance(source, np.ndarray):
        arr = source
    else:
        raise BadKeysError(f"keys must be an int64 tensor, an array or a file of keys; got "
                           f"{type(source).__name__}")
    if (arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer)
            or not np.can_cast(arr.dtype, np.int64, casting="safe")):
        raise BadKeysError(f"{what} must be 1-D int64 (or a narrower integer type); got "
                           f"{arr.dtype} of shape {list(arr.shape)}")
    if arr.shape[0] != n:
        raise BadKeysError(f"{what} holds {arr.shape[0]} keys for {n} rows: give one key per row"
                           + ("" if cli else " (keys=)"))
    distinct = census(arr, duplicates=duplicates, what=what, cli=cli)
    return KeySource(n, lambda a, b: torch.from_numpy(np.array(arr[a:b], dtype=np.int64)),
                     distinct)


def _chunks(ps: ParameterServer, source: object, keys: object, tensor: str | None,
            fmt: str | None, convert: bool, batch_size: int, duplicates: str,
            allow_nonfinite: bool
            ) -> tuple[int | None, Iterator[tuple[Any, Any]], Callable[[], int], bool]:
    """(rows or None for an iterator, the chunks to insert, the distinct keys inserted once
    the chunks are spent, whether the chunks are a quantized table's stored bytes, to
    insert as they are); a file's or tensor's keys and rows are checked before."""
    schema = ps.schema
    if isinstance(source, (torch.Tensor, np.ndarray, str, Path)):
        # NOTE: a raw file's rows are what the table's writes take: float32 if quantized
        rows = open_rows(source, tensor, format=fmt, dim=ps.dim, dtype=schema.value_dtype)
        check_rows(rows, ps.dim, ps.dtype, table=ps.table, convert=convert)
        keys = file_keys(source, keys, fmt, tensor)
        ks = None if keys is None else open_keys(keys, rows.n, duplicates=duplicates)
        if not allow_nonfinite or schema.quantized:  # NOTE: quantized: never stored
            check_finite_rows(rows, ps.dtype, ks, batch_size=batch_size, dim=ps.dim)
        cast = stored_chunk(rows, schema.row_format)

        def gen() -> Iterator[tuple[Any, Any]]:
            for a in range(0, rows.n, batch_size):
                b = min(rows.n, a + batch_size)
                k = torch.arange(a, b, dtype=torch.int64) if ks is None else ks.get(a, b)
                yield k, cast(rows.get(a, b))

        return (rows.n, gen(), lambda: rows.n if ks is None else ks.distinct,
                stored_bytes(rows, schema.row_format))
    if isinstance(source, Iterable):
        if keys is not None:
            raise BadArgumentError("keys= is not used with an iterator: yield (keys, values)")
        seen = StreamCensus(duplicates)

        def split() -> Iterator[tuple[Any, Any]]:
            for item in source:
                try:
                    k, v = item
                except (TypeError, ValueError) as e:
                    raise BadArgumentError("an iterator source must yield (keys, values)") from e
                if convert and isinstance(v, torch.Tensor):
                    v = v.to(schema.value_dtype)
                for a in range(0, len(k), batch_size):
                    ck = k[a:a + batch_size]
                    seen.add(check_keys(ck))  # NOTE: before the chunk is written
                    yield ck, v[a:a + batch_size]

        return None, split(), lambda: seen.distinct, False
    raise BadArgumentError(f"unsupported load source of type {type(source).__name__}")


def load_into(ps: ParameterServer, source: object, *, keys: object, tensor: str | None,
              format: str | None, convert: bool, batch_size: int,  # noqa: A002
              progress: bool | None, duplicates: str = "refuse",
              allow_nonfinite: bool = False) -> Loaded:
    """Insert every row of ``source`` into ``ps``; see :meth:`ParameterServer.load`."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
        raise BadArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    check_duplicates_arg(duplicates)
    total, chunks, distinct, verbatim = _chunks(ps, source, keys, tensor, format, convert,
                                                batch_size, duplicates, allow_nonfinite)
    # NOTE: a file's or tensor's rows were read and checked above; an iterator's are checked
    # by each insert
    checked = allow_nonfinite or total is not None
    loaded = 0
    if total:
        ps._reserve(total)
    # NOTE: progress=None: a bar only where stderr is a terminal (tqdm's disable=None)
    with tqdm(total=total, unit="rows", unit_scale=True, desc=f"load {ps.table}",
              disable=None if progress is None else not progress) as bar:
        for k, v in chunks:
            if verbatim:
                ps._insert_stored(k, v)
            else:
                ps.insert(k, v, allow_nonfinite=checked)
            loaded += len(k)
            bar.update(len(k))
    log.info("loaded %d rows into table %r", loaded, ps.table)
    return Loaded(loaded, distinct())
