"""Masks and score modifiers compiled into the kernel's program: an OR of ANDs of preset literals
(op codes are compile-time constants, parameters live in small int32 buffers)."""

from collections import OrderedDict
from dataclasses import dataclass
import enum
import threading

import torch

from ... import masks as _m
from ... import scores as _s

from ._env import _BIG

class _Op(enum.IntEnum):
    """Literal op codes of the in-kernel mask program (4 bits)."""

    TRUE = 1          # every pair
    CAUSAL = 2        # kp <= qp
    WINDOW = 3        # qp - a <= kp <= qp + b
    SINKS = 4         # kp < a
    SINKS_BATCH = 5   # kp < aux[a + batch * b]
    DOCUMENTS = 6     # aux[a + batch * c + qp] == aux[b + batch * d + kp]
    BLOCK_SPARSE = 7  # aux[a + head * c + (qp // b) * d + kp // b] != 0
    DILATED = 8       # (qp - kp) % a == 0
    TILE = 9          # bitmap[slot, batch * b, head * c, i, j] (a mask callable, evaluated per tile)


_NEGATE = 16   # literal bit: use the negation
_END = 32      # literal bit: this literal closes its AND clause
_LIT_BITS = 8  # bits per literal in the program code
_MAX_LITS = 7       # 7 x 8 bits: the program code stays a 64-bit constant
_MAX_CLAUSES = 8


@dataclass(frozen=True)
class _MaskProgram:
    """An OR of AND clauses of literals, ready for the kernel.

    code: the literals' op codes and flags, ``_LIT_BITS`` bits each (a compile-time constant);
    params: int32 ``(nlit, 4)`` parameters a, b, c, d per literal; aux: int32 buffer that
    tensor-backed literals index (document ids, layouts, per-batch sink counts).
    tile_mask: the mask to evaluate per partial tile when the program is ``TILE``.
    """

    code: int
    nlit: int
    params: torch.Tensor
    aux: torch.Tensor
    tile_mask: _m.Mask | None = None


def _dnf(mask, neg=False):
    """The mask as a list of clauses (AND of ``(leaf, negated)``); ``[]`` is false, ``[[]]`` true."""
    if isinstance(mask, _m._Not):
        return _dnf(mask.a, not neg)
    if isinstance(mask, _m._Or):       # before _And: _Or (and _Prefix) subclass it
        a, b = _dnf(mask.a, neg), _dnf(mask.b, neg)
        return _product(a, b) if neg else a + b
    if isinstance(mask, _m._And):
        a, b = _dnf(mask.a, neg), _dnf(mask.b, neg)
        return a + b if neg else _product(a, b)
    if isinstance(mask, _m._Full):
        return [] if neg else [[]]
    return [[(mask, neg)]]


def _product(a, b):
    return [x + y for x in a for y in b]


def _native_leaf(leaf) -> bool:
    return isinstance(leaf, (_m._Causal, _m._Window, _m._Sinks, _m._Documents, _m._BlockSparse, _m._Dilated))


_PROGRAMS: "OrderedDict[object, _MaskProgram]" = OrderedDict()
_LOCK = threading.Lock()


def _mask_program(mask) -> _MaskProgram:
    """Compile (and cache by the mask's hash) the in-kernel program of ``mask``."""
    with _LOCK:
        hit = _PROGRAMS.get(mask)
    if hit is not None:
        return hit
    clauses = _dnf(mask)
    n = sum(len(c) for c in clauses)
    native = all(_native_leaf(leaf) for c in clauses for leaf, _ in c)
    if any(len(c) == 0 for c in clauses):
        prog = _encode([[(_Op.TRUE, False, (0, 0, 0, 0))]], [])
    elif not native or n > _MAX_LITS or len(clauses) > _MAX_CLAUSES:
        prog = _encode([[(_Op.TILE, False, (0, 0, 0, 0))]], [], tile_mask=mask)
    else:
        aux: list[torch.Tensor] = []
        prog = _encode([[_literal(leaf, negated, aux) for leaf, negated in c] for c in clauses], aux)
    with _LOCK:
        _PROGRAMS[mask] = prog
        if len(_PROGRAMS) > 64:
            _PROGRAMS.popitem(last=False)
    return prog


def _encode(clauses, aux, tile_mask=None) -> _MaskProgram:
    code, params, i = 0, [], 0
    for clause in clauses:
        for k, (op, negated, prm) in enumerate(clause):
            bits = int(op) | (_NEGATE if negated else 0) | (_END if k == len(clause) - 1 else 0)
            code |= bits << (_LIT_BITS * i)
            params.append(prm)
            i += 1
    p = torch.tensor(params if params else [(0, 0, 0, 0)], dtype=torch.int32)
    a = torch.cat(aux) if aux else torch.zeros(1, dtype=torch.int32)
    return _MaskProgram(code, i, p, a, tile_mask)


_ALL_VISIBLE = _encode([[(_Op.TRUE, False, (0, 0, 0, 0))]], [])  # the program of mask=None


def _leaves(mask):
    if isinstance(mask, _m._Not):
        return _leaves(mask.a)
    if isinstance(mask, _m._And):  # also _Or and _Prefix
        return _leaves(mask.a) + _leaves(mask.b)
    return [mask]


