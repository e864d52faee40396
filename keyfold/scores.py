"""Score modifiers: functions of the scaled score ``s = scale * q·k``.

An *additive* modifier (ALiBi) only adds a bias that depends on positions, so the fused
kernel takes it as an additive mask. Any other modifier (softcap, a user's callable) runs
tile by tile in torch ops. A list composes left to right.
"""

from __future__ import annotations

import enum
import math
from typing import Callable

import torch

from . import _callables
from .masks import Logic, Varlen, _TensorKey, _fn_name, watch

__all__ = ["ScoreKind", "ScoreMod", "alibi", "alibi_slopes", "softcap", "score_fn", "as_score"]


class ScoreKind(enum.Enum):
    """The modifiers a backend may compile natively (see :meth:`ScoreMod.spec`)."""

    ALIBI = "alibi"      # {"slopes": float32 (H,)}
    SOFTCAP = "softcap"  # {"cap": float}


class ScoreMod:
    """The score protocol. ``apply(s, b, h, qp, kp)`` maps float32 scores ``(B, H, L, S)``;
    a modifier of your own subclasses this and implements ``apply`` (and, if it only adds a
    bias, ``additive = True`` and ``bias``). ``spec()`` names a preset a backend may compile,
    ``parts()`` the modifiers of a chain; a modifier with neither runs in torch ops per tile.

    Index tensors broadcast as in :meth:`keyfold.masks.Mask.evaluate` (absolute positions).
    Additive modifiers also give ``bias(b, h, qp, kp)`` with ``apply(s) == s + bias``.
    """

    _watchable = True  # check_unchanged looks inside (the presets it is made of)
    additive = False
    #: True when the modifier depends on positions only through ``qp - kp``.
    translation_invariant = False

    def apply(self, s, b, h, qp, kp):
        raise NotImplementedError

    def separable(self, q0: int, q1: int, k0: int, k1: int, device):
        """For an additive modifier on the rectangle [q0, q1) x [k0, k1) (absolute positions):
        ``(row, key)`` with ``bias == row[..., None] + key``, row ``(1, H|1, L)`` and key
        ``(1, H|1, 1, S)``, in float64 (callers cast to their state dtype), or None. A row term
        leaves the softmax unchanged and only shifts lse, so the fused kernel gets an O(S) mask
        instead of an O(L·S) tile."""
        return None

    def bias(self, b, h, qp, kp):
        raise NotImplementedError(f"{self!r} is not additive")

    def apply_(self, s, b, h, qp, kp):
        """``apply`` that may overwrite ``s`` (the forward kernels own their score tiles)."""
        return self.apply(s, b, h, qp, kp)

    def check_heads(self, H: int) -> None:
        """Raise if the modifier cannot serve ``H`` query heads."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors ``apply`` (and ``bias``) read that may need gradients; default none.

        When one of them has ``requires_grad`` and grad mode is on, the engine passes it to
        its autograd function and gives it its gradient: the backward differentiates ``apply``
        tile by tile (``torch.autograd.grad(s, [raw, *tensors], dS)``, summed over pieces).
        Additive modifiers get the same treatment."""
        return ()

    def live_tensors(self) -> tuple[torch.Tensor, ...]:
        """Those of :meth:`tensors` that ``apply`` reads as they are when it runs, not as a copy taken
        when the call began; default all of them. The backward runs ``apply`` again, so a backward
        after one of these changed in place raises (it would differentiate other values)."""
        return self.tensors()

    def check_batch(self, B: int) -> None:
        """Raise if the modifier cannot serve a batch of ``B`` (per-batch ALiBi slopes)."""

    def spec(self) -> tuple[ScoreKind, dict] | None:
        """``(kind, parameters)`` when this is a preset a backend may compile natively, else None."""
        return None

    def parts(self) -> tuple["ScoreMod", ...] | None:
        """The modifiers this one applies left to right (a chain), else None."""
        return None


