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

    @property
    def gathers(self) -> bool:
        """Whether a literal reads a per-pair table (a tile bitmap or a block layout): the
        kernel stages it through shared memory, so its tiles must leave room for it."""
        ops = {(self.code >> (_LIT_BITS * i)) & 15 for i in range(self.nlit)}
        return bool(ops & {int(_Op.TILE), int(_Op.BLOCK_SPARSE)})


def _dnf(mask, neg=False):
    """The mask as a list of clauses (AND of ``(leaf, negated)``); ``[]`` is false, ``[[]]`` true."""
    ops = mask.operands()
    if ops is None:
        return [[(mask, neg)]]
    logic, args = ops
    if logic is _m.Logic.NOT:
        return _dnf(args[0], not neg)
    parts = [_dnf(a, neg) for a in args]
    if (logic is _m.Logic.AND) != neg:   # AND, or a negated OR (De Morgan): the product of the parts
        out = [[]]
        for p in parts:
            out = _product(out, p)
        return out
    return [c for p in parts for c in p]  # OR, or a negated AND: the union of the parts


def _product(a, b):
    return [x + y for x in a for y in b]


def _native_leaf(leaf) -> bool:
    """A preset the kernel evaluates itself (any other mask is evaluated per tile into a bitmap)."""
    return leaf.spec() is not None


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
    ops = mask.operands()
    return [mask] if ops is None else [leaf for a in ops[1] for leaf in _leaves(a)]


def _check_extents(mask, B: int, Hq: int) -> None:
    """Per-batch and per-head tensors of the mask must fit the call: the kernel reads them
    without bounds checks (the torch paths would raise an IndexError instead)."""
    K = _m.MaskKind
    for leaf in _leaves(mask):
        spec = leaf.spec()
        kind, prm = spec if spec is not None else (None, {})
        n = prm.get("n")
        if kind is K.SINKS and isinstance(n, torch.Tensor) and n.numel() not in (1, B):
            raise ValueError(f"{prm['name']}(n): n has {n.numel()} entries but the batch has {B}; "
                             f"pass one count per batch entry")
        if kind is K.DOCUMENTS:
            for name in ("ids", "kv_ids"):
                t = prm[name]
                if t.dim() == 2 and t.shape[0] not in (1, B):
                    raise ValueError(f"documents({name}): {t.shape[0]} rows of ids but the batch has {B}; "
                                     f"pass ids of shape (N,) or ({B}, N)")
        if kind is K.BLOCK_SPARSE and prm["layout"].dim() == 3 and prm["layout"].shape[0] not in (1, Hq):
            raise ValueError(f"block_sparse(layout): the layout has {prm['layout'].shape[0]} heads but q has {Hq}; "
                             f"pass one layout per query head, or a 2-D layout for all")


def _push(aux: list, t: torch.Tensor) -> int:
    """Append ``t`` (flattened, int32) to the aux buffer; returns its offset."""
    off = sum(x.numel() for x in aux)
    aux.append(t.reshape(-1).to(torch.int32))
    return off


