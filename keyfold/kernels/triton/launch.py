"""Launch settings: block configs per device and head size, the per-query-block key lists
(partial and full tiles, CSR), mask-callable tile bitmaps, and one launch's arguments."""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ... import masks as _m
from ...planner import Plan, _plan
from .. import tiles as _tiles
from .._common import Problem
from ._env import _FALLBACK_SPAN, _MAX_POS, _TILE_BITMAP_BUDGET, _warn_once
from .program import _ALL_VISIBLE, _LOCK, _MaskProgram, _check_extents, _mask_program, _score_program

@dataclass(frozen=True)
class _Config:
    """Tile sizes and launch settings of one kernel."""

    block_m: int     # queries per tile
    block_n: int     # keys per tile
    num_warps: int
    num_stages: int


# Set by the GPU benchmark's tuner (``python -m keyfold bench gpu --tune``) alone: "fwd", "dq"
# or "dkdv" -> a _Config used instead of the table below.
_CONFIG_OVERRIDE: dict = {}


def _configs(q, D: int, Dv: int, prog) -> tuple[_Config, _Config, _Config]:
    """(forward, dQ, dK/dV) configs for a mask program; the two backward kernels may tile
    differently (each plans at its own tile size). The interpreter uses 16 x 16 tiles so
    tiny test shapes still have empty, partial and full tiles. CUDA sizes were chosen by
    compiling for sm_90 (``compile_for_gpu``, specialised as an aligned launch is) and reading
    ptxas's register report and the shared memory: no spills in the forward for bf16 head_dim
    128 (128 x 128 tiles; 128 x 64 once the program has > 3 literals or reads a per-pair table,
    whose staging took 256 and 352 KiB of shared memory at 128 x 128, over the H100/H200's
    227 KiB). The backward's were then timed on an H200 (``python -m keyfold bench gpu --tune``,
    benchmarks/results/gpu-tune.md: bf16 causal N=8192 forward + backward 18.7 ms with both at
    64 x 64, 8 warps, 2 stages; 10.5 ms with dQ at 128 x 64, 8 warps, 3 stages and dK/dV at
    64 x 64, 4 warps, 2 stages)."""
    fwd, dq, dkdv = _table(q, D, Dv, prog)
    o = _CONFIG_OVERRIDE
    return o.get("fwd", fwd), o.get("dq", dq), o.get("dkdv", dkdv)


def _table(q, D: int, Dv: int, prog) -> tuple[_Config, _Config, _Config]:
    if q.device.type != "cuda":
        return _Config(16, 16, 4, 1), _Config(16, 16, 4, 1), _Config(16, 16, 4, 1)
    width = max(D, Dv)
    if q.dtype == torch.float32:
        if width <= 64:
            return _Config(64, 32, 4, 2), _Config(32, 32, 4, 1), _Config(32, 32, 4, 1)
        return _Config(32, 32, 4, 1), _Config(16, 32, 4, 1), _Config(16, 32, 4, 1)
    if width <= 64:
        return _Config(128, 64, 4, 3), _Config(64, 64, 4, 2), _Config(64, 64, 4, 2)
    if width <= 128:
        narrow = prog.nlit > 3 or prog.gathers
        return _Config(128, 64 if narrow else 128, 8, 3), _Config(128, 64, 8, 3), _Config(64, 64, 4, 2)
    return _Config(64, 32, 8, 2), _Config(32, 32, 8, 1), _Config(32, 32, 8, 1)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@dataclass
class _Layout:
    """Per plan (one tile size) and device: the kernels' block lists and tile bitmaps."""

    plan: Plan
    fwd: tuple    # p_ptr, p_col, f_ptr, f_lo, f_hi: per query block, its partial key blocks
                  # and its runs [f_lo, f_hi) of full key blocks
    bwd: tuple    # p_ptr, p_row, p_slot, f_ptr, f_lo, f_hi: the same per key block (query blocks)
    params: torch.Tensor
    aux: torch.Tensor
    bits: torch.Tensor


_LAYOUTS: "OrderedDict[tuple, _Layout]" = OrderedDict()


