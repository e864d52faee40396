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
from torch.overrides import TorchFunctionMode

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

    mask: a keyfold mask over absolute positions (None: every key visible), or, for a mask
    function compiled code cannot read otherwise, a dense bool ``(B, 1, Nq, Nk)`` tensor of this
    call's pairs (offsets 0).
    q_offset / kv_offset: absolute positions of the first query row and the first key (q_offset
    is a 0-d tensor for a static cache, so a compiled decoding step takes it as data).
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

    @property
    def ndim(self):  # models that flatten a 2-d padding mask ask (GPT-2: `attention_mask.ndim < 4`)
        return len(self._shape)

    def dim(self):
        return len(self._shape)

    def __repr__(self):
        return f"KeyfoldMask({self.mask!r}, q_offset={self.q_offset}, kv_offset={self.kv_offset}, shape={self._shape})"

    __str__ = __repr__  # BlockMask's __str__ reads block tables this mask does not have

    def __getitem__(self, index):
        """Rows of the queries: ``mask[:, :, a:b]`` or ``mask[..., a:b, :]`` (Gemma 4's KV-shared layers keep
        the last queries), the query offset moved by ``a``. Anything else raises: BlockMask's own indexing
        read tables this mask does not have (AttributeError 'dq_kv_order'; a review, 2026-12-08)."""
        idx = index if isinstance(index, tuple) else (index,)
        if Ellipsis in idx:
            at = idx.index(Ellipsis)
            idx = idx[:at] + (slice(None),) * (4 - len(idx) + 1) + idx[at + 1:]
        idx = idx + (slice(None),) * (4 - len(idx))
        whole = slice(None)
        if (len(idx) != 4 or not all(isinstance(i, slice) and i == whole for i in (idx[0], idx[1], idx[3]))
                or not isinstance(idx[2], slice) or idx[2].step not in (None, 1)):
            raise NotImplementedError(
                f"keyfold's attention mask cannot be indexed as {index!r}: only its query rows can be "
                f"sliced (mask[:, :, a:b]). A model that reads the mask itself needs attn_implementation='eager' "
                f"or 'sdpa'")
        B, H, Nq, Nk = self._shape
        a, b, _ = idx[2].indices(Nq)
        b = max(a, b)
        if isinstance(self.mask, torch.Tensor):  # a dense mask of this call's pairs: its rows
            return KeyfoldMask(self.mask[:, :, a:b], self.q_offset, self.kv_offset, (B, H, b - a, Nk))
        return KeyfoldMask(self.mask, self.q_offset + a, self.kv_offset, (B, H, b - a, Nk))

    def _refuse_arithmetic(self, other):
        raise TypeError("keyfold's attention mask is not a tensor: this model adds it to scores it computes "
                        "itself, outside transformers' attention interface (GIT does); use "
                        "attn_implementation='eager' or 'sdpa' for this model")

    __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = _refuse_arithmetic


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


def _remapped(inner: M.Mask | None, positions: torch.Tensor) -> M.Mask:
    """``inner`` at packed positions (every key, None or ``full()``, ignores them). Beside the
    documents those positions restart in, ``&`` turns it back into ``inner`` (closed form)."""
    return M.full() if inner is None or inner == M.full() else M._Remapped(inner, positions)


def to_keyfold_mask(fn, mu=None, codes: _Codes | None = None) -> M.Mask | None:
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
        out = None
        for p in parts:  # (packed: remapped(f, positions) & documents -> f & documents, by &)
            m = to_keyfold_mask(p, mu, codes)
            if out is None:
                out = m
            else:
                out = (out & m) if code is codes.and_masks else (out | m)
        return out
    if code is codes.sliding:       # kv_idx > q_idx - w
        return _keys_from(_closure(fn)["sliding_window"] - 1)
    if code is codes.sliding_bi:    # |q_idx - kv_idx| <= w
        w = _closure(fn)["sliding_window"]
        return M.window(w, w)
    if code is codes.padding:
        return M.padding(keys=_closure(fn)["padding_mask"])
    if code is codes.packed:
        return M.documents(_closure(fn)["packed_sequence_mask"])
    if code is codes.remap:
        cells = _closure(fn)
        inner = to_keyfold_mask(cells["mask_function"], mu, codes)
        if inner is None or inner.translation_invariant:
            return _remapped(inner, cells["position_ids"])
    return _HFMaskFn(fn)


