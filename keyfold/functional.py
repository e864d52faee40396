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
from .engine import attention, autocast_dtype, autocast_inputs
from .masks import causal

__all__ = ["scaled_dot_product_attention", "SDPAInputError"]


class SDPAInputError(RuntimeError, ValueError, TypeError):
    """Bad arguments to :func:`scaled_dot_product_attention`. A ``RuntimeError`` as SDPA raises (so
    code written against torch's SDPA catches it), and a ``ValueError``/``TypeError`` as keyfold's
    own argument checks raise elsewhere."""


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
    float64 stays float64; or torch's ``causal_upper_left(L, S)`` / ``causal_lower_right(L, S)``
    (``torch.nn.attention.bias``), run as keyfold's ``causal()`` (lower right: query i sees keys
    ``j <= i + S - L``). is_causal: top-left causal (query i sees keys ``j <= i``, also when
    ``L != S``); with attn_mask as well, a pair must pass both. dropout_p: applied whenever > 0 (as SDPA does; pass
    ``dropout_p if self.training else 0.0``); ``generator`` seeds it. scale: default ``1/sqrt(E)``.

    Returns ``(..., Hq, L, Ev)`` in the query dtype. A row that sees no key gives 0, never NaN.
    Bad arguments raise :class:`SDPAInputError`, a ``RuntimeError`` like SDPA's (and a ``ValueError``).

    >>> q = k = v = torch.randn(2, 4, 8, 16)
    >>> out = scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
    True
    """
    try:  # any real number SDPA takes (a numpy scalar, a 0-d tensor), not a bool
        p = None if isinstance(dropout_p, bool) else float(dropout_p)
    except (TypeError, ValueError, RuntimeError):
        p = None
    if p is None or not 0.0 <= p < 1.0:
        raise SDPAInputError(f"dropout_p must be a number in [0, 1), got {dropout_p!r} (torch's SDPA gives zeros "
                             f"at 1.0; keyfold refuses it)")
    dropout_p = p
    # under torch.autocast, cast as SDPA's inputs are (float32 q and k after RoPE beside a bfloat16 v
    # had been refused as two dtypes)
    query, key, value = autocast_inputs(autocast_dtype(query), query, key, value)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise SDPAInputError(f"{name} must be a tensor of shape (..., seq, feature) with at least 2 dims, got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
    if not query.dtype == key.dtype == value.dtype:
        raise SDPAInputError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype} and "
                             f"{value.dtype}; cast them first (as SDPA requires)")
    if key.shape[-1] != query.shape[-1]:
        raise SDPAInputError(f"query and key feature dims differ ({query.shape[-1]} vs {key.shape[-1]})")
    if key.shape[-2] != value.shape[-2]:
        raise SDPAInputError(f"key has {key.shape[-2]} positions but value has {value.shape[-2]}")
    q_offset = 0  # SDPA's is_causal is top-left: query i sees keys j <= i
    if _is_causal_bias(attn_mask):  # torch.nn.attention.bias.causal_upper_left / causal_lower_right
        attn_mask, is_causal, q_offset = _causal_bias(attn_mask, is_causal, query.shape[-2], key.shape[-2])
    L, S, E, Ev = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    nd = max(query.dim(), key.dim(), value.dim(), 3)
    q, k, v = (t.reshape((1,) * (nd - t.dim()) + tuple(t.shape)) for t in (query, key, value))
    Hq, Hkv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != Hkv and 1 in (Hkv, v.shape[-3]):  # one of them 1: heads broadcast (as in SDPA)
        Hkv = max(Hkv, v.shape[-3])
        k, v = k.expand(*k.shape[:-3], Hkv, *k.shape[-2:]), v.expand(*v.shape[:-3], Hkv, *v.shape[-2:])
    if v.shape[-3] != Hkv:
        raise SDPAInputError(f"key has {Hkv} heads but value has {v.shape[-3]}")
    if Hq != Hkv and not enable_gqa and 1 in (Hq, Hkv):  # heads broadcast like any batch dim (as in SDPA)
        if Hq == 1:
            q, Hq = q.expand(*q.shape[:-3], Hkv, L, E), Hkv
    if Hq != Hkv:
        if not enable_gqa and Hkv != 1:
            raise SDPAInputError(f"query has {Hq} heads and key/value {Hkv}: pass enable_gqa=True for grouped-query "
                               f"attention (as in SDPA), or repeat the key/value heads")
        if Hkv == 0 or Hq % Hkv:
            raise SDPAInputError(f"enable_gqa=True needs query heads ({Hq}) to be a multiple of key/value heads ({Hkv})")
    try:
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except RuntimeError as e:
        raise SDPAInputError(f"the batch dims of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
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
            m, score = tensor_mask(m4, B=B, H=Hq, Nq=L, Nk=S, q_offset=q_offset, name="attn_mask")
            mask = mask if m is None else mask & m
        else:
            mask = m4
    if scale is not None:
        scale = float(scale)
    if E == 0:  # no features: every score is 0 (SDPA gives the average of the visible values); one zero feature
        q4, k4 = q4.new_zeros(B, Hq, L, 1) + q4.sum() * 0, k4.new_zeros(B, Hkv, S, 1) + k4.sum() * 0
        scale = 1.0
    if Ev == 0:  # no value features: an empty output (as SDPA gives), in the graph of the inputs
        out = v4.new_zeros(B, Hq, L, 0) + (q4.sum() + k4.sum() + v4.sum()) * 0
    else:
        out = attention(q4, k4, v4, mask=mask, score=score, scale=scale, q_offset=q_offset,
                        dropout_p=float(dropout_p), generator=generator)
    out = out.reshape(*lead, Hq, L, Ev)                             # (..., Hq, L, Ev)
    return out if max(query.dim(), key.dim(), value.dim()) >= 3 else out.reshape(L, Ev)


def _is_causal_bias(m) -> bool:
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # pragma: no cover - torch without the bias module
        return False
    return isinstance(m, CausalBias)


def _causal_bias(bias, is_causal: bool, L: int, S: int):
    """torch's ``CausalBias`` as keyfold's ``causal()``: ``(attn_mask=None, is_causal=True, q_offset)``.

    Its storage holds no mask (it is a tensor subclass that SDPA dispatches on), so it must never be
    read as one. UPPER_LEFT (or a square bias) is SDPA's ``is_causal`` (query i sees keys ``j <= i``);
    LOWER_RIGHT aligns the last query with the last key (``q_offset = S - L``): query i sees keys
    ``j <= i + S - L``. torch's own rules: ``is_causal=True`` with a CausalBias raises ValueError.
    """
    from torch.nn.attention.bias import CausalVariant
    if is_causal:
        raise ValueError("CausalBias should not be used with causal=True: pass the bias alone (as in SDPA)")
    if (bias.seq_len_q, bias.seq_len_kv) != (L, S) and bias.variant == CausalVariant.LOWER_RIGHT:
        raise SDPAInputError(f"attn_mask is a lower-right CausalBias for ({bias.seq_len_q}, {bias.seq_len_kv}) "
                             f"query/key positions but the call has ({L}, {S}); build it with causal_lower_right({L}, {S})")
    if bias.variant == CausalVariant.UPPER_LEFT or L == S:
        return None, True, 0
    if bias.variant == CausalVariant.LOWER_RIGHT:
        return None, True, S - L
    raise ValueError(f"unknown CausalBias variant {bias.variant!r}")  # torch raises ValueError too


def _mask_4d(m: torch.Tensor, lead, H: int, L: int, S: int) -> torch.Tensor:
    """An SDPA mask broadcastable to ``(*lead, H, L, S)`` as ``(B|1, H|1, L|1, S|1)``, expanding
    (copying) only the batch dims the mask actually varies over."""
    if not isinstance(m, torch.Tensor):
        raise SDPAInputError(f"attn_mask must be a tensor, got {type(m).__name__}")
    if m.dtype is not torch.bool and not m.is_floating_point():  # (torch's SDPA raises a RuntimeError too)
        raise SDPAInputError(f"attn_mask must be bool (True = attend) or float (added to the scores), got {m.dtype}; "
                             f"convert it with `attn_mask.bool()` or `attn_mask.float()`")
    full = tuple(lead) + (H, L, S)
    if m.dim() > len(full):
        raise SDPAInputError(f"attn_mask of shape {tuple(m.shape)} has more dims than the attention (..., H, L, S) = {full}")
    m = m.reshape((1,) * (len(full) - m.dim()) + tuple(m.shape))
    try:
        torch.broadcast_shapes(m.shape, full)
    except RuntimeError:
        raise SDPAInputError(f"attn_mask of shape {tuple(m.shape)} does not broadcast to (..., H, L, S) = {full}") from None
    if all(s == 1 for s in m.shape[:-3]):
        return m.reshape(1, *m.shape[-3:])
    return m.expand(*lead, *m.shape[-3:]).reshape(_prod(lead), *m.shape[-3:])
