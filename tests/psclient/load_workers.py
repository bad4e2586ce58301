"""Processes that load or write a table while a test drops or lists it.

Run as ``python -m tests.psclient.load_workers KIND URL TABLE`` from the repository root:

* ``loader``: a bulk load (``connect(..., loading=True)``, ``load()`` of an iterator) that
  prints ``wrote <i>`` after each chunk is in the table and then waits for a line on stdin
  before the next one, so a test acts while the load is registered but between writes.
* ``writer``: inserts 64-row batches until refused; prints ``wrote`` after the first.

Both print ``error <ErrorClass>: <message>`` and exit 3 on a psclient error, else print
``loaded <n>`` / ``done`` and exit 0.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

import psclient

DIM = 4
#: rows per chunk (loader) or batch (writer)
CHUNK = 64


def _loader(url: str, table: str, chunks: int) -> int:
    def rows() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(chunks):
            yield torch.arange(i * CHUNK, (i + 1) * CHUNK), torch.full((CHUNK, DIM), float(i))
            print(f"wrote {i}", flush=True)  # NOTE: load() asks for the next chunk: i is in
            sys.stdin.readline()

    with psclient.connect(url, table=table, dim=DIM, loading=True) as ps:
        n = ps.load(rows(), progress=False)
    print(f"loaded {n}", flush=True)
    return 0


def _writer(url: str, table: str, batches: int) -> int:
    with psclient.connect(url, table=table, dim=DIM) as ps:
        for i in range(batches):
            ps.insert(torch.arange(i * CHUNK, (i + 1) * CHUNK), torch.ones(CHUNK, DIM))
            if i == 0:
                print("wrote", flush=True)
    print("done", flush=True)
    return 0


def main(argv: list[str]) -> int:
    kind, url, table = argv[:3]
    try:
        if kind == "loader":
            return _loader(url, table, chunks=int(argv[3]) if len(argv) > 3 else 3)
        return _writer(url, table, batches=int(argv[3]) if len(argv) > 3 else 3000)
    except psclient.PSClientError as e:
        print(f"error {type(e).__name__}: {' '.join(str(e).split())}", flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
