"""The engine: ``attend`` (a partial State), ``attention`` (the output) and the piece backward.

Every variant goes through here: the mask and score modifier are settings; the planner
turns them into pieces; a backend computes the pieces; :mod:`keyfold.state` merges them.
"""

from __future__ import annotations

import math

import torch

from .kernels import Backend
from .kernels import cpu as _cpu
from .kernels import reference as _reference
from .kernels import tiles as _tiles
from .kernels._common import Problem
from .masks import as_mask, default_q_offset
from .planner import Plan, _plan
from .scores import as_score
from .state import State

__all__ = ["attend", "attention", "attend_backward", "Backend"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TILE_SPAN = 1024  # longest key span of a piece whose scores are materialised (tiles, bias)


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
    if k.shape[1] == 0 or Hq % k.shape[1] != 0:
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

    def __init__(self, q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs):
        _check(q, k, v, scale, q_offset, kv_offset, check_inputs)
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a keyfold.Backend, got {backend!r}")
        B, Hq, Nq, D = q.shape
        Nk = k.shape[2]
        mask = as_mask(mask)
        score = as_score(score)
        if score is not None:
            score.check_heads(Hq)
            score.check_batch(B)
        q_offset = Nk - Nq if q_offset is None else q_offset
        self.pb = Problem(mask, score, float(1.0 / math.sqrt(D) if scale is None else scale), q_offset, kv_offset)
        self.backend = _resolve(backend, q, score)
        if self.backend is Backend.CPU and (Nq == 0 or Nk == 0):  # the fused op dies of SIGFPE on an empty sequence
            self.backend = Backend.TILES
        self.plan: Plan | None = None
        if self.backend is Backend.TRITON:  # it plans at its own tile size (cached)
            if mask is not None:
                mask.check_positions(q_offset, q_offset + Nq, kv_offset, kv_offset + Nk)
        elif self.backend is not Backend.REFERENCE:
            bounded = self.backend is Backend.TILES or (score is not None)
            self.plan = _plan(mask, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, B=B, H=Hq,
                              block_size=block_size, max_span=TILE_SPAN if bounded else None,
                              allow_causal=self.backend is Backend.CPU)
        elif mask is not None:
            mask.check_positions(q_offset, q_offset + Nq, kv_offset, kv_offset + Nk)

    def forward(self, q, k, v) -> State:
        if self.backend is Backend.CPU:
            return _cpu.forward(q, k, v, self.plan, self.pb)
        if self.backend is Backend.TRITON:
            from .kernels import triton as _triton
            return _triton.forward(q, k, v, self.plan, self.pb)
        return _tiles.forward(q, k, v, self.plan, self.pb)

    def backward(self, q, k, v, out, lse, dout, dlse):
        if self.backend is Backend.CPU:
            return _cpu.backward(q, k, v, out, lse, dout, dlse, self.plan, self.pb)
        if self.backend is Backend.TRITON:
            from .kernels import triton as _triton
            return _triton.backward(q, k, v, out, lse, dout, dlse, self.plan, self.pb)
        return _tiles.backward(q, k, v, out, lse, dout, dlse, self.plan, self.pb)


def _resolve(backend: Backend, q, score) -> Backend:
    nonadditive = score is not None and not score.additive
    if backend is Backend.AUTO:
        if q.device.type == "cuda":
            from .kernels import triton as _triton
            backend = Backend.TRITON if _triton.available() else Backend.TILES
        elif q.device.type == "cpu" and _cpu.AVAILABLE:
            backend = Backend.CPU
        else:
            backend = Backend.TILES
    if backend is Backend.CPU:
        if q.device.type != "cpu":
            raise ValueError(f"Backend.CPU needs CPU tensors, got {q.device}; use Backend.AUTO")
        if not _cpu.AVAILABLE or nonadditive:
            # softcap and score callables are not additive: they run tile by tile in torch ops
            backend = Backend.TILES
    if backend is Backend.TRITON:
        from .kernels import triton as _triton
        _triton.check_supported(q, score)
    return backend


# --------------------------------------------------------------------------- autograd


class _AttendFn(torch.autograd.Function):
    """Forward: merged (out, lse) in float32. Backward: per piece with the global (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        st = call.forward(q, k, v)
        ctx.call = call
        ctx.save_for_backward(q, k, v, st.out, st.lse)
        return st.out, st.lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        call: _Call = ctx.call
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None and q.device.type == "cpu" and not bool(dlse.any()):
            dlse = None  # (on a GPU this check would cost a sync; the kernels take dlse = 0 as is)
        dq, dk, dv = call.backward(q, k, v, out, lse, dout, dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _run(q, k, v, call: _Call) -> State:
    if call.backend is Backend.REFERENCE:
        return _reference.attend_reference(q, k, v, call.pb)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _AttendFn.apply(q, k, v, call)
        return State(out, lse)
    return call.forward(q, k, v)


# ------------------------------------------------------------------------------ public


def attend(q, k, v, *, mask=None, score=None, scale=None, q_offset=None, kv_offset=0,
           backend=Backend.AUTO, block_size=None, check_inputs=False) -> State:
    """Partial attention of ``q`` over exactly the keys given: a mergeable :class:`State`.

    q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``; ``Hq % Hkv == 0``
    (GQA/MQA). dtypes float16, bfloat16, float32, float64 (all three alike).
    mask: a keyfold mask (``causal()``, ``window(...)``, ...), a Flex ``mask_mod`` callable, or None.
    score: ``alibi(...)``, ``softcap(...)``, a Flex ``score_mod`` callable, a list of them, or None.
    scale: defaults to ``1/sqrt(D)``.
    q_offset: absolute position of the first query; default ``kv_offset + Nk - Nq`` is
        bottom-right alignment relative to these keys (decoding); pass 0 for Flex's top-left.
        With a ``varlen(...)`` mask (packed queries) the default is 0.
    kv_offset: absolute position of the first key (a chunk, page or shard of a longer sequence).

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
    if mask is None and score is None and _plain_fused(q, k, v, backend, block_size, check_inputs, scale,
                                                       q_offset, kv_offset):
        return _cpu.dense(q, k, v, float(q.shape[-1] ** -0.5 if scale is None else scale))
    if q_offset is None and isinstance(k, torch.Tensor) and isinstance(q, torch.Tensor) and k.dim() == 4 and q.dim() == 4:
        q_offset = default_q_offset(as_mask(mask), q.shape[2], k.shape[2], kv_offset)
    call = _Call(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs)
    return _run(q, k, v, call)


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
            and qs[3] == ks[3] == vs[3] and ks[2] == vs[2] and qs[2] > 0 and ks[2] > 0):
        return False
    if not (scale is None or (type(scale) in (int, float) and math.isfinite(scale))):
        return False
    if type(kv_offset) is not int or kv_offset < 0 or not (q_offset is None or type(q_offset) is int):
        return False
    return not ((q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled())


def attention(q, k, v, *, mask=None, score=None, scale=None, q_offset=None, kv_offset=0,
              return_lse=False, backend=Backend.AUTO, block_size=None, check_inputs=False):
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
    st = attend(q, k, v, mask=mask, score=score, scale=scale, q_offset=q_offset, kv_offset=kv_offset,
                backend=backend, block_size=block_size, check_inputs=check_inputs)
    out = st.out.to(q.dtype)
    return (out, st.lse) if return_lse else out


def attend_backward(q, k, v, out, lse, dout, *, mask=None, score=None, scale=None, q_offset=None,
                    kv_offset=0, dlse=None, backend=Backend.AUTO, block_size=None):
    """Gradients of one piece of keys, given the *global* ``out`` and ``lse`` (docs/math.md §2).

    out: ``(B, Hq, Nq, Dv)`` the final merged output; lse ``(B, Hq, Nq)`` the final lse; dout
    its gradient; dlse an optional gradient of lse. Returns ``(dq, dk, dv)`` in float32
    (float64 for float64 inputs): dq is this piece's share (sum the shares over pieces), dk and
    dv are this piece's keys' full gradients. Ring attention and split-KV backward use this.
    """
    if q_offset is None and isinstance(k, torch.Tensor) and k.dim() == 4 and q.dim() == 4:
        q_offset = default_q_offset(as_mask(mask), q.shape[2], k.shape[2], kv_offset)
    if backend is Backend.REFERENCE:
        backend = Backend.TILES
    call = _Call(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block_size, False)
    return call.backward(q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout.detach(),
                         None if dlse is None else dlse.detach())
