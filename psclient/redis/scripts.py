"""The Lua steps that write a partition's rows and its change-feed record as one.

Every write command of a batch is one server-side step on one partition chunk: an ``EVAL``
(update, erase, clear), or for insert ``MULTI``, the ``EVAL`` of :data:`INSERT_NOTICE` on
the chunk's keys, a plain ``HSET`` of its rows, ``EXEC``. The scripts' keys::

    KEYS[1] = psc:{T:p}            hash    the partition's rows
    KEYS[2] = psc:{T:p}:changes    stream  the partition's change feed
    KEYS[3] = psc:{T:p}:last       string  the ID of the stream's newest entry
    KEYS[4] = psc:{T:p}:live       string  the table's existence marker in this slot
    KEYS[5] = psc:{T:p}:held       hash    (insert only, for an instant) see below
    KEYS[6] = psc:{T:p}:acc        hash    (accumulate only) receipts: id -> flags
    KEYS[7] = psc:{T:p}:accz       zset    (accumulate only) receipts by time
    ARGV[1] = MAXLEN of the stream (approximate trim, ``changes_maxlen``)
    ARGV[2] = the table's token (its creation time, ``TableSchema.token``)
    ARGV[3..] = key fields (8 little-endian bytes), each followed by its row for writes
                (accumulate: ARGV[3] the receipts' lifetime, ARGV[4] this command's
                receipt id, then each field followed by the row its writer read and the
                row to write)

The keys share the hash tag ``{T:p}``, so they live in one cluster slot and the step runs on
one node: Redis runs a script, or a ``MULTI``/``EXEC`` block, to its end before any other
command (and replicates and persists it as one unit), so a writer killed at any point leaves
either the rows and their notice or neither.

Every write step first compares the partition's marker with the writer's token and refuses
(an error reply starting with :data:`GONE`, nothing written) when it differs: the table was
dropped (the drop deletes each partition's keys and marker together) or dropped and created
anew. So a write racing a drop never re-creates a partition of the dropped table. Insert's
rows are a plain ``HSET`` after its script inside ``MULTI``, and Redis runs the rest of a
transaction after a failed command; so a refusing insert script moves the partition's hash
(another table's, if any) aside to ``:held`` and leaves a string in its place, on which the
``HSET`` fails, and :data:`FENCE`, the transaction's last command, puts the hash back.

A stream entry is::

    k  packed little-endian int64 keys whose rows changed   (or  c  "" : the partition was
    t  the server's TIME in microseconds since the epoch          cleared)
    p  the ID of the entry before it in this stream ("0-0": the first)

``p`` chains the entries: a follower whose cursor for the partition is ``X`` must see ``p ==
X`` on the first entry it reads after ``X``; anything else means entries between were lost
(trimmed, or a restart or failover dropped writes the follower had read), never a silent skip.
``KEYS[3]`` keeps the newest ID even when trimming removed the entry, so ``p`` is always known
and a cursor ahead of it is seen as a loss too.

The notice is exact: insert lists the keys whose field existed before (``HSET`` answers 0),
update and accumulate the keys that existed (and were written), erase the keys deleted
(``HDEL`` answers 1). A key repeated within one command may be listed although it did not
exist before the batch (harmless: a follower re-reads it).
"""

from __future__ import annotations

#: the start of the error reply of a write refused because the table is gone
GONE = "PSCGONE"

_NOTICE = b"""
local function notice(field, value)
  local t = redis.call('TIME')
  local prev = redis.call('GET', KEYS[3]) or '0-0'
  local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', field, value,
                        't', t[1] .. string.format('%06d', t[2]), 'p', prev)
  redis.call('SET', KEYS[3], id)
end
local GONE = 'PSCGONE the table was dropped (or created anew) while this client wrote it'
"""

_REFUSE = b"""
if redis.call('GET', KEYS[4]) ~= ARGV[2] then return redis.error_reply(GONE) end
"""

#: insert, with only the keys as ARGV[3..]: notice the keys whose field exists now. The
#: backend sends it inside ``MULTI`` before the chunk's plain ``HSET`` of the rows, then
#: :data:`FENCE`, then ``EXEC``: one transaction (nothing runs between them; a client gone
#: before ``EXEC`` runs none of it), and the rows never pass through Lua (copying them in and
#: out of Lua strings made a Lua-only insert far slower than a plain HSET: see
#: bench/RESULTS.md, "The atomic change feed"). Refused (the table is gone): the
#: partition's hash is set aside so that the ``HSET`` fails (module docstring).
INSERT_NOTICE = _NOTICE + b"""
if redis.call('GET', KEYS[4]) ~= ARGV[2] then
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('RENAME', KEYS[1], KEYS[5]) end
  redis.call('SET', KEYS[1], 'gone')
  return redis.error_reply(GONE)
end
local h, hit = KEYS[1], {}
for i = 3, #ARGV do
  if redis.call('HEXISTS', h, ARGV[i]) == 1 then hit[#hit + 1] = ARGV[i] end
end
if #hit > 0 then notice('k', table.concat(hit)) end
return #hit
"""

