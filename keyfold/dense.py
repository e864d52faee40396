"""Dense tensor masks, as ``F.scaled_dot_product_attention`` takes them.

A boolean tensor (True = attend, SDPA's meaning) becomes a :class:`~keyfold.masks.Mask`; an additive
float tensor becomes an additive :class:`~keyfold.scores.ScoreMod` (its ``-inf`` entries also become
a mask, so they are skipped like any hidden pair). Both broadcast as ``(B|1, H|1, Nq|1, Nk|1)`` and
are indexed relative to the call: entry ``[i, j]`` is the pair at absolute positions
``(q_offset + i, kv_offset + j)``.

Cost compared with a mask object: the engine keeps a private read-only copy (the bytes of the
tensor) hashed by content (one pass), and classifying tiles for block skipping builds prefix sums
over ``(Nq+1) x (Nk+1)`` int32/int64 counts once per distinct mask (cached with the plan). A
preset (``causal()``, ``window(w)``, ``padding(lengths)``) costs none of that.

Under ``torch.compile`` both are data of the ``keyfold::attend`` op (:mod:`keyfold.ops`): the
tensor travels as an op input, so a new mask of the same shape reuses the graph, and a float mask
with ``requires_grad`` gets its gradient from the op's backward.
"""

from __future__ import annotations

import torch

from .masks import BlockKind, Mask, _TensorKey, _kind
from .scores import ScoreMod

__all__ = ["tensor_mask", "check_additive"]


def _shape4(t: torch.Tensor, B: int, H: int, Nq: int, Nk: int, name: str) -> torch.Tensor:
    if t.dim() > 4 or t.dim() == 0:
        raise ValueError(f"{name}: a tensor mask must have 1 to 4 dims broadcastable to (B, H, Nq, Nk) = "
                         f"({B}, {H}, {Nq}, {Nk}), got shape {tuple(t.shape)}")
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    for size, want, what in zip(t4.shape, (B, H, Nq, Nk), ("batch", "heads", "queries", "keys")):
        if size not in (1, want):
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not broadcast to (B, H, Nq, Nk) = "
                             f"({B}, {H}, {Nq}, {Nk}) ({what}: {size} vs {want}); each dim must be 1 or match")
    return t4


def _gather(t: torch.Tensor, b, h, qp, kp, q0: int, k0: int) -> torch.Tensor:
    """``t[b, h, qp - q0, kp - k0]`` with size-1 dims broadcast: ``(B|1, H|1, L|1, S|1)``."""
    if t.shape[0] != 1:
        t = t[b.reshape(-1)]
    if t.shape[1] != 1:
        t = t[:, h.reshape(-1)]
    if t.shape[2] != 1:
        t = t[:, :, (qp - q0).reshape(-1)]
    if t.shape[3] != 1:
        t = t[:, :, :, (kp - k0).reshape(-1)]
    return t




def check_additive(t: torch.Tensor, name: str) -> None:
    """An additive mask may hold finite values and -inf (hidden), never NaN or +inf."""
    det = t.detach()
    if bool(torch.isnan(det).any() | torch.isposinf(det).any()):
        raise ValueError(f"{name} contains NaN or +inf; an additive mask may hold finite values and -inf (hidden)")


