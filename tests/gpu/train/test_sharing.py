"""Training layers sharing their tables with other processes: inference replicas reading
rows while a trainer writes them, two trainers adding to one Redis table, and a run resumed
by a new process over the tables (rows and optimizer state) the first one left."""

from __future__ import annotations

import multiprocessing as mp
import queue
from pathlib import Path
from typing import Any

import pytest
import torch

import psclient
from gpu import LayerType, optim
from tests.conftest import fresh_name
from tests.gpu.layer_tables import DEVICES
from tests.gpu.train import procs
from tests.gpu.train.tables import reference, rows_of, tables

CTX = mp.get_context("spawn")
ROWS, DIM = procs.ROWS, procs.DIM
LR = 0.05
#: float32 rows against torch's reference (as tests/gpu/train/test_differential.py)
TOL = 1e-5
#: how long a spawned process may take to start (imports on a busy 2-core machine)
START_S = 120


def _expect(answers: Any, kind: str, count: int, *, floor: int | None = None,
            timeout: float = START_S) -> list[tuple[Any, ...]]:
    """The next ``count`` messages of ``kind`` from spawned processes (for ``"ack"``: one
    per process of a step at least ``floor``; older acks are skipped); a process's error
    fails the test with its traceback."""
    got: dict[Any, tuple[Any, ...]] = {}
    while len(got) < count:
        try:
            msg = answers.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no {kind!r} from {count - len(got)} process(es) in {timeout} s")
        if msg[0] == "error":
            pytest.fail(f"process {msg[1]} failed:\n{msg[2]}")
        if msg[0] == kind and (floor is None or msg[2] >= floor):
            got[msg[1]] = msg
    return list(got.values())


def _join(processes: list[Any]) -> None:
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"


def _kill(processes: list[Any]) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(timeout=30)


