"""Context-parallel attention on local shards: ring, all-gather and all-to-all (Ulysses).

Every rank holds a shard of the queries, keys and values (:mod:`keyfold.distributed.layout`).

- ``Strategy.RING``: key/value shards rotate around the ring with ``batch_isend_irecv``; the
  next transfer is posted before the current shard is computed, so communication overlaps
  compute; each shard's partial State is merged in float32 (:func:`keyfold.merge`). Backward
  rotates the shards again and the dK/dV accumulators travel with them back to their owner.
- ``Strategy.ALL_GATHER``: the keys/values are gathered once, one head group at a time; the
  next group's gather is posted before the current group is computed. Backward reduce-scatters dK/dV.
- ``Strategy.ALL_TO_ALL``: DeepSpeed-Ulysses: an all-to-all turns sequence shards into head
  shards, each rank runs plain ``attend`` over the whole sequence for ``H / P`` heads, and an
  all-to-all turns the output back. Needs the query heads divisible by P.

All three give the same result as ``keyfold.attention`` on the full sequence, up to rounding.
"""

from __future__ import annotations

import enum

import torch

from ..engine import Backend, attend, no_autocast, refuse_second_order, settle_autocast
from ..masks import as_mask, check_unchanged
from ..scores import as_score
from ..state import State, empty_state, state_dtype
from .comm import Comm, Described
from .layout import Layout, Run, check_length, gather_order
from .pieces import Job, accumulate, piece_grads, piece_sums
from .views import piece_args

__all__ = ["Strategy", "ring_attention"]


class Strategy(enum.Enum):
    """How the key/value shards reach the queries."""

    RING = "ring"              # P-1 point-to-point shifts, overlapped with compute
    ALL_GATHER = "all_gather"  # one all-gather per head group, overlapped with the previous group
    ALL_TO_ALL = "all_to_all"  # Ulysses: sequence shards <-> head shards, plain attention between


# ------------------------------------------------------------------------------ helpers


def _pack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One flat buffer holding ``a`` then ``b`` (one transfer instead of two)."""
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def _unpack(buf: torch.Tensor, shape_a, shape_b):
    na = 1
    for s in shape_a:
        na *= s
    return buf[:na].view(shape_a), buf[na:].view(shape_b)


def _head_groups(Hkv: int, groups: int) -> list[tuple[int, int]]:
    """Split ``Hkv`` key/value heads into at most ``groups`` contiguous ranges."""
    groups = max(1, min(groups, Hkv))
    bounds = [round(i * Hkv / groups) for i in range(groups + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


# --------------------------------------------------------------------------------- ring


def _around(k, v, comm: Comm, what: str):
    """Yield ``(src, k, v)`` of every rank's shard in ring order, from this rank's own: the next
    transfer is posted before a shard is handed out, so the bytes travel while it is computed."""
    kv = _pack(k, v)
    for step in range(comm.size):
        pending = comm.shift(kv, what=f"{what} step {step}") if step < comm.size - 1 else None
        yield (comm.rank - step) % comm.size, *_unpack(kv, k.shape, v.shape)
        if pending is not None:
            kv = pending.wait()


def _ring_forward(q, k, v, job: Job, comm: Comm) -> State:
    B, Hq, n, _ = q.shape
    acc = empty_state(B, Hq, n, v.shape[-1], dtype=state_dtype(q.dtype), device=q.device)
    for src, kt, vt in _around(k, v, comm, "ring forward"):
        accumulate(acc, q, kt, vt, job, src=src)
    return acc


def _ring_sums(q, k, v, lse, dout, job: Job, comm: Comm):
    """Each local row's totals of P and P dP over every key shard (:func:`piece_sums`): one
    rotation of K/V before the gradients'."""
    B, Hq, n, _ = q.shape
    sums = torch.zeros(3, B, Hq, n, dtype=torch.float64, device=q.device)
    for src, kt, vt in _around(k, v, comm, "ring row sums"):
        piece_sums(q, kt, vt, lse, dout, job, src, sums)
    return sums


