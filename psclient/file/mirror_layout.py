"""The row mirror file's words: its header's word indices and the slots' sentinels.

Apart from :mod:`psclient.file.mirror_loops` (which re-exports them) so that reading a mirror's
header (opening a table, ``stat``) loads no compiler: numba loads with the first compiled
loop, a lookup or a write.
"""

from __future__ import annotations

#: ``srows`` sentinels
EMPTY = -1
TOMB = -2
CORRUPT = -3

#: header words
MAGIC, VERSION, GEN, STATE, SLOTS, ROW_CAP, ROW_BYTES, COUNT, USED, NEXT_ROW, FREE_TOP, \
    BOOT0, BOOT1, TXNID = range(14)
HEADER_WORDS = 16
