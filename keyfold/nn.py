"""``torch.nn`` layers on keyfold's attention: MultiheadAttention, the Transformer layers and stacks.

Drop-ins for ``torch.nn.MultiheadAttention``, ``TransformerEncoderLayer``, ``TransformerDecoderLayer``,
``TransformerEncoder`` and ``TransformerDecoder``: torch's signatures, defaults (``batch_first=False``,
``need_weights=True``), parameter names and state_dict keys, so ``load_state_dict`` moves weights either
way. torch's ``attn_mask`` / ``key_padding_mask`` keep torch's meaning (bool True = not allowed, float
added); keyfold masks and score modifiers (True = visible) are keyword-only (``mask=``, ``score=``).

Incremental decoding keeps keys and values in an :class:`AttentionCache` per layer: a
:class:`keyfold.caches.KVCache` for self-attention (or the encoder's keys for cross-attention),
so one new token costs one :func:`keyfold.caches.decode` step over the cache, the query at its
absolute position.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.nn import functional as F

from .caches import KVCache, decode
from .dense import tensor_mask
from .engine import attention
from .kernels._common import dropout_keep, row_divisor
from .masks import Mask, as_mask, causal, grid_positions, padding, sinks
from .scores import as_score

__all__ = ["MultiheadAttention", "AttentionCache", "TransformerEncoderLayer", "TransformerDecoderLayer",
           "TransformerEncoder", "TransformerDecoder",
           "key_padding_to_mask", "combine_masks"]


# ------------------------------------------------------------------ torch mask conversion


def key_padding_to_mask(key_padding_mask: torch.Tensor, n_queries: int = 0) -> Mask:
    """torch's ``key_padding_mask`` ``(B, S)`` bool, True = padding, as a keyfold mask (True = visible).

    Padding at the end of every row (the usual right padding) becomes ``sinks(lengths)`` with a
    ``(B,)`` length vector: classified in closed form and hashed by content, so equal batches reuse
    one plan. Any other pattern becomes ``padding(keys=~key_padding_mask)``, for any number of queries
    (``n_queries`` is kept for callers that pass it and no longer needed).

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
    # (any query position: documents ids covered max(n_queries, S) query positions, and a call with more
    # queries raised about documents(ids); a review, 2026-12-08)
    return padding(keys=~kpm.cpu())


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
        if self.kv is not None and self.kv.batch != B:
            # it used to start a new, empty cache here: the history was dropped without a word and the
            # step attended to itself alone (off by 0.46 in a review, 2026-12-07)
            raise ValueError(f"AttentionCache.append: the cache holds {self.kv.batch} rows but this step has {B}; "
                             f"keep the rows still decoding with reorder(index) (index may be shorter: finished "
                             f"requests dropped) or start over with reset()")
        if self.kv is None:
            self.kv = KVCache(B, H, D, max(self.capacity, n), dtype=k.dtype, value_dim=v.shape[-1],
                              device=k.device)
        elif self.kv.lengths[0] + n > self.kv.capacity:  # double: amortised O(1) per token
            self._copy(slice(None), max(2 * self.kv.capacity, self.kv.lengths[0] + n))
        self.kv.append(k, v)
        return self._held()

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` takes what row ``index[i]`` held (beam search); an ``index`` of another length
        makes a batch of that many rows (finished requests dropped, or rows repeated)."""
        if self.static:
            if self._static is not None:
                self._static = tuple(t.index_select(0, index) for t in self._static)
        elif self.kv is not None:
            index = torch.as_tensor(index, dtype=torch.long)
            if index.dim() != 1 or index.numel() < 1:
                raise ValueError(f"AttentionCache.reorder(index): a 1-d tensor of row numbers, got shape "
                                 f"{tuple(index.shape)}")
            if index.numel() == self.kv.batch:
                self.kv.reorder(index)
                return
            if int(index.min()) < 0 or int(index.max()) >= self.kv.batch:
                raise ValueError(f"AttentionCache.reorder(index): rows {index.tolist()} of a cache of "
                                 f"{self.kv.batch}")
            self._copy(index.to(self.kv.k.device), self.kv.capacity)

    def _copy(self, rows, capacity: int) -> None:
        """A new cache of ``capacity`` tokens holding ``rows`` (an index or a slice) of what is held."""
        old, L = self.kv, self.kv.lengths[0]
        B = old.batch if isinstance(rows, slice) else rows.numel()
        self.kv = KVCache(B, old.heads, old.head_dim, capacity, dtype=old.dtype, value_dim=old.value_dim,
                          device=old.k.device)
        if L:
            self.kv.append(old.k[rows, :, :L], old.v[rows, :, :L])

    def reset(self) -> None:
        """Forget what is held: the next step starts a new cache (any batch)."""
        self.kv, self._static = None, None


# --------------------------------------------------------------------- MultiheadAttention


def _check_mask_dtype(m, name):
    if m is not None and (not isinstance(m, torch.Tensor) or (m.dtype != torch.bool and not m.dtype.is_floating_point)):
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"{name} must be a tensor with torch's meaning (bool True = not allowed, float = added); "
                            f"a keyfold mask object goes in the keyword-only mask= (True = visible)")
        raise AssertionError(f"only bool and floating types of {name} are supported")  # torch's check


def _pad_key(m, n=1):
    """One more key column that every query may see (bool False = allowed, float 0 = added)."""
    return None if m is None else F.pad(m, (0, n))


def _torch_mask_parts(m, B, H, L, S, offset, name):
    """torch's mask (bool True = not allowed, float added) broadcastable to (B, H, L, S) -> (mask, score)."""
    if m is None:
        return None, None
    if m.dtype == torch.bool:
        m = ~m
    return tensor_mask(m, B=B, H=H, Nq=L, Nk=S, q_offset=offset, kv_offset=0, name=name)


class MultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` on :func:`keyfold.attention`: torch's signature, defaults
    (``batch_first=False``, ``need_weights=True``), parameter names and state_dict keys
    (``in_proj_weight`` or ``q/k/v_proj_weight``, ``in_proj_bias``, ``out_proj``, ``bias_k``, ``bias_v``),
    so ``load_state_dict`` moves weights either way and outputs match torch's.

    forward(query ``(L, B, E)`` / ``(B, L, E)`` with batch_first / ``(L, E)`` unbatched, key, value
    ``(S, B, kdim|vdim)`` ...) returns ``(out, weights)``. Masks keep torch's meaning: ``attn_mask``
    ``(L, S)`` or ``(B*H, L, S)``, bool True = not allowed or float added; ``key_padding_mask`` ``(B, S)``
    bool True = padding or float added. A float mask with ``requires_grad`` gets its gradient; float64
    stays float64. ``need_weights=True`` returns the head-averaged weights ``(B, L, S)`` (per head
    ``(B, H, L, S)`` with ``average_attn_weights=False``), computed from the kernel's lse in row chunks
    (``exp(s - lse)``): the ``L x S`` result is the only full-size buffer, and it costs a second pass
    over the scores; pass ``need_weights=False`` when you do not read them. Dropout drops attention
    probabilities in training (SDPA's semantics, keyfold's own random bits).

    Keyword-only keyfold options: ``mask=`` / ``score=`` (a keyfold mask, True = visible, and score
    modifier, on the module and per call) and ``cache=`` (:class:`AttentionCache`, incremental decoding:
    queries at absolute positions ``cache.length + i``). A query row that sees no key gives 0, not NaN.

    >>> mha = MultiheadAttention(16, 4)
    >>> x = torch.randn(5, 2, 16)                                 # (L, B, E)
    >>> out, w = mha(x, x, x)
    >>> out.shape, w.shape
    (torch.Size([5, 2, 16]), torch.Size([2, 5, 5]))
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None, *,
                 mask=None, score=None):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and "
                             f"num_heads={num_heads} instead")
        if embed_dim % num_heads:
            raise AssertionError("embed_dim must be divisible by num_heads")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        fk = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **fk))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **fk))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **fk))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **fk))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **fk))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **fk))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **fk))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
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
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _project(self, x, which: int):
        """(B, N, in) -> (B, N, E)."""
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight[which * E:(which + 1) * E]
        else:
            w = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)[which]
        b = None if self.in_proj_bias is None else self.in_proj_bias[which * E:(which + 1) * E]
        if b is not None and b.dtype != x.dtype:  # torch accepts a bias of another dtype (cast to the query's)
            b = b.to(x.dtype)
        return F.linear(x, w, b)

    def _heads(self, y):
        B, N, _ = y.shape
        return y.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, hd)

    def forward(self, query, key, value, key_padding_mask=None, need_weights: bool = True, attn_mask=None,
                average_attn_weights: bool = True, is_causal: bool = False, *, mask=None,
                cache: AttentionCache | None = None):
        """See the class docstring."""
        if any(isinstance(t, torch.Tensor) and t.is_nested for t in (query, key, value)):
            raise AssertionError("keyfold.nn.MultiheadAttention does not take NestedTensor inputs (torch's does only "
                                 "on its inference fast path): pad them to one length and pass key_padding_mask")
        _check_mask_dtype(key_padding_mask, "key_padding_mask")
        _check_mask_dtype(attn_mask, "attn_mask")
        batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                               "module method `generate_square_subsequent_mask` to create this mask.")
        if query.shape[-1] != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {query.shape[-1]}")
        if self._qkv_same_embed_dim and key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)  # (1, N, E)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)  # (B, N, E)
        B, L, _ = query.shape
        H = self.num_heads
        trust_hint = is_causal and key_padding_mask is None and not need_weights
        if trust_hint:  # torch drops attn_mask here, unchecked, and runs SDPA's top-left is_causal
            attn_mask = None
        if attn_mask is not None:  # torch's checks, before bias_k / zero_attn add a key
            want = (L, key.shape[1]) if attn_mask.dim() == 2 else (B * H, L, key.shape[1])
            if tuple(attn_mask.shape) != want:
                raise RuntimeError(f"The shape of the {attn_mask.dim()}D attn_mask is {tuple(attn_mask.shape)}, "
                                   f"but should be {want}.")
        q = self._heads(self._project(query, 0))                         # (B, H, L, hd)
        offset = 0
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            kp, vp = self._project(key, 1), self._project(value, 2)       # (B, S, E)
            if self.bias_k is not None:
                kp = torch.cat([kp, self.bias_k.expand(B, 1, -1)], 1)
                vp = torch.cat([vp, self.bias_v.expand(B, 1, -1)], 1)
                attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
            k, v = self._heads(kp), self._heads(vp)                       # (B, H, S, hd)
            if self.add_zero_attn:
                k = torch.cat([k, k.new_zeros(B, H, 1, self.head_dim)], 2)
                v = torch.cat([v, v.new_zeros(B, H, 1, self.head_dim)], 2)
                attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
            if cache is not None:
                offset = 0 if cache.static else cache.length
                k, v = cache.append(k, v)
        S = k.shape[2]
        masks, scores = [self.mask, mask], [self.score]
        if trust_hint:
            masks.append(causal())  # torch trusts the hint here (top-left, queries at `offset + i`)
        elif attn_mask is not None:
            if offset:
                raise ValueError("attn_mask with a filled cache: pass a keyfold mask (mask=...) instead, "
                                 "it sees absolute positions")
            am = attn_mask if attn_mask.dim() == 2 else attn_mask.view(B, H, L, S)  # (L, S) | (B, H, L, S)
            m, s = _torch_mask_parts(am, B, H, L, S, offset, "attn_mask")
            masks.append(m)
            scores.append(s)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (B, S):
                raise AssertionError(f"expecting key_padding_mask shape of {(B, S)}, but got "
                                     f"{tuple(key_padding_mask.shape)}")
            m, s = _torch_mask_parts(key_padding_mask.view(B, 1, 1, S), B, H, L, S, offset, "key_padding_mask")
            masks.append(m)
            scores.append(s)
        kf_mask, score = combine_masks(*masks), as_score([x for x in scores if x is not None])
        p = self.dropout if self.training else 0.0
        seed = int(torch.randint(0, 2 ** 62, (1,))) if p else None
        if cache is not None and not cache.static:  # one decode step over the KV cache
            if p or need_weights:
                raise ValueError("cache=: decoding runs without dropout and weights; call model.eval() and pass "
                                 "need_weights=False")
            out, lse = decode(q, cache.kv, mask=kf_mask, score=score), None  # (B, H, L, hd)
        else:
            out, lse = attention(q, k, v, mask=kf_mask, score=score, q_offset=offset, return_lse=True,
                                 dropout_p=p, dropout_seed=seed)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.embed_dim))  # (B, L, E)
        weights = None
        if need_weights:
            weights = _weights(q, k, lse, kf_mask, score, offset, p, seed, average_attn_weights)
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            out = out.transpose(0, 1)                                    # (L, B, E)
        return out, weights

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, "
                f"mask={self.mask!r}, score={self.score!r}")


