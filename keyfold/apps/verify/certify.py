"""Certified output bounds: for every input in a box, every output lies in ``[lo, hi]``.

Two methods over one abstract tensor, :class:`Abstract` ``x = c + G·e + r·d`` with ``e`` in
``[-1, 1]^P`` shared by every element (the input perturbation) and ``d`` in ``[-1, 1]`` private to
each element (everything a relaxation could not keep linear):

- ``Method.IBP`` (interval bound propagation): no shared symbols (``G = None``), so ``x`` is an
  interval in midpoint-radius form; nonlinear functions take their exact interval image and the
  softmax its tight per-coordinate interval.
- ``Method.LINEAR`` (linear relaxation, DeepZ/DeepT style): one shared symbol per input element;
  linear maps are exact, each nonlinear function ``f`` on ``[l, u]`` becomes its minimal-width
  linear enclosure ``lam·x + mu ± beta``; the softmax is written ``p_j = 1 / sum_k exp(s_k - s_j)``
  so the shared part of the scores cancels in the differences before any relaxation.

Both apply the fact attention gives for free: every output of a head lies in the per-column
range of the values its row can see (a convex combination), and ``0 <= p <= 1``.

Soundness in floating point: all arithmetic is float64 and every operation widens its radius by
a rounding allowance (``gamma_k`` of float64 for sums of k products, ``FN_SLACK`` relative for
elementwise functions), so the bounds hold for the exact real-number layer. The maths:
``docs/verify.md``. Certification materialises the (N x N) scores (pairwise differences even
N x N x N per head), like the reference backend: it is an analysis tool for small layers.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Callable

import torch

from keyfold.masks import as_mask

__all__ = ["Method", "Bounds", "AttentionWeights", "BlockWeights", "certify_attention", "certify_block",
           "attention_forward", "block_forward", "sample_box", "value_range"]

U64 = 2.0 ** -53          # float64 unit roundoff
FN_SLACK = 1e-13          # relative allowance for one float64 exp / log / sqrt / division (< 1000 ulps)
TINY = 1e-300             # keeps radii positive where everything is exact zero
_EXP_MAX = 600.0          # exp(600) ~ 1e260: above this a linear enclosure of exp would overflow


def _gamma(k: int) -> float:
    return k * U64 / (1 - k * U64)


class Method(enum.Enum):
    IBP = "ibp"          # interval bound propagation
    LINEAR = "linear"    # affine forms with linear relaxations of each nonlinearity


# ------------------------------------------------------------------------ abstract tensor


class Abstract:
    """``c + G·e + r·d``: c ``X``, G ``(P, *X)`` or None (pure interval), r ``X`` >= 0. float64.

    Shape methods take negative dims only, so they mean the same for c, r and G.
    """

    __slots__ = ("c", "G", "r")

    def __init__(self, c: torch.Tensor, G: torch.Tensor | None, r: torch.Tensor):
        self.c, self.G, self.r = c, G, r

    # -- construction / concretisation ----------------------------------------------------
    @staticmethod
    def box(lo: torch.Tensor, hi: torch.Tensor, method: Method) -> "Abstract":
        lo, hi = lo.double(), hi.double()
        c, rad = (lo + hi) / 2, (hi - lo) / 2
        rad = rad + _gamma(2) * (lo.abs() + hi.abs())       # midpoint/radius rounding
        if method is Method.IBP:
            return Abstract(c, None, rad)
        n = c.numel()
        G = torch.diag(rad.reshape(-1)).reshape(n, *c.shape)  # one shared symbol per input element
        return Abstract(c, G, torch.zeros_like(c))

    @property
    def shape(self):
        return self.c.shape

    def g(self) -> torch.Tensor:
        """``sum_p |G_p|``: the largest shared deviation of each element."""
        return torch.zeros_like(self.c) if self.G is None else self.G.abs().sum(0)

    def radius(self) -> torch.Tensor:
        return self.g() + self.r

    def mag(self) -> torch.Tensor:
        """An upper bound of ``|x|`` (used to size rounding allowances)."""
        return self.c.abs() + self.radius()

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Concretise: the smallest box this form guarantees, widened for rounding."""
        P = 0 if self.G is None else self.G.shape[0]
        rad = self.radius() * (1 + _gamma(P + 3)) + _gamma(P + 3) * self.c.abs() + TINY
        return self.c - rad, self.c + rad

    # -- shapes ----------------------------------------------------------------------------
    def _map(self, f: Callable) -> "Abstract":
        return Abstract(f(self.c), None if self.G is None else f(self.G), f(self.r))

    def reshape(self, *shape):
        return Abstract(self.c.reshape(shape), None if self.G is None else self.G.reshape(self.G.shape[0], *shape),
                        self.r.reshape(shape))

    def transpose(self, a: int, b: int):
        assert a < 0 and b < 0
        return self._map(lambda t: t.transpose(a, b))

    def unsqueeze(self, d: int):
        assert d < 0
        return self._map(lambda t: t.unsqueeze(d))

    def sum(self, d: int):
        assert d < 0
        n = self.c.shape[d]
        out = self._map(lambda t: t.sum(d))
        out.r = out.r + _gamma(n) * self.mag().sum(d)
        return out

    # -- linear ------------------------------------------------------------------------------
    def __add__(self, other: "Abstract"):
        G = _add_opt(self.G, other.G)
        r = self.r + other.r + _gamma(1) * (self.mag() + other.mag())
        return Abstract(self.c + other.c, G, r)

    def __neg__(self):
        return Abstract(-self.c, None if self.G is None else -self.G, self.r)

    def __sub__(self, other: "Abstract"):
        return self + (-other)

    def scale(self, a) -> "Abstract":
        """Multiply by a constant (a number or a tensor broadcasting over the trailing dims)."""
        a = torch.as_tensor(a, dtype=torch.float64)
        return Abstract(self.c * a, None if self.G is None else self.G * a,
                        self.r * a.abs() + _gamma(1) * self.mag() * a.abs())

    def shift(self, b) -> "Abstract":
        b = torch.as_tensor(b, dtype=torch.float64)
        return Abstract(self.c + b, self.G, self.r + _gamma(1) * (self.mag() + b.abs()))

    def linear(self, W: torch.Tensor, b: torch.Tensor | None = None) -> "Abstract":
        """``x @ W.T + b`` on the last dim (like ``F.linear``)."""
        W = W.double()
        Wt, Wa = W.t(), W.abs().t()
        c = self.c @ Wt
        G = None if self.G is None else self.G @ Wt
        r = self.r @ Wa + _gamma(W.shape[1] + 2) * (self.mag() @ Wa)
        if b is not None:
            c = c + b.double()
            r = r + _gamma(1) * (c.abs() + b.double().abs())
        return Abstract(c, G, r)

    # -- bilinear ------------------------------------------------------------------------------
    def matmul(self, other: "Abstract") -> "Abstract":
        """``self @ other`` over the last two dims, both uncertain (scores, p @ v)."""
        c = self.c @ other.c
        G = _add_opt(None if other.G is None else self.c @ other.G, None if self.G is None else self.G @ other.c)
        ga, gb = self.radius(), other.radius()
        r = (self.c.abs() @ other.r + self.r @ other.c.abs() + ga @ gb
             + _gamma(self.c.shape[-1] + 3) * (self.mag() @ other.mag()))
        # ga @ gb bounds the product of the two deviations, shared or not; c·r terms are the rest
        return Abstract(c, G, r)

    def mul(self, other: "Abstract") -> "Abstract":
        """Elementwise product of two uncertain tensors (broadcasting)."""
        c = self.c * other.c
        G = _add_opt(None if other.G is None else self.c * other.G, None if self.G is None else self.G * other.c)
        r = (self.c.abs() * other.r + self.r * other.c.abs() + self.radius() * other.radius()
             + _gamma(3) * self.mag() * other.mag())
        return Abstract(c, G, r)

    # -- elementwise nonlinear ----------------------------------------------------------------
    def apply(self, fn: "_Fn", floor: torch.Tensor | float | None = None) -> "Abstract":
        """``fn(x)`` elementwise: the exact interval image (IBP) or a linear enclosure (LINEAR).

        floor: a lower bound the true value is known to respect (a LayerNorm variance >= eps, a
        softmax denominator >= 1); the relaxation is built on ``[max(lo, floor), hi]``, which is
        sound because every reachable value lies there, and avoids a useless pole at 0.
        """
        lo, hi = self.bounds()
        if floor is not None:
            lo = torch.maximum(lo, torch.as_tensor(floor, dtype=torch.float64))
            hi = torch.maximum(hi, lo)
        lo, hi = fn.domain(lo, hi)
        if self.G is None:
            flo, fhi = fn.image(lo, hi)
            c, r = (flo + fhi) / 2, (fhi - flo) / 2
            r = r + FN_SLACK * (flo.abs() + fhi.abs()) + TINY
            return Abstract(c, None, r)
        lam = fn.slope(lo, hi)
        t = fn.tangent_point(lam, lo, hi).clamp(lo, hi)
        g_lo, g_hi = fn.f(lo) - lam * lo, fn.f(hi) - lam * hi
        g_t = fn.f(t) - lam * t
        band_hi = torch.maximum(g_lo, g_hi) if fn.convex else torch.maximum(torch.maximum(g_lo, g_hi), g_t)
        band_lo = torch.minimum(torch.minimum(g_lo, g_hi), g_t) if fn.convex else torch.minimum(g_lo, g_hi)
        mu, beta = (band_hi + band_lo) / 2, (band_hi - band_lo) / 2
        scale_ = (lam.abs() * self.mag() + mu.abs() + beta)
        out = self.scale(lam)
        return Abstract(out.c + mu, out.G, out.r + beta + FN_SLACK * scale_ + TINY)

    def select(self, cond: torch.Tensor, other: "Abstract") -> "Abstract":
        """Elementwise ``other`` where ``cond``, else ``self`` (shared terms of ``other`` kept)."""
        zero = torch.zeros((), dtype=torch.float64)
        G = None
        if self.G is not None or other.G is not None:
            G = torch.where(cond, zero if other.G is None else other.G, zero if self.G is None else self.G)
        return Abstract(torch.where(cond, other.c, self.c), G, torch.where(cond, other.r, self.r))

    def tighten(self, lo: torch.Tensor, hi: torch.Tensor) -> "Abstract":
        """Replace an element by the box ``[lo, hi]`` where that box is narrower (both are sound)."""
        cur_lo, cur_hi = self.bounds()
        lo, hi = torch.maximum(lo, cur_lo), torch.minimum(hi, cur_hi)
        better = (hi - lo) < (cur_hi - cur_lo)
        if not bool(better.any()):
            return self
        c = torch.where(better, (lo + hi) / 2, self.c)
        r = torch.where(better, (hi - lo) / 2 + _gamma(2) * (lo.abs() + hi.abs()) + TINY, self.r)
        G = None if self.G is None else torch.where(better, torch.zeros((), dtype=torch.float64), self.G)
        return Abstract(c, G, r)


