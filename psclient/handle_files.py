"""What a parameter-server handle writes to files, mixed into
:class:`psclient.ParameterServer` (the work is :mod:`psclient.dump`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from psclient.base import ParameterServer


class HandleFiles:
    """:meth:`dump`: a table's keys and rows to a file."""

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