def _batches(gen: torch.Generator, steps: int, n: int = 48
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, target)`` batches with repeated keys over part of the table."""
    return [(torch.randint(0, ROWS * 3 // 4, (n,), generator=gen),
             torch.randn(n, DIM, generator=gen)) for _ in range(steps)]


def _stored(args: dict[str, Any]) -> torch.Tensor:
    """Every stored row (values and optimizer state) of the tables ``args`` names, read
    from the table itself: the shared block, or the parameter server (the source of
    truth)."""
    every = torch.arange(ROWS)
    storage = args["storage"]
    if isinstance(storage, psclient.ParameterServer):
        rows, held = storage.lookup(every)
        assert held.all()
        return rows
    return storage.read(every)


def _check_replica_rows(name: str, seen: dict[tuple[str, int, bytes], int],
                        versions: list[torch.Tensor]) -> int:
    """Every row a replica read of table ``name`` is a version the trainer wrote, no older
    than the last step whose write had returned before the lookup started; returns how
    many rows were read as a mix of such versions, element by element (only a LinearUVM
    table's may be: see the test)."""
    mixed = 0
    for (table, key, raw), floor in seen.items():
        if table != name:
            continue
        row = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        matches = [i for i, v in enumerate(versions) if torch.equal(v[key], row)]
        if matches:
            assert max(matches) >= floor, (
                f"{name} key {key}: a replica read version {max(matches)} in a lookup "
                f"started after step {floor}'s write returned (read-after-write)")
            continue
        later = torch.stack([v[key] for v in versions[floor:]])
        whole = (later == row).any(dim=0).all()
        assert name == "LinearUVM" and whole, (
            f"{name} key {key}: a replica read a row that is no version the trainer wrote "
            f"since step {floor}: {row.tolist()}")
        mixed += 1
    return mixed


@pytest.mark.parametrize("device", DEVICES)
def test_replicas_read_whole_trained_rows(device: str, tmp_path: Path) -> None:
    """The test process trains a LinearUVM layer over a SharedMemBlock and a Hierarchical
    layer over a host cache and a ``file://`` parameter server (RowwiseAdagrad, fp32)
    while two spawned replicas look every key up in a loop with inference layers over the
    same tables. The tables hold ``row_width`` columns (the row and its optimizer state),
    so the replicas are built with ``embedding_size = row_width``: they read whole stored
    rows, state included, and a row torn between two steps would show in either part.

    After each step the trainer records every stored row (read from the tables in its
    own process, and checked against its own lookup); every row a replica returned must
    be one of those versions, and no older than the last step whose write had returned
    when its lookup started (each step waits until each replica has finished a lookup
    that started after it). After the last step the replicas return exactly the final rows.

    Hierarchical rows are read under the host cache's seqlock, whole. A SharedMemBlock
    gates writes against lookups within one process only (docs/layers.md: a write to a
    linear table from another process is ordered by the application), so a LinearUVM
    replica may read a row mixed element by element from two versions written during its
    lookup; it is accepted there only if every element belongs to such a version.
    """
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(ROWS, DIM, generator=gen)
    steps = 8
    batches = _batches(gen, steps)
    width = optim.RowwiseAdagrad(LR).row_width(DIM, torch.float32)
    block, cache = fresh_name(), fresh_name()
    step, stop, answers = CTX.Value("q", 0), procs.StopFlag(CTX, steps), CTX.Queue()
    replicas: list[Any] = []
    with tables(LayerType.LinearUVM, tmp_path, w, optim.RowwiseAdagrad(LR),
                name=block) as uvm_args, \
            tables(LayerType.Hierarchical, tmp_path, w, optim.RowwiseAdagrad(LR),
                   name=cache) as hier_args:
        args = {"LinearUVM": uvm_args, "Hierarchical": hier_args}
        versions = {name: [_stored(a)] for name, a in args.items()}
        try:
            replicas = [CTX.Process(target=procs.replica, name=f"replica-{rid}", args=(
                rid, device, block, cache, f"file://{tmp_path}/{cache}", width, step, stop,
                answers)) for rid in range(2)]
            for p in replicas:
                p.start()
            _expect(answers, "ready", 2)
            layers = {name: procs.make_layer(name, device, optim.RowwiseAdagrad(LR), a)
                      for name, a in args.items()}
            try:
                for i, batch in enumerate(batches, 1):
                    for name, layer in layers.items():
                        procs.train_mse(layer, [batch])
                        rows = _stored(args[name])
                        assert torch.equal(rows_of(layer, torch.arange(ROWS)), rows[:, :DIM])
                        versions[name].append(rows)
                    step.value = i
                    _expect(answers, "ack", 2, floor=i)
            finally:
                for layer in layers.values():
                    layer.close()
            stop.set()
            done = _expect(answers, "done", 2)
            _join(replicas)
        finally:
            _kill(replicas)
    for name, vs in versions.items():
        assert not torch.equal(vs[-1], vs[0])  # NOTE: trained: there was something to tear
        for _, rid, seen, final, lookups in done:
            assert lookups > steps
            torch.testing.assert_close(torch.from_numpy(final[name]), vs[-1], atol=0, rtol=0,
                                       msg=lambda m, n=name, r=rid: f"replica {r}, {n}: {m}")
            mixed = _check_replica_rows(name, seen, vs)
            assert name == "LinearUVM" or mixed == 0


@pytest.mark.redis
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["torch-sgd", "fused-sgd"])
def test_two_trainers_of_one_redis_table_lose_no_step(fused: bool, device: str,
                                                      redis_url: str) -> None:
    """Two spawned processes each train a Hierarchical layer over the same Redis table
    (a parameter server only: each has its own GPU cache, no host cache), with
    ``torch.optim.SGD`` on ``layer.weight`` or with the fused ``gpu.optim.SGD``, on the
    same keys at once (started together by a barrier). The loss ``(out * c).sum()`` gives
    each row the gradient ``c`` per occurrence of its key, whatever the row holds, so the
    final rows are ``init - lr * steps * (count * c_a + count * c_b)`` if no step of
    either trainer was lost (the parameter server adds each row's delta atomically)."""
    name = fresh_name()
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(ROWS, DIM, generator=gen)
    keys = torch.cat([torch.arange(0, 32), torch.arange(0, 32, 3)])  # NOTE: some twice
    cs = [torch.linspace(0.5, 1.5, DIM), torch.linspace(-1.0, 2.0, DIM)]
    lr, steps = 0.0625, 10
    with psclient.connect(redis_url, table=name, dim=DIM, dtype=torch.float32) as ps:
        ps.load(w, progress=False)
    barrier, answers = CTX.Barrier(2), CTX.Queue()
    trainers = [CTX.Process(target=procs.redis_trainer, name=f"trainer-{rid}", args=(
        rid, device, redis_url, name, fused, lr, keys, cs[rid], steps, barrier, answers))
        for rid in range(2)]
    try:
        for p in trainers:
            p.start()
        _expect(answers, "done", 2)
        _join(trainers)
        with psclient.connect(redis_url, table=name) as ps:
            got, held = ps.lookup(torch.arange(ROWS))
    finally:
        _kill(trainers)
        psclient.connect(redis_url, table=name).drop()
    assert held.all()
    count = torch.bincount(keys, minlength=ROWS).float().unsqueeze(1)
    want = w - lr * steps * count * (cs[0] + cs[1])
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    one_lost = want + lr * count * cs[0]  # NOTE: what one lost step of trainer 0 leaves
    assert (one_lost - want).abs().max() > 100 * TOL


