"""How a sequence is split over ranks: which global positions each rank's shard holds.

A shard is a tuple of :class:`Run`\\ s: arithmetic runs of global positions
``start, start + stride, ...`` stored one after another in the local tensor.

=============  ======================================  ==========================================
layout         rank ``r`` of ``P`` holds                runs
=============  ======================================  ==========================================
CONTIGUOUS     chunk ``r`` of ``P``                     one run, stride 1
ZIGZAG         chunks ``r`` and ``2P-1-r`` of ``2P``    two runs, stride 1 (balances causal work)
STRIPED        positions ``r, r+P, r+2P, ...``          one run, stride ``P`` (balances causal work)
=============  ======================================  ==========================================

Ring attention computes each (query run, key run) pair as one piece: stride-1 runs are plain
offsets (``q_offset`` / ``kv_offset``), stride-P runs see the mask through a position view
(:mod:`keyfold.distributed.views`, :mod:`keyfold.views`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["Layout", "Run", "shard_runs", "shard_positions", "shard", "unshard"]


class Layout(enum.Enum):
    """How the sequence dimension is split over the ranks of a group."""

    CONTIGUOUS = "contiguous"  # rank r: positions [r*n, (r+1)*n)
    ZIGZAG = "zigzag"          # rank r: chunks r and 2P-1-r of 2P equal chunks
    STRIPED = "striped"        # rank r: positions r, r+P, r+2P, ...


@dataclass(frozen=True)
class Run:
    """``length`` global positions ``start + i*stride`` stored at local rows ``local + i``."""

    local: int
    start: int
    length: int
    stride: int = 1

    def positions(self) -> torch.Tensor:
        return self.start + self.stride * torch.arange(self.length)

    @property
    def last(self) -> int:
        """The last global position of the run."""
        return self.start + self.stride * (self.length - 1)


def _divisor(layout: Layout, P: int) -> int:
    return 2 * P if layout is Layout.ZIGZAG else P


def check_length(N: int, P: int, layout: Layout, what: str = "the sequence") -> None:
    """Raise a clear error if ``N`` positions cannot be split evenly by ``layout`` over ``P`` ranks."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a keyfold.distributed.Layout (CONTIGUOUS, ZIGZAG, STRIPED), got {layout!r}")
    d = _divisor(layout, P)
    if N % d != 0:
        raise ValueError(f"{what} has {N} positions, which {layout.name} over {P} ranks cannot split evenly: "
                         f"it needs a multiple of {d}; pad the sequence (and mask the padding, e.g. with "
                         f"documents(ids)) to {-(-N // d) * d}")


def shard_runs(N: int, P: int, rank: int, layout: Layout) -> tuple[Run, ...]:
    """The runs of global positions that ``rank`` holds when ``N`` positions are split over ``P``.

    >>> shard_runs(8, 2, 0, Layout.ZIGZAG)
    (Run(local=0, start=0, length=2, stride=1), Run(local=2, start=6, length=2, stride=1))
    """
    check_length(N, P, layout)
    if not 0 <= rank < P:
        raise ValueError(f"rank must be in [0, {P}), got {rank}")
    if layout is Layout.CONTIGUOUS:
        n = N // P
        return (Run(0, rank * n, n),)
    if layout is Layout.ZIGZAG:
        c = N // (2 * P)
        return (Run(0, rank * c, c), Run(c, (2 * P - 1 - rank) * c, c))
    return (Run(0, rank, N // P, P),)


def shard_positions(N: int, P: int, rank: int, layout: Layout) -> torch.Tensor:
    """Global positions of ``rank``'s local rows, int64 ``(N // P,)``, in local order."""
    return torch.cat([r.positions() for r in shard_runs(N, P, rank, layout)])


def gather_order(N: int, P: int, layout: Layout) -> torch.Tensor:
    """Global positions of the rows of all shards concatenated in rank order, int64 ``(N,)``."""
    return torch.cat([shard_positions(N, P, r, layout) for r in range(P)])


def _group_rank_size(group):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("keyfold.distributed needs an initialised process group: call "
                           "torch.distributed.init_process_group(...) first (torchrun sets the environment)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, group=None, layout: Layout = Layout.CONTIGUOUS, *, dim: int = -2) -> torch.Tensor:
    """This rank's part of the full sequence ``x`` (sequence along ``dim``, default -2).

    x: ``(..., N, D)`` the same full tensor on every rank. Returns ``(..., N // P, D)``, a new
    contiguous tensor holding the positions of :func:`shard_positions` in that order.

    >>> q_local = shard(q, layout=Layout.ZIGZAG)   # on every rank of the group  # doctest: +SKIP
    """
    rank, P = _group_rank_size(group)
    return shard_of(x, P, rank, layout, dim=dim)


def shard_of(x: torch.Tensor, P: int, rank: int, layout: Layout, *, dim: int = -2) -> torch.Tensor:
    """:func:`shard` for an explicit ``rank`` of ``P`` (no process group needed)."""
    N = x.shape[dim]
    check_length(N, P, layout, what=f"x (dim {dim})")
    runs = shard_runs(N, P, rank, layout)
    parts = [x.narrow(dim, r.start, r.length) if r.stride == 1
             else x.index_select(dim, r.positions().to(x.device)) for r in runs]
    return torch.cat(parts, dim=dim).contiguous() if len(parts) > 1 else parts[0].contiguous()


def unshard_of(shards: list[torch.Tensor], layout: Layout, *, dim: int = -2) -> torch.Tensor:
    """Inverse of :func:`shard_of`: every rank's shard, in rank order, back in the original order."""
    P = len(shards)
    cat = torch.cat(shards, dim=dim)  # rows in rank order
    N = cat.shape[dim]
    inverse = torch.argsort(gather_order(N, P, layout)).to(cat.device)
    return cat.index_select(dim, inverse)


def unshard(x_local: torch.Tensor, group=None, layout: Layout = Layout.CONTIGUOUS, *, dim: int = -2) -> torch.Tensor:
    """Gather every rank's shard and put the rows back in the original order (all ranks get it).

    x_local: ``(..., n, D)`` on every rank, one shape on all of them (else a clear error on every
    rank). Returns ``(..., n * P, D)``. Not differentiable (use it for outputs and checks).
    """
    from .comm import Comm

    comm = Comm(group)
    comm.agree("unshard", (tuple(x_local.shape), str(x_local.dtype)), None)
    dim = dim % x_local.dim()
    moved = x_local.movedim(dim, 0).contiguous()                 # (n, ...)
    gathered = comm.all_gather(moved).wait()                    # (P, n, ...)
    shards = [gathered[r].movedim(0, dim) for r in range(comm.size)]
    return unshard_of(shards, layout, dim=dim)
