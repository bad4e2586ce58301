"""Node namespaces (NVEC_NODE): several simulated nodes on one machine, each seeing only its
own shared tables, as if each had its own /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hostcache import BadArgumentError, HostCache, SegmentNotFoundError, segment


def test_each_node_sees_only_its_own_tables(table_name: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segment.NODE_ENV, "A")
    a = HostCache.create(table_name, capacity=16, dim=2)
    monkeypatch.setenv(segment.NODE_ENV, "B")
    b = HostCache.create(table_name, capacity=16, dim=2)  # the same name, another node
    try:
        a.insert(torch.tensor([1]), torch.ones(1, 2))
        assert not b.contains(torch.tensor([1])).item()  # two tables
        assert table_name in segment.list_names()
        assert os.path.exists(f"/dev/shm/nvec@B.{table_name}")
        assert os.path.exists(f"/dev/shm/nvec-lock@B.{table_name}")
        monkeypatch.delenv(segment.NODE_ENV)
        assert table_name not in segment.list_names()  # the default node has none
        with pytest.raises(SegmentNotFoundError):
            HostCache.attach(table_name)
    finally:
        a.close()
        b.close()
        for node in ("A", "B"):
            monkeypatch.setenv(segment.NODE_ENV, node)
            HostCache.unlink(table_name)
    assert not [e for e in os.listdir("/dev/shm") if e.endswith(table_name)]


def test_a_process_of_a_node_attaches_that_nodes_table(table_name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segment.NODE_ENV, "n1")
    with HostCache.create(table_name, capacity=16, dim=2) as hc:
        try:
            hc.insert(torch.tensor([7]), torch.full((1, 2), 3.0))
            code = ("import torch; from hostcache import HostCache; "
                    f"h = HostCache.attach({table_name!r}); "
                    "print(h.lookup(torch.tensor([7]))[0][0, 0].item()); h.close()")
            for node, want in (("n1", "3.0"), ("n2", "SegmentNotFoundError")):
                env = {**os.environ, segment.NODE_ENV: node}
                done = subprocess.run([sys.executable, "-c", code], env=env,
                                      capture_output=True, text=True, timeout=120)
                assert want in done.stdout + done.stderr
        finally:
            HostCache.unlink(table_name)


@pytest.mark.parametrize("bad", ["a b", "x/y", "n" * 33, "."])
def test_a_bad_node_name_is_a_typed_error(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segment.NODE_ENV, bad)
    with pytest.raises(BadArgumentError, match="NVEC_NODE"):
        HostCache.create("t", capacity=16, dim=2)


def test_listing_skips_an_entry_that_is_gone_or_not_a_segment(table_name: str) -> None:
    """An entry that vanishes between the directory listing and its stat (a segment another
    process removed meanwhile; here a dangling link, which stats the same way) is skipped,
    not raised; a link is never listed as a segment."""
    live = HostCache.create(table_name + "-live", capacity=16, dim=2)
    link = f"/dev/shm/nvec.{table_name}-gone"
    os.symlink(f"/dev/shm/nvec.{table_name}-nowhere", link)
    try:
        names = list(segment.list_names())
        assert table_name + "-live" in names
        assert table_name + "-gone" not in names
    finally:
        os.unlink(link)
        live.close()
        HostCache.unlink(table_name + "-live")