def _add_opt(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


# ---------------------------------------------------------------- elementwise functions


class _Fn:
    """A scalar function with what both methods need: its image on [l, u] and a tangent point."""

    convex = True

    def f(self, x):
        raise NotImplementedError

    def domain(self, lo, hi):
        return lo, hi

    def image(self, lo, hi):           # monotone increasing by default
        return self.f(lo), self.f(hi)

    def slope(self, lo, hi):
        """Chord slope, or the derivative at the midpoint for (near-)degenerate intervals."""
        w = hi - lo
        chord = (self.f(hi) - self.f(lo)) / torch.where(w > 0, w, torch.ones_like(w))
        return torch.where(w > 1e-9 * (1 + lo.abs() + hi.abs()), chord, self.df((lo + hi) / 2))

    def df(self, x):
        raise NotImplementedError

    def tangent_point(self, lam, lo, hi):
        raise NotImplementedError


class _Exp(_Fn):
    def f(self, x):
        return torch.exp(x)

    def df(self, x):
        return torch.exp(x)

    def tangent_point(self, lam, lo, hi):
        return torch.log(lam.clamp_min(1e-300))


class _Recip(_Fn):                       # 1/x on x > 0: convex, decreasing
    def f(self, x):
        return 1.0 / x

    def domain(self, lo, hi):
        if bool((lo <= 0).any()):
            raise ValueError("certify: a softmax denominator's lower bound reached 0 (cannot happen for exact "
                             "sums including exp(0) = 1); report this as a bug")
        return lo, hi

    def image(self, lo, hi):
        return 1.0 / hi, 1.0 / lo

    def df(self, x):
        return -1.0 / (x * x)

    def tangent_point(self, lam, lo, hi):
        return torch.sqrt(-1.0 / lam.clamp_max(-1e-300))


class _Rsqrt(_Fn):                       # x^(-1/2) on x > 0: convex, decreasing
    def f(self, x):
        return torch.rsqrt(x)

    def domain(self, lo, hi):
        return lo.clamp_min(1e-300), hi.clamp_min(1e-300)

    def image(self, lo, hi):
        return torch.rsqrt(hi), torch.rsqrt(lo)

    def df(self, x):
        return -0.5 * x.pow(-1.5)

    def tangent_point(self, lam, lo, hi):
        return (-2.0 * lam.clamp_max(-1e-300)).pow(-2.0 / 3.0)


class _Square(_Fn):
    def f(self, x):
        return x * x

    def image(self, lo, hi):
        top = torch.maximum(lo * lo, hi * hi)
        bottom = torch.where((lo <= 0) & (hi >= 0), torch.zeros_like(lo), torch.minimum(lo * lo, hi * hi))
        return bottom, top

    def df(self, x):
        return 2 * x

    def tangent_point(self, lam, lo, hi):
        return lam / 2


class _Relu(_Fn):
    def f(self, x):
        return x.clamp_min(0)

    def df(self, x):
        return (x > 0).double()

    def tangent_point(self, lam, lo, hi):
        return torch.zeros_like(lam)     # the kink


EXP, RECIP, RSQRT, SQUARE, RELU = _Exp(), _Recip(), _Rsqrt(), _Square(), _Relu()


# ----------------------------------------------------------------------------- softmax


def _softmax(s: Abstract, vis: torch.Tensor) -> Abstract:
    """Row softmax of scores ``(H, N, N)`` over visible keys ``vis`` ``(N, N)`` or ``(H, N, N)``;
    hidden p = 0 exactly."""
    if s.G is None:
        return _softmax_interval(s, vis)
    # p_j = 1 / sum_k exp(s_k - s_j): the differences keep the shared part of the scores exact
    diff = s.unsqueeze(-2) - s.unsqueeze(-1)                                # (H, N, j, k) = s_k - s_j
    # where a difference may exceed exp's range, that p_j takes the interval softmax instead
    over = diff.bounds()[1] > _EXP_MAX                                      # (H, N, j, k)
    wild = (over & vis.unsqueeze(-2)).any(-1)                               # (H, N, j)
    if bool(over.any()):
        # exp of such a difference overflows and its NaN would reach every p of the row, even
        # through a hidden key (0 * NaN); each is either hidden (weighted by 0 below) or in a wild
        # row (replaced below), so any finite stand-in is sound: 0
        zero = torch.zeros_like(diff.c)
        diff = diff.select(over, Abstract(zero, None, zero))
    e = diff.apply(EXP)
    # k = j is exactly exp(0) = 1 (the form cannot see that both private terms are one element)
    diag = torch.eye(vis.shape[-1], dtype=torch.bool)
    one = torch.ones((), dtype=torch.float64)
    e_lo, e_hi = e.bounds()
    e = Abstract(torch.where(diag, one, e.c), None if e.G is None else torch.where(diag, 0 * one, e.G),
                 torch.where(diag, 0 * one, e.r))
    e = e.scale(vis.unsqueeze(-2).double())                                 # hidden keys contribute 0
    den = e.sum(-1)                                                         # (H, N, j), >= 1
    d_lo = 1 + torch.where(vis.unsqueeze(-2) & ~diag, e_lo.clamp_min(0), 0 * one).sum(-1)
    p = den.apply(RECIP, floor=torch.where(wild, one, d_lo * (1 - FN_SLACK)))
    p = p.scale(vis.double())
    if bool(wild.any()):
        p = p.select(wild, _softmax_interval(s, vis))
    return p.tighten(torch.zeros_like(p.c), vis.double())


def _softmax_interval(s: Abstract, vis: torch.Tensor) -> Abstract:
    """The tight per-coordinate interval of the softmax (IBP), as a pure interval."""
    lo, hi = s.bounds()
    hidden = torch.tensor(float("-inf"), dtype=torch.float64)
    # p_j >= 1 / (1 + sum_{k != j} exp(u_k - l_j)),  p_j <= 1 / (1 + sum_{k != j} exp(l_k - u_j))
    eye = torch.eye(vis.shape[-1], dtype=torch.bool)
    others = vis.unsqueeze(-2) & ~eye                                   # ([H,] N, j, k)
    lse_lo = torch.logsumexp(torch.where(others, hi.unsqueeze(-2) - lo.unsqueeze(-1), hidden), -1)
    lse_hi = torch.logsumexp(torch.where(others, lo.unsqueeze(-2) - hi.unsqueeze(-1), hidden), -1)
    p_lo, p_hi = torch.sigmoid(-lse_lo), torch.sigmoid(-lse_hi)
    p_lo = torch.where(vis, p_lo * (1 - FN_SLACK), torch.zeros_like(p_lo))
    p_hi = torch.where(vis, (p_hi * (1 + FN_SLACK)).clamp_max(1.0), torch.zeros_like(p_hi))
    return Abstract((p_lo + p_hi) / 2, None, (p_hi - p_lo) / 2 + TINY * vis)


# -------------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class AttentionWeights:
    """Multi-head self-attention ``out = concat_h softmax(Q_h K_h^T / sqrt(dh)) V_h @ wo.T + bo``.

    wq, wk, wv, wo: ``(E, E)``; bq, bk, bv, bo: ``(E,)``; heads divides E. float64 copies.
    mask: a keyfold mask the layer itself applies on every call (a ``keyfold.nn`` layer's
    ``mask=``); certification and :func:`attention_forward` AND it with the caller's mask, so
    the certificate is for the layer as it runs.
    """

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor
    bk: torch.Tensor
    bv: torch.Tensor
    bo: torch.Tensor
    heads: int
    mask: object = None

    @staticmethod
    def random(E: int, heads: int, *, seed: int = 0, gain: float = 1.0) -> "AttentionWeights":
        g = torch.Generator().manual_seed(seed)
        w = [torch.randn(E, E, generator=g, dtype=torch.float64) * gain / math.sqrt(E) for _ in range(4)]
        b = [torch.randn(E, generator=g, dtype=torch.float64) * 0.1 for _ in range(4)]
        return AttentionWeights(*w, *b, heads=heads)

    @staticmethod
    def from_module(mha) -> "AttentionWeights":
        """From a ``torch.nn.MultiheadAttention`` or ``keyfold.nn.MultiheadAttention`` (same names).

        A keyfold layer's ``mask`` is carried into the weights (and so into every bound); a
        score modifier cannot be certified and raises ``ValueError`` naming it, and so do the extra
        keys of ``add_bias_kv`` and ``add_zero_attn`` (a key every row sees that no input moves: a bound
        without it was for a different function, escaped by the layer's own output by up to 0.87).
        A layer built with ``bias=False`` has zero biases."""
        score = getattr(mha, "score", None)
        if score is not None:
            raise ValueError(f"AttentionWeights.from_module: the layer applies the score modifier {score!r}; "
                             f"certification covers plain scaled dot-product scores (with a mask) only, so a "
                             f"bound without it would be for a different function. Build the layer without score=")
        for name, on in (("add_bias_kv", getattr(mha, "bias_k", None) is not None),
                         ("add_zero_attn", bool(getattr(mha, "add_zero_attn", False)))):
            if on:
                raise ValueError(f"AttentionWeights.from_module: the layer was built with {name}=True, which adds a "
                                 f"key and value to every row that certification does not model, so a bound would be "
                                 f"for a different function. Build the layer with {name}=False")
        E, H = mha.embed_dim, mha.num_heads
        kdim, vdim = getattr(mha, "kdim", E), getattr(mha, "vdim", E)
        if (kdim, vdim) != (E, E):  # (it raised a bare shape error inside the certificate; a review, 2026-12-07)
            raise ValueError(f"AttentionWeights.from_module: the layer takes keys of {kdim} and values of {vdim} "
                             f"features beside queries of {E} (cross-attention); certification covers "
                             f"self-attention, one input x for queries, keys and values. Build it with "
                             f"kdim = vdim = embed_dim")
        if getattr(mha, "in_proj_weight", None) is not None:
            wq, wk, wv = mha.in_proj_weight.detach().double().split(E)
        else:
            wq, wk, wv = (getattr(mha, f"{n}_proj_weight").detach().double() for n in "qkv")
        zeros = torch.zeros(E, dtype=torch.float64)
        bq, bk, bv = (mha.in_proj_bias.detach().double().split(E) if mha.in_proj_bias is not None
                      else (zeros, zeros, zeros))
        bo = mha.out_proj.bias.detach().double() if mha.out_proj.bias is not None else zeros
        return AttentionWeights(wq, wk, wv, mha.out_proj.weight.detach().double(), bq, bk, bv, bo, H,
                                as_mask(getattr(mha, "mask", None)))


@dataclass(frozen=True)
class BlockWeights:
    """A Transformer encoder block: attention, a ReLU feed-forward, two LayerNorms.

    post-LN (the paper): ``y = LN1(x + attn(x)); out = LN2(y + ff(y))``;
    pre-LN (``norm_first``): ``y = x + attn(LN1(x)); out = y + ff(LN2(y))``.
    ln1, ln2: ``(weight, bias)`` of shape ``(E,)``; w1 ``(F, E)``, b1 ``(F,)``, w2 ``(E, F)``, b2 ``(E,)``.
    """

    attn: AttentionWeights
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    ln1: tuple[torch.Tensor, torch.Tensor]
    ln2: tuple[torch.Tensor, torch.Tensor]
    norm_first: bool = False
    eps: float = 1e-5
    #: the second LayerNorm's eps (None: ``eps``); a layer's two norms may differ, and taking norm1's for both
    #: put the layer's own outputs 0.26-0.37 outside its certified bounds (a review, 2026-12-08)
    eps2: float | None = None

    @property
    def eps_of_ln2(self) -> float:
        return self.eps if self.eps2 is None else self.eps2

    @staticmethod
    def random(E: int, heads: int, F: int, *, seed: int = 0, norm_first: bool = False) -> "BlockWeights":
        g = torch.Generator().manual_seed(seed + 1)
        ones, zeros = torch.ones(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64)
        return BlockWeights(AttentionWeights.random(E, heads, seed=seed),
                            torch.randn(F, E, generator=g, dtype=torch.float64) / math.sqrt(E),
                            torch.randn(F, generator=g, dtype=torch.float64) * 0.1,
                            torch.randn(E, F, generator=g, dtype=torch.float64) / math.sqrt(F),
                            torch.randn(E, generator=g, dtype=torch.float64) * 0.1,
                            (ones, zeros), (ones.clone(), zeros.clone()), norm_first)

    @staticmethod
    def from_module(layer) -> "BlockWeights":
        """From ``torch.nn.TransformerEncoderLayer`` (ReLU, batch_first), ``keyfold.nn``'s encoder
        layer (``ff`` = Linear, ReLU, Dropout, Linear) or its decoder layer built with
        ``cross_attention=False`` (a decoder-only block: ``norms`` holds its two LayerNorms).
        Dropout is ignored (eval mode). The layer's own keyfold ``mask`` is carried (ANDed with the
        caller's, e.g. the causal one a stream adds); a score modifier raises ``ValueError``."""
        if getattr(layer, "multihead_attn", "absent") is not None and hasattr(layer, "norm3"):
            raise ValueError("BlockWeights.from_module: a decoder layer with cross-attention is not one block "
                             "of self-attention + feed-forward; build it with cross_attention=False")
        if hasattr(layer, "linear1"):
            l1, l2 = layer.linear1, layer.linear2
            act = getattr(layer, "activation", None)
            if act is not None and act not in (torch.nn.functional.relu, torch.relu) and not isinstance(act, torch.nn.ReLU):
                raise ValueError("BlockWeights.from_module: only a ReLU feed-forward is certified; "
                                 "build the layer with activation='relu'")
        elif hasattr(layer, "ff"):
            l1, l2 = layer.ff[0], layer.ff[-1]
        else:
            raise TypeError(f"BlockWeights.from_module: expected an encoder layer with self_attn, norm1, norm2 and "
                            f"linear1/linear2 or ff, got {type(layer).__name__}")
        n1, n2 = (layer.norm1, layer.norm3) if hasattr(layer, "norm3") else (layer.norm1, layer.norm2)

        def vec(t, size, fill):  # a parameter, or the constant a layer built with bias=False (or without
            # elementwise_affine) applies in its place
            return t.detach().double() if t is not None else torch.full((size,), fill, dtype=torch.float64)

        def ln(n):
            E = n.normalized_shape[-1]
            return (vec(n.weight, E, 1.0), vec(n.bias, E, 0.0))
        return BlockWeights(AttentionWeights.from_module(layer.self_attn), l1.weight.detach().double(),
                            vec(l1.bias, l1.out_features, 0.0), l2.weight.detach().double(),
                            vec(l2.bias, l2.out_features, 0.0), ln(n1), ln(n2), bool(layer.norm_first), float(n1.eps),
                            float(n2.eps))


# ------------------------------------------------------------------ one forward, two domains


def _with_layer(layer_mask, mask):
    """The caller's mask AND the mask the layer itself carries (either may be None)."""
    mask = as_mask(mask)
    if layer_mask is None or mask is None:
        return mask if layer_mask is None else layer_mask
    return layer_mask & mask


def _visible(mask, N: int, H: int = 1) -> torch.Tensor:
    """Which keys each row sees: ``(N, N)``, or ``(H, N, N)`` for a mask that reads the head (each
    head certified under its own rows, as the layer runs them; head 0's for every head certified
    intervals that the layer's other heads left, 2026-12-06)"""
    mask = as_mask(mask)
    if mask is None:
        return torch.ones(N, N, dtype=torch.bool)
    dense = mask.to_dense(N, N, 0, 0, H=H)
    return dense[0] if dense.dim() == 4 else dense


def value_range(v_lo: torch.Tensor, v_hi: torch.Tensor, vis: torch.Tensor):
    """The free fact: attention output ``(H, N, dh)`` lies in the per-column range of the values
    its row sees: ``[min_{j visible} v_lo[j], max_{j visible} v_hi[j]]`` (rows seeing none: 0)."""
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    m = vis.unsqueeze(-1)                                                   # ([H,] N, N, 1)
    lo = torch.where(m, v_lo.unsqueeze(-3), inf).amin(-2)                   # (H, N, dh)
    hi = torch.where(m, v_hi.unsqueeze(-3), -inf).amax(-2)
    empty = ~vis.any(-1).unsqueeze(-1)                                      # ([H,] N, 1)
    return torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)


