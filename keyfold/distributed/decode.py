"""Decoding against a KV cache sharded across ranks: each rank attends to its part, then one
reduction combines the partial states.

Rank ``r`` holds cache positions ``[offset_r, offset_r + n_r)`` (shards may differ in length;
offsets are the running sum of the lengths in rank order). Two ways to combine, selectable:

- ``Reduce.ALL_REDUCE`` (default): the merge written as a reduction, ``m = max_r lse_r``, then one
  sum of ``(exp(lse_r - m) * out_r, exp(lse_r - m))``. Two all-reduces whose bytes per rank do not
  grow with the number of ranks (a ring all-reduce sends about twice the state).
- ``Reduce.ALL_GATHER``: gather every rank's small ``(out, lse)`` and merge them with
  :func:`keyfold.merge_all`. One collective, but each rank receives P states.

For one decode token the state is tiny (``B*H*Dv`` floats), so both are bound by latency; the
all-reduce is the default because it keeps bytes flat as P grows and every rank ends with
bit-identical results (the reduction order is the collective's, the same on all ranks).
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from ..engine import Backend, attend_wide
from ..masks import as_mask, check_unchanged, default_q_offset
from ..state import State, empty_state, merge_all, state_dtype
from .comm import Comm, Described, ShardError

__all__ = ["Reduce", "tree_decode"]


class Reduce(enum.Enum):
    ALL_REDUCE = "all_reduce"  # max, then sum of (weighted out, weight)
    ALL_GATHER = "all_gather"  # gather (out, lse) states and merge_all


def _flags(st: State, comm: Comm, failed: bool) -> torch.Tensor:
    """One slot per rank, 1 where that rank's attention raised: reduced (MAX) with the first
    collective, so that every rank learns of a failure without one more round trip."""
    f = torch.zeros(comm.size, dtype=st.lse.dtype, device=st.lse.device)
    f[comm.rank] = float(failed)
    return f


def _combine_all_reduce(st: State, comm: Comm, failed: bool = False) -> tuple[State, list[int]]:
    n = st.lse.numel()
    both = torch.cat([st.lse.reshape(-1), _flags(st, comm, failed)])
    both = comm.all_reduce(both, op=dist.ReduceOp.MAX, what="tree_decode max").wait()
    bad = [r for r, x in enumerate(both[n:].tolist()) if x > 0]
    if bad:
        return st, bad
    m = both[:n].view(st.lse.shape)                                                     # (B, H, Nq)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)                     # rows nobody saw
    w = torch.exp(st.lse - m_safe)                                                      # 0 where lse = -inf
    packed = torch.cat([st.out * w.unsqueeze(-1), w.unsqueeze(-1)], -1)               # (B, H, Nq, Dv+1)
    total = comm.all_reduce(packed, what="tree_decode sum").wait()
    s = total[..., -1]
    seen = s > 0
    out = torch.where(seen.unsqueeze(-1), total[..., :-1] / torch.where(seen, s, torch.ones_like(s)).unsqueeze(-1),
                      torch.zeros_like(total[..., :-1]))
    lse = torch.where(seen, m_safe + torch.log(torch.where(seen, s, torch.ones_like(s))),
                      torch.full_like(s, float("-inf")))
    return State(out, lse), []


def _combine_all_gather(st: State, comm: Comm, failed: bool = False) -> tuple[State, list[int]]:
    packed = torch.cat([st.out, st.lse.unsqueeze(-1)], -1)                             # (B, H, Nq, Dv+1)
    flag = torch.full((1,), float(failed), dtype=packed.dtype, device=packed.device)  # this rank's own slot
    every = comm.all_gather(torch.cat([packed.reshape(-1), flag]), what="tree_decode gather").wait()
    every = every.view(comm.size, -1)                                                  # (P, B*H*Nq*(Dv+1) + 1)
    bad = [r for r, x in enumerate(every[:, -1].tolist()) if x > 0]  # (one read of the flags, not P)
    if bad:
        return st, bad
    states = (x[:-1].view(packed.shape) for x in every)
    return merge_all(State(x[..., :-1], x[..., -1]) for x in states), []


@torch.no_grad()
def tree_decode(q, k_local, v_local, group=None, *, mask=None, score=None, scale=None, q_offset=None,
                reduce: Reduce = Reduce.ALL_REDUCE, return_lse: bool = False, backend: Backend = Backend.AUTO):
    """Attention of ``q`` over a KV cache whose positions are split across the ranks of ``group``.

    q: ``(B, Hq, Nq, D)``, the same on every rank (the new token(s)); k_local ``(B, Hkv, n_r, D)``,
    v_local ``(B, Hkv, n_r, Dv)``: rank r's contiguous part of the cache, ranks in position order
    (``n_r`` may differ, even be 0). mask/score use absolute positions; ``q_offset`` defaults to
    ``total - Nq`` (the new tokens are the last positions), 0 with a ``varlen`` mask (packed queries), as
    in :func:`keyfold.attention`. Returns ``(B, Hq, Nq, Dv)`` in q's
    dtype on every rank (and the lse with ``return_lse=True``). Not differentiable (inference).

    >>> out = tree_decode(q, k_cache_shard, v_cache_shard)   # on every rank   # doctest: +SKIP
    """
    comm = Comm(group)
    error = None
    try:
        if not isinstance(reduce, Reduce):
            raise TypeError(f"reduce must be a keyfold.distributed.Reduce, got {reduce!r}")
        for name, t in (("q", q), ("k_local", k_local), ("v_local", v_local)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got {getattr(t, 'shape', t)}")
        if k_local.shape[2] != v_local.shape[2]:
            raise ValueError(f"k_local has {k_local.shape[2]} positions but v_local {v_local.shape[2]}")
    except (ValueError, TypeError) as e:
        error = e
    # the cache's lengths first: with them every rank checks the mask against the whole cache's
    # positions, so all raise or none does (a rank with no key skips attend, and was left waiting in
    # the reduce while another raised there)
    n_local = k_local.shape[2] if error is None else 0
    device = next((t.device for t in (q, k_local, v_local) if isinstance(t, torch.Tensor)), None)
    lengths = comm.all_gather(torch.tensor([n_local], device=device), what="cache lengths").wait()
    lengths = [int(x) for x in lengths.view(-1).tolist()]
    kv_offset, total = sum(lengths[:comm.rank]), sum(lengths)
    if error is None:
        try:
            checked = as_mask(mask)
            check_unchanged(checked, score)
            if q_offset is None:  # as keyfold.attention: the last positions, or 0 for packed queries (varlen;
                # total - Nq there raised, naming q_offset=0 as "the default", which it was not here; a review)
                q_offset = default_q_offset(checked, q.shape[2], total)
            if checked is not None:
                checked.check_positions(q_offset, q_offset + q.shape[2], 0, total)
        except (ValueError, TypeError) as e:
            error = e
    shapes = (tuple(getattr(q, "shape", ())), tuple(getattr(k_local, "shape", ()))[:2],
              tuple(getattr(k_local, "shape", ()))[3:], tuple(getattr(v_local, "shape", ()))[3:],
              str(getattr(q, "dtype", None)), getattr(reduce, "name", reduce),
              None if mask is None else Described(mask),
              None if score is None else Described(score))
    comm.agree("tree_decode", shapes, error)
    B, Hq, Nq, _ = q.shape

    def empty():
        return empty_state(B, Hq, Nq, v_local.shape[-1], dtype=state_dtype(q.dtype), device=q.device,
                           of=(q, k_local, v_local))

    def wide(st):  # one dtype on every rank for the collectives: lse float64 (attend_wide's), out as it is
        return State(st.out, st.lse.double())
    failure = None
    try:
        # each rank's state as the caches' merged pieces are (attend_wide: a float64 lse, a 16-bit call's out
        # in float32): from attend, a bfloat16 decode split over 2 ranks went to 1.02x the rule's allowance
        # (1 of 2,500 seeds of a review's fuzz; merged attend halves 2 of 300 in one process, attend_wide's 0)
        st = wide(empty() if k_local.shape[2] == 0 else attend_wide(
            q, k_local, v_local, mask=mask, score=score, scale=scale, q_offset=q_offset, kv_offset=kv_offset,
            backend=backend))
    except Exception as e:  # noqa: BLE001 - told to every rank in the combine, then raised here
        st, failure = wide(empty()), e  # (a rank with no key waited in the reduce until the group's timeout)
    combine = _combine_all_reduce if reduce is Reduce.ALL_REDUCE else _combine_all_gather
    st, bad = combine(st, comm, failure is not None)
    if failure is not None:
        raise failure
    if bad:
        raise ShardError(f"tree_decode: attention raised on rank(s) {bad} (see their errors); this rank's "
                         f"inputs were fine")
    out = st.out.to(q.dtype)
    return (out, st.lse.to(state_dtype(q.dtype))) if return_lse else out