class _DenseMask(Mask):
    """A bool tensor ``(B|1, H|1, Nq|1, Nk|1)``, True = visible, at query/key offsets ``q0`` / ``k0``."""

    def __init__(self, t: torch.Tensor, q0: int, k0: int):
        self.table = _TensorKey(t.bool())
        self.q0, self.k0 = int(q0), int(k0)
        self._csum = None

    def evaluate(self, b, h, qp, kp):
        return _gather(self.table.on(qp.device), b, h, qp, kp, self.q0, self.k0)

    def _prefix(self):
        if self._csum is None:
            t = self.table.t
            n = (t.shape[2] + 1) * (t.shape[3] + 1)
            dt = torch.int32 if n < 2 ** 31 else torch.int64
            out = []
            for plane in (t.any(0).any(0), t.all(0).all(0)):  # (Nq|1, Nk|1): some / every (b, h) visible
                c = torch.nn.functional.pad(plane.to(dt).cumsum(0, dtype=dt).cumsum(1, dtype=dt), (1, 0, 1, 0))
                out.append(c)
            self._csum = tuple(out)
        return self._csum

    def classify(self, q0, q1, k0, k1):
        t = self.table.t
        nq, nk = t.shape[2], t.shape[3]

        def rng(lo, hi, off, n):  # local index range; a size-1 dim covers every position
            if n == 1:
                return torch.zeros_like(lo), torch.ones_like(hi)
            return (lo - off).clamp(0, n), (hi - off).clamp(0, n)

        r0, r1 = rng(q0, q1, self.q0, nq)
        c0, c1 = rng(k0, k1, self.k0, nk)
        some, every = self._prefix()

        def count(S):
            return (S[r1, c1] - S[r0, c1] - S[r1, c0] + S[r0, c0]).long()

        cells = (r1 - r0) * (c1 - c0)
        return _kind(count(every) == cells, count(some) == 0)

    def check_positions(self, q_start, q_end, k_start, k_end):
        nq, nk = self.table.t.shape[2], self.table.t.shape[3]
        for what, s, e, off, n in (("query", q_start, q_end, self.q0, nq), ("key", k_start, k_end, self.k0, nk)):
            if n != 1 and e > s and (s < off or e > off + n):
                raise ValueError(f"tensor mask covers {what} positions [{off}, {off + n}) but this call touches "
                                 f"[{s}, {e}); build the mask for this call's shape (it is indexed relative "
                                 f"to the call's offsets)")

    def depends_on_batch_head(self):
        return self.table.t.shape[0] != 1, self.table.t.shape[1] != 1

    def __repr__(self):
        return f"tensor_mask(<{'x'.join(map(str, self.table.t.shape))} bool>, q0={self.q0}, k0={self.k0})"

    def __eq__(self, other):
        return type(other) is _DenseMask and (self.q0, self.k0) == (other.q0, other.k0) and self.table == other.table

    def __hash__(self):
        return hash(("tensor_mask", self.table, self.q0, self.k0))


class _ValuesOf(torch.autograd.Function):
    """``values`` in the forward, the gradient straight to ``live`` (same shape) in the backward"""

    @staticmethod
    def forward(ctx, live, values):
        return values.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


class _DenseBias(ScoreMod):
    """An additive float tensor ``(B|1, H|1, Nq|1, Nk|1)`` (its -inf entries are zeroed here and
    hidden by a companion :class:`_DenseMask`). The bias keeps its dtype (float64 stays float64) and
    is added in the score dtype. ``tensors()`` gives the live tensor, so one with ``requires_grad``
    gets its gradient through autograd of :meth:`apply`."""

    additive = True
    #: what lse gets back of a huge row's shift (set by shifted_bias; None: no row was shifted)
    lse_shift = None

    def __init__(self, t: torch.Tensor, q0: int, k0: int):
        self.live = t                                    # the caller's tensor (may require grad)
        finite = torch.where(torch.isneginf(t.detach()), torch.zeros((), dtype=t.dtype, device=t.device), t.detach())
        self.table = _TensorKey(finite)
        self.q0, self.k0 = int(q0), int(k0)

    def tensors(self):
        return (self.live,)

    def live_tensors(self):
        return ()  # apply reads the copy made when the call began (and gives its gradient to the live tensor)

    def bias(self, b, h, qp, kp):
        return _gather(self.table.on(qp.device), b, h, qp, kp, self.q0, self.k0)

    def apply(self, s, b, h, qp, kp):
        if self.live.requires_grad and torch.is_grad_enabled():
            # the tile's values as they were when the call began (the backward re-runs this), its
            # gradient into the live tensor: a bias changed in place between the forward and the
            # backward (an optimizer step, a clamp) had moved the backward's scores (gradients off
            # by 1-2, a helper's fuzz); torch's SDPA differentiates the values its forward saw too.
            # A key hidden then (-inf) has P = 0, so its gradient is 0 whatever the entry is now
            live = _gather(self.live.to(qp.device), b, h, qp, kp, self.q0, self.k0)
            add = _ValuesOf.apply(live, self.bias(b, h, qp, kp))
        else:
            add = self.bias(b, h, qp, kp)
        return s + add.to(s.dtype)

    def apply_(self, s, b, h, qp, kp):
        return s.add_(self.bias(b, h, qp, kp).to(s.dtype))

    def __repr__(self):
        return f"tensor_bias(<{'x'.join(map(str, self.table.t.shape))} {self.table.t.dtype}>)"

    def __eq__(self, other):
        return type(other) is _DenseBias and (self.q0, self.k0) == (other.q0, other.k0) and self.table == other.table

    def __hash__(self):
        return hash(("tensor_bias", self.table, self.q0, self.k0))