class _Alibi(ScoreMod):
    additive = True
    translation_invariant = True

    def __init__(self, slopes: torch.Tensor):
        if not isinstance(slopes, torch.Tensor) or slopes.dim() not in (1, 2) or not slopes.dtype.is_floating_point:
            got = tuple(slopes.shape) if isinstance(slopes, torch.Tensor) else type(slopes).__name__
            raise ValueError(f"alibi(slopes): expected a float tensor (H,) with one slope per query head, or "
                             f"(B, H) per batch entry and head (FlashAttention's alibi_slopes); got {got}; "
                             f"alibi_slopes(H) gives the paper's geometric slopes")
        if slopes.requires_grad and torch.is_grad_enabled():
            # the preset holds a read-only copy, so the slopes would silently get no gradient
            raise ValueError("alibi(slopes): slopes require grad, but alibi() holds fixed slopes and gives them "
                             "no gradient; for learnable slopes pass a score callable that reads them, e.g. "
                             "score=lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs() (it trains like Flex's), "
                             "or pass slopes.detach() to keep them fixed")
        self.slopes = _TensorKey(slopes.float())
        watch(self, slopes)

    def _per_batch(self) -> bool:
        return self.slopes.t.dim() == 2

    def _place(self, qp):
        """``(where each query row measures its distance from, what picks its slopes)``: its position, no pick"""
        return qp.long(), None

    def bias(self, b, h, qp, kp, dtype: torch.dtype = torch.float32):
        a, pick = self._place(qp)
        # the distance in exact int64 arithmetic, then cast: float32 positions are exact only below 2^24
        dist = (a - kp.long()).abs().to(dtype)
        t = self.slopes.on(qp.device).to(dtype)
        # slopes broadcast over the head axis (a head slice holds its heads' slopes, see
        # keyfold.views.heads_slice); per-batch slopes are picked by b: (B|1, H, 1|L, 1), per-sequence ones by
        # the rows' sequences (_VarlenAlibi): (1, H, L, 1)
        if pick is None and self._per_batch():
            pick = b.long()
        slopes = t.view(1, -1, 1, 1) if pick is None else t[pick].movedim(-1, 1).squeeze(2)
        return -slopes * dist

    def apply(self, s, b, h, qp, kp):
        # float64 scores (the reference) get the bias in float64: in float32 a distance past 2^24 rounds,
        # and a bias of -slope x 2^31 has an ulp of 32 (found in review: the reference was off by 1.9
        # with every key 2^31 behind)
        return s + self.bias(b, h, qp, kp, torch.float64 if s.dtype is torch.float64 else torch.float32)

    def separable(self, q0, q1, k0, k1, device):
        # Anchored at the tile's key r: -s|qp - kp| = -s|qp - r| + (-s|r - kp|) when every key is on one
        # side of every query. Both offsets are taken in int64 and only then cast, so the key term holds
        # numbers below the tile size at any absolute position; the row term only shifts lse.
        t = self.slopes.on(device)
        slopes = t.unsqueeze(-1) if self._per_batch() else t.view(1, -1, 1)  # (B|1, H, 1)
        qp = torch.arange(q0, q1, device=device, dtype=torch.int64).view(1, 1, -1)
        kp = torch.arange(k0, k1, device=device, dtype=torch.int64).view(1, 1, -1)
        if k1 - 1 <= q0:    # every key at or before every query: anchored at the last key
            r = k1 - 1
        elif k0 >= q1 - 1:  # every key at or after every query: anchored at the first key
            r = k0
        else:
            return None
        # in float64 (exact products of a float32 slope and an integer below 2^29): float64 inputs
        # need it (float32 terms left them 1.6e-5 off; found by fuzzing, 2026-12-05), the others round once
        slopes = slopes.double()
        return -slopes * (qp - r).abs().double(), (-slopes * (kp - r).abs().double()).unsqueeze(2)

    def check_heads(self, H):
        n = self.slopes.t.shape[-1]
        if n != H:
            raise ValueError(f"alibi(slopes): {n} slopes for {H} query heads; pass one slope per query head")

    def check_batch(self, B):
        if self._per_batch() and self.slopes.t.shape[0] != B:
            raise ValueError(f"alibi(slopes): slopes of shape {tuple(self.slopes.t.shape)} are per batch entry, "
                             f"but the batch has {B}; pass (B, H) slopes for this batch or (H,) for all")

    def spec(self):
        return ScoreKind.ALIBI, {"slopes": self.slopes.t}

    def __repr__(self):
        return f"alibi(<{'x'.join(map(str, self.slopes.t.shape))} slopes>)"

    def __eq__(self, other):
        return type(other) is _Alibi and self.slopes == other.slopes

    def __hash__(self):
        return hash(("alibi", self.slopes))