def _attention(x: Abstract, w: AttentionWeights, vis: torch.Tensor) -> Abstract:
    """Abstract multi-head self-attention of x ``(N, E)``."""
    N, E = x.shape
    H = w.heads
    dh = E // H

    def heads(t):                                                           # (N, E) -> (H, N, dh)
        return t.reshape(N, H, dh).transpose(-3, -2)

    q, k, v = heads(x.linear(w.wq, w.bq)), heads(x.linear(w.wk, w.bk)), heads(x.linear(w.wv, w.bv))
    s = q.matmul(k.transpose(-1, -2)).scale(1.0 / math.sqrt(dh))           # (H, N, N)
    p = _softmax(s, vis)
    o = p.matmul(v)                                                         # (H, N, dh)
    o = o.tighten(*value_range(*v.bounds(), vis))                           # the free fact
    o = o.transpose(-3, -2).reshape(N, E)                                   # (N, E)
    return o.linear(w.wo, w.bo)


def _layernorm(x: Abstract, weight, bias, eps: float) -> Abstract:
    E = x.shape[-1]
    centre = torch.eye(E, dtype=torch.float64) - 1.0 / E                   # x - mean(x): exact linear map
    xc = x.linear(centre)
    var = xc.apply(SQUARE).sum(-1).scale(1.0 / E).shift(eps)               # (N,), truly >= eps
    inv = var.apply(RSQRT, floor=eps * (1 - FN_SLACK)).unsqueeze(-1)        # (N, 1)
    z = xc.mul(inv)
    # free fact: |x_i - mean| <= sqrt(E - 1) * std, so each normalised coordinate is in +-sqrt(E - 1)
    lim = torch.full_like(z.c, math.sqrt(max(E - 1, 0)) * (1 + FN_SLACK))
    z = z.tighten(-lim, lim)
    return z.scale(weight.double()).shift(bias.double())


