"""What the parameter server refuses to store, on file:// and Redis: rows holding NaN or an
infinity (unless the caller allows them), the reserved key INT64_MIN, a load's repeated keys
(unless the last row of a key may win), and files that are not what they are read as.

Each refusal is a typed error that says what to do, and leaves the table as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import psclient
from nvecache.common.keys import RESERVED_KEY

DIM = 4
NONFINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.fixture(params=["file", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    shared: str = request.getfixturevalue("shared_redis")
    return shared


@pytest.fixture(params=["float32", "float16", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def ps(url: str, table_name: str, dtype: str) -> Iterator[psclient.ParameterServer]:
    with psclient.connect(url, table=table_name, dim=DIM, dtype=dtype) as table:
        yield table
    psclient.connect(url, table=table_name).drop()


def rows(n: int, dtype: torch.dtype, start: float = 0.0) -> torch.Tensor:
    return (torch.arange(n * DIM, dtype=torch.float32).reshape(n, DIM) + start).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN equal to NaN."""
    return bool(torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


@pytest.mark.parametrize("bad", NONFINITE)
def test_insert_and_update_refuse_nonfinite_rows_unless_allowed(
        ps: psclient.ParameterServer, bad: float) -> None:
    keys = torch.tensor([10, 11, 12, 13])
    before = rows(4, ps.dtype)
    ps.insert(keys, before)
    feed = ps.changes()[1]
    new = rows(4, ps.dtype, start=100.0)
    new[1, 2] = bad
    new[3, 0] = bad
    for write in (ps.insert, ps.update):
        with pytest.raises(psclient.NonFiniteValuesError,
                           match=r"2 row\(s\) hold NaN or infinite values \(the first: key 11\)"
                           r".*allow_nonfinite=True") as err:
            write(keys, new)
        assert isinstance(err.value, psclient.BadValuesError)
        got, found = ps.lookup(keys)
        assert bool(found.all()) and torch.equal(got, before)  # nothing written
    assert ps.changes(feed)[0].numel() == 0  # and nothing announced
    assert bool(ps.update(keys, new, allow_nonfinite=True).all())
    assert same(ps.lookup(keys)[0], new)
    ps.insert(torch.tensor([20]), new[1:2], allow_nonfinite=True)
    assert same(ps.lookup(torch.tensor([20]))[0], new[1:2])


def test_insert_and_update_refuse_the_reserved_key(ps: psclient.ParameterServer) -> None:
    keys = torch.tensor([5, RESERVED_KEY, 6])
    for write in (ps.insert, ps.update):
        with pytest.raises(psclient.BadKeysError, match="INT64_MIN.*reserved"):
            write(keys, rows(3, ps.dtype))
    assert ps.size() == 0


@pytest.mark.parametrize("dtype", ["float32"])
def test_a_load_with_a_nonfinite_row_writes_nothing(ps: psclient.ParameterServer,
                                                    tmp_path: Path) -> None:
    data = rows(1000, torch.float32)
    data[997, 1] = float("nan")  # NOTE: in the last chunk: checked before the first insert
    data[998, 3] = float("inf")
    keys = torch.arange(1000) * 7
    np.save(tmp_path / "rows.npy", data.numpy())
    for source in (data, tmp_path / "rows.npy"):
        with pytest.raises(psclient.NonFiniteValuesError,
                           match=r"2 of 1000 rows hold NaN or infinite values \(the first: row "
                           r"997, key 6979\).*allow_nonfinite=True"):
            ps.load(source, keys=keys, batch_size=100, progress=False)
        assert ps.size() == 0
    # rows that overflow the table's dtype once converted are refused as well
    wide = torch.full((3, DIM), 1e300, dtype=torch.float64)
    with pytest.raises(psclient.NonFiniteValuesError, match="once converted to float32"):
        ps.load(wide, convert=True, progress=False)
    assert ps.size() == 0
    assert ps.load(data, keys=keys, batch_size=100, progress=False,
                   allow_nonfinite=True) == 1000
    assert same(ps.lookup(keys)[0], data)


@pytest.mark.parametrize("dtype", ["float32"])
def test_an_iterator_load_refuses_a_nonfinite_chunk_before_writing_it(
        ps: psclient.ParameterServer) -> None:
    good, bad = rows(3, torch.float32), rows(3, torch.float32, start=50.0)
    bad[2, 0] = float("nan")
    chunks = [(torch.tensor([1, 2, 3]), good), (torch.tensor([4, 5, 6]), bad)]
    with pytest.raises(psclient.NonFiniteValuesError, match="the first: key 6"):
        ps.load(iter(chunks), progress=False)
    assert ps.size() == 3  # the chunk before the refused one
    assert ps.load(iter(chunks[1:]), progress=False, allow_nonfinite=True) == 3
    assert same(ps.lookup(torch.tensor([4, 5, 6]))[0], bad)


@pytest.mark.parametrize("dtype", ["float32"])
def test_a_load_refuses_repeated_keys_unless_the_last_may_win(
        ps: psclient.ParameterServer, tmp_path: Path) -> None:
    n = 1000
    data = rows(n, torch.float32)
    keys = np.arange(n, dtype=np.int64) + 10**9
    keys[[500, 900, 950]] = keys[3]  # NOTE: across chunks of 100 rows
    keys[101] = keys[100]  # and within one
    np.save(tmp_path / "keys.npy", keys)
    for source in (keys, tmp_path / "keys.npy", torch.from_numpy(keys)):
        with pytest.raises(psclient.DuplicateKeysError,
                           match=r"4 of 1000 rows repeat the key of an earlier row \(2 key\(s\) "
                           rf"given more than once: {10**9 + 3}, {10**9 + 100}\).*nothing was "
                           r"written.*duplicates='last'"):
            ps.load(data, keys=source, batch_size=100, progress=False)
        assert ps.size() == 0
    loaded = ps.load(data, keys=tmp_path / "keys.npy", batch_size=100, progress=False,
                     duplicates="last")
    assert (loaded, loaded.distinct, loaded.duplicates) == (1000, 996, 4)
    assert ps.size() == 996
    got, _ = ps.lookup(torch.tensor([10**9 + 3, 10**9 + 100]))
    assert torch.equal(got, data[[950, 101]])  # the last row of each key
    with pytest.raises(psclient.BadArgumentError, match="duplicates must be"):
        ps.load(data, keys=keys, duplicates="first", progress=False)


@pytest.mark.parametrize("dtype", ["float32"])
def test_an_iterator_load_counts_repeated_keys_as_it_goes(
        ps: psclient.ParameterServer) -> None:
    def chunks() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for c in range(40):  # NOTE: key c * 10 + 9 repeats within a chunk, key 0 in every one
            k = torch.arange(c * 10, c * 10 + 10)
            k[8], k[0] = k[9], 0 if c else k[0]
            yield k, rows(10, torch.float32, start=float(c))

    with pytest.raises(psclient.DuplicateKeysError,
                       match=r"keys: 1 of 10 rows repeat.*given more than once: 9\).*the 0 "
                       r"rows of the chunks before this one are written"):
        ps.load(chunks(), progress=False)
    assert ps.size() == 0
    loaded = ps.load(chunks(), progress=False, duplicates="last", batch_size=7)
    assert (loaded, loaded.distinct, loaded.duplicates) == (400, 400 - 40 - 39, 79)
    assert ps.size() == loaded.distinct
    got, _ = ps.lookup(torch.tensor([0, 399]))  # each from its last row: in the last chunk
    assert torch.equal(got, rows(10, torch.float32, start=39.0)[[0, 9]])


@pytest.mark.parametrize("dtype", ["float32"])
def test_a_load_refuses_the_reserved_key(ps: psclient.ParameterServer, tmp_path: Path) -> None:
    keys = np.arange(10, dtype=np.int64)
    keys[7] = RESERVED_KEY
    keys.astype("<i8").tofile(tmp_path / "keys.bin")
    for source in (keys, tmp_path / "keys.bin"):
        for duplicates in ("refuse", "last"):
            with pytest.raises(psclient.BadKeysError, match="INT64_MIN.*reserved"):
                ps.load(rows(10, torch.float32), keys=source, progress=False,
                        duplicates=duplicates)
    with pytest.raises(psclient.BadKeysError, match="INT64_MIN.*reserved"):
        ps.load(iter([(torch.from_numpy(keys), rows(10, torch.float32))]), progress=False)
    assert ps.size() == 0


def bad_files(tmp_path: Path) -> dict[str, Path]:
    """Files that are not the .npy they are read as, and one .npy read as something else."""
    good = np.ones((4, DIM), dtype=np.float32)
    np.save(tmp_path / "good.npy", good)
    np.savez(tmp_path / "rows.npz", emb=good, other=good)
    torch.save(torch.from_numpy(good), tmp_path / "rows.pt")
    torch.save(torch.from_numpy(good), tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "garbage.npy").write_bytes(os.urandom(64) + b"\0" * 64)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, None], dtype=object),
            allow_pickle=True)
    return {p.stem: p for p in tmp_path.iterdir()}


