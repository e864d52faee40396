"""The engine: ``attend`` (a partial State), ``attention`` (the output) and the piece backward.

Every variant goes through here: the mask and score modifier are settings; the planner
turns them into pieces; a backend computes the pieces; :mod:`keyfold.state` merges them.
"""

from __future__ import annotations

import contextlib

import math

import torch

from .kernels import Backend
from .kernels import cpu as _cpu
from .kernels import reference as _reference
from .kernels import tiles as _tiles
from .kernels._common import Problem
from .dense import tensor_mask
from .masks import Mask, as_mask, check_unchanged, default_q_offset, int_of_scalar, key_spans
from .planner import Plan, _plan, default_block
from .scores import aligned, as_score
from .state import State, empty_state, merge_all, state_dtype

__all__ = ["attend", "attention", "attend_backward", "attend_row_sums", "Backend"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TILE_SPAN = 1024  # longest key span of a piece whose scores are materialised (tiles, bias)
#: row bands of the tile backward that stands in for the CPU backend's (:meth:`_Call.tile_plan`), widest
#: first: the first whose (rows x widest piece) tile is at most q's Nq x D. At 1k tokens, 2 heads of 32,
#: 128-row bands put the forward+backward peak at 1.5x SDPA's, 32-row ones within it; at 4k tokens
#: 128-row bands take 0.7x the time of 32-row ones (causal, 8 heads of 64, 2 threads, AMD EPYC)
TILE_ROWS = (128, 64, 32)


def _span(Nq: int, block_size) -> int:
    """Longest key span of a forward piece whose scores are materialised: TILE_SPAN keys for a block of
    256 rows, and as many more keys as fewer rows leave room for (the same tile area), so that a
    decoding step over a long cache stays one piece: one row over 16k keys with ALiBi ran as 16 pieces
    of 1,024 keys, merged, 2.1-3.9x SDPA's time with the bias as a mask (a review, 2026-12-07). A
    caller's own block_size keeps TILE_SPAN."""
    if block_size is not None or Nq >= 256:
        return TILE_SPAN
    return TILE_SPAN * (256 // max(1, Nq))


# ------------------------------------------------------------------------- validation


def _check(q, k, v, scale, q_offset, kv_offset, check_inputs):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim) like SDPA, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} has dtype {t.dtype}; use float32, bfloat16, float16 or float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads but v has {v.shape[1]}; they must match")
    if (k.shape[1] == 0 and Hq != 0) or (k.shape[1] and Hq % k.shape[1] != 0):  # 0 and 0: an empty output
        raise ValueError(f"q has {Hq} heads and k/v have {k.shape[1]}: query heads must be a multiple "
                         f"of key/value heads (GQA/MQA); repeat k/v heads or change the head counts")
    if k.shape[-1] != D:
        raise ValueError(f"q and k head dims differ ({D} vs {k.shape[-1]}); they must match (v may differ)")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k has {k.shape[2]} keys but v has {v.shape[2]} values; they must match")
    if D == 0 or v.shape[-1] == 0:
        raise ValueError("head_dim must be >= 1")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None (1/sqrt(head_dim)), got {scale!r}")
    for name, x in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if kv_offset is not None and kv_offset < 0:
        raise ValueError(f"kv_offset must be >= 0 (an absolute position), got {kv_offset}")
    if check_inputs:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains NaN or inf (check_inputs=True); clean the input upstream")


