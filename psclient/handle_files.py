"""What a parameter-server handle reads from and writes to files, mixed into
:class:`psclient.ParameterServer` (the work is :mod:`psclient.loader`'s and
:mod:`psclient.dump`'s)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import numpy as np
    import torch

    from psclient.base import ParameterServer
    from psclient.loader import Loaded


class HandleFiles:
    """:meth:`load`: rows from a tensor, a file or an iterator into the table;
    :meth:`dump`: a table's keys and rows to a file."""

    def load(
        self,
        source: torch.Tensor | np.ndarray | str | Path | Iterable[tuple[torch.Tensor, Any]],
        *,
        keys: torch.Tensor | np.ndarray | str | Path | None = None,
        tensor: str | None = None,
        format: str | None = None,  # noqa: A002 -- the file format, as in numpy/pandas
        convert: bool = False,
        batch_size: int = 65536,
        progress: bool | None = None,
        duplicates: str = "refuse",
        allow_nonfinite: bool = False,
    ) -> Loaded:
        """Bulk-insert rows from a tensor, a ``.npy`` / ``.safetensors`` / raw file or an iterator.

        Args:
            source: a ``[N, dim]`` tensor or array, a path to a ``.npy``, ``.safetensors`` or
                raw binary file (rows of the table's dim and dtype back to back, little-endian,
                no header; ``.bin``/``.raw``, or any name with ``format="raw"``), or an
                iterable of ``(keys, values)`` chunks.
            keys: one int64 key per row, default ``0..N-1`` (not for iterators): a tensor or
                array, a ``.npy`` file of integers, or a raw file of little-endian int64.
            tensor: the tensor's name inside a ``.safetensors`` file (optional if it holds
                exactly one tensor).
            format: ``"npy"``, ``"safetensors"``, ``"raw"`` or ``"dcp"``; default: by the
                suffix (a directory: a ``torch.distributed.checkpoint``, ``"dcp"``).
            convert: cast rows of another dtype to the table's (else a dtype difference
                raises). A quantized table takes float rows of any plain dtype without it
                and quantizes them as it loads (``convert`` casts other rows to float32
                first), or its own stored bytes, uint8 ``[N, row_bytes]`` (what
                :meth:`dump` writes of it), which are stored as they are.
            batch_size: rows per insert.
            progress: show a tqdm progress bar on stderr; default: only when stderr is a
                terminal (``True`` shows it anyway, ``False`` never).
            duplicates: what a key given to more than one row does: ``"refuse"`` (the
                default) raises :class:`DuplicateKeysError`; ``"last"`` stores the row of
                its last occurrence.
            allow_nonfinite: store rows holding NaN or infinite values too (else refused;
                a quantized table refuses them always).

        Returns:
            The number of rows read, an ``int`` whose ``distinct`` says how many distinct
            keys were stored and ``duplicates`` how many rows repeated an earlier key
            (:class:`psclient.loader.Loaded`).

        Raises:
            BadArgumentError: no such file, unknown format, bad ``batch_size``.
            BadValuesError: rows of another length, or of another dtype without ``convert``;
                a raw file that is not a whole number of rows.
            BadKeysError: keys that are not 1-D integers, one per row, or that hold the
                reserved key ``INT64_MIN``.
            DuplicateKeysError: keys repeat and ``duplicates="refuse"`` (says how many and
                the first few).
            NonFiniteValuesError: rows hold NaN or infinite values (converted to the table's
                dtype) and not ``allow_nonfinite`` (says how many and the first key).
            TableDroppedError: the table was dropped (or created anew) while the load
                wrote it: its rows are not in the table.
            Nothing is written when one of these is raised (they are checked before the
            first insert: a file's or tensor's keys and rows are all read once before);
            an iterator is checked chunk by chunk, so the chunks before a refused one stay
            written, as does every row inserted before an error of the store.

        On a handle of ``connect(..., loading=True)`` that created or joined a ``loading``
        table, the load ends its registration: a load that succeeds and is the last one
        registered makes the table ready; one that fails (or is interrupted) while other
        loads are registered leaves the table to them; the last one out drops the table if
        no load into it succeeded (docs/psclient.md, "Loading a new table").
        """
        from psclient.loader import load_into  # NOTE: the file readers load on use

        ps = cast("ParameterServer", self)
        ps._enter(None)
        try:
            n = load_into(ps, source, keys=keys, tensor=tensor, format=format,
                          convert=convert, batch_size=batch_size, progress=progress,
                          duplicates=duplicates, allow_nonfinite=allow_nonfinite)
        except BaseException:
            ps._end_load(ok=False)
            raise
        ps._end_load(ok=True, rows=n)
        return n

    def dump(self, path: str | Path, *, keys_path: str | Path | None = None,
             format: str | None = None,  # noqa: A002 - the CLI's flag
             progress: bool | None = None) -> int:
        """Write every key and row of the table to ``path``; returns the rows written.

        As :func:`psclient.dump.dump_table`: a ``.safetensors`` file (rows as ``weight``,
        keys as ``keys``) or ``.npy`` rows with their keys in ``keys_path`` (by default
        ``<name>.keys.npy`` beside them); ``format`` overrides the suffix; ``progress``: a
        progress bar on stderr (None: where stderr is a terminal). What it writes loads
        back with :meth:`~psclient.ParameterServer.load`.

        Raises:
            BadArgumentError: an unknown format, or a path that cannot be written (nothing
                is left of the file).
        """
        from psclient.dump import dump_table  # NOTE: tqdm and the writers load on use

        return dump_table(cast("ParameterServer", self), path, keys_path=keys_path,
                          format=format, progress=progress)
