"""Checkpoints of the layers (gpu.state): state_dict views, load_state_dict through the
write path, nn.Embedding / nn.EmbeddingBag / TorchRec checkpoints, and
torch.distributed.checkpoint save/load in one process, for every layer type and storage,
NVEmbedding and NVEmbeddingBag, on the CPU and (when present) CUDA."""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import psclient
from gpu import DistMemBlock, LayerClosedError, LayerType, NVEmbedding, NVEmbeddingBag, state
from gpu.state import StateDictError
from hostcache import HostCache, SharedMemBlock
from tests.conftest import fresh_name

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU")])]
ROWS, DIM = 40, 8
#: (layer type, storage kind)
STACKS = [(LayerType.GPULayer, "tensor"), (LayerType.GPULayer, "memblock"),
          (LayerType.GPULayer, "distmem"), (LayerType.LinearUVM, "memblock"),
          (LayerType.LinearUVM, "distmem"), (LayerType.Hierarchical, "hostcache+ps")]
LINEAR = [s for s in STACKS if s[0] is not LayerType.Hierarchical]
CLASSES = [NVEmbedding, NVEmbeddingBag]


class Tables:
    """One storage of a kind (and, for Hierarchical, a parameter server kept across
    host caches); every table it made is removed on close."""

    def __init__(self, kind: str, device: str, stack: contextlib.ExitStack,
                 ps_dir: str | None = None) -> None:
        self.kind, self.device, self.stack = kind, device, stack
        self.ps_dir = ps_dir or stack.enter_context(tempfile.TemporaryDirectory())
        self.ps_name = "ps"

    def args(self) -> dict[str, Any]:
        """A fresh storage (of zeros; Hierarchical: a fresh host cache, the same PS)."""
        s = self.stack
        if self.kind == "tensor":
            self.storage: Any = torch.zeros(ROWS, DIM, device=self.device)
            return {"storage": self.storage}
        if self.kind == "memblock":
            mb = SharedMemBlock.create(fresh_name(), num_rows=ROWS, dim=DIM)
            s.callback(SharedMemBlock.unlink, mb.name)
            s.callback(mb.close)
            self.storage = mb
            return {"storage": mb}
        if self.kind == "distmem":
            block = DistMemBlock(ROWS, DIM, devices=[self.device], name=fresh_name())
            s.callback(block.close)
            self.storage = block
            return {"storage": block}
        hc = HostCache.create(fresh_name(), capacity=4 * ROWS, dim=DIM)
        s.callback(HostCache.unlink, hc.name)
        s.callback(hc.close)
        ps = psclient.connect(f"file://{self.ps_dir}", table=self.ps_name, dim=DIM)
        s.callback(ps.close)
        self.storage = ps
        return {"host_cache": hc, "storage": ps, "default_row": 0.0}

    def rows(self) -> torch.Tensor:
        """The table's rows as its storage holds them (CPU)."""
        keys = torch.arange(ROWS)
        if self.kind == "tensor":
            return self.storage.cpu().clone()
        if self.kind == "distmem":
            return self.storage.read(keys.to(self.storage.view().device)).cpu()
        if self.kind == "memblock":
            return self.storage.read(keys).clone()
        return self.storage.lookup(keys)[0].cpu()


def make_layer(cls: type, layer_type: LayerType, args: dict[str, Any], device: str) -> Any:
    cache = 0 if layer_type is LayerType.GPULayer else ROWS * (12 + 4 * DIM)
    extra = {"mode": "sum"} if cls is NVEmbeddingBag else {}
    return cls(ROWS, DIM, torch.float32, layer_type, gpu_cache_size=cache, device=device,
               **args, **extra)


class Model(torch.nn.Module):
    """A model as a user's: a dense layer and an embedding layer named ``emb``."""

    dense: torch.nn.Linear
    emb: Any

    def __init__(self, emb: torch.nn.Module) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(DIM, 2)
        self.emb = emb


