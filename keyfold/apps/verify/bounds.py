"""An a-priori forward error bound for the engine: |keyfold - exact| before running anything.

The derivation, term by term, is in ``docs/error_bounds.md``; this module evaluates it.
It follows the rounding model of Blanchard, Higham & Higham (2021, "Accurately computing
the log-sum-exp and softmax functions"): every floating-point operation returns the exact
result times ``(1 + d)`` with ``|d| <= u``, sums of ``k`` terms carry ``gamma_k = k u / (1 - k u)``.
Two roundoffs enter: ``u_in`` of the input dtype (probabilities and each piece's output may be
stored in it) and ``w`` of the state dtype (float32; float64 for float64 inputs) in which
scores, sums, lse and merges are computed.

Per query row ``i`` with ``n`` keys, ``m`` merged pieces, score magnitude ``R`` (``|s_ij| <= R``)
and ``A = scale * max_j sum_d |q_id k_jd|`` (the size of the score's dot product), and per
value column ``c`` with ``V_c = max_j |v_jc|``, to first order::

    |out - exact| <~ V_c * (2 e_s + 3 u_in + 2 eps_exp + w (6 n + 5 R) + n eta_in
                            + (m - 1) (2 delta + 3 w L)),          e_s = (D + 2) w A,
    |lse - exact| <~ delta + (m - 1) w (L + C_LAE),   delta ~ e_s + 3 w R + eps_exp + 2 n w,
    L = R + log n + 1,

where ``delta`` is one piece's lse bound, ``eps_exp`` the relative error of exp and ``eta_in``
half the smallest subnormal of the input dtype (probabilities that underflow).
:func:`error_bound` evaluates the exact (not first-order) recurrence of the derivation, so the
numbers it returns are the bound itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from keyfold.engine import TILE_SPAN
from keyfold.masks import as_mask
from keyfold.planner import default_block
from keyfold.scores import ScoreKind, ScoreMod, as_score

__all__ = ["Roundoff", "roundoff", "ErrorBound", "error_bound", "pieces_per_row", "observed_error"]

# Elementary-function accuracy assumed, in units of w (relative error of one evaluation).
# PyTorch's vectorised exp/log/tanh are within a few ulps (1 ulp <= 2w); these leave room
# (measured: 4.1 w for exp in the fused kernel's float32 path, at 0 and away from it, see
# :func:`measure_kernel_exp`).
C_EXP = 16.0    # exp
C_LOG = 8.0     # log, log1p
C_TANH = 8.0    # tanh (softcap)
C_LAE = 28.0    # logaddexp = max + log1p(exp(-|a - b|)): one exp, one log1p, two adds
# The fused CPU kernel evaluates exp(s - max) for 16-bit inputs with a fast approximation
# (relative error measured at 1.2e-4, e.g. exp(0) = 1 - 5.3e-5): a property of the kernel, not
# of IEEE arithmetic, so it is a constant here, twice the measured maximum, and a test re-measures it.
EXP_REDUCED = 2.0 ** -12


@dataclass(frozen=True)
class Roundoff:
    """Unit roundoffs of one call.

    u_in: of the input dtype (probabilities and per-piece outputs may be stored in it).
    w: of the state dtype (float32, or float64 for float64 inputs): scores, sums, lse, merges.
    eta_in: half the smallest positive subnormal of the input dtype (underflow of a probability).
    """

    u_in: float
    w: float
    eta_in: float


def roundoff(dtype: torch.dtype) -> Roundoff:
    """The :class:`Roundoff` for inputs of ``dtype`` (float16, bfloat16, float32 or float64).

    >>> roundoff(torch.bfloat16).u_in == 2.0 ** -8
    True
    """
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"roundoff(dtype): expected float16, bfloat16, float32 or float64, got {dtype}")
    fi = torch.finfo(dtype)
    w = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2
    return Roundoff(u_in=fi.eps / 2, w=w, eta_in=fi.smallest_normal * fi.eps / 2)


def _gamma(k, u):
    """Higham's gamma_k = k u / (1 - k u); infinite when k u >= 1 (no bound)."""
    ku = k * u
    return torch.where(ku < 1, ku / (1 - ku).clamp_min(1e-300), torch.full_like(ku, math.inf))