def _block(x: Abstract, w: BlockWeights, vis: torch.Tensor) -> Abstract:
    def ff(t):
        return t.linear(w.w1, w.b1).apply(RELU).linear(w.w2, w.b2)
    if w.norm_first:
        y = x + _attention(_layernorm(x, *w.ln1, w.eps), w.attn, vis)
        return y + ff(_layernorm(y, *w.ln2, w.eps_of_ln2))
    y = _layernorm(x + _attention(x, w.attn, vis), *w.ln1, w.eps)
    return _layernorm(y + ff(y), *w.ln2, w.eps_of_ln2)


# ------------------------------------------------------------------------------- public


@dataclass(frozen=True)
class Bounds:
    """Certified ``lo <= f(x) <= hi`` for every x in the input box. float64, shape of the output."""

    lo: torch.Tensor
    hi: torch.Tensor
    method: Method

    @property
    def width(self) -> torch.Tensor:
        return self.hi - self.lo

    def contains(self, y: torch.Tensor) -> bool:
        y = y.double()
        return bool(((self.lo <= y) & (y <= self.hi)).all())


def _input_box(x, eps, lo, hi):
    if lo is not None or hi is not None:
        if lo is None or hi is None or lo.shape != x.shape or hi.shape != x.shape:
            raise ValueError("certify: pass both lo and hi with x's shape (a box), or eps (an L-infinity ball)")
        if bool((lo > x).any()) or bool((hi < x).any()):
            raise ValueError("certify: the box [lo, hi] must contain x")
        return lo.double(), hi.double()
    if eps is None or not (isinstance(eps, (int, float)) and eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"certify: eps must be a finite number >= 0 (the L-infinity radius), got {eps!r}")
    return x.double() - eps, x.double() + eps