class _VarlenAlibi(_Alibi):
    """:func:`alibi` under a :func:`keyfold.masks.varlen` mask: each sequence's own bottom-right distance
    ``|i + Lk - Lq - j|``, FlashAttention's varlen ALiBi, which is ``|qp + shift[s] - kp|`` on packed
    positions (the mask's per-sequence shift); slopes ``(sequences, H)`` are picked by the query's
    sequence. Made by :func:`aligned`, never by users."""

    translation_invariant = False

    def __init__(self, alibi: _Alibi, varlen: Varlen, per_sequence: bool):
        self.slopes, self.varlen, self.per_sequence = alibi.slopes, varlen, per_sequence
        self._watched = list(getattr(alibi, "_watched", ()))

    def _per_batch(self) -> bool:
        return self.slopes.t.dim() == 2 and not self.per_sequence

    def _place(self, qp):
        q = qp[:, :1] if qp.dim() == 4 else qp  # (positions never depend on the head)
        sq = Varlen._seq(self.varlen.cu_q.on(q.device), q)
        # the query's place among its sequence's keys; per-sequence slopes picked by its sequence
        return q.long() + self.varlen._shift.to(q.device)[sq], (sq if self.per_sequence else None)

    def separable(self, q0, q1, k0, k1, device):
        return None

    def check_batch(self, B):
        n = self.varlen.cu_q.t.numel() - 1
        if not self.per_sequence:
            super().check_batch(B)
        elif self.slopes.t.shape[0] != n:
            raise ValueError(f"alibi(slopes): slopes of shape {tuple(self.slopes.t.shape)} are per sequence, but "
                             f"the varlen mask packs {n} sequences; pass ({n}, H) slopes or (H,) for all")

    def spec(self):
        return None

    def __repr__(self):
        return f"alibi(<{'x'.join(map(str, self.slopes.t.shape))} slopes>, per sequence of {self.varlen!r})"

    def __eq__(self, other):
        return (type(other) is _VarlenAlibi and self.slopes == other.slopes and self.varlen == other.varlen
                and self.per_sequence == other.per_sequence)

    def __hash__(self):
        return hash(("varlen-alibi", self.slopes, self.varlen, self.per_sequence))


def _varlen_of(mask):
    """The :class:`~keyfold.masks.Varlen` a mask is, or is a conjunction with, else None."""
    if type(mask) is Varlen:
        return mask
    ops = mask.operands() if mask is not None else None
    if ops is not None and ops[0] is Logic.AND:
        return next((v for v in map(_varlen_of, ops[1]) if v is not None), None)
    return None


def aligned(score, mask, B: int):
    """``score`` with its :func:`alibi` measured inside each sequence of a varlen ``mask`` (FlashAttention's
    varlen ALiBi): packed positions gave ``|qp - kp|``, another distance wherever queries and keys are packed
    differently (chunked prefill, decoding: 1.8-3.0 off, gradients 3-7.8; a review, 2026-12-08), and
    FlashAttention's ``(sequences, H)`` slopes were refused. Anything else is returned as it is."""
    if score is None or mask is None:
        return score
    parts = score.parts()
    if parts is not None:
        new = [aligned(x, mask, B) for x in parts]
        return score if all(a is b for a, b in zip(new, parts)) else as_score(new)
    if type(score) is not _Alibi:
        return score
    vl = _varlen_of(mask)
    if vl is None:
        return score
    # (B, H) slopes of this batch are picked by batch entry as before; other 2-d slopes by sequence
    per_sequence = score._per_batch() and score.slopes.t.shape[0] != B
    if not per_sequence and bool((vl._shift == 0).all()):
        return score  # queries and keys packed alike: packed distances are the sequences' own
    return _VarlenAlibi(score, vl, per_sequence)


