"""User errors of training layers: each raises a typed error of ``gpu.errors`` whose
message says what to do, and changes nothing (no row, no optimizer state, no table left
open). Also what is not an error but easy to take for one: a gradient holding NaN or an
infinity (those rows are skipped and counted), and an inference layer under grad mode (its
rows are not trained).

Real layers over real tables, on every device of ``DEVICES``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import psclient
from gpu import BadArgumentError, LayerType, NVEmbedding, NVEmbeddingBag, optim
from gpu.train import wide
from hostcache import HostCache, SharedMemBlock
from tests.conftest import fresh_name
from tests.gpu.layer_tables import DEVICES
from tests.gpu.train.tables import TYPES, rows_of, tables, width

ROWS, DIM, LR = 24, 4, 0.1
ME = os.getpid()


def _weights(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3)).to(dtype)


def _bits(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as integers of their width: compared bit for bit (a 16-bit table's float32
    state read as two halves may look like NaN, which never equals itself)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return rows.cpu().contiguous().view(ints[rows.element_size()])


@contextlib.contextmanager
def _trained_tables(layer_type: LayerType, tmp_path: Path, w: torch.Tensor,
                    opt: optim.Optimizer | None, device: str) -> Iterator[dict[str, Any]]:
    """``tables``' layer arguments, except that a GPULayer gets its table (rows of
    ``row_width``, zero state) as ``storage=`` on ``device``, so that the test reads the
    stored rows of every layer type from the table itself (:func:`_stored`)."""
    if layer_type is LayerType.GPULayer:
        yield {"storage": wide.pad(w, width(opt, DIM, w.dtype)).to(device)}
        return
    with tables(layer_type, tmp_path, w, opt) as args:
        yield args


def _stored(args: dict[str, Any]) -> torch.Tensor:
    """Every stored row (values and optimizer state) of the table ``args`` names, on the
    CPU: a GPULayer's tensor, the SharedMemBlock, or the parameter server (the source of
    truth of a Hierarchical layer)."""
    storage, keys = args["storage"], torch.arange(ROWS)
    if isinstance(storage, torch.Tensor):
        return storage.cpu().clone()
    if isinstance(storage, psclient.ParameterServer):
        rows, held = storage.lookup(keys)
        assert bool(held.all())
        return rows
    return storage.read(keys)


# -- optimizer= ------------------------------------------------------------------------


def _torch_sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)


NOT_OPTIMIZERS: dict[str, Callable[[], object]] = {
    "torch.optim.SGD": _torch_sgd,
    "torch.optim.SGD class": lambda: torch.optim.SGD,
    "gpu.optim.SGD class": lambda: optim.SGD,
    "string": lambda: "sgd",
    "lr": lambda: LR,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("what", list(NOT_OPTIMIZERS))
def test_an_optimizer_that_is_not_gpu_optims_is_refused(what: str, device: str,
                                                        tmp_path: Path) -> None:
    """``optimizer=`` takes one of gpu.optim's; a torch optimizer, a class or a name raise
    before any table is touched: the SharedMemBlock keeps its rows and serves a layer."""
    w = _weights()
    with tables(LayerType.LinearUVM, tmp_path, w, None) as args:
        with pytest.raises(BadArgumentError, match=r"optimizer must be one of gpu\.optim"):
            NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, device=device,
                        optimize_for_training=True,
                        optimizer=NOT_OPTIMIZERS[what](), **args)  # type: ignore[arg-type]
        assert torch.equal(args["storage"].read(torch.arange(ROWS)), w)
        with NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, device=device,
                         optimize_for_training=True, **args) as layer:
            assert torch.equal(rows_of(layer, torch.arange(ROWS)), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train", [False, None], ids=["False", "default"])
def test_an_optimizer_without_optimize_for_training_is_refused(train: bool | None,
                                                               device: str) -> None:
    kw: dict[str, Any] = {} if train is None else {"optimize_for_training": train}
    with pytest.raises(BadArgumentError, match=r"pass optimize_for_training=True"):
        NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device=device,
                    weight_init=_weights(), optimizer=optim.RowwiseAdagrad(LR), **kw)
    with NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device=device,
                     weight_init=_weights(), optimize_for_training=True,
                     optimizer=optim.RowwiseAdagrad(LR)) as layer:  # the fix works
        assert layer.row_width == DIM + 1


# -- the optimizers' settings ------------------------------------------------------------

#: (optimizer, the setting) pairs whose value must be a finite positive number
RATES = [(optim.SGD, "lr"), (optim.Adagrad, "lr"), (optim.Adagrad, "eps"),
         (optim.RowwiseAdagrad, "lr"), (optim.RowwiseAdagrad, "eps"), (optim.Adam, "lr"),
         (optim.Adam, "eps")]
NOT_RATES = [0, 0.0, -1, -1e-3, math.nan, math.inf, -math.inf, True, False, "0.1", None,
             torch.tensor(0.1), [0.1]]


def _build(cls: type, **kw: object) -> optim.Optimizer:
    if cls is optim.SGD:
        kw.setdefault("lr", LR)
    return cls(**kw)


@pytest.mark.parametrize("value", NOT_RATES, ids=repr)
@pytest.mark.parametrize(("cls", "arg"), RATES, ids=lambda x: getattr(x, "__name__", x))
def test_a_rate_that_is_not_a_finite_positive_number_is_refused(cls: type, arg: str,
                                                                value: object) -> None:
    with pytest.raises(BadArgumentError, match=rf"^{arg} must be a finite positive number"):
        _build(cls, **{arg: value})


@pytest.mark.parametrize(("cls", "arg"), RATES, ids=lambda x: getattr(x, "__name__", x))
def test_finite_positive_rates_are_taken_as_floats(cls: type, arg: str) -> None:
    """The check above refuses only what it should: ints and tiny or large floats pass."""
    for value in (1, 1e-12, 0.5, 1e6):
        opt = _build(cls, **{arg: value})
        assert getattr(opt, arg) == float(value) and type(getattr(opt, arg)) is float


NOT_BETAS = [(0, 0.9), (1, 0.9), (0.9, 1.0), (0.9, 0), (-0.1, 0.9), (0.9, 1.5),
             (math.nan, 0.9), (0.9, math.inf), (True, 0.9), ("0.9", 0.999), (0.9,),
             (0.9, 0.99, 0.999), (), 0.9, None, "ab"]


@pytest.mark.parametrize("betas", NOT_BETAS, ids=repr)
def test_adam_betas_outside_the_unit_interval_or_not_a_pair_are_refused(betas: object
                                                                        ) -> None:
    with pytest.raises(BadArgumentError, match=r"^betas(\[[01]\])? must be "):
        optim.Adam(LR, betas=betas)  # type: ignore[arg-type]
    assert optim.Adam(LR, betas=[0.5, 0.75]).betas == (0.5, 0.75)  # type: ignore[arg-type]


# -- tables of the wrong width -----------------------------------------------------------

#: (optimizer, dtype): the width differs by dtype (a float32 of state takes two 16-bit
#: elements)
WIDE = {"rowwise-fp32": (lambda: optim.RowwiseAdagrad(LR), torch.float32),
        "adam-fp16": (lambda: optim.Adam(LR), torch.float16)}


def _check_width_error(error: pytest.ExceptionInfo[BadArgumentError],
                       opt: optim.Optimizer, dtype: torch.dtype) -> None:
    want = opt.row_width(DIM, dtype)
    assert want != DIM
    msg = str(error.value)
    assert f"optimizer.row_width({DIM}, {dtype}) = {want} elements" in msg, msg
    assert type(opt).__name__ in msg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(WIDE))
def test_a_shared_block_of_dim_columns_under_a_fused_optimizer_is_refused(
        case: str, device: str) -> None:
    """A SharedMemBlock of ``dim`` columns under a LinearUVM layer with a fused
    optimizer: the message names ``row_width``; the block is left as it was and usable
    (on CUDA: not left registered, so an inference layer over it registers it again)."""
    make, dtype = WIDE[case]
    opt, name, w = make(), fresh_name(), _weights(dtype)
    with SharedMemBlock.create(name, num_rows=ROWS, dim=DIM, dtype=dtype) as mb:
        try:
            mb.write(torch.arange(ROWS), w)
            with pytest.raises(BadArgumentError, match="row_width") as e:
                NVEmbedding(ROWS, DIM, dtype, LayerType.LinearUVM, storage=mb,
                            gpu_cache_size=2**14, device=device, optimize_for_training=True,
                            optimizer=opt)
            _check_width_error(e, opt, dtype)
            assert torch.equal(_bits(mb.read(torch.arange(ROWS))), _bits(w))
            new = _weights(dtype).flip(0)
            mb.write(torch.arange(ROWS), new)
            with NVEmbedding(ROWS, DIM, dtype, LayerType.LinearUVM, storage=mb,
                             gpu_cache_size=2**14, device=device,
                             optimize_for_training=True) as layer:
                assert torch.equal(rows_of(layer, torch.arange(ROWS)), new.float())
        finally:
            SharedMemBlock.unlink(name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(WIDE))
def test_a_gpulayer_storage_tensor_of_dim_columns_is_refused(case: str, device: str
                                                             ) -> None:
    make, dtype = WIDE[case]
    opt, w = make(), _weights(dtype).to(device)
    table = w.clone()
    with pytest.raises(BadArgumentError, match="row_width") as e:
        NVEmbedding(ROWS, DIM, dtype, LayerType.GPULayer, storage=table, device=device,
                    optimize_for_training=True, optimizer=opt)
    _check_width_error(e, opt, dtype)
    assert torch.equal(_bits(table), _bits(w))
    stored = wide.pad(w, opt.row_width(DIM, dtype))
    with NVEmbedding(ROWS, DIM, dtype, LayerType.GPULayer, storage=stored, device=device,
                     optimize_for_training=True, optimizer=opt) as layer:  # the fix works
        assert torch.equal(rows_of(layer, torch.arange(ROWS)), w.float().cpu())


@contextlib.contextmanager
def _host_tables(tmp_path: Path, dtype: torch.dtype, host_dim: int, ps_dim: int
                 ) -> Iterator[tuple[str, HostCache, psclient.ParameterServer]]:
    name = fresh_name()
    with HostCache.create(name, capacity=32, dim=host_dim, dtype=dtype, ways=4) as hc:
        try:
            with psclient.connect(f"file://{tmp_path}/{name}", table=name, dim=ps_dim,
                                  dtype=dtype) as ps:
                ps.load(wide.pad(_weights(dtype), ps_dim), progress=False)
                yield name, hc, ps
        finally:
            HostCache.unlink(name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("narrow", ["host cache", "parameter server"])
@pytest.mark.parametrize("case", list(WIDE))
def test_hierarchical_tables_of_dim_columns_are_refused(case: str, narrow: str,
                                                        device: str, tmp_path: Path) -> None:
    """A host cache (attached by name) or a parameter server of ``dim`` columns under a
    Hierarchical layer with a fused optimizer: the message names ``row_width``, the host
    cache the layer attached is detached again, and both tables serve as before."""
    make, dtype = WIDE[case]
    opt = make()
    wide_dim = opt.row_width(DIM, dtype)
    host_dim, ps_dim = (DIM, wide_dim) if narrow == "host cache" else (wide_dim, DIM)
    with _host_tables(tmp_path, dtype, host_dim, ps_dim) as (name, hc, ps):
        with pytest.raises(BadArgumentError, match="row_width") as e:
            NVEmbedding(ROWS, DIM, dtype, LayerType.Hierarchical, host_cache=name,
                        storage=ps, gpu_cache_size=2**14, device=device,
                        optimize_for_training=True, optimizer=opt)
        _check_width_error(e, opt, dtype)
        assert narrow in str(e.value)
        assert hc.attached_pids().count(ME) == 1  # the test's own handle only
        rows, held = ps.lookup(torch.arange(ROWS))
        assert bool(held.all())
        assert torch.equal(_bits(rows), _bits(wide.pad(_weights(dtype), ps_dim)))
        hc.insert(torch.arange(2), torch.ones(2, host_dim, dtype=dtype))
        assert bool(hc.lookup(torch.arange(2))[1].all())


@pytest.mark.parametrize("device", DEVICES)
def test_a_parameter_server_url_of_dim_columns_is_refused(device: str, tmp_path: Path
                                                          ) -> None:
    opt, dtype, name = optim.RowwiseAdagrad(LR), torch.float32, fresh_name()
    url = f"file://{tmp_path}/{name}"
    psclient.connect(url, table=name, dim=DIM, dtype=dtype).close()  # a table of dim columns
    with HostCache.create(name, capacity=32, dim=opt.row_width(DIM, dtype), dtype=dtype,
                          ways=4) as hc:
        try:
            with pytest.raises(BadArgumentError, match="row_width"):
                NVEmbedding(ROWS, DIM, dtype, LayerType.Hierarchical, host_cache=hc,
                            storage=url, table=name, gpu_cache_size=2**14, device=device,
                            optimize_for_training=True, optimizer=opt)
        finally:
            HostCache.unlink(name)


# -- non-finite gradients ----------------------------------------------------------------

KEYS = torch.tensor([1, 2, 2, 3, 3, 5, 6, 6])
#: occurrences whose gradient is not finite: both of key 2, the first of key 3
BAD = (1, 2, 3)
#: how each optimizer is made: None is torch.optim.SGD on layer.weight
SKIPPING = {"rowwise": lambda: optim.RowwiseAdagrad(LR), "sgd": lambda: optim.SGD(LR),
            "torch-sgd": lambda: None}


def _gradient(dtype: torch.dtype) -> torch.Tensor:
    """The batch's gradient of the lookup's output ``[8, DIM]`` as float32; good entries
    are exact in every dtype. float32: NaN and infinities. float16: finite values that
    overflow when autograd casts the gradient to the output's dtype."""
    i = torch.arange(KEYS.numel())[:, None] + torch.arange(DIM)
    g = 0.25 * (i % 4 + 1).float()
    big = [math.inf, math.nan, -math.inf] if dtype == torch.float32 else [1e5, -1e5, 7e4]
    for occurrence, value in zip(BAD, big, strict=True):
        g[occurrence, occurrence % DIM] = value
    return g



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("opt_name", list(SKIPPING))
@pytest.mark.parametrize("layer_type", TYPES, ids=lambda t: t.name)
def test_rows_whose_gradient_is_not_finite_are_skipped_and_counted(
        layer_type: LayerType, opt_name: str, dtype: torch.dtype, device: str,
        tmp_path: Path) -> None:
    """A step over keys ``KEYS`` whose gradient holds NaN or infinities for both
    occurrences of key 2 and the first of key 3 (gpu/train/step.py):

    * fused SGD on a linear table (GPULayer, LinearUVM) adds ``-lr * grad`` per
      occurrence: the 3 bad occurrences are skipped and counted, so row 2 keeps its value
      and row 3 takes its good occurrence only;
    * the other steps sum the gradient per key first (a torch optimizer's gradient is
      coalesced): keys 2 and 3 are skipped, values and optimizer state bit for bit, and
      counted once each.

    Rows 1, 5, 6 change (and their state), untouched rows do not; a later finite step
    trains the skipped rows and adds nothing to the count."""
    opt = SKIPPING[opt_name]()
    per_occurrence = isinstance(opt, optim.SGD) and layer_type is not LayerType.Hierarchical
    w = _weights(dtype)
    with _trained_tables(layer_type, tmp_path, w, opt, device) as args, \
            NVEmbedding(ROWS, DIM, dtype, layer_type, device=device,
                        optimize_for_training=True, optimizer=opt, **args) as layer:
        torch_opt = torch.optim.SGD(layer.parameters(), lr=LR) if opt is None else None
        before = _stored(args)
        g = _gradient(dtype)
        out = layer(KEYS.to(device))
        (out.float() * g.to(device)).sum().backward()
        if torch_opt is not None:
            grad = layer.weight.grad
            assert grad is not None and grad.is_sparse and grad.is_coalesced()
            bad = ~torch.isfinite(grad.values().float()).all(dim=1)
            assert grad.indices()[0][bad].tolist() == [2, 3]  # the gradient reached it
            torch_opt.step()
        else:
            assert layer.weight.grad is None
        after = _stored(args)
        assert layer.skipped_rows() == (len(BAD) if per_occurrence else 2)

        kept = [2] if per_occurrence else [2, 3]
        untouched = [k for k in range(ROWS) if k not in KEYS.tolist()]
        assert torch.equal(_bits(after[kept + untouched]), _bits(before[kept + untouched]))
        trained = [1, 5, 6] + ([3] if per_occurrence else [])
        for k in trained:
            assert not torch.equal(after[k, :DIM], before[k, :DIM]), k
            assert bool(torch.isfinite(after[k, :DIM]).all()), k
        if per_occurrence:  # row 3 took its good occurrence (4) only, rounded as stored
            delta = (-LR * g[4].to(dtype).float()).to(dtype).float()
            want = (before[3].float() + delta).to(dtype)
            torch.testing.assert_close(after[3], want, rtol=0,
                                       atol=1e-6 if dtype == torch.float32 else 1e-3)
        if width(opt, DIM, dtype) > DIM:  # RowwiseAdagrad: the state of trained rows grew
            state = wide.split(after, DIM)[1]
            assert bool((state[[1, 5, 6]] > 0).all())
        torch.testing.assert_close(rows_of(layer, torch.arange(ROWS)),
                                   after[:, :DIM].float())  # the layer reads them

        # a finite step trains the skipped rows; the count stays
        if torch_opt is not None:
            torch_opt.zero_grad()
        layer(torch.tensor([2, 3], device=device)).float().sum().backward()
        if torch_opt is not None:
            torch_opt.step()
        again = _stored(args)
        assert layer.skipped_rows() == (len(BAD) if per_occurrence else 2)
        for k in (2, 3):
            assert not torch.equal(again[k, :DIM], after[k, :DIM]), k


