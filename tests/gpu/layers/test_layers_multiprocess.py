"""Two processes share one HostCache / SharedMemBlock: one updates, the other sees it next."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

import psclient
from hostcache import HostCache, SharedMemBlock
from tests.gpu import replica

CTX = mp.get_context("spawn")
ROWS, DIM = 256, 8


class Replica:
    def __init__(self, layer_type: str, table: str, ps_url: str | None, device: str) -> None:
        self.commands, self.answers = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=replica.serve,
                                args=(layer_type, table, ps_url, device, self.commands,
                                      self.answers))
        self.proc.start()
        assert self.answers.get(timeout=120) == "ready"

    def call(self, op: str, keys: torch.Tensor, values: torch.Tensor | None = None):
        self.commands.put((op, keys, values))
        return self.answers.get(timeout=60)

    def stop(self) -> None:
        self.commands.put(None)
        assert self.answers.get(timeout=60) == "bye"
        self.proc.join(timeout=30)
        assert self.proc.exitcode == 0


#: (replica a's device, replica b's device)
DEVICES = [
    ("cpu", "cpu"),
    pytest.param(("cuda", "cuda"), marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (each replica registers the shared tables with it)")]),
    pytest.param(("cuda:0", "cuda:1"), marks=[pytest.mark.multigpu, pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (one replica per GPU, each registering the tables)")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer_type", ["LinearUVM", "Hierarchical"])
def test_read_after_write_across_processes(
    table_name: str, tmp_path, layer_type: str, device: tuple[str, str]
) -> None:
    weights = torch.randn(ROWS, DIM)
    ps_url = None
    if layer_type == "LinearUVM":
        table = SharedMemBlock.create(table_name, num_rows=ROWS, dim=DIM)
        table.write(torch.arange(ROWS), weights)
    else:
        table = HostCache.create(table_name, capacity=128, dim=DIM)
        ps_url = f"file://{tmp_path}/ps"
        with psclient.connect(ps_url, table=table_name, dim=DIM, dtype=torch.float32) as ps:
            ps.load(weights, progress=False)
    a = b = None
    try:
        a = Replica(layer_type, table_name, ps_url, device[0])
        b = Replica(layer_type, table_name, ps_url, device[1])
        keys = torch.arange(0, 64)
        for _ in range(2):  # b caches the rows privately
            assert torch.equal(b.call("lookup", keys), weights[keys])
        new = torch.full((8, DIM), 42.0)
        found = a.call("update", keys[:8], new)
        assert found.all()
        expected = weights[keys].clone()
        expected[:8] = 42.0
        assert torch.equal(b.call("lookup", keys), expected)  # b's very next lookup
        assert torch.equal(a.call("lookup", keys), expected)
        a.stop()
        b.stop()
    finally:
        for r in (a, b):
            if r is not None and r.proc.is_alive():
                r.proc.kill()
        table.close()
        type(table).unlink(table_name)
