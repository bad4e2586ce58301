"""Process bodies of the sharing tests (tests/gpu/train/test_sharing.py), importable by a
spawned process: inference replicas reading tables a trainer writes, a trainer of a Redis
table, and a trainer that resumes a run over tables another process trained.

Each body reports on its ``answers`` queue; an exception is sent back as
``("error", who, traceback)`` so the test shows it, and the process exits with status 1.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

ROWS, DIM = 64, 8


def _fail(answers: Any, who: object) -> None:
    answers.put(("error", who, traceback.format_exc()))
    raise SystemExit(1)


def _cache_bytes(width: int) -> int:
    return 16 * width * 4  # NOTE: 16 fp32 rows: most of the 64 keys miss each lookup


def replica(rid: int, device: str, block: str, cache: str, ps_url: str, width: int,
            step: Any, stop: Any, answers: Any) -> None:
    """An inference replica over a LinearUVM table (``block``) and a Hierarchical one
    (host cache ``cache`` over the parameter server ``ps_url``), both of rows of ``width``
    elements: every key looked up in a loop until ``stop`` is set.

    Before each lookup it reads ``step`` (the last training step whose write has
    returned); it records each distinct row it gets per table and key with the highest
    such step it was read after, acknowledges each new step once a whole lookup started
    after it, and keeps the rows of its first lookup after the step ``stop`` names
    (``final``). Sends ``("ready", rid)``, ``("ack", rid, step)``..., then
    ``("done", rid, seen, final, lookups)``.
    """
    from gpu import LayerType, NVEmbedding
    from hostcache import SharedMemBlock

    torch.set_num_threads(1)
    try:
        mb = SharedMemBlock.attach(block)
        layers = {
            "LinearUVM": NVEmbedding(ROWS, width, torch.float32, LayerType.LinearUVM,
                                     storage=mb, gpu_cache_size=_cache_bytes(width),
                                     device=device),
            "Hierarchical": NVEmbedding(ROWS, width, torch.float32, LayerType.Hierarchical,
                                        host_cache=cache, storage=ps_url, table=cache,
                                        gpu_cache_size=_cache_bytes(width), device=device),
        }
        keys = torch.arange(ROWS, device=device)
        seen: dict[tuple[str, int, bytes], int] = {}
        final: dict[str, Any] = {}  # NOTE: numpy: a tensor on a queue outlives no sender
        acked, lookups = -1, 0
        answers.put(("ready", rid))
        while not stop.is_set():
            floor = step.value
            for name, layer in layers.items():
                rows = layer(keys).cpu()
                if floor == stop.last.value and name not in final:
                    final[name] = rows.numpy()
                for k in range(ROWS):
                    entry = (name, k, rows[k].numpy().tobytes())
                    seen[entry] = max(seen.get(entry, -1), floor)
            lookups += 1
            if floor > acked:
                answers.put(("ack", rid, floor))
                acked = floor
        for layer in layers.values():
            layer.close()
        mb.close()
        answers.put(("done", rid, seen, final, lookups))
    except BaseException:  # noqa: BLE001 - reported to the test
        _fail(answers, rid)


class StopFlag:
    """An Event and the step after which a replica keeps its ``final`` rows."""

    def __init__(self, ctx: Any, last: int) -> None:
        self.event = ctx.Event()
        self.last = ctx.Value("q", last)

    def is_set(self) -> bool:
        return self.event.is_set()

    def set(self) -> None:
        self.event.set()


def redis_trainer(rid: int, device: str, url: str, table: str, fused: bool, lr: float,
                  keys: torch.Tensor, c: torch.Tensor, steps: int, barrier: Any,
                  answers: Any) -> None:
    """``steps`` steps of ``loss = (layer(keys) * c).sum()`` on a Hierarchical layer over
    the Redis table only (no host cache): the gradient of a row is ``c`` per occurrence of
    its key. ``fused``: gpu.optim.SGD inside backward; else torch.optim.SGD on
    ``layer.weight``. Starts when every trainer has built its layer (``barrier``)."""
    from gpu import LayerType, NVEmbedding, optim

    torch.set_num_threads(1)
    try:
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, storage=url,
                            table=table, gpu_cache_size=_cache_bytes(DIM), device=device,
                            optimize_for_training=True,
                            optimizer=optim.SGD(lr) if fused else None)
        opt = None if fused else torch.optim.SGD(layer.parameters(), lr=lr)
        keys, c = keys.to(device), c.to(device)
        barrier.wait(timeout=120)
        for _ in range(steps):
            if opt is not None:
                opt.zero_grad()
            (layer(keys) * c).sum().backward()
            if opt is not None:
                opt.step()
        layer.close()
        answers.put(("done", rid))
    except BaseException:  # noqa: BLE001 - reported to the test
        _fail(answers, rid)


def make_optimizer(name: str, lr: float) -> Any:
    from gpu import optim

    return {"adagrad": optim.Adagrad, "rowwise": optim.RowwiseAdagrad}[name](lr)


def make_layer(layer_type: str, device: str, opt: Any, tables: dict[str, Any]) -> Any:
    """A training layer of ``ROWS`` x ``DIM`` fp32 rows over existing tables (no
    ``weight_init``: their rows and state are kept)."""
    from gpu import LayerType, NVEmbedding

    width = opt.row_width(DIM, torch.float32)
    return NVEmbedding(ROWS, DIM, torch.float32, LayerType[layer_type], device=device,
                       optimize_for_training=True, optimizer=opt,
                       **{"gpu_cache_size": _cache_bytes(width), **tables})


def train_mse(layer: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One step of mean squared error per ``(keys, target)`` batch."""
    for keys, target in batches:
        out = layer(keys.to(layer.device))
        ((out - target.to(layer.device)) ** 2).mean().backward()


def resume(layer_type: str, device: str, name: str, ps_url: str | None, opt_name: str,
           lr: float, batches: list[tuple[torch.Tensor, torch.Tensor]],
           answers: Any) -> None:
    """Attach the tables another process trained (a SharedMemBlock for LinearUVM, a host
    cache over a ``file://`` parameter server for Hierarchical), build a layer with a new
    fused optimizer over them, train ``batches``, close; sends ``("done", layer_type)``."""
    from hostcache import SharedMemBlock

    torch.set_num_threads(1)
    try:
        block = None
        if layer_type == "LinearUVM":
            block = SharedMemBlock.attach(name)
            tables: dict[str, Any] = {"storage": block}
        else:
            tables = {"host_cache": name, "storage": ps_url, "table": name}
        with make_layer(layer_type, device, make_optimizer(opt_name, lr), tables) as layer:
            train_mse(layer, batches)
        if block is not None:
            block.close()
        answers.put(("done", layer_type))
    except BaseException:  # noqa: BLE001 - reported to the test
        _fail(answers, layer_type)