#: A row of an additive mask whose largest entry is below minus this is shifted by it (see
#: shifted_bias): past 2^15 a float32 lse keeps the log of a row's key count to less than 2^-9,
#: and float16's finfo.min (65504) is past it; HF's -10000 for a hidden key is not.
HUGE_BIAS = 2.0 ** 15


def tensor_mask(t: torch.Tensor, *, B: int, H: int, Nq: int, Nk: int, q_offset: int = 0, kv_offset: int = 0,
                name: str = "mask") -> tuple[Mask | None, ScoreMod | None]:
    """SDPA's ``attn_mask`` as ``(keyfold mask, additive score modifier)``.

    t: bool ``(B|1, H|1, Nq|1, Nk|1)`` (True = attend) or float of that shape (added to the scaled
    scores; ``-inf`` = hidden). Fewer dims broadcast from the left, as in SDPA. Entry ``[.., i, j]``
    is the pair ``(q_offset + i, kv_offset + j)``. A float tensor with +inf or NaN is refused.
    A row whose largest entry is below -:data:`HUGE_BIAS` is shifted by that entry
    (the softmax is the same); the bias's ``lse_shift`` ``(B|1, H|1, Nq|1)`` (or None) is what
    the row's lse must get back.

    >>> m, s = tensor_mask(torch.tensor([[True, False]]), B=1, H=1, Nq=1, Nk=2)
    >>> m.to_dense(1, 2, q_offset=0).tolist(), s
    ([[True, False]], None)
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor here, got {type(t).__name__}")
    t4 = _shape4(t, B, H, Nq, Nk, name)
    if t.dtype == torch.bool:
        return _DenseMask(t4, q_offset, kv_offset), None
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be bool (True = attend) or float (added to the scores), got {t.dtype}; "
                        f"convert it with `m.bool()` or `m.float()`")
    det = t4.detach()
    hidden = torch.isneginf(det)
    if torch.compiler.is_compiling():
        # traced: no data-dependent branch. keyfold.ops checks the values, drops an all-visible
        # companion mask and shifts huge rows (shifted_bias) when it rebuilds these objects inside
        # the op, where the data is known.
        return _DenseMask(~hidden, q_offset, kv_offset), _DenseBias(t4, q_offset, kv_offset)
    check_additive(det, name)
    mask = _DenseMask(~hidden, q_offset, kv_offset) if bool(hidden.any()) else None
    return mask, shifted_bias(t4, q_offset, kv_offset)


def shifted_bias(t4: torch.Tensor, q0: int, k0: int) -> _DenseBias:
    """The additive mask ``t4`` as a bias, each row whose largest entry is below -:data:`HUGE_BIAS`
    shifted by it, the shift kept as ``lse_shift`` for lse alone (the softmax does not change).

    Such a row (finfo.min on every key it sees: HF's fully masked rows) would otherwise have an lse
    that holds no log of its key count (ulp(3e38) = 2e31): pieces of the row merged by lse weighed
    each piece, not each key (errors of 1.1-1.7 beyond 2048 keys or 520 causal rows, found by
    fuzzing 2026-12-06), and a backward recomputing P from lse scaled it by the count. Reads the
    values: not while dynamo traces (the compiled op calls it where the data is known)."""
    det = t4.detach()
    shift = None
    top = det.amax(-1, keepdim=True) if det.shape[-1] else None         # -inf on a hidden row
    # (a huge positive top is left alone: taken from a key another mask hides, it would push the
    # row's visible keys down to where their scores round; fuzzing, 2026-12-06)
    huge = None if top is None else torch.isfinite(top) & (top < -HUGE_BIAS)
    if huge is not None and bool(huge.any()):
        shift = torch.where(huge, top, torch.zeros((), dtype=top.dtype))
        t4 = t4 - shift
    bias = _DenseBias(t4, q0, k0)
    if shift is not None:
        bias.lse_shift = shift[..., 0]                                  # (B|1, H|1, Nq|1)
    return bias


def lse_shift_of(score) -> torch.Tensor | None:
    """The ``lse_shift`` of the shifted bias in ``score`` (itself or one link of a chain), or None"""
    for m in getattr(score, "mods", (score,)):
        if isinstance(m, _DenseBias) and m.lse_shift is not None:
            return m.lse_shift
    return None