# ------------------------------------------------- the same, while torch.compile traces

class _NotClosedForm(Exception):
    """A mask function the symbolic probe cannot read (it indexes a tensor, or compares in a form
    no keyfold preset states)."""


class _Lin:
    """``cq * q_idx + ckv * kv_idx + c``: what transformers' index arithmetic builds. With
    ``pos`` (a ``(B, N)`` tensor), the indices are remapped: ``cq * pos[b, q_idx] + ckv * pos[b, kv_idx] + c``
    (what ``position_ids[batch_idx, q_idx]`` gives under :class:`_Probe`)."""

    def __init__(self, cq: int, ckv: int, c: int, pos: torch.Tensor | None = None):
        self.cq, self.ckv, self.c, self.pos = cq, ckv, c, pos

    def _other(self, x):
        if isinstance(x, _Lin):
            return x
        if type(x) is int:
            return _Lin(0, 0, x)
        raise _NotClosedForm

    def _pos(self, o: "_Lin"):
        """The positions both sides index (one remapping, or none, per expression)."""
        mine, theirs = (self.cq, self.ckv) != (0, 0), (o.cq, o.ckv) != (0, 0)
        if mine and theirs and self.pos is not o.pos:
            raise _NotClosedForm
        return self.pos if mine else o.pos

    def __add__(self, x):
        o = self._other(x)
        return _Lin(self.cq + o.cq, self.ckv + o.ckv, self.c + o.c, self._pos(o))

    __radd__ = __add__

    def __sub__(self, x):
        o = self._other(x)
        return _Lin(self.cq - o.cq, self.ckv - o.ckv, self.c - o.c, self._pos(o))

    def __rsub__(self, x):
        return self._other(x).__sub__(self)

    def __neg__(self):
        return _Lin(-self.cq, -self.ckv, -self.c, self.pos)

    def __eq__(self, x):  # packed_sequence_mask[b, q_idx] == packed_sequence_mask[b, kv_idx]
        d = self - x
        if d.pos is not None and d.c == 0 and abs(d.cq) == 1 and d.cq == -d.ckv:
            return _Pred(M.documents(d.pos))
        raise _NotClosedForm

    __hash__ = None

    def __abs__(self):
        return _Abs(self)

    # every comparison as ``d >= 0`` or ``d <= 0`` with d = self - x (positions are integers)
    def __ge__(self, x):
        return _at_least_zero(self - x)

    def __gt__(self, x):
        return _at_least_zero(self - x - 1)

    def __le__(self, x):
        return _at_least_zero(-(self - x))

    def __lt__(self, x):
        return _at_least_zero(-(self - x) - 1)

    def new_ones(self, *args, **kwargs):   # and_masks starts from True,
        return _Pred(M.full())

    def new_zeros(self, *args, **kwargs):  # or_masks from False
        return _Pred(None)

    def __index__(self):  # indexing a tensor with a position: not closed form
        raise _NotClosedForm

    def __bool__(self):
        raise _NotClosedForm


class _Abs:
    def __init__(self, lin: _Lin):
        self.lin = lin

    def __le__(self, w):  # |q - kv| <= w
        if type(w) is int and self.lin.c == 0 and abs(self.lin.cq) == 1 and self.lin.cq == -self.lin.ckv:
            m = M.window(w, w)
            return _Pred(m if self.lin.pos is None else _remapped(m, self.lin.pos))
        raise _NotClosedForm

    def __bool__(self):
        raise _NotClosedForm


def _keys_from(c: int) -> M.Mask:
    """``kv >= q - c`` for any int ``c``: a window's left bound, or for ``c < 0`` keys ahead of the query
    only (a window of 0, which Qwen2-MoE's config sets where no layer slides: ``window(-1)`` raised and
    the model could not run; a review, 2026-12-08)."""
    return M.window(c, None) if c >= 0 else ~M.window(None, -c - 1)