def _check_x(x, E):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != E:
        raise ValueError(f"certify: x must be (N, {E}) (one sequence, d_model = {E}), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("certify: x contains NaN or inf; a box around it would be unbounded")


def certify_attention(x: torch.Tensor, weights: AttentionWeights, *, eps: float | None = None,
                      lo: torch.Tensor | None = None, hi: torch.Tensor | None = None, mask=None,
                      method: Method = Method.LINEAR) -> Bounds:
    """Sound bounds on every output of multi-head self-attention for all inputs in a box.

    x: ``(N, E)`` float; the box is ``[x - eps, x + eps]`` or ``[lo, hi]``. mask: a keyfold mask
    (queries and keys at positions 0..N-1) or None. Returns :class:`Bounds` of shape ``(N, E)``.

    >>> w = AttentionWeights.random(8, 2)
    >>> x = torch.randn(4, 8, dtype=torch.float64)
    >>> b = certify_attention(x, w, eps=0.01)
    >>> b.contains(attention_forward(x + 0.01 * (2 * torch.rand(4, 8) - 1), w))
    True
    """
    _check_x(x, weights.wq.shape[1])
    box = Abstract.box(*_input_box(x, eps, lo, hi), method)
    y = _attention(box, weights, _visible(_with_layer(weights.mask, mask), x.shape[0], weights.heads))
    return _result(y, method)


def certify_block(x: torch.Tensor, weights: BlockWeights, *, eps: float | None = None,
                  lo: torch.Tensor | None = None, hi: torch.Tensor | None = None, mask=None,
                  method: Method = Method.LINEAR) -> Bounds:
    """Sound bounds on every output of a whole Transformer block (attention, feed-forward, two
    LayerNorms) for all inputs in a box. Arguments as :func:`certify_attention`."""
    _check_x(x, weights.attn.wq.shape[1])
    box = Abstract.box(*_input_box(x, eps, lo, hi), method)
    y = _block(box, weights, _visible(_with_layer(weights.attn.mask, mask), x.shape[0], weights.attn.heads))
    return _result(y, method)


def _result(y: Abstract, method: Method) -> Bounds:
    lo, hi = y.bounds()
    if bool(torch.isnan(lo).any()) or bool(torch.isnan(hi).any()):
        raise RuntimeError("certify: a bound came out NaN (an overflow the relaxations did not catch); "
                           "this is a bug in keyfold.apps.verify.certify, please report the layer and box")
    return Bounds(lo, hi, method)


# --------------------------------------------------------------- concrete forward (float64)


def attention_forward(x: torch.Tensor, w: AttentionWeights, mask=None) -> torch.Tensor:
    """The layer itself in float64 through :func:`keyfold.attention` (the reference backend).

    x: ``(N, E)`` or a batch ``(S, N, E)`` (e.g. samples of a box); returns the same shape.
    """
    from keyfold.engine import Backend, attention
    x = x.double()
    single = x.dim() == 2
    x = x.unsqueeze(0) if single else x                                     # (S, N, E)
    S, N, E = x.shape
    H, dh = w.heads, E // w.heads

    def heads(t):
        return t.view(S, N, H, dh).transpose(1, 2)                          # (S, H, N, dh)

    q = heads(x @ w.wq.t() + w.bq)
    k = heads(x @ w.wk.t() + w.bk)
    v = heads(x @ w.wv.t() + w.bv)
    o = attention(q, k, v, mask=_with_layer(w.mask, mask), q_offset=0, backend=Backend.REFERENCE)
    y = o.transpose(1, 2).reshape(S, N, E) @ w.wo.t() + w.bo                # (S, N, E)
    return y[0] if single else y


def block_forward(x: torch.Tensor, w: BlockWeights, mask=None) -> torch.Tensor:
    """The block itself in float64; x ``(N, E)`` or ``(S, N, E)``."""
    import torch.nn.functional as F

    def ln(t, p):
        return F.layer_norm(t, (t.shape[-1],), p[0], p[1], w.eps if p is w.ln1 else w.eps_of_ln2)

    def ff(t):
        return torch.relu(t @ w.w1.t() + w.b1) @ w.w2.t() + w.b2
    x = x.double()
    if w.norm_first:
        y = x + attention_forward(ln(x, w.ln1), w.attn, mask)
        return y + ff(ln(y, w.ln2))
    y = ln(x + attention_forward(x, w.attn, mask), w.ln1)
    return ln(y + ff(y), w.ln2)


def sample_box(lo: torch.Tensor, hi: torch.Tensor, n: int, *, generator=None) -> torch.Tensor:
    """``n`` points of the box: half uniform inside, half on random vertices (where extremes live)."""
    shape = (n,) + tuple(lo.shape)
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    corners = torch.randint(0, 2, shape, generator=generator).double()
    u[n // 2:] = corners[n // 2:]
    return lo.double() + u * (hi.double() - lo.double())