#: the end of an insert transaction (KEYS: the partition's hash and its ``:held``): after a
#: refused insert, the string left in the hash's place goes and the hash comes back.
FENCE = b"""
if redis.call('TYPE', KEYS[1]).ok == 'string' then
  redis.call('DEL', KEYS[1])
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('RENAME', KEYS[2], KEYS[1]) end
  return redis.error_reply('PSCGONE the table was dropped (or created anew) meanwhile')
end
return 0
"""

#: update: write only rows that exist; notice them. Returns one '0'/'1' per key.
UPDATE = _NOTICE + _REFUSE + b"""
local h, out, hit = KEYS[1], {}, {}
for i = 3, #ARGV, 2 do
  if redis.call('HEXISTS', h, ARGV[i]) == 1 then
    redis.call('HSET', h, ARGV[i], ARGV[i + 1])
    out[#out + 1] = '1'
    hit[#hit + 1] = ARGV[i]
  else
    out[#out + 1] = '0'
  end
end
if #hit > 0 then notice('k', table.concat(hit)) end
return table.concat(out)
"""

#: accumulate's compare-and-set (KEYS: :func:`partition_keys`; ARGV[3] :data:`RECEIPT_MS`,
#: ARGV[4] the command's receipt id): write a key's new row only where the row stored is
#: still the one its writer read and added to; notice the keys written. Returns one flag
#: per key: '1' written, '0' missing (nothing created), 'r' changed since the read (the
#: writer reads it again and retries that key), so no concurrent addition is ever lost.
#: The flags are kept as the command's receipt (``:acc`` by id, ``:accz`` by time; each
#: call removes receipts older than :data:`RECEIPT_MS`): the same command sent again (a
#: connection lost before its reply came, and the pipeline resent) answers them again
#: instead of adding twice.
ACCUMULATE = _NOTICE + _REFUSE + b"""
local done = redis.call('HGET', KEYS[6], ARGV[4])
if done then return done end
local h, out, hit = KEYS[1], {}, {}
for i = 5, #ARGV, 3 do
  local cur = redis.call('HGET', h, ARGV[i])
  if not cur then
    out[#out + 1] = '0'
  elseif cur == ARGV[i + 1] then
    redis.call('HSET', h, ARGV[i], ARGV[i + 2])
    out[#out + 1] = '1'
    hit[#hit + 1] = ARGV[i]
  else
    out[#out + 1] = 'r'
  end
end
if #hit > 0 then notice('k', table.concat(hit)) end
local flags = table.concat(out)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local old = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now - tonumber(ARGV[3]),
                       'LIMIT', 0, 64)
if #old > 0 then
  redis.call('HDEL', KEYS[6], unpack(old))
  redis.call('ZREM', KEYS[7], unpack(old))
end
redis.call('HSET', KEYS[6], ARGV[4], flags)
redis.call('ZADD', KEYS[7], string.format('%d', now), ARGV[4])
return flags
"""

#: how long an accumulate command's receipt stays at least (ms): longer than a
#: pipeline's resends
RECEIPT_MS = 60_000

#: erase: delete the keys; notice those that existed. Returns how many were deleted.
ERASE = _NOTICE + _REFUSE + b"""
local h, hit = KEYS[1], {}
for i = 3, #ARGV do
  if redis.call('HDEL', h, ARGV[i]) == 1 then hit[#hit + 1] = ARGV[i] end
end
if #hit > 0 then notice('k', table.concat(hit)) end
return #hit
"""

#: clear: delete the partition's rows; notice the clear (followers get a gap).
CLEAR = _NOTICE + _REFUSE + b"""
redis.call('UNLINK', KEYS[1])
notice('c', '')
return 1
"""

#: drop one partition (KEYS: :func:`partition_keys`; ARGV: the token, or '' for a
#: partition found without a marker): only where the marker is that token or missing
DROP_PART = """
local cur = redis.call('GET', KEYS[4])
if cur and cur ~= ARGV[1] then return 0 end
return redis.call('UNLINK', unpack(KEYS))
"""


def partition_keys(part_key: bytes) -> list[bytes]:
    """A partition's keys, as :data:`DROP_PART` and :data:`ACCUMULATE` take them: its hash,
    change feed, the feed's last ID, the table's marker, insert's ``:held``, and
    accumulate's receipts (``:acc``, ``:accz``)."""
    return [part_key, part_key + b":changes", part_key + b":last", part_key + b":live",
            part_key + b":held", part_key + b":acc", part_key + b":accz"]
