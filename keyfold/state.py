"""The one operator: a partial attention state and its merge.

A :class:`State` is attention over *some* of the keys: ``out`` is the softmax-weighted
average of their values and ``lse`` the natural-log normaliser ``log sum_j exp(z_ij)``.
Two states over disjoint key sets merge exactly; the empty key set is the identity
``(out=0, lse=-inf)``.  The derivation (associativity, the identity, why the merge is
stable) is in ``docs/math.md``.  Every other module imports the merge from here; there
is no second copy of it.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch

__all__ = ["State", "merge", "merge_all", "empty_state", "state_dtype"]


class State(NamedTuple):
    """Partial attention over a set of keys.

    out: ``(B, H, Nq, Dv)``, float32 (float64 when the inputs are float64).
    lse: ``(B, H, Nq)``, same dtype as ``out``, natural log; ``-inf`` on rows that
        saw no key, whose ``out`` is exactly 0.

    >>> s = empty_state(1, 2, 3, 4)
    >>> merge(s, s).lse.isneginf().all().item()
    True
    """

    out: torch.Tensor
    lse: torch.Tensor


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial states are kept in for inputs of ``dtype`` (float32, or float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_state(B: int, H: int, Nq: int, Dv: int, *, dtype=torch.float32, device=None) -> State:
    """The identity of :func:`merge`: attention over no key (out 0, lse -inf)."""
    out = torch.zeros(B, H, Nq, Dv, dtype=dtype, device=device)
    lse = torch.full((B, H, Nq), float("-inf"), dtype=dtype, device=device)
    return State(out, lse)


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """Merged lse and the two rescaling weights, safe for empty rows.

    lse = logaddexp(lse_a, lse_b) never overflows (it shifts by the max internally), and
    each weight exp(lse_x - lse) = sigmoid(+-(lse_b - lse_a)) lies in [0, 1].  Where both
    sides are empty, lse is -inf and ``-inf - -inf`` would be NaN, so both weights are set to 0
    there and the empty row stays (0, -inf).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    # the weights from the difference alone, wb = sigmoid(lse_b - lse_a), wa = 1 - wb: exp(lse_x - lse)
    # stops summing to 1 once |lse| is so large (~1e10, 16-bit inputs at their maximum) that
    # logaddexp's log(2) rounds away, and the merged output would double
    empty = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    d = torch.where(empty, torch.zeros_like(lse), lse_b - lse_a)
    zero = torch.zeros_like(lse)
    return lse, torch.where(empty, zero, torch.sigmoid(-d)), torch.where(empty, zero, torch.sigmoid(d))


def merge(a: State, b: State) -> State:
    """Merge two partial states over disjoint key sets (commutative, associative).

    ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)``.
    Shapes must match; the result has the dtype of the inputs. Differentiable.
    """
    lse, wa, wb = _weights(a.lse, b.lse)
    out = a.out * wa.unsqueeze(-1) + b.out * wb.unsqueeze(-1)
    return State(out, lse)


def merge_into(acc: State, part: State) -> None:
    """In-place ``acc = merge(acc, part)`` for the engine's accumulators (no autograd)."""
    lse, wa, wb = _weights(acc.lse, part.lse)
    acc.out.mul_(wa.unsqueeze(-1)).add_(part.out * wb.unsqueeze(-1))
    acc.lse.copy_(lse)


def merge_all(states: Iterable[State]) -> State:
    """Merge any number of partial states; merging none is an error (no shape to give)."""
    states = list(states)
    if not states:
        raise ValueError("merge_all needs at least one State; use empty_state(...) for attention over no key")
    # Pairwise tree: depth log2(n), which keeps rounding growth logarithmic in the piece count.
    while len(states) > 1:
        nxt = [merge(states[i], states[i + 1]) for i in range(0, len(states) - 1, 2)]
        if len(states) % 2:
            nxt.append(states[-1])
        states = nxt
    return states[0]