@pytest.mark.parametrize("dtype", ["float32"])
def test_files_that_are_not_what_they_are_read_as_are_refused_in_one_line(
        ps: psclient.ParameterServer, tmp_path: Path) -> None:
    f = bad_files(tmp_path)
    cases: list[tuple[dict, str]] = [
        ({"source": f["rows"].with_suffix(".npz")},
         r"is an \.npz archive of arrays \['emb', 'other'\], not a \.npy array: save the one"),
        ({"source": f["rows"].with_suffix(".npz"), "format": "npy"}, r"\.npz archive"),
        ({"source": f["rows"].with_suffix(".pt"), "format": "npy"},
         r"is a zip archive \(a torch \.pt file\?\), not a \.npy array: psclient reads"),
        ({"source": f["rows"].with_suffix(".pt")}, r"zip archive \(a torch \.pt file\?\)"),
        ({"source": f["old"], "format": "npy"}, r"is a Python pickle \(a torch \.pt file\?\)"),
        ({"source": f["garbage"]}, r"is not a \.npy file \(it does not start like one\): "
                                   r"psclient reads .*format="),
        ({"source": f["objects"]}, r"holds Python objects, not numbers: save a numeric array"),
        ({"source": f["good"], "format": "raw"}, r"is a \.npy file, not raw rows: load it as "
                                                 r"npy \(format= npy\)"),
        ({"source": f["good"], "format": "safetensors"}, r"is a \.npy file, not a "
                                                         r"\.safetensors file"),
        ({"source": f["good"], "keys": f["rows"].with_suffix(".npz")}, r"keys file .*\.npz "
                                                                       r"archive"),
        ({"source": f["good"], "keys": f["garbage"]}, r"keys file .* is not a \.npy file"),
        ({"source": f["good"], "keys": f["objects"]}, r"keys file .* holds Python objects"),
        ({"source": f["good"], "keys": f["rows"].with_suffix(".pt")}, r"keys file .* zip "
                                                                      r"archive"),
    ]
    for kw, message in cases:
        with pytest.raises(psclient.BadArgumentError, match=message) as err:
            ps.load(progress=False, **kw)
        assert "allow_pickle" not in str(err.value) and "\n" not in str(err.value)
    assert ps.size() == 0


@pytest.mark.parametrize("dtype", ["float32"])
def test_the_progress_bar_shows_on_a_terminal_or_when_asked(
        ps: psclient.ParameterServer, capfd: pytest.CaptureFixture[str]) -> None:
    data = rows(300, torch.float32)
    assert ps.load(data, batch_size=100) == 300  # NOTE: stderr is a pipe here
    assert capfd.readouterr().err == ""
    assert ps.load(data, batch_size=100, progress=True) == 300
    assert "300/300" in capfd.readouterr().err
