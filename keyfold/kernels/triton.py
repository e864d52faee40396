"""Backend.TRITON: the project's own Triton piece kernel (CUDA, or the CPU interpreter).

One launch computes every piece of a plan: the planner classifies the (query block x key
block) grid at the kernel's own tile size, and each query block gets two lists of key
blocks, *partial* ones (the mask is evaluated inside the tile) and *full* ones (no mask
work); empty blocks are never visited. Online softmax runs in float32 and returns the
partial State ``(out, lse)`` (natural log) that :mod:`keyfold.state` merges.
Backward (docs/math.md section 2) takes the *global* ``(out, lse)``: one kernel gives dQ
per query block, one gives dK and dV per key block from the transposed lists; no atomics.

Masks run inside the kernel as a small *program*: the mask tree is rewritten as an OR of
ANDs of preset literals (causal, window, sinks, documents, block_sparse, dilated, each
possibly negated), whose op codes are compile-time constants and whose parameters
(window sizes, document ids, layouts) live in small int32 buffers. A Flex ``mask_mod``
callable cannot be traced into Triton: it is evaluated once per *partial* tile into a
cached bool bitmap that the kernel reads (full and empty tiles need no bitmap).
ALiBi and softcap (and the two chained) run in the kernel; a ``score_mod`` callable
falls back to the tile kernel with one warning. Details and numbers: ``docs/gpu.md``.
"""

import enum
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .. import masks as _m
from .. import scores as _s
from ..planner import Plan, plan as _plan
from ..state import State, state_dtype
from . import tiles as _tiles
from ._common import Problem

try:  # triton is optional: without it the backend reports itself unavailable
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

    class _NoTriton:  # lets the kernels below be defined (never run) without triton
        constexpr = object

    tl = _NoTriton()

    def _jit(fn):
        return fn

__all__ = ["available", "check_supported", "forward", "backward", "USE_ATEN_DENSE"]

# Plain dense 16-bit pieces on CUDA go through PyTorch's own flash op (aten), which is faster
# than a portable kernel there; set to False to measure or use the Triton kernel alone.
USE_ATEN_DENSE = True