class _Call:
    """A resolved call: problem settings, backend, plan."""

    def __init__(self, q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs,
                 dropout_p=0.0, dropout_seed=0, check_presets: bool = True):
        _check(q, k, v, scale, q_offset, kv_offset, check_inputs)
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a keyfold.Backend, got {backend!r}")
        B, Hq, Nq, D = q.shape
        Nk = k.shape[2]
        q_offset = Nk - Nq if q_offset is None else q_offset
        #: what lse gets back of a huge additive mask's row shift (dense.tensor_mask), or None
        self.lse_shift = None
        if isinstance(mask, torch.Tensor):  # SDPA's attn_mask: bool (True = attend) or additive float
            mask, bias = tensor_mask(mask, B=B, H=Hq, Nq=Nq, Nk=Nk, q_offset=q_offset, kv_offset=kv_offset)
            if bias is not None:
                score = [score, bias]
                self.lse_shift = bias.lse_shift
        mask = as_mask(mask)
        score = aligned(as_score(score), mask, B)  # (ALiBi inside each sequence of a varlen mask)
        if check_presets:  # (a piece's backward takes the forward's values, the preset's own: see _piece_call)
            check_unchanged(mask, score)
        if score is not None:
            score.check_heads(Hq)
            score.check_batch(B)
        self.pb = Problem(mask, score, float(1.0 / math.sqrt(D) if scale is None else scale), q_offset, kv_offset,
                          float(dropout_p), int(dropout_seed))
        #: Tensors the score reads that need gradients (empty unless one has requires_grad).
        self.score_tensors = _grad_tensors(score)
        self.auto = backend is Backend.AUTO
        self.backend = _resolve(backend, q, score, dropout_p)
        if self.backend is Backend.TRITON:
            why = _triton_refusal(q, k, v, self.pb, self.score_tensors)
            if why is not None:
                if backend is Backend.TRITON:  # named: run it or raise, never another backend
                    from .kernels import triton as _triton
                    raise _triton.refusal(why)
                self.backend = Backend.TILES   # AUTO: the tile kernel runs everything
        self.plan: Plan | None = None
        self._sizes = (B, Hq, Nq, Nk, D, block_size)  # for tile_plan; mask and offsets are in pb
        if self.backend is Backend.TRITON:  # it plans at its own tile size (cached)
            if mask is not None:
                mask.check_positions(q_offset, q_offset + Nq, kv_offset, kv_offset + Nk)
        elif self.backend is not Backend.REFERENCE:
            bounded = self.backend is Backend.TILES or (score is not None)
            self.plan = _plan(mask, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, B=B, H=Hq,
                              block_size=block_size, max_span=_span(Nq, block_size) if bounded else None,
                              allow_causal=self.backend is Backend.CPU)
        elif mask is not None:
            mask.check_positions(q_offset, q_offset + Nq, kv_offset, kv_offset + Nk)

    def forward(self, q, k, v, in_dtype: bool = False, lse_exact: bool = True, wide_lse: bool = False) -> State:
        """The merged State; with ``in_dtype`` the CPU backend may give ``out`` in the input dtype
        (a one-piece plan: the op's own tensor, not a float32 copy of it). ``lse_exact=False``: nobody
        uses lse beyond merging this call's pieces (no backward, no caller), so the tile kernel need
        not compute it the way a backward recomputes P, and the CPU backend need not check the fused
        op's lse of rows that see no key. ``wide_lse``: lse in float64 and out in float32
        on the CPU and tile backends (:func:`attend_wide`; float64 inputs' are float64 anyway)."""
        if self.backend is Backend.CPU:
            return _cpu.forward(q, k, v, self.plan, self.pb, keep_dtype=in_dtype, wide_lse=wide_lse,
                                lse_needed=lse_exact)
        if self.backend is Backend.TRITON:
            from .kernels import triton as _triton
            return _triton.forward(q, k, v, self.plan, self.pb, fallback=self.auto)
        if self.auto and q.is_cpu:  # a softcap: the prefill kernel (None where it does not run)
            st = _cpu.prefill(q, k, v, self.plan, self.pb, keep_dtype=in_dtype, wide_lse=wide_lse)
            if st is not None:
                return st
        return _tiles.forward(q, k, v, self.plan, self.pb, lse_exact=lse_exact, wide_lse=wide_lse)

    def backward(self, q, k, v, out, lse, dout, dlse, whole_rows: bool = True, sums=None, values=None):
        """``(dq, dk, dv, d_score_tensors)``; the last is a tuple aligned with ``score_tensors``.
        sums: the rows' totals of :func:`tiles.row_sums` (``attend_backward(row_sums=...)``; the call
        was made on Backend.TILES for them). values: ``{id(t): the forward's values}`` of score tensors
        changed in place since (:func:`_forward_values`), read in their place.

        The fused CPU op gives no dS, so when a score tensor needs its gradient the CPU backend
        runs the backward's pieces through the tile path (torch ops), which differentiates the
        score modifier tile by tile; the forward stays fused."""
        if self.score_tensors or sums is not None:
            dq, dk, dv, dts = _tiles.backward_with_score(q, k, v, out, lse, dout, dlse, self.plan, self.pb,
                                                         self.score_tensors, whole_rows, sums, values)
            # (None for a tensor the score never read; zeros for all where no pair was visible: tiles.py)
            return dq, dk, dv, dts
        if self.backend is Backend.CPU and _cpu.backward_on_tiles(q, k, v, self.plan, self.pb, whole_rows):
            return (*_tiles.backward(q, k, v, out, lse, dout, dlse, self.tile_plan(), self.pb, whole_rows), ())
        if self.backend is Backend.CPU:
            # the engine's own backward takes the gradients in the input dtype (a one-piece plan's
            # come from the op as they are); attend_backward's stay float32 as documented
            return (*_cpu.backward(q, k, v, out, lse, dout, dlse, self.plan, self.pb, whole_rows,
                                   grad_dtype=q.dtype if whole_rows else None), ())
        if self.backend is Backend.TRITON:
            from .kernels import triton as _triton
            return (*_triton.backward(q, k, v, out, lse, dout, dlse, self.plan, self.pb, fallback=self.auto), ())
        return (*_tiles.backward(q, k, v, out, lse, dout, dlse, self.plan, self.pb, whole_rows), ())

    def tile_plan(self) -> Plan:
        """The plan (cached) by which the tile kernel's backward stands in for the CPU backend's: pieces
        at most TILE_SPAN keys wide, row bands of TILE_ROWS."""
        B, Hq, Nq, Nk, D, block_size = self._sizes

        def planned(bs):
            return _plan(self.pb.mask, Nq, Nk, q_offset=self.pb.q_offset, kv_offset=self.pb.kv_offset, B=B, H=Hq,
                         block_size=bs, max_span=TILE_SPAN)

        if block_size is None:
            bk, rows = default_block(Nq, Nk)[1], TILE_ROWS[0]
        else:  # the caller's key blocks; row bands no wider than TILE_ROWS[0] (a 2048-row block held 3.3x
            # the memory of the CPU op's backward)
            bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
            rows = min(bq, TILE_ROWS[0])
        plan = planned((min(rows, max(1, Nq)), bk))
        # a tile's few (rows x span) float32 tensors are a constant beside the call's own (Nq x D) ones:
        # narrower row bands where they would outweigh q, so the peak stays SDPA's on short calls
        span = max((pc.k1 - pc.k0 for pc in plan.pieces), default=0)
        for narrower in (r for r in TILE_ROWS[1:] if r < rows):
            if rows * span <= Nq * D:
                break
            rows = narrower
            plan = planned((min(rows, max(1, Nq)), bk))
        return plan