def _ring_backward(q, k, v, out, lse, dout, dlse, job: Job, comm: Comm):
    """K/V rotate twice: once for the rows' totals (:func:`_ring_sums`), once for the gradients,
    where the float32 dK/dV of the shard being visited travel with it.

    At step t rank r holds shard (r - t) and its dK/dV accumulated by ranks r-t .. r-1; it adds
    its own share and passes both on. After P shifts every shard's dK/dV is home, complete.
    """
    sd = state_dtype(q.dtype)
    sums = _ring_sums(q, k, v, lse, dout, job, comm)
    dq = torch.zeros(q.shape, dtype=sd, device=q.device)
    kv = _pack(k, v)
    dkv_pending = None
    for step in range(comm.size):
        kv_pending = comm.shift(kv, what=f"ring backward step {step}") if step < comm.size - 1 else None
        kt, vt = _unpack(kv, k.shape, v.shape)
        dk = torch.zeros(k.shape, dtype=sd, device=q.device)
        dv = torch.zeros(v.shape, dtype=sd, device=q.device)
        piece_grads(q, kt, vt, out, lse, dout, dlse, job, (comm.rank - step) % comm.size, dq, dk, dv, sums)
        dkv = _pack(dk, dv)
        if dkv_pending is not None:  # the shard's dK/dV from the ranks before us
            dkv += dkv_pending.wait()
        dkv_pending = comm.shift(dkv, what=f"ring dK/dV step {step}", tag=1)
        if kv_pending is not None:
            kv = kv_pending.wait()
    dk, dv = _unpack(dkv_pending.wait(), k.shape, v.shape)
    return dq, dk, dv


#: the ring's and all-gather's backward recompute P per shard from detached scores, as the engine's do
_SECOND_ORDER = ("ring and all-gather attention have no second derivative through q or k (a gradient penalty "
                 "or Hessian-vector product over attention): Strategy.ALL_TO_ALL with backend=Backend.REFERENCE "
                 "differentiates twice (each rank holds its heads' N x N scores)")


class _RingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, job: Job, comm: Comm):
        st = _ring_forward(q, k, v, job, comm)
        ctx.job, ctx.comm = job, comm
        ctx.save_for_backward(q, k, v, st.out, st.lse)
        return st.out, st.lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dlse = None if dlse is None or not bool(dlse.any()) else dlse
        with no_autocast(q):
            dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, dlse, ctx.job, ctx.comm)
        dq, dk, dv = refuse_second_order((dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)), (q, k), _SECOND_ORDER)
        return dq, dk, dv, None, None


# --------------------------------------------------------------------------- all-gather


