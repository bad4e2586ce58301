"""One rule for table names in every tier: psclient and hostcache accept and refuse alike."""

from __future__ import annotations

from pathlib import Path

import pytest

import psclient
from hostcache import BadNameError, HostCache, segment
from nvecache.common.names import is_table_name

GOOD = ["a", "ctr_user", "emb.v2", "x-1", "...", ".a", "a.", "A" * 100]
BAD = [".", "..", "", "a\n", "a b", "a/b", "a{b}", "A" * 101, "é", None, 3]


@pytest.mark.parametrize("name", BAD)
def test_both_packages_refuse_the_same_names(name: object, tmp_path: Path) -> None:
    assert not is_table_name(name)
    with pytest.raises(psclient.BadArgumentError, match="bad table name"):
        psclient.connect(f"file://{tmp_path}/store", table=name, dim=4)  # type: ignore[arg-type]
    with pytest.raises(BadNameError, match="bad table name"):
        segment.check_name(name)
    assert not (tmp_path / "store").exists()  # refused before anything was created


@pytest.mark.parametrize("name", GOOD)
def test_both_packages_accept_the_same_names(name: str, tmp_path: Path) -> None:
    assert is_table_name(name)
    assert segment.check_name(name) == name
    with psclient.connect(f"file://{tmp_path}/store", table=name, dim=4) as ps:
        assert ps.table == name


def test_dot_names_are_refused_by_psclient_as_by_hostcache(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    for name in (".", ".."):
        with pytest.raises(psclient.BadArgumentError):
            psclient.connect(url, table=name, dim=4)
        with pytest.raises(BadNameError):
            HostCache.create(name, capacity=8, dim=4)
    assert not (tmp_path / "store").exists()  # nothing was created