def _triton_refusal(q, k, v, pb: Problem, score_tensors) -> str | None:
    """What in this call the Triton kernel cannot run, or None."""
    from .kernels import triton as _triton
    if score_tensors:
        return (f"gradients for the {len(score_tensors)} tensor(s) the score modifier {pb.score!r} reads "
                f"with requires_grad (or run under torch.no_grad() / detach them)")
    return _triton.why_not_native(q, k, v, pb)


def _grad_tensors(score) -> tuple:
    """The score's tensors that need gradients in this call (nothing to look at without a score)."""
    if score is None or not torch.is_grad_enabled():
        return ()
    seen: set = set()  # each once (a ScoreMod's tensors() may repeat one): autograd adds what each entry gets
    got = tuple(t for t in score.tensors() if t.requires_grad and not (id(t) in seen or seen.add(id(t))))
    if _reads_unseen_grad(score, got):
        raise ValueError(f"score={score!r} reads a tensor that requires grad, and keyfold's walk of what the "
                         f"callable captures gave up before finding it (too many objects on the way, such as "
                         f"sys.modules), so it would get no gradient: name it, "
                         f"keyfold.score_fn(fn, tensors=[table])")
    return got


def _reads_unseen_grad(score, found) -> bool:
    parts = score.parts()
    if parts is not None:
        return any(_reads_unseen_grad(p, found) for p in parts)
    check = getattr(score, "reads_unseen_grad", None)
    return bool(check(found)) if check is not None else False


def _resolve(backend: Backend, q, score, dropout_p: float = 0.0) -> Backend:
    """The backend that runs the call. ``Backend.AUTO`` routes by device and by what the call
    needs; a backend the caller names runs the call or raises, saying which one can: it is
    never swapped for another."""
    nonadditive = score is not None and not score.additive
    if backend is Backend.AUTO:
        if q.device.type == "cuda":
            from .kernels import triton as _triton
            backend = Backend.TRITON if _triton.available() and not dropout_p else Backend.TILES
        elif q.device.type == "cpu" and _cpu.AVAILABLE and not nonadditive and not dropout_p:
            backend = Backend.CPU
        else:  # softcap, score callables and dropout run tile by tile in torch ops
            backend = Backend.TILES
    if backend is Backend.CPU:
        if q.device.type != "cpu":
            raise ValueError(f"backend=Backend.CPU needs CPU tensors, got {q.device}; use Backend.AUTO")
        if not _cpu.AVAILABLE:
            raise ValueError(f"backend=Backend.CPU: torch {torch.__version__} lacks the fused CPU flash op "
                             f"(aten._scaled_dot_product_flash_attention_for_cpu) it runs on; use Backend.TILES, "
                             f"or Backend.AUTO, which routes there")
        if nonadditive:
            raise ValueError(f"backend=Backend.CPU: score={score!r} is not additive (softcap and score_mod "
                             f"callables are not), and the fused CPU op takes only an additive bias; use "
                             f"Backend.TILES, or Backend.AUTO, which routes such scores there")
        if dropout_p:
            raise ValueError(f"backend=Backend.CPU: dropout_p={dropout_p} needs a keep mask per tile, which the "
                             f"fused CPU op cannot apply; use Backend.TILES, or Backend.AUTO, which routes "
                             f"dropout there (or dropout_p=0.0)")
    if backend is Backend.TRITON:
        if dropout_p:
            raise ValueError(f"backend=Backend.TRITON: dropout_p={dropout_p}: the Triton kernel has no attention "
                             f"dropout; use Backend.TILES (or Backend.AUTO, which routes dropout there), or "
                             f"dropout_p=0.0")
        from .kernels import triton as _triton
        _triton.check_supported(q, score)
    return backend


# --------------------------------------------------------------------------- autograd


class _NoSecondOrder(torch.autograd.Function):
    """Identity on a backward's gradients, whose own backward raises: a second derivative through
    attention stops here, loudly. Every backend's backward recomputes P from detached scores, so
    the graph a backward under create_graph=True records holds no term through P's dependence on
    q, k and the score's tensors (TILES: a gradient penalty's d/dq off by 0.67 where it is at most
    0.55). q, k and those tensors are inputs, so a penalty summed with other terms still reaches
    this node; a backward(create_graph=True) that nobody differentiates again runs as before."""

    @staticmethod
    def forward(ctx, message: str, n: int, *tensors):
        ctx.message = message
        return tuple(t.clone() for t in tensors[len(tensors) - n:])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


_SECOND_ORDER = ("keyfold attention has no second derivative through q, k or a score's tensors (a gradient "
                 "penalty or Hessian-vector product over attention): backend=Backend.REFERENCE runs plain "
                 "torch ops that differentiate twice (it holds the N x N scores)")


