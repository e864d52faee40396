"""Backend.TRITON: the project's own Triton piece kernel (CUDA, or the CPU interpreter).

One launch computes every piece of a plan: the planner classifies the (query block x key
block) grid at the kernel's own tile size, and each query block gets two lists of key
blocks, *partial* ones (the mask is evaluated inside the tile) and *full* ones (no mask
work); empty blocks are never visited. Online softmax runs in float32 and returns the
partial State ``(out, lse)`` (natural log) that :mod:`keyfold.state` merges.
Backward (docs/math.md section 2) takes the *global* ``(out, lse)``: one kernel gives dQ
per query block, one gives dK and dV per key block from the transposed lists; no atomics.

Masks run inside the kernel as a small *program*: the mask tree is rewritten as an OR of
ANDs of preset literals (causal, window, sinks, documents, block_sparse, dilated, each
possibly negated), whose op codes are compile-time constants and whose parameters
(window sizes, document ids, layouts) live in small int32 buffers. A Flex ``mask_mod``
callable cannot be traced into Triton: it is evaluated once per *partial* tile into a
cached bool bitmap that the kernel reads (full and empty tiles need no bitmap).
ALiBi and softcap (and the two chained) run in the kernel. What the kernel cannot run (a
``score_mod`` callable, float64, head_dim > 256, positions >= 2^30: :func:`why_not_native`)
raises when the caller names ``Backend.TRITON``; ``Backend.AUTO`` routes it to the tile kernel.
Details and numbers: ``docs/gpu.md``.
"""

import torch

from ... import masks as _m
from ... import scores as _s
from ...planner import Plan
from ...state import State, state_dtype
from .. import tiles as _tiles
from .._common import Problem
from ._env import _WARNED, _interpreting, _warn_once, available, check_supported, triton  # noqa: F401
from .launch import (_Launch, _configs, _fallback_plan, _last_dim_contiguous, _pow2, _program_of,
                     _tiles_forward, why_not_native)
from .program import _END, _NEGATE, _Op, _mask_program, _score_program  # noqa: F401
from .source import _bwd_dkdv_kernel, _bwd_dq_kernel, _fwd_kernel

__all__ = ["available", "check_supported", "why_not_native", "forward", "backward", "compile_for_gpu", "USE_ATEN_DENSE"]

# True: plain dense 16-bit pieces on CUDA go forward through PyTorch's own flash op (aten).
# Off by default: on an H200 (torch 2.11, benchmarks/results/gpu.md) that op took 1.4-1.5x the
# Triton kernel's time (bf16 dense forward, N = 2k-32k: 287-349 vs 403-506 TFLOP/s).
USE_ATEN_DENSE = False


_BITMAPS = "the mask callable's tile bitmaps would exceed 256 MiB"


def refusal(why: str) -> ValueError:
    """The error of a call that names Backend.TRITON for what the kernel cannot run."""
    return ValueError(f"backend=Backend.TRITON cannot run {why}; use Backend.AUTO, which routes this call "
                      f"to Backend.TILES, or name Backend.TILES")


def forward(q, k, v, plan: Plan, pb: Problem, fallback: bool = False) -> State:
    """Attention of q over these keys under ``pb``: the merged State (float32).

    ``plan`` is the engine's plan; the kernel re-plans at its own tile size (cached).
    fallback: run on the tile kernel (one warning) when a mask callable's bitmaps are too
    big, as ``Backend.AUTO`` does; False (a named backend) raises instead.
    """
    why = why_not_native(q, k, v, pb)
    if why is not None:
        raise refusal(why)
    if _aten_dense_ok(q, k, v, pb):
        st = _aten_dense(q, k, v, pb)
        if st is not None:
            return st
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    cfg = _configs(q, q.shape[-1], v.shape[-1], _program_of(pb))[0]
    L = _Launch(q, k, v, pb, cfg)
    if L.layout is None:
        if not fallback:
            raise refusal(_BITMAPS + " (write the mask with keyfold presets to run it in the kernel)")
        return _tiles_forward(q, k, v, pb, _BITMAPS + ": it runs on the tile kernel; write it with keyfold "
                              "presets to run in the kernel")
    sd = state_dtype(q.dtype)
    out = torch.empty(L.B, L.Hq, L.Nq, L.Dv, dtype=sd, device=q.device)
    lse = torch.empty(L.B, L.Hq, L.Nq, dtype=sd, device=q.device)
    if L.Nq == 0:
        return State(out, lse)
    lay = L.layout
    grid = (triton.cdiv(L.Nq, cfg.block_m), L.B * L.Hq)
    _fwd_kernel[grid](q, k, v, out, lse,
                      q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                      *lay.fwd, lay.params, lay.aux, lay.bits, L.slopes, L.cap,
                      L.Hq, L.G, L.Nq, L.Nk, L.D, L.Dv, *L.scalars,
                      EVEN_N=L.Nk % cfg.block_n == 0, **L.const)
    return State(out, lse)