def _keys_up_to(c: int) -> M.Mask:
    """``kv <= q + c`` for any int ``c``."""
    return M.window(None, c) if c >= 0 else ~M.window(-c - 1, None)


def _at_least_zero(d: _Lin) -> "_Pred":
    """``d >= 0`` as a keyfold mask, for ``d = +-(q - kv) + c`` or ``d = q + c`` (of remapped
    positions when ``d.pos`` is set)."""
    if d.cq == 1 and d.ckv == -1:      # kv <= q + c
        m = M.causal() if d.c == 0 else _keys_up_to(d.c)
    elif d.cq == -1 and d.ckv == 1:    # kv >= q - c
        m = _keys_from(d.c)
    elif d.cq == 1 and d.ckv == 0 and d.c >= 0 and d.pos is None:  # q >= -c: every query (bidirectional)
        return _Pred(M.full())
    else:
        raise _NotClosedForm
    return _Pred(m if d.pos is None else _remapped(m, d.pos))


class _Pred:
    """A boolean mask value: a keyfold mask, or None for False (or_masks' start)."""

    device = None

    def __init__(self, mask):
        self.mask = mask

    def to(self, *args, **kwargs):
        return self

    def __and__(self, o):
        if not isinstance(o, _Pred):
            raise _NotClosedForm
        if self.mask is None or o.mask is None:
            return _Pred(None)
        if self.mask == M.full():
            return o
        if o.mask == M.full():
            return self
        return _Pred(self.mask & o.mask)

    def __or__(self, o):
        if not isinstance(o, _Pred):
            raise _NotClosedForm
        if self.mask is None:
            return o
        if o.mask is None:
            return self
        return _Pred(self.mask | o.mask)

    def __bool__(self):
        raise _NotClosedForm


class _Index:
    """The batch or head index: a function that reads it is not closed form (except to index a
    per-batch tensor of positions, see :class:`_Probe`)."""

    def __init__(self, batch: bool):
        object.__setattr__(self, "batch", batch)

    def __getattr__(self, name):
        if name.startswith("__"):  # a protocol lookup (dynamo asks for __torch_function__): absent
            raise AttributeError(name)
        raise _NotClosedForm

    def __index__(self):
        raise _NotClosedForm