def refuse_second_order(grads: tuple, watched: tuple, message: str = _SECOND_ORDER) -> tuple:
    """``grads`` as they are, unless this backward runs under create_graph=True for ``watched``
    tensors that need gradients: then behind :class:`_NoSecondOrder` (None entries pass)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in watched):
        return grads
    live = [g for g in grads if g is not None]
    out = iter(_NoSecondOrder.apply(message, len(live), *watched, *live))
    return tuple(None if g is None else next(out) for g in grads)


def _live_state(call: _Call, score_tensors) -> tuple:
    """``(tensor, version, copy or None)`` for each tensor the score modifier reads live
    (``ScoreMod.live_tensors``): the backward runs the modifier again, on the tensors as they are then.
    A copy of each trained tensor of up to ``tiles.WIDE_TENSOR`` elements (a table, a slope) is kept,
    for the backward to read should it change in place before then (a clamp under no_grad in the next
    layer's forward): it differentiates the forward's values, as autograd of a plain attention does."""
    if call.pb.score is None:
        return ()
    trained = {id(t) for t in score_tensors}
    return tuple((t, t._version, t.detach().clone() if id(t) in trained and t.numel() <= _tiles.WIDE_TENSOR else None)
                 for t in call.pb.score.live_tensors() if not t.is_inference())


def _forward_values(call: _Call, live: tuple) -> dict:
    """``{id(t): the forward's values}`` of the live tensors changed in place since the forward (see
    :func:`_live_state`); raises for one with no copy (a buffer, a tensor past WIDE_TENSOR elements),
    whose values the backward would read anew: the gradient of another function, silently (dq 2.2 off
    against 0.9 for a buffer negated in between; a review, 2026-12-07)."""
    values = {}
    for t, n, copy in live:
        if t._version == n:
            continue
        if copy is None:
            raise RuntimeError(
                f"keyfold: a tensor the score modifier {call.pb.score!r} reads (shape {tuple(t.shape)}, {t.dtype}) "
                f"was modified in place between the forward and the backward (version {n} -> {t._version}); the "
                "backward would read its new values. Change it after backward() (as an optimizer step does), or "
                "pass a copy to the call")
        values[id(t)] = copy
    return values


class _AttendFn(torch.autograd.Function):
    """Forward: merged (out, lse) in float32. Backward: per piece with the global (out, lse).

    in_dtype (``attention``, which returns out in the input dtype): on the CPU backend out comes
    back, and is saved, in the input dtype. Its backward reads O in that dtype anyway, so a
    16-bit call then holds no float32 copy of out, and its dout arrives 16-bit, not upcast."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call, in_dtype: bool, wide_lse: bool, *score_tensors):
        # score_tensors (call.score_tensors) are inputs only so that autograd routes their
        # gradients here; the score modifier reads them itself. wide_lse (attend_wide): lse comes out in
        # float64 for the caller's merge; the backward reads it in float32, as every call's
        cast = in_dtype and call.backend is Backend.CPU
        st = call.forward(q, k, v, in_dtype=cast, wide_lse=wide_lse)
        out = st.out.to(q.dtype) if cast else st.out
        ctx.call = call
        ctx.live = _live_state(call, score_tensors)
        ctx.save_for_backward(q, k, v, out, st.lse.to(state_dtype(q.dtype)))
        return out, st.lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        call: _Call = ctx.call
        values = _forward_values(call, ctx.live)
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None:
            dlse = dlse.to(lse.dtype)  # (a wide lse's is float64)
        if dlse is not None and q.device.type == "cpu" and not bool(dlse.any()):
            dlse = None  # (on a GPU this check would cost a sync; the kernels take dlse = 0 as is)
        with no_autocast(q):  # a backward run inside an autocast region
            dq, dk, dv, dts = call.backward(q, k, v, out, lse, dout, dlse, values=values)
        dq, dk, dv, *dts = refuse_second_order((dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *dts),
                                               (q, k, *call.score_tensors))
        return (dq, dk, dv, None, None, None, *dts)


def _run(q, k, v, call: _Call, in_dtype: bool = False, lse_exact: bool = True, wide_lse: bool = False) -> State:
    """The call's State; ``in_dtype``: out may come back in the input dtype (see _AttendFn);
    ``lse_exact``: as in :meth:`_Call.forward` (a backward always needs it); ``wide_lse``: as there,
    recorded by autograd or not (a recorded call's backward reads its lse in float32)."""
    if q.shape[1] == 0:  # no heads (and k, v have none): an empty output, as SDPA gives
        return empty_state(q.shape[0], 0, q.shape[2], v.shape[-1], dtype=state_dtype(q.dtype), device=q.device,
                           of=(q, k, v))
    if call.backend is Backend.REFERENCE:
        return _reference.attend_reference(q, k, v, call.pb)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or call.score_tensors):
        out, lse = _AttendFn.apply(q, k, v, call, in_dtype, wide_lse, *call.score_tensors)
        return State(out, lse)
    return call.forward(q, k, v, in_dtype=in_dtype, lse_exact=lse_exact, wide_lse=wide_lse)


# ------------------------------------------------------------------------------ public


