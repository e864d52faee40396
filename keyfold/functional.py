"""``torch.nn.functional.scaled_dot_product_attention``'s signature on keyfold's engine.

Swap one import::

    from keyfold import scaled_dot_product_attention   # instead of torch.nn.functional's

Where it differs from SDPA (README, "SDPA drop-in"): a query row that sees no key gives 0 (SDPA
gives NaN on some backends); dropout draws its mask from keyfold's own counter-based hash (same
expectation and scaling, not the same random bits as torch's dropout).
"""

from __future__ import annotations

import math

import torch

from .dense import tensor_mask
from .engine import attention
from .masks import causal

__all__ = ["scaled_dot_product_attention"]


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, generator=None):
    """SDPA with SDPA's semantics, computed by :func:`keyfold.attention`.

    query ``(..., Hq, L, E)``, key ``(..., Hkv, S, E)``, value ``(..., Hkv, S, Ev)``: any leading batch
    dims that broadcast (at least the sequence and feature dims). ``Hq == Hkv`` unless
    ``enable_gqa=True`` (then ``Hq % Hkv == 0``). attn_mask: bool (True = attend) or float (added),
    broadcastable to ``(..., Hq, L, S)``; a float mask with ``requires_grad`` gets its gradient and
    float64 stays float64. is_causal: top-left causal (query i sees keys ``j <= i``, also when
    ``L != S``); with attn_mask as well, a pair must pass both. dropout_p: applied whenever > 0 (as SDPA does; pass
    ``dropout_p if self.training else 0.0``); ``generator`` seeds it. scale: default ``1/sqrt(E)``.

    Returns ``(..., Hq, L, Ev)`` in the query dtype. A row that sees no key gives 0, never NaN.

    >>> q = k = v = torch.randn(2, 4, 8, 16)
    >>> out = scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    True
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise ValueError(f"{name} must be a tensor of shape (..., seq, feature), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"query and key feature dims differ ({query.shape[-1]} vs {key.shape[-1]})")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key has {key.shape[-2]} positions but value has {value.shape[-2]}")
    L, S, E, Ev = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    nd = max(query.dim(), key.dim(), value.dim(), 3)
    q, k, v = (t.reshape((1,) * (nd - t.dim()) + tuple(t.shape)) for t in (query, key, value))
    Hq, Hkv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != Hkv:
        raise ValueError(f"key has {Hkv} heads but value has {v.shape[-3]}")
    if Hq != Hkv and not enable_gqa and 1 in (Hq, Hkv):  # heads broadcast like any batch dim (as in SDPA)
        if Hq == 1:
            q, Hq = q.expand(*q.shape[:-3], Hkv, L, E), Hkv
    if Hq != Hkv:
        if not enable_gqa and Hkv != 1:
            raise RuntimeError(f"query has {Hq} heads and key/value {Hkv}: pass enable_gqa=True for grouped-query "
                               f"attention (as in SDPA), or repeat the key/value heads")
        if Hkv == 0 or Hq % Hkv:
            raise RuntimeError(f"enable_gqa=True needs query heads ({Hq}) to be a multiple of key/value heads ({Hkv})")
    try:
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except RuntimeError as e:
        raise RuntimeError(f"the batch dims of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                           f"{tuple(value.shape)} do not broadcast: {e}") from None
    B = _prod(lead)
    q4 = q.expand(*lead, Hq, L, E).reshape(B, Hq, L, E)             # (B, Hq, L, E)
    k4 = k.expand(*lead, Hkv, S, E).reshape(B, Hkv, S, E)           # (B, Hkv, S, E)
    v4 = v.expand(*lead, Hkv, S, Ev).reshape(B, Hkv, S, Ev)         # (B, Hkv, S, Ev)
    mask = causal() if is_causal else None
    score = None
    if attn_mask is not None:
        m4 = _mask_4d(attn_mask, lead, Hq, L, S)
        if is_causal:  # both: a pair must pass both (torch's CPU SDPA accepts the pair too)
            m, score = tensor_mask(m4, B=B, H=Hq, Nq=L, Nk=S, name="attn_mask")
            mask = mask if m is None else mask & m
        else:
            mask = m4
    if scale is not None:
        scale = float(scale)
    out = attention(q4, k4, v4, mask=mask, score=score, scale=scale, q_offset=0, dropout_p=float(dropout_p),
                    generator=generator)
    out = out.reshape(*lead, Hq, L, Ev)                             # (..., Hq, L, Ev)
    return out if max(query.dim(), key.dim(), value.dim()) >= 3 else out.reshape(L, Ev)


def _mask_4d(m: torch.Tensor, lead, H: int, L: int, S: int) -> torch.Tensor:
    """An SDPA mask broadcastable to ``(*lead, H, L, S)`` as ``(B|1, H|1, L|1, S|1)``, expanding
    (copying) only the batch dims the mask actually varies over."""
    if not isinstance(m, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor, got {type(m).__name__}")
    full = tuple(lead) + (H, L, S)
    if m.dim() > len(full):
        raise RuntimeError(f"attn_mask of shape {tuple(m.shape)} has more dims than the attention (..., H, L, S) = {full}")
    m = m.reshape((1,) * (len(full) - m.dim()) + tuple(m.shape))
    try:
        torch.broadcast_shapes(m.shape, full)
    except RuntimeError:
        raise RuntimeError(f"attn_mask of shape {tuple(m.shape)} does not broadcast to (..., H, L, S) = {full}") from None
    if all(s == 1 for s in m.shape[:-3]):
        return m.reshape(1, *m.shape[-3:])
    return m.expand(*lead, *m.shape[-3:]).reshape(_prod(lead), *m.shape[-3:])