def backward(q, k, v, out, lse, dout, dlse, plan: Plan, pb: Problem, fallback: bool = False):
    """dq, dk, dv (float32) of these keys from the *global* out/lse (and dlse), docs/math.md §2.
    ``fallback`` as in :func:`forward`."""
    why = why_not_native(q, k, v, pb)
    if why is not None:
        raise refusal(why)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    _, cfg_dq, cfg = _configs(q, q.shape[-1], v.shape[-1], _program_of(pb))
    L = _Launch(q, k, v, pb, cfg)                                   # dK/dV's tiles
    Lq = L if cfg_dq == cfg else _Launch(q, k, v, pb, cfg_dq)       # dQ's, when they differ
    if L.layout is None or Lq.layout is None:
        if not fallback:
            raise refusal(_BITMAPS + " (write the mask with keyfold presets to run it in the kernel)")
        _warn_once("bitmaps", _BITMAPS + ": it runs on the tile kernel")
        return _tiles.backward(q, k, v, out, lse, dout, dlse, _fallback_plan(q, k, pb), pb)
    sd = state_dtype(q.dtype)
    # Rows that saw no key have lse = -inf; every tile hides them, so any finite stand-in
    # gives P = 0 there (while -inf - -inf would be NaN).
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(torch.float32).contiguous()
    delta = (dout.to(sd) * out.to(sd)).sum(-1)                 # (B, Hq, Nq): D_i = dO_i . O_i
    if dlse is not None:
        delta = delta - dlse.to(sd)                             # the lse gradient enters here
    delta = delta.to(torch.float32).contiguous()
    do = _last_dim_contiguous(dout.to(q.dtype))
    dq = torch.zeros(L.B, L.Hq, L.Nq, L.D, dtype=sd, device=q.device)
    dk = torch.zeros(L.B, L.Hkv, L.Nk, L.D, dtype=sd, device=q.device)
    dv = torch.zeros(L.B, L.Hkv, L.Nk, L.Dv, dtype=sd, device=q.device)
    if L.Nq == 0 or L.Nk == 0:
        return dq, dk, dv
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    def tail(lay):  # the mask program's data as one launch's tiles see it, then the score's
        return lay.params, lay.aux, lay.bits, L.slopes, L.cap
    lay = Lq.layout
    _bwd_dq_kernel[(triton.cdiv(L.Nq, cfg_dq.block_m), L.B * L.Hq)](
        q, k, v, do, lse_safe, delta, dq, *strides, *lay.fwd, *tail(lay),
        L.Hq, L.G, L.Nq, L.Nk, L.D, L.Dv, *L.scalars,
        EVEN_N=L.Nk % cfg_dq.block_n == 0, **Lq.const)
    lay = L.layout
    _bwd_dkdv_kernel[(triton.cdiv(L.Nk, cfg.block_n), L.B * L.Hkv)](
        q, k, v, do, lse_safe, delta, dk, dv, *strides, *lay.bwd, *tail(lay),
        L.Hq, L.Hkv, L.G, L.Nq, L.Nk, L.D, L.Dv, *L.scalars, **L.const)
    return dq, dk, dv


# ============================================================================ aten dense path


_ATEN_BROKEN: list = []


