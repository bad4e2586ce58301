"""gpu.kernels.launch.DirectLaunch: a direct launch runs the variant the JIT would have chosen.

The launcher is keyed by each pointer's 16-byte alignment and each integer's value class;
these tests feed one kernel (the GPULayer gather) pointers of both alignments, in turns,
and a launch hook (which takes the JIT's path), and check every result against torch.
"""

from __future__ import annotations

import pytest
import torch

from gpu import LayerType, NVEmbedding

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU "
                                 "(direct launches are CUDA only; the interpreter takes the "
                                 "JIT's path)")]

ROWS = 1000


@pytest.mark.parametrize("dim", [5, 16, 33])
def test_aligned_and_unaligned_pointers_in_turns(dim: int) -> None:
    """Keys and table views 8 and 4 bytes off 16-byte alignment, then aligned, then off
    again: each launch must pick its own variant (a variant compiled for aligned pointers
    would read the wrong addresses or fault on the others)."""
    g = torch.Generator(device="cuda").manual_seed(dim)
    big = torch.randn(ROWS + 1, dim, device="cuda", generator=g)
    tables = {"aligned": big[:ROWS], "off": big.view(-1)[1:1 + ROWS * dim].view(ROWS, dim)}
    assert tables["off"].data_ptr() % 16 == 4
    for which, table in tables.items():
        layer = NVEmbedding(ROWS, dim, torch.float32, LayerType.GPULayer, storage=table,
                            device="cuda")
        pool = torch.randint(0, ROWS, (4097,), device="cuda", generator=g)
        for off in (0, 1, 0, 1, 2):
            keys = pool[off:off + 4000]
            assert keys.data_ptr() % 16 == (8 * off) % 16
            got = layer(keys)
            assert torch.equal(got, table[keys]), (which, off)
        layer.synchronize()  # no key was reported out of range


def test_a_launch_hook_takes_the_jit_path_with_the_same_results() -> None:
    import triton

    rt = triton.knobs.runtime
    calls: list[object] = []
    w = torch.randn(ROWS, 8, device="cuda")
    layer = NVEmbedding(ROWS, 8, torch.float32, LayerType.GPULayer, storage=w, device="cuda")
    keys = torch.randint(0, ROWS, (300,), device="cuda")
    before = layer(keys)
    for _ in range(2):  # NOTE: the variant found, then launched directly
        assert torch.equal(layer(keys), before)
    def hook(*args: object) -> None:
        calls.append(args)

    chain = rt.launch_enter_hook
    if hasattr(chain, "add"):  # Triton 3.5+: a chain of hooks
        chain.add(hook)
    else:
        rt.launch_enter_hook = hook
    try:
        hooked = layer(keys)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            rt.launch_enter_hook = chain
    assert calls, "the hook saw no launch: the direct path ignored it"
    assert torch.equal(hooked, before) and torch.equal(before, w[keys])
    after = layer(keys)  # the direct path again once the hook is gone
    assert len(calls) == 1 and torch.equal(after, before)


def test_a_bad_key_is_reported_by_a_direct_launch() -> None:
    """The key-error flag is passed to the launcher as a plain address: the kernel must
    still write it."""
    from gpu import BadArgumentError

    w = torch.randn(ROWS, 4, device="cuda")
    layer = NVEmbedding(ROWS, 4, torch.float32, LayerType.GPULayer, storage=w, device="cuda")
    good = torch.randint(0, ROWS, (64,), device="cuda")
    for _ in range(3):  # past the JIT's first launch of the variant
        layer(good)
    bad = good.clone()
    bad[17] = ROWS + 5
    rows = layer(bad)
    assert torch.equal(rows[17], torch.zeros(4, device="cuda"))
    with pytest.raises(BadArgumentError, match=str(ROWS + 5)):
        layer.synchronize()


def test_a_key_that_leaves_out_a_constexpr_never_launches_another_calls_variant() -> None:
    """The same key with other constexprs (here the row width) must not reuse the variant
    compiled first: the host tier's row reads once keyed out ``EVEN_D``, and a table of
    5-float rows read after one of 8-float rows wrote 8 floats a row (zeros over the next
    row's first three, and past the output's end)."""
    from gpu.kernels.launch import DirectLaunch
    from gpu.kernels.triton_access import kernel_module

    gk = kernel_module("gather", interpret=False)
    launch = DirectLaunch(gk._gather_kernel)
    g = torch.Generator(device="cuda").manual_seed(3)
    for dim in (8, 5, 8, 5, 3):
        table = torch.randn(100, dim, device="cuda", generator=g)
        keys = torch.randint(0, 100, (64,), device="cuda", generator=g)
        out = torch.full((65, dim), 7.0, device="cuda")  # a guard row after the 64 rows
        launch((4,), (keys, 64, table, 100, dim, out, keys, keys),
               {"DIM": dim, "BLOCK_K": 16, "BLOCK_D": 8, "ORDERED": False, "CHECK": False,
                "QUANT": 0, "META": 0, "SEQ": 0},
               ("one key for every width",))
        assert torch.equal(out[:64], table[keys]), dim
        assert (out[64] == 7.0).all(), f"dim {dim}: a row was written past the output"


