"""What a bulk load checks before it writes: what a file is, the keys, and the rows.

* :func:`sniff` reads a file's first bytes: a file is read as ``.npy`` / ``.safetensors``
  only if it starts like one, and a raw file must not be one of those; :func:`not_a` says
  what the file is instead, and what is read.
* :func:`census` counts the distinct keys of a whole load (one sort of its keys), refusing
  the reserved key and, unless ``duplicates="last"``, keys given to more than one row;
  :class:`StreamCensus` does the same chunk by chunk for an iterator.
* :func:`scan_finite` reads every row once, as the table's dtype, and refuses NaN and
  infinite values unless the caller allows them (a quantized table allows none).

Messages name the arguments the way the caller spells them (``cli``: the ``psclient``
command's flags).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from nvecache.common.finite import nonfinite_rows
from nvecache.common.keys import RESERVED_KEY, RESERVED_KEY_RULE
from psclient.codec import first_of_runs
from psclient.errors import BadArgumentError, BadKeysError, DuplicateKeysError, NonFiniteValuesError

#: what ``duplicates=`` accepts: refuse repeated keys, or let the last row of a key win
DUPLICATES = ("refuse", "last")
#: what the loader reads, for messages
READS = "psclient reads .npy arrays, .safetensors files and raw binary rows"

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE = 0x80  # NOTE: a pickle's PROTO opcode: torch.save without its zip container
_MAX_HEADER = 100 << 20  # safetensors' own bound on its JSON header
_FEW = 5


def _arg(cli: bool, api: str, flag: str) -> str:
    return flag if cli else api


def sniff(path: Path) -> str | None:
    """What a file's first bytes say it is: ``"npy"``, ``"zip"`` (an ``.npz`` archive or a
    torch ``.pt`` file), ``"pickle"`` (an older torch ``.pt`` file), ``"safetensors"``, or
    None (anything else: raw rows, or bytes of no known format)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if head.startswith(_NPY_MAGIC):
            return "npy"
        if head.startswith(_ZIP_MAGIC):
            return "zip"
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if 2 <= n <= min(size - 8, _MAX_HEADER) and f.read(1) == b"{":
            try:
                if isinstance(json.loads(b"{" + f.read(n - 1)), dict):
                    return "safetensors"
            except ValueError:  # NOTE: json's errors (decode, not UTF-8) are ValueErrors
                pass
    if len(head) >= 2 and head[0] == _PICKLE and 2 <= head[1] <= 5:  # NOTE: PROTO + version
        return "pickle"
    return None


def not_a(path: Path, fmt: str, found: str | None, *, what: str = "", cli: bool = False
          ) -> BadArgumentError:
    """The error for a file that is not the ``fmt`` it is read as (``found``: its
    :func:`sniff`): what it is, and what to do."""
    name = what or repr(str(path))
    fix = _arg(cli, "format=", "--format")
    if found == "zip":
        try:
            members = zipfile.ZipFile(path).namelist()
        except (zipfile.BadZipFile, OSError):
            members = []
        arrays = [m.removesuffix(".npy") for m in members if m.endswith(".npy")]
        if members and len(arrays) == len(members):
            return BadArgumentError(
                f"{name} is an .npz archive of arrays {arrays}, not a .npy array: save the "
                f"one to load on its own (numpy.save('rows.npy', numpy.load({str(path)!r})"
                f"[{arrays[0]!r}])) and load that file")
        return BadArgumentError(
            f"{name} is a zip archive (a torch .pt file?), not a .npy array: {READS}; save "
            "the rows with numpy.save or safetensors.torch.save_file and load that file")
    if found == "pickle":
        return BadArgumentError(
            f"{name} is a Python pickle (a torch .pt file?), not {fmt} data: {READS}; save "
            "the rows with numpy.save or safetensors.torch.save_file and load that file")
    if found is not None:
        return BadArgumentError(
            f"{name} is a .{found} file, not {'raw rows' if fmt == 'raw' else f'a .{fmt} file'}"
            f": load it as {found} ({fix} {found})")
    return BadArgumentError(
        f"{name} is not a .{fmt} file (it does not start like one): {READS} ({fix} npy, "
        "safetensors or raw); check the file and its format")


def check_duplicates_arg(duplicates: object) -> None:
    """``duplicates=`` is one of :data:`DUPLICATES`, else a :class:`BadArgumentError`."""
    if duplicates not in DUPLICATES:
        raise BadArgumentError(f"duplicates must be 'refuse' or 'last'; got {duplicates!r}")


def _refuse_duplicates(what: str, rows: int, repeated: np.ndarray, copies: int, before: str,
                       cli: bool) -> DuplicateKeysError:
    few = ", ".join(str(k) for k in repeated[:_FEW].tolist())
    more = ", ..." if repeated.size > _FEW else ""
    return DuplicateKeysError(
        f"{what}: {copies} of {rows} rows repeat the key of an earlier row "
        f"({repeated.size} key(s) given more than once: {few}{more}); {before}: give each row "
        f"its own key, or let the last row of a key win with "
        f"{_arg(cli, 'duplicates=' + repr('last'), '--duplicates last')}")


