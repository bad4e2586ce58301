"""The batched-first interface every parameter-server backend implements.

Public methods validate their arguments here (typed errors, nothing written) and hand
numpy int64 keys and contiguous *stored* rows to the backend's ``_`` methods: a plain
table's rows as they are, a quantized table's encoded (uint8 ``[N, row_bytes]``,
:mod:`psclient.quantized`); lookups decode what the backends return.
"""

from __future__ import annotations

import contextlib
import logging
import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import numpy as np

from nvecache.common.accumulate import delta_problem
from nvecache.common.lazy import lazy_import
from psclient.codec import check_keys, check_values, check_written
from psclient.errors import (
    BadArgumentError,
    BadValuesError,
    HandleClosedError,
    PSClientError,
    TableDroppedError,
)
from psclient.feed import FeedBatch
from psclient.handle_files import HandleFiles
from psclient.loads import Load, TableState
from psclient.quantized import check_stored, decode_rows, encode_rows, refuse_nonfinite
from psclient.schema import TableSchema

if TYPE_CHECKING:
    import torch
else:  # NOTE: torch loads when rows are first handled
    torch = lazy_import("torch", globals())

log = logging.getLogger(__name__)


class ParameterServer(HandleFiles, ABC):
    """A table of int64 keys -> rows of ``dim`` elements of ``dtype``, shared by all nodes.

    Use :func:`psclient.connect` to get one. Every method works on a batch of keys.
    Instances are context managers (``close()`` on exit). They notice a fork and reconnect
    in the child.
    """

    _closed = True  # class-level defaults so close()/repr work after a failed __init__
    _table = "<unopened>"
    #: the store's URL without a password or query; every backend sets it
    _url = ""
    _schema: TableSchema
    #: this handle's registration with a ``loading`` table (``connect(loading=True)``),
    #: until its load ends
    _load: Load | None = None

    def __init__(self, table: str, schema: TableSchema) -> None:
        self._table = table
        self._schema = schema
        self._pid = os.getpid()
        self._closed = False

    # -- read-only properties ------------------------------------------------------------

    @property
    def table(self) -> str:
        """The table name."""
        return self._table

    @property
    def url(self) -> str:
        """The store's URL without a password or query (``file:///dir``,
        ``redis://host:6379/0``): what :func:`psclient.connect` opens this table from."""
        return self._url

    @property
    def dim(self) -> int:
        """Elements per row."""
        return self._schema.dim

    @property
    def dtype(self) -> torch.dtype:
        """Row dtype (a quantized table's: its format's, ``torch.int8`` or
        ``torch.float8_e4m3fn``; its lookups return float32)."""
        return self._schema.torch_dtype

    @property
    def quantized(self) -> bool:
        """Whether rows are stored quantized (writes encode float rows, lookups decode
        them to float32; docs/psclient.md, "Quantized tables")."""
        return self._schema.quantized

    @property
    def schema(self) -> TableSchema:
        """The stored schema (dim, dtype, partitions, layout version)."""
        return self._schema

    # -- the interface -------------------------------------------------------------------

    def lookup(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the rows of ``keys``.

        Args:
            keys: int64 CPU tensor ``[N]``; duplicates allowed.

        Returns:
            ``(values, found)``: ``values`` ``[N, dim]`` of the table dtype (zeros where
            not found; a quantized table's rows dequantized, float32) and ``found`` bool
            ``[N]``, new tensors the caller owns (a layer hands ``values`` to its
            host-cache worker as they are).

        Raises:
            BadKeysError: keys are not a 1-D int64 CPU tensor.
            CorruptValueError: a stored value has the wrong length (names table and key).
            PSUnavailableError: the store could not be reached (PSTimeoutError on timeout).
        """
        k = self._enter(keys)
        if k.size == 0:
            return (torch.zeros(0, self.dim, dtype=self._schema.value_dtype),
                    torch.zeros(0, dtype=torch.bool))
        stored, found = self._lookup(k)
        return decode_rows(stored, self._schema), found

    def lookup_stored(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the rows of ``keys`` as the table stores them: a quantized table's encoded
        rows, uint8 ``[N, stored_bytes]`` (what :func:`nvecache.common.quant.decode` reads:
        :meth:`lookup` returns them decoded), a plain table's rows as :meth:`lookup`
        returns them. A reader that keeps rows in the same quantized format (a layer's
        host cache) takes them so, without decoding and encoding them again.

        Returns:
            ``(stored, found)``: zero bytes where not found; new tensors the caller owns.

        Raises:
            As :meth:`lookup`.
        """
        k = self._enter(keys)
        if k.size == 0:
            shape = (0, self._schema.row_bytes) if self.quantized else (0, self.dim)
            dtype = torch.uint8 if self.quantized else self._schema.value_dtype
            return torch.zeros(shape, dtype=dtype), torch.zeros(0, dtype=torch.bool)
        return self._lookup(k)

    def insert(self, keys: torch.Tensor, values: torch.Tensor, *,
               allow_nonfinite: bool = False) -> None:
        """Write rows, creating or overwriting them (the last of duplicate keys wins).

        Args:
            keys: int64 CPU tensor ``[N]``; never the reserved key ``INT64_MIN``.
            values: ``[N, dim]`` CPU tensor of the table's dtype (a quantized table: float
                rows of any plain dtype, stored quantized).
            allow_nonfinite: store rows holding NaN or infinite values too (else refused;
                a quantized table refuses them always: their range is not finite).

        Raises:
            BadKeysError, BadValuesError: bad arguments (a key ``INT64_MIN`` is reserved);
                nothing is written.
            NonFiniteValuesError: a row holds NaN or an infinity and not
                ``allow_nonfinite`` (or the table is quantized); nothing is written.
            PSUnavailableError: the write could not be applied (never silently dropped).
        """
        k = self._enter(keys)
        v = self._written(k, values, allow_nonfinite)
        if k.size:
            self._insert(k, v)

    def update(self, keys: torch.Tensor, values: torch.Tensor, *,
               allow_nonfinite: bool = False) -> torch.Tensor:
        """Overwrite rows of keys that exist; keys that do not exist are not written.

        Args:
            keys: int64 CPU tensor ``[N]``; never the reserved key ``INT64_MIN``.
            values: as for :meth:`insert`.
            allow_nonfinite: as for :meth:`insert`.

        Returns:
            bool ``[N]``: which keys existed (and were written).

        Raises:
            BadKeysError, BadValuesError, NonFiniteValuesError: as for :meth:`insert`;
                nothing is written.
        """
        k = self._enter(keys)
        v = self._written(k, values, allow_nonfinite)
        if k.size == 0:
            return torch.zeros(0, dtype=torch.bool)
        return self._update(k, v)

    def accumulate(self, keys: torch.Tensor, deltas: torch.Tensor, *,
                   allow_nonfinite: bool = False) -> torch.Tensor:
        """Add ``deltas`` to the rows of keys that exist; keys that do not exist are not
        written (nor created).

        Each row's read, add and write is one atomic step: a concurrent accumulate or
        update of the same row, from any process, never loses an addition. The deltas of
        a key repeated in the batch are summed first; float16 and bfloat16 rows are added
        in float32 and rounded once (:mod:`nvecache.common.accumulate`); a quantized row
        is decoded, added to in float32 and encoded again with stochastic rounding
        (:func:`nvecache.common.quant.encode_sum`: deltas under half its quantization
        step add up over many calls instead of rounding away; each element within one
        step of the sum). The changed keys are announced on the change
        feed as an update's are.

        Args:
            keys: int64 CPU tensor ``[N]``; never the reserved key ``INT64_MIN``.
            deltas: ``[N, dim]`` CPU tensor of the table's dtype, or float32 (float64 for
                a float64 table): added without rounding them to the table's dtype first.
                A quantized table takes float32 deltas.
            allow_nonfinite: add deltas holding NaN or infinite values too (else refused;
                a quantized table refuses them always, and a sum that overflows).

        Returns:
            bool ``[N]``: which keys existed (and were added to).

        Raises:
            BadKeysError, BadValuesError, NonFiniteValuesError: as for :meth:`update`;
                nothing is written.
        """
        k = self._enter(keys)
        q = self._schema.quantized
        problem = delta_problem(deltas, k.size, self.dim, self._schema.value_dtype)
        if problem is not None:
            raise BadValuesError(problem + (f" ({self._schema.dtype} rows are added to in "
                                            "float32)" if q else ""))
        d = deltas.contiguous()
        check_written(k, d, allow_nonfinite=allow_nonfinite or q)
        if q:
            refuse_nonfinite(k, d, "deltas")
        if k.size == 0:
            return torch.zeros(0, dtype=torch.bool)
        return self._accumulate(k, d)

    def erase(self, keys: torch.Tensor) -> None:
        """Delete the rows of ``keys`` (missing keys are ignored)."""
        k = self._enter(keys)
        if k.size:
            self._erase(k)

    def clear(self) -> None:
        """Delete every row; the schema stays. Change-feed readers get a ChangeFeedGapError."""
        self._enter(None)
        self._clear()

    def size(self) -> int:
        """Number of rows stored."""
        self._enter(None)
        return self._size()

    def follow(self, since: str | None = None, *, limit: int = 1024,
               block_ms: int = 0) -> FeedBatch:
        """Keys written by update/accumulate/erase/insert-over-existing after a cursor, waiting
        if asked.

        Args:
            since: a cursor returned by an earlier call; ``None`` starts at the feed's end
                now (no keys, the cursor to follow from).
            limit: at most about this many feed entries per call (docs/psclient.md: per
                partition stream on Redis, never fewer than one per partition).
            block_ms: when nothing is new after ``since``, wait up to this long for the
                first new entry and return as soon as one is committed (0: do not wait).
                Redis wakes on the write itself (no timer polling; on a cluster, a doorbell
                with a bounded fallback sweep); file:// polls its local store every few ms.

        Returns:
            A :class:`psclient.FeedBatch`: the unique keys changed after ``since``, the next
            cursor, and the commit times of the oldest and newest entry read.

        Raises:
            ChangeFeedGapError: the changes after ``since`` cannot all be listed: entries
                were trimmed from the bounded feed, the table was cleared, or the store lost
                entries the cursor had already passed (a restart without persistence, a
                failover). Drop every cached row of the table and resume from
                ``err.cursor``.
            BadArgumentError: ``since`` is not a cursor of this feed, or a bad
                ``limit``/``block_ms``.
        """
        self._enter(None)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise BadArgumentError(f"limit must be a positive int, got {limit!r}")
        if isinstance(block_ms, bool) or not isinstance(block_ms, int) or block_ms < 0:
            raise BadArgumentError(f"block_ms must be an int >= 0, got {block_ms!r}")
        if since is not None and not isinstance(since, str):
            raise BadArgumentError(
                f"bad change-feed cursor {since!r}: pass a string returned by follow()")
        return self._follow(since, limit, block_ms)

    def changes(self, since: str | None = None, *, limit: int = 1024,
                block_ms: int = 0) -> tuple[torch.Tensor, str]:
        """:meth:`follow` without the commit times: ``(keys, cursor)``.

        Args:
            since: a cursor returned by an earlier call; ``None`` starts at the current end
                (returns no keys and the cursor to poll from).
            limit: as for :meth:`follow`.
            block_ms: as for :meth:`follow`.

        Returns:
            ``(keys, cursor)``: unique int64 keys changed after ``since`` and the cursor to
            pass next time.

        Raises:
            ChangeFeedGapError: as for :meth:`follow`: drop every cached row of the table
                and resume from ``err.cursor``.
        """
        batch = self.follow(since, limit=limit, block_ms=block_ms)
        return batch.keys, batch.cursor

    def _end_load(self, *, ok: bool, rows: int = 0) -> None:
        """End this handle's load: withdraw its registration (a failed load's last step
        never raises over the load's own error), and check that a successful load's rows
        are in the table still."""
        entry = self._load
        if entry is not None and entry.pid != os.getpid():
            entry = None  # NOTE: a forked child: the registration is its parent's
        else:
            self._load = None
        if not ok:
            if entry is not None:
                try:
                    if self._withdraw(entry, ok=False) == "drop":
                        self._drop()
                except PSClientError:
                    log.warning("%r: the failed load could not withdraw from the table; "
                                "psclient ls shows it", self, exc_info=True)
            return
        outcome = self._withdraw(entry, ok=True) if entry is not None else (
            "ready" if self._same_table() else "gone")
        if outcome == "gone":
            raise TableDroppedError(
                f"table {self.table!r} was dropped (or created anew) while this load wrote "
                f"it: its {rows} rows are not in a table; load them again")

    def drop(self) -> None:
        """Delete the table, whatever its state: rows, schema, state and change feed. The
        client is closed afterwards. Loads still writing it fail with
        :class:`TableDroppedError`.

        Raises:
            TableDroppedError: the table was dropped (or created anew) since this handle
                opened it; nothing was deleted.
        """
        self._enter(None)
        self._load = None  # NOTE: the registration goes with the table
        self._drop()
        self.close()

    def state(self) -> dict[str, Any]:
        """The table's state: ``{"state": "ready" | "loading" | ..., "loads": [{"pid",
        "host", "since", "running"}, ...], "committed": int}`` (docs/psclient.md,
        "Loading a new table")."""
        self._enter(None)
        return self._state().as_dict()

    def stat(self) -> dict[str, Any]:
        """Schema, row count, state and backend details, as a JSON-able dict."""
        self._enter(None)
        info = {"table": self.table, "dim": self.dim, "dtype": self._schema.dtype,
                "partitions": self._schema.partitions, "layout": self._schema.layout,
                "created": self._schema.created, "rows": self._size()}
        state = self._state()
        info.update(state=state.state, loads=[load.as_dict() for load in state.loads])
        info.update(self._stat())
        return info

    def close(self) -> None:
        """Let go of connections / file handles. Idempotent. A handle of
        ``connect(..., loading=True)`` whose load never ended withdraws from the table as a
        failed load would."""
        if self._closed:
            return
        if self._load is not None and self._load.pid == os.getpid():
            with contextlib.suppress(PSClientError):
                self._end_load(ok=False)
        self._closed = True
        self._close()

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if getattr(self, "_schema", None) is None:
            return f"{type(self).__name__}(table={self._table!r}, unopened)"
        return (f"{type(self).__name__}(table={self.table!r}, dim={self.dim}, "
                f"dtype={self._schema.dtype}{', closed' if self._closed else ''})")

    # -- helpers -------------------------------------------------------------------------

    def _enter(self, keys: object) -> np.ndarray:
        if self._closed:
            raise HandleClosedError(f"table {self._table!r}: client is closed; connect() again")
        pid = os.getpid()
        if pid != self._pid:
            # NOTE: a forked child must not share the parent's sockets / LMDB environment.
            self._after_fork()
            self._pid = pid
        if keys is None:
            return np.empty(0, dtype=np.int64)
        return check_keys(keys)

    def _written(self, k: np.ndarray, values: object, allow_nonfinite: bool) -> torch.Tensor:
        """Rows to write as the backend stores them: checked (nothing written when they
        are refused), a quantized table's encoded."""
        v = check_values(values, k.size, self._schema)
        if not self._schema.quantized:
            check_written(k, v, allow_nonfinite=allow_nonfinite)
            return v
        check_written(k, v, allow_nonfinite=True)  # NOTE: the keys' rule; encode: the rows'
        return encode_rows(k, v, self._schema)

    def _insert_stored(self, keys: torch.Tensor, raw: torch.Tensor) -> None:
        """Insert a quantized table's stored bytes as they are (uint8 ``[N, row_bytes]``: a
        load of what ``dump`` wrote), once their rows are seen to be finite."""
        k = self._enter(keys)
        v = check_stored(k, raw, self._schema)
        check_written(k, v, allow_nonfinite=True)
        if k.size:
            self._insert(k, v)

    # -- backend hooks -------------------------------------------------------------------

    @abstractmethod
    def _insert(self, keys: np.ndarray, values: torch.Tensor) -> None: ...

    @abstractmethod
    def _update(self, keys: np.ndarray, values: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _lookup(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored rows of ``keys`` (:meth:`TableSchema.stored_view`; zero bytes where
        missing) and bool ``[N]`` found."""

    @abstractmethod
    def _accumulate(self, keys: np.ndarray, deltas: torch.Tensor) -> torch.Tensor:
        """Add ``deltas`` (checked: the table's dtype or its accumulator) to the rows of
        ``keys`` that exist, each row atomically (:func:`psclient.quantized.add_rows`: a
        quantized row decoded, added to, encoded); bool ``[N]`` of the keys that existed."""

    @abstractmethod
    def _erase(self, keys: np.ndarray) -> None: ...

    @abstractmethod
    def _clear(self) -> None: ...

    def _reserve(self, rows: int) -> None:  # noqa: B027 - optional for backends
        """A bulk load of about ``rows`` new rows is starting (a backend may size itself
        once instead of growing step by step); nothing by default."""

    @abstractmethod
    def _size(self) -> int: ...

    @abstractmethod
    def _follow(self, since: str | None, limit: int, block_ms: int) -> FeedBatch: ...

    @abstractmethod
    def _drop(self) -> None: ...

    def _state(self) -> TableState:
        """The table's state now (ready unless a backend keeps states)."""
        return TableState()

    def _withdraw(self, load: Load, *, ok: bool) -> str:
        """End ``load``'s registration; one of :data:`psclient.loads.WITHDRAW_OUTCOMES`."""
        return "ready"

    def _same_table(self) -> bool:
        """Whether the table this handle opened is still there (not dropped or replaced)."""
        return True

    @abstractmethod
    def _close(self) -> None: ...

    @abstractmethod
    def _after_fork(self) -> None: ...

    def _stat(self) -> dict[str, Any]:
        return {}