def _csr(kinds: torch.Tensor, kind: _m.BlockKind):
    """Row pointers and column indices of the ``kind`` blocks, row-major (int32)."""
    r, c = torch.nonzero(kinds == int(kind), as_tuple=True)
    ptr = torch.zeros(kinds.shape[0] + 1, dtype=torch.int64)
    ptr[1:] = torch.bincount(r, minlength=kinds.shape[0]).cumsum(0)
    return ptr.to(torch.int32), c.to(torch.int32), r


def _runs(kinds: torch.Tensor, kind: _m.BlockKind):
    """Row pointers and ``[lo, hi)`` column runs of consecutive ``kind`` blocks (int32)."""
    r, c = torch.nonzero(kinds == int(kind), as_tuple=True)
    start = torch.ones_like(r, dtype=torch.bool)
    start[1:] = (r[1:] != r[:-1]) | (c[1:] != c[:-1] + 1)
    end = torch.ones_like(start)
    end[:-1] = start[1:]
    ptr = torch.zeros(kinds.shape[0] + 1, dtype=torch.int64)
    ptr[1:] = torch.bincount(r[start], minlength=kinds.shape[0]).cumsum(0)
    return ptr.to(torch.int32), c[start].to(torch.int32), (c[end] + 1).to(torch.int32)


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    return t if t.numel() else torch.zeros(1, dtype=t.dtype)


def _layout(pb: Problem, prog: _MaskProgram, q, Nk: int, cfg: _Config) -> _Layout | None:
    """Plan at the kernel's tile size and build (or fetch) its block lists on q's device.

    Returns None when a mask callable's tile bitmaps would exceed the memory budget.
    """
    B, Hq, Nq = q.shape[:3]
    plan = _plan(pb.mask, Nq, Nk, q_offset=pb.q_offset, kv_offset=pb.kv_offset, B=B, H=Hq,
                 block_size=(cfg.block_m, cfg.block_n), max_span=None, allow_causal=False)
    key = (id(plan), q.device)
    with _LOCK:
        hit = _LAYOUTS.get(key)
    if hit is not None and hit.plan is plan:
        return hit
    kinds = plan.kinds
    p_ptr, p_col, p_rows = _csr(kinds, _m.BlockKind.PARTIAL)
    full = _runs(kinds, _m.BlockKind.FULL)
    slot_of = torch.full(kinds.shape, -1, dtype=torch.int64)
    slot_of[p_rows, p_col.long()] = torch.arange(p_col.numel())
    tp_ptr, tp_row, tp_cols = _csr(kinds.t(), _m.BlockKind.PARTIAL)
    tp_slot = slot_of[tp_row.long(), tp_cols].to(torch.int32)
    tfull = _runs(kinds.t(), _m.BlockKind.FULL)
    params, bits = prog.params, torch.zeros(1, dtype=torch.int8)
    if prog.tile_mask is not None and p_col.numel():
        got = _tile_bitmaps(prog.tile_mask, plan, p_ptr, p_col, B, Hq, cfg)
        if got is None:
            return None
        bits, params = got
    dev = q.device
    lay = _Layout(plan,
                  tuple(_nonempty(t).to(dev) for t in (p_ptr, p_col, *full)),
                  tuple(_nonempty(t).to(dev) for t in (tp_ptr, tp_row, tp_slot, *tfull)),
                  params.to(dev), prog.aux.to(dev), bits.to(dev))
    with _LOCK:
        _LAYOUTS[key] = lay
        if len(_LAYOUTS) > 32:
            _LAYOUTS.popitem(last=False)
    return lay