class _Softcap(ScoreMod):
    def __init__(self, cap: float):
        if isinstance(cap, torch.Tensor) and cap.dim() == 0 and cap.dtype.is_floating_point \
                and not torch.compiler.is_compiling():
            if cap.requires_grad:  # a fixed number here: a learnable cap would get no gradient
                raise ValueError("softcap(cap): cap requires grad, but softcap() holds a fixed number; for a "
                                 "learnable cap pass score=lambda s, b, h, q, kv: cap * torch.tanh(s / cap)")
            cap = float(cap)  # a 0-d float tensor (a config's value kept as a tensor): its number
        elif isinstance(cap, torch.Tensor) and cap.dim() == 0 and cap.dtype.is_floating_point:
            # while dynamo traces: the tensor travels as data of the graph and the op takes its number (its
            # checks ran into dynamo's "Unsupported repr() on tensor" under fullgraph=True; a review, 2026-12-08)
            self.cap = cap
            return
        if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0 or math.isinf(cap):
            raise ValueError(f"softcap(cap): cap must be a finite number > 0 (or a 0-d float tensor), got {cap!r}")
        self.cap = float(cap)

    def apply(self, s, b, h, qp, kp):
        return self.cap * torch.tanh(s / self.cap)

    def apply_(self, s, b, h, qp, kp):
        return s.div_(self.cap).tanh_().mul_(self.cap)

    def spec(self):
        return ScoreKind.SOFTCAP, {"cap": self.cap}

    def __repr__(self):
        return f"softcap({self.cap:g})"

    def __eq__(self, other):
        return type(other) is _Softcap and self.cap == other.cap

    def __hash__(self):
        return hash(("softcap", self.cap))


def _leaves(t: torch.Tensor) -> set:
    """ids of the autograd leaves (tensors that require grad) ``t`` is made from (itself if it is one)."""
    if t.grad_fn is None:
        return {id(t)} if t.requires_grad else set()
    out, seen, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if var is not None:
            out.add(id(var))
        stack += [n for n, _ in node.next_functions]
    return out


class ScoreFn(ScoreMod):
    """A FlexAttention-style ``score_mod(score, b, h, q_idx, kv_idx)`` callable (absolute positions).

    Evaluated once per tile on broadcast index grids, or per element under ``torch.vmap`` when
    the callable is written per element for Flex (see :mod:`keyfold._callables`). ``score`` is
    float32 for 16/32-bit inputs (float64 for float64) and the result is cast back to it, as in
    Flex: a float64 table added to float32 scores gives float32 scores.

    Tensors the callable reads (closure cells, defaults, the globals it names, a bound method's
    object or an ``nn.Module``'s parameters, ``functools.partial`` arguments, nested functions)
    are found by :meth:`tensors`; pass others with ``tensors=[...]``. Those with
    ``requires_grad`` get gradients.
    """

    def __init__(self, fn: Callable, tensors=()):
        if not callable(fn):
            raise TypeError(f"score_fn(fn): expected a score_mod(score, b, h, q_idx, kv_idx) callable, "
                            f"got {type(fn).__name__}")
        extra = tuple(tensors)
        for t in extra:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"score_fn(tensors=...): expected tensors, got {type(t).__name__}")
        self.fn = fn
        self.extra = extra

    def apply(self, s, b, h, qp, kp):
        return _callables.call_score(self.fn, s, b, h, qp, kp)

    def tensors(self):
        objs, complete = _callables.captured(self.fn)
        self._saw_all = complete  # for reads_unseen_grad, which the engine asks right after: one walk
        found = _callables.float_tensors(objs)
        if not self.extra:
            return found
        ids = {id(t) for t in found}
        extra = []
        for t in self.extra:  # each once: a tensor listed twice got its gradient twice
            if id(t) not in ids:
                ids.add(id(t))
                extra.append(t)
        return found + tuple(extra)

    def reads_unseen_grad(self, found=()) -> bool:
        """Whether the callable reads a tensor that requires grad, other than ``found`` (and what they are
        made from), where the walk of what it captures gave up (:func:`keyfold._callables.captured`: too
        many objects, such as a table read through ``sys.modules`` in a large program): one probe call
        at index 0 with grad on, whose autograd leaves are compared with ``found``'s. Such a tensor would
        get no gradient, silently; the engine raises instead."""
        saw_all = getattr(self, "_saw_all", None)  # (the last tensors()'s walk)
        if (_callables.captured(self.fn)[1] if saw_all is None else saw_all) or not torch.is_grad_enabled():
            return False
        z = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
        try:
            out = self.fn(torch.zeros(1, 1, 1, 1), z, z, z, z)
        except Exception:  # noqa: BLE001 - a probe it cannot take: nothing learned
            return False
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return False
        known = set()
        for t in found:
            known |= _leaves(t)
        return not _leaves(out) <= known

    def __repr__(self):
        return f"score_fn({_fn_name(self.fn)})"

    def __eq__(self, other):
        return (type(other) is ScoreFn and _callables.same_callable(self.fn, other.fn)
                and len(self.extra) == len(other.extra) and all(a is b for a, b in zip(self.extra, other.extra)))

    def __hash__(self):
        return hash(("score_fn", _callables.callable_id(self.fn), tuple(id(t) for t in self.extra)))


