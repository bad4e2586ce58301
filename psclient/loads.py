"""A table's state, and the bulk loads registered with a table while it is ``loading``.

A load that creates a table creates it ``loading``; other loads with the same geometry join
it. Each load registers itself (a token, its pid, host and start time) and withdraws when it
ends. The last load to withdraw decides: the table becomes ready if any load committed (or
this one did); if none did, it drops the table, which no load reported rows into. A load
that ends while others are still registered leaves the table to them, whether it committed
or failed, so a failed or interrupted creator never destroys rows another load is writing.

Readers (``connect`` without ``loading=True``) of a ``loading`` table get a
:class:`psclient.errors.TableLoadingError` naming the loads. A load killed outright (SIGKILL,
a crash of its machine) stays registered: ``psclient ls`` shows it, and on its own host it is
seen not to run any more, so the next load that ends there no longer waits for it.

Nothing here needs torch: the command lines list states without loading it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from psclient.errors import TableLoadingError

#: what a table is, as ``stat()["state"]`` and ``psclient ls`` say it
READY, LOADING, CREATING, DROPPING = "ready", "loading", "creating", "dropping"

#: outcomes of a load's withdrawal: the table is ready now, stays loading for other loads,
#: must be dropped by the withdrawing load (last out, nothing committed), was dropped by it,
#: or was dropped (or created anew) by someone else meanwhile
WITHDRAW_OUTCOMES = (READY, LOADING, "drop", "dropped", "gone")


def iso(when: object) -> str | None:
    """Seconds since the epoch as an ISO 8601 UTC date (``None`` for a missing time)."""
    if not isinstance(when, (int, float)) or isinstance(when, bool) or when <= 0:
        return None
    moment = _dt.datetime.fromtimestamp(when, _dt.UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Load:
    """One bulk load registered with a table."""

    #: names the registration (random)
    token: str
    pid: int
    host: str
    #: when the load registered, seconds since the epoch
    since: float

    @classmethod
    def here(cls) -> Load:
        """A new registration for a load run by this process."""
        return cls(uuid.uuid4().hex[:16], os.getpid(), socket.gethostname(), time.time())

    def encode(self) -> bytes:
        """The stored record (JSON; the token is stored beside it)."""
        return json.dumps({"pid": self.pid, "host": self.host, "since": self.since}).encode()

    @classmethod
    def decode(cls, token: str, raw: bytes | str) -> Load:
        """A stored record; an unreadable one reads as an unknown load (never an error)."""
        try:
            rec = json.loads(raw)
            return cls(token, int(rec["pid"]), str(rec["host"]), float(rec["since"]))
        except (ValueError, KeyError, TypeError):
            return cls(token, 0, "?", 0.0)

    def running(self) -> bool | None:
        """Whether the load's process runs: ``None`` when it is on another host (unknown)."""
        if self.host != socket.gethostname() or self.pid <= 0:
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # NOTE: another user's process: it exists
            return True
        return True

    def describe(self) -> str:
        """``pid 1234 on host since 2026-01-01T00:00:00Z`` (and ``, not running``)."""
        text = f"pid {self.pid} on {self.host} since {iso(self.since) or '?'}"
        return text + (", not running" if self.running() is False else "")

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"pid", "host", "since" (ISO date), "running" (or None)}``."""
        return {"pid": self.pid, "host": self.host, "since": iso(self.since),
                "running": self.running()}


@dataclass(frozen=True)
class TableState:
    """A table's state: ``ready``, or ``loading`` with its loads (``creating``/``dropping``:
    a Redis table between the steps of its creation or of a failed load's drop)."""

    state: str = READY
    loads: tuple[Load, ...] = field(default=())
    #: loads that ended successfully while the table was loading
    committed: int = 0

    def describe(self) -> str:
        """``ready``, or ``loading (pid 1 on h since ...; pid 2 on h since ...)``."""
        if not self.loads:
            return self.state if self.state != LOADING else "loading (no load registered)"
        return f"{self.state} ({'; '.join(load.describe() for load in self.loads)})"

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"state", "loads": [...], "committed"}``."""
        return {"state": self.state, "loads": [load.as_dict() for load in self.loads],
                "committed": self.committed}

    def gone_loads(self, mine: Load | None) -> list[Load]:
        """The registered loads seen not to run any more (on this host), other than ``mine``."""
        return [load for load in self.loads
                if load.running() is False and (mine is None or load.token != mine.token)]


def loading_error(where: str, table: str, state: TableState) -> TableLoadingError:
    """The error a reader of a table that is not ready yet gets."""
    if state.state == CREATING:
        what = f"is being created ({state.describe().removeprefix(CREATING).strip()})"
    elif state.state == DROPPING:
        what = "is being dropped by the load that created it (the load failed)"
    else:
        what = f"is being loaded ({state.describe().removeprefix(LOADING).strip()})"
    return TableLoadingError(
        f"{where} {what}: it opens once the load finishes; if that load is gone, drop the "
        f"table (psclient drop URL --table {table}) and load it again",
        [load.as_dict() for load in state.loads])
