"""A Redis table's life: creation, the state of a table being loaded, and drop.

Keys of table ``T`` besides its rows (:mod:`psclient.redis.backend`)::

    psc:{T}:schema     string  the schema record; never rewritten while the table lives
                               (a layout-1 upgrade aside), so comparing it tells tables apart
    psc:{T}:state      hash    absent: the table is ready. Else ``state`` = creating |
                               loading | dropping, ``l:<token>`` = a registered load (JSON
                               pid, host, since), ``committed`` = loads that succeeded
    psc:{T:p}:live     string  partition p's existence marker: the table's token (its
                               creation time, exactly); every write step compares it

Steps on ``{T}`` keys are one script each (atomic); a partition's steps too. Across slots:

* **Create**: one script sets the schema if there is none and the state ``creating`` with
  the creator registered; the creator then marks every partition (a script that empties
  the partition's keys, leftovers of an interrupted drop, and sets its marker, unless a
  newer table of this name holds it); then it publishes: ``loading`` for a load
  (``connect(loading=True)``), else ready. Readers and loads that find ``creating`` wait
  for the publication. A creation that fails undoes itself.
* **Drop**: the schema and state first (compared with the record the dropper opened, so a
  table created anew meanwhile is not touched), then each partition's keys and marker
  together, where the marker is the dropped table's or missing. A writer that opened the
  table before the drop finds its marker gone and is refused; one that opens it after
  finds no schema. A drop interrupted between the steps leaves partitions without a schema:
  orphans, which ``psclient ls`` lists and ``psclient drop`` removes
  (:mod:`psclient.redis.admin`).
* **Loads**: :mod:`psclient.loads`: join a ``loading`` table, withdraw at the end; the
  last load out of a table no load committed to sets ``dropping`` and drops it.
* **Tables created before markers** (no ``marked`` in the record): a writer marks the
  partitions where no marker is on its first write, then checks that the schema is still
  the one it opened (else it takes its markers back and is refused); since a drop deletes
  the schema first, a marker set after that is always seen and taken back. A write refused
  while the schema is still the one its writer opened met markers the store lost (a
  restart without persistence): the writer marks them again the same way and repeats it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from nvecache.common import rows
from psclient.errors import (
    PSClientError,
    SchemaMismatchError,
    TableDroppedError,
    TableNotFoundError,
)
from psclient.loads import CREATING, DROPPING, LOADING, READY, Load, TableState, loading_error
from psclient.redis import resp
from psclient.redis.conn import redis_errors
from psclient.redis.dispatch import Cmd
from psclient.redis.keyspace import decode_state
from psclient.redis.scripts import DROP_PART, partition_keys
from psclient.schema import LAYOUT_VERSION, TableSchema

log = logging.getLogger(__name__)

#: how long an open waits for a table another client is creating (one round trip, usually)
CREATING_WAIT_S = 5.0

_CREATE = """
local cur = redis.call('GET', KEYS[1])
if cur then return cur end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'state', 'creating', 'l:' .. ARGV[2], ARGV[3])
return false
"""

_PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[3] == 'loading' then redis.call('HSET', KEYS[2], 'state', 'loading')
else redis.call('DEL', KEYS[2]) end
return 1
"""

_JOIN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 'gone' end
local st = redis.call('HGET', KEYS[2], 'state')
if not st then return 'ready' end
if st == 'loading' then
  redis.call('HSET', KEYS[2], 'l:' .. ARGV[2], ARGV[3])
  return 'joined'
end
return st
"""

_WITHDRAW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 'gone' end
local st = redis.call('HGET', KEYS[2], 'state')
if st ~= 'loading' then return st or 'ready' end
redis.call('HDEL', KEYS[2], 'l:' .. ARGV[2])
for i = 4, #ARGV do redis.call('HDEL', KEYS[2], 'l:' .. ARGV[i]) end
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[2], 'committed', 1) end
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.sub(f, 1, 2) == 'l:' then return 'loading' end
end
if redis.call('HEXISTS', KEYS[2], 'committed') == 1 then
  redis.call('DEL', KEYS[2])
  return 'ready'
end
redis.call('HSET', KEYS[2], 'state', 'dropping')
return 'drop'
"""

_DROP_SCHEMA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""

