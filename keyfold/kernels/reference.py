"""The oracle: plain torch ops over the whole score matrix, differentiable by autograd.

It is the only code in keyfold that materialises all Nq x Nk scores. Computation runs in
float32 for 16-bit inputs and float64 for float64 inputs, so with float64 inputs it is the
float64 reference every other path is tested against.
"""

from __future__ import annotations

import torch

from ..masks import grid_positions
from ..state import State, state_dtype
from ._common import NEG_INF, Problem, dropout_keep, group_matmul, row_divisor

__all__ = ["attend_reference"]


def attend_reference(q, k, v, pb: Problem) -> State:
    """Attention of q over exactly these keys. Shapes as in :func:`keyfold.attend`."""
    sd = state_dtype(q.dtype)
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    g = Hq // Hkv
    qg = q.to(sd).reshape(B, Hkv, g, Nq, D)                    # (B, Hkv, g, Nq, D)
    s = group_matmul(qg, k.to(sd), transpose=True) * pb.scale  # (B, Hkv, g, Nq, Nk)
    s = s.reshape(B, Hq, Nq, Nk)
    b, h, qp, kp = grid_positions(B, Hq, pb.q_offset, Nq, pb.kv_offset, Nk, q.device)
    if pb.score is not None:  # in the state dtype, as the other backends take it (a float64 table beside
        # float32 scores made P float64, and P @ v raised); positions of its own: a score callable shifting
        # q_idx in place (q_idx += 7) moved the mask's too, 2.2-3.8 off (a review, 2026-12-08)
        s = pb.score.apply(s, *(t.clone() for t in (b, h, qp, kp))).to(sd)
    if pb.mask is not None:
        s = s.masked_fill(~pb.mask.evaluate(b, h, qp, kp), NEG_INF)
    # shift by the row max and divide by the sum: exp(s - lse) would not sum to 1 once |lse| is so
    # large that adding log(sum) rounds away (scores ~1e10 from 16-bit inputs at their maximum)
    m = s.amax(-1, keepdim=True) if Nk else s.new_zeros(B, Hq, Nq, 1)  # (B, Hq, Nq, 1)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # empty rows: exp(-inf) = 0
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    lse = (m + total.log()).squeeze(-1)                        # (B, Hq, Nq); -inf on empty rows
    if pb.dropout_p:  # SDPA's dropout after softmax, kept ones scaled by 1/(1-p); lse unchanged
        keep = dropout_keep(pb.dropout_seed, pb.dropout_p, b, h, qp, kp, Hq)
        p = p * keep / (1.0 - pb.dropout_p)
    out = group_matmul(p.reshape(B, Hkv, g, Nq, Nk), v.to(sd))  # (B, Hkv, g, Nq, Dv)
    out = out.reshape(B, Hq, Nq, Dv) / row_divisor(total)
    return State(out, lse)


def attend_naive(q, k, v, pb: Problem, with_lse: bool = False):
    """The yardstick of the correctness rule: the plain same-dtype implementation.

    Scores and bias in the input dtype, hidden pairs -inf, softmax in float32 cast back to
    the input dtype, then ``@ v`` in the input dtype (DESIGN.md section 6). Rows that see no
    key are NaN in plain softmax; here they are kept finite and zeroed, so the yardstick's
    gradients on the other rows stay usable. Materialises Nq x Nk. ``with_lse``: ``(out, lse)``,
    lse the float32 logsumexp of those scores (0 on rows that see no key).
    """
    out, s = _naive(q, k, v, pb)
    if not with_lse:
        return out
    lse = torch.logsumexp(s.float(), dim=-1)
    return out, torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _naive(q, k, v, pb: Problem):
    """attend_naive's out and its masked scores"""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ kk.transpose(-1, -2)) * pb.scale                  # (B, Hq, Nq, Nk), input dtype
    b, h, qp, kp = grid_positions(B, Hq, pb.q_offset, Nq, pb.kv_offset, Nk, q.device)
    if pb.score is not None:
        s = pb.score.apply(s.float(), *(t.clone() for t in (b, h, qp, kp))).to(q.dtype)
    if pb.mask is None:
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ vv, s
    m = torch.broadcast_to(pb.mask.evaluate(b, h, qp, kp), s.shape)
    seen = m.any(-1, keepdim=True)
    s = s.masked_fill(~m & seen, NEG_INF)
    return (torch.softmax(s.float(), dim=-1).to(q.dtype) @ vv) * seen, s.masked_fill(~seen, NEG_INF)
