"""The journal of a :class:`gpu.DistMemBlock` and how long its segment lives.

A block's journal is a one-row :class:`hostcache.SharedMemBlock` whose invalidation ring
carries the indices of rows written (every layer over the block follows it). Its segment
has a name only while the ranks of the block's group attach it:

1. rank 0 creates ``/dev/shm/nvec.<name>`` (and its lock file ``nvec-lock.<name>``);
2. every other rank attaches it by name;
3. once every rank holds it (an allgather), rank 0 unlinks the name and the lock file.

From then on the journal is reachable only through the mappings and lock-file
descriptors of the processes holding it, so nothing is left in ``/dev/shm`` however they
end: ``close()``, garbage collection, a normal exit with the block still alive, an
exception, SIGTERM or SIGKILL. A one-process block goes through the same steps, so its
name is gone before the constructor returns.

Only a process killed between steps 1 and 3 leaves the segment behind. A generated name
records its creator, ``distmem-<pid namespace>-<pid>-<random>``, and
:func:`reap_orphaned_journals` removes every such segment (and lock file) of this user
whose creator is dead; rank 0 runs it before it creates a journal, so the next block
built on the node clears what a killed one left. A segment with a name given by the user
(``name=``) is not reaped: ``hostcache rm NAME`` removes it.
"""

from __future__ import annotations

import logging
import os
import re
import uuid

import torch

from hostcache import HostCacheError, SharedMemBlock, segment
from hostcache.table import process_alive

from gpu.errors import BadArgumentError, GroupError
from gpu.dist.groups import Group

logger = logging.getLogger(__name__)

#: a generated journal name: ``distmem-<pid namespace inode>-<creator pid>-<12 hex>``
GENERATED = re.compile(r"distmem-(\d+)-(\d+)-[0-9a-f]{12}")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_name() -> str:
    """A fresh journal name recording this process (its pid and pid namespace)."""
    return f"distmem-{_pid_namespace()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def check_journal_name(name: object) -> str:
    """``name`` if it is a valid segment name, else :class:`BadArgumentError`."""
    try:
        return segment.check_name(name)
    except HostCacheError as e:
        raise BadArgumentError(f"name: {e}") from e


def reap_orphaned_journals() -> list[str]:
    """Remove the journal segments (and lock files) whose creator died before unlinking them.

    Only generated names (:data:`GENERATED`) created in this pid namespace by this user
    are considered; a journal whose creator is alive is being built and stays.

    Returns:
        The journal names removed.
    """
    ns = str(_pid_namespace())
    try:
        entries = os.listdir(segment.SHM_DIR)
    except OSError:
        return []
    reaped: list[str] = []
    for entry in entries:  # a loop over /dev/shm entries, not over keys
        for prefix in (segment.prefix(), segment.lock_prefix()):
            if not entry.startswith(prefix):
                continue
            name = entry[len(prefix):]
            m = GENERATED.fullmatch(name)
            if m is None or m.group(1) != ns or process_alive(int(m.group(2))):
                continue
            path = os.path.join(segment.SHM_DIR, entry)
            try:
                if os.stat(path).st_uid != os.getuid():
                    continue
                os.unlink(path)
            except (FileNotFoundError, PermissionError):
                continue
            if name not in reaped:
                reaped.append(name)
    for name in reaped:
        logger.info("distmem: removed journal %s left by a dead process", name)
    return reaped


def _unlink_name(name: str) -> None:
    try:
        SharedMemBlock.unlink(name)
    except Exception as e:  # noqa: BLE001 - someone removed it already; nothing to undo
        logger.debug("distmem: journal %s already removed: %s", name, e)


def open_journal(group: Group, name: str) -> SharedMemBlock:
    """Create (rank 0) or attach (the others) the journal, then unlink its name (module).

    Collective over ``group``. On any failure every rank raises and the name is gone.

    Raises:
        BadArgumentError: rank 0 could not create the segment (e.g. the name is taken).
        GroupError: another rank failed, or the group broke.
    """
    journal: SharedMemBlock | None = None
    err: BaseException | None = None
    try:
        if group.rank == 0:
            reap_orphaned_journals()
            try:
                journal = SharedMemBlock.create(name, num_rows=1, dim=1, dtype=torch.float32)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                err = BadArgumentError(
                    f"cannot create the block's journal segment {name!r}: {e}; pick another "
                    f"name= or remove the old segment (hostcache rm {name})")
        failed = group.bcast(None if err is None else str(err))
        if failed is not None:
            if err is not None:
                raise err
            raise GroupError(f"rank 0 could not create the journal: {failed}")
        if group.rank != 0:
            try:
                journal = SharedMemBlock.attach(name)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                err = GroupError(f"rank {group.rank} could not attach the journal {name!r}: "
                                 f"{e}")
        errors = group.allgather(None if err is None else str(err))  # all hold it now
        if err is not None:
            raise err
        bad = [e for e in errors if e is not None]
        if bad:
            raise GroupError("opening the journal failed on another rank: " + "; ".join(bad))
    except BaseException:
        if journal is not None:
            journal.close()
        raise
    finally:
        if group.rank == 0 and journal is not None:
            _unlink_name(name)  # NOTE: from here the journal has no name: nothing to leak
    assert journal is not None
    return journal
