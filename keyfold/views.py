"""Views: a mask or score modifier seen through remapped indices.

The walls (:mod:`keyfold.caches`, :mod:`keyfold.distributed`) run ``attend`` on a part of a
larger problem, and the part's own indices are not the indices the user's mask and score
modifier were written for. A :class:`Remap` says how a part's indices become the whole's:

==================  =================================================  =======================
remap               local index -> the inner mask's / score's index     used by
==================  =================================================  =======================
``q=(q0, qs)``      query position ``qp -> q0 + qp*qs``                  striped ring shards
``k=(k0, ks)``      key position ``kp -> k0 + kp*ks``                    striped ring shards
``h0``              head ``h -> h0 + h``                                 head-sliced work
``batch=(B, b0)``   batch row ``b -> b0 + b`` of a batch of ``B``         decode on a slice
``rows=RowTable``   query row ``i -> (request req[i], position pos[i])``  cascade's folded rows
==================  =================================================  =======================

A stride-1 shift needs no view: ``attend`` takes ``q_offset`` / ``kv_offset`` directly, and the
planner keeps its closed forms. :class:`MaskView` and :class:`ScoreView` implement the mask and
score protocols (:class:`keyfold.masks.Mask`, :class:`keyfold.scores.ScoreMod`); a view is no
preset and no combinator (``spec()`` / ``operands()`` / ``parts()`` answer None), so compilers
evaluate it tile by tile. A view classifies a tile by asking the inner mask about the hull of
the tile's true positions, which is sound: a hull that is EMPTY (FULL) holds only hidden
(visible) pairs.

Batch rows differ between the two: a core mask that depends on the batch answers for the whole
batch at once (a ``(B, ...)`` tensor, whatever ``b`` holds), so a mask view evaluates all ``B``
rows and keeps its own; a score modifier reads the value of ``b`` (ALiBi's per-batch slopes are
indexed by it), so a score view shifts the index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .masks import BlockKind, Mask, inherit_watch
from .scores import ScoreKind, ScoreMod, alibi, as_score

__all__ = ["RowTable", "Remap", "MaskView", "ScoreView", "heads_slice", "span_kinds"]


class RowTable:
    """Row ``i`` of a folded call is request ``req[i]``'s query at absolute position ``pos[i]``.

    The folded call passes ``q_offset=0``, so the engine's ``qp`` is the row index.
    pos, req: int tensors ``(L,)``; R: the number of requests (the inner's batch).
    """

    def __init__(self, pos: torch.Tensor, req: torch.Tensor, R: int):
        self.pos, self.req, self.R = pos.long().cpu(), req.long().cpu(), R
        self.key = (tuple(self.pos.tolist()), tuple(self.req.tolist()), R)

    def __eq__(self, other):
        return isinstance(other, RowTable) and self.key == other.key

    def __hash__(self):
        return hash(("row_table", self.key))


@dataclass(frozen=True)
class Remap:
    """How a view's local indices become the inner's (see the module's table).

    q, k: ``(start, stride)``; h0: the first head; batch: ``(B, b0)``; rows: a :class:`RowTable`
    (then ``q`` is the identity: the rows' positions come from the table).
    """

    q: tuple[int, int] = (0, 1)
    k: tuple[int, int] = (0, 1)
    h0: int = 0
    batch: tuple[int, int] | None = None
    rows: RowTable | None = field(default=None)

    def __post_init__(self):
        if self.rows is not None and (self.q != (0, 1) or self.batch is not None):
            raise ValueError("Remap(rows=...): a row table gives the rows' positions and requests itself; "
                             "pass neither q nor batch with it")

    def qpos(self, qp):
        """Query positions (tensors or ints) -> the inner's."""
        return qp if self.q == (0, 1) else self.q[0] + qp * self.q[1]

    def kpos(self, kp):
        """Key positions (tensors or ints) -> the inner's."""
        return kp if self.k == (0, 1) else self.k[0] + kp * self.k[1]

    def head(self, h):
        return h if self.h0 == 0 else h + self.h0

    def q_hull(self, q0, q1):
        """Half-open local query ranges (int tensors ``(nq, 1)``) -> half-open hulls of the inner's positions."""
        if self.rows is not None:
            pos = self.rows.pos
            spans = zip(q0.view(-1).tolist(), q1.view(-1).tolist())
            lo_hi = [(int(pos[a:c].min()), int(pos[a:c].max()) + 1) for a, c in spans]
            return (torch.tensor([a for a, _ in lo_hi]).view(-1, 1),
                    torch.tensor([c for _, c in lo_hi]).view(-1, 1))
        return (q0, q1) if self.q == (0, 1) else (self.qpos(q0), self.qpos(q1 - 1) + 1)

    def k_hull(self, k0, k1):
        return (k0, k1) if self.k == (0, 1) else (self.kpos(k0), self.kpos(k1 - 1) + 1)

    def __repr__(self):
        parts = []
        if self.q != (0, 1):
            parts.append(f"q={self.q[0]}+{self.q[1]}i")
        if self.k != (0, 1):
            parts.append(f"k={self.k[0]}+{self.k[1]}j")
        if self.h0:
            parts.append(f"h+{self.h0}")
        if self.batch is not None:
            parts.append(f"b+{self.batch[1]} of {self.batch[0]}")
        if self.rows is not None:
            parts.append(f"{self.rows.R} requests folded into rows")
        return ", ".join(parts) or "identity"


def _rows_args(rows: RowTable, qp):
    """The folded rows' indices, their true positions and their requests, shaped like ``qp``."""
    idx = qp.reshape(-1).cpu()
    real_qp = rows.pos[idx].view(qp.shape).to(qp.device)
    req = rows.req[idx].view(qp.shape).to(qp.device)  # (1, 1, L, 1)
    return idx, real_qp, req


def _pick_rows(rows: RowTable, t: torch.Tensor, idx: torch.Tensor, S: int) -> torch.Tensor:
    """``(R|1, H', L|1, S|1)`` answers -> ``(1, H', L, S)``: row i from request req[i]."""
    t = t.view((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t
    if t.shape[0] == 1:
        return t
    L = idx.numel()
    t = torch.broadcast_to(t, (t.shape[0], t.shape[1], L, S))
    req = rows.req[idx].to(t.device)
    return t[req, :, torch.arange(L, device=t.device), :].permute(1, 0, 2).unsqueeze(0)  # (1, H', L, S)


class _Seen:
    """What both views share: shown as ``inner[remap]``, equal and hashed by type and ``_key()``."""

    def __repr__(self):
        return f"{self.inner!r}[{self.remap!r}]"

    def __eq__(self, other):
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self):
        return hash((type(self).__name__,) + self._key())


class MaskView(_Seen, Mask):
    """``inner`` seen through ``remap``: ``evaluate(b, h, qp, kp)`` asks ``inner`` at the remapped indices.

    >>> import keyfold
    >>> striped = MaskView(keyfold.causal(), Remap(q=(1, 4), k=(0, 4)))  # rank 1 of 4 vs rank 0
    >>> striped.to_dense(2, 2, q_offset=0).int().tolist()
    [[1, 0], [1, 1]]
    """

    def __init__(self, inner: Mask, remap: Remap, n_batch: int | None = None):
        # n_batch: the local batch rows (a batch remap keeps rows b0 .. b0 + n_batch - 1)
        if remap.batch is not None and n_batch is None:
            raise ValueError("MaskView(remap=Remap(batch=...)): pass n_batch, the number of local batch rows")
        self.inner, self.remap, self.n_batch = inner, remap, n_batch

    def evaluate(self, b, h, qp, kp):
        r = self.remap
        h, kp = r.head(h), r.kpos(kp)
        if r.rows is not None:  # every request at the rows' true positions; each row keeps its own
            idx, real_qp, _ = _rows_args(r.rows, qp)
            full_b = torch.arange(r.rows.R, device=qp.device).view(r.rows.R, 1, 1, 1)
            return _pick_rows(r.rows, self.inner.evaluate(full_b, h, real_qp, kp), idx, kp.numel())
        qp = r.qpos(qp)
        if r.batch is None:
            return self.inner.evaluate(b, h, qp, kp)
        B, b0 = r.batch  # the whole batch's answer, then our rows
        full_b = torch.arange(B, device=qp.device).view(B, 1, 1, 1)
        m = self.inner.evaluate(full_b, h, qp, kp)
        return m if m.dim() < 4 or m.shape[0] == 1 else m[b0:b0 + self.n_batch]

    def classify(self, q0, q1, k0, k1):
        return self.inner.classify(*self.remap.q_hull(q0, q1), *self.remap.k_hull(k0, k1))

    def check_positions(self, q_start, q_end, k_start, k_end):
        r = self.remap
        if r.rows is not None:
            pos = r.rows.pos
            self.inner.check_positions(int(pos.min()), int(pos.max()) + 1, *r.k_hull(k_start, k_end))
        elif r.q == (0, 1) and r.k == (0, 1):
            self.inner.check_positions(q_start, q_end, k_start, k_end)
        elif q_end > q_start and k_end > k_start:  # half-open local ranges -> the inner's hulls
            self.inner.check_positions(*r.q_hull(q_start, q_end), *r.k_hull(k_start, k_end))

    def depends_on_batch_head(self, B=None, H=None):
        # a folded call has batch 1: each row's request is already picked
        dep = self.inner.depends_on_batch_head(B, H)
        return (False, dep[1]) if self.remap.rows is not None else dep

    def _key(self):
        return (self.inner, self.remap, self.n_batch)


class ScoreView(_Seen, ScoreMod):
    """A score modifier seen through ``remap``, like :class:`MaskView`; ``b`` is the inner's batch
    row (shifted by a batch remap, each row's request under a row table)."""

    def __init__(self, inner: ScoreMod, remap: Remap):
        self.inner, self.remap = inner, remap
        self.additive = inner.additive

    def _map(self, b, h, qp, kp):
        r = self.remap
        h, kp = r.head(h), r.kpos(kp)
        if r.rows is not None:
            _, real_qp, req = _rows_args(r.rows, qp)
            return req, h, real_qp, kp
        if r.batch is not None:
            b = b + r.batch[1]
        return b, h, r.qpos(qp), kp

    def apply(self, s, b, h, qp, kp):
        return self.inner.apply(s, *self._map(b, h, qp, kp))

    def bias(self, b, h, qp, kp):
        return self.inner.bias(*self._map(b, h, qp, kp))

    def check_heads(self, H):
        self.inner.check_heads(H)

    def tensors(self):
        return self.inner.tensors()

    def live_tensors(self):
        return self.inner.live_tensors()

    def _key(self):
        return (self.inner, self.remap)


def heads_slice(score: ScoreMod | None, h0: int, h1: int) -> ScoreMod | None:
    """``score`` restricted to query heads ``[h0, h1)``: ALiBi keeps only those heads' slopes
    (its bias broadcasts slopes over the head axis); callables see shifted head indices through
    :class:`ScoreView` (``Remap(h0=...)``); softcap does not depend on the head."""
    if score is None:
        return None
    spec = score.spec()
    if spec is not None and spec[0] is ScoreKind.ALIBI:
        return inherit_watch(alibi(spec[1]["slopes"][..., h0:h1]), score)  # (its slopes' watch: 2.5 off, 2026-12-08)
    if score.parts() is not None:
        return as_score([heads_slice(m, h0, h1) for m in score.parts()])
    return score


def span_kinds(mask: Mask, q0: int, q1: int, spans) -> list[BlockKind | None]:
    """The mask's closed-form kind for query positions ``[q0, q1)`` against each key span
    ``(k0, k1)`` of ``spans``, in one call; None per span when the mask has no closed form (a
    callable: the piece goes to ``attend``, whose planner evaluates it)."""
    spans = list(spans)
    if not spans:
        return []
    k0 = torch.tensor([[a for a, _ in spans]])  # (1, n_spans)
    k1 = torch.tensor([[e for _, e in spans]])  # (1, n_spans)
    kinds = mask.classify(torch.tensor([[q0]]), torch.tensor([[q1]]), k0, k1)
    if kinds is None:
        return [None] * len(spans)
    return [BlockKind(int(x)) for x in torch.broadcast_to(kinds, (1, len(spans))).reshape(-1).tolist()]
