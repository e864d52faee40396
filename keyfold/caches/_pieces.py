"""What a cache hands to :func:`keyfold.caches.decode`: groups of query rows and key spans.

A cache never computes attention. It only says where its keys live: for a group of query
rows (sequences of equal length, stored side by side) a few contiguous *spans* of keys,
each a view of the cache's storage with the absolute position of its first key. Decoding
is then :func:`keyfold.attend` per span (``kv_offset`` = that position, so every mask and
score modifier sees the true positions) merged with :func:`keyfold.merge_all`.

Also here: the two small mask/score wrappers that keep a batch-dependent mask meaning the
same when decode runs on a slice of the batch (:class:`BatchRows`), and when cascade folds
many requests' queries into the rows of one call (:class:`QueryRows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..masks import Mask
from ..scores import ScoreMod

__all__ = ["Cache", "Span", "Group", "CacheFullError", "BatchRows", "BatchRowsScore", "QueryRows",
           "QueryRowsScore", "RowMap"]


class CacheFullError(RuntimeError):
    """Raised when an append does not fit (capacity, or the page pool); the cache is unchanged."""


@dataclass(frozen=True)
class Span:
    """Keys ``[kv_offset, kv_offset + n)`` of a group: ``k`` ``(b, Hkv, n, D)``, ``v`` ``(b, Hkv, n, Dv)``.

    ``k`` and ``v`` are views of the cache's storage (no copy).
    """

    k: torch.Tensor
    v: torch.Tensor
    kv_offset: int

    @property
    def n(self) -> int:
        return self.k.shape[2]


@dataclass(frozen=True)
class Group:
    """Query rows ``[r0, r1)`` of ``q``: sequences holding ``length`` tokens each, keys in ``spans``.

    The group's queries are the last ``Nq`` tokens of each sequence (bottom-right):
    query ``i`` sits at absolute position ``length - Nq + i``.

    ``row_lengths`` (only when nothing reads positions): the rows' sequences hold different
    numbers of tokens, row ``r``'s keys are the positions below ``row_lengths[r]`` (``length`` is
    the largest); decode hides the rest with a per-row key count, so a ragged batch is one call.
    """

    r0: int
    r1: int
    length: int
    spans: tuple[Span, ...]
    row_lengths: tuple[int, ...] | None = None


# ------------------------------------------------------------------- batch-slice wrappers


class BatchRows(Mask):
    """``mask`` as seen by batch rows ``[b0, b0 + n)`` of a batch of ``B`` (decode on a slice).

    The core's batch-dependent masks (per-batch ``documents`` ids, ``sinks`` counts, callables
    that read ``b``) answer for the whole batch, so we evaluate on all ``B`` rows and keep ours.
    Classification is the inner mask's (over all rows: a superset, hence sound).
    """

    def __init__(self, mask: Mask, B: int, b0: int, n: int):
        self.mask, self.B, self.b0, self.n = mask, B, b0, n

    def evaluate(self, b, h, qp, kp):
        full_b = torch.arange(self.B, device=qp.device).view(self.B, 1, 1, 1)
        m = self.mask.evaluate(full_b, h, qp, kp)
        return m if m.dim() < 4 or m.shape[0] == 1 else m[self.b0:self.b0 + self.n]

    def classify(self, q0, q1, k0, k1):
        return self.mask.classify(q0, q1, k0, k1)

    def check_positions(self, *span):
        self.mask.check_positions(*span)

    def depends_on_batch_head(self, B=None, H=None):
        return self.mask.depends_on_batch_head(B, H)

    def __repr__(self):
        return f"{self.mask!r}[rows {self.b0}:{self.b0 + self.n} of {self.B}]"

    def __eq__(self, other):
        return (type(other) is BatchRows
                and (self.mask, self.B, self.b0, self.n) == (other.mask, other.B, other.b0, other.n))

    def __hash__(self):
        return hash(("batch_rows", self.mask, self.B, self.b0, self.n))


class BatchRowsScore(ScoreMod):
    """A score modifier as seen by batch rows ``[b0, b0 + n)``: its ``b`` is shifted by ``b0``.

    Score modifiers hold no per-batch tensors (ALiBi slopes are per head), so only a callable
    reads ``b``, and it reads the value: shifting the index is enough.
    """

    def __init__(self, score: ScoreMod, b0: int):
        self.score, self.b0 = score, b0
        self.additive = score.additive

    def bias(self, b, h, qp, kp):
        return self.score.bias(b + self.b0, h, qp, kp)

    def apply(self, s, b, h, qp, kp):
        return self.score.apply(s, b + self.b0, h, qp, kp)

    def check_heads(self, H):
        self.score.check_heads(H)

    def tensors(self):
        return self.score.tensors()

    def __repr__(self):
        return f"{self.score!r}[batch from row {self.b0}]"

    def __eq__(self, other):
        return type(other) is BatchRowsScore and (self.score, self.b0) == (other.score, other.b0)

    def __hash__(self):
        return hash(("batch_rows_score", self.score, self.b0))


# ------------------------------------------------------------------- query-row wrappers


class RowMap:
    """Row ``i`` of a folded call is request ``req[i]``'s query at absolute position ``pos[i]``.

    The call passes ``q_offset=0``, so the engine's ``qp`` is the row index. An inner mask or
    score is evaluated for all ``R`` requests at the rows' true positions, and each row keeps
    its own request's answer: batch-dependent masks and ``b``-reading callables stay exact.
    """

    def __init__(self, pos: torch.Tensor, req: torch.Tensor, R: int):
        self.pos, self.req, self.R = pos.long().cpu(), req.long().cpu(), R
        self.key = (tuple(self.pos.tolist()), tuple(self.req.tolist()), R)

    def args(self, h, qp):
        rows = qp.reshape(-1).cpu()
        real_qp = self.pos[rows].view(qp.shape).to(qp.device)
        full_b = torch.arange(self.R, device=qp.device).view(self.R, 1, 1, 1)
        return full_b, h, real_qp, rows

    def pick(self, t: torch.Tensor, rows: torch.Tensor, S: int) -> torch.Tensor:
        """``(R|1, H', L|1, S|1)`` answers -> ``(1, H', L, S)``: row i from request req[i]."""
        t = t.view((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t
        if t.shape[0] == 1:
            return t
        L = rows.numel()
        t = torch.broadcast_to(t, (t.shape[0], t.shape[1], L, S))
        req = self.req[rows].to(t.device)
        return t[req, :, torch.arange(L, device=t.device), :].permute(1, 0, 2).unsqueeze(0)  # (1, H', L, S)


class QueryRows(Mask):
    """``mask`` for a call whose query rows stand for many requests' queries (see :class:`RowMap`).

    A query block is classified by the range of its rows' true positions (a superset of the
    rows, hence sound: FULL or EMPTY there is FULL or EMPTY for every row).
    """

    def __init__(self, mask: Mask, rowmap: RowMap):
        self.mask, self.map = mask, rowmap

    def evaluate(self, b, h, qp, kp):
        full_b, h, real_qp, rows = self.map.args(h, qp)
        return self.map.pick(self.mask.evaluate(full_b, h, real_qp, kp), rows, kp.numel())

    def classify(self, q0, q1, k0, k1):
        pos = self.map.pos
        spans = zip(q0.view(-1).tolist(), q1.view(-1).tolist())
        lo_hi = [(int(pos[a:c].min()), int(pos[a:c].max()) + 1) for a, c in spans]
        lo = torch.tensor([a for a, _ in lo_hi]).view(-1, 1)
        hi = torch.tensor([c for _, c in lo_hi]).view(-1, 1)
        return self.mask.classify(lo, hi, k0, k1)

    def check_positions(self, q_start, q_end, k_start, k_end):
        pos = self.map.pos
        self.mask.check_positions(int(pos.min()), int(pos.max()) + 1, k_start, k_end)

    def depends_on_batch_head(self, B=None, H=None):
        return False, self.mask.depends_on_batch_head(B, H)[1]

    def __repr__(self):
        return f"{self.mask!r}[{self.map.R} requests folded into rows]"

    def __eq__(self, other):
        return type(other) is QueryRows and self.mask == other.mask and self.map.key == other.map.key

    def __hash__(self):
        return hash(("query_rows", self.mask, self.map.key))


class QueryRowsScore(ScoreMod):
    """A score modifier for folded query rows: true positions, and ``b`` = each row's request."""

    def __init__(self, score: ScoreMod, rowmap: RowMap):
        self.score, self.map = score, rowmap
        self.additive = score.additive

    def _args(self, qp):
        rows = qp.reshape(-1).cpu()
        real_qp = self.map.pos[rows].view(qp.shape).to(qp.device)
        req = self.map.req[rows].view(qp.shape).to(qp.device)  # (1, 1, L, 1)
        return req, real_qp

    def bias(self, b, h, qp, kp):
        req, real_qp = self._args(qp)
        return self.score.bias(req, h, real_qp, kp)

    def apply(self, s, b, h, qp, kp):
        req, real_qp = self._args(qp)
        return self.score.apply(s, req, h, real_qp, kp)

    def check_heads(self, H):
        self.score.check_heads(H)

    def tensors(self):
        return self.score.tensors()

    def __repr__(self):
        return f"{self.score!r}[{self.map.R} requests folded into rows]"

    def __eq__(self, other):
        return type(other) is QueryRowsScore and self.score == other.score and self.map.key == other.map.key

    def __hash__(self):
        return hash(("query_rows_score", self.score, self.map.key))


class Cache(Protocol):
    """What :func:`keyfold.caches.decode` needs from a cache (all three caches implement it).

    ``pieces(seq_ids, n_queries, exact_positions)``: the groups of query rows and the spans of
    keys they read. With ``exact_positions=False`` (no mask or score reads positions) a span's
    keys may come in any order and its ``kv_offset`` is then meaningless.
    ``implied_mask(n_queries)``: the mask the cache stands for when ``n_queries`` queries read
    it (the window cache's ``causal() & (window(W - 1) | sinks(S))``), or None when every key in
    the spans is visible to every query.
    """

    dtype: torch.dtype
    heads: int
    head_dim: int
    value_dim: int

    def pieces(self, seq_ids=None, n_queries: int = 1, exact_positions: bool = True) -> list[Group]: ...

    def implied_mask(self, n_queries: int) -> Mask | None: ...
