"""``psclient load`` refusing what the store should not hold, in one line and before the
table is created; its progress bar on a terminal only; Ctrl-C during a load.

In-process tests go through ``main(argv)``; the terminal and the interrupt are tested on a
real ``python -m psclient.cli`` process (a pseudo-terminal; a SIGINT sent once the bar shows
rows loaded).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import psclient
from nvecache.common.keys import RESERVED_KEY
from tests.psclient.load.test_cli import one_line_error as cli_error
from tests.psclient.load.test_cli import run


def one_line_error(err: str) -> str:
    """One ``psclient: error:`` line, with none of numpy's pickle advice."""
    assert "allow_pickle" not in err
    return cli_error(err)


def tables(url: str) -> list[str]:
    try:
        return psclient.list_tables(url)
    except psclient.PSUnavailableError:  # NOTE: a file:// store never written is not there
        return []


def test_files_that_are_not_what_format_says_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    good = np.ones((4, 3), dtype=np.float32)
    np.save(tmp_path / "rows.npy", good)
    np.savez(tmp_path / "rows.npz", emb=good)
    torch.save(torch.from_numpy(good), tmp_path / "rows.pt")
    # NOTE: no known magic at its start (random bytes would, now and then: a pickle's 0x80)
    (tmp_path / "garbage.npy").write_bytes(b"\x01garbage" + bytes(range(23)) + b"\0" * 96)
    cases = [
        (["rows.npz"], r"rows\.npz' is an \.npz archive of arrays \['emb'\], not a \.npy array"),
        (["rows.npz", "--format", "npy"], r"\.npz archive"),
        (["rows.pt", "--format", "npy"], r"rows\.pt' is a zip archive \(a torch \.pt file\?\), "
                                         r"not a \.npy array: psclient reads \.npy arrays"),
        (["rows.pt"], r"zip archive \(a torch \.pt file\?\)"),
        (["garbage.npy"], r"garbage\.npy' is not a \.npy file \(it does not start like one\): "
                          r"psclient reads .*--format npy, safetensors or raw"),
        (["rows.npy", "--format", "raw", "--dim", "3"], r"is a \.npy file, not raw rows: load "
                                                        r"it as npy \(--format npy\)"),
        (["rows.npy", "--keys", str(tmp_path / "rows.npz")], r"keys file .*\.npz archive"),
    ]
    for (file, *flags), message in cases:
        rc, _, err = run(capsys, "load", url, "--table", "t", str(tmp_path / file), *flags)
        assert rc == 1 and re.search(message, one_line_error(err)), err
    assert tables(url) == []


