"""Resident memory, measured from ``/proc`` and from the shared segments' tmpfs files.

* A segment's resident size is what tmpfs holds for it: the file's allocated blocks
  (``st_blocks * 512`` of ``/dev/shm/nvec.<name>``). A segment is created sparse, so only
  the pages that were written count, once, however many processes map them.
* A process's view comes from ``/proc/<pid>/smaps``: for each mapping of a segment, ``Rss``
  (pages of it this process has touched; a page shared by N processes counts in each) and
  ``Pss`` (each shared page divided by the number of processes mapping it, so the Pss of
  all mappers sums to the pages mapped). ``smaps_rollup`` gives the whole process's Rss/Pss.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from hostcache import segment


@dataclass(frozen=True)
class MappingMemory:
    """One process's resident memory in one shared segment, bytes."""

    name: str
    size: int
    rss: int
    pss: int


@dataclass(frozen=True)
class ProcessMemory:
    """Resident memory of one process, bytes (``smaps_rollup``), and its segment mappings."""

    pid: int
    rss: int
    pss: int
    #: unique set size: pages only this process maps (Private_Clean + Private_Dirty).
    uss: int
    segments: tuple[MappingMemory, ...]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def segment_resident_bytes(name: str) -> int:
    """Bytes tmpfs holds for the named segment (0 if it is gone)."""
    try:
        return os.stat(segment.shm_path(name)).st_blocks * 512
    except OSError:
        return 0


def segment_file_bytes(name: str) -> int:
    """The segment's size (its virtual size in every mapping), 0 if it is gone."""
    try:
        return os.stat(segment.shm_path(name)).st_size
    except OSError:
        return 0


def _kib(line: str) -> int:
    return int(line.split()[1]) * 1024


def process_memory(pid: int | str = "self", names: list[str] | None = None) -> ProcessMemory:
    """Rss/Pss of a process and of its mappings of the named segments (all ``nvec.*``).

    Raises:
        OSError: the process is gone or not ours.
    """
    wanted = None if names is None else {segment.shm_path(n): n for n in names}
    segs: dict[str, list[int]] = {}
    current: list[int] | None = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping header: "start-end perms off dev inode path"
                parts = line.split(maxsplit=5)
                path = parts[5].strip().removesuffix(" (deleted)") if len(parts) > 5 else ""
                base = os.path.basename(path)
                if wanted is not None:
                    name = wanted.get(path)
                elif path.startswith(segment.SHM_DIR) and base.startswith(segment.prefix()):
                    name = base[len(segment.prefix()):]
                else:
                    name = None
                current = segs.setdefault(name, [0, 0, 0]) if name is not None else None
            elif current is not None:
                if head == "Size:":
                    current[0] += _kib(line)
                elif head == "Rss:":
                    current[1] += _kib(line)
                elif head == "Pss:":
                    current[2] += _kib(line)
    rollup = {"Rss:": 0, "Pss:": 0, "Private_Clean:": 0, "Private_Dirty:": 0}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if head in rollup:
                rollup[head] = _kib(line)
    mappings = tuple(MappingMemory(n, *v) for n, v in sorted(segs.items()))
    return ProcessMemory(int(os.getpid() if pid == "self" else pid), rollup["Rss:"],
                         rollup["Pss:"], rollup["Private_Clean:"] + rollup["Private_Dirty:"],
                         mappings)