@pytest.mark.parametrize("dim", [5, 16])
def test_bound_lookups_with_pointers_and_sizes_in_turns(dim: int) -> None:
    """A cache's bound lookups (gpu.kernels.launch.BoundLaunch: its tables bound, the keys, output
    and hit flags, or a miss list, given per call): keys 8 bytes off alignment and aligned
    in turns, batch sizes of 1, a multiple of 16 and neither, two threads' miss lists;
    every result equal to the CPU twin's, the misses listed exactly."""
    from gpu.cache.gpu_cache import GPUCache
    from gpu.stacks.misses.miss_list import MissList

    slot = 8 + 4 + dim * 4
    gpu_cache = GPUCache(4096 * slot, dim, torch.float32, "cuda")
    twin = GPUCache(4096 * slot, dim, torch.float32, "cpu", backend="torch")
    g = torch.Generator().manual_seed(dim)
    present = torch.randperm(ROWS, generator=g)[:600]
    rows = torch.randn(600, dim, generator=g)
    for c in (gpu_cache, twin):
        c.insert(present.to(c.device), rows.to(c.device))
    lists = [MissList(torch.device("cuda")) for _ in range(2)]
    pool = torch.cat([present, torch.randint(0, ROWS, (200,), generator=g)])
    for step, (off, n) in enumerate([(0, 256), (1, 256), (0, 1), (1, 37), (0, 700),
                                     (1, 1), (0, 48), (1, 48)]):
        keys = pool[off:off + n] if step % 3 else present[off:off + n]
        dkeys = pool.cuda()[off:off + n] if step % 3 else present.cuda()[off:off + n]
        assert dkeys.data_ptr() % 16 == 8 * off
        got, hit = gpu_cache.lookup(dkeys)
        want, want_hit = twin.lookup(keys)
        misses = lists[step % 2]
        misses.ensure(n)
        served = gpu_cache.serve(dkeys, misses)
        twin.lookup(keys)  # NOTE: counted twice there too
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want) and torch.equal(hit.cpu(), want_hit), step
        assert torch.equal(served.cpu(), want), step
        listed = torch.from_numpy(misses.take()[1]).sort().values
        assert torch.equal(listed, (~want_hit).nonzero().squeeze(1)), step
    assert gpu_cache.ops.bound, "the lookups went through a bound launch"
    assert gpu_cache.stats().hits == twin.stats().hits


@pytest.mark.parametrize("how", ["bound", "checked", "unchecked"])
def test_the_gather_with_sizes_and_alignments_in_turns(how: str) -> None:
    """The GPULayer's gather, bound (gpu.kernels.gather.BoundRows: table and key flag
    bound once, a call passing keys, size and output) and not (with and without a key
    flag): batch sizes of 1, a multiple of 16, neither and 0, keys 8 bytes off alignment
    and aligned in turns, each case twice (its variant found, then launched directly), a
    bad key among good ones; every result equal to torch's, a bad key read as a zero row
    and reported in the flag."""
    from gpu import BadArgumentError
    from gpu.kernels.tiles import DEFAULT_TILES
    from gpu.kernels.triton_access import kernel_module
    from gpu.stacks.key_flag import KeyErrorFlag

    gk = kernel_module("gather", interpret=False)
    g = torch.Generator(device="cuda").manual_seed(11)
    table = torch.randn(ROWS, 24, device="cuda", generator=g)
    flag = KeyErrorFlag(torch.device("cuda"), ROWS)
    err = None if how == "unchecked" else flag.device_view
    bound = None
    if how == "bound":
        assert err is not None
        bound = gk.BoundRows(table, err, host_table=False, tiles=DEFAULT_TILES, fmt=None,
                             dtype=torch.float32, device=torch.device("cuda"))

    def rows(keys: torch.Tensor) -> torch.Tensor:
        if bound is not None:
            return bound(keys)
        return gk.gather(keys, table, err, host_table=False)

    pool = torch.randint(0, ROWS, (801,), device="cuda", generator=g)
    for off, n in [(0, 256), (1, 256), (0, 1), (1, 37), (0, 800), (1, 1), (0, 48),
                   (0, 0)] * 2:
        keys = pool[off:off + n]
        assert n == 0 or keys.data_ptr() % 16 == 8 * off
        got = rows(keys)
        assert got.shape == (n, 24) and torch.equal(got, table[keys]), (off, n)
    if bound is not None:
        assert bound.launch.variants >= 5, "calls took the JIT's path after their first"
    if err is not None:
        bad = pool[:37].clone()
        bad[20] = ROWS + 9
        for _ in range(2):
            got = rows(bad)
            torch.cuda.synchronize()
            assert torch.equal(got[20], torch.zeros(24, device="cuda"))
            assert torch.equal(got[:20], table[bad[:20]])
            with pytest.raises(BadArgumentError, match=str(ROWS + 9)):
                flag.raise_pending()
