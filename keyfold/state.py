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
        saw no key, whose ``out`` is exactly 0. It may be float64 beside a float32 ``out`` (a wide
        lse): :func:`merge` then weighs in float64 and the merged lse stays float64. keyfold's
        decoding keeps its pieces' lse so until it returns (float32 rounds lse to 2^-24 |lse|,
        4e-6 at 65, and a merge weighs each out by ``exp(lse - lse_total)``).

    >>> s = empty_state(1, 2, 3, 4)
    >>> merge(s, s).lse.isneginf().all().item()
    True
    """

    out: torch.Tensor
    lse: torch.Tensor


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial states are kept in for inputs of ``dtype`` (float32, or float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_state(B: int, H: int, Nq: int, Dv: int, *, dtype=torch.float32, device=None, of=()) -> State:
    """The identity of :func:`merge`: attention over no key (out 0, lse -inf).

    of: tensors (q, k, v) whose autograd graph the state joins, with zero gradient, as attention
    over keys that are all hidden does: a result of no key then still takes ``backward()``.
    """
    out = torch.zeros(B, H, Nq, Dv, dtype=dtype, device=device)
    lse = torch.full((B, H, Nq), float("-inf"), dtype=dtype, device=device)
    live = [t for t in of if t.requires_grad]
    if live:  # a sum over no element: exactly 0 whatever the tensor holds (NaN too), gradient 0
        zero = sum(t.narrow(-1, 0, 0).sum() for t in live).to(dtype)
        out, lse = out + zero, lse + zero
    return State(out, lse)


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """Merged lse and the two rescaling weights, safe for empty rows in value and gradient.

    With ``m = max(lse_a, lse_b)`` (a constant: the result does not depend on it),
    ``e_x = exp(lse_x - m)`` and ``t = e_a + e_b``: ``lse = m + log t`` and
    ``w_x = e_x / t``. On a row that saw a key the larger term is ``exp(0) = 1``, so
    ``1 <= t <= 2``: nothing overflows and the weights lie in [0, 1]. On a row empty on both
    sides ``m = -inf``; we shift by 0 there instead, so ``e_a = e_b = t = 0``, and divide by 1,
    so lse is -inf and both weights are 0 with zero gradient. ``torch.logaddexp`` would give
    the same values but a NaN gradient at (-inf, -inf).
    """
    m = torch.maximum(lse_a, lse_b).detach()
    empty = torch.isneginf(m)
    m = m.masked_fill(empty, 0.0)
    ea, eb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    t = (ea + eb).masked_fill(empty, 1.0)
    lse = (m + torch.log(t)).masked_fill(empty, float("-inf"))
    return lse, ea / t, eb / t


def _eager(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor outside torch.compile: one whose values may be asked about
    and that may be written in place (vmap's tensors can neither answer a data-dependent question
    nor take an in-place op; Dynamo cannot trace the check, and fuses the out-of-place form)"""
    return not torch.compiler.is_compiling() and not torch._C._functorch.is_functorch_wrapped_tensor(t)


def _zero_empty(st: State) -> torch.Tensor:
    """``st.out`` with 0 on its empty rows (lse -inf), whatever they held: multiplied by a weight of
    0, a NaN or inf there would still be NaN, in value and gradient. On the CPU, outside
    torch.compile, a state with no empty row (the common case) is returned as it is: asking costs a
    pass over lse, not a copy of out (a device would wait for the answer, so there it always copies)."""
    empty = torch.isneginf(st.lse)
    if st.out.device.type == "cpu" and _eager(empty) and not bool(empty.any()):
        return st.out
    return st.out.masked_fill(empty.unsqueeze(-1), 0.0)


def _fills(x, y, w) -> bool:
    """Whether shapes ``y`` and ``w`` broadcast into ``x`` (an in-place ``x.addcmul_(y, w)``). The common
    case, equal shapes, is answered without ``torch.broadcast_shapes`` (a Python reference implementation
    in torch: 65 us a call, a sixth of a decoding step's merge over a window cache's pieces)."""
    if y == x and w[:-1] == x[:-1]:
        return True
    return torch.broadcast_shapes(x, y, w) == x


def merge(a: State, b: State) -> State:
    """Merge two partial states over disjoint key sets (commutative, associative).

    ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse)``.
    Shapes must match; the result has the dtype of the inputs (a wide lse stays wide: the
    weights are taken in lse's dtype and applied in out's). Differentiable: a row empty in
    both (lse -inf) gives out 0, lse -inf and zero gradients, never NaN. A state's rows with
    lse -inf count as empty whatever their ``out`` holds (weight 0).
    """
    lse, wa, wb = _weights(a.lse, b.lse)
    # (a NaN filler in an empty row made the merged row NaN; found by fuzzing, 2026-12-05)
    # one new tensor, not three: each fresh (B, H, N, Dv) buffer costs its page faults (4k rows, 8
    # heads: 18 ms a merge with three, against 2 ms of arithmetic)
    # weights applied in out's dtype, at least float32: 16-bit outs (attention's with return_lse) merge
    # into float32, as they did when the weights were lse's float32; a float64 lse beside float32 outs
    # (keyfold's decoding) weighs them in float32
    od = torch.promote_types(torch.promote_types(a.out.dtype, b.out.dtype), torch.float32)
    x, y, w = _zero_empty(a) * wa.to(od).unsqueeze(-1), _zero_empty(b), wb.to(od).unsqueeze(-1)
    if _fills(x.shape, y.shape, w.shape) and _eager(x):
        return State(x.addcmul_(y, w), lse)
    return State(torch.addcmul(x, y, w), lse)  # b's out broadcasts wider than a's


def merge_into(acc: State, part: State) -> None:
    """In-place ``acc = merge(acc, part)`` for the engine's accumulators (no autograd), whose empty
    rows hold out 0 (the engine zeroes them): no masking of what an empty row's out holds."""
    lse, wa, wb = _weights(acc.lse, part.lse)
    od = acc.out.dtype
    acc.out.mul_(wa.to(od).unsqueeze(-1)).addcmul_(part.out, wb.to(od).unsqueeze(-1))
    acc.lse.copy_(lse)


def merge_all(states: Iterable[State]) -> State:
    """Merge any number of partial states; merging none is an error (no shape to give).

    Rows with lse -inf are empty: the result has out 0 there (also for a single state, whose
    empty rows may carry anything in ``out``), lse -inf and zero gradient.
    """
    states = list(states)
    if not states:
        raise ValueError("merge_all needs at least one State; use empty_state(...) for attention over no key")
    if len(states) == 1:
        return State(_zero_empty(states[0]), states[0].lse)
    # Pairwise tree: depth log2(n), which keeps rounding growth logarithmic in the piece count.
    while len(states) > 1:
        nxt = [merge(states[i], states[i + 1]) for i in range(0, len(states) - 1, 2)]
        if len(states) % 2:
            nxt.append(states[-1])
        states = nxt
    return states[0]
