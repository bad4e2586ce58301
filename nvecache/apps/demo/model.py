"""The demo's ranking model: two embedding-bag tables on the node's tiers, then an MLP."""

from __future__ import annotations

from typing import Any, Literal

import torch

from gpu import LayerType, NVEmbeddingBag
from nvecache.apps.demo.config import DemoConfig
from nvecache.apps.demo.workload import Requests


class RankingModel(torch.nn.Module):
    """Scores (user, candidate item) pairs given the user's recent items.

    ``user`` and ``item`` are Hierarchical ``NVEmbeddingBag`` layers: a private device-side
    cache, then the node's shared host cache, then the parameter server. The item layer
    pools the history bags (mean) and looks up the candidates in the same call.
    """

    def __init__(self, user: NVEmbeddingBag, item: NVEmbeddingBag, dim: int,
                 device: torch.device, *, seed: int) -> None:
        super().__init__()
        self.user = user
        self.item = item
        gen = torch.Generator().manual_seed(seed)
        sizes = (3 * dim + 1, 128, 64, 1)
        layers: list[torch.nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            lin = torch.nn.Linear(a, b)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(b, a, generator=gen) / a**0.5)
                lin.bias.zero_()
            layers.append(lin)
            if i < len(sizes) - 2:
                layers.append(torch.nn.ReLU())
        self.mlp = torch.nn.Sequential(*layers).to(device)

    @torch.inference_mode()
    def forward(self, req: Requests) -> torch.Tensor:
        """Click probabilities, float32 [B]."""
        b = req.size
        u = self.user(req.user_keys, req.user_offsets)
        pooled = self.item(req.item_keys, req.item_offsets)
        hist, cand = pooled[:b], pooled[b:]
        affinity = (hist * cand).sum(dim=1, keepdim=True)
        x = torch.cat([u, hist, cand, affinity], dim=1)
        return torch.sigmoid(self.mlp(x)).squeeze(1)

    def layers(self) -> dict[str, NVEmbeddingBag]:
        return {"user": self.user, "item": self.item}

    def close(self) -> None:
        self.user.close()
        self.item.close()


def build_model(cfg: DemoConfig, device: torch.device, host_caches: dict[str, Any],
                stores: dict[str, Any]) -> RankingModel:
    """The model of one replica over the attached host caches and parameter-server tables.

    Args:
        cfg: the demo settings.
        device: this replica's device.
        host_caches: ``{"user": HostCache, "item": HostCache}``.
        stores: ``{"user": ParameterServer, "item": ParameterServer}``.
    """
    def layer(suffix: str, mode: Literal["sum", "mean"]) -> NVEmbeddingBag:
        return NVEmbeddingBag(
            cfg.rows, cfg.dim, torch.float32, LayerType.Hierarchical, mode=mode,
            gpu_cache_size=cfg.gpu_cache_bytes, host_cache=host_caches[suffix],
            storage=stores[suffix], device=device,
        )

    return RankingModel(layer("user", "sum"), layer("item", "mean"), cfg.dim, device,
                        seed=cfg.seed)