class _Probe(TorchFunctionMode):
    """While the probe runs: ``t[batch_idx, q_idx]`` / ``t[batch_idx, kv_idx]`` on a ``(B, N)``
    tensor is the remapped index ``_Lin(.., pos=t)`` (transformers' packed-sequence functions
    index ``position_ids`` and ``packed_sequence_mask`` so); any other use of a symbolic index
    by torch is not closed form. Dynamo traces a torch function mode, so this keeps the probe
    inside the graph where indexing a tensor with a Python object would break it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[1], tuple) and len(args[1]) == 2:
            (b, i), t = args[1], args[0]
            if (isinstance(b, _Index) and b.batch and isinstance(i, _Lin) and i.pos is None and i.c == 0
                    and (i.cq, i.ckv) in ((1, 0), (0, 1)) and t.dim() == 2):
                return _Lin(i.cq, i.ckv, 0, t)
        flat = [y for x in (*args, *(kwargs or {}).values()) for y in (x if isinstance(x, (tuple, list)) else (x,))]
        if any(isinstance(a, (_Index, _Lin, _Abs, _Pred, _Opaque)) for a in flat):
            return _Opaque()  # (raising here, inside the mode, is an internal error for dynamo)
        return func(*args, **(kwargs or {}))


def _not_closed_form(*args, **kwargs):
    raise _NotClosedForm


class _Opaque:
    """What torch gave for a symbolic index it cannot read: any use of it is not closed form."""

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __floordiv__ = __rfloordiv__ = _not_closed_form
    __mod__ = __rmod__ = __and__ = __rand__ = __or__ = __ror__ = __invert__ = __neg__ = _not_closed_form
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __index__ = __getitem__ = _not_closed_form
    __hash__ = None

    def __getattr__(self, name):
        if name.startswith("__"):  # a protocol lookup (dynamo asks for __torch_function__): absent
            raise AttributeError(name)
        raise _NotClosedForm


def traced_mask(fn) -> M.Mask | None:
    """A transformers mask function as a keyfold mask by calling it on symbolic positions.

    Used while torch.compile traces, where the mask function is a closure made inside the traced
    region and dynamo cannot read its ``__closure__``: dynamo can call it, and the symbolic
    positions turn ``kv_idx <= q_idx``, ``kv_idx > q_idx - w``, ``abs(q_idx - kv_idx) <= w``,
    ``q_idx >= 0`` and and/or composites into keyfold masks (None: every key). Raises
    :class:`_NotClosedForm` for anything else (a function that indexes a tensor).
    """
    with _Probe():
        out = fn(_Index(True), _Index(False), _Lin(1, 0, 0), _Lin(0, 1, 0))
    if not isinstance(out, _Pred):
        raise _NotClosedForm
    if out.mask is None:
        raise _NotClosedForm  # no key at all: not a mask a model builds
    return None if out.mask == M.full() else out.mask


def _dense_mask(mu, batch_size, q_length, kv_length, q_offset, kv_offset, fn, attention_mask, kwargs) -> "KeyfoldMask":
    """While dynamo traces, a mask function the probe cannot read (chunked attention indexes a
    tensor by the batch index) is evaluated on every pair by transformers' own ``sdpa_mask``,
    padding included: a dense bool ``(B, 1, Nq, Nk)`` tensor that reaches the op as data. Exact,
    and it costs what ``attn_implementation="sdpa"`` costs (B x Nq x Nk bytes). A callable made
    inside the traced region cannot be passed by reference (its captured tensors are new each call)."""
    dense = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=fn,
                         attention_mask=None if attention_mask is None else attention_mask.bool(),
                         allow_is_causal_skip=False, use_vmap=bool(kwargs.get("use_vmap", False)),
                         device=kwargs.get("device", "cpu"))
    return KeyfoldMask(dense, 0, 0, (batch_size, 1, q_length, kv_length))  # its entries are this call's pairs


def mask_interface(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                   mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> KeyfoldMask:
    """transformers' ``AttentionMaskInterface`` entry: the model's mask, as a :class:`KeyfoldMask`.

    attention_mask: the 2-D ``(B, seen + q_length)`` padding mask (True/1 = a real token), indexed
    by absolute key position; it is kept as ``padding(keys=...)``, never expanded to 4-D.
    """
    mu = _hf()
    fn = mu.causal_mask_function if mask_function is None else mask_function
    if torch.compiler.is_compiling():
        try:
            mask = traced_mask(fn)
        except (_NotClosedForm, IndexError, TypeError):
            return _dense_mask(mu, batch_size, q_length, kv_length, q_offset, kv_offset, fn, attention_mask, kwargs)
    else:
        mask = to_keyfold_mask(fn, mu)
    if isinstance(q_offset, torch.Tensor):
        # a StaticCache layer reports its length as a tensor that it advances in place during the
        # forward: keep a copy of today's value. While compiling (or for a compiled forward that
        # receives this mask), a tensor is data of the graph: no recompile at every decoding step.
        q_offset = q_offset.detach().clone()
    # (traced by torch.compile, the all-real check would break the graph: keep the mask, it is exact).
    # A mask shorter than the keys is kept even when all real: a static cache's slots past it hold
    # no key yet, and a mask that is not causal would see them (a bidirectional one averaged the
    # empty slots in: logits off by 1.7, a helper's fuzz); transformers pads them False too
    need = kv_offset + kv_length
    if attention_mask is not None and (torch.compiler.is_compiling() or attention_mask.shape[-1] < need
                                       or not bool(attention_mask.all())):
        valid = attention_mask.bool()
        if valid.shape[-1] < need:  # a static cache's slots past the prompt: not real keys yet
            valid = torch.nn.functional.pad(valid, (0, need - valid.shape[-1]), value=False)
        pad = M.padding(keys=valid)
        mask = pad if mask is None or mask == M.full() else mask & pad
    if mask == M.full():
        mask = None
    return KeyfoldMask(mask, q_offset, kv_offset, (batch_size, 1, q_length, kv_length))


# ------------------------------------------------------------------------- the attention


def _supports_dropout() -> bool:
    return "dropout_p" in inspect.signature(attention).parameters


#: keyword arguments transformers' sparse-attention models give the attention function in place of a mask:
#: keys the kernel must select (MiniMax-M3's block_indices, the DeepSeek-V3.2 family's indices), sinks
_CHANGES_THE_MATH = ("indices", "block_indices", "topk_indices")

#: attention modules that skip their own masking when handed FlexAttention's BlockMask (KeyfoldMask is one)
_MASK_IN_THE_MODEL = ("DogeAttention",)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' ``AttentionInterface`` entry.

    query ``(B, Hq, Nq, D)``, key / value ``(B, Hkv, Nk, D)`` (GQA as is, no repeat).
    attention_mask: the :class:`KeyfoldMask` the mask builder made (or None: causal if the
    module is causal, else every key). Returns ``(out (B, Nq, Hq, Dv), None)``: attention weights
    are never materialised.
    """
    for name in ("s_aux", "sinks"):  # (sinks=: the Inkling 2 models' name for them; it was said to be a selection)
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"keyfold attention: learned attention sinks ({name}=) are not supported; "
                                      f"use attn_implementation='eager' for this model")
    for name in _CHANGES_THE_MATH:  # a model that hands its sparse selection to the kernel: dropped, the
        if kwargs.get(name) is not None:  # attention was dense, 4.1 off (MiniMax-M3's block_indices; 2026-12-08)
            raise NotImplementedError(f"keyfold attention: {type(module).__name__} passes {name}= (a selection "
                                      f"of keys the attention must apply), which keyfold does not take; use "
                                      f"attn_implementation='eager' or 'sdpa' for this model")
    if type(module).__name__ in _MASK_IN_THE_MODEL:
        raise NotImplementedError(f"keyfold attention: {type(module).__name__} folds the causal and padding mask "
                                  f"into its own bias only when the mask is not FlexAttention's, and keyfold's "
                                  f"mask passes for one (its tokens saw the future, 3.2 off; 2026-12-08); use "
                                  f"attn_implementation='eager' or 'sdpa' for this model")
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
        if key.shape[-2] > attention_mask.shape[-1]:
            # more keys than the mask describes: their positions are unknown (a DynamicCache's window of 1
            # keeps every key and its mask says 1: keyfold read key j at position kv_offset + j, 0.15-0.63 off;
            # eager and sdpa spread their one column over every key, itself not a window of 1; 2026-12-08)
            raise RuntimeError(f"keyfold attention: {type(module).__name__} got {key.shape[-2]} keys but its mask "
                               f"describes {attention_mask.shape[-1]}; the cache and the mask disagree (transformers' "
                               f"sliding-window cache with sliding_window=1 does): use a larger window, a "
                               f"StaticCache, or attn_implementation='eager'")
        mask, q_offset, kv_offset = attention_mask.mask, attention_mask.q_offset, attention_mask.kv_offset
        if isinstance(q_offset, torch.Tensor) and not torch.compiler.is_compiling():
            q_offset = int(q_offset)  # (compiled, the op reads it at run time)
    elif attention_mask is None:
        _check_mask_builder(module)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        mask = M.causal() if causal and query.shape[2] > 1 else None
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        # a prepared 4-D mask, which transformers passes through untouched (its documented way to give
        # packed or tree-shaped masks): bool (True attends) or additive float, (B, 1 or H, Nq, >= Nk),
        # read as eager and sdpa read it, cut to the keys of this call; a tensor mask (README "Tensor masks")
        mask = attention_mask[:, :, :, : key.shape[-2]]
    else:
        raise TypeError(
            f"keyfold attention got a {type(attention_mask).__name__} attention mask"
            f"{f' of {attention_mask.dim()} dims' if isinstance(attention_mask, torch.Tensor) else ''}; it takes "
            f"the mask its own mask builder makes, or a prepared 4-D tensor mask. Call "
            f"keyfold.integrations.transformers.register() before building the model, and pass the 2-D "
            f"attention_mask or a 4-D one to the model")
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