def attend(q, k, v, *, mask=None, score=None, scale=None, q_offset=None, kv_offset=0,
           backend=Backend.AUTO, block_size=None, check_inputs=False, dropout_p=0.0, dropout_seed=None,
           generator=None) -> State:
    """Partial attention of ``q`` over exactly the keys given: a mergeable :class:`State`.

    q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``; ``Hq % Hkv == 0``
    (GQA/MQA). dtypes float16, bfloat16, float32, float64 (all three alike).
    mask: a keyfold mask (``causal()``, ``window(...)``, ...), a Flex ``mask_mod`` callable, None, or a
        tensor as SDPA takes it, broadcastable to ``(B, Hq, Nq, Nk)`` and indexed relative to this call:
        bool (True = attend) or additive float (``-inf`` = hidden; float64 stays float64; with
        ``requires_grad`` it gets its gradient). A dense mask costs a private copy and one
        classification pass; a mask object costs neither (README, "Tensor masks").
    score: ``alibi(...)``, ``softcap(...)``, a Flex ``score_mod`` callable, a list of them, or None.
    scale: defaults to ``1/sqrt(D)``.
    dropout_p: SDPA's attention dropout: probabilities are dropped after the softmax with probability
        ``dropout_p`` and kept ones scaled by ``1/(1-dropout_p)``; lse is unchanged. The mask is a hash of
        ``(dropout_seed, b, h, query, key)``, regenerated per tile in backward (runs on Backend.TILES).
        dropout_seed: an int; None draws one from ``generator`` (default: torch's global generator,
        so ``torch.manual_seed`` makes it reproducible).
    q_offset: absolute position of the first query; default ``kv_offset + Nk - Nq`` is
        bottom-right alignment relative to these keys (decoding); pass 0 for Flex's top-left.
        With a ``varlen(...)`` mask (packed queries) the default is 0.
    kv_offset: absolute position of the first key (a chunk, page or shard of a longer sequence).

    Under ``torch.compile`` the call is one custom op, ``keyfold::attend`` (:mod:`keyfold.ops`):
    no graph breaks, ``fullgraph=True`` works.

    Returns ``State(out, lse)``: out ``(B, Hq, Nq, Dv)`` and lse ``(B, Hq, Nq)`` in float32
    (float64 for float64 inputs). A row that sees no key has out 0 and lse -inf. The result is
    differentiable in q, k and v through both out and lse.

    >>> import torch, keyfold
    >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    >>> a = keyfold.attend(q, k[:, :, :3], v[:, :, :3], q_offset=2)
    >>> b = keyfold.attend(q, k[:, :, 3:], v[:, :, 3:], q_offset=2, kv_offset=3)
    >>> whole = keyfold.attend(q, k, v)
    >>> torch.allclose(keyfold.merge(a, b).out, whole.out, atol=1e-6)
    True
    """
    return _attend(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs, dropout_p,
                   dropout_seed, generator, in_dtype=False, lse_exact=True)


def attend_wide(q, k, v, *, mask=None, score=None, scale=None, q_offset=None, kv_offset=0,
                backend=Backend.AUTO) -> State:
    """:func:`attend` for callers that merge the states they get (decoding's split-KV chunks, a window
    cache's sinks and band, pages, a cascade's prefix and suffix; your own merges of key chunks): the
    state's lse is float64 (a wide lse, see :class:`State`) and its out float32, never rounded
    to 16 bits, on the CPU and tile backends, the kernels' ``m + log(sum)`` summed in double. A float32
    lse carries 2^-24 |lse| (4e-6 at lse 65), which a merge passes to out, and 16-bit pieces' outs
    rounded each to 16 bits round once per piece: merged pieces broke the 2x rule where one call over
    the same keys did not. A call autograd records gets the same (its backward reads lse in float32;
    until 2026-12-07 it got attend's float32 lse). float64 inputs and the Triton kernel (its lse is
    float32): what :func:`attend` gives."""
    return _attend(q, k, v, mask, score, scale, q_offset, kv_offset, backend, None, False, 0.0, None, None,
                   in_dtype=False, lse_exact=True, wide_lse=True)


def attend_out(q, k, v, *, mask=None, score=None, scale=None, q_offset=None, kv_offset=0,
               backend=Backend.AUTO) -> State:
    """:func:`attend` for keyfold's own callers that read only the state's out (a decoding step whose lse
    nobody asked for): lse is what ``attention(..., return_lse=False)`` computes, not the exact one a
    backward or a merge needs (the tile kernel's softmax path, and no check of the fused op's lse on
    rows that see no key, whose small ops after a step's stream of keys cost 50-80 us)."""
    return _attend(q, k, v, mask, score, scale, q_offset, kv_offset, backend, None, False, 0.0, None, None,
                   in_dtype=False, lse_exact=False)


_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_dtype(t) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts attention's inputs to on ``t``'s device, or None where it
    is off (SDPA is on autocast's lower-precision list: float32, float16 and bfloat16 inputs go to
    its dtype, float64 stays). A device autocast does not know (meta) has none."""
    if (not isinstance(t, torch.Tensor) or not torch.amp.is_autocast_available(t.device.type)
            or not torch.is_autocast_enabled(t.device.type)):
        return None
    return torch.get_autocast_dtype(t.device.type)


def no_autocast(t: torch.Tensor):
    """A context with autocast off on ``t``'s device (nothing to turn off where it has none)"""
    if not torch.amp.is_autocast_available(t.device.type):
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


def autocast_inputs(dt: torch.dtype | None, *ts):
    """``ts`` cast as autocast casts SDPA's inputs to ``dt`` (None: as they are)"""
    if dt is None:
        return ts
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_ELIGIBLE else t for t in ts)


def settle_autocast(q, k, v):
    """``(q, k, v, context)``: the inputs cast as autocast casts SDPA's, and a context to compute
    them in with autocast off (nothing to turn off where autocast is)"""
    dt = autocast_dtype(q)
    q, k, v = autocast_inputs(dt, q, k, v)
    return q, k, v, (no_autocast(q) if dt is not None else contextlib.nullcontext())


def _attend(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs, dropout_p,
            dropout_seed, generator, in_dtype: bool, lse_exact: bool, wide_lse: bool = False) -> State:
    """:func:`attend`; with ``in_dtype`` (``attention``, which casts out to the input dtype) out
    may already come back in it, sparing a float32 copy of out (see _AttendFn); ``lse_exact=False``
    when the caller drops lse (see :meth:`_Call.forward`).

    Under ``torch.autocast`` the inputs are cast as SDPA's are (to the autocast dtype; float64
    stays) and the call runs with autocast off: the tile path's products, meant in float32, had
    run in bfloat16 under it, its lse from those scores against a backward recomputing them in
    float32 (dv 4.4x torch's error, a helper's fuzz), and q, k, v of two dtypes (float32 q and k
    after RoPE, bfloat16 v) were refused where torch casts them."""
    q, k, v, settled = settle_autocast(q, k, v)
    with settled:
        return _attend_here(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs,
                            dropout_p, dropout_seed, generator, in_dtype, lse_exact, wide_lse)


