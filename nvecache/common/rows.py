"""How a row is stored: its dtype, its bytes, its padding, the dtypes every tier accepts.

One place for what every tier agrees on about a row, read everywhere:

- the plain dtype whitelist (:data:`DTYPES`: stored name -> bytes per element), each name's
  stable header code (the host tier's segments record it), its torch dtype and its numpy
  dtype;
- the quantized formats (:data:`QUANTIZED`), whose rows carry per-row parameters after
  their payload: ``int8`` (row-wise int8 with a float32 scale and bias) and
  ``float8_e4m3fn`` (fp8 with a float32 scale); :mod:`nvecache.common.quant` encodes and
  decodes them. A tier takes them only where it names them (``allowed=``), so one that
  cannot dequantize never reads quantized bytes as numbers;
- :class:`RowFormat` ``(dtype, dim)``: bytes per element, payload bytes, where the per-row
  parameters start (``meta_offset``: 4-byte aligned, after the payload) and how many bytes
  they take, the bytes a stored row takes, and its stride in an array of rows (rounded up
  to :data:`ROW_ALIGN`, so GPU kernels read every row with wide loads).

The module imports neither torch nor numpy: the command lines read the names and sizes
without them; :meth:`RowFormat.torch_dtype` and :func:`torch_dtype` import torch on their
first call, :func:`numpy_dtype` numpy.

Errors are :class:`RowFormatError` (a :class:`ValueError`); each package turns it into its
own argument error where a user passes a dtype.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "DTYPES", "FORMATS", "LAYER_DTYPES", "QUANTIZED", "ROW_ALIGN", "RowFormat",
    "RowFormatError", "align_up", "code_of", "dtype_name", "is_plain", "name_of_code",
    "numpy_dtype", "torch_dtype",
]

#: every stored row (payload and metadata) starts on a multiple of this many bytes in an
#: array of rows (a shared segment's row area): GPU kernels read rows with 16-byte loads
ROW_ALIGN = 16


class RowFormatError(ValueError):
    """A dtype no table stores, or a row geometry no table can hold. Each package raises its
    own argument error in its place where a user passes one."""


class _Spec(NamedTuple):
    #: bytes per element
    itemsize: int
    #: the host segments' header code; never reused, a new format takes the next one
    code: int
    #: bytes of per-row metadata stored after the payload (quantization parameters)
    meta_bytes: int
    #: numpy dtype of an element (bfloat16: its 16 bits, numpy has no bfloat16)
    numpy: str
    #: the element's dtype name in a safetensors file
    safetensors: str


_SPECS: dict[str, _Spec] = {
    "float32": _Spec(4, 1, 0, "<f4", "F32"),
    "float16": _Spec(2, 2, 0, "<f2", "F16"),
    "bfloat16": _Spec(2, 3, 0, "<i2", "BF16"),
    "float64": _Spec(8, 4, 0, "<f8", "F64"),
    # quantized: the payload, then float32 parameters (int8: scale, bias; fp8: scale)
    "int8": _Spec(1, 5, 8, "|i1", "I8"),
    "float8_e4m3fn": _Spec(1, 6, 4, "|u1", "F8_E4M3"),
}

#: the quantized formats: stored name -> bytes per payload element
QUANTIZED: dict[str, int] = {name: _SPECS[name].itemsize for name in ("int8", "float8_e4m3fn")}
#: the plain dtypes every stored table may have: stored name -> bytes per element
DTYPES: dict[str, int] = {name: spec.itemsize for name, spec in _SPECS.items()
                          if name not in QUANTIZED}
#: every stored format's name, plain then quantized (a tier that reads both names these)
FORMATS: tuple[str, ...] = (*DTYPES, *QUANTIZED)
#: the dtypes a layer computes in (its ``data_type``, a distributed GPU table, a pooled
#: output): the stored ones but float64, which the Triton kernels do not read
LAYER_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
_CODES = {spec.code: name for name, spec in _SPECS.items()}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp64": "float64", "double": "float64", "float": "float32",
            "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn", "e4m3": "float8_e4m3fn"}


def dtype_name(dtype: object, allowed: tuple[str, ...] | None = None) -> str:
    """The stored name of a dtype (``torch.float32``, ``"torch.float32"``, ``"fp32"`` ->
    ``"float32"``), if it is one of ``allowed`` (default: every plain name, those of
    :data:`DTYPES`; :data:`FORMATS` adds the quantized ones).

    Raises:
        RowFormatError: the dtype is none of them (the message lists them).
    """
    names = tuple(DTYPES) if allowed is None else allowed
    name = None
    tm = sys.modules.get("torch")  # NOTE: torch not loaded: no value can be a torch.dtype
    if tm is not None and isinstance(dtype, tm.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.").lower()
        name = _ALIASES.get(name, name)
    if name not in names:
        raise RowFormatError(
            f"unsupported dtype {dtype!r}: use one of {', '.join(names)} (a torch.dtype or "
            "its name)")
    return name


def is_plain(dtype: object) -> bool:
    """Whether ``dtype`` names a plain row dtype (one of :data:`DTYPES`: the float rows a
    quantized table's writes take)."""
    try:
        dtype_name(dtype)
    except RowFormatError:
        return False
    return True


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a stored name (a quantized format's: its payload's; imports
    torch)."""
    import torch

    dtype: torch.dtype = getattr(torch, dtype_name(name, FORMATS))
    return dtype


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds an element of a stored name's rows (bfloat16: its bits as
    little-endian int16, numpy having no bfloat16)."""
    import numpy as np

    return np.dtype(_SPECS[dtype_name(name, FORMATS)].numpy)


def safetensors_dtype(name: str) -> str:
    """The safetensors dtype name of the stored dtype ``name`` (``"float32"`` -> ``"F32"``)."""
    return _SPECS[dtype_name(name, FORMATS)].safetensors


def code_of(name: str) -> int:
    """The header code the host segments record for a stored name."""
    return _SPECS[dtype_name(name, FORMATS)].code


def name_of_code(code: int) -> str:
    """The stored name of a header code.

    Raises:
        RowFormatError: no format has that code.
    """
    try:
        return _CODES[code]
    except (KeyError, TypeError):
        raise RowFormatError(f"no row format has the code {code!r}") from None


def align_up(nbytes: int, align: int = ROW_ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return (nbytes + align - 1) // align * align


@dataclass(frozen=True)
class RowFormat:
    """How one table's rows are stored.

    ``dtype`` may be given as a torch dtype or any name :func:`dtype_name` reads (of
    :data:`FORMATS`); it is kept as the stored name. A row is ``row_bytes`` of payload
    (``dim`` elements), then, from ``meta_offset``, ``meta_bytes`` of its format's per-row
    parameters (little-endian float32; none for a plain dtype): ``stored_bytes`` in all, one
    value in a parameter server; an array of rows spaces them ``stride`` bytes apart.

    Raises:
        RowFormatError: an unsupported dtype, or a dim that is not an int in 1..2**20.
    """

    #: the stored dtype name, a key of :data:`DTYPES`
    dtype: str
    #: elements per row
    dim: int

    #: the largest dim a table may have
    MAX_DIM = 1 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype, FORMATS))
        dim = self.dim
        if isinstance(dim, bool) or not hasattr(dim, "__index__") \
                or not 0 < int(dim) <= self.MAX_DIM:
            raise RowFormatError(f"dim must be an int in 1..{self.MAX_DIM}; got {dim!r}")
        object.__setattr__(self, "dim", int(dim))

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _SPECS[self.dtype].itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of a row's payload (``dim * itemsize``)."""
        return self.dim * self.itemsize

    @property
    def meta_bytes(self) -> int:
        """Bytes of per-row parameters stored after the payload (0: none)."""
        return _SPECS[self.dtype].meta_bytes

    @property
    def quantized(self) -> bool:
        """Whether rows are stored quantized (:mod:`nvecache.common.quant` reads them)."""
        return self.dtype in QUANTIZED

    @property
    def meta_offset(self) -> int:
        """Byte offset of the per-row parameters in a stored row (the payload's end,
        rounded up to 4 bytes for the float32 parameters; the payload's end when none)."""
        return align_up(self.row_bytes, 4) if self.meta_bytes else self.row_bytes

    @property
    def stored_bytes(self) -> int:
        """Bytes of one stored row: payload and parameters."""
        return self.meta_offset + self.meta_bytes

    @property
    def stride(self) -> int:
        """Bytes from one row to the next in an array of rows (aligned to ROW_ALIGN)."""
        return align_up(self.stored_bytes)

    @property
    def code(self) -> int:
        """The header code of the dtype (host segments)."""
        return _SPECS[self.dtype].code

    @property
    def torch_dtype(self) -> torch.dtype:
        """The payload's torch dtype (imports torch)."""
        return torch_dtype(self.dtype)

    @property
    def numpy_dtype(self) -> np.dtype:
        """The payload's numpy dtype (:func:`numpy_dtype`; imports numpy)."""
        return numpy_dtype(self.dtype)
