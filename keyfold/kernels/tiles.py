"""Tile-by-tile attention in torch ops: any score modifier, any device.

Each piece materialises only its own (L x S) tile of scores; the planner bounds S.
Forward returns one State per call; backward uses the global (out, lse) (docs/math.md).
"""

from __future__ import annotations

import torch

from ..planner import Plan
from ..state import State, empty_state, merge_into, state_dtype
from ._common import NEG_INF, Problem, dropout_keep, positions, visible

__all__ = ["forward", "backward", "backward_with_score"]


def _scores(qp_, kp_, pb: Problem):
    """Scaled raw scores ``scale * q·k`` of one piece: ``(B, Hq, L, S)``."""
    B, Hq, L, D = qp_.shape
    Hkv, S = kp_.shape[1], kp_.shape[2]
    g = Hq // Hkv
    raw = (qp_.reshape(B, Hkv, g, L, D) @ kp_.unsqueeze(2).transpose(-1, -2)) * pb.scale  # (B,Hkv,g,L,S)
    raw = raw.reshape(B, Hq, L, S)
    return raw


def _modify(raw, pb: Problem, pos, vis):
    s = pb.score.apply(raw, *pos) if pb.score is not None else raw
    if vis is not None:
        s = s.masked_fill(~vis, NEG_INF)
    return s


def _visible_cached(q, piece, pb: Problem, plan: Plan):
    """The piece's bool tile, kept in the plan's tile cache between calls."""
    key = ("visible", piece, q.shape[0], q.shape[1], q.device)
    vis = plan.tiles.get(key)
    if vis is None:
        vis = visible(q, piece, pb)
        if vis is not None:
            plan.tiles.put(key, vis, vis.numel())
    return vis


def _separable(piece, pb: Problem, device):
    """``(row, key)`` terms of an additive bias on this piece (ALiBi with every key on one side
    of every query), or None: then the bias is applied whole."""
    if pb.score is None or not pb.score.additive:
        return None
    qa, ka = pb.q_offset + piece.q0, pb.kv_offset + piece.k0
    return pb.score.separable(qa, pb.q_offset + piece.q1, ka, pb.kv_offset + piece.k1, device)


def _keep(q, piece, pb: Problem, pos):
    """Dropout's keep tile ``(B, Hq, L, S)`` for this piece (regenerated, never stored), or None."""
    if not pb.dropout_p:
        return None
    b, h, qp, kp = pos if pos is not None else positions(q, piece, pb)
    return dropout_keep(pb.dropout_seed, pb.dropout_p, b, h, qp, kp, q.shape[1])


def forward(q, k, v, plan: Plan, pb: Problem) -> State:
    sd = state_dtype(q.dtype)
    B, Hq, Nq, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    g = Hq // Hkv
    acc = empty_state(B, Hq, Nq, Dv, dtype=sd, device=q.device)
    for piece in plan.pieces:
        vis = _visible_cached(q, piece, pb, plan)
        pos = positions(q, piece, pb) if pb.score is not None or pb.dropout_p else None
        qs = q[:, :, piece.q0:piece.q1].to(sd)
        ks = k[:, :, piece.k0:piece.k1].to(sd)
        vs = v[:, :, piece.k0:piece.k1].to(sd)
        s = _scores(qs, ks, pb)                                              # (B, Hq, L, S), ours
        sep = _separable(piece, pb, q.device)
        if sep is not None:  # key term into the scores, row term into lse (exact far from the keys)
            s = s.add_(sep[1])
        elif pb.score is not None:
            s = pb.score.apply_(s, *pos)
        if vis is not None:
            s = s.masked_fill_(~vis, NEG_INF)
        # softmax in place: one max, one exp pass, one sum (empty rows: max = -inf -> use 0)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        p = s.sub_(m).exp_()
        total = p.sum(-1, keepdim=True)                                      # (B, Hq, L, 1)
        lse = (m + total.log()).squeeze(-1)                                  # -inf where total = 0
        if sep is not None:
            lse = lse + sep[0]
        L, S = p.shape[-2:]
        keep = _keep(q, piece, pb, pos)
        if keep is not None:  # SDPA's dropout: drop probabilities after softmax; lse is unchanged
            p = p.masked_fill_(~keep, 0.0)
            total = total * (1.0 - pb.dropout_p)                             # kept ones scale by 1/(1-p)
        out = (p.reshape(B, Hkv, g, L, S) @ vs.unsqueeze(2)).reshape(B, Hq, L, Dv)
        out = out / torch.where(total > 0, total, torch.ones_like(total))
        rows = slice(piece.q0, piece.q1)
        merge_into(State(acc.out[:, :, rows], acc.lse[:, :, rows]), State(out, lse))
    return acc


