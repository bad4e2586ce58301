"""Everything that touches CUDA: host registration of the shared tables, the per-process
GPU cache and its Triton kernels, and the torch layers ``NVEmbedding``/``NVEmbeddingBag``.

Every path has a CPU twin with identical results: ``device="cpu"`` makes no CUDA call.
"""

from __future__ import annotations

from gpu.cache.gpu_cache import GPUCache, GPUCacheStats, MissCandidates
from gpu.dist.distmem import DistMemBlock
from gpu.errors import (
    BadArgumentError,
    CUDAUnavailableError,
    DestructionOrderError,
    GPUError,
    KeyNotFoundError,
    LayerClosedError,
    NonFiniteValuesError,
    StorageUnavailableError,
    StorageWriteError,
)
from gpu.layer_config import InsertPolicy, LayerStats, LayerType, TierStats
from gpu.layers import NVEmbedding, NVEmbeddingBag
from gpu.stacks.protocol import Tier
from gpu.tier_config import TierConfig

__all__ = [
    "BadArgumentError",
    "CUDAUnavailableError",
    "DestructionOrderError",
    "DistMemBlock",
    "GPUCache",
    "GPUCacheStats",
    "MissCandidates",
    "GPUError",
    "InsertPolicy",
    "KeyNotFoundError",
    "LayerClosedError",
    "LayerStats",
    "LayerType",
    "NVEmbedding",
    "NVEmbeddingBag",
    "NonFiniteValuesError",
    "StorageUnavailableError",
    "StorageWriteError",
    "Tier",
    "TierConfig",
    "TierStats",
]