def census(keys: np.ndarray, *, duplicates: str, what: str = "keys", cli: bool = False) -> int:
    """The distinct keys of a whole load; refuses the reserved key, and repeated keys unless
    ``duplicates == "last"``.

    Args:
        keys: every key of the load (any integer array; sorted in a copy).
        duplicates: ``"refuse"`` or ``"last"``.
        what: how messages name the keys.
        cli: name the flags of the ``psclient`` command in messages.

    Raises:
        BadKeysError: a key is the reserved ``INT64_MIN``.
        DuplicateKeysError: keys repeat and ``duplicates == "refuse"`` (how many, the first
            few).
    """
    s = np.sort(np.asarray(keys, dtype=np.int64))
    if s.size and int(s[0]) == RESERVED_KEY:
        raise BadKeysError(f"{what}: {RESERVED_KEY_RULE}; nothing was written")
    first = first_of_runs(s)
    distinct = int(np.count_nonzero(first))
    if distinct < s.size and duplicates == "refuse":
        repeated = s[1:][~first[1:] & first[:-1]]  # NOTE: the second of each run: once per key
        raise _refuse_duplicates(what, int(s.size), repeated, int(s.size) - distinct,
                                 "nothing was written", cli)
    return distinct


class StreamCensus:
    """:func:`census` for a load read chunk by chunk (an iterator): the keys seen so far, as
    sorted runs merged like a binary counter (each key is merged about log2(N) times)."""

    def __init__(self, duplicates: str) -> None:
        self.duplicates = duplicates
        #: rows counted, and distinct keys among them
        self.rows = self.distinct = 0
        self._runs: list[np.ndarray] = []

    def add(self, keys: np.ndarray) -> None:
        """Count a chunk's keys (int64), before it is written.

        Raises:
            DuplicateKeysError: a key of the chunk repeats one of the chunk or of an earlier
                chunk and ``duplicates == "refuse"``; the chunks before it are written.
        """
        s = np.sort(keys)
        first = first_of_runs(s)
        fresh = s[first]
        seen = np.zeros(fresh.size, dtype=bool)
        for run in self._runs:  # NOTE: O(log N) runs, each searched for the whole chunk
            at = np.minimum(np.searchsorted(run, fresh), run.size - 1)
            seen |= run[at] == fresh
        copies = int(s.size - fresh.size + np.count_nonzero(seen))
        if copies and self.duplicates == "refuse":
            repeated = np.union1d(s[~first], fresh[seen])
            raise _refuse_duplicates("keys", self.rows + int(s.size), repeated, copies,
                                     f"the {self.rows} rows of the chunks before this one are "
                                     "written", False)
        new = fresh[~seen]
        self.rows += int(s.size)
        self.distinct += int(new.size)
        while self._runs and self._runs[-1].size <= new.size:
            new = np.sort(np.concatenate([self._runs.pop(), new]))
        if new.size:
            self._runs.append(new)


def scan_finite(n: int, get: Callable[[int, int], torch.Tensor], key_of: Callable[[int], int],
                *, what: str, converted: str | None, batch_size: int, cli: bool,
                quantized: bool = False) -> None:
    """Read every row once and refuse NaN and infinite values.

    Args:
        n: rows of the source.
        get: ``get(a, b)``: rows ``a..b-1`` as the table's dtype (what the load stores).
        key_of: the key of row ``i``.
        what: how messages name the source.
        converted: the table dtype's name when the rows are converted to it, else None.
        batch_size: rows read at a time.
        cli: name the flags of the ``psclient`` command in messages.
        quantized: the table is quantized (it stores finite rows only: the message offers
            no opt-in).

    Raises:
        NonFiniteValuesError: how many rows hold NaN or an infinity, and the first one's key.
    """
    count, first = 0, -1
    for a in range(0, n, batch_size):
        bad = nonfinite_rows(get(a, min(n, a + batch_size)))
        if bad is not None:
            rows = torch.nonzero(bad)[:, 0]
            first = a + int(rows[0]) if first < 0 else first
            count += rows.numel()
    if count:
        as_ = f" once converted to {converted}" if converted else ""
        todo = ("a quantized table stores finite rows only, fix those rows" if quantized
                else "fix those rows, or load them anyway with "
                + _arg(cli, "allow_nonfinite=True", "--allow-nonfinite"))
        raise NonFiniteValuesError(
            f"{what}: {count} of {n} rows hold NaN or infinite values{as_} (the first: row "
            f"{first}, key {key_of(first)}); nothing was written: {todo}")