_FALLBACK_SPAN = 1024   # the tile kernel's longest key span per piece (its tile memory bound)
_MAX_POS = 1 << 30      # absolute positions stay below this so int32 arithmetic cannot wrap
_BIG = _MAX_POS         # stands for "unbounded" in window/sinks parameters
_TILE_BITMAP_BUDGET = 1 << 28  # bytes of per-tile bitmaps a mask callable may use


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """Triton importable, and a CUDA device or the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and (torch.cuda.is_available() or _interpreting())


def check_supported(q, score) -> None:
    """Raise, saying what to do, when Backend.TRITON cannot run on ``q`` at all.

    Settings it cannot run natively (float64, a ``score_mod`` callable, head_dim > 256)
    do not raise: they fall back to the tile kernel with one warning.
    """
    if triton is None:
        raise RuntimeError("Backend.TRITON needs the triton package: `pip install triton` "
                           "(it ships with CUDA builds of torch), or use Backend.AUTO")
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu" and _interpreting():
        return
    if q.device.type == "cpu":
        raise ValueError("Backend.TRITON runs on CUDA tensors; on a CPU use Backend.AUTO (the fused CPU "
                         "kernel), or set TRITON_INTERPRET=1 before triton is imported to run the kernel "
                         "in Triton's (slow) interpreter, as the tests do")
    raise ValueError(f"Backend.TRITON runs on CUDA tensors, got {q.device}; use Backend.TILES there")


_WARNED: set = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"keyfold Backend.TRITON: {msg}", RuntimeWarning, stacklevel=4)


# ============================================================================ the mask program


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
    if slopes is not None and slopes.t.dim() != 1:
        return None  # per-batch (B, H) slopes: the kernel reads slopes[h] only
    cap = next((m.cap for m in mods if isinstance(m, _s._Softcap)), 1.0)
    return kind, slopes, cap


# ============================================================================ Triton kernels
# Conventions: scores are kept in log2 units inside the online softmax (exp2 is the fast
# path; 1.4426950408889634 = log2 e); lse is returned in natural log (0.6931471805599453 =
# ln 2). Tiles are BLOCK_M queries x BLOCK_N keys; head dims are padded to BLOCK_D / BLOCK_DV
# (powers of 2, >= 16) with masked loads. Every program's base offset is int64 so tensors
# over 2^31 elements cannot wrap.

_BIG_K = tl.constexpr(_BIG) if triton is not None else _BIG


@_jit
def _mm(a, b, IEEE: tl.constexpr):
    """``a @ b`` in float32; IEEE float32 products for float32 inputs (no TF32 rounding)."""
    if IEEE:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@_jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b``."""
    if IEEE:
        r = tl.dot(a, b, acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@_jit
def _tanh(x):
    # tanh without libdevice (the interpreter has none): the exp form, and its series near 0
    # where 1 - e^{-2|x|} would cancel.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(ax < 0.05, small, big)
    return tl.where(x < 0, -t, t)


@_jit
def _modify(x, SCORE: tl.constexpr, slope, cap, qp, kp):
    """The score modifier on natural-unit scores ``x``: returns ``(y, dy/dx)``."""
    dy = tl.full(x.shape, 1.0, tl.float32)
    if SCORE == 1:    # ALiBi
        y = x - slope * tl.abs(qp - kp).to(tl.float32)
    elif SCORE == 2:  # softcap
        t = _tanh(x / cap)
        y = cap * t
        dy = 1.0 - t * t
    elif SCORE == 3:  # softcap(x + alibi)
        t = _tanh((x - slope * tl.abs(qp - kp).to(tl.float32)) / cap)
        y = cap * t
        dy = 1.0 - t * t
    elif SCORE == 4:  # softcap(x) + alibi
        t = _tanh(x / cap)
        y = cap * t - slope * tl.abs(qp - kp).to(tl.float32)
        dy = 1.0 - t * t
    else:
        y = x
    return y, dy


@_jit
def _literal_value(OP: tl.constexpr, prm, aux, bits, b, h, slot, qp, kp, q0, k0, q_last, k_last,
                   TILE_N: tl.constexpr):
    """One literal (see ``_Op``) on broadcastable absolute positions ``qp`` and ``kp``."""
    if OP == 1:    # TRUE
        res = (qp >= -_BIG_K) | (kp >= -_BIG_K)
    elif OP == 2:  # CAUSAL
        res = kp <= qp
    elif OP == 3:  # WINDOW
        res = (kp >= qp - tl.load(prm)) & (kp <= qp + tl.load(prm + 1))
    elif OP == 4:  # SINKS
        res = (kp < tl.load(prm)) & (qp >= -_BIG_K)
    elif OP == 5:  # SINKS_BATCH
        n = tl.load(aux + tl.load(prm) + b * tl.load(prm + 1))
        res = (kp < n) & (qp >= -_BIG_K)
    elif OP == 6:  # DOCUMENTS; padding rows and columns read a valid id
        qc = tl.minimum(tl.maximum(qp, 0), q_last)
        kc = tl.minimum(tl.maximum(kp, 0), k_last)
        qid = tl.load(aux + tl.load(prm) + b * tl.load(prm + 2) + qc)
        kid = tl.load(aux + tl.load(prm + 1) + b * tl.load(prm + 3) + kc)
        res = qid == kid
    elif OP == 7:  # BLOCK_SPARSE
        bs = tl.load(prm + 1)
        qc = tl.minimum(tl.maximum(qp, 0), q_last)
        kc = tl.minimum(tl.maximum(kp, 0), k_last)
        cell = tl.load(aux + tl.load(prm) + h * tl.load(prm + 2) + (qc // bs) * tl.load(prm + 3) + kc // bs)
        res = cell != 0
    elif OP == 8:  # DILATED
        res = ((qp - kp) % tl.load(prm)) == 0
    else:          # TILE: a mask callable's values on this partial tile, evaluated on the host
        base = slot * tl.load(prm).to(tl.int64) + b * tl.load(prm + 1) + h * tl.load(prm + 2)
        res = tl.load(bits + base + (qp - q0) * TILE_N + (kp - k0)) != 0
    return res


@_jit
def _visible(PROG: tl.constexpr, NLIT: tl.constexpr, prm, aux, bits, b, h, slot, qp, kp, q0, k0,
             q_last, k_last, TILE_N: tl.constexpr):
    """The mask program on one tile: an OR of AND clauses, unrolled at compile time."""
    vis = (qp < -_BIG_K) & (kp < -_BIG_K)        # all false, tile-shaped
    clause = (qp >= -_BIG_K) | (kp >= -_BIG_K)   # all true
    for i in tl.static_range(NLIT):
        code = (PROG >> (8 * i)) & 255
        lit = _literal_value(code & 15, prm + 4 * i, aux, bits, b, h, slot, qp, kp, q0, k0,
                             q_last, k_last, TILE_N)
        if (code & 16) != 0:
            lit = lit == 0
        clause = clause & lit
        if (code & 32) != 0:
            vis = vis | clause
            clause = (qp >= -_BIG_K) | (kp >= -_BIG_K)
    return vis


@_jit
def _fwd_tile(acc, m_i, l_i, q, Kb, Vb, skn, svn, kb, slot, offs_d, offs_dv, qp, q0, b, h,
              Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
              MASKED: tl.constexpr, PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
              BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """One (query block x key block) tile of the online softmax."""
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = offs_n < Nk
    kT = tl.load(Kb + offs_n[None, :] * skn + offs_d[:, None],
                 mask=kmask[None, :] & (offs_d[:, None] < D), other=0.0)        # (BD, BN)
    v = tl.load(Vb + offs_n[:, None] * svn + offs_dv[None, :],
                mask=kmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)       # (BN, BDV)
    kp = kv_offset + offs_n
    s = _mm(q, kT, IEEE)                                                       # (BM, BN)
    if SCORE == 0:
        s = s * (sm_scale * 1.4426950408889634)
    else:
        y, dy = _modify(s * sm_scale, SCORE, slope, cap, qp[:, None], kp[None, :])
        s = y * 1.4426950408889634
    if MASKED:
        vis = _visible(PROG, NLIT, prm, aux, bits, b, h, slot, qp[:, None], kp[None, :], q0,
                       kv_offset + kb * BLOCK_N, q_last, k_last, BLOCK_N)
        s = tl.where(vis, s, float("-inf"))
    if not EVEN_N:
        s = tl.where(kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    return acc, m_new, l_i


@_jit
def _fwd_kernel(Q, K, V, O, LSE,
                sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                p_ptr, p_col, f_ptr, f_lo, f_hi, prm, aux, bits, slopes, cap,
                Hq, G, Nq, Nk, D, Dv, q_offset, kv_offset, sm_scale,
                PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """Program (query block, batch*head): partial key blocks with the mask, then full ones."""
    qb = tl.num_programs(0) - 1 - tl.program_id(0)  # last (under causal: heaviest) blocks first
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rmask = offs_m < Nq
    q = tl.load(Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BM, BD)
    Kb = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    Vb = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    qp = q_offset + offs_m
    q0 = q_offset + qb * BLOCK_M
    q_last = q_offset + Nq - 1
    k_last = kv_offset + Nk - 1
    slope = tl.load(slopes + h)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo = tl.load(p_ptr + qb)
    hi = tl.load(p_ptr + qb + 1)
    for t in range(lo, hi):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, Kb, Vb, skn, svn, tl.load(p_col + t), t, offs_d, offs_dv,
                                  qp, q0, b, h, Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap,
                                  prm, aux, bits, True, PROG, NLIT, SCORE, BLOCK_N, EVEN_N, IEEE)
    lo = tl.load(f_ptr + qb)
    hi = tl.load(f_ptr + qb + 1)
    for t in range(lo, hi):  # runs of full key blocks: the inner loop has affine addresses
        for kb in range(tl.load(f_lo + t), tl.load(f_hi + t)):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, Kb, Vb, skn, svn, kb, t, offs_d, offs_dv,
                                      qp, q0, b, h, Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap,
                                      prm, aux, bits, False, PROG, NLIT, SCORE, BLOCK_N, EVEN_N, IEEE)
    seen = l_i > 0.0  # a row that saw no key: out 0, lse -inf (never NaN)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    ob = b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(O + ob + offs_m[:, None] * som + offs_dv[None, :], out,
             mask=rmask[:, None] & (offs_dv[None, :] < Dv))
    tl.store(LSE + bh.to(tl.int64) * Nq + offs_m, lse, mask=rmask)


@_jit
def _dq_tile(dq, q, do, lse2, delta, Kb, Vb, skn, svn, kb, slot, offs_d, offs_dv, qp, q0, b, h,
             Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
             MASKED: tl.constexpr, PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
             BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """dQ of one tile: dS = P * (dO V^T - delta) * dy/dx, dQ += dS K."""
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = offs_n < Nk
    k = tl.load(Kb + offs_n[:, None] * skn + offs_d[None, :],
                mask=kmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BN, BD)
    v = tl.load(Vb + offs_n[:, None] * svn + offs_dv[None, :],
                mask=kmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)       # (BN, BDV)
    kp = kv_offset + offs_n
    y, dy = _modify(_mm(q, tl.trans(k), IEEE) * sm_scale, SCORE, slope, cap, qp[:, None], kp[None, :])
    if MASKED:
        vis = _visible(PROG, NLIT, prm, aux, bits, b, h, slot, qp[:, None], kp[None, :], q0,
                       kv_offset + kb * BLOCK_N, q_last, k_last, BLOCK_N)
        y = tl.where(vis, y, float("-inf"))
    if not EVEN_N:
        y = tl.where(kmask[None, :], y, float("-inf"))
    p = tl.exp2(y * 1.4426950408889634 - lse2[:, None])                      # (BM, BN)
    dp = _mm(do, tl.trans(v), IEEE)
    ds = p * (dp - delta[:, None])
    if SCORE >= 2:
        ds = ds * dy
    return _mma(ds.to(k.dtype), k, dq, IEEE)


@_jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                   sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
                   p_ptr, p_col, f_ptr, f_lo, f_hi, prm, aux, bits, slopes, cap,
                   Hq, G, Nq, Nk, D, Dv, q_offset, kv_offset, sm_scale,
                   PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """Program (query block, batch*head): dQ over the same key lists as the forward."""
    qb = tl.num_programs(0) - 1 - tl.program_id(0)  # last (under causal: heaviest) blocks first
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rmask = offs_m < Nq
    qbase = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    q = tl.load(Q + qbase + offs_m[:, None] * sqm + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BM, BD)
    do = tl.load(DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + offs_m[:, None] * sdm + offs_dv[None, :],
                 mask=rmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)      # (BM, BDV)
    row = bh.to(tl.int64) * Nq + offs_m
    lse2 = tl.load(LSE + row, mask=rmask, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + row, mask=rmask, other=0.0)
    Kb = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    Vb = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    qp = q_offset + offs_m
    q0 = q_offset + qb * BLOCK_M
    q_last = q_offset + Nq - 1
    k_last = kv_offset + Nk - 1
    slope = tl.load(slopes + h)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = tl.load(p_ptr + qb)
    hi = tl.load(p_ptr + qb + 1)
    for t in range(lo, hi):
        dq = _dq_tile(dq, q, do, lse2, delta, Kb, Vb, skn, svn, tl.load(p_col + t), t, offs_d, offs_dv,
                      qp, q0, b, h, Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap,
                      prm, aux, bits, True, PROG, NLIT, SCORE, BLOCK_N, EVEN_N, IEEE)
    lo = tl.load(f_ptr + qb)
    hi = tl.load(f_ptr + qb + 1)
    for t in range(lo, hi):
        for kb in range(tl.load(f_lo + t), tl.load(f_hi + t)):
            dq = _dq_tile(dq, q, do, lse2, delta, Kb, Vb, skn, svn, kb, t, offs_d, offs_dv,
                          qp, q0, b, h, Nk, D, Dv, kv_offset, q_last, k_last, sm_scale, slope, cap,
                          prm, aux, bits, False, PROG, NLIT, SCORE, BLOCK_N, EVEN_N, IEEE)
    tl.store(DQ + bh.to(tl.int64) * Nq * D + offs_m[:, None] * D + offs_d[None, :], dq * sm_scale,
             mask=rmask[:, None] & (offs_d[None, :] < D))


@_jit
def _dkdv_tile(dk, dv, k, v, kp, k0, Qb, DOb, LSEb, DELTAb, sqm, sdm, qb, slot, offs_d, offs_dv,
               b, h, Nq, D, Dv, q_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
               MASKED: tl.constexpr, PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """dK, dV of one tile, computed transposed (keys as rows): dV += P^T dO, dK += dS^T Q."""
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = offs_m < Nq
    q = tl.load(Qb + offs_m[:, None] * sqm + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BM, BD)
    do = tl.load(DOb + offs_m[:, None] * sdm + offs_dv[None, :],
                 mask=rmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)      # (BM, BDV)
    lse2 = tl.load(LSEb + offs_m, mask=rmask, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTAb + offs_m, mask=rmask, other=0.0)
    qp = q_offset + offs_m
    yT, dyT = _modify(_mm(k, tl.trans(q), IEEE) * sm_scale, SCORE, slope, cap, qp[None, :], kp[:, None])
    if MASKED:
        vis = _visible(PROG, NLIT, prm, aux, bits, b, h, slot, qp[None, :], kp[:, None],
                       q_offset + qb * BLOCK_M, k0, q_last, k_last, BLOCK_N)
        yT = tl.where(vis, yT, float("-inf"))
    pT = tl.exp2(yT * 1.4426950408889634 - lse2[None, :])                    # (BN, BM)
    dv = _mma(pT.to(do.dtype), do, dv, IEEE)
    dsT = pT * (_mm(v, tl.trans(do), IEEE) - delta[None, :])
    if SCORE >= 2:
        dsT = dsT * dyT
    dk = _mma(dsT.to(q.dtype), q, dk, IEEE)
    return dk, dv


@_jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                     sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm,
                     p_ptr, p_row, p_slot, f_ptr, f_lo, f_hi, prm, aux, bits, slopes, cap,
                     Hq, Hkv, G, Nq, Nk, D, Dv, q_offset, kv_offset, sm_scale,
                     PROG: tl.constexpr, NLIT: tl.constexpr, SCORE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, IEEE: tl.constexpr):
    """Program (key block, batch*kv head): dK, dV summed over the GQA group's query heads."""
    kb = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hkv
    hk = bhk % Hkv
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kmask = offs_n < Nk
    k = tl.load(K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_n[:, None] * skn + offs_d[None, :],
                mask=kmask[:, None] & (offs_d[None, :] < D), other=0.0)         # (BN, BD)
    v = tl.load(V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_n[:, None] * svn + offs_dv[None, :],
                mask=kmask[:, None] & (offs_dv[None, :] < Dv), other=0.0)       # (BN, BDV)
    kp = kv_offset + offs_n
    k0 = kv_offset + kb * BLOCK_N
    q_last = q_offset + Nq - 1
    k_last = kv_offset + Nk - 1
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        h = hk * G + g
        slope = tl.load(slopes + h)
        Qb = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        DOb = DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
        row = (b.to(tl.int64) * Hq + h) * Nq
        lo = tl.load(p_ptr + kb)
        hi = tl.load(p_ptr + kb + 1)
        for t in range(lo, hi):
            dk, dv = _dkdv_tile(dk, dv, k, v, kp, k0, Qb, DOb, LSE + row, DELTA + row, sqm, sdm,
                                tl.load(p_row + t), tl.load(p_slot + t), offs_d, offs_dv, b, h, Nq, D, Dv,
                                q_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
                                True, PROG, NLIT, SCORE, BLOCK_M, BLOCK_N, IEEE)
        lo = tl.load(f_ptr + kb)
        hi = tl.load(f_ptr + kb + 1)
        for t in range(lo, hi):
            for qb in range(tl.load(f_lo + t), tl.load(f_hi + t)):
                dk, dv = _dkdv_tile(dk, dv, k, v, kp, k0, Qb, DOb, LSE + row, DELTA + row, sqm, sdm,
                                    qb, t, offs_d, offs_dv, b, h, Nq, D, Dv,
                                    q_offset, q_last, k_last, sm_scale, slope, cap, prm, aux, bits,
                                    False, PROG, NLIT, SCORE, BLOCK_M, BLOCK_N, IEEE)
    out = bhk.to(tl.int64) * Nk
    tl.store(DK + (out + offs_n[:, None]) * D + offs_d[None, :], dk * sm_scale,
             mask=kmask[:, None] & (offs_d[None, :] < D))
    tl.store(DV + (out + offs_n[:, None]) * Dv + offs_dv[None, :], dv,
             mask=kmask[:, None] & (offs_dv[None, :] < Dv))


# ============================================================================ host side


@dataclass(frozen=True)
class _Config:
    """Tile sizes and launch settings of one kernel."""

    block_m: int     # queries per tile
    block_n: int     # keys per tile
    num_warps: int
    num_stages: int


def _configs(q, D: int, Dv: int, nlit: int) -> tuple[_Config, _Config]:
    """(forward, backward) configs. The interpreter uses 16 x 16 tiles so tiny test shapes
    still have empty, partial and full tiles. CUDA sizes were chosen by compiling for sm_90
    (``compile_for_gpu``) and reading ptxas's register report: no spills in the forward for
    bf16 head_dim 128 (128 x 128 tiles; 128 x 64 once the mask program has > 3 literals),
    none in dQ, none in dK/dV at 64 x 64 without GQA (~200 bytes with its head loop; smaller
    tiles lose Hopper's wgmma)."""
    if q.device.type != "cuda":
        return _Config(16, 16, 4, 1), _Config(16, 16, 4, 1)
    width = max(D, Dv)
    if q.dtype == torch.float32:
        if width <= 64:
            return _Config(64, 32, 4, 2), _Config(32, 32, 4, 1)
        return _Config(32, 32, 4, 1), _Config(16, 32, 4, 1)
    if width <= 64:
        return _Config(128, 64, 4, 3), _Config(64, 64, 4, 2)
    if width <= 128:
        return _Config(128, 128 if nlit <= 3 else 64, 8, 3), _Config(64, 64, 8, 2)
    return _Config(64, 32, 8, 2), _Config(32, 32, 8, 1)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@dataclass
class _Layout:
    """Per plan (one tile size) and device: the kernels' block lists and tile bitmaps."""

    plan: Plan
    fwd: tuple    # p_ptr, p_col, f_ptr, f_lo, f_hi: per query block, its partial key blocks
                  # and its runs [f_lo, f_hi) of full key blocks
    bwd: tuple    # p_ptr, p_row, p_slot, f_ptr, f_lo, f_hi: the same per key block (query blocks)
    params: torch.Tensor
    aux: torch.Tensor
    bits: torch.Tensor


_LAYOUTS: "OrderedDict[tuple, _Layout]" = OrderedDict()


def _csr(kinds: torch.Tensor, kind: _m.BlockKind):
    """Row pointers and column indices of the ``kind`` blocks, row-major (int32)."""
    r, c = torch.nonzero(kinds == int(kind), as_tuple=True)
    ptr = torch.zeros(kinds.shape[0] + 1, dtype=torch.int64)
    ptr[1:] = torch.bincount(r, minlength=kinds.shape[0]).cumsum(0)
    return ptr.to(torch.int32), c.to(torch.int32), r


def _runs(kinds: torch.Tensor, kind: _m.BlockKind):
    """Row pointers and ``[lo, hi)`` column runs of consecutive ``kind`` blocks (int32)."""
    r, c = torch.nonzero(kinds == int(kind), as_tuple=True)
    start = torch.ones_like(r, dtype=torch.bool)
    start[1:] = (r[1:] != r[:-1]) | (c[1:] != c[:-1] + 1)
    end = torch.ones_like(start)
    end[:-1] = start[1:]
    ptr = torch.zeros(kinds.shape[0] + 1, dtype=torch.int64)
    ptr[1:] = torch.bincount(r[start], minlength=kinds.shape[0]).cumsum(0)
    return ptr.to(torch.int32), c[start].to(torch.int32), (c[end] + 1).to(torch.int32)


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    return t if t.numel() else torch.zeros(1, dtype=t.dtype)


def _layout(pb: Problem, prog: _MaskProgram, q, Nk: int, cfg: _Config) -> _Layout | None:
    """Plan at the kernel's tile size and build (or fetch) its block lists on q's device.

    Returns None when a mask callable's tile bitmaps would exceed the memory budget.
    """
    B, Hq, Nq = q.shape[:3]
    plan = _plan(pb.mask, Nq, Nk, q_offset=pb.q_offset, kv_offset=pb.kv_offset, B=B, H=Hq,
                 block_size=(cfg.block_m, cfg.block_n), max_span=None, allow_causal=False)
    key = (id(plan), q.device)
    with _LOCK:
        hit = _LAYOUTS.get(key)
    if hit is not None and hit.plan is plan:
        return hit
    kinds = plan.kinds
    p_ptr, p_col, p_rows = _csr(kinds, _m.BlockKind.PARTIAL)
    full = _runs(kinds, _m.BlockKind.FULL)
    slot_of = torch.full(kinds.shape, -1, dtype=torch.int64)
    slot_of[p_rows, p_col.long()] = torch.arange(p_col.numel())
    tp_ptr, tp_row, tp_cols = _csr(kinds.t(), _m.BlockKind.PARTIAL)
    tp_slot = slot_of[tp_row.long(), tp_cols].to(torch.int32)
    tfull = _runs(kinds.t(), _m.BlockKind.FULL)
    params, bits = prog.params, torch.zeros(1, dtype=torch.int8)
    if prog.tile_mask is not None and p_col.numel():
        got = _tile_bitmaps(prog.tile_mask, plan, p_ptr, p_col, B, Hq, cfg)
        if got is None:
            return None
        bits, params = got
    dev = q.device
    lay = _Layout(plan,
                  tuple(_nonempty(t).to(dev) for t in (p_ptr, p_col, *full)),
                  tuple(_nonempty(t).to(dev) for t in (tp_ptr, tp_row, tp_slot, *tfull)),
                  params.to(dev), prog.aux.to(dev), bits.to(dev))
    with _LOCK:
        _LAYOUTS[key] = lay
        if len(_LAYOUTS) > 32:
            _LAYOUTS.popitem(last=False)
    return lay


def _tile_bitmaps(mask, plan: Plan, p_ptr, p_col, B: int, Hq: int, cfg: _Config):
    """A mask callable on every partial tile: int8 ``(n_partial, Be, He, BM, BN)`` and the
    TILE literal's parameters; None over the memory budget. One mask call per query block."""
    bm, bn = cfg.block_m, cfg.block_n
    q_last, k_last = plan.q_offset + plan.Nq - 1, plan.kv_offset + plan.Nk - 1
    rows, Be, He = [], None, None
    for qb in range(plan.kinds.shape[0]):
        cols = p_col[int(p_ptr[qb]):int(p_ptr[qb + 1])].long()
        if cols.numel() == 0:
            continue
        qp = (plan.q_offset + qb * bm + torch.arange(bm)).clamp(max=q_last).view(1, 1, bm, 1)
        kp = (plan.kv_offset + cols.view(-1, 1) * bn + torch.arange(bn)).clamp(max=k_last).view(1, 1, 1, -1)
        m = mask.evaluate(torch.arange(B).view(B, 1, 1, 1), torch.arange(Hq).view(1, Hq, 1, 1), qp, kp)
        m = m.view((1,) * (4 - m.dim()) + tuple(m.shape))
        if Be is None:
            Be, He = m.shape[0], m.shape[1]
            if p_col.numel() * Be * He * bm * bn > _TILE_BITMAP_BUDGET:
                return None
        m = torch.broadcast_to(m, (Be, He, bm, cols.numel() * bn))
        rows.append(m.reshape(Be, He, bm, cols.numel(), bn).permute(3, 0, 1, 2, 4))  # (n, Be, He, BM, BN)
    bits = torch.cat(rows).to(torch.int8).contiguous()
    tile = bm * bn
    params = torch.tensor([[Be * He * tile, He * tile if Be > 1 else 0, tile if He > 1 else 0, 0]],
                          dtype=torch.int32)
    return bits, params


def _why_not_native(q, k, v, pb: Problem) -> str | None:
    """Why these inputs run on the tile kernel instead (None when the Triton kernel runs)."""
    if q.dtype == torch.float64:
        return "float64 inputs run on the tile kernel (the GPU kernel is for 16- and 32-bit floats)"
    if _score_program(pb.score) is None:
        return (f"score {pb.score!r} is not ALiBi/softcap (alone or chained): a score_mod callable "
                f"cannot be traced into Triton, so it runs on the tile kernel (same results, slower)")
    if max(q.shape[-1], v.shape[-1]) > 256:
        return "head_dim > 256 runs on the tile kernel"
    Nq, Nk = q.shape[2], k.shape[2]
    if max(abs(pb.q_offset) + Nq, pb.kv_offset + Nk) >= _MAX_POS:
        return f"positions >= 2^30 run on the tile kernel (q_offset={pb.q_offset}, kv_offset={pb.kv_offset})"
    return None


def _fallback_plan(q, k, pb: Problem) -> Plan:
    return _plan(pb.mask, q.shape[2], k.shape[2], q_offset=pb.q_offset, kv_offset=pb.kv_offset,
                 B=q.shape[0], H=q.shape[1], max_span=_FALLBACK_SPAN, allow_causal=False)


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class _Launch:
    """Everything a launch needs that does not depend on forward vs backward."""

    def __init__(self, q, k, v, pb: Problem, cfg: _Config):
        self.B, self.Hq, self.Nq, self.D = q.shape
        self.Hkv, self.Nk, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = self.Hq // self.Hkv
        self.prog = _program_of(pb)
        if pb.mask is not None and self.prog.tile_mask is None:
            _check_extents(pb.mask, self.B, self.Hq)
        self.layout = _layout(pb, self.prog, q, self.Nk, cfg)
        kind, slopes, cap = _score_program(pb.score)
        self.score = int(kind)
        # device copies are cached: a host-to-device copy per call would wait for the GPU
        self.slopes = slopes.on(q.device) if slopes is not None else _zeros(self.Hq, q.device)
        self.cap = float(cap)
        self.cfg = cfg
        self.ieee = q.dtype == torch.float32 and not (q.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
        self.const = dict(PROG=self.prog.code, NLIT=self.prog.nlit, SCORE=self.score,
                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_pow2(self.D),
                          BLOCK_DV=_pow2(self.Dv), IEEE=self.ieee,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self.scalars = (pb.q_offset, pb.kv_offset, pb.scale)


_ZEROS: dict = {}


def _zeros(n: int, device) -> torch.Tensor:
    """A cached float32 zero vector on ``device`` (the slopes of a call without ALiBi)."""
    key = (n, str(device))
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(n, dtype=torch.float32, device=device)
    return _ZEROS[key]


def _program_of(pb: Problem) -> _MaskProgram:
    return _mask_program(pb.mask) if pb.mask is not None else _ALL_VISIBLE


def _tiles_forward(q, k, v, pb, why):
    _warn_once(why, why)
    return _tiles.forward(q, k, v, _fallback_plan(q, k, pb), pb)


def forward(q, k, v, plan: Plan, pb: Problem) -> State:
    """Attention of q over these keys under ``pb``: the merged State (float32).

    ``plan`` is the engine's plan; the kernel re-plans at its own tile size (cached).
    """
    why = _why_not_native(q, k, v, pb)
    if why is not None:
        return _tiles_forward(q, k, v, pb, why)
    if _aten_dense_ok(q, k, v, pb):
        st = _aten_dense(q, k, v, pb)
        if st is not None:
            return st
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    cfg = _configs(q, q.shape[-1], v.shape[-1], _program_of(pb).nlit)[0]
    L = _Launch(q, k, v, pb, cfg)
    if L.layout is None:
        return _tiles_forward(q, k, v, pb, "the mask callable's tile bitmaps exceed 256 MiB: it runs on "
                              "the tile kernel; write it with keyfold presets to run in the kernel")
    sd = state_dtype(q.dtype)
    out = torch.empty(L.B, L.Hq, L.Nq, L.Dv, dtype=sd, device=q.device)
    lse = torch.empty(L.B, L.Hq, L.Nq, dtype=sd, device=q.device)
    if L.Nq == 0:
        return State(out, lse)
    lay = L.layout
    grid = (triton.cdiv(L.Nq, cfg.block_m), L.B * L.Hq)
    _fwd_kernel[grid](q, k, v, out, lse,
                      q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                      *lay.fwd, lay.params, lay.aux, lay.bits, L.slopes, L.cap,
                      L.Hq, L.G, L.Nq, L.Nk, L.D, L.Dv, *L.scalars,
                      EVEN_N=L.Nk % cfg.block_n == 0, **L.const)
    return State(out, lse)


def backward(q, k, v, out, lse, dout, dlse, plan: Plan, pb: Problem):
    """dq, dk, dv (float32) of these keys from the *global* out/lse (and dlse), docs/math.md §2."""
    why = _why_not_native(q, k, v, pb)
    if why is not None:
        _warn_once(why, why)
        return _tiles.backward(q, k, v, out, lse, dout, dlse, _fallback_plan(q, k, pb), pb)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    cfg = _configs(q, q.shape[-1], v.shape[-1], _program_of(pb).nlit)[1]
    L = _Launch(q, k, v, pb, cfg)
    if L.layout is None:
        _warn_once("bitmaps", "the mask callable's tile bitmaps exceed 256 MiB: it runs on the tile kernel")
        return _tiles.backward(q, k, v, out, lse, dout, dlse, _fallback_plan(q, k, pb), pb)
    sd = state_dtype(q.dtype)
    # Rows that saw no key have lse = -inf; every tile hides them, so any finite stand-in
    # gives P = 0 there (while -inf - -inf would be NaN).
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(torch.float32).contiguous()
    delta = (dout.to(sd) * out.to(sd)).sum(-1)                 # (B, Hq, Nq): D_i = dO_i . O_i
    if dlse is not None:
        delta = delta - dlse.to(sd)                             # the lse gradient enters here
    delta = delta.to(torch.float32).contiguous()
    do = _last_dim_contiguous(dout.to(q.dtype))
    dq = torch.zeros(L.B, L.Hq, L.Nq, L.D, dtype=sd, device=q.device)
    dk = torch.zeros(L.B, L.Hkv, L.Nk, L.D, dtype=sd, device=q.device)
    dv = torch.zeros(L.B, L.Hkv, L.Nk, L.Dv, dtype=sd, device=q.device)
    if L.Nq == 0 or L.Nk == 0:
        return dq, dk, dv
    lay = L.layout
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    tail = (lay.params, lay.aux, lay.bits, L.slopes, L.cap)
    _bwd_dq_kernel[(triton.cdiv(L.Nq, cfg.block_m), L.B * L.Hq)](
        q, k, v, do, lse_safe, delta, dq, *strides, *lay.fwd, *tail,
        L.Hq, L.G, L.Nq, L.Nk, L.D, L.Dv, *L.scalars,
        EVEN_N=L.Nk % cfg.block_n == 0, **L.const)
    _bwd_dkdv_kernel[(triton.cdiv(L.Nk, cfg.block_n), L.B * L.Hkv)](
        q, k, v, do, lse_safe, delta, dk, dv, *strides, *lay.bwd, *tail,
        L.Hq, L.Hkv, L.G, L.Nq, L.Nk, L.D, L.Dv, *L.scalars, **L.const)
    return dq, dk, dv


# ============================================================================ aten dense path


_ATEN_BROKEN: list = []


def _aten_dense_ok(q, k, v, pb: Problem) -> bool:
    """A plain dense 16-bit piece on CUDA that PyTorch's flash op can compute."""
    return (USE_ATEN_DENSE and not _ATEN_BROKEN and q.device.type == "cuda" and pb.mask is None
            and pb.score is None and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[1] == k.shape[1] and q.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention"))


def _aten_dense(q, k, v, pb: Problem) -> State | None:
    """``(out, lse)`` from ``aten._scaled_dot_product_flash_attention`` (lse natural log)."""
    try:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=pb.scale)
        out, lse = res[0], res[1]
        return State(out.float(), lse[..., :q.shape[2]].float().contiguous())
    except Exception as e:  # noqa: BLE001 - any failure: use the Triton kernel from now on
        _ATEN_BROKEN.append(repr(e))
        _warn_once("aten", f"aten flash op failed ({e!r}); dense pieces use the Triton kernel")
        return None


# ============================================================================ compile check


def compile_for_gpu(arch: int = 90, dtype: str = "bf16", head_dim: int = 128, mask=None, score=None,
                    kernels=("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel")) -> dict:
    """Compile the three kernels ahead of time for an NVIDIA GPU of compute capability ``arch``
    (90 = H100/H200) without one: proves they lower to a cubin. Returns per kernel
    ``{"seconds", "shared_bytes"}``. Needs triton with its bundled ptxas, and must run in a
    process where TRITON_INTERPRET is unset (the interpreter replaces the kernels).

    mask, score: the settings whose programs to compile (default ``causal() & (window(64) |
    sinks(4))`` with ``[alibi, softcap]``, which exercises most of the in-kernel code).
    kernels: which of the three to compile.
    """
    import time

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if _interpreting():
        raise RuntimeError("compile_for_gpu needs TRITON_INTERPRET unset (run it in a fresh process)")
    if mask is None:
        mask = _m.causal() & (_m.window(64) | _m.sinks(4))
    score = _s.as_score([_s.alibi(torch.ones(1)), _s.softcap(30.0)] if score is None else score)
    prog = _mask_program(_m.as_mask(mask))
    kind = _score_program(score)
    if kind is None:
        raise ValueError(f"score {score!r} does not run in the kernel")
    d = _pow2(head_dim)
    const = dict(PROG=prog.code, NLIT=prog.nlit, SCORE=int(kind[0]), BLOCK_D=d, BLOCK_DV=d,
                 IEEE=dtype == "fp32")
    fake = torch.empty(1, dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype],
                       device="meta")
    fwd, bwd = _configs(_MetaCuda(fake), head_dim, head_dim, prog.nlit)
    ptrs = {n: "*i32" for n in ("p_ptr", "p_col", "f_ptr", "f_lo", "f_hi", "p_row", "p_slot", "prm", "aux")}
    ptrs.update(bits="*i8", slopes="*fp32", O="*fp32", LSE="*fp32", DELTA="*fp32", DQ="*fp32", DK="*fp32",
                DV="*fp32", **{n: "*" + dtype for n in ("Q", "K", "V", "DO")})
    result = {}
    for fn, cfg, extra in ((_fwd_kernel, fwd, dict(EVEN_N=False)), (_bwd_dq_kernel, bwd, dict(EVEN_N=False)),
                           (_bwd_dkdv_kernel, bwd, {})):
        if fn.__name__ not in kernels:
            continue
        c = dict(const, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **extra)
        sig = {n: "constexpr" if n in c else ptrs.get(n, "fp32" if n in ("cap", "sm_scale") else "i32")
               for n in fn.arg_names}
        t0 = time.perf_counter()
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c), target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        result[fn.__name__] = {"seconds": round(time.perf_counter() - t0, 2), "shared_bytes": k.metadata.shared}
    return result


class _MetaCuda:
    """Stands in for a CUDA tensor when choosing configs for a GPU that is not here."""

    def __init__(self, t):
        self.dtype = t.dtype
        self.device = torch.device("cuda")