@dataclass(frozen=True)
class ErrorBound:
    """A-priori bounds for one call (all float64).

    out: ``(B, Hq, Nq, Dv)`` bound on ``|attend(...).out - exact|`` elementwise.
    lse: ``(B, Hq, Nq)`` bound on ``|attend(...).lse - exact|``.
    cast: ``(B, Hq, Nq, Dv)`` bound on ``|attention(...) - exact|`` (the output in the input dtype).
    score_error: ``(B, Hq, Nq)`` e_s, the bound on the error of one computed score.
    score_range: ``(B, Hq, Nq)`` R, the bound on ``|score|``.
    pieces: the number of merged pieces m the bound allows for.
    Rows that see no key are exactly 0 with lse -inf; the bound does not need to cover them.
    """

    out: torch.Tensor
    lse: torch.Tensor
    cast: torch.Tensor
    score_error: torch.Tensor
    score_range: torch.Tensor
    pieces: int


def pieces_per_row(Nq: int, chunk_sizes: Sequence[int], block_size: int | None = None,
                   bounded_span: bool = False) -> int:
    """An upper bound on the partial states merged into one row when the keys are cut into
    chunks of ``chunk_sizes``, each given to one :func:`keyfold.attend` call.

    Within one call the planner gives a row at most one piece per key block, plus one for the
    causal split (``planner._causal_pieces``); ``bounded_span`` (the tile path) cuts spans
    longer than ``TILE_SPAN`` but never below one per key block, so the count stands.
    """
    total = 0
    for n in chunk_sizes:
        if n <= 0:
            continue
        bk = default_block(Nq, n)[1] if block_size is None else block_size
        total += -(-n // min(bk, TILE_SPAN if bounded_span else bk)) + 1
    return max(1, total)


def _abs_score(q, k, scale, chunk=1024):
    """``scale * max_j sum_d |q_id| |k_jd|`` per query row, ``(B, Hq, Nq)``, keys in chunks."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qa = q.double().abs().reshape(B, Hkv, g, Nq, D)                      # (B, Hkv, g, Nq, D)
    best = torch.zeros(B, Hkv, g, Nq, dtype=torch.float64)
    for j0 in range(0, Nk, chunk):
        ka = k[:, :, j0:j0 + chunk].double().abs().unsqueeze(2)           # (B, Hkv, 1, c, D)
        best = torch.maximum(best, (qa @ ka.transpose(-1, -2)).amax(-1))
    return best.reshape(B, Hq, Nq) * abs(scale)


def _score_mods(score: ScoreMod | None):
    if score is None:
        return []
    return list(score.parts() or (score,))


def _apply_mods(mods, R, e_s, w, Hq, q_lo, q_hi, k_lo, k_hi):
    """Carry the score bound R and its error e_s through each modifier, left to right."""
    for mod in mods:
        kind, prm = mod.spec() or (None, {})
        if kind is ScoreKind.ALIBI:
            slopes = prm["slopes"].double().abs().view(1, Hq, 1)          # (1, Hq, 1)
            dist = max(abs(q_hi - k_lo), abs(k_hi - q_lo))                # largest |qp - kp|
            bias = slopes * dist
            # bias = -slope * |qp - kp|, or the fused path's separable form (a key term s(kp - r)
            # and a row term added to lse, each at most slope * the largest distance): two
            # roundings of the bias, s + bias, and the row term's addition to lse
            R = R + bias
            e_s = e_s + w * (2 * R + 4 * bias)
        elif kind is ScoreKind.SOFTCAP:
            # cap * tanh(s / cap): division, tanh, product; tanh is 1-Lipschitz
            e_s = e_s + w * (R + (C_TANH + 2) * prm["cap"])
            R = torch.clamp(R, max=prm["cap"])
        else:
            raise ValueError(f"error_bound: no a-priori bound for the score modifier {mod!r}; it supports "
                             f"alibi(...) and softcap(...) (a general score_mod has no known Lipschitz constant)")
    return R, e_s


def error_bound(q, k, v, *, mask=None, score=None, scale=None, q_offset=None, kv_offset=0,
                pieces: int | None = None) -> ErrorBound:
    """The a-priori bound on keyfold's error for this call (docs/error_bounds.md).

    Same arguments as :func:`keyfold.attend` (a tensor mask bool only: an additive one changes the
    scores, which the bound does not model, and raises); ``pieces`` is the number of partial states merged
    into a row (default: what one engine call can produce, :func:`pieces_per_row`). When you
    split the keys into chunks yourself and merge them, pass
    ``pieces_per_row(Nq, [chunk sizes])``. The mask only decides which rows are empty (those are
    exactly 0); the bound uses all ``Nk`` keys as ``n``, which only loosens it.

    >>> import torch, keyfold
    >>> from keyfold.apps.verify.bounds import error_bound
    >>> q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    >>> err = (keyfold.attend(q, k, v).out.double() - keyfold.attend(q.double(), k.double(), v.double()).out).abs()
    >>> bool((err <= error_bound(q, k, v).out).all())
    True
    """
    if isinstance(mask, torch.Tensor):  # attend's tensor masks (a review, 2026-12-07: refused as not a mask)
        if mask.dtype is not torch.bool:
            raise ValueError("error_bound: an additive (float) tensor mask changes the scores, which this bound "
                             "does not model; pass a bool tensor mask (True = attend), a keyfold mask or callable")
    else:
        as_mask(mask)  # validates the mask argument the way attend does
    score = as_score(score)
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    if score is not None:
        score.check_heads(Hq)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q_offset = kv_offset + Nk - Nq if q_offset is None else q_offset
    if pieces is None:
        pieces = pieces_per_row(Nq, [Nk], bounded_span=score is not None)
    if not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"pieces must be an int >= 1 (merged partial states per row), got {pieces!r}")
    ro = roundoff(q.dtype)
    w, u, eta = ro.w, ro.u_in, ro.eta_in
    n = float(max(Nk, 1))
    logn = math.log(n)

    A = _abs_score(q, k, scale) if Nk else torch.zeros(B, Hq, Nq, dtype=torch.float64)
    e_s = _gamma(torch.tensor(D + 2.0), w) * A                           # dot product, scale
    R, e_s = _apply_mods(_score_mods(score), A.clone(), e_s, w, Hq, q_offset, q_offset + Nq - 1,
                         kv_offset, kv_offset + Nk - 1)

    # one piece (at most n keys): exponents, sums, probabilities in the input dtype, the output
    c_exp = w * C_EXP if q.dtype in (torch.float32, torch.float64) else max(w * C_EXP, EXP_REDUCED)
    e_x = e_s + 2 * w * R + c_exp                                        # exponent perturbation
    nn = torch.tensor(n, dtype=torch.float64)
    eps_l = _gamma(2 * nn, w)                                            # sum of n, n rescales
    eps_n = (1 + u) * (1 + _gamma(2 * nn + 1, w)) - 1                    # P in dtype, P@V, rescales
    lse_comp = eps_l / (1 - eps_l) + w * ((C_LOG + 1) * logn + R + 1)    # log of the sum, add the max
    E = (torch.expm1(2 * e_x + lse_comp) + (eps_n + n * eta + eps_l) / (1 - eps_l)
         + 2 * (u + w) + (u + w) ** 2)                                   # in units of V
    delta = e_x + lse_comp                                               # lse of one piece

    # m - 1 merges in sequence bound every merge tree of m pieces (the recurrence is monotone)
    L = R + logn + 1
    for _ in range(pieces - 1):
        theta = 2 * delta + w * (3 * L + C_LAE + C_EXP)
        E = torch.exp(theta) * E + torch.expm1(theta) + 2 * w * torch.exp(theta) * (1 + E)
        delta = delta + w * (L + C_LAE)

    Hkv = k.shape[1]
    V = v.double().abs().amax(2) if Nk else torch.zeros(B, Hkv, v.shape[-1], dtype=torch.float64)
    V = V.repeat_interleave(Hq // Hkv, dim=1).unsqueeze(2)              # (B, Hq, 1, Dv)
    out = E.unsqueeze(-1) * V                                            # (B, Hq, Nq, Dv)
    if q.dtype != torch.float64:
        ref = error_bound(q.double(), k.double(), v.double(), mask=mask, score=score, scale=scale,
                          q_offset=q_offset, kv_offset=kv_offset, pieces=1)
        out = out + ref.out                                              # the float64 oracle's own error
        delta = delta + ref.lse
    cast = out + u * (V + out) + eta
    return ErrorBound(out=out, lse=delta, cast=cast, score_error=e_s, score_range=R, pieces=pieces)


def observed_error(state_out, exact_out, exact_lse):
    """``|out - exact|`` on rows that see a key, 0 elsewhere (their exactness is checked apart)."""
    seen = torch.isfinite(exact_lse).unsqueeze(-1)
    return torch.where(seen, (state_out.double() - exact_out.double()).abs(), torch.zeros((), dtype=torch.float64))


def measure_kernel_exp(dtype: torch.dtype, points: int = 4096) -> float:
    """Measured relative error of the exp that the fused CPU kernel uses for ``dtype`` inputs.

    At 0: sixteen keys with equal scores ``d`` on a grid over [-4, 4] give ``lse = d + log 16``
    exactly (the sum is exact), so ``|lse - exact|`` is the kernel's rounding of exp(0). Away from
    0: two keys with scores 0 and ``-x`` (exact in ``dtype``) give ``lse = log(1 + e^-x)``, and an
    exp off by ``r`` relative moves it by ``r e^-x / (1 + e^-x)``: the error of lse divided by that
    factor bounds ``r`` from above (the sum's and log's roundings count against the exp), for x
    over [0, 4] (16-bit) or [0, 1] (float32, whose roundings the wider factor would swamp).
    Returns the larger of the two; 0.0 where the fused kernel is unavailable. The bound assumes
    :data:`EXP_REDUCED` (16-bit inputs) and ``C_EXP * w`` (32-bit) are at least this.
    """
    from keyfold.kernels import cpu as _cpu
    if not _cpu.AVAILABLE:
        return 0.0
    d = torch.linspace(-4, 4, points).to(dtype)
    q = torch.zeros(1, 1, points, 16, dtype=dtype)                       # (1, 1, P, 16)
    q[0, 0, :, 0] = d
    k = torch.zeros(1, 1, 16, 16, dtype=dtype)
    k[0, 0, :, 0] = 1                                                    # every score equals d
    _, lse = _cpu._FWD(q, k, torch.zeros_like(k), 0.0, False, attn_mask=None, scale=1.0)
    at_zero = float((lse.double()[0, 0] - (d.double() + math.log(16.0))).abs().max())
    x = torch.linspace(0, 1.0 if dtype == torch.float32 else 4.0, points).to(dtype).double()
    q = torch.zeros(1, 1, points, 16, dtype=dtype)
    q[0, 0, :, 1] = (-x).to(dtype)                                      # scores 0 and -x
    k = torch.zeros(1, 1, 2, 16, dtype=dtype)
    k[0, 0, 0, 0] = k[0, 0, 1, 1] = 1
    _, lse = _cpu._FWD(q, k, torch.zeros_like(k), 0.0, False, attn_mask=None, scale=1.0)
    e = torch.exp(-x)
    away = float(((lse.double()[0, 0] - torch.log1p(e)).abs() * (1 + e) / e).max())
    return max(at_zero, away)