# -- writes of layer.weight around the layer ---------------------------------------------

AROUND: dict[str, Callable[[torch.Tensor], object]] = {
    "mul_": lambda weight: weight.mul_(2),
    "zero_": lambda weight: weight.zero_(),
    "add_ dense": lambda weight: weight.add_(torch.ones(ROWS, DIM, device=weight.device)),
    "add_ dense alpha": lambda weight: weight.add_(torch.ones_like(weight), alpha=-LR),
    "copy_": lambda weight: weight.copy_(torch.zeros(ROWS, DIM)),
    "sub_ sparse": lambda weight: weight.sub_(
        torch.ones(ROWS, DIM, device=weight.device).to_sparse(1)),
    "index_put_": lambda weight: weight.index_put_(
        (torch.tensor([1], device=weight.device),), torch.ones(DIM, device=weight.device)),
    "nn.init.zeros_": lambda weight: torch.nn.init.zeros_(weight),
    # NOTE: nn.init's normal_ / uniform_ hand the tensor over by keyword (tensor=)
    "nn.init.normal_": lambda weight: torch.nn.init.normal_(weight),
    "nn.init.uniform_": lambda weight: torch.nn.init.uniform_(weight),
    "setitem": lambda weight: weight.__setitem__(3, 7.0),
    "out=": lambda weight: torch.add(weight, 1, out=weight),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_mode", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("write", list(AROUND))
@pytest.mark.parametrize("layer_type", TYPES, ids=lambda t: t.name)
def test_in_place_writes_of_weight_other_than_the_sparse_add_are_refused(
        layer_type: LayerType, write: str, grad_mode: bool, device: str,
        tmp_path: Path) -> None:
    w = _weights()
    with tables(layer_type, tmp_path, w, None) as args, \
            NVEmbedding(ROWS, DIM, torch.float32, layer_type, device=device,
                        optimize_for_training=True, **args) as layer:
        with torch.set_grad_enabled(grad_mode), \
                pytest.raises(BadArgumentError, match=r"layer\.update.*accumulate"):
            AROUND[write](layer.weight)
        assert torch.equal(rows_of(layer, torch.arange(ROWS)), w)
        # the optimizer's sparse add still works
        opt = torch.optim.SGD(layer.parameters(), lr=LR)
        layer(torch.tensor([0], device=device)).sum().backward()
        opt.step()
        assert not torch.equal(rows_of(layer, torch.tensor([0])), w[:1])


COPIES: dict[str, Callable[[Any], object]] = {
    "copy.deepcopy(weight)": lambda layer: copy.deepcopy(layer.weight),
    "copy.copy(weight)": lambda layer: copy.copy(layer.weight),
    "pickle.dumps(weight)": lambda layer: pickle.dumps(layer.weight),
    "torch.save(weight)": lambda layer: torch.save(layer.weight, io.BytesIO()),
    "copy.deepcopy(layer)": lambda layer: copy.deepcopy(layer),
    "pickle.dumps(layer)": lambda layer: pickle.dumps(layer),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("layer_type", TYPES, ids=lambda t: t.name)
def test_weight_is_neither_copied_nor_pickled(layer_type: LayerType, how: str, device: str,
                                              tmp_path: Path) -> None:
    """``weight`` stands for the tables: copying or pickling it (or the layer) raises and
    points at ``state_dict()``, which does copy and pickle."""
    w = _weights()
    with tables(layer_type, tmp_path, w, None) as args, \
            NVEmbedding(ROWS, DIM, torch.float32, layer_type, device=device,
                        optimize_for_training=True, **args) as layer:
        with pytest.raises(BadArgumentError, match=r"layer\.state_dict\(\)"):
            COPIES[how](layer)
        sd = pickle.loads(pickle.dumps(layer.state_dict()))
        assert copy.deepcopy(layer.state_dict()).keys() == sd.keys()
        if "weight" in sd:
            assert torch.equal(sd["weight"].cpu(), w)
        assert torch.equal(rows_of(layer, torch.arange(ROWS)), w)


# -- inference layers ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [NVEmbedding, NVEmbeddingBag], ids=lambda c: c.__name__)
@pytest.mark.parametrize("layer_type", TYPES, ids=lambda t: t.name)
def test_an_inference_layer_is_not_trained(layer_type: LayerType, cls: type, device: str,
                                           tmp_path: Path) -> None:
    """Without ``optimize_for_training`` a layer has no parameter and its output no
    autograd history, under grad mode too: a loss that also depends on a real parameter
    backpropagates into that parameter only, and the layer's rows stay."""
    w = _weights()
    with tables(layer_type, tmp_path, w, None) as args, \
            cls(ROWS, DIM, torch.float32, layer_type, device=device, **args) as layer:
        assert list(layer.parameters()) == [] and layer.skipped_rows() == 0
        head = torch.nn.Parameter(torch.full((DIM,), 2.0, device=device))
        keys = torch.tensor([[1, 2], [2, 7]], device=device)
        assert torch.is_grad_enabled()
        out = layer(keys)
        assert out.grad_fn is None and not out.requires_grad
        loss = (out * head).sum()
        loss.backward()
        pooled = w[keys.cpu()].sum(dim=-2) if cls is NVEmbeddingBag else w[keys.cpu()]
        assert head.grad is not None
        torch.testing.assert_close(head.grad.cpu(), pooled.reshape(-1, DIM).sum(0))
        assert torch.equal(rows_of(layer, torch.arange(ROWS)), w)
        assert layer.skipped_rows() == 0