def _gathered(k, v, comm: Comm, groups, what):
    """Yield ``(a, b, every rank's k/v for kv heads [a, b))``, the next gather already posted."""
    def post(a, b):
        return comm.all_gather(_pack(k[:, a:b], v[:, a:b]), what=f"{what} heads {a}:{b}")

    pending = post(*groups[0])
    for i, (a, b) in enumerate(groups):
        gathered = pending.wait()                               # (P, packed)
        if i + 1 < len(groups):
            pending = post(*groups[i + 1])                      # overlaps this group's compute
        shape_k = (k.shape[0], b - a) + tuple(k.shape[2:])
        shape_v = (v.shape[0], b - a) + tuple(v.shape[2:])
        yield a, b, [_unpack(gathered[s], shape_k, shape_v) for s in range(comm.size)]


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, job: Job, comm: Comm, groups):
        B, Hq, n, _ = q.shape
        g = Hq // k.shape[1]
        acc = empty_state(B, Hq, n, v.shape[-1], dtype=state_dtype(q.dtype), device=q.device)
        for a, b, shards in _gathered(k, v, comm, groups, "all-gather forward"):
            part = State(acc.out[:, a * g:b * g], acc.lse[:, a * g:b * g])   # views into acc
            for src, (kt, vt) in enumerate(shards):
                accumulate(part, q[:, a * g:b * g], kt, vt, job, src, heads=(a * g, b * g, Hq))
        ctx.job, ctx.comm, ctx.groups = job, comm, groups
        ctx.save_for_backward(q, k, v, acc.out, acc.lse)
        return acc.out, acc.lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        job, comm = ctx.job, ctx.comm
        sd = state_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout
        dlse = None if dlse is None or not bool(dlse.any()) else dlse
        Hq = q.shape[1]
        g = Hq // k.shape[1]
        dq = torch.zeros(q.shape, dtype=sd, device=q.device)
        dk = torch.zeros(k.shape, dtype=sd, device=q.device)
        dv = torch.zeros(v.shape, dtype=sd, device=q.device)
        scatters = []
        with no_autocast(q):  # a backward run inside an autocast region
            for a, b, shards in _gathered(k, v, comm, ctx.groups, "all-gather backward"):
                h = slice(a * g, b * g)
                heads = (a * g, b * g, Hq)
                sums = torch.zeros(3, q.shape[0], h.stop - h.start, q.shape[2], dtype=torch.float64, device=q.device)
                for src, (kt, vt) in enumerate(shards):  # the rows' totals first, from the keys at hand
                    piece_sums(q[:, h], kt, vt, lse[:, h], dout[:, h], job, src, sums, heads=heads)
                per_src = []
                for src, (kt, vt) in enumerate(shards):
                    gk = torch.zeros(kt.shape, dtype=sd, device=q.device)
                    gv = torch.zeros(vt.shape, dtype=sd, device=q.device)
                    piece_grads(q[:, h], kt, vt, out[:, h], lse[:, h], dout[:, h],
                                None if dlse is None else dlse[:, h], job, src, dq[:, h], gk, gv, sums, heads=heads)
                    per_src.append(_pack(gk, gv))
                # each shard's dK/dV summed over the ranks and delivered to its owner
                scatters.append((a, b, comm.reduce_scatter(torch.stack(per_src), what=f"dK/dV heads {a}:{b}")))
        for a, b, pending in scatters:
            shape_k = (k.shape[0], b - a) + tuple(k.shape[2:])
            shape_v = (v.shape[0], b - a) + tuple(v.shape[2:])
            dk[:, a:b], dv[:, a:b] = _unpack(pending.wait(), shape_k, shape_v)
        dq, dk, dv = refuse_second_order((dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)), (q, k), _SECOND_ORDER)
        return dq, dk, dv, None, None, None


# ---------------------------------------------------------------------- all-to-all (Ulysses)


