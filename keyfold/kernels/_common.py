"""What every piece kernel needs: a piece's positions, its mask tile and its bias tile."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import Mask, grid_positions
from ..planner import Piece, PieceKind
from ..scores import ScoreMod

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Problem:
    """Everything about one call except the tensors: what the kernels need to know."""

    mask: Mask | None
    score: ScoreMod | None
    scale: float
    q_offset: int
    kv_offset: int


def positions(q: torch.Tensor, piece: Piece, pb: Problem):
    """Index tensors for a piece: b (B,1,1,1), h (1,Hq,1,1), qp (1,1,L,1), kp (1,1,1,S)."""
    B, Hq = q.shape[0], q.shape[1]
    return grid_positions(B, Hq, pb.q_offset + piece.q0, piece.q1 - piece.q0,
                          pb.kv_offset + piece.k0, piece.k1 - piece.k0, q.device)


def visible(q: torch.Tensor, piece: Piece, pb: Problem, pos=None) -> torch.Tensor | None:
    """Bool tile ``(B|1, Hq|1, L, S)`` of visible pairs, or None when all are visible."""
    if piece.kind is PieceKind.FULL or pb.mask is None:
        return None
    if piece.kind is PieceKind.CAUSAL:
        L, S = piece.q1 - piece.q0, piece.k1 - piece.k0
        i = torch.arange(L, device=q.device).view(1, 1, L, 1)
        j = torch.arange(S, device=q.device).view(1, 1, 1, S)
        return j <= i
    b, h, qp, kp = pos if pos is not None else positions(q, piece, pb)
    m = pb.mask.evaluate(b, h, qp, kp)
    return m.view((1,) * (4 - m.dim()) + tuple(m.shape)) if m.dim() < 4 else m


def empty_rows(vis: torch.Tensor | None):
    """``(B|1, H|1, L)`` bool: rows of the tile with no visible key (None if there are none)."""
    if vis is None:
        return None
    rows = ~vis.any(-1)
    return rows if bool(rows.any()) else None