def _attend_here(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs, dropout_p,
                 dropout_seed, generator, in_dtype: bool, lse_exact: bool, wide_lse: bool = False) -> State:
    """:func:`_attend` with autocast settled (``wide_lse``: :func:`attend_wide`)"""
    if torch.compiler.is_compiling():  # one opaque custom op: dynamo never traces the planner
        if dropout_p:
            raise NotImplementedError("keyfold: dropout_p > 0 inside torch.compile is not supported yet; "
                                      "run attention dropout eagerly, or set dropout_p=0 in the compiled model")
        from .ops import attend_op
        return attend_op(q, k, v, mask=mask, score=score, scale=scale, q_offset=q_offset, kv_offset=kv_offset,
                         backend=backend, block_size=block_size, check_inputs=check_inputs)
    # a position given as a 0-d integer tensor (a static cache's, data of the graph when compiled) is its int
    # eagerly too: a compiled decode step raised TypeError when run eagerly (a review, 2026-12-07)
    q_offset, kv_offset = int_of_scalar(q_offset), int_of_scalar(kv_offset)
    if mask is None and score is None and not dropout_p and _plain_fused(
            q, k, v, backend, block_size, check_inputs, scale, q_offset, kv_offset):
        return _cpu.dense(q, k, v, float(q.shape[-1] ** -0.5 if scale is None else scale), keep_dtype=in_dtype,
                          wide_lse=wide_lse, lse_needed=lse_exact)
    if q_offset is None and isinstance(k, torch.Tensor) and isinstance(q, torch.Tensor) and k.dim() == 4 and q.dim() == 4:
        q_offset = default_q_offset(_mask_object(mask), q.shape[2], k.shape[2], kv_offset)
    spans = _one_row_keys(q, k, v, mask, score, q_offset, kv_offset, backend, block_size, check_inputs, dropout_p)
    if spans is not None:  # a decoding step's row under a closed-form mask: its keys alone, no mask, no plan
        if len(spans) == 1:
            a, e = spans[0]
            return _attend_here(q, k[:, :, a:e], v[:, :, a:e], None, score, scale, q_offset, kv_offset + a, backend,
                                block_size, check_inputs, dropout_p, dropout_seed, generator, in_dtype, lse_exact,
                                wide_lse)
        # several ranges (sinks beside a window): few bytes are copied together (one call: each range's own
        # took 1.7-2.3x the copy's time at windows of 64-256), more attended one state each, merged, wide
        # (16-bit pieces rounded each would carry a rounding per piece, see attend_wide): copying them
        # together cost 2.4-10x the planned path's time over wide ranges (a fresh buffer a step; reviews,
        # 2026-12-08)
        copied = sum(e - a for a, e in spans) * k.shape[0] * k.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size()
        if copied <= _CAT_BYTES and score is None:
            k, v = (torch.cat([t[:, :, a:e] for a, e in spans], 2) for t in (k, v))
            return _attend_here(q, k, v, None, None, scale, q_offset, kv_offset, backend, block_size, check_inputs,
                                dropout_p, dropout_seed, generator, in_dtype, lse_exact, wide_lse)
        st = merge_all([_attend_here(q, k[:, :, a:e], v[:, :, a:e], None, score, scale, q_offset, kv_offset + a,
                                     backend, block_size, check_inputs, dropout_p, dropout_seed, generator,
                                     False, True, True) for a, e in spans])
        return st if wide_lse or st.lse.dtype == st.out.dtype else State(st.out, st.lse.to(st.out.dtype))
    dropout_p, dropout_seed = _dropout_args(dropout_p, dropout_seed, generator)
    call = _Call(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs,
                 dropout_p, dropout_seed)
    st = _run(q, k, v, call, in_dtype, lse_exact, wide_lse)
    return st if call.lse_shift is None else with_lse_shift(st, call.lse_shift)


#: most bytes of keys and values a decoding row's several key ranges are copied together for (see _attend_here)
_CAT_BYTES = 1 << 20


