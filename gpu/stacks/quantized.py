"""Linear tables stored quantized (int8, float8_e4m3fn: :mod:`nvecache.common.quant`) under
the GPULayer, HostLayer and LinearUVM stacks: which format a table has, a GPULayer's own
quantized table (``weight_dtype=``), its writes, and the rows the torch paths read.

A quantized table is handed to the kernels as its stored bytes, uint8 ``[num_rows,
stored_bytes]`` with a row stride of ``fmt.stride`` bytes (what a quantized
``SharedMemBlock``'s ``tensor`` is), and read dequantized in the layer's dtype in the same
load (:mod:`gpu.kernels.stored_rows`). The torch paths (the CPU, max bags) decode only the
rows a call reads (:func:`decoded`): no float copy of the table exists anywhere.

Writes encode on the table's device, under the table's gate (as
:func:`gpu.stacks.linear_tables.write_tensor` writes a plain table): an update stores
``quant.encode(rows)`` (or stored bytes given as they are, a checkpoint's), an accumulate
decodes the rows, adds the deltas in float32 and encodes the sums with stochastic rounding
(``quant.encode_sum``, the accumulate rule of every quantized table), so repeated deltas
under half a step add up in expectation instead of rounding away. Rows holding NaN or an
infinity cannot be stored (their range is their scale):
:class:`~gpu.errors.NonFiniteValuesError`, nothing written.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.cache.twin import last_occurrence
from gpu.errors import BadArgumentError, NonFiniteValuesError
from gpu.kernels.triton_access import kernel_module, triton_available
from hostcache.gate import TableGate
from hostcache.row_versions import is_versioned, read_rows, versions_in, wait_of
from nvecache.common import quant, rows
from nvecache.common.accumulate import sum_duplicates
from nvecache.common.finite import nonfinite_message, nonfinite_rows

#: bytes of float rows encoded at once while a table is initialized
CHUNK_BYTES = 64 << 20


def block_format(block: Any) -> rows.RowFormat | None:
    """A linear block's quantized format as its readers are told it (``SharedMemBlock``:
    its ``read_format``, rows read under their seqlock versions; ``DistMemBlock``: its
    ``row_format``), None for a plain one."""
    if not getattr(block, "quantized", False):
        return None
    return getattr(block, "read_format", block.row_format)


def weight_format(weight_dtype: object, data_type: torch.dtype, dim: int
                  ) -> rows.RowFormat | None:
    """The format ``weight_dtype=`` asks a GPULayer's own table to be stored in: None for
    None or ``data_type`` itself (rows stored as they are computed), else a quantized one.

    Raises:
        BadArgumentError: anything else (another plain dtype: the layer computes in its
            ``data_type``, and stores its own table in it or quantized).
    """
    if weight_dtype is None or weight_dtype == data_type:
        return None
    quantized = ", ".join(f"torch.{name}" for name in rows.QUANTIZED)
    is_dtype = isinstance(weight_dtype, torch.dtype)
    name = str(weight_dtype).removeprefix("torch.")
    if is_dtype and name in rows.QUANTIZED:
        return rows.RowFormat(name, dim)
    plain = is_dtype and rows.is_plain(weight_dtype)
    hint = (f"; to store {weight_dtype} rows, build the layer with data_type={weight_dtype}"
            if plain else "")
    raise BadArgumentError(
        f"weight_dtype must be None or data_type ({data_type}: rows stored as the layer "
        f"computes them), or a quantized format ({quantized}: rows stored with their "
        f"per-row scale, read dequantized in data_type); got {weight_dtype!r}{hint}")


def no_weight_format(layer_type: str) -> BadArgumentError:
    """The error of ``weight_dtype=`` where the layer has no table of its own to store."""
    where = {"Hierarchical": "a quantized parameter server (psclient.connect(..., "
                             "dtype=torch.int8))",
             "HostLayer": "a quantized SharedMemBlock (SharedMemBlock.create(..., "
                          "dtype=torch.int8))"}.get(
        layer_type, "a quantized SharedMemBlock (SharedMemBlock.create(..., "
                    "dtype=torch.int8)) or DistMemBlock")
    return BadArgumentError(
        f"weight_dtype is the format of a GPULayer's own table; a {layer_type} layer reads "
        f"its storage in the storage's own format: give it {where} and drop weight_dtype")


def decoded(table: torch.Tensor, keys: torch.Tensor, fmt: rows.RowFormat,
            dtype: torch.dtype) -> torch.Tensor:
    """Rows ``keys`` (in range) of a quantized table's stored bytes, dequantized in
    ``dtype``, on ``keys``' device: only those rows are decoded. A versioned format's
    rows are read under their versions (:mod:`hostcache.row_versions`): on CUDA by the
    gather kernel (no host sync), on the CPU by torch."""
    idx = keys.to(table.device)
    if not is_versioned(fmt):
        return quant.decode(table.index_select(0, idx), fmt, dtype).to(keys.device)
    if table.is_cuda and triton_available():
        gather = kernel_module("gather", interpret=False).gather
        return gather(idx, table, None, host_table=True, fmt=fmt,
                      out_dtype=dtype).to(keys.device)
    stored = read_rows(table, idx, versions_in(table, fmt.stored_bytes), wait_of(fmt))
    return quant.decode(stored, fmt, dtype).to(keys.device)


def _finite(values: torch.Tensor, keys: torch.Tensor | None, what: str) -> None:
    bad = nonfinite_rows(values)
    if bad is not None:
        raise NonFiniteValuesError(
            nonfinite_message(bad, keys, what=what).split("; nothing was written")[0]
            + "; nothing was written: a quantized table stores finite rows only (a row's "
              "range is its scale), fix those rows")


def stored_bytes(values: torch.Tensor, fmt: rows.RowFormat, keys: torch.Tensor | None = None,
                 ) -> torch.Tensor:
    """What a quantized table stores of ``values``: float rows ``[N, dim]`` encoded (on
    their device), or uint8 stored bytes ``[N, stored_bytes]`` (a checkpoint's, a
    table's ``state_dict``) as they are once they decode to finite rows.

    Raises:
        BadArgumentError: neither of those shapes and dtypes.
        NonFiniteValuesError: a row holds (or decodes to) NaN or an infinity.
    """
    if values.dtype == torch.uint8:
        if values.dim() != 2 or values.shape[1] != fmt.stored_bytes:
            raise BadArgumentError(
                f"stored rows of a {fmt.dtype} table must be uint8 [N, {fmt.stored_bytes}] "
                f"(its state_dict's); got {tuple(values.shape)}")
        _finite(quant.decode(values, fmt), keys, "stored rows")
        return values
    if values.dim() != 2 or values.shape[1] != fmt.dim or not rows.is_plain(values.dtype):
        raise BadArgumentError(
            f"rows for a {fmt.dtype} table must be float [N, {fmt.dim}] (quantized when "
            f"written) or its stored bytes, uint8 [N, {fmt.stored_bytes}]; got "
            f"{values.dtype} {tuple(values.shape)}")
    _finite(values, keys, "values")
    return quant.encode(values, fmt)


def own_table(num_rows: int, fmt: rows.RowFormat, device: torch.device,
              init: torch.Tensor | None) -> torch.Tensor:
    """A GPULayer's own quantized table on ``device``: the stored bytes ``[num_rows,
    stored_bytes]`` (a view of ``[num_rows, stride]`` uint8, so that every row, and its
    float32 parameters, start on a 16-byte boundary), of ``init`` (float rows, or stored
    bytes as they are) or of random rows (``N(0, 1)``, as a plain table's), encoded a
    chunk at a time: no float copy of the whole table is made.

    Raises:
        BadArgumentError / NonFiniteValuesError: ``init`` is not such rows (see
            :func:`stored_bytes`); nothing is built.
    """
    if init is not None and (init.dim() != 2 or init.shape[0] != num_rows):
        raise BadArgumentError(f"weight_init must have {num_rows} rows; got shape "
                               f"{tuple(init.shape)}")
    full = torch.zeros(num_rows, fmt.stride, dtype=torch.uint8, device=device)
    table = full[:, :fmt.stored_bytes]
    step = max(1, CHUNK_BYTES // (4 * fmt.dim))
    for start in range(0, num_rows, step):
        stop = min(num_rows, start + step)
        if init is None:
            part = torch.randn(stop - start, fmt.dim, device=device)
        else:
            part = init[start:stop].detach().to(device)
        table[start:stop] = stored_bytes(part, fmt, torch.arange(start, stop))
    return table


def write_stored(gate: TableGate, table: torch.Tensor, fmt: rows.RowFormat,
                 keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write rows (float, or stored bytes) of a layer's own quantized table through its
    gate, encoded on the table's device; of duplicate keys the last occurrence is written
    (a whole row: its payload with its own parameters). On CUDA the rows are in place
    when this returns."""
    dev = table.device
    keys = keys.to(dev)
    stored = stored_bytes(values.to(dev), fmt, keys)
    ukeys, last, _ = last_occurrence(keys)
    stored = stored.index_select(0, last)
    with gate.writing():
        table[ukeys] = stored
        if table.is_cuda:
            torch.cuda.current_stream(dev).synchronize()


def add_stored(gate: TableGate, table: torch.Tensor, fmt: rows.RowFormat,
               keys: torch.Tensor, deltas: torch.Tensor) -> None:
    """Add ``deltas`` to rows of a layer's own quantized table through its gate: duplicate
    keys summed in float32, each distinct row decoded, added to in float32 and encoded
    with stochastic rounding (unbiased: small deltas add up over many calls). On CUDA the
    rows are in place when this returns.

    Raises:
        NonFiniteValuesError: a sum is not finite (an overflow); nothing is written.
    """
    dev = table.device
    ukeys, sums, _ = sum_duplicates(keys.to(dev), deltas.to(dev), torch.float32)
    with gate.writing():
        new = quant.decode(table.index_select(0, ukeys), fmt) + sums
        _finite(new, ukeys, "sums")
        table[ukeys] = quant.encode_sum(new, fmt)
        if table.is_cuda:
            torch.cuda.current_stream(dev).synchronize()
