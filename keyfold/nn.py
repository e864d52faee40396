"""``torch.nn`` layers on keyfold's attention: MultiheadAttention and the Transformer layers.

:class:`MultiheadAttention` is a drop-in for ``torch.nn.MultiheadAttention`` (batch-first, the same
parameter names, so ``load_state_dict`` moves weights either way) whose core is
:func:`keyfold.attention`. Masks and score modifiers are settings (``mask=``, ``score=``); torch's
``attn_mask`` / ``key_padding_mask`` keep torch's meaning (True = masked out) and are turned into
keyfold masks without building an ``L x S`` tensor (a key padding mask becomes ``sinks(lengths)``,
a per-row key count, when the padding is at the end, else ``documents`` ids of length S).

Incremental decoding keeps keys and values in an :class:`AttentionCache` per layer: a
:class:`keyfold.caches.KVCache` for self-attention (or the encoder's keys for cross-attention),
so one new token costs one :func:`keyfold.caches.decode` step over the cache, the query at its
absolute position.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .caches import KVCache, decode
from .engine import attention
from .masks import Mask, _TensorKey, as_mask, block_sparse, causal, documents, sinks
from .scores import ScoreMod, as_score

__all__ = ["MultiheadAttention", "AttentionCache", "TransformerEncoderLayer", "TransformerDecoderLayer",
           "key_padding_to_mask", "combine_masks"]


# ------------------------------------------------------------------ torch mask conversion


def key_padding_to_mask(key_padding_mask: torch.Tensor, n_queries: int = 0) -> Mask:
    """torch's ``key_padding_mask`` ``(B, S)`` bool, True = padding, as a keyfold mask (True = visible).

    Padding at the end of every row (the usual right padding) becomes ``sinks(lengths)`` with a
    ``(B,)`` length vector: classified in closed form and hashed by content, so equal batches reuse
    one plan. Any other pattern becomes ``documents`` ids: key ids 0 (real) / 1 (pad), query ids 0;
    ``n_queries`` is the number of query positions the ids must cover (absolute positions).

    >>> m = key_padding_to_mask(torch.tensor([[False, False, True]]))
    >>> m.to_dense(1, 3, q_offset=0, B=1).view(-1).tolist()
    [True, True, False]
    """
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be a (batch, source_len) bool tensor, True = padding; "
                         f"got {getattr(key_padding_mask, 'shape', type(key_padding_mask).__name__)}")
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}; "
                        f"an additive float padding mask is not supported: pass `mask != 0`")
    kpm = key_padding_mask.detach()
    B, S = kpm.shape
    lengths = (~kpm).sum(1)  # (B,)
    suffix = torch.arange(S, device=kpm.device).unsqueeze(0) >= lengths.unsqueeze(1)  # (B, S)
    if torch.equal(suffix, kpm):
        return sinks(lengths.cpu())
    q_ids = torch.zeros(B, max(n_queries, S), dtype=torch.long)
    return documents(q_ids, kpm.long().cpu())


class _DenseBias(ScoreMod):
    """torch's float ``attn_mask`` ``(L, S)``: an additive bias indexed by (query, key) position."""

    additive = True

    def __init__(self, bias: torch.Tensor):
        self.table = _TensorKey(bias.float())

    def bias(self, b, h, qp, kp):
        t = self.table.on(qp.device)
        return t[qp.reshape(-1)][:, kp.reshape(-1)].view(1, 1, qp.numel(), kp.numel())  # (1, 1, L, S)

    def apply(self, s, b, h, qp, kp):
        return s + self.bias(b, h, qp, kp)

    def __repr__(self):
        return f"dense_bias(<{'x'.join(map(str, self.table.t.shape))}>)"

    def __eq__(self, other):
        return type(other) is _DenseBias and self.table == other.table

    def __hash__(self):
        return hash(("dense_bias", self.table))


def _attn_mask_to_keyfold(attn_mask: torch.Tensor, L: int, S: int):
    """torch's 2-D ``attn_mask`` as (keyfold mask, score modifier): bool True = masked out, float = added."""
    if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (L, S):
        raise ValueError(f"attn_mask must have shape (L, S) = ({L}, {S}), got {tuple(attn_mask.shape)}; "
                         f"per-(batch*head) 3-D masks are not supported: express them as a keyfold mask "
                         f"(mask=...) or key_padding_mask")
    if attn_mask.dtype == torch.bool:
        return block_sparse(~attn_mask.detach().cpu(), 1), None
    if not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be bool (True = masked out) or float (added to the scores), "
                        f"got {attn_mask.dtype}")
    return None, _DenseBias(attn_mask.detach())


def combine_masks(*masks) -> Mask | None:
    """``&`` of the masks that are not None (None if all are)."""
    out = None
    for m in masks:
        m = as_mask(m)
        if m is not None:
            out = m if out is None else out & m
    return out


# ------------------------------------------------------------------------------ the cache


