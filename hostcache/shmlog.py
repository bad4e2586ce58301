"""A record of the ``/dev/shm`` entries this package creates, for leak checks.

When the environment variable ``NVEC_SHM_LOG`` names a file, every process that creates
a segment (``nvec.<name>``) or a lock file (``nvec-lock.<name>``) appends one line
``<inode> <file name>`` to it. Child processes inherit the variable, so one log covers a
whole process tree (the test suite sets it for its session: pytest-xdist workers,
spawned ranks and CLI subprocesses included). :func:`leftovers` then lists the recorded
entries still in ``/dev/shm``: an entry counts only while the file of that name is the
inode that was recorded, so a table of the same name created later by a process outside
the tree (another test session beside this one) is never taken for a leftover.

Without the variable nothing is recorded and nothing is checked.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV = "NVEC_SHM_LOG"


def record(path: str) -> None:
    """Append ``path``'s inode and file name to the log named by ``NVEC_SHM_LOG``, if any.

    Never raises: a log that cannot be written is reported with a warning.
    """
    log = os.environ.get(ENV)
    if not log:
        return
    try:
        line = f"{os.stat(path).st_ino} {os.path.basename(path)}\n".encode()
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)  # NOTE: one short O_APPEND write: lines never interleave
        finally:
            os.close(fd)
    except OSError as e:
        logger.warning("cannot record %s in %s=%s: %s", path, ENV, log, e)


def recorded(log: str) -> list[tuple[int, str]]:
    """The ``(inode, file name)`` lines of ``log`` (empty when it does not exist)."""
    try:
        with open(log, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out: list[tuple[int, str]] = []
    for line in lines:
        ino, _, name = line.partition(" ")
        if ino.isdigit() and name and "/" not in name:
            out.append((int(ino), name))
    return out


def leftovers(log: str, shm_dir: str = "/dev/shm") -> list[str]:
    """File names in ``shm_dir`` that ``log`` recorded and that are still the same inode."""
    found = set()
    for ino, name in recorded(log):
        try:
            if os.stat(os.path.join(shm_dir, name)).st_ino == ino:
                found.add(name)
        except FileNotFoundError:
            pass
    return sorted(found)
