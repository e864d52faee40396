"""keyfold as a Hugging Face transformers attention implementation: ``attn_implementation="keyfold"``.

>>> import keyfold.integrations.transformers as kft                     # doctest: +SKIP
>>> kft.register()                                                      # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="keyfold")  # doctest: +SKIP

A transformers 5.x model asks two registries for one name: ``AttentionInterface`` for the
attention function and ``AttentionMaskInterface`` for the mask builder. :func:`register` fills
both. The mask builder gets the model's mask *function* (the same closure FlexAttention gets)
and the 2-D ``attention_mask``, and returns a :class:`KeyfoldMask`: a keyfold mask object and
the absolute positions of the first query and key, never an ``N x N`` tensor. Known pieces
become closed-form keyfold masks (causal, sliding windows, bidirectional, padding, packed
sequences); anything else is kept as a ``mask_mod`` callable, evaluated exactly per tile, so an
unknown pattern costs time, never correctness. Registering only the attention function would
leave the model without its padding (transformers builds no mask for a name its mask registry
lacks), which is why both are registered together.

Rows that see no key (the query rows of left padding) give 0, where eager attention spreads
them uniformly over masked keys: compare outputs on real tokens only.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch.nn.attention.flex_attention import BlockMask

from .. import masks as M
from ..engine import attention
from ..scores import softcap as _softcap

__all__ = ["register", "KeyfoldMask", "attention_forward", "mask_interface", "to_keyfold_mask"]

NAME = "keyfold"


def _hf():
    try:
        import transformers  # noqa: F401
        from transformers import masking_utils
    except ImportError as e:
        from .._extras import require
        require("hf", "keyfold.integrations.transformers")
        raise e
    return masking_utils


class KeyfoldMask(BlockMask):
    """What the mask builder hands the attention function instead of a dense tensor.

    mask: a keyfold mask over absolute positions (None: every key visible).
    q_offset / kv_offset: absolute positions of the first query row and the first key.
    shape: ``(B, 1, Nq, Nk)``, the mask's logical shape.

    It subclasses FlexAttention's ``BlockMask`` (a block-sparse mask description, which it is)
    only so that transformers passes it through as an already prepared mask: ``generate`` with
    a static cache builds the mask once and hands it back to the model, which keeps a
    ``BlockMask`` of 4 dimensions as it is. None of ``BlockMask``'s own fields are used.
    """

    def __init__(self, mask: M.Mask | None, q_offset: int, kv_offset: int, shape: tuple[int, int, int, int]):
        self.mask, self.q_offset, self.kv_offset, self._shape = mask, q_offset, kv_offset, tuple(shape)

    @property
    def shape(self):
        return self._shape

    def __repr__(self):
        return f"KeyfoldMask({self.mask!r}, q_offset={self.q_offset}, kv_offset={self.kv_offset}, shape={self._shape})"


# ------------------------------------------------------------------ mask functions -> masks


def _closure(fn) -> dict:
    cells = fn.__closure__ or ()
    return {name: c.cell_contents for name, c in zip(fn.__code__.co_freevars, cells)}


@dataclasses.dataclass(frozen=True)
class _Codes:
    """The code objects of transformers' mask factories: a closure is recognised by its code
    object (identity), and read through its named closure cells; anything else is kept as a
    callable."""

    and_masks: object
    or_masks: object
    sliding: object
    sliding_bi: object
    padding: object
    packed: object
    remap: object


def _codes(mu) -> _Codes:
    f = mu.causal_mask_function
    ids = torch.zeros(1, 1, dtype=torch.long)
    return _Codes(mu.and_masks(f).__code__, mu.or_masks(f).__code__, mu.sliding_window_overlay(1).__code__,
                  mu.sliding_window_bidirectional_overlay(1).__code__, mu.padding_mask_function(ids).__code__,
                  mu.packed_sequence_mask_function(ids).__code__,
                  mu.remap_positions_for_packed_sequence(f, ids).__code__)


class _HFMaskFn(M.MaskFn):
    """A transformers mask function kept as a callable (evaluated exactly per tile). They may
    index per-batch tensors with the batch index, so no probe with a made-up batch of 2."""

    def depends_on_batch_head(self):
        return True, False


def _consecutive_within(psm: torch.Tensor, pos: torch.Tensor) -> bool:
    """Whether ``pos[b, i] - i`` is constant inside every packed sequence of ``psm``: then a mask
    that depends only on ``q - kv`` gives the same answer on remapped and raw positions there."""
    shift = pos - torch.arange(pos.shape[-1], device=pos.device)
    same_doc = psm[:, 1:] == psm[:, :-1]
    return bool((shift[:, 1:] == shift[:, :-1])[same_doc].all())


def to_keyfold_mask(fn, mu=None, codes: _Codes | None = None, packed: torch.Tensor | None = None) -> M.Mask | None:
    """A transformers ``mask_function(batch_idx, head_idx, q_idx, kv_idx)`` as a keyfold mask.

    causal / bidirectional / sliding-window overlays / padding / packed sequences become
    closed-form keyfold masks (None means every key); and/or composites recurse; any other
    function becomes a callable mask evaluated exactly. Positions are absolute, as transformers
    passes them.
    """
    mu = mu or _hf()
    codes = codes or _codes(mu)
    if fn is mu.causal_mask_function:
        return M.causal()
    if fn is mu.bidirectional_mask_function:
        return M.full()
    code = getattr(fn, "__code__", None)
    if code is codes.and_masks or code is codes.or_masks:
        parts = _closure(fn)["mask_functions"]
        # packed sequences: remap(f, positions) & same-sequence -> f & documents when f is shift-free
        psm = next((_closure(p)["packed_sequence_mask"] for p in parts
                    if getattr(p, "__code__", None) is codes.packed), None)
        out = None
        for p in parts:
            m = to_keyfold_mask(p, mu, codes, psm)
            if out is None:
                out = m
            else:
                out = (out & m) if code is codes.and_masks else (out | m)
        return out
    if code is codes.sliding:       # kv_idx > q_idx - w
        return M.window(_closure(fn)["sliding_window"] - 1, None)
    if code is codes.sliding_bi:    # |q_idx - kv_idx| <= w
        w = _closure(fn)["sliding_window"]
        return M.window(w, w)
    if code is codes.padding:
        return M.padding(keys=_closure(fn)["padding_mask"])
    if code is codes.packed:
        return M.documents(_closure(fn)["packed_sequence_mask"])
    if code is codes.remap and packed is not None:
        cells = _closure(fn)
        inner = to_keyfold_mask(cells["mask_function"], mu, codes)
        pos = cells["position_ids"]
        if (inner is None or inner.translation_invariant) and _consecutive_within(packed, pos):
            return inner
    return _HFMaskFn(fn)


def mask_interface(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                   mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> KeyfoldMask:
    """transformers' ``AttentionMaskInterface`` entry: the model's mask, as a :class:`KeyfoldMask`.

    attention_mask: the 2-D ``(B, seen + q_length)`` padding mask (True/1 = a real token), indexed
    by absolute key position; it is kept as ``padding(keys=...)``, never expanded to 4-D.
    """
    mu = _hf()
    codes = _codes(mu)
    mask = to_keyfold_mask(mu.causal_mask_function if mask_function is None else mask_function, mu, codes)
    if isinstance(q_offset, torch.Tensor):  # a StaticCache layer reports it as a tensor
        q_offset = int(q_offset)
    # (traced by torch.compile, the all-real check would break the graph: keep the mask, it is exact)
    if attention_mask is not None and (torch.compiler.is_compiling() or not bool(attention_mask.all())):
        valid = attention_mask.bool()
        need = kv_offset + kv_length
        if valid.shape[-1] < need:  # a static cache's slots past the prompt: not real keys yet
            valid = torch.nn.functional.pad(valid, (0, need - valid.shape[-1]), value=False)
        pad = M.padding(keys=valid)
        mask = pad if mask is None or mask == M.full() else mask & pad
    if mask == M.full():
        mask = None
    return KeyfoldMask(mask, int(q_offset), int(kv_offset), (batch_size, 1, q_length, kv_length))


# ------------------------------------------------------------------------- the attention


def _supports_dropout() -> bool:
    return "dropout_p" in inspect.signature(attention).parameters


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' ``AttentionInterface`` entry.

    query ``(B, Hq, Nq, D)``, key / value ``(B, Hkv, Nk, D)`` (GQA as is, no repeat).
    attention_mask: the :class:`KeyfoldMask` the mask builder made (or None: causal if the
    module is causal, else every key). Returns ``(out (B, Nq, Hq, Dv), None)``: attention weights
    are never materialised.
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("keyfold attention: learned attention sinks (s_aux) are not supported; "
                                  "use attn_implementation='eager' for this model")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("keyfold attention: a dense position_bias is not supported; "
                                  "use attn_implementation='sdpa' or 'eager' for this model")
    extra = {}
    if dropout:
        if not _supports_dropout():
            raise NotImplementedError(
                f"keyfold attention has no attention dropout yet and the model asks for p={dropout} "
                f"(training mode): call model.eval(), or set the config's attention dropout to 0.0")
        extra["dropout_p"] = float(dropout)
    q_offset, kv_offset = None, 0
    if isinstance(attention_mask, KeyfoldMask):
        mask, q_offset, kv_offset = attention_mask.mask, attention_mask.q_offset, attention_mask.kv_offset
    elif attention_mask is None:
        _check_mask_builder(module)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask = M.causal() if causal and query.shape[2] > 1 else None
    else:
        raise TypeError(
            f"keyfold attention got a {type(attention_mask).__name__} attention mask; it takes the mask its "
            f"own mask builder makes. Call keyfold.integrations.transformers.register() before building "
            f"the model, and pass the 2-D attention_mask (not a prepared 4-D mask) to the model")
    score = None if softcap is None else _softcap(float(softcap))
    out = attention(query, key, value, mask=mask, score=score, scale=scaling, q_offset=q_offset,
                    kv_offset=kv_offset, **extra)                       # (B, Hq, Nq, Dv)
    return out.transpose(1, 2).contiguous(), None


def _check_mask_builder(module) -> None:
    """A model whose attention name lacks a mask builder passes no mask at all, padding included:
    refuse that instead of attending to padding."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if impl is None:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    if impl not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise RuntimeError(
            f"keyfold attention is registered as {impl!r} without its mask builder, so the model would drop "
            f"its padding mask silently; call keyfold.integrations.transformers.register({impl!r}), which "
            f"registers both")


def register(name: str = NAME) -> str:
    """Register keyfold with transformers under ``name`` (both the attention function and the
    mask builder); then ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` uses it. Returns the name. Idempotent."""
    _hf()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_interface)
    return name
