"""The row mirror file's words: its header's word indices and the slots' sentinels.

Apart from :mod:`psclient.file.mirror_loops` (which re-exports them) so that reading a mirror's
header (opening a table, ``stat``) loads no compiler: numba loads with the first compiled
loop, a lookup or a write.
"""

from __future__ import annotations

import struct

#: ``srows`` sentinels
EMPTY = -1
TOMB = -2
CORRUPT = -3

#: header words
MAGIC, VERSION, GEN, STATE, SLOTS, ROW_CAP, ROW_BYTES, COUNT, USED, NEXT_ROW, FREE_TOP, \
    BOOT0, BOOT1, TXNID = range(14)
HEADER_WORDS = 16

#: the header's ``MAGIC`` and ``VERSION`` words of a mirror file of this format
FILE_MAGIC = 0x4E56524F57494458  # b"NVROWIDX"
FILE_FORMAT = 1


def boot_id() -> tuple[int, int]:
    """This boot of the machine, as two int64 (the ``BOOT0``/``BOOT1`` words a mirror
    written now holds; zeros where the kernel does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            raw = bytes.fromhex(f.read().strip().replace("-", ""))
    except (OSError, ValueError):
        return 0, 0
    a, b = struct.unpack("<2q", raw[:16].ljust(16, b"\0"))
    return a, b