class AttentionCache:
    """Keys and values of one attention layer for incremental decoding.

    A self-attention cache keeps the projected keys and values in a
    :class:`keyfold.caches.KVCache` (preallocated, appended in place, rows reordered in place for
    beam search) and each new token is one :func:`keyfold.caches.decode` over it. It is created
    at the first step with room for ``capacity`` tokens and doubles when full. A ``static``
    cache (cross-attention) holds the encoder's projected keys and values, filled once.

    ``k``, ``v``: views ``(B, H, S, head_dim)`` of what is held, or None before the first step.
    """

    def __init__(self, static: bool = False, capacity: int = 128):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"AttentionCache(capacity=...): a positive int of tokens, got {capacity!r}")
        self.static, self.capacity = static, capacity
        self.kv: KVCache | None = None          # self-attention: the memory wall's cache
        self._static: tuple | None = None       # cross-attention: (k, v) of the encoder output

    @property
    def k(self) -> torch.Tensor | None:
        held = self._held()
        return None if held is None else held[0]

    @property
    def v(self) -> torch.Tensor | None:
        held = self._held()
        return None if held is None else held[1]

    @property
    def length(self) -> int:
        held = self._held()
        return 0 if held is None else held[0].shape[2]

    def _held(self):
        if self.static:
            return self._static
        return None if self.kv is None else self.kv.whole()[:2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens' keys/values ``(B, H, n, head_dim)``; returns views of all held."""
        if self.static:
            self._static = (k, v)
            return k, v
        B, H, n, D = k.shape
        if self.kv is None or self.kv.batch != B:
            self.kv = KVCache(B, H, D, max(self.capacity, n), dtype=k.dtype, value_dim=v.shape[-1],
                              device=k.device)
        elif self.kv.lengths[0] + n > self.kv.capacity:  # double: amortised O(1) per token
            old, L = self.kv, self.kv.lengths[0]
            self.kv = KVCache(B, H, D, max(2 * old.capacity, L + n), dtype=old.dtype, value_dim=old.value_dim,
                              device=k.device)
            self.kv.append(old.k[:, :, :L], old.v[:, :, :L])
        self.kv.append(k, v)
        return self._held()

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` takes what row ``index[i]`` held (beam search)."""
        if self.static:
            if self._static is not None:
                self._static = tuple(t.index_select(0, index) for t in self._static)
        elif self.kv is not None:
            self.kv.reorder(index)


# --------------------------------------------------------------------- MultiheadAttention


class MultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` on :func:`keyfold.attention`, batch-first.

    embed_dim, num_heads, bias, kdim, vdim: as in torch (same parameter names: ``in_proj_weight``
    or ``q/k/v_proj_weight``, ``in_proj_bias``, ``out_proj``). dropout must be 0: the fused kernel
    has no dropout on attention weights (the paper's dropout is on sub-layer outputs, which the
    layers below apply). mask / score: a keyfold mask and score modifier applied on every call.

    forward(query ``(B, L, E)``, key ``(B, S, kdim)``, value ``(B, S, vdim)``) returns
    ``(out (B, L, E), None)``: attention weights are never materialised. Queries sit at
    absolute positions ``offset + i`` (``offset`` = cached length when decoding, else 0, torch's
    top-left alignment); keys at ``0 .. S-1``. A query row that sees no key gives 0, not NaN.

    >>> mha = MultiheadAttention(16, 4)
    >>> x = torch.randn(2, 5, 16)
    >>> mha(x, x, x, is_causal=True)[0].shape
    torch.Size([2, 5, 16])
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 kdim: int | None = None, vdim: int | None = None, batch_first: bool = True, *,
                 mask=None, score=None, device=None, dtype=None):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        if dropout != 0.0:
            raise ValueError(f"dropout={dropout}: keyfold's fused attention has no dropout on attention "
                             f"weights; pass dropout=0.0 and apply dropout to the layer output instead")
        if not batch_first:
            raise ValueError("batch_first=False is not supported: pass (batch, seq, feature) tensors "
                             "and batch_first=True")
        fk = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.batch_first = True
        self.dropout = 0.0
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **fk))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **fk))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **fk))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **fk))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **fk)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        self.mask = as_mask(mask)
        self.score = as_score(score)
        self._reset_parameters()

    def _reset_parameters(self):
        # torch's initialisation, so both modules start alike
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def _project(self, x, which: int):
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight[which * E:(which + 1) * E]
        else:
            w = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)[which]
        b = None if self.in_proj_bias is None else self.in_proj_bias[which * E:(which + 1) * E]
        y = F.linear(x, w, b)  # (B, N, E)
        B, N, _ = y.shape
        return y.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, hd)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = False, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False, *, mask=None,
                cache: AttentionCache | None = None):
        """See the class docstring. ``mask``: an extra keyfold mask for this call (True = visible),
        ANDed with the module's ``mask``. ``cache``: decode incrementally (self-attention appends
        the new keys; a static cache projects ``key``/``value`` once and then ignores them)."""
        if need_weights:
            raise ValueError("need_weights=True: keyfold never materialises the L x S attention weights; "
                             "pass need_weights=False (the second return value is None)")
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be (batch, L, {self.embed_dim}) (batch_first), got {tuple(query.shape)}")
        L = query.shape[1]
        q = self._project(query, 0)
        offset = 0
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            k, v = self._project(key, 1), self._project(value, 2)
            if cache is not None:
                offset = 0 if cache.static else cache.length
                k, v = cache.append(k, v)
        S = k.shape[2]
        score = self.score
        masks = [self.mask, mask]
        if is_causal:
            masks.append(causal())
        if attn_mask is not None:
            if cache is not None and offset:
                raise ValueError("attn_mask with a filled cache: pass a keyfold mask (mask=...) instead, "
                                 "it sees absolute positions")
            am, bias = _attn_mask_to_keyfold(attn_mask, L, S)
            masks.append(am)
            if bias is not None:
                score = [score, bias] if score is not None else bias
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (query.shape[0], S):
                raise ValueError(f"key_padding_mask must be (batch, S) = ({query.shape[0]}, {S}), "
                                 f"got {tuple(key_padding_mask.shape)}")
            masks.append(key_padding_to_mask(key_padding_mask, offset + L))
        if cache is not None and not cache.static:  # one decode step over the KV cache
            out = decode(q, cache.kv, mask=combine_masks(*masks), score=score)  # (B, H, L, hd)
        else:
            out = attention(q, k, v, mask=combine_masks(*masks), score=score, q_offset=offset)
        out = out.transpose(1, 2).reshape(query.shape[0], L, self.embed_dim)  # (B, L, E)
        return self.out_proj(out), None

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, mask={self.mask!r}, "
                f"score={self.score!r}")


