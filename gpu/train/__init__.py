"""Training the layers: autograd through the lookup, the sparse gradient of
``layer.weight``, and the fused optimizers' step (:mod:`gpu.optim`).

A layer built with ``optimize_for_training=True`` has a ``weight`` parameter standing
for its whole table (:mod:`gpu.train.weight`); under grad mode its lookups go through
:class:`gpu.train.autograd.Lookup`, whose backward sums the gradient per unique key and
then either hands ``weight`` a coalesced sparse gradient (for ``torch.optim.SGD``) or,
with ``optimizer=``, applies the fused optimizer to the rows in every tier at once
(:mod:`gpu.train.step`). Rows with their optimizer state are stored wide
(:mod:`gpu.train.wide`). Over a quantized table the stateless optimizers train, their steps
added through the table's stochastically rounded accumulate (:mod:`gpu.train.quantized`).
"""