def _literal(leaf, negated, aux):
    """``(op, negated, (a, b, c, d))`` for one preset leaf, from its :meth:`~keyfold.Mask.spec`."""
    K = _m.MaskKind
    kind, prm = leaf.spec()
    if kind is K.CAUSAL:
        return _Op.CAUSAL, negated, (0, 0, 0, 0)
    if kind is K.WINDOW:
        left = _BIG if prm["left"] is None else min(prm["left"], _BIG)
        right = _BIG if prm["right"] is None else min(prm["right"], _BIG)
        return _Op.WINDOW, negated, (left, right, 0, 0)
    if kind is K.SINKS:
        if not isinstance(prm["n"], torch.Tensor):
            return _Op.SINKS, negated, (min(prm["n"], _BIG), 0, 0, 0)
        n = prm["n"].clamp(max=_BIG)
        return _Op.SINKS_BATCH, negated, (_push(aux, n), 1 if n.numel() > 1 else 0, 0, 0)
    if kind is K.DOCUMENTS:
        qi, ki = prm["ids"], prm["kv_ids"]
        # ids may be any int64: renumber both sides together so they fit int32
        _, inv = torch.unique(torch.cat([qi.reshape(-1), ki.reshape(-1)]), return_inverse=True)
        qc, kc = inv[:qi.numel()].view(qi.shape), inv[qi.numel():].view(ki.shape)
        qs = qi.shape[-1] if qi.dim() == 2 and qi.shape[0] > 1 else 0
        ks = ki.shape[-1] if ki.dim() == 2 and ki.shape[0] > 1 else 0
        return _Op.DOCUMENTS, negated, (_push(aux, qc), _push(aux, kc), qs, ks)
    if kind is K.BLOCK_SPARSE:
        lay = prm["layout"]
        nq, nk = lay.shape[-2:]
        hs = nq * nk if lay.dim() == 3 and lay.shape[0] > 1 else 0
        return _Op.BLOCK_SPARSE, negated, (_push(aux, lay.to(torch.int32)), prm["block_size"], hs, nk)
    if kind is K.DILATED:
        return _Op.DILATED, negated, (prm["step"], 0, 0, 0)
    raise AssertionError(f"no kernel literal for {leaf!r}")  # a new MaskKind needs one here


# ============================================================================ score program


class _Score(enum.IntEnum):
    """Score modifiers the kernel runs itself (a compile-time constant)."""

    NONE = 0
    ALIBI = 1
    SOFTCAP = 2
    ALIBI_SOFTCAP = 3  # softcap(s + bias)
    SOFTCAP_ALIBI = 4  # softcap(s) + bias


_SCORES: "OrderedDict[object, tuple | None]" = OrderedDict()


def _score_program(score):
    """``(kind, slopes or None, cap)``, or None when the kernel cannot run ``score``; cached by the
    modifier, so the slopes' device copies (a ``_TensorKey``) are made once, not per launch."""
    if score is None:
        return _Score.NONE, None, 1.0
    with _LOCK:
        if score in _SCORES:
            return _SCORES[score]
    result = _compile_score(score)
    with _LOCK:
        _SCORES[score] = result
        if len(_SCORES) > 64:
            _SCORES.popitem(last=False)
    return result


def _compile_score(score):
    mods = score.parts() or (score,)
    specs = [m.spec() for m in mods]
    if any(sp is None for sp in specs):
        return None
    S = _s.ScoreKind
    names = tuple({S.ALIBI: "a", S.SOFTCAP: "s"}.get(sp[0], "?") for sp in specs)
    kind = {("a",): _Score.ALIBI, ("s",): _Score.SOFTCAP, ("a", "s"): _Score.ALIBI_SOFTCAP,
            ("s", "a"): _Score.SOFTCAP_ALIBI}.get(names)
    if kind is None or any(sp[0] is S.ALIBI and sp[1]["slopes"].dim() != 1 for sp in specs):
        return None  # per-batch slopes (B, H) run on the tile kernel
    slopes = next((_m._TensorKey(sp[1]["slopes"]) for sp in specs if sp[0] is S.ALIBI), None)
    cap = next((sp[1]["cap"] for sp in specs if sp[0] is S.SOFTCAP), 1.0)
    return kind, slopes, cap


# ============================================================================ Triton kernels
# Conventions: scores are kept in log2 units inside the online softmax (exp2 is the fast
# path; 1.4426950408889634 = log2 e); lse is returned in natural log (0.6931471805599453 =
# ln 2). Tiles are BLOCK_M queries x BLOCK_N keys; head dims are padded to BLOCK_D / BLOCK_DV
# (powers of 2, >= 16) with masked loads. Every program's base offset is int64 so tensors
# over 2^31 elements cannot wrap.
