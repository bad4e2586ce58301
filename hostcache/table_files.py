"""Save a shared table to a file and restore it, as methods of the tables
(:class:`~hostcache.HostCache`, :class:`~hostcache.SharedMemBlock`); the work is
:mod:`hostcache.files`'.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, cast

from hostcache.errors import GeometryMismatchError

if TYPE_CHECKING:
    from hostcache.table import SharedTable


class TableFiles:
    """:meth:`save` a table's keys and rows to a ``.safetensors`` file, :meth:`restore` one."""

    def save(self, path: str | Path, **options: Any) -> int:
        """Write this table's keys and rows to ``path`` (:func:`hostcache.files.save`:
        read chunk by chunk, renamed into place once whole); returns the rows written."""
        from hostcache import files

        return files.save(cast("SharedTable", self), path, **options)

    @classmethod
    def restore(cls, name: str, path: str | Path, *, create: bool = True,
                allow_nonfinite: bool = False, **options: Any) -> Self:
        """Write the rows saved in ``path`` into the table ``name`` of this class (created
        from the file's geometry where it does not exist and ``create``); returns its
        handle (close it). As :func:`hostcache.files.restore`: every check runs before the
        first write.

        Raises:
            GeometryMismatchError: the file holds another kind of table (a cache's file
                restored as a SharedMemBlock, or the reverse), or one that does not fit the
                existing table; nothing was written.
        """
        from hostcache import files
        from hostcache.files.saved import Saved

        kind = Saved(Path(path)).kind()
        if files._KINDS.get(kind) is not cls:  # noqa: SLF001
            raise GeometryMismatchError(
                f"{str(path)!r} holds a {kind} table, not a {cls.__name__}: restore it with "
                "hostcache.files.restore (it opens the kind the file holds)")
        table = files.restore(name, path, create=create, allow_nonfinite=allow_nonfinite,
                              **options)
        return cast("Self", table)