def lookup(layer: Any, device: str) -> torch.Tensor:
    """Every row through the layer (a bag layer: one key per bag), on the CPU."""
    keys = torch.arange(ROWS, device=device)
    if isinstance(layer, NVEmbeddingBag | torch.nn.EmbeddingBag):
        out = layer(keys, torch.arange(ROWS, device=device))
    else:
        out = layer(keys)
    return out.detach().cpu()


def reference(cls: type, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    if cls is NVEmbeddingBag:
        return torch.nn.EmbeddingBag(ROWS, DIM, mode="sum")
    return torch.nn.Embedding(ROWS, DIM)


@contextlib.contextmanager
def tables(kind: str, device: str) -> Iterator[Tables]:
    with contextlib.ExitStack() as stack:
        yield Tables(kind, device, stack)


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """dcp warns that it assumes one process (no process group): that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        yield


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layer_type", "kind"), LINEAR)
def test_state_dict_weight_is_the_table_itself(device: str, layer_type: LayerType,
                                               kind: str) -> None:
    with tables(kind, device) as t:
        layer = make_layer(NVEmbedding, layer_type, t.args(), device)
        sd = Model(layer).state_dict()
        assert set(sd) == {"dense.weight", "dense.bias", "emb.weight"}
        weight = sd["emb.weight"]
        assert weight.shape == (ROWS, DIM) and weight.dtype == torch.float32
        assert weight.data_ptr() == layer.state_dict()["weight"].data_ptr()
        if kind == "tensor":
            assert weight.data_ptr() == t.storage.data_ptr()
        # no copy: a write through the view is in the storage itself
        weight[3] = 7.0
        if weight.is_cuda:
            torch.cuda.synchronize()
        assert torch.equal(t.rows()[3], torch.full((DIM,), 7.0))
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_hierarchical_state_names_its_tables_and_copies_no_row(device: str) -> None:
    with tables("hostcache+ps", device) as t:
        args = t.args()
        layer = make_layer(NVEmbedding, LayerType.Hierarchical, args, device)
        sd = Model(layer).state_dict()
        assert set(sd) == {"dense.weight", "dense.bias", "emb._extra_state"}
        extra = sd["emb._extra_state"]
        assert extra["layer_type"] == "Hierarchical"
        assert extra["host_cache"] == args["host_cache"].name
        assert extra["table"] == t.ps_name
        assert extra["url"] == f"file://{t.ps_dir}"
        assert (extra["num_embeddings"], extra["embedding_size"]) == (ROWS, DIM)
        assert not any(isinstance(v, torch.Tensor) for v in extra.values())
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("layer_type", "kind"), STACKS)
def test_load_state_dict_of_an_nn_embedding_model(device: str, cls: type,
                                                  layer_type: LayerType, kind: str) -> None:
    ref = Model(reference(cls))
    with tables(kind, device) as t:
        args = t.args()
        model = Model(make_layer(cls, layer_type, args, device))
        # a replica over the same tables, its caches warm with the old rows
        replica = make_layer(cls, layer_type, args, device)
        before = lookup(replica, device)
        replica.flush()
        result = model.load_state_dict(ref.state_dict(), strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        want = lookup(ref.emb, "cpu")
        assert not torch.equal(before, want)
        assert torch.equal(lookup(model.emb, device), want)
        assert torch.equal(lookup(replica, device), want)  # its cached rows were dropped
        assert torch.equal(t.rows(), ref.emb.weight.detach())
        assert torch.equal(model.dense.weight, ref.dense.weight)
        replica.close()
        model.emb.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("layer_type", "kind"), STACKS)
def test_dcp_round_trip_into_a_fresh_layer_over_fresh_tables(
        device: str, cls: type, layer_type: LayerType, kind: str) -> None:
    ref = reference(cls, seed=1)
    with tables(kind, device) as t, tempfile.TemporaryDirectory() as ckpt:
        model = Model(make_layer(cls, layer_type, t.args(), device))
        model.load_state_dict(Model(ref).state_dict())
        want = lookup(model.emb, device)
        with quiet_dcp():
            dcp.save(model.state_dict(), checkpoint_id=ckpt)
            # fresh tables (Hierarchical: a fresh host cache over the parameter server the
            # checkpoint names), a fresh layer and model whose rows differ
            fresh = Model(make_layer(cls, layer_type, t.args(), device))
            if layer_type is not LayerType.Hierarchical:
                assert not torch.equal(lookup(fresh.emb, device), want)
                fresh.emb.flush()  # its GPU cache holds the old rows (LinearUVM)
            sd = fresh.state_dict()
            dcp.load(sd, checkpoint_id=ckpt)
        fresh.load_state_dict(sd, strict=True)
        assert torch.equal(lookup(fresh.emb, device), want)
        assert torch.equal(fresh.dense.weight, model.dense.weight)
        assert torch.equal(t.rows(), ref.weight.detach())
        model.emb.close()
        fresh.emb.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layer_type", "kind"), STACKS)
def test_a_checkpoint_that_does_not_fit_raises_and_writes_nothing(
        device: str, layer_type: LayerType, kind: str) -> None:
    with tables(kind, device) as t:
        layer = make_layer(NVEmbedding, layer_type, t.args(), device)
        layer.load_state_dict(reference(NVEmbedding).state_dict())
        held, seen = t.rows(), lookup(layer, device)
        good = torch.randn(ROWS, DIM)
        nan = good.clone()
        nan[ROWS - 1, 0] = float("nan")
        bad = {"rows": torch.randn(ROWS + 1, DIM), "dim": torch.randn(ROWS, DIM + 1),
               "dtype": good.to(torch.float16), "nan": nan, "kind": [[0.0] * DIM] * ROWS}
        for what, value in bad.items():
            with pytest.raises(StateDictError) as err:
                layer.load_state_dict({"weight": value})
            message = str(err.value)
            assert "\n" not in message and "nothing was written" in message, what
            if kind != "tensor":  # the table is named
                name = t.ps_name if kind == "hostcache+ps" else t.storage.name
                assert repr(name) in message, (what, message)
            assert torch.equal(t.rows(), held), what
            assert torch.equal(lookup(layer, device), seen), what
        # a model-level check first: a later layer's misfit leaves earlier ones unwritten
        two = torch.nn.ModuleDict({"a": layer, "b": torch.nn.Linear(2, 2)})
        with pytest.raises(StateDictError):
            state.check_state_dict(two, {"a.weight": bad["dim"]})
        assert torch.equal(t.rows(), held)
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_hierarchical_checkpoint_of_another_table_is_refused(device: str) -> None:
    with tables("hostcache+ps", device) as t:
        layer = make_layer(NVEmbedding, LayerType.Hierarchical, t.args(), device)
        extra = dict(layer.state_dict()["_extra_state"])
        for field, value in (("table", "other"), ("embedding_size", DIM + 1),
                             ("layer_type", "LinearUVM"), ("format", 99)):
            with pytest.raises(StateDictError, match=field if field != "format" else "format"):
                layer.load_state_dict({"_extra_state": {**extra, field: value}})
        # another host cache (another node's) is fine: it is a cache
        layer.load_state_dict({"_extra_state": {**extra, "host_cache": "elsewhere"}})
        # strict: a state with neither entry is missing the extra state
        with pytest.raises(RuntimeError, match="_extra_state"):
            layer.load_state_dict({})
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_strict_loading_reports_missing_and_unexpected_keys(device: str) -> None:
    layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device=device)
    with pytest.raises(RuntimeError, match="Missing key.*emb.weight"):
        Model(layer).load_state_dict({"dense.weight": torch.zeros(2, DIM),
                                      "dense.bias": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="Unexpected key.*weight_extra"):
        layer.load_state_dict({"weight": torch.zeros(ROWS, DIM), "weight_extra": 1})
    result = layer.load_state_dict({"weight": torch.ones(ROWS, DIM), "other": 1},
                                   strict=False)
    assert result.unexpected_keys == ["other"]
    assert torch.equal(lookup(layer, device), torch.ones(ROWS, DIM))
    layer.close()
    with pytest.raises(LayerClosedError):
        layer.state_dict()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layer_type", "kind"), STACKS)
def test_loading_streams_in_chunks_of_a_few_rows(device: str, layer_type: LayerType,
                                                 kind: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # chunks of 3 rows: 14 writes for 40 rows, the last one short
    monkeypatch.setattr(state, "CHUNK_BYTES", 3 * DIM * 4)
    ref = reference(NVEmbedding, seed=2)
    with tables(kind, device) as t:
        layer = make_layer(NVEmbedding, layer_type, t.args(), device)
        layer.load_state_dict(ref.state_dict())
        assert torch.equal(t.rows(), ref.weight.detach())
        assert torch.equal(lookup(layer, device), ref.weight.detach())
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_from_torchrec_maps_embedding_bag_collection_names(device: str) -> None:
    torch.manual_seed(3)
    user, item = torch.randn(ROWS, DIM), torch.randn(ROWS, DIM)
    # an EmbeddingBagCollection's state dict inside a model, built by hand
    sd = {"sparse_arch.embedding_bag_collection.embedding_bags.user.weight": user,
          "sparse_arch.embedding_bag_collection.embedding_bags.item.weight": item,
          "dense_arch.model.0.weight": torch.randn(2, DIM)}
    layers = {name: NVEmbeddingBag(ROWS, DIM, torch.float32, LayerType.GPULayer,
                                   device=device) for name in ("user", "item")}
    before = {name: lookup(layer, device) for name, layer in layers.items()}
    with pytest.raises(StateDictError, match="'missing'"):
        state.from_torchrec(sd, {**layers, "missing": layers["user"]})
    bad = dict(sd)
    bad["sparse_arch.embedding_bag_collection.embedding_bags.item.weight"] = item[:, :2]
    with pytest.raises(StateDictError, match="item"):
        state.from_torchrec(bad, layers)
    for name, layer in layers.items():  # nothing was written by either failure
        assert torch.equal(lookup(layer, device), before[name])
    loaded = state.from_torchrec(sd, layers)
    assert loaded == ["sparse_arch.embedding_bag_collection.embedding_bags.user.weight",
                      "sparse_arch.embedding_bag_collection.embedding_bags.item.weight"]
    assert torch.equal(lookup(layers["user"], device), user)
    assert torch.equal(lookup(layers["item"], device), item)
    # an EmbeddingCollection's names too
    state.from_torchrec({"embeddings.user.weight": item}, {"user": layers["user"]})
    assert torch.equal(lookup(layers["user"], device), item)
    for layer in layers.values():
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_dcp_round_trip_of_padded_rows(device: str) -> None:
    # 3 fp32 elements a row: a SharedMemBlock pads rows to 16 bytes, its view is strided
    rows, dim = 50, 3
    torch.manual_seed(4)
    trained = torch.nn.Embedding(rows, dim)
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as ckpt:
        blocks = []
        for _ in range(2):
            mb = SharedMemBlock.create(fresh_name(), num_rows=rows, dim=dim)
            stack.callback(SharedMemBlock.unlink, mb.name)
            stack.callback(mb.close)
            blocks.append(mb)
        saved = NVEmbedding(rows, dim, torch.float32, LayerType.GPULayer, storage=blocks[0],
                            device=device)
        assert saved.state_dict()["weight"].stride(0) == 4
        saved.load_state_dict(trained.state_dict())
        fresh = NVEmbedding(rows, dim, torch.float32, LayerType.LinearUVM,
                            gpu_cache_size=rows * 64, storage=blocks[1], device=device)
        fresh(torch.arange(rows, device=device))
        fresh.flush()  # its cache holds the zero rows
        with quiet_dcp():
            dcp.save(saved.state_dict(), checkpoint_id=ckpt)
            sd = fresh.state_dict()
            dcp.load(sd, checkpoint_id=ckpt)
        fresh.load_state_dict(sd)
        assert torch.equal(fresh(torch.arange(rows, device=device)).cpu(),
                           trained.weight.detach())
        assert torch.equal(blocks[1].read(torch.arange(rows)), trained.weight.detach())
        saved.close()
        fresh.close()
