"""One rank's work against one key shard: every (query run, key run) pair is one ``attend``.

Forward merges the pieces into a float32 accumulator; backward runs ``attend_backward`` per
piece with the *global* ``out``/``lse`` (docs/math.md section 2) and only sums. Ring and
all-gather attention are loops over these two functions; they differ only in how the key
shards arrive.
"""

from __future__ import annotations

from dataclasses import dataclass


from ..engine import Backend, attend, attend_backward
from ..masks import Mask
from ..scores import ScoreMod
from ..state import State, merge, state_dtype
from .layout import Layout, Run, shard_runs
from .views import is_empty, piece_args

__all__ = ["Job", "accumulate", "piece_grads"]


@dataclass(frozen=True)
class Job:
    """Everything about a sharded call except the tensors."""

    mask: Mask | None
    score: ScoreMod | None
    scale: float | None
    backend: Backend
    layout: Layout
    N: int       # global sequence length
    P: int       # ranks
    rank: int

    def runs(self, rank: int) -> tuple[Run, ...]:
        return shard_runs(self.N, self.P, rank, self.layout)


def _pieces(job: Job, src: int, heads):
    for qr in job.runs(job.rank):
        for kr in job.runs(src):
            m, s, qo, ko = piece_args(job.mask, job.score, qr, kr, heads)
            if not is_empty(m, qr.length, kr.length, qo, ko):
                yield qr, kr, m, s, qo, ko


def accumulate(acc: State, q, k, v, job: Job, src: int, heads=None) -> int:
    """Merge attention of the local queries over key shard ``src`` into ``acc`` (in place).

    q: ``(B, Hq, n, D)`` local queries; k, v: ``(B, Hkv, n, D|Dv)`` rank ``src``'s shard.
    acc: float32 State ``(B, Hq, n, Dv)``. Returns the number of pieces computed.
    """
    count = 0
    for qr, kr, m, s, qo, ko in _pieces(job, src, heads):
        rows, keys = slice(qr.local, qr.local + qr.length), slice(kr.local, kr.local + kr.length)
        part = attend(q[:, :, rows], k[:, :, keys], v[:, :, keys], mask=m, score=s, scale=job.scale,
                      q_offset=qo, kv_offset=ko, backend=job.backend)
        merged = merge(State(acc.out[:, :, rows], acc.lse[:, :, rows]), part)
        acc.out[:, :, rows] = merged.out
        acc.lse[:, :, rows] = merged.lse
        count += 1
    return count


def piece_grads(q, k, v, out, lse, dout, dlse, job: Job, src: int, dq, dk, dv, heads=None) -> None:
    """Add this rank's gradient shares for key shard ``src``: ``dq += ``, ``dk += ``, ``dv += ``.

    out, lse, dout, dlse: the global (merged) forward results of the local queries and their
    gradients; dq ``(B, Hq, n, D)``, dk/dv ``(B, Hkv, n, D|Dv)`` float32 accumulators.

    16-bit inputs are computed in float32 here: the fused kernels return each piece's gradient
    in the input dtype, and summing P shares each rounded to 16 bits would make the error grow
    with the number of ranks. Upcasting costs O(n*D) per shard against O(n^2*D) of compute.
    """
    sd = state_dtype(q.dtype)
    q, k, v, dout = (t.to(sd) for t in (q, k, v, dout))
    for qr, kr, m, s, qo, ko in _pieces(job, src, heads):
        rows, keys = slice(qr.local, qr.local + qr.length), slice(kr.local, kr.local + kr.length)
        gq, gk, gv = attend_backward(
            q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows], dout[:, :, rows],
            mask=m, score=s, scale=job.scale, q_offset=qo, kv_offset=ko,
            dlse=None if dlse is None else dlse[:, :, rows], backend=job.backend)
        dq[:, :, rows] += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