def _tile_bitmaps(mask, plan: Plan, p_ptr, p_col, B: int, Hq: int, cfg: _Config):
    """A mask callable on every partial tile: int8 ``(n_partial, Be, He, BM, BN)`` and the
    TILE literal's parameters; None over the memory budget. One mask call per query block."""
    bm, bn = cfg.block_m, cfg.block_n
    q_last, k_last = plan.q_offset + plan.Nq - 1, plan.kv_offset + plan.Nk - 1
    rows, Be, He = [], None, None
    for qb in range(plan.kinds.shape[0]):
        cols = p_col[int(p_ptr[qb]):int(p_ptr[qb + 1])].long()
        if cols.numel() == 0:
            continue
        qp = (plan.q_offset + qb * bm + torch.arange(bm)).clamp(max=q_last).view(1, 1, bm, 1)
        kp = (plan.kv_offset + cols.view(-1, 1) * bn + torch.arange(bn)).clamp(max=k_last).view(1, 1, 1, -1)
        m = mask.evaluate(torch.arange(B).view(B, 1, 1, 1), torch.arange(Hq).view(1, Hq, 1, 1), qp, kp)
        m = m.view((1,) * (4 - m.dim()) + tuple(m.shape))
        if Be is None:
            Be, He = m.shape[0], m.shape[1]
            if p_col.numel() * Be * He * bm * bn > _TILE_BITMAP_BUDGET:
                return None
        m = torch.broadcast_to(m, (Be, He, bm, cols.numel() * bn))
        rows.append(m.reshape(Be, He, bm, cols.numel(), bn).permute(3, 0, 1, 2, 4))  # (n, Be, He, BM, BN)
    bits = torch.cat(rows).to(torch.int8).contiguous()
    tile = bm * bn
    params = torch.tensor([[Be * He * tile, He * tile if Be > 1 else 0, tile if He > 1 else 0, 0]],
                          dtype=torch.int32)
    return bits, params


def why_not_native(q, k, v, pb: Problem) -> str | None:
    """What in these inputs the Triton kernel cannot run (None when it runs them). The engine
    raises with it when the caller named ``Backend.TRITON`` and routes to ``Backend.TILES`` under
    ``Backend.AUTO``."""
    if q.dtype == torch.float64:
        return "float64 inputs (the Triton kernel is for 16- and 32-bit floats)"
    if _score_program(pb.score) is None:
        return (f"score {pb.score!r} is not ALiBi/softcap (alone or chained): a score_mod callable "
                f"cannot be traced into Triton")
    if max(q.shape[-1], v.shape[-1]) > 256:
        return f"head_dim {max(q.shape[-1], v.shape[-1])} > 256"
    Nq, Nk = q.shape[2], k.shape[2]
    if max(abs(pb.q_offset) + Nq, pb.kv_offset + Nk) >= _MAX_POS:
        return (f"positions >= 2^30 (q_offset={pb.q_offset}, kv_offset={pb.kv_offset}; the kernel "
                f"computes positions in int32)")
    return None


def _fallback_plan(q, k, pb: Problem) -> Plan:
    return _plan(pb.mask, q.shape[2], k.shape[2], q_offset=pb.q_offset, kv_offset=pb.kv_offset,
                 B=q.shape[0], H=q.shape[1], max_span=_FALLBACK_SPAN, allow_causal=False)


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class _Launch:
    """Everything a launch needs that does not depend on forward vs backward."""

    def __init__(self, q, k, v, pb: Problem, cfg: _Config):
        self.B, self.Hq, self.Nq, self.D = q.shape
        self.Hkv, self.Nk, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = self.Hq // self.Hkv
        self.prog = _program_of(pb)
        if pb.mask is not None and self.prog.tile_mask is None:
            _check_extents(pb.mask, self.B, self.Hq)
        self.layout = _layout(pb, self.prog, q, self.Nk, cfg)
        kind, slopes, cap = _score_program(pb.score)
        self.score = int(kind)
        # device copies are cached: a host-to-device copy per call would wait for the GPU
        self.slopes = slopes.on(q.device) if slopes is not None else _zeros(self.Hq, q.device)
        self.cap = float(cap)
        self.cfg = cfg
        self.ieee = q.dtype == torch.float32 and not (q.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
        self.const = dict(PROG=self.prog.code, NLIT=self.prog.nlit, SCORE=self.score,
                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_pow2(self.D),
                          BLOCK_DV=_pow2(self.Dv), IEEE=self.ieee,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self.scalars = (pb.q_offset, pb.kv_offset, pb.scale)


_ZEROS: dict = {}


def _zeros(n: int, device) -> torch.Tensor:
    """A cached float32 zero vector on ``device`` (the slopes of a call without ALiBi)."""
    key = (n, str(device))
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(n, dtype=torch.float32, device=device)
    return _ZEROS[key]


def _program_of(pb: Problem) -> _MaskProgram:
    return _mask_program(pb.mask) if pb.mask is not None else _ALL_VISIBLE


def _tiles_forward(q, k, v, pb, why):
    _warn_once(why, why)
    return _tiles.forward(q, k, v, _fallback_plan(q, k, pb), pb)
