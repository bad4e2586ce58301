"""Fused row-wise optimizers for trainable layers: pass one as ``optimizer=`` to
``NVEmbedding`` / ``NVEmbeddingBag`` (with ``optimize_for_training=True``).

The optimizer runs inside the layer's backward, on the unique keys of the batch: no
gradient tensor is kept between steps and ``layer.weight.grad`` stays None. Its state
(an Adagrad sum, Adam's moments) lives beside each row in every tier the layer has, as
extra columns of the stored row, so it moves with the row on admission and eviction,
persists where the tables persist, and a second process attaching the same tables
continues from it. :meth:`Optimizer.row_width` gives the width those tables are built
with. Math is float32 whatever the table's dtype. Over a quantized table (int8,
float8_e4m3fn) only :class:`SGD` trains: the others' state would be quantized with the row
(:mod:`gpu.train.quantized`).
"""

from __future__ import annotations

from gpu.optim.rules import SGD, Adagrad, Adam, Optimizer, RowwiseAdagrad

__all__ = ["SGD", "Adagrad", "Adam", "Optimizer", "RowwiseAdagrad"]
