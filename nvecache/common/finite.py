"""The one rule for the rows a write stores: finite numbers only, unless the caller says.

A NaN or an infinity written once is served to every replica of every node, so each tier's
write refuses rows holding one (``psclient``'s ``NonFiniteValuesError``, and ``hostcache``'s
and ``gpu``'s of that name) unless the caller passes ``allow_nonfinite=True``.
:func:`nonfinite_rows` finds them; :func:`nonfinite_message` says what to do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def nonfinite_rows(values: torch.Tensor) -> torch.Tensor | None:
    """Which rows of ``values`` (``[N, dim]``, any device) hold a NaN or an infinity.

    Returns:
        None when every element is finite, else bool ``[N]`` (on ``values``' device).

    NOTE: the common case is one reduction: a sum is finite only if every term is (a NaN or
    an infinity propagates; opposite infinities make a NaN). A sum of finite rows that
    overflows the dtype only sends the batch to the exact per-element test. On the CPU a sum
    allocates no ``[N, dim]`` mask, unlike ``isfinite(v).all()`` (bench/RESULTS.md,
    "Parameter-server clients"); on a CUDA tensor reading it is one host sync.
    """
    import torch  # NOTE: here, not at import: command lines that write no rows load no torch

    if values.numel() == 0:
        return None
    if bool(torch.isfinite(values.sum())):
        return None
    bad = ~torch.isfinite(values.reshape(values.shape[0], -1)).all(dim=1)
    return bad if bool(bad.any()) else None


def nonfinite_message(bad: torch.Tensor, keys: torch.Tensor | None, *, what: str = "values",
                      key_word: str = "key", allow: str = "allow_nonfinite=True") -> str:
    """The message of a refused write: how many rows, the first one's key, what to do.

    Args:
        bad: :func:`nonfinite_rows`' mask (not None).
        keys: the write's keys (row ``i`` is ``keys[i]``); None: rows are named by position.
        what: how the message names the rows.
        key_word: what a key is called (``index`` for a linear table).
        allow: how the caller spells the opt-in (``--allow-nonfinite`` on a command line).
    """
    pos = bad.nonzero()
    count, first = pos.shape[0], int(pos[0, 0])
    where = (f"{key_word} {int(keys.reshape(-1)[first])}" if keys is not None
             else f"row {first}")
    return (f"{what}: {count} row(s) hold NaN or infinite values (the first: {where}); "
            f"nothing was written: fix those rows, or store them anyway with {allow}")