class _SeqToHeads(torch.autograd.Function):
    """``(B, H, n, X)`` sequence shard -> ``(B, H/P, P*n, X)`` head shard, rows in rank order.

    Its gradient is the inverse all-to-all (and vice versa), itself this Function, so a gradient taken
    with ``create_graph=True`` differentiates again: the raw all-to-all in the backward cut that path,
    and a gradient penalty's second derivatives came back without the attention's part, off by O(1)
    with no error (a review, 2026-12-07)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, inverse: bool):
        ctx.comm, ctx.inverse = comm, inverse
        return _heads_to_seq(x, comm) if inverse else _seq_to_heads(x, comm)

    @staticmethod
    def backward(ctx, g):
        return _SeqToHeads.apply(g, ctx.comm, not ctx.inverse), None, None


def _seq_to_heads(x, comm: Comm):
    B, H, n, X = x.shape
    P = comm.size
    chunks = x.reshape(B, P, H // P, n, X).transpose(0, 1)           # (P, B, H/P, n, X): chunk j -> rank j
    got = comm.all_to_all(chunks.contiguous(), what="all-to-all to heads").wait()  # row s: rank s's shard
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // P, P * n, X)  # (B, H/P, P*n, X)


def _heads_to_seq(y, comm: Comm):
    B, Hp, N, X = y.shape
    P = comm.size
    chunks = y.reshape(B, Hp, P, N // P, X).permute(2, 0, 1, 3, 4)  # (P, B, H/P, n, X): rows of rank s -> s
    got = comm.all_to_all(chunks.contiguous(), what="all-to-all to sequence").wait()  # row j: head chunk j
    return got.transpose(0, 1).reshape(B, P * Hp, N // P, X)        # (B, H, n, X)


def _ulysses(q, k, v, job: Job, comm: Comm):
    P = comm.size
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv % P:  # too few key/value heads to split: give every query head its own copy
        k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    qh = _SeqToHeads.apply(q, comm, False)                            # (B, Hq/P, N, D)
    kh = _SeqToHeads.apply(k, comm, False)
    vh = _SeqToHeads.apply(v, comm, False)
    order = gather_order(job.N, P, job.layout).to(q.device)           # global position of each row
    contiguous = job.layout is Layout.CONTIGUOUS
    if not contiguous:
        inverse = torch.argsort(order)
        qh, kh, vh = (t.index_select(2, inverse) for t in (qh, kh, vh))  # rows in global order
    Hp = Hq // P
    whole = Run(0, 0, job.N)
    m, s, qo, ko = piece_args(job.mask, job.score, whole, whole, (comm.rank * Hp, (comm.rank + 1) * Hp, Hq))
    st = attend(qh, kh, vh, mask=m, score=s, scale=job.scale, q_offset=qo, kv_offset=ko, backend=job.backend)
    both = torch.cat([st.out, st.lse.unsqueeze(-1)], -1)              # (B, Hq/P, N, Dv+1)
    if not contiguous:
        both = both.index_select(2, order)                            # back to rank order
    back = _SeqToHeads.apply(both, comm, True)                        # (B, Hq, n, Dv+1)
    return back[..., :-1], back[..., -1]


# ------------------------------------------------------------------------------- public


def _validate(q, k, v, P, layout, strategy, mask, score, head_groups, backend=Backend.AUTO):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D local shard (batch, heads, seq, head_dim), "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                                              torch.float64):
        raise TypeError(f"q, k, v must share one float dtype (float16, bfloat16, float32, float64), got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"local shards must hold the same positions for q, k and v, got lengths "
                         f"{q.shape[2]}, {k.shape[2]}, {v.shape[2]} (self-attention over one sharded sequence)")
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be a keyfold.distributed.Strategy, got {strategy!r}")
    check_length(q.shape[2] * P, P, layout, what=f"the sharded sequence ({P} ranks x {q.shape[2]})")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads and k/v have {k.shape[1]}: query heads must be a "
                         f"multiple of key/value heads")
    if strategy is Strategy.ALL_TO_ALL and q.shape[1] % P:
        raise ValueError(f"Strategy.ALL_TO_ALL splits the {q.shape[1]} query heads over {P} ranks and needs "
                         f"them divisible; use Strategy.RING or Strategy.ALL_GATHER")
    if isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1:
        raise ValueError(f"head_groups must be an int >= 1, got {head_groups!r}")
    N = q.shape[2] * P
    if mask is not None:
        mask.check_positions(0, N, 0, N)
    if score is not None:
        score.check_heads(q.shape[1])
    # what the ring's and all-gather's piece backward cannot do, refused before any rank sends a byte: in
    # the backward it raised with advice for another function, and a ring left its transfers posted, so
    # the group's next call timed out (a review, 2026-12-07)
    if strategy is not Strategy.ALL_TO_ALL and torch.is_grad_enabled():
        if backend is Backend.REFERENCE and any(t.requires_grad for t in (q, k, v)):
            raise ValueError(f"ring_attention(backend=Backend.REFERENCE) with Strategy.{strategy.name}: its backward "
                             f"runs a piece backward, which the reference has not; use Strategy.ALL_TO_ALL (over "
                             f"REFERENCE it differentiates twice) or Backend.AUTO")
        if score is not None and any(t.requires_grad for t in score.tensors()):
            raise NotImplementedError(f"ring_attention with Strategy.{strategy.name}: the score modifier reads "
                                      f"tensors that require grad, which its piece backward does not give; use "
                                      f"Strategy.ALL_TO_ALL, or detach them")


_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _describe(x) -> Described | None:
    """A mask or score for the agreement check: readable, and compared by content."""
    return None if x is None else Described(x)


def _index(enum_cls, x) -> int:
    """A member's place in its enum (-1 for anything else: the rank's own validation names it)."""
    return list(enum_cls).index(x) if isinstance(x, enum_cls) else -1


def ring_attention(q, k, v, *, group=None, mask=None, score=None, scale=None,
                   layout: Layout = Layout.CONTIGUOUS, strategy: Strategy = Strategy.RING,
                   return_lse: bool = False, backend: Backend = Backend.AUTO, head_groups: int = 2,
                   check_shards: bool = True):
    """Exact attention over a sequence sharded across the ranks of ``group``; differentiable.

    Call it on every rank of the group with that rank's shards.
    q: ``(B, Hq, n, D)``, k: ``(B, Hkv, n, D)``, v: ``(B, Hkv, n, Dv)``: the positions
    :func:`~keyfold.distributed.shard` gives this rank for ``layout`` (the sequence has ``N = n*P``
    positions; ``Hq % Hkv == 0``). mask, score, scale: as in :func:`keyfold.attention`, in global
    positions (bottom-right alignment with Nq == Nk is top-left: query i sees key i).
    strategy: :class:`Strategy` (RING, ALL_GATHER over ``head_groups`` head groups, ALL_TO_ALL).

    Returns this rank's output ``(B, Hq, n, Dv)`` in the input dtype (and its lse ``(B, Hq, n)``,
    float32, with ``return_lse=True``). Rows that see no key give 0 and lse -inf. Every rank
    raises the same :class:`ShardError` if a rank's input is invalid or the shards disagree.
    check_shards: exchange shapes and settings before any transfer (one small all-gather of
    Python objects per call; masks and score modifiers are compared by content: the shape and
    bytes of every tensor they hold). False skips the masks and scores and exchanges only the shard
    shapes, dtype, strategy, layout and head groups as one 16-int tensor, so a shape or schedule
    mismatch or one rank's invalid input still raises :class:`ShardError` on every rank; different
    masks then go unnoticed.

    >>> out = ring_attention(shard(q), shard(k), shard(v), mask=causal(), layout=Layout.ZIGZAG)  # doctest: +SKIP
    """
    comm = Comm(group)
    error = None
    try:
        mask, score = as_mask(mask), as_score(score)
        check_unchanged(mask, score)  # before the ranks agree: raised mid-exchange, the group's next call hung
        _validate(q, k, v, comm.size, layout, strategy, mask, score, head_groups, backend)
    except (ValueError, TypeError, NotImplementedError) as e:
        error = e
    meta = {n: tuple(getattr(t, "shape", ())) for n, t in (("q", q), ("k", k), ("v", v))}
    meta.update(dtype=str(getattr(q, "dtype", None)), layout=getattr(layout, "name", layout),
                strategy=getattr(strategy, "name", strategy), mask=_describe(mask), score=_describe(score),
                scale=scale, head_groups=head_groups)
    if check_shards:
        comm.agree("ring_attention", meta, error)
    else:  # shapes, dtype and the schedule only, as one small tensor: a mismatch raises on every rank
        # instead of aborting (one rank on another strategy waited out the group's timeout, 30 minutes by
        # default, and left the group broken; a review, 2026-12-07)
        sizes = [d for n in ("q", "k", "v") for d in (list(meta[n]) + [0] * 4)[:4]]
        schedule = [_index(Strategy, strategy), _index(Layout, layout),
                    head_groups if isinstance(head_groups, int) and not isinstance(head_groups, bool) else -1]
        comm.agree_sizes("ring_attention", sizes + [_DTYPES.get(getattr(q, "dtype", None), -1)] + schedule, error)
    job = Job(mask, score, scale, backend, layout, q.shape[2] * comm.size, comm.size, comm.rank)
    # under torch.autocast: the inputs cast as SDPA's are, every piece run without it (a piece's
    # forward in bfloat16 against a backward recomputing it in float32 gave dv 2.9x torch's error;
    # review of 2026-12-06)
    q, k, v, settled = settle_autocast(q, k, v)
    with settled:
        if strategy is Strategy.RING:
            out, lse = _RingFn.apply(q, k, v, job, comm)
        elif strategy is Strategy.ALL_GATHER:
            out, lse = _GatherFn.apply(q, k, v, job, comm, _head_groups(k.shape[1], head_groups))
        else:
            out, lse = _ulysses(q, k, v, job, comm)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