def _reference_run(w: torch.Tensor, opt_name: str,
                   batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                   restart_at: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and optimizer state of torch's run over ``batches`` (a new optimizer, its
    state lost, from batch ``restart_at`` on)."""
    ref = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(w)
    ref_opt = reference(procs.make_optimizer(opt_name, LR), ref.parameters(), LR)
    for i, (keys, target) in enumerate(batches):
        if i == restart_at:
            ref_opt = reference(procs.make_optimizer(opt_name, LR), ref.parameters(), LR)
        ref_opt.zero_grad()
        ((ref(keys) - target) ** 2).mean().backward()
        ref_opt.step()
    state = ref_opt.state[ref.weight]["sum"]
    return ref.weight.detach().clone(), state.reshape(ROWS, -1).clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", ["rowwise", "adagrad"])
@pytest.mark.parametrize("layer_type", ["LinearUVM", "Hierarchical"])
def test_a_new_process_resumes_training_from_the_tables(layer_type: str, opt_name: str,
                                                         device: str, tmp_path: Path) -> None:
    """Three steps in the test process (a LinearUVM layer over a SharedMemBlock, or a
    Hierarchical one over a host cache and a ``file://`` parameter server), the layer
    closed; a spawned process attaches the same tables, builds a layer with a new fused
    optimizer, and trains three more steps on the next batches. The rows and optimizer
    state left equal torch's uninterrupted six-step run, which differs from a run whose
    optimizer state is lost at the restart: the state persisted in the tables."""
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(ROWS, DIM, generator=gen)
    batches = _batches(gen, 6)
    want_w, want_s = _reference_run(w, opt_name, batches)
    lost_w, _ = _reference_run(w, opt_name, batches, restart_at=3)
    assert (lost_w - want_w).abs().max() > 100 * TOL  # NOTE: the test can tell them apart
    name = fresh_name()
    ps_url = f"file://{tmp_path}/{name}" if layer_type == "Hierarchical" else None
    answers = CTX.Queue()
    resumed: list[Any] = []
    with tables(LayerType[layer_type], tmp_path, w, procs.make_optimizer(opt_name, LR),
                name=name) as args:
        with procs.make_layer(layer_type, device, procs.make_optimizer(opt_name, LR),
                              args) as layer:
            procs.train_mse(layer, batches[:3])
        try:
            resumed = [CTX.Process(target=procs.resume, name="resume", args=(
                layer_type, device, name, ps_url, opt_name, LR, batches[3:], answers))]
            resumed[0].start()
            _expect(answers, "done", 1)
            _join(resumed)
        finally:
            _kill(resumed)
        stored = _stored(args)
    torch.testing.assert_close(stored[:, :DIM], want_w, atol=TOL, rtol=TOL)
    torch.testing.assert_close(stored[:, DIM:], want_s, atol=TOL, rtol=TOL)
    assert (stored[:, :DIM] - lost_w).abs().max() > 100 * TOL