_WEIGHT_CHUNK_ELEMS = 1 << 22  # scores per row chunk of need_weights (B * H * rows * S)


def _weights(q, k, lse, mask, score, offset, p, seed, average):
    """Attention weights ``exp(s - lse)``, normalised per row (dropped like the output when ``p``) in row chunks:
    ``(B, L, S)`` averaged over heads or ``(B, H, L, S)``; differentiable through q, k and lse."""
    B, H, L, hd = q.shape
    S = k.shape[2]
    sd = lse.dtype
    scale = hd ** -0.5
    rows = max(1, _WEIGHT_CHUNK_ELEMS // max(1, B * H * S))
    chunks = []
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        b, h, qp, kp = grid_positions(B, H, offset + r0, r1 - r0, 0, S, q.device)
        s = (q[:, :, r0:r1].to(sd) @ k.to(sd).transpose(-1, -2)) * scale       # (B, H, c, S)
        if score is not None:
            s = score.apply(s, b, h, qp, kp)
        if mask is not None:
            s = s.masked_fill(~mask.evaluate(b, h, qp, kp), float("-inf"))
        ls = lse[:, :, r0:r1].unsqueeze(-1)
        w = torch.exp(s - torch.where(torch.isneginf(ls), torch.zeros_like(ls), ls))  # empty rows: 0
        # normalised by its own sum: lse came from the attention call's scores, rounded otherwise
        # (float32 rows summed to 1 +- 1.4e-5, 24x torch's error), and a bias of finfo.min on every
        # key rounds log(S) out of lse (each weight was 1, rows summed to S; found by fuzzing)
        w = w / row_divisor(w.sum(-1, keepdim=True))
        if p:
            w = w * dropout_keep(seed, p, b, h, qp, kp, H) / (1.0 - p)
        chunks.append(w.mean(1) if average else w)
    return torch.cat(chunks, -2).to(q.dtype)


# ----------------------------------------------------------------------------- the layers


def _activation(activation):
    if isinstance(activation, str):
        if activation == "relu":
            return F.relu
        if activation == "gelu":
            return F.gelu
        raise RuntimeError(f"activation should be relu/gelu, not {activation}")
    if not callable(activation):
        raise TypeError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")
    return activation


class TransformerEncoderLayer(nn.Module):
    """``torch.nn.TransformerEncoderLayer`` on keyfold: the same signature, defaults, parameter names
    (``self_attn``, ``linear1``, ``linear2``, ``norm1``, ``norm2``) and forward
    ``(src, src_mask=None, src_key_padding_mask=None, is_causal=False)`` with torch's mask meaning.
    Keyword-only: ``mask=`` / ``score=`` (keyfold objects, True = visible) on the layer and ``mask=``
    per call.

    >>> layer = TransformerEncoderLayer(16, 4, 32, dropout=0.0)
    >>> layer(torch.randn(5, 2, 16)).shape                       # (L, B, E): batch_first=False
    torch.Size([5, 2, 16])
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None, *, mask=None, score=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first,
                                            mask=mask, score=score, **fk)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **fk)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **fk)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)
        self.activation = _activation(activation)

    def _sa(self, x, attn_mask, kpm, is_causal, mask):
        return self.dropout1(self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False,
                                            is_causal=is_causal, mask=mask)[0])

    def _ff(self, x):
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False, *, mask=None):
        x = src
        if self.norm_first:
            x = x + self._sa(self.norm1(x), src_mask, src_key_padding_mask, is_causal, mask)
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self._sa(x, src_mask, src_key_padding_mask, is_causal, mask))
        return self.norm2(x + self._ff(x))


class TransformerDecoderLayer(nn.Module):
    """``torch.nn.TransformerDecoderLayer`` on keyfold: the same signature, defaults, parameter names
    (``self_attn``, ``multihead_attn``, ``linear1``, ``linear2``, ``norm1``-``norm3``) and forward
    ``(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
    tgt_is_causal, memory_is_causal)`` with torch's mask meaning.

    Keyword-only keyfold options: ``cross_attention=False`` builds a decoder-only block (no
    ``multihead_attn``/``norm2``; ``memory`` may be None); ``mask=``/``score=`` on the layer (self-attention);
    per call ``mask=`` (self-attention) and ``cross_mask=`` (over memory keys), keyfold masks (True =
    visible), and ``caches=(self_cache, cross_cache)`` for incremental decoding.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation="relu", layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None, *,
                 cross_attention: bool = True, mask=None, score=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first,
                                            mask=mask, score=score, **fk)
        self.multihead_attn = (MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                                  batch_first=batch_first, **fk) if cross_attention else None)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **fk)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **fk)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
        if cross_attention:
            self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
            self.dropout2 = nn.Dropout(dropout)
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **fk)
        self.dropout1, self.dropout3 = nn.Dropout(dropout), nn.Dropout(dropout)
        self.activation = _activation(activation)

    def forward(self, tgt, memory=None, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False, memory_is_causal: bool = False, *,
                mask=None, cross_mask=None, caches=None):
        self_cache, cross_cache = caches if caches is not None else (None, None)

        def sa(x):
            return self.dropout1(self.self_attn(x, x, x, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask,
                                                need_weights=False, is_causal=tgt_is_causal, mask=mask,
                                                cache=self_cache)[0])

        def mha(x):
            return self.dropout2(self.multihead_attn(x, memory, memory, attn_mask=memory_mask,
                                                     key_padding_mask=memory_key_padding_mask, need_weights=False,
                                                     is_causal=memory_is_causal, mask=cross_mask,
                                                     cache=cross_cache)[0])

        def ff(x):
            return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))

        blocks = [(sa, self.norm1)]
        if self.multihead_attn is not None:
            if memory is None:
                raise ValueError("memory is None: a decoder layer with cross-attention needs the encoder output; "
                                 "build it with cross_attention=False for a decoder-only model")
            blocks.append((mha, self.norm2))
        blocks.append((ff, self.norm3))
        x = tgt
        for f, norm in blocks:
            x = x + f(norm(x)) if self.norm_first else norm(x + f(x))
        return x


