"""The seed document's Python snippet (its resource-sharing example), run against this project.

What changed: the imports (pynve -> this project's ``gpu`` package; ``gpu.compat.MPI`` is
mpi4py's under mpirun, a COMM_WORLD over torch.distributed under torchrun, and a
one-process COMM_WORLD when run alone), the device picked on the CPU where no CUDA GPU is
present (the snippet's two device lines run only with CUDA), the table is scaled from 2**30
rows to 2**22 (1 TiB -> 4 GiB) so that it fits the GPUs of one small machine, and the
snippet's ``...`` is filled in with a lookup that checks the rows it reads.

``MPIMemBlock`` is a ``gpu.DistMemBlock``: each rank's shard lives in its GPU's memory and
every rank maps all shards into one range (rows on another GPU are read over NVLink).
Without CUDA the shards are host memory (the block's CPU twin; pages are allocated only
where rows are written) and the layer runs on the CPU.

Run: ``python examples/seed_linear_uvm.py``, or one process per GPU with
``torchrun --nproc-per-node N examples/seed_linear_uvm.py`` or
``mpirun -n N python examples/seed_linear_uvm.py``. Each rank prints
``rank R: 1024 rows read correctly on DEVICE; GPU cache hit rate H``.
"""

import gc

import torch

import gpu as nve_layers
from gpu import compat as nve
from gpu.compat import MPI

comm = MPI.COMM_WORLD
mpi_rank = comm.Get_rank()
if torch.cuda.is_available():
    # The 2 lines below assume the code was run with `mpirun -n N python ...` on K nodes with N/K gpus on each. Amend if different params are used  # noqa: E501
    local_device_id = mpi_rank % torch.cuda.device_count()
    local_device = torch.device(f"cuda:{local_device_id}")
else:  # no CUDA GPU: the table's shards and the layer live on the CPU (the CPU twin)
    local_device = torch.device("cpu")
embedding_dim = 256
num_table_rows = 2**22
nve_dtype = nve.DataType_t.Float32
torch_dtype = torch.float32
memblock = nve.MPIMemBlock(embedding_dim, num_table_rows, nve_dtype)
cache_size = 2**20
emb_layer = nve_layers.NVEmbedding(
num_table_rows,
embedding_dim,
torch_dtype,
nve_layers.LayerType.LinearUVM,
gpu_cache_size=cache_size,
optimize_for_training=False,
storage=memblock,
device=local_device)
# At this point every process forked from mpirun has it's own memblock and emb_layer, but all memblocks are using the same group of GPU buffers.  # noqa: E501
# Each layer still has it's own GPU cache.
if mpi_rank == 0:  # the snippet's "...": fill some rows, then look them up twice
    keys = torch.arange(0, num_table_rows, 4099, dtype=torch.int64)
    memblock.write(keys, keys.to(torch_dtype)[:, None].expand(-1, embedding_dim).contiguous())
comm.Barrier()
with torch.no_grad():
    keys = torch.arange(0, num_table_rows, 4099, dtype=torch.int64, device=local_device)
    for _ in range(2):  # the second pass is served from the GPU cache
        out = emb_layer(keys)
        assert torch.equal(out[:, 0], keys.to(torch_dtype)), "rows read back wrong"
print(f"rank {mpi_rank}: {keys.numel()} rows read correctly on {local_device}; "
      f"GPU cache hit rate {emb_layer.stats().gpu.hit_rate:.2f}")
# Cleanup
comm.Barrier()
del emb_layer
del memblock
gc.collect()
