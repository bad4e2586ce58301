"""A plain-dict model of a ParameterServer table and hypothesis strategies for op sequences."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

import psclient

DIM = 4
# small key pool so inserts, updates and erases collide; plus the int64 extremes a table
# stores (INT64_MIN is the reserved key every write refuses: tests/psclient/test_write_checks)
KEYS = st.one_of(st.integers(-20, 20),
                 st.sampled_from([-(2**63) + 1, 2**63 - 1, 2**40, -(2**40)]))
BATCH = st.lists(KEYS, min_size=0, max_size=12)
OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "update", "erase", "lookup", "clear"]), BATCH,
              st.integers(0, 2**16)),
    min_size=1, max_size=12,
)


def rows_for(keys: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(keys), DIM, generator=g)


def check_against_dict(ps: psclient.ParameterServer, ops: list[tuple[str, list[int], int]]
                       ) -> None:
    """Apply ``ops`` to ``ps`` and to a dict; every answer must agree."""
    ps.clear()
    model: dict[int, torch.Tensor] = {}
    for op, keys, seed in ops:
        k = torch.tensor(keys, dtype=torch.int64)
        if op == "insert":
            v = rows_for(keys, seed)
            ps.insert(k, v)
            for key, row in zip(keys, v, strict=True):
                model[key] = row
        elif op == "update":
            v = rows_for(keys, seed)
            existed = ps.update(k, v)
            want = [key in model for key in keys]
            assert existed.tolist() == want
            for key, row, ex in zip(keys, v, want, strict=True):
                if ex:
                    model[key] = row
        elif op == "erase":
            ps.erase(k)
            for key in keys:
                model.pop(key, None)
        elif op == "clear":
            ps.clear()
            model.clear()
        values, found = ps.lookup(k)
        assert values.shape == (len(keys), DIM) and values.dtype == torch.float32
        assert found.tolist() == [key in model for key in keys]
        for i, key in enumerate(keys):
            want_row = model.get(key, torch.zeros(DIM))
            assert torch.equal(values[i], want_row), (op, key)
        assert ps.size() == len(model)