def _detect_is_causal(mask, is_causal, size: int) -> bool:
    """torch's rule for the stacks' ``is_causal=None``: True when ``mask`` is exactly
    ``generate_square_subsequent_mask(size)`` (float: -inf above the diagonal, else 0; bool: True
    above it), so every layer runs ``causal()`` instead of reading the dense mask."""
    if is_causal is not None:
        return bool(is_causal)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (size, size):
        return False
    above = torch.ones(size, size, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, above))
    return bool(torch.equal(mask, torch.zeros_like(mask).masked_fill(above, float("-inf"))))


def _seq_len(x, batch_first: bool) -> int:
    return x.shape[0] if x.dim() == 2 else x.shape[1 if batch_first else 0]


class TransformerEncoder(nn.Module):
    """``torch.nn.TransformerEncoder``: ``num_layers`` copies of ``encoder_layer`` (``layers.i``) and an
    optional final ``norm``. forward(src, mask=None, src_key_padding_mask=None, is_causal=None); as in torch,
    ``is_causal=None`` with ``mask`` equal to ``generate_square_subsequent_mask`` runs the layers causal."""

    def __init__(self, encoder_layer, num_layers: int, norm=None, enable_nested_tensor: bool = True,
                 mask_check: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.num_layers, self.norm = num_layers, norm

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        x = src
        if self.layers:
            is_causal = _detect_is_causal(mask, is_causal, _seq_len(src, self.layers[0].self_attn.batch_first))
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        return x if self.norm is None else self.norm(x)


class TransformerDecoder(nn.Module):
    """``torch.nn.TransformerDecoder``: ``num_layers`` copies of ``decoder_layer`` and an optional ``norm``."""

    def __init__(self, decoder_layer, num_layers: int, norm=None):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(decoder_layer) for _ in range(num_layers))
        self.num_layers, self.norm = num_layers, norm

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal: bool = False):
        x = tgt
        if self.layers:
            tgt_is_causal = _detect_is_causal(tgt_mask, tgt_is_causal,
                                              _seq_len(tgt, self.layers[0].self_attn.batch_first))
        for layer in self.layers:
            x = layer(x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask, tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=bool(tgt_is_causal),
                      memory_is_causal=memory_is_causal)
        return x if self.norm is None else self.norm(x)

def sinusoidal_positions(n: int, d_model: int) -> torch.Tensor:
    """The paper's positional encoding ``(n, d_model)`` float32: sin on even, cos on odd features."""
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)  # (n, 1)
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(n, d_model)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: d_model // 2])
    return pe