# ----------------------------------------------------------------------------- the layers


class _FeedForward(nn.Sequential):
    def __init__(self, d_model, d_ff, dropout):
        super().__init__(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))


class TransformerEncoderLayer(nn.Module):
    """Self-attention + feed-forward, each ``x + dropout(sublayer(x))`` with post-LN (the paper)
    or pre-LN (``norm_first=True``). Arguments follow ``torch.nn.TransformerEncoderLayer``.

    forward(src ``(B, N, d_model)``, src_mask=keyfold mask or None, src_key_padding_mask ``(B, N)``
    bool True = padding) -> ``(B, N, d_model)``.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 norm_first: bool = False, *, mask=None, score=None):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, mask=mask, score=score)
        self.ff = _FeedForward(d_model, dim_feedforward, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)
        self.norm_first = norm_first

    def _sa(self, x, mask):
        return self.drop1(self.self_attn(x, x, x, mask=mask)[0])

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        mask = combine_masks(src_mask, None if src_key_padding_mask is None
                             else key_padding_to_mask(src_key_padding_mask, src.shape[1]))
        x = src
        if self.norm_first:
            x = x + self._sa(self.norm1(x), mask)
            return x + self.drop2(self.ff(self.norm2(x)))
        x = self.norm1(x + self._sa(x, mask))
        return self.norm2(x + self.drop2(self.ff(x)))


class TransformerDecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over ``memory``, feed-forward; post- or pre-LN.

    forward(tgt ``(B, T, d)``, memory ``(B, S, d)`` or None (decoder-only), tgt_mask (keyfold mask,
    default ``causal()``), memory_mask (keyfold mask over memory keys, e.g. from
    :func:`key_padding_to_mask`), caches ``(self, cross)`` for incremental decoding).
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 norm_first: bool = False, *, cross_attention: bool = True, mask=None, score=None):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, mask=mask, score=score)
        self.cross_attn = MultiheadAttention(d_model, nhead) if cross_attention else None
        self.ff = _FeedForward(d_model, dim_feedforward, dropout)
        n = 3 if cross_attention else 2
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n))
        self.drops = nn.ModuleList(nn.Dropout(dropout) for _ in range(n))
        self.norm_first = norm_first

    def _sublayers(self, memory, tgt_mask, memory_mask, caches):
        self_cache, cross_cache = caches if caches is not None else (None, None)
        yield lambda x: self.self_attn(x, x, x, mask=tgt_mask, cache=self_cache)[0]
        if self.cross_attn is not None:
            yield lambda x: self.cross_attn(x, memory, memory, mask=memory_mask, cache=cross_cache)[0]
        yield self.ff

    def forward(self, tgt, memory=None, tgt_mask=causal(), memory_mask=None, caches=None):
        x = tgt
        for f, norm, drop in zip(self._sublayers(memory, tgt_mask, memory_mask, caches), self.norms, self.drops):
            x = x + drop(f(norm(x))) if self.norm_first else norm(x + drop(f(x)))
        return x


def sinusoidal_positions(n: int, d_model: int) -> torch.Tensor:
    """The paper's positional encoding ``(n, d_model)`` float32: sin on even, cos on odd features."""
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)  # (n, 1)
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(n, d_model)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: d_model // 2])
    return pe
