"""What every piece kernel needs: a piece's positions, its mask tile and its bias tile."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..masks import Mask, grid_positions
from ..planner import Piece, PieceKind
from ..scores import ScoreKind, ScoreMod

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Problem:
    """Everything about one call except the tensors: what the kernels need to know."""

    mask: Mask | None
    score: ScoreMod | None
    scale: float
    q_offset: int
    kv_offset: int
    dropout_p: float = 0.0  # SDPA's attention dropout (TILES and REFERENCE paths)
    dropout_seed: int = 0   # the keep mask is a pure function of (seed, b, h, qp, kp): see dropout_keep


def softcap_cap(pb: "Problem") -> float | None:
    """The cap when the call's score is exactly ``softcap(cap)`` (nothing chained to it), else None."""
    spec = pb.score.spec() if pb.score is not None else None
    return spec[1]["cap"] if spec is not None and spec[0] is ScoreKind.SOFTCAP else None


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


def row_divisor(total: torch.Tensor) -> torch.Tensor:
    """A row's sum to divide by: 1 where it is 0 (a row that sees no key keeps its zeros)"""
    return torch.where(total > 0, total, torch.ones_like(total))


def empty_rows(vis: torch.Tensor | None):
    """``(B|1, H|1, L)`` bool: rows of the tile with no visible key (None if there are none)."""
    if vis is None:
        return None
    rows = ~vis.any(-1)
    return rows if bool(rows.any()) else None


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values < 2**32;
    every product stays below 2**63, so nothing overflows."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _mix32_int(x: int) -> int:
    """:func:`_mix32` on a Python int below 2**32"""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def dropout_keep(seed: int, p: float, b, h, qp, kp, H: int) -> torch.Tensor:
    """Bool ``(B, H, L, S)``: which attention probabilities dropout keeps (each with probability 1 - p).

    A counter-based draw: a hash of (seed, batch b, head h, absolute query qp, absolute key kp), so
    the forward and the backward regenerate the same mask tile by tile, any tiling gives the same
    mask, and no N x N mask is ever stored. b, h, qp, kp broadcast as in :func:`positions`.

    The seed (below 2**64) is hashed on its own before it meets the indices, and every row carries
    two independent 32-bit states whose key hashes are xored: seeds that differ in low bits had
    given the same masks on other (batch, head) slots (s and s ^ d for d < B H: the seed was xored
    into the slot index before one bijection), and two rows whose one state differed by d < S had
    keep masks that were permutations of each other (a helper's fuzz, 2026-12-06).
    """
    st_a = _mix32_int(_mix32_int(seed & _M32) ^ ((seed >> 32) & _M32))
    st_b = _mix32_int(st_a ^ 0x9E3779B9)
    bh = (b * H + h) & _M32
    q32, k32 = qp & _M32, kp & _M32
    row_a = _mix32(_mix32(bh ^ st_a) ^ q32)                    # (B, H, L, 1)
    row_b = _mix32(_mix32(bh ^ st_b) ^ q32)
    x = _mix32(_mix32(row_a ^ k32)) ^ _mix32(row_b ^ ((k32 * 0x6C8E9CF5) & _M32))  # (B, H, L, S): < 2**63
    return x >= int(p * 4294967296.0)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags this CPU reports in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


#: Rows a head up to which group_matmul multiplies a GQA group one head at a time (float32)
GROUP_ROWS = 16


def group_matmul(a: torch.Tensor, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``a (B, Hkv, g, L, X)`` times ``b (B, Hkv, X, Y)`` (or ``b``'s last two dimensions transposed, a
    view) for each of a GQA group's g heads: ``(B, Hkv, g, L, Y)``.

    Broadcast, b meets the group's g·L rows folded into one product (or a contiguous copy of b), which
    torch sums in one chain a dimension; the naive attention multiplies one head at a time, and torch sums
    the dot products of a few rows in vector lanes (up to 2 rows at head size 64, 5 at 128, 10 at 256,
    15 at 512). With up to GROUP_ROWS rows a head, b is repeated per head and each head multiplied as the
    naive attention does (the same bits): folded, float32 scores at head size 128 and std 6 put the tile
    and reference paths past the rule in 23-25 of 40 calls of 4 heads of 5 rows (up to 6.2x), and 4-9
    of 40 with groups folding into 2-4 rows over 2 kv heads. float64 sums exactly enough either way.

    A ``b`` whose batch and head dimensions do not flatten into one (the (B, N, H, D) layout a projection
    gives, transposed to (B, H, N, D), with B and H above 1) is copied contiguous first: torch's matmul
    then cannot batch the product and sums each score in one chain, 4x the error of its GEMM on the
    naive attention's contiguous copy (the tile kernel's softcap and score callables up to 2.3x the
    rule's allowance, its gradients without keyfold's kernels 2.9x; a review, 2026-12-07)."""
    B, Hkv, g, L = a.shape[:4]
    if B > 1 and Hkv > 1 and b.stride(0) != b.stride(1) * Hkv and a.dtype is not torch.float64:
        b = b.contiguous()
    if a.dtype is not torch.float64 and g > 1 and L <= GROUP_ROWS:
        bb = b.repeat_interleave(g, 1)
        out = a.reshape(B, Hkv * g, L, a.shape[-1]) @ (bb.transpose(-1, -2) if transpose else bb)
        return out.unflatten(1, (Hkv, g))
    return a @ (b.transpose(-1, -2) if transpose else b).unsqueeze(2)