def test_repeated_keys_are_refused_or_counted_with_last_wins(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    data = np.arange(1000 * 3, dtype=np.float32).reshape(1000, 3)
    np.save(tmp_path / "rows.npy", data)
    np.save(tmp_path / "keys.npy", np.full(1000, 42, dtype=np.int64))  # the case
    rc, _, err = run(capsys, "load", url, "--table", "t", str(tmp_path / "rows.npy"),
                     "--keys", str(tmp_path / "keys.npy"), "--batch-size", "300")
    assert rc == 1 and re.search(r"999 of 1000 rows repeat the key of an earlier row \(1 "
                                 r"key\(s\) given more than once: 42\); nothing was written: .*"
                                 r"--duplicates last", one_line_error(err)), err
    assert tables(url) == []
    rc, out, _ = run(capsys, "load", url, "--table", "t", str(tmp_path / "rows.npy"),
                     "--keys", str(tmp_path / "keys.npy"), "--batch-size", "300",
                     "--duplicates", "last")
    assert rc == 0
    assert "loaded t: 1000 rows read, 1 distinct keys stored, 999 duplicates (last wins)" in out
    with psclient.connect(url, table="t") as ps:
        assert ps.size() == 1
        assert torch.equal(ps.lookup(torch.tensor([42]))[0], torch.from_numpy(data[-1:]))


def test_the_reserved_key_and_nonfinite_rows_are_refused_before_the_table_is_created(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    data = np.ones((100, 3), dtype=np.float32)
    np.save(tmp_path / "rows.npy", data)
    keys = np.arange(100, dtype=np.int64) * 3
    keys[50] = RESERVED_KEY
    keys.astype("<i8").tofile(tmp_path / "keys.bin")
    rc, _, err = run(capsys, "load", url, "--table", "t", str(tmp_path / "rows.npy"),
                     "--keys", str(tmp_path / "keys.bin"))
    assert rc == 1 and "INT64_MIN) is reserved" in one_line_error(err)
    data[[60, 70], 2] = [np.nan, -np.inf]
    np.save(tmp_path / "bad.npy", data)
    rc, _, err = run(capsys, "load", url, "--table", "t", str(tmp_path / "bad.npy"),
                     "--batch-size", "32")
    assert rc == 1 and re.search(r"2 of 100 rows hold NaN or infinite values \(the first: row "
                                 r"60, key 60\); nothing was written: .*--allow-nonfinite",
                                 one_line_error(err)), err
    assert tables(url) == []
    rc, out, _ = run(capsys, "load", url, "--table", "t", str(tmp_path / "bad.npy"),
                     "--allow-nonfinite")
    assert rc == 0 and "loaded 100 rows into t" in out
    with psclient.connect(url, table="t") as ps:
        assert bool(ps.lookup(torch.tensor([60]))[0].isnan().any())




def _read_until(fd: int, pattern: str, seen: bytearray) -> re.Match[str]:
    """Read ``fd`` until its text matches ``pattern`` (fails at the end of the stream)."""
    while True:
        m = re.search(pattern, seen.decode(errors="replace"))
        if m:
            return m
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # NOTE: a pty's reader gets EIO once the child closed it
            chunk = b""
        assert chunk, f"the stream ended without {pattern!r}: {seen.decode(errors='replace')}"
        seen += chunk


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "psclient.cli", *argv]


def test_the_bar_shows_on_a_terminal_or_when_asked(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    np.save(tmp_path / "rows.npy", np.ones((500, 3), dtype=np.float32))
    rc, out, err = run(capsys, "load", url, "--table", "t", str(tmp_path / "rows.npy"))
    assert rc == 0 and err == "" and "loaded 500 rows" in out  # NOTE: stderr is a pipe here
    rc, _, err = run(capsys, "load", url, "--table", "u", str(tmp_path / "rows.npy"),
                     "--progress")
    assert rc == 0 and "500/500" in err
    # on a terminal the bar shows unasked
    leader, follower = pty.openpty()
    # NOTE: a terminal's size, as a real one has (tqdm draws nothing on 0 columns)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        proc = subprocess.Popen(_cli("load", url, "--table", "v", str(tmp_path / "rows.npy")),
                                stdout=subprocess.PIPE, stderr=follower)
        os.close(follower)
        _read_until(leader, r"load v: 100%.*500/500", bytearray())
        out_b, _ = proc.communicate(timeout=120)
    finally:
        os.close(leader)
    assert proc.returncode == 0 and b"loaded 500 rows into v" in out_b


def test_ctrl_c_during_a_file_load_ends_it_at_once_in_one_line(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    n, dim = 2_000_000, 4
    np.save(tmp_path / "rows.npy", np.ones((n, dim), dtype=np.float32))
    with psclient.connect(url, table="t", dim=dim):
        pass  # NOTE: an existing table: the interrupt alone is under test, not a new table's fate
    proc = subprocess.Popen(
        _cli("load", url, "--table", "t", str(tmp_path / "rows.npy"), "--batch-size", "4096",
             "--progress"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    seen = bytearray()
    try:
        # NOTE: synchronised on the bar: rows are being written when the signal lands
        _read_until(proc.stderr.fileno(), r"\| *[1-9][\d.]*k?/2\.00M", seen)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        rest = proc.stderr.read()
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = (bytes(seen) + rest).decode(errors="replace")
    assert proc.returncode == 130, err
    assert err.rstrip("\n").rsplit("\n", 1)[-1] == "psclient: error: interrupted", err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert took < 1.0, f"the process took {took:.2f} s to end after SIGINT"


def test_an_interrupt_inside_a_mirror_write_is_the_callers_to_report(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C landing in the file:// row mirror's update: the mirror goes stale (lookups read
    LMDB until the next write rebuilds it), and nothing logs a traceback for it."""
    from psclient.file import mirror_loops

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    with psclient.connect(f"file://{tmp_path}/store", table="t", dim=2) as ps:
        ps.insert(torch.arange(4), torch.ones(4, 2))
        assert ps.stat()["mirror"]["state"] == "ok"
        with caplog.at_level(logging.DEBUG, logger="psclient"), monkeypatch.context() as patch:
            patch.setattr(mirror_loops, "put", interrupted)  # lands in the mirror's put loop
            with pytest.raises(KeyboardInterrupt):
                ps.insert(torch.arange(4, 6), torch.full((2, 2), 2.0))
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        assert ps.stat()["mirror"]["state"].startswith("stale")
        values, found = ps.lookup(torch.arange(7))  # LMDB's rows: the insert was committed
        assert found.tolist() == [True] * 6 + [False]
        assert torch.equal(values[:6], torch.tensor([[1.0, 1.0]] * 4 + [[2.0, 2.0]] * 2))