class _Chain(ScoreMod):
    def __init__(self, mods):
        self.mods = tuple(mods)
        self.additive = all(m.additive for m in self.mods)
        self.translation_invariant = all(m.translation_invariant for m in self.mods)

    def apply(self, s, b, h, qp, kp):
        for m in self.mods:
            s = m.apply(s, b, h, qp, kp)
        return s

    def apply_(self, s, b, h, qp, kp):
        for m in self.mods:
            s = m.apply_(s, b, h, qp, kp)
        return s

    def bias(self, b, h, qp, kp):
        total = self.mods[0].bias(b, h, qp, kp)
        for m in self.mods[1:]:
            total = total + m.bias(b, h, qp, kp)
        return total

    def separable(self, q0, q1, k0, k1, device):
        parts = [m.separable(q0, q1, k0, k1, device) for m in self.mods]
        if any(p is None for p in parts):
            return None
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def check_heads(self, H):
        for m in self.mods:
            m.check_heads(H)

    def tensors(self):
        return self._each("tensors")

    def live_tensors(self):
        return self._each("live_tensors")

    def _each(self, what: str) -> tuple:
        seen, out = set(), []
        for m in self.mods:
            for t in getattr(m, what)():
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return tuple(out)

    def check_batch(self, B):
        for m in self.mods:
            m.check_batch(B)

    def parts(self):
        return self.mods

    def __repr__(self):
        return "[" + ", ".join(map(repr, self.mods)) + "]"

    def __eq__(self, other):
        return type(other) is _Chain and self.mods == other.mods

    def __hash__(self):
        return hash(("chain", self.mods))


def alibi_slopes(H: int) -> torch.Tensor:
    """The ALiBi paper's geometric head slopes ``2^(-8 i / H)`` for i = 1..H (float32, ``(H,)``)."""
    n = 2 ** math.floor(math.log2(H))
    base = [2 ** (-8.0 * (i + 1) / n) for i in range(n)]
    extra = [2 ** (-4.0 * (2 * i + 1) / n) for i in range(H - n)]  # paper's rule for non-powers of 2
    return torch.tensor(base + extra, dtype=torch.float32)


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi: adds ``-slopes[h] * |qp - kp|`` to the scaled score (FlashAttention's convention).

    slopes: float ``(H,)``, one per query head, or ``(B, H)``, per batch entry and head
    (``-slopes[b, h] * |qp - kp|``). Distances are exact integers at any absolute position.
    """
    return _Alibi(slopes)


def softcap(cap: float) -> ScoreMod:
    """Gemma-2 style soft capping: ``s -> cap * tanh(s / cap)``."""
    return _Softcap(cap)


def score_fn(fn: Callable, *, tensors=()) -> ScoreMod:
    """Wrap a Flex ``score_mod(score, b, h, q_idx, kv_idx)``; ``tensors``: tensors it reads that
    need gradients but that discovery cannot see (say, reached through an object's attribute
    chain). Passing the bare callable as ``score=`` is the same as ``score_fn(fn)``.

    >>> import torch, keyfold
    >>> rel = torch.zeros(15, requires_grad=True)          # learnable relative-position bias
    >>> mod = keyfold.score_fn(lambda s, b, h, q, kv: s + rel[q - kv + 7], tensors=[rel])
    >>> q = k = v = torch.randn(1, 2, 8, 16)
    >>> keyfold.attention(q, k, v, score=mod).sum().backward()
    >>> rel.grad.shape
    torch.Size([15])
    """
    return ScoreFn(fn, tensors)


def as_score(score) -> ScoreMod | None:
    """``None``, a :class:`ScoreMod`, a ``score_mod`` callable, or a list of these (left to right)."""
    if score is None or isinstance(score, ScoreMod):
        return score
    if isinstance(score, (list, tuple)):
        mods = [as_score(s) for s in score if s is not None]
        if not mods:
            return None
        return mods[0] if len(mods) == 1 else _Chain(mods)
    if callable(score):
        return ScoreFn(score)
    raise TypeError(f"score must be None, alibi(...)/softcap(...), a score_mod(score, b, h, q_idx, kv_idx) "
                    f"callable or a list of these; got {type(score).__name__}")
