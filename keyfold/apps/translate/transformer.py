"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), on keyfold attention.

Encoder-decoder with sinusoidal positions, post-LN (``norm_first=True`` for pre-LN), one
embedding matrix shared by source, target and the output projection (embeddings scaled by
``sqrt(d_model)``, the projection unscaled), dropout 0.1, and a decoder-only language model.
Decoding is greedy or beam search (GNMT length penalty ``((5 + |Y|) / 6) ** alpha``), both
incremental: each new token costs one decoder step over the per-layer K/V caches of
:class:`keyfold.nn.AttentionCache` (a :class:`keyfold.caches.KVCache` with a batch reorder for
the beams), never a re-run of the prefix. docs/transformer.md has the
details and the measured numbers.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from torch import nn

from keyfold.masks import causal
from keyfold.nn import AttentionCache, TransformerDecoderLayer, TransformerEncoderLayer, key_padding_to_mask, sinusoidal_positions
from .data import BOS, EOS, PAD

__all__ = ["ModelConfig", "MODEL_CONFIGS", "Transformer", "TransformerLM", "greedy", "beam_search",
           "length_penalty"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Transformer (``n_encoder_layers = 0`` means a decoder-only language model)."""

    vocab_size: int = 8000
    d_model: int = 512           # model width; embeddings are scaled by sqrt(d_model)
    n_heads: int = 8
    d_ff: int = 2048             # inner width of the feed-forward sub-layers
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1         # the paper's P_drop: on embeddings+positions and every sub-layer output
    norm_first: bool = False     # False: post-LN as in the paper; True: pre-LN (+ a final LayerNorm)
    max_len: int = 256           # longest sequence the sinusoid table covers

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_decoder_layers < 1:
            raise ValueError("n_decoder_layers must be >= 1")


MODEL_CONFIGS = {
    # the paper's Table 3: base (65 M parameters with its 37 k vocabulary) and big (213 M; P_drop 0.3 for EN-DE)
    "base": ModelConfig(),
    "big": ModelConfig(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3),
    "small": ModelConfig(d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3),

    # sized for the 45-minute budget on 2 CPU cores, data included (docs/transformer.md): post-LN,
    # which had the lower validation loss at steps 250/500/750 than pre-LN with lr_scale 0.5
    # (5.82/5.04/4.66 vs 6.08/5.25/4.79); no dropout (the run sees about 1.3 epochs: it underfits)
    "cpu": ModelConfig(d_model=192, n_heads=4, d_ff=768, n_encoder_layers=2, n_decoder_layers=2,
                       dropout=0.0, norm_first=False),
    "tiny": ModelConfig(vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2,
                        n_decoder_layers=2, max_len=64),
    "lm-small": ModelConfig(d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=0, n_decoder_layers=4),
}


def _layer_kwargs(cfg: ModelConfig, layer: type) -> dict:
    """torch.nn-style keyword arguments of a keyfold.nn layer for ``cfg`` (batch-first tensors)."""
    kw = dict(d_model=cfg.d_model, nhead=cfg.n_heads, dim_feedforward=cfg.d_ff, dropout=cfg.dropout,
              norm_first=cfg.norm_first)
    if "batch_first" in inspect.signature(layer.__init__).parameters:
        kw["batch_first"] = True
    return kw


class _Embedding(nn.Module):
    """Shared token embedding ``* sqrt(d_model)`` plus sinusoidal positions, then dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.d_model ** -0.5)
        self.register_buffer("pe", sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        self.scale = math.sqrt(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        n = tokens.shape[1]
        if offset + n > self.pe.shape[0]:
            raise ValueError(f"sequence reaches position {offset + n - 1} but max_len is {self.pe.shape[0]}; "
                             f"raise ModelConfig.max_len or shorten the input")
        x = self.weight[tokens] * self.scale  # (B, N, d)
        return self.drop(x + self.pe[offset:offset + n])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()  # tied output projection, unscaled: (B, N, V)


class Transformer(nn.Module):
    """Encoder-decoder Transformer over one shared vocabulary; ``PAD = 0`` marks padding.

    forward(src ``(B, S)`` int64, tgt_in ``(B, T)`` int64 starting with BOS) -> logits
    ``(B, T, vocab)`` float32. Sequences are right-padded with PAD; padded source keys are
    hidden from every query (``sinks(lengths)``), the decoder is causal.

    >>> m = Transformer(MODEL_CONFIGS["tiny"])
    >>> m(torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7]])).shape
    torch.Size([1, 2, 64])
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.n_encoder_layers < 1:
            raise ValueError("a Transformer needs n_encoder_layers >= 1; use TransformerLM for a decoder-only model")
        self.cfg = cfg
        self.embed = _Embedding(cfg)
        self.encoder = nn.ModuleList(TransformerEncoderLayer(**_layer_kwargs(cfg, TransformerEncoderLayer))
                                     for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(TransformerDecoderLayer(**_layer_kwargs(cfg, TransformerDecoderLayer))
                                     for _ in range(cfg.n_decoder_layers))
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()

    def encode(self, src: torch.Tensor):
        """Encoder output ``(B, S, d)`` and the keyfold mask hiding padded source keys. Its query ids cover
        every target position too (cross-attention's queries): a source padded anywhere but at its end
        becomes ``documents`` ids, and ids for the S source positions only raised once a target passed
        S tokens (a review, 2026-12-07)."""
        src_mask = key_padding_to_mask(src.eq(PAD), max(src.shape[1], self.cfg.max_len))
        x = self.embed(src)
        for layer in self.encoder:
            x = layer(x, mask=src_mask)
        return self.enc_norm(x), src_mask

    def decode(self, tgt_in, memory, src_mask, caches=None, offset: int = 0):
        """Logits ``(B, T, V)`` for target tokens at positions ``offset ..``; with ``caches`` incremental."""
        x = self.embed(tgt_in, offset)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, mask=causal(), cross_mask=src_mask,
                      caches=None if caches is None else caches[i])
        return self.embed.logits(self.dec_norm(x))

    def new_caches(self):
        return [(AttentionCache(capacity=self.cfg.max_len), AttentionCache(static=True)) for _ in self.decoder]

    def forward(self, src, tgt_in):
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)


class TransformerLM(nn.Module):
    """Decoder-only language model (causal self-attention + feed-forward, tied embeddings).

    forward(tokens ``(B, T)``) -> logits ``(B, T, V)``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = _Embedding(cfg)
        self.decoder = nn.ModuleList(
            TransformerDecoderLayer(**_layer_kwargs(cfg, TransformerDecoderLayer), cross_attention=False)
            for _ in range(cfg.n_decoder_layers))
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.norm_first else nn.Identity()

    def forward(self, tokens, caches=None, offset: int = 0):
        x = self.embed(tokens, offset)
        for i, layer in enumerate(self.decoder):
            x = layer(x, mask=causal(), caches=None if caches is None else caches[i])
        return self.embed.logits(self.dec_norm(x))

    def new_caches(self):
        return [(AttentionCache(capacity=self.cfg.max_len), None) for _ in self.decoder]


# ------------------------------------------------------------------------------ decoding


def _never_special(logits: torch.Tensor) -> torch.Tensor:
    """PAD and BOS are never generated."""
    logits = logits.clone()
    logits[..., [PAD, BOS]] = -math.inf
    return logits


MAX_EXTRA = 50  # the paper's maximum output length: input length + 50


def _limits(src: torch.Tensor, max_len: int | None, model: Transformer) -> tuple[int, torch.Tensor]:
    """``(steps, limit (B,))``: output tokens per row at most, EOS included: ``max_len`` if given,
    else that row's input length + 50 (the paper's rule), never past ``ModelConfig.max_len``."""
    if max_len is None:
        limit = src.ne(PAD).sum(1) + MAX_EXTRA
    else:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        limit = torch.full((src.shape[0],), max_len, dtype=torch.long, device=src.device)
    limit = limit.clamp(max=model.cfg.max_len)
    return int(limit.max()), limit


def _force_eos(logits: torch.Tensor, at_limit: torch.Tensor) -> torch.Tensor:
    """Rows ``at_limit`` (bool, leading dims of ``logits``) may only emit EOS, at its own score: every
    other token gets -inf. Beam search adds these log-probabilities to a hypothesis's score, so the
    forced EOS costs its real log P(EOS | prefix), as fairseq's limit does (it had cost 0: a
    hypothesis cut at the limit outranked a finished one whose log P(Y|X) / lp(|Y|) was higher)."""
    if not bool(at_limit.any()):
        return logits
    others = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
    others[EOS] = False
    return logits.masked_fill(at_limit.unsqueeze(-1) & others, -math.inf)


@torch.no_grad()
def greedy(model: Transformer, src: torch.Tensor, max_len: int | None = None, *, use_cache: bool = True):
    """Greedy decoding of a batch ``src (B, S)``; returns ``(B, T)`` int64 tokens after BOS, each row
    ending at its first EOS and padded with PAD. ``use_cache=False`` re-runs the decoder over the
    whole prefix every step (the reference the cached path is tested against); uncached, any model
    with ``encode(src) -> state`` and ``decode(prefix, *state)`` works (the Table-2 baselines)."""
    steps, limit = _limits(src, max_len, model)
    state = model.encode(src)
    B = src.shape[0]
    out = torch.full((B, 1), BOS, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    caches = model.new_caches() if use_cache else None
    for t in range(steps):
        if use_cache:
            logits = model.decode(out[:, -1:], *state, caches, offset=t)[:, -1]
        else:
            logits = model.decode(out, *state)[:, -1]
        nxt = _force_eos(_never_special(logits), limit.eq(t + 1)).argmax(-1).masked_fill(done, PAD)
        out = torch.cat([out, nxt[:, None]], 1)
        done |= nxt.eq(EOS)
        if bool(done.all()):
            break
    return out[:, 1:]


def length_penalty(length: torch.Tensor, alpha: float) -> torch.Tensor:
    """GNMT's ``((5 + |Y|) / 6) ** alpha``."""
    return ((5.0 + length.float()) / 6.0) ** alpha


@torch.no_grad()
def beam_search(model: Transformer, src: torch.Tensor, beam: int = 4, alpha: float = 0.6,
                max_len: int | None = None):
    """Batched beam search; returns the best hypothesis per row as ``(B, T)`` tokens (like :func:`greedy`).

    Every hypothesis is ranked by ``log P(Y | X) / lp(|Y|)`` with ``lp`` :func:`length_penalty`
    (|Y| counts the EOS). A finished hypothesis stays in the beam with its score frozen, so with
    ``beam=1`` this is exactly greedy decoding. Incremental: caches are reordered per step.
    """
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    steps, limit = _limits(src, max_len, model)
    B, K = src.shape[0], beam
    memory, src_mask = model.encode(src)
    memory = memory.repeat_interleave(K, 0)  # (B*K, S, d)
    src_mask = key_padding_to_mask(src.eq(PAD).repeat_interleave(K, 0), max(src.shape[1], model.cfg.max_len))
    caches = model.new_caches()
    dev = src.device
    tokens = torch.full((B * K, 1), BOS, dtype=torch.long, device=dev)
    logp = torch.zeros(B, K, device=dev)
    logp[:, 1:] = -math.inf  # only one live hypothesis at the start
    length = torch.zeros(B, K, dtype=torch.long, device=dev)
    done = torch.zeros(B, K, dtype=torch.bool, device=dev)
    for t in range(steps):
        step = model.decode(tokens[:, -1:], memory, src_mask, caches, offset=t)[:, -1].float()  # (B*K, V)
        V = step.shape[-1]
        lp_tok = _force_eos(_never_special(torch.log_softmax(step, -1)).view(B, K, V),
                            limit.eq(t + 1).unsqueeze(1).expand(B, K))
        # a finished hypothesis has one continuation, PAD at no cost, and keeps its length
        frozen = torch.full_like(lp_tok, -math.inf)
        frozen[..., PAD] = 0.0
        lp_tok = torch.where(done.unsqueeze(-1), frozen, lp_tok)
        cand = logp.unsqueeze(-1) + lp_tok  # (B, K, V)
        cand_len = torch.where(done, length, length + 1).unsqueeze(-1).expand(B, K, V)
        score = cand / length_penalty(cand_len, alpha)
        top = score.view(B, K * V).topk(K, dim=-1).indices  # (B, K)
        src_beam, tok = top // V, top % V
        logp = cand.view(B, K * V).gather(1, top)
        length = cand_len.reshape(B, K * V).gather(1, top)
        done = done.gather(1, src_beam) | tok.eq(EOS)
        flat = (src_beam + torch.arange(B, device=dev).unsqueeze(1) * K).view(-1)  # (B*K,)
        tokens = torch.cat([tokens.index_select(0, flat), tok.view(-1, 1)], 1)
        for self_c, _ in caches:
            self_c.reorder(flat)  # cross caches hold the same memory for every beam of a row
        if bool(done.all()):
            break
    final = logp / length_penalty(length, alpha)
    best = final.argmax(-1)  # (B,)
    pick = best + torch.arange(B, device=dev) * K
    return tokens.index_select(0, pick)[:, 1:]
