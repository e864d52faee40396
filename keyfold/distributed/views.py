"""How one (query run, key run) piece of a shard sees the user's mask and score modifier.

A shard run of stride 1 is just an offset, which ``attend`` takes directly (``q_offset`` /
``kv_offset``), so the planner keeps its closed forms (causal stays the fused kernel's own flag).
A STRIPED run has stride P: local row ``i`` is global position ``start + i*P``. There we call
``attend`` with offsets 0 and hand it the mask and score through a view
(:class:`keyfold.views.MaskView` / :class:`keyfold.views.ScoreView`) that maps local indices to
global positions. The same view shifts head indices for work that holds a slice of the heads
(all-gather head groups, all-to-all over heads); ALiBi slopes are sliced to those heads
(:func:`keyfold.views.heads_slice`).
"""

from __future__ import annotations

from ..masks import BlockKind, Mask, MaskKind
from ..scores import ScoreMod
from ..views import MaskView, Remap, ScoreView, heads_slice, span_kinds
from .layout import Run

__all__ = ["piece_args", "is_empty"]


def piece_args(mask: Mask | None, score: ScoreMod | None, qr: Run, kr: Run,
               heads: tuple[int, int, int] | None = None):
    """``(mask, score, q_offset, kv_offset)`` for ``attend`` on query rows of run ``qr`` against
    keys of run ``kr``; ``heads = (h0, h1, H)`` when the call holds query heads ``[h0, h1)`` of H."""
    sliced = heads is not None and (heads[0], heads[1]) != (0, heads[2])
    head_free = (mask is None or not mask.depends_on_batch_head(None, heads and heads[2])[1]) and score is None
    if qr.stride == 1 and kr.stride == 1 and (not sliced or head_free):
        return mask, score, qr.start, kr.start
    if mask is not None and mask.spec() == (MaskKind.CAUSAL, {}) and score is None and qr.stride == kr.stride:
        # Striped causal is causal on local indices (Striped Attention, Brandon et al. 2023):
        # b + j*S <= a + i*S  <=>  j <= i + d with d = floor((a - b) / S), which attend's causal
        # sees with q_offset - kv_offset = d; the fused kernel keeps its own causal flag.
        d = (qr.start - kr.start) // qr.stride
        return mask, None, max(d, 0), max(-d, 0)
    h0 = heads[0] if sliced else 0
    remap = Remap(q=(qr.start, qr.stride), k=(kr.start, kr.stride), h0=h0)
    m = None if mask is None else MaskView(mask, remap)
    s = None if score is None else ScoreView(heads_slice(score, h0, heads[1]) if sliced else score, remap)
    return m, s, 0, 0


def is_empty(mask: Mask | None, nq: int, nk: int, q_offset: int, kv_offset: int) -> bool:
    """True when the mask's closed form says no pair of the piece is visible (skip it).

    Callables have no closed form: those pieces go to ``attend``, whose planner evaluates them
    and computes nothing for the empty tiles.
    """
    if nq == 0 or nk == 0:
        return True
    if mask is None:
        return False
    return span_kinds(mask, q_offset, q_offset + nq, [(kv_offset, kv_offset + nk)])[0] is BlockKind.EMPTY
