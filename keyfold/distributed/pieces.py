"""One rank's work against one key shard: every (query run, key run) pair is one ``attend``.

Forward merges the pieces into a float32 accumulator. Backward takes two passes over the key
shards: :func:`piece_sums` adds each row's sums of P and P dP (``attend_row_sums``, with the
*global* ``out``/``lse``, docs/math.md section 2), then :func:`piece_grads` runs
``attend_backward`` per piece with those totals, so P is renormalised over the whole row and
D_i = sum P dP, as one process's backward takes them. Ring and all-gather attention are loops
over these functions; they differ only in how the key shards arrive.
"""

from __future__ import annotations

from dataclasses import dataclass


from ..engine import Backend, attend, attend_backward, attend_row_sums
from ..masks import Mask
from ..scores import ScoreMod
from ..state import State, merge, state_dtype
from .layout import Layout, Run, shard_runs
from .views import is_empty, piece_args

__all__ = ["Job", "accumulate", "piece_grads", "piece_sums"]


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


def _wide(q, k, v, dout):
    """16-bit inputs in float32: the fused kernels return each piece's gradient in the input dtype,
    and summing P shares each rounded to 16 bits would make the error grow with the number of
    ranks. Upcasting costs O(n*D) per shard against O(n^2*D) of compute."""
    sd = state_dtype(q.dtype)
    return (t.to(sd) for t in (q, k, v, dout))


def piece_sums(q, k, v, lse, dout, job: Job, src: int, sums, heads=None) -> None:
    """Add each local row's sums of P and P dP over key shard ``src`` to ``sums`` ``(3, B, Hq, n)``
    float64 (:func:`keyfold.attend_row_sums`); a pass over every shard gives the totals
    :func:`piece_grads` needs."""
    q, k, v, dout = _wide(q, k, v, dout)
    for qr, kr, m, s, qo, ko in _pieces(job, src, heads):
        rows, keys = slice(qr.local, qr.local + qr.length), slice(kr.local, kr.local + kr.length)
        sums[..., rows] += attend_row_sums(q[:, :, rows], k[:, :, keys], v[:, :, keys], lse[:, :, rows],
                                           dout[:, :, rows], mask=m, score=s, scale=job.scale, q_offset=qo,
                                           kv_offset=ko)


def piece_grads(q, k, v, out, lse, dout, dlse, job: Job, src: int, dq, dk, dv, sums, heads=None) -> None:
    """Add this rank's gradient shares for key shard ``src``: ``dq += ``, ``dk += ``, ``dv += ``.

    out, lse, dout, dlse: the global (merged) forward results of the local queries and their
    gradients; sums: the rows' totals from :func:`piece_sums` over every shard; dq
    ``(B, Hq, n, D)``, dk/dv ``(B, Hkv, n, D|Dv)`` float32 accumulators.
    """
    q, k, v, dout = _wide(q, k, v, dout)
    for qr, kr, m, s, qo, ko in _pieces(job, src, heads):
        rows, keys = slice(qr.local, qr.local + qr.length), slice(kr.local, kr.local + kr.length)
        gq, gk, gv = attend_backward(
            q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows], dout[:, :, rows],
            mask=m, score=s, scale=job.scale, q_offset=qo, kv_offset=ko,
            dlse=None if dlse is None else dlse[:, :, rows], row_sums=sums[..., rows])
        dq[:, :, rows] += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