def backward(q, k, v, out, lse, dout, dlse, plan: Plan, pb: Problem, whole_rows: bool = True):
    """Gradients of every piece from the global ``out``/``lse`` (and ``dlse``), summed.

    whole_rows: these keys are all the keys the rows see (the engine's own backward). False
    for a piece of a larger computation (``attend_backward``): a row's D_i must then come
    from the global ``out``, as the pieces outside this call also contribute to it."""
    return backward_with_score(q, k, v, out, lse, dout, dlse, plan, pb, (), whole_rows)[:3]


def backward_with_score(q, k, v, out, lse, dout, dlse, plan: Plan, pb: Problem, score_tensors=(),
                        whole_rows: bool = True):
    """``(dq, dk, dv, dts)``: as :func:`backward`, plus the gradients of ``score_tensors`` (tensors
    the score modifier reads, see ``ScoreMod.tensors``), one per tensor (None if unused), by
    autograd of ``score.apply`` on each tile, ``grad(s, [raw, *tensors], dS)``, summed over pieces."""
    sd = state_dtype(q.dtype)
    B, Hq, Nq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    g = Hq // Hkv
    dq = torch.zeros(q.shape, dtype=sd, device=q.device)
    dk = torch.zeros(k.shape, dtype=sd, device=q.device)
    dv = torch.zeros(v.shape, dtype=sd, device=q.device)
    dts: list = [None] * len(score_tensors)
    safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(sd)
    delta = (dout.to(sd) * out.to(sd)).sum(-1)                               # (B, Hq, Nq)
    if dlse is not None:
        delta = delta - dlse.to(sd)
    nonadd = pb.score is not None and not pb.score.additive
    # Rows that one piece covers alone take D_i = sum_j P_ij dP_ij from that piece (equal to
    # dO_i . O_i in exact arithmetic, as softmax's own backward computes it): then dS cancels
    # exactly where it should, e.g. a row with one visible key gets dS = 1 * (dP - dP) = 0,
    # while dO . O (a different summation order than the dP product) leaves ~1e-7.
    cover = torch.zeros(Nq, dtype=torch.int32)
    for piece in plan.pieces:
        cover[piece.q0:piece.q1] += 1
    alone = (cover == 1) & whole_rows
    for piece in plan.pieces:
        vis = _visible_cached(q, piece, pb, plan)
        pos = positions(q, piece, pb) if pb.score is not None or pb.dropout_p else None
        rows, keys = slice(piece.q0, piece.q1), slice(piece.k0, piece.k1)
        qs, ks, vs = q[:, :, rows].to(sd), k[:, :, keys].to(sd), v[:, :, keys].to(sd)
        do = dout[:, :, rows].to(sd)
        L, S = piece.q1 - piece.q0, piece.k1 - piece.k0
        sep = None if nonadd else _separable(piece, pb, q.device)
        with torch.enable_grad():
            raw = _scores(qs, ks, pb)
            if nonadd:
                raw.requires_grad_(True)
            if sep is not None:  # as in forward: the row term stays in lse
                s = raw + sep[1]
                s = s.masked_fill(~vis, NEG_INF) if vis is not None else s
            else:
                s = _modify(raw, pb, pos, vis)
        lse_p = safe_lse[:, :, rows] - sep[0] if sep is not None else safe_lse[:, :, rows]
        p = torch.exp(s.detach() - lse_p.unsqueeze(-1))                      # (B, Hq, L, S)
        dp = (do.reshape(B, Hkv, g, L, Dv) @ vs.unsqueeze(2).transpose(-1, -2)).reshape(B, Hq, L, S)
        keep = _keep(q, piece, pb, pos)
        pv = p                                                               # the probabilities V saw
        if keep is not None:  # out = (P * Z) V with Z = keep / (1 - p): dP = Z * dO V^T, dV = (P Z)^T dO
            z = keep.to(sd) / (1.0 - pb.dropout_p)
            dp, pv = dp * z, p * z
        d_rows = delta[:, :, rows]
        own = alone[rows].to(q.device)
        if score_tensors and bool(own.any()):
            # Captured tensors that train sum dS over many pairs (a clamped relative-position bin
            # gathers most of each row), so dS must cancel along the row as softmax's own backward
            # makes it: P renormalized to sum 1 and D_i = sum_j P_ij dP_ij. exp(s - lse) alone sums
            # to 1 only up to lse's rounding, which the bins add up (local_window's table: 5.7x
            # naive's error with it, 2.8x without). Only rows one piece covers can do this.
            own = own.view(1, 1, L, 1)
            total = p.sum(-1, keepdim=True)
            p = torch.where(own & (total > 0), p / torch.where(total > 0, total, torch.ones_like(total)), p)
            pv = p if keep is None else p * z
            local = (p * dp).sum(-1) - (dlse[:, :, rows].to(sd) if dlse is not None else 0)
            d_rows = torch.where(own.view(1, 1, L), local, d_rows)
        elif bool(own.any()):  # ... and only rows with exactly one visible key (where it makes dS cancel):
            # elsewhere dO.O gives the more accurate gradients (Flex's rel_bias and learned-ALiBi ports)
            own = own & ((vis.sum(-1) == 1) if vis is not None else torch.tensor(S == 1, device=q.device))
        if not score_tensors and bool(own.any()):
            local = (p * dp).sum(-1) - (dlse[:, :, rows].to(sd) if dlse is not None else 0)
            d_rows = torch.where(own, local, d_rows)
        ds = p * (dp - d_rows.unsqueeze(-1))
        if score_tensors and s.requires_grad:
            inputs = ([raw] if nonadd else []) + list(score_tensors)
            grads = torch.autograd.grad(s, inputs, ds, allow_unused=True)
            for i, gt in enumerate(grads[1:] if nonadd else grads):
                if gt is not None:
                    dts[i] = gt if dts[i] is None else dts[i] + gt
            if nonadd:
                ds = grads[0] if grads[0] is not None else torch.zeros_like(ds)
        elif nonadd:
            (ds,) = torch.autograd.grad(s, raw, ds)  # (with score_tensors, s always needs grad through raw)
        if nonadd and vis is not None:  # a modifier's derivative may be non-finite where the mask hides the pair
            ds = torch.where(vis, ds, torch.zeros_like(ds))
        ds5 = ds.reshape(B, Hkv, g, L, S)
        dq[:, :, rows] += (ds5 @ ks.unsqueeze(2)).reshape(B, Hq, L, D) * pb.scale
        dk[:, :, keys] += (ds5.transpose(-1, -2) @ qs.reshape(B, Hkv, g, L, D)).sum(2) * pb.scale
        dv[:, :, keys] += (pv.reshape(B, Hkv, g, L, S).transpose(-1, -2) @ do.reshape(B, Hkv, g, L, Dv)).sum(2)
    return dq, dk, dv, tuple(dts)
