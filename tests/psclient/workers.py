"""Spawn-safe worker functions for multi-process psclient tests (importable by children)."""

from __future__ import annotations

from typing import Any

import torch

import psclient


def file_writer_forever(url: str, table: str, ready: Any) -> None:
    """Rewrite all 512 rows with a growing value, forever (until killed)."""
    with psclient.connect(url, table=table) as ps:
        i = 0
        while True:
            ps.insert(torch.arange(512), torch.full((512, 8), float(i)))
            ready.set()
            i += 1


def file_reader(url: str, table: str, rounds: int) -> str:
    """Read all rows ``rounds`` times; every lookup must see one whole committed batch."""
    with psclient.connect(url, table=table) as ps:
        for _ in range(rounds):
            got, found = ps.lookup(torch.arange(512))
            if not bool(found.all()):
                return "missing rows"
            if not torch.equal(got, got[:, :1].expand(-1, 8)):
                return "torn row"
            if got.unique().numel() != 1:  # one read transaction sees one whole batch
                return "torn batch"
    return "ok"