def _aten_dense_ok(q, k, v, pb: Problem) -> bool:
    """A plain dense 16-bit piece on CUDA that PyTorch's flash op can compute."""
    return (USE_ATEN_DENSE and not _ATEN_BROKEN and q.device.type == "cuda" and pb.mask is None
            and pb.score is None and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[1] == k.shape[1] and q.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention"))


def _aten_dense(q, k, v, pb: Problem) -> State | None:
    """``(out, lse)`` from ``aten._scaled_dot_product_flash_attention`` (lse natural log)."""
    try:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=pb.scale)
        out, lse = res[0], res[1]
        return State(out.float(), lse[..., :q.shape[2]].float().contiguous())
    except Exception as e:  # noqa: BLE001 - any failure: use the Triton kernel from now on
        _ATEN_BROKEN.append(repr(e))
        _warn_once("aten", f"aten flash op failed ({e!r}); dense pieces use the Triton kernel")
        return None


# ============================================================================ compile check


def compile_for_gpu(arch: int = 90, dtype: str = "bf16", head_dim: int = 128, mask=None, score=None,
                    kernels=("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"), aligned: bool = True) -> dict:
    """Compile the three kernels ahead of time for an NVIDIA GPU of compute capability ``arch``
    (90 = H100/H200) without one: proves they lower to a cubin. Returns per kernel
    ``{"seconds", "shared_bytes"}``. Needs triton with its bundled ptxas, and must run in a
    process where TRITON_INTERPRET is unset (the interpreter replaces the kernels).

    mask, score: the settings whose programs to compile (default ``causal() & (window(64) |
    sinks(4))`` with ``[alibi, softcap]``, which exercises most of the in-kernel code).
    kernels: which of the three to compile.
    aligned: compile as a launch on aligned tensors with sizes divisible by 16 is specialised
    (Triton's ``tt.divisibility``); without it the kernels pipeline less and need less shared
    memory than they do on the GPU.
    """
    import time

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if _interpreting():
        raise RuntimeError("compile_for_gpu needs TRITON_INTERPRET unset (run it in a fresh process)")
    if mask is None:
        mask = _m.causal() & (_m.window(64) | _m.sinks(4))
    score = _s.as_score([_s.alibi(torch.ones(1)), _s.softcap(30.0)] if score is None else score)
    prog = _mask_program(_m.as_mask(mask))
    kind = _score_program(score)
    if kind is None:
        raise ValueError(f"score {score!r} does not run in the kernel")
    d = _pow2(head_dim)
    const = dict(PROG=prog.code, NLIT=prog.nlit, SCORE=int(kind[0]), BLOCK_D=d, BLOCK_DV=d,
                 IEEE=dtype == "fp32")
    fake = torch.empty(1, dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype],
                       device="meta")
    fwd, dq, dkdv = _configs(_MetaCuda(fake), head_dim, head_dim, prog)
    ptrs = {n: "*i32" for n in ("p_ptr", "p_col", "f_ptr", "f_lo", "f_hi", "p_row", "p_slot", "prm", "aux")}
    ptrs.update(bits="*i8", slopes="*fp32", O="*fp32", LSE="*fp32", DELTA="*fp32", DQ="*fp32", DK="*fp32",
                DV="*fp32", **{n: "*" + dtype for n in ("Q", "K", "V", "DO")})
    result = {}
    for fn, cfg, extra in ((_fwd_kernel, fwd, dict(EVEN_N=False)), (_bwd_dq_kernel, dq, dict(EVEN_N=False)),
                           (_bwd_dkdv_kernel, dkdv, {})):
        if fn.__name__ not in kernels:
            continue
        c = dict(const, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **extra)
        sig = {n: "constexpr" if n in c else ptrs.get(n, "fp32" if n in ("cap", "sm_scale") else "i32")
               for n in fn.arg_names}
        t0 = time.perf_counter()
        # a real launch marks 16-byte-aligned pointers and integers divisible by 16 (here: all of
        # them, the launch with the most room to pipeline and so the most shared memory)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if aligned and n not in c and sig[n] != "fp32"}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        result[fn.__name__] = {"seconds": round(time.perf_counter() - t0, 2), "shared_bytes": k.metadata.shared}
    return result


class _MetaCuda:
    """Stands in for a CUDA tensor when choosing configs for a GPU that is not here."""

    def __init__(self, t):
        self.dtype = t.dtype
        self.device = torch.device("cuda")