def _check_extents(mask, B: int, Hq: int) -> None:
    """Per-batch and per-head tensors of the mask must fit the call: the kernel reads them
    without bounds checks (the torch paths would raise an IndexError instead)."""
    for leaf in _leaves(mask):
        if isinstance(leaf, _m._Sinks) and not isinstance(leaf.n, int) and leaf.n.t.numel() not in (1, B):
            raise ValueError(f"{leaf.name}(n): n has {leaf.n.t.numel()} entries but the batch has {B}; "
                             f"pass one count per batch entry")
        if isinstance(leaf, _m._Documents):
            for name, key in (("ids", leaf.ids), ("kv_ids", leaf.kv_ids)):
                if key is not None and key.t.dim() == 2 and key.t.shape[0] not in (1, B):
                    raise ValueError(f"documents({name}): {key.t.shape[0]} rows of ids but the batch has {B}; "
                                     f"pass ids of shape (N,) or ({B}, N)")
        if isinstance(leaf, _m._BlockSparse) and leaf.layout.t.dim() == 3 and leaf.layout.t.shape[0] not in (1, Hq):
            raise ValueError(f"block_sparse(layout): the layout has {leaf.layout.t.shape[0]} heads but q has {Hq}; "
                             f"pass one layout per query head, or a 2-D layout for all")


def _push(aux: list, t: torch.Tensor) -> int:
    """Append ``t`` (flattened, int32) to the aux buffer; returns its offset."""
    off = sum(x.numel() for x in aux)
    aux.append(t.reshape(-1).to(torch.int32))
    return off


def _literal(leaf, negated, aux):
    """``(op, negated, (a, b, c, d))`` for one preset leaf."""
    if isinstance(leaf, _m._Causal):
        return _Op.CAUSAL, negated, (0, 0, 0, 0)
    if isinstance(leaf, _m._Window):
        left = _BIG if leaf.left is None else min(leaf.left, _BIG)
        right = _BIG if leaf.right is None else min(leaf.right, _BIG)
        return _Op.WINDOW, negated, (left, right, 0, 0)
    if isinstance(leaf, _m._Sinks):
        if isinstance(leaf.n, int):
            return _Op.SINKS, negated, (min(leaf.n, _BIG), 0, 0, 0)
        n = leaf.n.t.clamp(max=_BIG)
        return _Op.SINKS_BATCH, negated, (_push(aux, n), 1 if n.numel() > 1 else 0, 0, 0)
    if isinstance(leaf, _m._Documents):
        qi, ki = leaf.ids.t, leaf._kv().t
        # ids may be any int64: renumber both sides together so they fit int32
        _, inv = torch.unique(torch.cat([qi.reshape(-1), ki.reshape(-1)]), return_inverse=True)
        qc, kc = inv[:qi.numel()].view(qi.shape), inv[qi.numel():].view(ki.shape)
        qs = qi.shape[-1] if qi.dim() == 2 and qi.shape[0] > 1 else 0
        ks = ki.shape[-1] if ki.dim() == 2 and ki.shape[0] > 1 else 0
        return _Op.DOCUMENTS, negated, (_push(aux, qc), _push(aux, kc), qs, ks)
    if isinstance(leaf, _m._BlockSparse):
        lay = leaf.layout.t
        nq, nk = lay.shape[-2:]
        hs = nq * nk if lay.dim() == 3 and lay.shape[0] > 1 else 0
        return _Op.BLOCK_SPARSE, negated, (_push(aux, lay.to(torch.int32)), leaf.block_size, hs, nk)
    if isinstance(leaf, _m._Dilated):
        return _Op.DILATED, negated, (leaf.step, 0, 0, 0)
    raise AssertionError(f"not a native leaf: {leaf!r}")  # guarded by _native_leaf


# ============================================================================ score program


class _Score(enum.IntEnum):
    """Score modifiers the kernel runs itself (a compile-time constant)."""

    NONE = 0
    ALIBI = 1
    SOFTCAP = 2
    ALIBI_SOFTCAP = 3  # softcap(s + bias)
    SOFTCAP_ALIBI = 4  # softcap(s) + bias


def _score_program(score):
    """``(kind, slopes or None, cap)``, or None when the kernel cannot run ``score``."""
    if score is None:
        return _Score.NONE, None, 1.0
    mods = list(score.mods) if isinstance(score, _s._Chain) else [score]
    names = tuple("a" if isinstance(m, _s._Alibi) else "s" if isinstance(m, _s._Softcap) else "?" for m in mods)
    kind = {("a",): _Score.ALIBI, ("s",): _Score.SOFTCAP, ("a", "s"): _Score.ALIBI_SOFTCAP,
            ("s", "a"): _Score.SOFTCAP_ALIBI}.get(names)
    if kind is None:
        return None
    slopes = next((m.slopes for m in mods if isinstance(m, _s._Alibi)), None)  # a _TensorKey
    cap = next((m.cap for m in mods if isinstance(m, _s._Softcap)), 1.0)
    return kind, slopes, cap


# ============================================================================ Triton kernels
# Conventions: scores are kept in log2 units inside the online softmax (exp2 is the fast
# path; 1.4426950408889634 = log2 e); lse is returned in natural log (0.6931471805599453 =
# ln 2). Tiles are BLOCK_M queries x BLOCK_N keys; head dims are padded to BLOCK_D / BLOCK_DV
# (powers of 2, >= 16) with masked loads. Every program's base offset is int64 so tensors
# over 2^31 elements cannot wrap.