#: a creator's mark of a partition (KEYS: hash, changes, last, live; ARGV: token)
_MARK = """
local cur = redis.call('GET', KEYS[4])
if cur == ARGV[1] then return 1 end
if cur and (tonumber(cur) or 0) > tonumber(ARGV[1]) then return 0 end
redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[6])
redis.call('SET', KEYS[4], ARGV[1])
return 1
"""

#: a table created before markers: mark a partition that has none (KEYS: live)
_ADOPT = """
local cur = redis.call('GET', KEYS[1])
if not cur then redis.call('SET', KEYS[1], ARGV[1]) return 1 end
if cur == ARGV[1] then return 1 end
return 0
"""

_UNMARK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""

class RedisTableLife:
    """The life of a table, mixed into :class:`psclient.redis.backend.RedisParameterServer`
    (which sets these attributes)."""

    _client: Any
    _cluster: bool
    _where: str
    _table: str
    _opts: dict[str, Any]
    _schema: TableSchema
    _schema_raw: bytes
    _schema_key: str
    _state_key: str
    _part_keys: list[bytes]
    _load: Load | None
    _marked: bool

    def _run(self, cmds: list[Cmd], job: Any = None, finish: Any = None, *,
             bell: bool = False) -> list[Any]:
        raise NotImplementedError

    def _eval(self, script: str, args: list[bytes | str]) -> Any:
        """A script on the table's ``{T}`` keys (schema, state)."""
        with redis_errors(self._where):
            return self._client.eval(script, 2, self._schema_key, self._state_key, *args)

    def _per_part(self, script: str, keys: Any, *args: bytes | str) -> list[Any]:
        """``script`` on every partition: ``keys(part_key)`` are its keys."""
        cmds = []
        for p, k in enumerate(self._part_keys):
            ks = keys(k)
            cmds.append(Cmd(p, 0, 1, [resp.pack("EVAL", script, len(ks), *ks, *args)]))
        return self._run(cmds)

    def _dropped(self, what: str) -> TableDroppedError:
        return TableDroppedError(f"{self._where} {what}: connect again (`psclient ls URL` "
                                 "lists the tables there)")

    # -- open ----------------------------------------------------------------------------

    def _open_schema(self, table: str, dim: int | None, dtype: str | None,
                     partitions: int | None) -> tuple[TableSchema, Load | None]:
        """The stored schema, or a new one (state ``creating``, this handle its creator:
        the returned load) when there is none and ``dim`` is given."""
        with redis_errors(self._where):
            raw = self._client.get(self._schema_key)
            if raw is None:
                if dim is None:
                    raise TableNotFoundError(
                        f"{self._where} does not exist: pass dim= (and dtype=) to create it")
                if partitions is None:
                    masters = len(self._client.get_primaries()) if self._cluster else 1
                    partitions = max(64, 8 * masters)
                schema = TableSchema(dim=dim, dtype=dtype or "float32", partitions=partitions,
                                     marked=True, formats=rows.FORMATS)
                rec, me = schema.encode(), Load.here()
                raw = self._eval(_CREATE, [rec, me.token, me.encode()])
                if raw is None:
                    self._schema_raw = rec
                    return schema, me
            schema = TableSchema.decode(raw, table)  # NOTE: there, or a creation race lost
            self._schema_raw = raw
            if schema.layout == 1:
                schema = self._upgrade(table, schema, raw)
            schema.check(table, dim=dim, dtype=dtype, partitions=partitions)
            return schema, None

    def _settle(self, creator: Load | None, mode: str) -> None:
        """Once the partitions are known: finish this handle's creation, or check the
        table's state (``mode`` ``open``: ready only; ``load``: join a loading table;
        ``partial``: any state)."""
        if creator is not None:
            self._finish_creation(creator, loading=mode == "load")
            return
        if mode == "partial":
            return
        deadline = time.monotonic() + CREATING_WAIT_S
        while True:
            state = self._state()
            if state.state == CREATING and time.monotonic() < deadline and \
                    not all(load.running() is False for load in state.loads):
                time.sleep(0.005)  # NOTE: its creator is marking the partitions
                continue
            if state.state == READY:
                return
            if mode != "load" or state.state != LOADING:
                if self.stored_schema() != self._schema_raw:
                    raise self._dropped("was dropped while this client opened it")
                raise loading_error(self._where, self._table, state)
            me = Load.here()
            got = self._eval(_JOIN, [self._schema_raw, me.token, me.encode()])
            got = got.decode() if isinstance(got, bytes) else str(got)
            if got == "joined":
                self._load = me
                return
            if got == "gone":
                raise self._dropped("was dropped while this load opened it")
            # NOTE: ready, or another state since we read it: look again

    def _finish_creation(self, me: Load, *, loading: bool) -> None:
        try:
            token = self._schema.token
            marked = self._per_part(_MARK, lambda k: [k, k + b":changes", k + b":last",
                                                      k + b":live", k + b":acc",
                                                      k + b":accz"], token)
            if not all(int(m) == 1 for m in marked):
                raise self._dropped("was dropped and created anew while this client created "
                                    "it")
            if not int(self._eval(_PUBLISH, [self._schema_raw, me.token,
                                             LOADING if loading else ""])):
                raise self._dropped("was dropped while this client created it")
        except BaseException:
            with contextlib.suppress(PSClientError):
                self._eval(_DROP_SCHEMA, [self._schema_raw])
                self._per_part(DROP_PART, partition_keys, self._schema.token)
            raise
        self._load = me if loading else None
        log.info("created %s%s: %s", self._where, " (loading)" if loading else "", self._schema)

    def _upgrade(self, table: str, old: TableSchema, raw: bytes) -> TableSchema:
        """Layout 1 (one stream per table, written after the rows) to layout 2, if asked."""
        if not self._opts["upgrade"]:
            raise SchemaMismatchError(
                f"{self._where} has layout 1 (one change stream per table, appended after the "
                "rows: a writer killed in between left changes unannounced); this psclient "
                f"reads and writes layout {LAYOUT_VERSION}. Stop every client of the older "
                "psclient, then run `psclient upgrade URL --table NAME` (or connect with "
                "upgrade=True) once: the rows stay, the old feed is dropped, followers re-sync")
        new = TableSchema(dim=old.dim, dtype=old.dtype, partitions=old.partitions,
                          created=old.created, formats=rows.FORMATS)
        pre = self._opts["prefix"]
        rec = new.encode()
        # NOTE: compare-and-set: only the process that still finds the old record upgrades
        done = self._client.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) "
            "redis.call('DEL', KEYS[2]) return 1 end return 0", 2, self._schema_key,
            f"{pre}:{{{table}}}:changes", raw, rec)
        if done:
            log.warning("upgraded %s from layout 1 to %d", self._where, LAYOUT_VERSION)
            self._schema_raw = rec
            return new
        self._schema_raw = self._client.get(self._schema_key)
        if self._schema_raw is None:
            raise TableNotFoundError(f"{self._where} was dropped while this client upgraded it")
        return TableSchema.decode(self._schema_raw, table)

    # -- what redis_feed uses ------------------------------------------------------------

    def stored_schema(self) -> bytes | None:
        """The schema record stored now (``None``: the table is gone)."""
        with redis_errors(self._where):
            raw: bytes | None = self._client.get(self._schema_key)
            return raw

    # -- state, loads, drop --------------------------------------------------------------

    def _state(self) -> TableState:
        with redis_errors(self._where):
            return decode_state(self._client.hgetall(self._state_key))

    def _withdraw(self, load: Load, *, ok: bool) -> str:
        gone = [g.token for g in self._state().gone_loads(load)]
        out = self._eval(_WITHDRAW, [self._schema_raw, load.token, "1" if ok else "0", *gone])
        out = out.decode() if isinstance(out, bytes) else str(out)
        return "gone" if out in (DROPPING, CREATING) else out

    def _same_table(self) -> bool:
        return self.stored_schema() == self._schema_raw

    def _drop(self) -> None:
        if not int(self._eval(_DROP_SCHEMA, [self._schema_raw])):
            raise self._dropped("was dropped (or created anew) since this client opened it; "
                                "nothing was deleted")
        self._per_part(DROP_PART, partition_keys, self._schema.token)
        log.info("dropped %s", self._where)

    def _adopt(self) -> None:
        """A table created before markers: mark its partitions before the first write."""
        token = self._schema.token
        got = self._per_part(_ADOPT, lambda k: [k + b":live"], token)
        if all(int(g) == 1 for g in got) and self.stored_schema() == self._schema_raw:
            self._marked = True
            return
        with contextlib.suppress(PSClientError):
            self._per_part(_UNMARK, lambda k: [k + b":live"], token)
        raise self._dropped("was dropped (or created anew) while this client wrote it; "
                            "nothing was written")
