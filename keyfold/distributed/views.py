"""A mask or score modifier seen through a shard's local indices.

A shard run of stride 1 is just an offset, which ``attend`` takes directly (``q_offset`` /
``kv_offset``), so the planner keeps its closed forms (causal stays the fused kernel's own flag).
A STRIPED run has stride P: local row ``i`` is global position ``start + i*P``. There we call
``attend`` with offsets 0 and hand it a *position-aware* mask, :class:`PositionView`, that maps
local indices to global positions before asking the user's mask. Its block classification asks
the inner mask about the hull ``[first, last]`` of each tile's positions, which is sound: a hull
that is EMPTY (FULL) contains only empty (visible) pairs.

The same view shifts head indices for work that holds a slice of the heads (all-gather head
groups, all-to-all over heads); ALiBi slopes are sliced to those heads.
"""

from __future__ import annotations

import torch

from ..masks import BlockKind, Mask, MaskKind
from ..scores import ScoreKind, ScoreMod, alibi, as_score
from .layout import Run

__all__ = ["PositionView", "ScoreView", "piece_args", "is_empty", "heads_slice"]


class PositionView(Mask):
    """``inner`` evaluated at ``qp -> q0 + qp*qs``, ``kp -> k0 + kp*ks``, ``h -> h + h0``."""

    def __init__(self, inner: Mask, q: tuple[int, int], k: tuple[int, int], h0: int = 0):
        self.inner = inner
        (self.q0, self.qs), (self.k0, self.ks) = q, k
        self.h0 = h0

    def _q(self, x):
        return self.q0 + x * self.qs

    def _k(self, x):
        return self.k0 + x * self.ks

    def evaluate(self, b, h, qp, kp):
        return self.inner.evaluate(b, h + self.h0, self._q(qp), self._k(kp))

    def classify(self, q0, q1, k0, k1):
        # half-open local ranges -> half-open hulls of global positions
        return self.inner.classify(self._q(q0), self._q(q1 - 1) + 1, self._k(k0), self._k(k1 - 1) + 1)

    def check_positions(self, q_start, q_end, k_start, k_end):
        if q_end > q_start and k_end > k_start:  # half-open local ranges -> global hulls
            self.inner.check_positions(self._q(q_start), self._q(q_end - 1) + 1,
                                       self._k(k_start), self._k(k_end - 1) + 1)

    def depends_on_batch_head(self):
        return self.inner.depends_on_batch_head()

    def _key(self):
        return (self.inner, self.q0, self.qs, self.k0, self.ks, self.h0)

    def __repr__(self):
        return f"PositionView({self.inner!r}, q={self.q0}+{self.qs}i, k={self.k0}+{self.ks}j, h+{self.h0})"

    def __eq__(self, other):
        return type(other) is PositionView and self._key() == other._key()

    def __hash__(self):
        return hash(("PositionView",) + self._key())


class ScoreView(ScoreMod):
    """A score modifier seen through local indices, like :class:`PositionView`."""

    def __init__(self, inner: ScoreMod, q: tuple[int, int], k: tuple[int, int], h0: int = 0):
        self.inner = inner
        self.additive = inner.additive
        (self.q0, self.qs), (self.k0, self.ks) = q, k
        self.h0 = h0

    def _map(self, h, qp, kp):
        return h + self.h0, self.q0 + qp * self.qs, self.k0 + kp * self.ks

    def apply(self, s, b, h, qp, kp):
        return self.inner.apply(s, b, *self._map(h, qp, kp))

    def bias(self, b, h, qp, kp):
        return self.inner.bias(b, *self._map(h, qp, kp))

    def check_heads(self, H):
        self.inner.check_heads(H)

    def _key(self):
        return (self.inner, self.q0, self.qs, self.k0, self.ks, self.h0)

    def __repr__(self):
        return f"ScoreView({self.inner!r}, q={self.q0}+{self.qs}i, k={self.k0}+{self.ks}j, h+{self.h0})"

    def __eq__(self, other):
        return type(other) is ScoreView and self._key() == other._key()

    def __hash__(self):
        return hash(("ScoreView",) + self._key())


def heads_slice(score: ScoreMod | None, h0: int, h1: int) -> ScoreMod | None:
    """``score`` restricted to query heads ``[h0, h1)``: ALiBi keeps only those heads' slopes
    (its bias broadcasts slopes over the head axis); callables see shifted head indices through
    :class:`ScoreView`; softcap does not depend on the head."""
    if score is None:
        return None
    spec = score.spec()
    if spec is not None and spec[0] is ScoreKind.ALIBI:
        return alibi(spec[1]["slopes"][..., h0:h1])
    if score.parts() is not None:
        return as_score([heads_slice(m, h0, h1) for m in score.parts()])
    return score


def piece_args(mask: Mask | None, score: ScoreMod | None, qr: Run, kr: Run,
               heads: tuple[int, int, int] | None = None):
    """``(mask, score, q_offset, kv_offset)`` for ``attend`` on query rows of run ``qr`` against
    keys of run ``kr``; ``heads = (h0, h1, H)`` when the call holds query heads ``[h0, h1)`` of H."""
    sliced = heads is not None and (heads[0], heads[1]) != (0, heads[2])
    head_free = (mask is None or not mask.depends_on_batch_head()[1]) and score is None
    if qr.stride == 1 and kr.stride == 1 and (not sliced or head_free):
        return mask, score, qr.start, kr.start
    if mask is not None and mask.spec() == (MaskKind.CAUSAL, {}) and score is None and qr.stride == kr.stride:
        # Striped causal is causal on local indices (Striped Attention, Brandon et al. 2023):
        # b + j*S <= a + i*S  <=>  j <= i + d with d = floor((a - b) / S), which attend's causal
        # sees with q_offset - kv_offset = d; the fused kernel keeps its own causal flag.
        d = (qr.start - kr.start) // qr.stride
        return mask, None, max(d, 0), max(-d, 0)
    h0 = heads[0] if sliced else 0
    q, k = (qr.start, qr.stride), (kr.start, kr.stride)
    m = None if mask is None else PositionView(mask, q, k, h0)
    s = None if score is None else ScoreView(heads_slice(score, h0, heads[1]) if sliced else score, q, k, h0)
    return m, s, 0, 0


def is_empty(mask: Mask | None, nq: int, nk: int, q_offset: int, kv_offset: int) -> bool:
    """True when the mask's closed form says no pair of the piece is visible (skip it).

    Callables have no closed form: those pieces go to ``attend``, whose planner evaluates them
    and computes nothing for the empty tiles.
    """
    if mask is None or nq == 0 or nk == 0:
        return nq == 0 or nk == 0
    t = lambda x: torch.tensor([[x]], dtype=torch.int64)  # noqa: E731
    kinds = mask.classify(t(q_offset), t(q_offset + nq), t(kv_offset), t(kv_offset + nk))
    return kinds is not None and int(kinds.max()) == int(BlockKind.EMPTY)