def _one_row_keys(q, k, v, mask, score, q_offset, kv_offset, backend, block_size, check_inputs, dropout_p):
    """For one query row (a decoding step) under a mask of closed forms (:func:`keyfold.masks.key_spans`):
    the key index ranges ``[(a, b), ...]`` it sees, else None. Attention over exactly those keys with no
    mask is the same softmax: a window's or causal cache's step then skips planning (a window of 512
    over a 4k cache took 0.9-1.2 ms a step, 18x SDPA on the window's slice; 2026-12-08). None where the
    row sees no key, or sees several ranges and autograd records the call (the general path answers)."""
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
            or q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != 1 or k.shape[2] != v.shape[2]
            or not isinstance(mask, Mask) or dropout_p or backend is not Backend.AUTO or block_size is not None
            or check_inputs or type(q_offset) is not int or type(kv_offset) is not int or kv_offset < 0):
        return None
    spans = key_spans(mask, q_offset, kv_offset, kv_offset + k.shape[2])
    if not spans or (len(spans) > 1 and torch.is_grad_enabled()
                     and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return None  # (several ranges merge states: a backward through merged pieces is the general path's)
    return [(a - kv_offset, b - kv_offset) for a, b in spans]


def with_lse_shift(st: State, shift: torch.Tensor) -> State:
    """``st`` with ``shift`` (broadcast over its rows) added to lse: a row shift of an additive mask
    that the softmax never saw (dense.tensor_mask); a wide lse (float64 beside float32 out) is held
    within float32's range, which it returns to"""
    held = torch.float32 if st.lse.dtype is torch.float64 and st.out.dtype is not torch.float64 else st.lse.dtype
    return State(st.out, st.lse + shift_in(shift, held).to(st.lse.dtype))


def shift_in(shift: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A row shift in ``dtype``, held at its most negative number: a float64 mask's finfo.min
    on float32 inputs would overflow to -inf and call a row that sees keys empty"""
    return shift.double().clamp(min=torch.finfo(dtype).min).to(dtype)


def _mask_object(mask):
    """The mask as a keyfold Mask (a tensor mask is converted later, with the call's offsets)."""
    return None if isinstance(mask, torch.Tensor) else as_mask(mask)


def _dropout_args(p, seed, generator):
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {p!r}")
    if not p:
        return 0.0, 0
    if seed is None:
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"dropout_seed must be an int in [0, 2**64) or None, got {seed!r}")
    return float(p), seed


def _plain_fused(q, k, v, backend, block_size, check_inputs, scale, q_offset, kv_offset) -> bool:
    """A call with nothing to plan (no mask, no score, equal heads and head dims, no autograd):
    one fused call, without the planner's bookkeeping. Decoding steps are mostly this, and at
    4k keys the kernel takes ~0.4 ms. The test is written for speed (shapes read once, cheap
    attributes first): after the kernel has streamed the cache through L2, every Python object
    this touches is a cache miss, so each line here costs ~5x what it costs in a warm loop."""
    if ((backend is not Backend.AUTO and backend is not Backend.CPU) or block_size is not None or check_inputs
            or type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor):
        return False
    dt = q.dtype
    if not (q.is_cpu and k.is_cpu and v.is_cpu and k.dtype == dt and v.dtype == dt and dt in _FLOATS
            and _cpu.AVAILABLE):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    if not (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and qs[0] == ks[0] == vs[0] and qs[1] == ks[1] == vs[1]
            and qs[3] == ks[3] == vs[3] and ks[2] == vs[2] and qs[2] > 0 and ks[2] > 0 and qs[1] > 0 and qs[3] > 0):
        return False
    if not (scale is None or (type(scale) in (int, float) and math.isfinite(scale))):
        return False
    if type(kv_offset) is not int or kv_offset < 0 or not (q_offset is None or type(q_offset) is int):
        return False
    return not ((q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled())


def attention(q, k, v, *, mask=None, score=None, scale=None, q_offset=None, kv_offset=0,
              return_lse=False, backend=Backend.AUTO, block_size=None, check_inputs=False, dropout_p=0.0,
              dropout_seed=None, generator=None):
    """Exact attention, every variant through one engine; differentiable in q, k, v.

    Same arguments as :func:`attend`. Returns ``out`` ``(B, Hq, Nq, Dv)`` in the input dtype, or
    ``(out, lse)`` with ``return_lse=True`` (lse float32, natural log). Rows that see no key
    give 0 (and lse -inf), with zero gradients, never NaN.

    >>> import torch, keyfold
    >>> q = k = v = torch.randn(1, 8, 128, 64)
    >>> out = keyfold.attention(q, k, v, mask=keyfold.causal() & keyfold.window(32))
    >>> out.shape
    torch.Size([1, 8, 128, 64])
    """
    q, k, v = autocast_inputs(autocast_dtype(q), q, k, v)  # out in autocast's dtype, as SDPA's
    st = _attend(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs, dropout_p,
                 dropout_seed, generator, in_dtype=True, lse_exact=return_lse)
    out = st.out.to(q.dtype)
    return (out, st.lse) if return_lse else out


def unshifted_lse(q, k, v, call: _Call, lse: torch.Tensor, lse_shift: torch.Tensor) -> torch.Tensor:
    """The lse ``attend_backward`` recomputes P against, for a call whose dense mask had huge rows
    shifted (dense.shifted_bias): the given lse minus the shift. Where the given lse is the shift
    plus a number its own rounding cannot hold (a float32 lse of finfo.min + log 16 is finfo.min)
    and equals this piece's own lse to that rounding, the piece's own lse is taken: subtracting gave
    nothing of it back (gradients off by 10-170, found by fuzzing 2026-12-06). An lse merged over
    chunks of such a row that rounding cannot tell from one chunk's stays wrong (README)."""
    shift = torch.broadcast_to(shift_in(lse_shift, lse.dtype).double(), lse.shape)
    rel = lse.double() - shift
    ulp = torch.nextafter(shift.abs().to(lse.dtype), torch.tensor(math.inf, dtype=lse.dtype)).double() - shift.abs()
    coarse = (shift != 0) & (ulp > 2.0 ** -20) & (rel.abs() <= 2.0 ** 10)
    if bool(coarse.any()):
        with torch.no_grad():
            own = call.forward(q.detach(), k.detach(), v.detach()).lse.double()
        # only where the given lse is this piece's own, to its rounding: an lse merged over other
        # chunks of the row differs by more than that, and is taken apart by subtraction (review of
        # 2026-12-06: the own lse for a merged one put each chunk at 1, gradients off by 0.1-1.6)
        mine = coarse & ((own + shift - lse.double()).abs() <= ulp)
        rel = torch.where(mine, own, rel)
    return rel.to(lse.dtype)


def _piece_call(name, q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, dropout_p, dropout_seed,
                renormalised: bool) -> _Call:
    """The resolved call of one piece's backward (:func:`attend_backward`, :func:`attend_row_sums`).
    ``renormalised``: it runs with a row's totals, which only the tile kernel takes (its P and dP are
    the ones :func:`attend_row_sums` sums; another kernel's would differ in the last bits)."""
    if q_offset is None and isinstance(k, torch.Tensor) and k.dim() == 4 and q.dim() == 4:
        q_offset = default_q_offset(_mask_object(mask), q.shape[2], k.shape[2], kv_offset)
    if backend is Backend.REFERENCE:
        raise ValueError(f"{name}(backend=Backend.REFERENCE): the reference has no piece backward (it "
                         f"differentiates its own forward with autograd); use Backend.TILES, or Backend.AUTO")
    if renormalised:
        if backend not in (Backend.AUTO, Backend.TILES):
            raise ValueError(f"{name}(backend={backend}) with row sums: P and dP must be the ones attend_row_sums "
                             f"sums, which the tile kernel computes; use Backend.TILES, or Backend.AUTO")
        backend = Backend.TILES
    # no stale-preset check: a piece's backward differentiates the forward that ran, with the values the
    # preset held then (raised there, one rank of a ring's backward left the others waiting out the group's
    # timeout; a review, 2026-12-08)
    with torch.enable_grad():  # backward hooks run without grad mode; the score tensors still need theirs
        return _Call(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, False,
                     *_dropout_args(dropout_p, dropout_seed, None), check_presets=False)


def _piece_lse(q, k, v, call: _Call, lse):
    lse = lse.detach()
    return lse if call.lse_shift is None else unshifted_lse(q, k, v, call, lse, call.lse_shift)


def attend_row_sums(q, k, v, lse, dout, *, mask=None, score=None, scale=None, q_offset=None, kv_offset=0,
                    block_size=None, dropout_p=0.0, dropout_seed=0):
    """One piece's share of each row's totals for a renormalised :func:`attend_backward`:
    ``(3, B, Hq, Nq)`` float64, the sums over this piece's keys of P = exp(s - lse), of P dP
    (dP = dO V^T) and of keys with P > 0 (``keyfold.kernels.tiles.ROW_SUMS``).

    lse: the *global* lse of the rows ``(B, Hq, Nq)``; dout: the global output's gradient. Sum
    the shares over every piece of the rows' keys and hand the total to each piece's
    ``attend_backward(..., row_sums=total)`` with the same arguments: its P then sums to 1 over
    the row and D_i = sum P dP, as one softmax's backward takes them, whatever the rounding of
    the forward's lse, and a row whose P is one key's gets dS = 0 there exactly. Ring attention's
    backward does this (a pass over the key shards before the gradients). Runs on the tile kernel.
    """
    call = _piece_call("attend_row_sums", q, k, v, mask, score, scale, q_offset, kv_offset, Backend.AUTO, block_size,
                       dropout_p, dropout_seed, True)
    with torch.no_grad():
        return _tiles.row_sums(q.detach(), k.detach(), v.detach(), _piece_lse(q, k, v, call, lse), dout.detach(),
                               call.plan, call.pb)


def attend_backward(q, k, v, out, lse, dout, *, mask=None, score=None, scale=None, q_offset=None,
                    kv_offset=0, dlse=None, backend=Backend.AUTO, block_size=None, score_grads=False,
                    dropout_p=0.0, dropout_seed=0, row_sums=None):
    """Gradients of one piece of keys, given the *global* ``out`` and ``lse`` (docs/math.md §2).

    out: ``(B, Hq, Nq, Dv)`` the final merged output; lse ``(B, Hq, Nq)`` the final lse; dout
    its gradient; dlse an optional gradient of lse. Returns ``(dq, dk, dv)`` in float32
    (float64 for float64 inputs): dq is this piece's share (sum the shares over pieces), dk and
    dv are this piece's keys' full gradients. Ring attention and split-KV backward use this.

    row_sums: ``(3, B, Hq, Nq)`` float64, the totals of :func:`attend_row_sums` over every piece
    of the rows' keys, or None. With them P is renormalised over the whole row and D_i is
    sum P dP instead of dO . O: gradients as one process's backward gives them (a row that
    sees one key gets dq = dk = 0 exactly). They run on the tile kernel (Backend.AUTO or TILES).

    score_grads: also return the gradients of the tensors the score modifier reads that have
    ``requires_grad`` (``score.tensors()``), as a fourth item: a tuple ``((tensor, grad), ...)``
    of this piece's shares (sum them over pieces; grad is None where the tensor had no
    effect). Without it, such tensors make this raise rather than lose their gradient.
    """
    if row_sums is not None:
        if not isinstance(row_sums, torch.Tensor) or tuple(row_sums.shape) != (3, *q.shape[:3]):
            raise ValueError(f"row_sums must be the (3, B, Hq, Nq) = (3, {', '.join(map(str, q.shape[:3]))}) totals "
                             f"of attend_row_sums over the rows' pieces, got {getattr(row_sums, 'shape', row_sums)!r}")
    call = _piece_call("attend_backward", q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size,
                       dropout_p, dropout_seed, row_sums is not None)
    if call.score_tensors and not score_grads:
        raise ValueError(f"attend_backward: the score modifier {call.pb.score!r} reads "
                         f"{len(call.score_tensors)} tensor(s) with requires_grad; pass score_grads=True "
                         f"and add the returned gradients to them, or detach them")
    lse = _piece_lse(q, k, v, call, lse)
    dq, dk, dv, dts = call.backward(q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                    dout.detach(), None if dlse is None else dlse.detach(), whole_rows=False,
                                    sums=None if row_sums is None else row_sums.detach().to(torch.float64))
    if score_grads:
        return dq, dk, dv, tuple(zip(call.score_tensors, dts))
    return dq, dk, dv
