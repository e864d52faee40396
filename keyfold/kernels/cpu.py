"""Pieces through PyTorch's fused CPU flash kernel, merged in float32; float32 plans (on CPUs with
AVX-512) and bfloat16 ones (with AMX) through keyfold's prefill kernel instead (:func:`prefill`,
``native.prefill``), and decoding steps over 16-bit caches through its decode kernel (``native.run``).

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` returns ``(out, logsumexp)``,
which is exactly a partial State. It is a private op, so we check for it at import; if a torch
release drops it, Backend.AUTO uses the tile kernel (one warning) and Backend.CPU raises.
Facts about it that this module works around (measured, DESIGN.md section 7):

- it takes an additive float mask, not a bool one;
- a row fully masked inside a piece comes back with ``lse = 0``, not ``-inf``;
- its backward returns NaN for ``lse = -inf``;
- q, k and v must share one head size, and it has no GQA.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import warnings
from typing import NamedTuple

import torch

from ..planner import Piece, PieceKind, Plan, _causal_area, _plan
from ..state import State, empty_state, merge_all, merge_into, state_dtype
from . import native
from ._common import NEG_INF, Problem, cpu_flags, empty_rows, positions, softcap_cap, visible

__all__ = ["AVAILABLE", "dense", "forward", "prefill", "backward", "backward_on_tiles"]

# The C++ bindings where torch exposes them: ``torch.ops.aten.X`` resolves its overload in
# Python on every call, ~10-20 us that a 0.4 ms decode step notices.
_FWD = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None) or getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_BWD = getattr(_BWD, "default", _BWD)


def _probe() -> bool:
    if _FWD is None or _BWD is None:
        return False
    try:
        x = torch.zeros(1, 1, 2, 4)
        out, lse = _FWD(x, x, x, 0.0, False, attn_mask=None, scale=1.0)
        return out.shape == (1, 1, 2, 4) and lse.shape == (1, 1, 2)
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False


def _fp16_units() -> bool:
    """Whether this CPU computes float16 natively: AVX-512-FP16 or AMX-FP16 on x86; any non-x86 CPU
    is assumed to (ARM has float16 arithmetic)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return True
    return bool({"avx512_fp16", "amx_fp16"} & cpu_flags())


#: float16 inputs run the fused op in float32 (q, k, v cast once per call) on CPUs without float16
#: units: there PyTorch's float16 op converts element by element and ran 1.4-7x slower than casting and
#: running it in float32 (measured, AMD EPYC with AVX-512-BF16, N = 1..4096 queries over 4096 keys,
#: decoding included). The result is more accurate, and is a float32 state like every piece's.
#: bfloat16 stays as it is (its op ran as fast as float32's here).
FP16_AS_FP32 = not _fp16_units()


def _rows(x):
    """x with stride 1 in its last dim, the layout PyTorch's fused op assumes of q, k, v, out and dout:
    it reads any other (a transposed view) from the wrong places with no error, where the public SDPA
    checks first (found by fuzzing: errors of 0.6 to 1e35 from a transposed k or q, 2026-12-05). A copy
    only where needed; masks it reads through their strides, so they pass as they are."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _widened(dtype: torch.dtype) -> torch.dtype:
    """The dtype a call of ``dtype`` computes in: float32 for float16 where :data:`FP16_AS_FP32`."""
    return torch.float32 if FP16_AS_FP32 and dtype is torch.float16 else dtype


def _widen(q, k, v):
    """q, k, v in float32 where :data:`FP16_AS_FP32` says so for float16; others pass through."""
    if _widened(q.dtype) is not q.dtype:
        return q.float(), k.float(), v.float()
    return q, k, v


#: bfloat16 decoding goes by float32 chunks on CPUs without AMX. With AMX (Intel Xeon, 2 threads)
#: PyTorch's bfloat16 op decoded 128k keys at 20 GB/s, 1.04x SDPA's time on the float32 path, so
#: it keeps the op there; without (AMD EPYC with AVX-512-BF16) the op ran at 3.5-4.4 GB/s.
BF16_BY_CHUNKS = "amx_bf16" not in cpu_flags()

#: Bytes of float32 keys (and as many of values) a chunk of :func:`_by_chunks` holds: two such
#: buffers stay in the last-level cache between the cast and the fused op that reads them.
CHUNK_BYTES = 4 << 20


def _chunks_pay(dtype: torch.dtype, rows: int, n: int) -> bool:
    """Whether a fused call reads 16-bit keys with so few query rows that casting them to float32 a
    chunk at a time (:func:`_by_chunks`) beats the op in the input dtype. Decoding is that case:
    per byte of cache there is little arithmetic, and PyTorch's 16-bit op does it slowly (bfloat16 with
    one query row: 3.5-4.4 GB/s against 9.7-12.3 GB/s by chunks; float16 on a CPU without float16
    units ~1.5 GB/s, and casting the whole cache allocates twice its size afresh every step: 5x slower
    at 16k keys; AMD EPYC, 2 threads, B=1 H=8 D=64, 8k-128k keys). From two query rows on, the
    bfloat16 op runs twice as fast as with one and chunks no longer win; float16 by chunks wins or
    ties up to 256 rows."""
    if dtype is torch.bfloat16 and BF16_BY_CHUNKS:
        return rows == 1 and n >= 8192
    if dtype is torch.float16 and FP16_AS_FP32:
        return rows <= 256 and n >= 4096
    return False


def _by_chunks(q, k, v, scale: float):
    """``(out, lse)`` in float32 of the fused op over every key, the 16-bit keys and values cast to
    float32 one chunk at a time into two reused buffers (exact casts), the chunks' states merged."""
    B, H, n, D = k.shape
    per = max(256, CHUNK_BYTES // (B * H * max(D, v.shape[-1]) * 4))  # keys per chunk, at most
    chunks = -(-n // per)
    c = -(-n // chunks)  # equal chunks: no sliver at the end
    kb = torch.empty(B, H, c, D, dtype=torch.float32, device=k.device)
    vb = torch.empty(B, H, c, v.shape[-1], dtype=torch.float32, device=v.device)
    qf = _rows(q.float())
    states = []
    for a in range(0, n, c):
        e = min(n, a + c)
        kc, vc = kb[:, :, :e - a], vb[:, :, :e - a]
        kc.copy_(k[:, :, a:e])
        vc.copy_(v[:, :, a:e])
        states.append(State(*_FWD(qf, kc, vc, 0.0, False, attn_mask=None, scale=scale)))
    st = merge_all(states)
    return st.out, st.lse


#: Query rows up to which a call over a 16-bit cache goes to keyfold's own decode kernel
#: (:mod:`keyfold.kernels.native`) on its one-row path. Against PyTorch's op on the Intel Xeon with
#: AMX (B=1, H=8, D=64, 64k keys, 2 threads) it took 0.54-0.90x the op's time with 1 row, 0.60-0.72x
#: with 2, 0.84-0.87x with 4 and 1.3-1.5x with 8: it reads each key once, but does the rows'
#: arithmetic without a GEMM. Against the float32 chunks (:func:`_by_chunks`) it took 0.24-0.41x up
#: to 4 rows. A float32 cache stays on the op for one row (it reads at the stream's rate; from two,
#: NATIVE_F32_ROWS).
NATIVE_ROWS = 4

#: From ``native.FEW_ROWS`` (= NATIVE_ROWS + 1) rows the kernel takes its several-rows path (eight
#: rows to a key's every FMA); up to how many rows a call goes there, per cache dtype. Against the
#: op, each call after a read of 256 MiB (the cache not in any cache level; B=1, 2 key/value heads,
#: 64k keys, D=64, 2 threads): float32 0.78x (8 rows), 0.83x (16), 0.80x (32), 0.64x (64); float16
#: 0.70x, 0.82x, 0.89x, 0.80x; bfloat16 0.81x at 8 rows, but 1.25x at 16 and 1.57x at 32 against
#: the AMX op. An MQA step (8 query heads over one float32 key/value head, 128k keys) went from
#: 3.1 to 2.2 ms. With keys that the caches hold (B=1, H=8, 512-4096 keys, 8-64 rows) float32 took
#: 0.90-1.09x the op's time: about even, so the rule is the one for a cache read from memory.
NATIVE_FEW_ROWS = {torch.float32: 64, torch.float16: 64, torch.bfloat16: 8}

#: With AMX PyTorch's bfloat16 op reads a cache that the last-level cache holds faster than the
#: kernel (47 vs 38 GB/s at 16k keys), and a larger one slower (24 vs 31 GB/s at 128k, the stream
#: copy 27 GB/s; B=1, H=8, D=64): bfloat16 calls that read fewer bytes of keys and values than this
#: stay on the op there (64k keys, 128 MiB: the kernel took 0.91x the op's time).
NATIVE_BF16_BYTES = 128 << 20
#: The same for the several-rows path, whose rows make the op slower per byte: with 8 rows the op
#: took 0.85-0.91x the kernel's time on 1-2 MiB in L2, 1.18-1.37x on 32 MiB from memory.
NATIVE_BF16_FEW_BYTES = 8 << 20


#: float32 calls from this many rows (up to NATIVE_FEW_ROWS) go to the decode kernel, masked ones too
#: (up to NATIVE_MASKED_ROWS): PyTorch's op is not safe there. After ``torch.set_num_threads`` (any
#: count above 1), its products inside its parallel loop over heads are summed another way than at
#: one thread or than torch's matmul sums them: with 4-5 rows a head at head size 128 (16 heads, 399
#: to 1000 keys, scores of std 6) 3-7 of 8 calls went past the rule, up to 5.8x the naive error, with
#: a key mask, causal, ALiBi or none; with one row none. The kernel sums a row's scores in vector
#: lanes (or, from FEW_ROWS rows, in blocks): none of those past it.
NATIVE_F32_ROWS = 2

#: float32 calls of NATIVE_F32_ROWS rows on go to the decode kernel below native.MIN_KEYS keys too, from
#: this many keys times head size: the op's few-row sums bend the same way from about 40k (2-5 rows,
#: scores of std 6, 40 calls each: head size 255 over 160-224 keys 8-19 past the rule, 192 over 224
#: keys 9; none at 36.9k or below), and below it the op is the better of the two (the kernel: 1 of 40
#: at head size 192 over 128 keys; the op none, with or without a key mask). There the kernel takes
#: 1.5-2x the op's time (10-100 us).
NATIVE_F32_AREA = 32768

#: The most query rows of a float32 call with a mask tile (or an additive score's) that the decode
#: kernel takes: the rows where torch's matmul sums scores in lanes (up to 10 rows at head size 256),
#: whose sums the op's do not match (NATIVE_F32_ROWS). From one row (the kernel's exact scores, _exact):
#: one ALiBi row on the op went past the rule in 3 of 100 steps at score std 30 over 300 keys, on
#: the kernel in none, at 1.06-1.22x the step's time (1k-32k keys, head sizes 64 and 128).
NATIVE_MASKED_ROWS = 16


#: Where the decode kernel is the AVX2 build (``native.isa() == "avx2"``: ``decode_avx2.c``, CPUs without
#: AVX-512), its rows are dot products on 8-float vectors, one row at a time, so it pays for fewer rows
#: than decode.c's several-rows path, and it beats the op for one float32 row too. Kernel / op time
#: (AMD EPYC Zen 3, 2 threads, D=64, 4k-64k keys, B=1, 2 or 8 heads; /tmp timings of 2026-12-07):
#: float32 0.71-0.91x at 1 row, 0.68-0.86x at 2-4, 0.85-1.10x at 8-16, 1.15-1.36x at 32; bfloat16
#: 0.19-0.25x at 1, 0.69-0.97x at 2-4, 1.12-1.40x at 8; float16 (the op converts element by element)
#: 0.10-0.65x at every count up to 32. float32 keeps going there up to 16 rows for the rule's sake (as
#: NATIVE_F32_ROWS says) at about even time.
NATIVE_FEW_ROWS_AVX2 = {torch.float32: 16, torch.float16: 64, torch.bfloat16: 4}
#: float32 calls from this many rows take the AVX2 kernel (NATIVE_F32_ROWS for decode.c)
NATIVE_F32_ROWS_AVX2 = 1


def _native_may(dtype: torch.dtype, rows: int, n: int, least: int | None = None) -> bool:
    """The routing rule from dtype and sizes alone: up to :data:`NATIVE_ROWS` query rows for a 16-bit
    cache (float32 from :data:`NATIVE_F32_ROWS`), from there up to :data:`NATIVE_FEW_ROWS` for its dtype
    (the ``_AVX2`` limits where the kernel is that build), at least ``least`` keys (:func:`_native_keys`;
    native.MIN_KEYS when not given), a kernel built."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16) or rows > native.MAX_ROWS:
        return False
    if n < (native.MIN_KEYS if least is None else least) or not native.available():
        return False
    fewest, most = native_rows(dtype)
    return fewest <= rows <= most


def native_rows(dtype: torch.dtype) -> tuple[int, int]:
    """``(fewest, most)`` query rows (a GQA group's heads counted) of a call without mask over a cache
    of ``dtype`` that the decode kernel built here takes (:func:`_native_may`'s rule; the ``_AVX2``
    limits where the kernel is that build). Where none is built, decode.c's."""
    avx2 = native.isa() == "avx2"
    fewest = 1 if dtype is not torch.float32 else NATIVE_F32_ROWS_AVX2 if avx2 else NATIVE_F32_ROWS
    return fewest, max(NATIVE_ROWS, (NATIVE_FEW_ROWS_AVX2 if avx2 else NATIVE_FEW_ROWS)[dtype])


def _native_keys(dtype: torch.dtype, rows: int, d: int) -> int:
    """The fewest keys a call of ``rows`` rows at head size ``d`` takes the decode kernel over:
    native.MIN_KEYS, or for float32's few rows those of :data:`NATIVE_F32_AREA` (at least one)."""
    if dtype is torch.float32 and rows >= NATIVE_F32_ROWS and d:
        return max(1, min(native.MIN_KEYS, -(-NATIVE_F32_AREA // d)))
    return native.MIN_KEYS


def _native_pays(q, k, v) -> bool:
    """Whether a call without mask goes to the native decode kernel: :func:`_native_may`, bfloat16
    only where the op is slow (no AMX) or the cache large; :func:`native.pays` checks the rest
    (dtypes, strides, head sizes)."""
    rows = q.shape[2]
    least = _native_keys(k.dtype, rows, q.shape[-1])
    if not _native_may(k.dtype, rows, k.shape[2], least):
        return False
    if k.dtype is torch.bfloat16 and not BF16_BY_CHUNKS:
        if k.nbytes + v.nbytes < (NATIVE_BF16_BYTES if rows <= NATIVE_ROWS else NATIVE_BF16_FEW_BYTES):
            return False
    return native.pays(q, k, v, least)


def splits_itself(q, k, v) -> bool:
    """Whether a call without mask or score of ``q (B, Hq, Nq, D)`` over ``k, v (B, Hkv, N, .)`` runs
    whole on keyfold's native decode kernel, which splits the keys among the threads itself: a
    split-KV above it only adds calls and a merge (an MQA step over 128k float32 keys took 2.7 ms
    split into 8 attends against 2.2 ms whole)."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    if q.device.type != "cpu" or Hq % Hkv:
        return False
    folded = q[:, :1, :1].expand(B, Hkv, Hq // Hkv * Nq, D)  # the shape the router sees (a GQA group's rows)
    return _native_pays(folded, k, v)


def _op(q, k, v, causal: bool, mask, scale: float, way: str | None = None, wide: bool = False, group: int = 1,
        hidden: bool = True):
    """One fused call, ``(out, lse)``: on the native decode kernel where :func:`_route` says so (``way``,
    when the caller has asked it already), by float32 chunks where :func:`_chunks_pay`, else in float32
    for float16 where :data:`FP16_AS_FP32` says so (inputs not yet widened), else as given. ``wide``
    (a call whose states the caller merges, :func:`forward`'s ``wide_lse``): out in float32 and lse
    in float64. A float32 call then goes to the decode kernel's exact scores (sums in double of the
    exact products) where it takes it (any row count up to its 64, not the causal flag), else to
    :func:`_wide_piece`; a merge weighs each piece by its lse, and float32 scores rounded apart from the
    naive's broke the rule (a cascade's folded rows: 47 of 200 at score std 30). A 16-bit call goes as
    the router says (the decode kernel, float32 chunks), else to the decode kernel where it takes it
    (:func:`_wide_native`), else to the op with its inputs widened to float32 (exact): the op's 16-bit
    out is rounded to 16 bits, and a merge of such pieces rounds once per piece where the naive
    attention rounds once. ``group``: the GQA group size folded into q's rows (:func:`_exact`).
    ``hidden``: the op's lse of rows whose every score is -inf set right (:func:`_hidden_rows`), for a
    caller whose lse anyone reads (after a decoding step's stream of keys its small ops run on cold
    caches: 50 us of a 0.6 ms step where nobody reads lse)."""
    if wide and q.dtype is torch.float32:
        if not causal and _kernel_takes(q, k, v, mask):
            return native.run(q, k, v, scale, mask, exact=True)  # merged: exact at any row count (_exact)
        return _wide_piece(q, k, v, causal, mask, scale)
    way = way or _route(q, k, v, causal, mask)
    if way == "op" and q.dtype is torch.float32 and _few_keys(q, k):
        # the causal flag's few-key pieces and, where no kernel is built, every few-key call: exact scores
        # (:func:`_few_keys`), the flag as a tile on the kernel, else in float64 in torch ops
        if causal:
            tile = torch.full((1, 1, q.shape[2], k.shape[2]), NEG_INF, device=q.device).triu_(1)  # top-left, as the flag
            tile = tile if mask is None else mask + tile
            if _kernel_takes(q, k, v, tile):
                return native.run(q, k, v, scale, tile, exact=True)
        return _wide_piece(q, k, v, causal, mask, scale)
    if way == "native":  # _native_pays has checked what attend would
        return native.run(q, k, v, scale, mask, exact=_exact(q, group) or _few_keys(q, k))
    if way == "chunks":
        return _by_chunks(q, k, v, scale)
    # in float32, out rounded to 16 bits once by the caller; where lse is read, a 16-bit call over fewer than
    # native.MIN_KEYS keys, a decoding step's few rows, and float16 at any size: the op's 16-bit lse at a small
    # scale (0.01-0.05) was 2-20x the naive's error (3.5e-5 against 1.7e-6 over 120 keys; reviews, 2026-12-08),
    # the decode kernel's or the widened op's 0.02-0.04x
    tiny = way == "op" and (_tiny_16bit(q, k) or (hidden and q.dtype in (torch.bfloat16, torch.float16) and (
        k.shape[2] < native.MIN_KEYS or q.shape[2] <= NATIVE_ROWS or q.dtype is torch.float16)))
    if (tiny or (wide and _wide_native(q, causal))) and not causal and _kernel_takes(q, k, v, mask):
        return native.run(q, k, v, scale, mask)  # the kernel widens the 16-bit values in registers
    if wide or tiny:
        # the op in float32 on the exact widened values: out never 16-bit (for a tiny call its float32 sums
        # are far below a 16-bit rounding: not the float32 calls' exact routes, 5-11x the time without a kernel)
        q, k, v = (_rows(x.float()) for x in (q, k, v))
    else:
        q, k, v = _widen(_rows(q), _rows(k), _rows(v))
    q, scale = _signed(q, causal, scale)
    out, lse = _FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, _hidden_rows(q, k, out, lse, causal, mask, scale) if hidden else lse


def _signed(q, causal: bool, scale: float):
    """``(q, scale)`` for the fused op's causal flag: the op masks the flag's pairs before it scales the
    scores, so a scale <= 0 made their -inf +inf (or NaN at 0) and every row past the first NaN (torch's
    own SDPA does the same with ``is_causal=True``). The same scores at a positive scale: ``s·q·k`` is
    ``|s|·(-q)·k`` exactly (negation is exact), and scale 0 is q = 0 at scale 1. :func:`_op_backward`
    maps the gradient of q back."""
    if not causal or scale > 0:
        return q, scale
    return (q.neg() if scale < 0 else torch.zeros_like(q)), (-scale if scale < 0 else 1.0)


def _op_backward(do, q, k, v, o, lse, causal: bool, mask, scale: float):
    """The fused op's backward, ``(dq, dk, dv)``, at any scale (:func:`_signed`)."""
    qs, s = _signed(q, causal, scale)
    gq, gk, gv = _BWD(do, qs, k, v, o, lse, 0.0, causal, attn_mask=mask, scale=s)
    if s != scale:  # d/dq of |s|·(-q)·k is -(its gradient in -q); at scale 0 the scores do not read q
        gq = gq.neg_() if scale < 0 else gq.zero_()
    return gq, gk, gv


def _hidden_rows(q, k, out, lse, causal: bool, mask, scale: float):
    """The op's lse with -inf on rows whose every score is -inf because of infinite keys (or queries): the
    op gives them out 0 and lse 0, the lse of a row that saw one key of score 0, and a merge
    (keyfold.merge, a split decode) weighed the other states of such a row by sigmoid(their lse)
    instead of 1. Rows with lse 0 and out 0 are the candidates (a look at lse, the hot path's only cost:
    4 us; then one pass over out); only where q or k holds an infinity (one more pass, then) are their
    scores recomputed, a key/value head at a time, to tell. Rows a mask hides whole are their callers'
    (forward's ``tile.empty``)."""
    if not bool((lse == 0).any()):
        return lse
    cand = (lse == 0) & (out == 0).all(-1)
    if not bool(cand.any()) or not (bool(torch.isinf(k).any()) or bool(torch.isinf(q).any())):
        return lse
    lse = lse.clone()
    for b, h in cand.any(-1).nonzero().tolist():
        rows = cand[b, h].nonzero().squeeze(-1)
        s = (q[b, h, rows].double() @ k[b if k.shape[0] > 1 else 0, h if k.shape[1] > 1 else 0].double().T) * scale
        if mask is not None:
            m = mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0]
            s = s + (m[rows] if m.shape[0] > 1 else m).double()
        if causal:  # top-left: row r sees keys 0..r
            s = s.masked_fill(torch.arange(s.shape[-1], device=s.device) > rows[:, None], NEG_INF)
        lse[b, h, rows[torch.isneginf(s).all(-1)]] = NEG_INF
    return lse


#: The most rows of a merged float32 piece whose scores :func:`_wide_rows` computes in float64 (the causal
#: flag's pieces of a chunked prefill), and of a few-key call the decode kernel takes for its exact scores
#: (:func:`_exact_few_keys`); above it torch's float32 matmul, whose errors over many rows of one
#: sequence stay within the rule (64-row chunks of a chunked prefill split 4 ways at score std 30: 0 of
#: 60 either way).
EXACT_ROWS = 32


def _exact(q, group: int = 1) -> bool:
    """Whether the decode kernel computes a call's scores exactly (``native.run(exact=True)``): float32
    calls of fewer than ``native.FEW_ROWS`` rows, every call of rows folded from GQA groups of ``group``
    query heads (48 rows of an MQA step of 3 tokens over 16 heads: 12 of 150 past the rule at score std
    30 on the float32 path); :func:`_op` makes every call whose states are merged exact too (a
    cascade's prefix call holds its requests' rows, each request's naive attention its own product; 16
    requests over 4 heads a key/value head, 64 rows, broke the rule in 40 of 60 cascades at score std 30
    on the float32 path). The kernel's float32 sums over the head dimension round apart from
    the naive attention's BLAS ones, and at sharp scores that rounding is what the rule measures: a
    GQA step of 4 rows a key/value head went past it in 6 of 100 calls (1,000 keys, head size 128,
    scores of std 30; up to 4.3x), three query tokens 8 of 100, MQA's 8 rows 19 of 200 (up to 3.4x; 1 of
    100 at std 10), 16 rows 7 of 100, 32 rows 3 of 100, 64 rows 1 of 100 (1.01x): a GQA group's rows are
    each the naive's one-row product. The rows of one head's query tokens (5-64 of them) are the naive's
    GEMM, which the kernel's blocked sums follow closely enough (0 of 100 at 8 and 64 tokens). In
    double the scores carry no rounding of float32's: 0 in each. Time against the float32 paths:
    0.98-1.19x at 1-4 rows, 1.4-1.9x at 8 (1.2x over 128k keys read from memory), 1.7-1.9x at 16-32,
    2-2.9x at 64 (double has half float32's lanes, and the several-rows path pairs a key's elements)."""
    rows = q.shape[2]
    return q.dtype is torch.float32 and (group > 1 or rows <= max(native.FEW_ROWS - 1, EXACT_LANE_ROWS))


#: Rows a head up to which a float32 call on the decode kernel takes exact scores (:func:`_exact`), where
#: torch's matmul, the naive attention's product, sums each q.k of so few rows in vector lanes, more
#: exactly than the kernel's several-rows path sums it in float32 blocks: one head's 5 query tokens
#: (chunked prefill, speculative decoding) went past the rule in 12 of 464 random calls over 256-2,000
#: keys at score std 8-30 (up to 4.0x the allowance at head size 256), 6 tokens in 7 of 239, 8 tokens
#: at head sizes above 128 in 2 of 90; 8 tokens at 64-128 and 10 above, none (a fuzz, 2026-12-07,
#: found by a review; the note of that morning had counted 0 of 150 at 6-16 tokens, head size 128).
#: At 9-16 tokens 4 of 7,100 random calls over 256-1,000 keys at score std 30 went past it too (up to
#: 2.07x, head sizes 32-128; a second review, 2026-12-07), so 16 now: 0 of the same 3,000, at 1.2-1.8x
#: the kernel's time for those calls (9-16 tokens over 1k-32k keys, 2 threads), at every head size (it had
#: been 10 above head size 128, where torch's lanes reach 10 rows: MEMBER_ROWS_WIDE)
EXACT_LANE_ROWS = 16


#: Keys under which a 16-bit call of few rows computes in float32 (:func:`_tiny_16bit`)
TINY_16BIT_KEYS = 96


def _tiny_16bit(q, k) -> bool:
    """Whether a 16-bit call the router sends to PyTorch's op runs in float32 instead (the decode kernel,
    which widens the values in registers, else the op on widened inputs): up to :data:`EXACT_ROWS` rows
    over fewer than :data:`TINY_16BIT_KEYS` keys. The op's 16-bit path rounds the unnormalised weights to
    16 bits before ``P @ V``, the naive attention its normalised ones, and over a few keys the naive's
    roundings can all fall near its answer: one bfloat16 row over 27 keys at score std 1 was 2.26x the
    naive error, two causal rows over 5 keys 2.46x (2 of 26,000 random calls of 1-16 rows past the rule,
    2026-12-07). By key count (30,000 calls of 1-32 rows at score std 1-5, bfloat16 and float16): 9 of
    16,600 past it over 8-64 keys (up to 1.44x the allowance), none of 16,800 over 96-255 (worst 0.94 at
    96, 0.80 at 255). In float32 the call's error is the output's one rounding, which no 16-bit answer
    beats; it costs 1.4-1.8x the op's time there (a bfloat16 row over 100 keys, 8 heads: 46 -> 80 us on
    the Intel Xeon with AMX), so it stops where the failures did."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[2] <= EXACT_ROWS
            and k.shape[2] < TINY_16BIT_KEYS)


def _wide_native(q, causal: bool) -> bool:
    """Whether a piece the router sends to the fused op goes to the decode kernel instead under ``wide``
    (:func:`_op`): a 16-bit one, which the kernel computes in float32 from the exact 16-bit values (a
    bfloat16 cascade of 64 rows a request takes 1.2x the time it took on the op in bfloat16; on the op
    with widened inputs 1.25x, on _wide_piece 1.4x). Float32 ones go to the kernel's exact scores
    before the router is asked (:func:`_op`). Not the causal flag's pieces, which the kernel does not take."""
    return not causal and q.dtype is not torch.float32


#: Scores a :func:`_wide_piece` holds at once (batch x heads x rows x keys; 8 MiB of float64): rows go
#: in chunks of this over the keys, so no call allocates its rows x keys scores whole.
WIDE_SCORES = 1 << 20


def _wide_piece(q, k, v, causal: bool, mask, scale: float):
    """``(out, lse)`` of float32 ``q (B, H, L, W)`` over ``k, v (B, H, S, .)`` with lse in float64, for a
    piece the decode kernel does not take: exact scores (:func:`_exact_scores`) times ``scale`` with the
    additive tile ``mask`` added, the row's max ``m`` and weights ``exp(s - m)`` in float64 rounded to
    float32 once, ``P @ V / l`` in float32, lse ``m + log l`` in float64 (a piece under
    :data:`SMALL_PRODUCT` a head all in float64, :func:`_small_piece`). For a call whose states are
    merged after it (:func:`forward`'s ``wide_lse``): the fused op's lse is float32, rounded at 2^-24
    |lse| (4e-6 at 65), and a merge weighs each out by ``exp(lse - lse_total)``, so a decode that merged
    the op's pieces broke the 2x rule (a fuzz of split-KV, window caches' sinks and band, pages and
    cascades at score spreads 5-30: up to 3.4x the allowance); float32 scores, the naive's own matmul's
    included, broke it in 50 of 200 cascades at score std 30, where exact ones held it in all.
    ``causal``: top-left, as the op's flag. Rows that see no key: out 0, lse -inf."""
    B, H, L, _ = q.shape
    S = k.shape[2]
    W = max(q.shape[-1], v.shape[-1])
    if L * S * W < SMALL_PRODUCT and B * H * S * W < SMALL_TOTAL:
        return _small_piece(q, k, v, causal, mask, scale)
    step = max(1, WIDE_SCORES // max(1, B * H * S))
    if step >= L:
        return _wide_rows(q, k, v, causal, mask, scale, 0)
    parts = [_wide_rows(q[:, :, a:a + step], k, v, causal,
                        None if mask is None else mask[..., a:a + step, :] if mask.shape[-2] > 1 else mask, scale, a)
             for a in range(0, L, step)]
    return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)


def _wide_rows(q, k, v, causal: bool, mask, scale: float, a: int):
    """:func:`_wide_piece` of rows ``q`` (the piece's rows from ``a`` on, for the causal flag) in one pass"""
    if q.dtype is torch.float32 and q.shape[2] > EXACT_ROWS:  # the naive's own float32 matmul (see EXACT_ROWS)
        s = _per_head(q, k.transpose(-1, -2)).double().mul_(scale)
    else:
        s = _exact_scores(q, k).mul_(scale)                                # (B, H, r, S) float64
    if mask is not None:
        s = s.add_(mask)
    if causal:
        s = s.masked_fill_(torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=q.device).triu(a + 1),
                           NEG_INF)
    m = s.amax(-1, keepdim=True)
    # a row that sees no key (a mask, or every score -inf from infinite keys, which the op and the
    # kernels take as hidden) subtracts 0: its weights are 0, then out 0 and lse -inf as theirs
    empty = torch.isneginf(m)
    base = m.masked_fill(empty, 0.0)
    p = s.sub_(base).to(q.dtype).exp_()  # weights from s - m rounded once: exact near the max
    l = p.sum(-1, keepdim=True)
    out = _per_head(p, v).div_(l)
    lse = base.add_(l.double().log_())
    return out.masked_fill_(empty, 0.0), lse.masked_fill_(empty, NEG_INF).squeeze(-1)


#: Key elements (batch x heads x keys x head size) :func:`_exact_scores` widens to float64 at once (8 MiB).
EXACT_KEYS = 1 << 20


def _exact_scores(q, k):
    """``q @ k^T`` in float64 for ``q (B, H, r, D)``, ``k (B, H, S, D)``: the products of float32 (or 16-bit)
    values are exact in float64 and their sums round at 2^-53, so the scores carry no float32 rounding
    (the decode kernel's ``exact`` scores, decode.c's exact_scores says why that counts). Keys are widened
    :data:`EXACT_KEYS` elements at a time."""
    B, H, r, D = q.shape
    S = k.shape[2]
    qd = q.double()
    step = max(1, EXACT_KEYS // max(1, B * H * D))
    if step >= S:
        return qd @ k.double().transpose(-1, -2)
    s = torch.empty(B, H, r, S, dtype=torch.float64, device=q.device)
    for j in range(0, S, step):
        s[..., j:j + step] = qd @ k[:, :, j:j + step].double().transpose(-1, -2)
    return s


def _small_piece(q, k, v, causal: bool, mask, scale: float):
    """:func:`_wide_piece` of a piece under :data:`SMALL_PRODUCT` a head (a window's sinks, a short chunk or
    suffix): :func:`_wide_rows` in float64, weights and ``P @ V`` too, out rounded to float32 once: its
    error is that one rounding."""
    out, lse = _wide_rows(q.double(), k.double(), v.double(), causal, mask, scale, 0)
    return out.float(), lse


#: torch's batched matmul takes a product (rows x contraction x columns a batch) under this to a loop of
#: its own (``bmm_out_or_baddbmm_``) that sums each dot product in one chain, less exactly than the BLAS
#: GEMM the naive attention's product over all of a row's keys gets (a window cache's 4 sinks at head
#: size 64 were 4.0x the rule's allowance, short split chunks 5.0x; a review, 2026-12-07):
#: :func:`_per_head` multiplies such products in float64.
TORCH_SMALL_BMM = 400

#: A head's piece (rows x keys x head size) below which :func:`_wide_piece` computes in float64
#: throughout (weights and ``P @ V`` too, not only the scores), when the whole piece is also under
#: :data:`SMALL_TOTAL` key elements: its error is out's one rounding. Against scores rounded to float32
#: after a float64 product (the first exact scores, which rounded them), the whole piece in float64
#: left fewer calls past the rule where one attention call held it (window sinks at head size 128,
#: score std 20: 0 of 400 against 5; a cache fuzz 5 of 1,241 against 7; split decodes 3 of 400
#: against 4).
SMALL_PRODUCT = 1 << 14

#: The most key (and value) elements, batch x heads x keys x head size, of a piece :func:`_wide_piece`
#: computes in float64: widening every key and value of a batch of small pieces costs with the batch (a
#: cascade of 32 requests over 200-token suffixes, 3.3M elements, took 3.3-9x the time), and past this
#: it runs in float32 (2 MiB of float64 keys at most).
SMALL_TOTAL = 1 << 18


def _per_head(x, y):
    """``x @ y`` for float32 ``x (B, H, r, .)`` and ``y (B, H, ., c)``, each head's rows a GEMM of their own
    as the naive attention's are: where ``y`` repeats one head along dim 1 (stride 0,
    :func:`_by_members`' keys and values, expanded to a GQA group's members), torch's matmul folds the
    heads' rows into one GEMM, which sums a score of more than 5 rows in one chain rather than in
    vector lanes (8x the naive error at 2 x 3 rows, head size 128, scores of std 20), so the heads go
    one at a time, and where ``y``'s batch dims do not flatten, the batches; a head's product under
    :data:`TORCH_SMALL_BMM` runs in float64."""
    if x.dtype is torch.float32 and x.shape[-2] * x.shape[-1] * y.shape[-1] < TORCH_SMALL_BMM:
        return (x.double() @ y.double()).float()
    if y.dim() == 4 and y.shape[1] > 1 and y.stride(1) == 0:
        return torch.stack([x[:, j] @ y[:, 0] for j in range(x.shape[1])], 1)
    if y.dim() == 4 and y.shape[0] > 1 and not _flattens(y):
        # batch dims that do not merge into one stride (split-KV's chunks of a cache with room left):
        # torch's matmul would copy y to a contiguous (., c) layout whose GEMM sums a score over the head
        # dimension in one chain (4.7x the rule's allowance) and 16-25x slower; batch by batch it does not
        return torch.stack([x[i] @ y[i] for i in range(y.shape[0])])
    return x @ y


def _exact_few_keys(q, k, v, mask) -> bool:
    """Whether a float32 call of up to :data:`EXACT_ROWS` rows over fewer keys than the decode
    kernel pays its fixed cost for (:func:`_native_keys`) goes to it anyway, for its exact scores
    (:func:`_exact`). Over a few keys the naive attention's product is torch's small-matmul loop, one
    chain a score, and the op's sums round apart from it: at score std 30, one row over 20 keys at
    head size 16 went past the rule in 7 of 200 calls (up to 1.9x), a GQA group's in 9 of 200, ALiBi
    over 35-250 keys in 1 of 3,500 cache decodes; on the kernel, none. It costs 7-40 us a call (the op
    10-24 us, the kernel 17-64; 20-255 keys, 1-4 rows, 2-8 heads)."""
    return _few_keys(q, k) and _kernel_takes(q, k, v, mask)


def _kernel_takes(q, k, v, mask) -> bool:
    """Whether the decode kernel takes a call of any row count and key count up to its limits, with its
    additive mask tile ``mask`` (or none): ``native.pays`` from one key, and ``native.mask_takes``."""
    return native.pays(q, k, v, 1) and (mask is None or native.mask_takes(mask, q, k))


def _few_keys(q, k) -> bool:
    """A float32 call of up to :data:`EXACT_ROWS` rows over fewer keys than the decode kernel pays its
    fixed cost for: it runs there for its exact scores (:func:`_exact_few_keys`), at every row count
    (one head's 5 query tokens over 100 keys took the several-rows path's float32 sums for a day: 13
    of 100 past the rule at score std 30; a review). Where the kernel does not take it (the causal
    flag's pieces, as a mask tile, on the kernel; no kernel built) :func:`_op` computes it by
    :func:`_wide_piece`, float64 scores (28-130 us a call of 2-32 rows, 8 heads, the op's 8-35 us): on
    the op, 4 causal rows over 8 keys at score std 19 went to 1.14x the rule's allowance, and without the
    kernel 4 of 500 ALiBi calls over 2-8 keys past it (up to 2.2x; a helper's fuzz, 2026-12-07)."""
    rows = q.shape[2]
    return (q.dtype is torch.float32 and rows <= EXACT_ROWS
            and k.shape[2] < _native_keys(q.dtype, max(rows, NATIVE_F32_ROWS), q.shape[-1]))


def _route(q, k, v, causal: bool, mask) -> str:
    """Where :func:`_op` runs a call: ``"native"`` (the decode kernel), ``"chunks"`` (float32 chunks)
    or ``"op"`` (PyTorch's fused op)."""
    if causal or q.dim() != 4:
        return "op"
    if _exact_few_keys(q, k, v, mask):
        return "native"
    if mask is None:
        if _native_pays(q, k, v):
            return "native"
        if _chunks_pay(q.dtype, q.shape[2], k.shape[2]):
            return "chunks"
    elif (q.dtype is torch.float32 and q.shape[2] <= NATIVE_MASKED_ROWS and native.mask_takes(mask, q, k)
          and native.pays(q, k, v, _native_keys(q.dtype, NATIVE_F32_ROWS, q.shape[-1]))):
        return "native"  # from one row (NATIVE_MASKED_ROWS)
    return "op"


AVAILABLE = _probe()
if not AVAILABLE:
    warnings.warn("keyfold: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu is missing or changed "
                  f"in torch {torch.__version__}; Backend.AUTO runs CPU tensors on the tile kernel (slower, same "
                  f"results) and Backend.CPU raises",
                  RuntimeWarning, stacklevel=2)


class _Inputs:
    """q, k, v brought to one head size W (the op requires it), once per call.

    W = max(D, Dv), plus one spare column when the caller differentiates through lse:
    with out[:, W-1] = 1 and dout[:, W-1] = -dlse (v and q, k zero there), the op's internal
    D_i = sum(dout * out) becomes D_i - dlse_i, which is the whole lse gradient (docs/math.md).
    """

    def __init__(self, q, k, v, spare: bool = False):
        D, Dv = q.shape[-1], v.shape[-1]
        self.D, self.Dv = D, Dv
        self.W = max(D, Dv) + (1 if spare else 0)
        self.q = _pad(_rows(q), self.W)
        self.k = _pad(_rows(k), self.W)
        self.v = _pad(_rows(v), self.W)
        self.g = q.shape[1] // k.shape[1]


def _pad(x, W):
    return x if x.shape[-1] == W else torch.nn.functional.pad(x, (0, W - x.shape[-1]))


def _tile_mask(vis, bias, dtype):
    """Additive float mask: bias (or 0) where visible, -inf where hidden."""
    if vis is None:
        return bias.to(dtype) if bias is not None else None
    base = bias.to(dtype) if bias is not None else torch.zeros((), dtype=dtype, device=vis.device)
    return torch.where(vis, base, torch.tensor(NEG_INF, dtype=dtype, device=vis.device))


def _fold(x, g):
    """(B, Hq, L, *) -> (B, Hkv, g*L, *): put a GQA group's heads one after another as rows."""
    if g == 1:
        return x
    B, Hq, L = x.shape[:3]
    return x.reshape(B, Hq // g, g * L, *x.shape[3:])


def _fold_mask(m, g, Hq, L):
    if m is None or g == 1:
        return m
    b, h, _, S = m.shape
    m = m.expand(b, h, L, S)
    if h == 1:
        return m.repeat(1, 1, g, 1)  # (b, 1, g*L, S)
    return m.reshape(b, Hq // g, g * L, S)


def _unfold(x, g, Hq):
    if g == 1:
        return x
    B, Hkv, gL = x.shape[:3]
    return x.reshape(B, Hq, gL // g, *x.shape[3:])


class _Tile(NamedTuple):
    """The mask side of one fused call: additive float mask, empty rows, lse shift."""

    mask: torch.Tensor | None       # (B|1, H|1, L|1, S), or (.., g*L, S) when folded
    empty: torch.Tensor | None      # (B|1, H|1, L) rows with no visible key
    row_shift: torch.Tensor | None  # (1, H|1, L) separable bias's row term, added to lse
    cols: tuple[int, int] | None = None  # the piece's keys [a, b) the call reads (mask trimmed to them)
    later: dict | None = None  # what the backward derives from the mask, kept with the tile (_seen)


def _visible_cols(vis: torch.Tensor) -> tuple[int, int] | None:
    """The narrowest key range ``[a, b)`` of a tile holding every visible pair, when it is narrower
    than the tile. A sink column (keys 0..3 of a 256-key tile, every query block) or a document's
    edge then costs the keys it shows, not the tile: window 256 + 4 sinks at 4k ran 1.5x window 256
    alone, for 30% more tiles, when each sink tile was a full 256 x 256 call."""
    S = vis.shape[-1]
    seen = vis.reshape(-1, S).any(0).nonzero()
    if len(seen) == 0:
        return None
    a, b = int(seen[0]), int(seen[-1]) + 1
    return (a, b) if b - a < S else None


def _tile(piece: Piece, pb: Problem, q_orig, folded: bool, g: int, memo: dict, cache) -> _Tile:
    """Build (or reuse) the tile of one piece.

    Tiles of translation-invariant masks and biases depend only on the piece's shape and
    diagonal offset, so each distinct one is built once per call (``memo``); every tile is
    also kept in the plan's bounded ``cache`` for the next call with the same plan.
    """
    score = pb.score if _bias_needed(pb) else None
    if piece.kind is not PieceKind.MASKED and score is None:
        return _Tile(None, None, None)
    L, S = piece.q1 - piece.q0, piece.k1 - piece.k0
    qa, ka = pb.q_offset + piece.q0, pb.kv_offset + piece.k0
    invariant = ((pb.mask is None or pb.mask.translation_invariant or piece.kind is not PieceKind.MASKED)
                 and (score is None or score.translation_invariant))
    where = (L, S, qa - ka) if invariant else (qa, ka, L, S)
    B, Hq = q_orig.shape[:2]
    key = (piece.kind, where, folded, g, B, Hq, score, q_orig.dtype, q_orig.device)
    hit = memo.get(key) or cache.get(key)
    if hit is not None:
        memo[key] = hit
        return hit
    row_shift = None
    # a bias separable on this tile (ALiBi with every key on one side): only the key term enters
    # the scores, the row term shifts lse, so a bias of any size never swamps the scores in float32
    sep = score.separable(qa, qa + L, ka, ka + S, q_orig.device) if (
        score is not None and piece.kind is not PieceKind.CAUSAL) else None
    if sep is not None:
        row_shift, bias = sep[0].to(state_dtype(q_orig.dtype)), sep[1]
        vis = visible(q_orig, piece, pb) if piece.kind is PieceKind.MASKED else None
    else:
        pos = positions(q_orig, piece, pb)
        vis = visible(q_orig, piece, pb, pos) if piece.kind is PieceKind.MASKED else None
        with torch.no_grad():  # a tile is data: never a piece of a tensor's autograd graph
            if score is None:
                bias = None
            elif q_orig.dtype is torch.float64:  # the modifier's own float64 path (apply adds the
                # bias to float64 scores in float64; ALiBi's float32 bias left 1.9e-6 errors), on
                # zero scores of the tile's shape, as apply is promised
                grid = torch.broadcast_shapes(*(t.shape for t in pos))
                bias = score.apply(torch.zeros(grid, dtype=torch.float64, device=q_orig.device), *pos)
            else:
                bias = score.bias(*pos)
    cols = _visible_cols(vis) if vis is not None else None
    if cols is not None:  # keys no row sees are left out of the call (and of the mask)
        vis = vis[..., cols[0]:cols[1]]
        if bias is not None and bias.shape[-1] == S:
            bias = bias[..., cols[0]:cols[1]]
    m = _tile_mask(vis, bias, state_dtype(q_orig.dtype))
    if folded:
        m = _fold_mask(m, g, Hq, L)
    tile = _Tile(m, empty_rows(vis), row_shift, cols, {})
    nbytes = sum(t.numel() * t.element_size() for t in tile[:3] if t is not None)
    if score is None and vis is not None:  # a mask alone: equal tiles share one tensor in the cache
        # (the rows' visible counts narrow the search; the masks must be equal, then so are the empty rows)
        fingerprint = (tuple(m.shape), m.dtype, folded, cols, vis.sum(-1).numpy().tobytes())
        first = cache.shared(fingerprint, tile, lambda a, b: torch.equal(a.mask, b.mask))
        if first is not tile:
            tile, nbytes = first, 0
    memo[key] = tile
    if score is None or not score.tensors():  # a tile of tensors that may train would go stale
        cache.put(key, tile, nbytes)
    return tile


def _piece_args(inp: _Inputs, piece: Piece, pb: Problem, q_orig, memo: dict, cache):
    """Tensors and flags for one fused call: (q, k, v, causal, tile, folded, keys), ``keys`` the
    slice of the call's keys in the whole sequence (the piece's, or the part its rows see).

    With GQA (g query heads per key/value head) a piece either *folds* the group's heads into
    the query rows (one call, k and v untouched) or, for the fused causal flag, which folding
    would break, runs once per group member (``q`` is then ``(B, Hkv, g, L, W)``, k and v are
    never copied).
    """
    causal = piece.kind is PieceKind.CAUSAL
    folded = not causal and inp.g > 1
    tile = _tile(piece, pb, q_orig, folded, inp.g, memo, cache)
    qs = inp.q[:, :, piece.q0:piece.q1]
    keys = slice(piece.k0, piece.k1) if tile.cols is None else slice(piece.k0 + tile.cols[0], piece.k0 + tile.cols[1])
    ks = inp.k[:, :, keys]
    vs = inp.v[:, :, keys]
    if folded:
        qs = _fold(qs, inp.g)
    elif inp.g > 1:
        qs = qs.unflatten(1, (-1, inp.g))  # (B, Hkv, g, L, W): member j is qs[:, :, j]
    return qs, ks, vs, causal, tile, folded, keys


def _members(x, g):
    """(B, Hq, L, *) -> (B, Hkv, g, L, *) view, or None when there is no group."""
    return None if g == 1 else x.unflatten(1, (-1, g))


def _bias_needed(pb: Problem) -> bool:
    return pb.score is not None and pb.score.additive


def dense(q, k, v, scale: float, keep_dtype: bool = False, wide_lse: bool = False, lse_needed: bool = True) -> State:
    """One fused call over every key, no mask: the op's (out, lse) is the whole state (the prefill
    kernel's where it runs: bfloat16 with AMX, float32 at head sizes up to
    :data:`PREFILL_F32_DENSE_MAX_HEAD` on AVX-512, :data:`PREFILL_AVX2_MAX_HEAD` on AVX2).
    keep_dtype: out stays in the op's dtype (the input's, float32 for widened float16), for a
    caller that casts it to the input dtype anyway. wide_lse, lse_needed: as :func:`forward`'s."""
    sd = state_dtype(q.dtype)
    wide = wide_lse and q.dtype is not torch.float64
    if _prefill_may(q, k, v, Problem(None, None, scale, 0, 0), True, True):
        q, k, v = _widen(q, k, v)
        out, lse = native.prefill(q, k, v, scale, [native.piece_row(0, q.shape[2], 0, k.shape[2], False)],
                                  out_dtype=q.dtype if keep_dtype else sd, wide_lse=wide)
        return State(out, lse)
    if wide:
        out, lse = _op(q, k, v, False, None, scale, wide=True)
        return State(out, lse.double())
    out, lse = _op(q, k, v, False, None, scale, hidden=lse_needed)
    return State(out if out.dtype == sd or keep_dtype else out.to(sd), lse if lse.dtype == sd else lse.to(sd))


#: Softcaps the prefill kernel takes: it gets the cap as a float32 and computes s / cap under
#: flush-to-zero, so a cap below ~1e-38 would arrive as 0 (no softcap) and one above ~1e37 would
#: flush s / cap to 0; caps outside this range run on the tile kernel.
PREFILL_CAPS = (1e-20, 1e20)


#: float32 calls with no mask and no score (one piece of every pair) at head sizes above this stay on
#: the fused op on AVX-512: it runs them at 0.94-0.99x the prefill kernel's time at D = 128 (4k keys,
#: Intel Xeon with AMX), where every masked or causal plan is faster on the kernel (0.90-0.96x the op's).
#: On AVX2 the kernel takes them (0.90x the op's time at D = 96, 0.96x at 128, 4k keys; 1.01x at 1k,
#: AMD EPYC), and its lse is the one the backward kernel's sums match: the op's there is renormalised.
PREFILL_F32_DENSE_MAX_HEAD = 64

#: Query rows per key/value head (rows x GQA group) from which a call goes to the prefill kernel. It
#: packs the keys and values its pieces read once per call, so it pays only when enough rows share
#: them: over 32k cached keys (B=1, H=8, D=64, Intel Xeon with AMX) it took 2-5x the op's time with
#: 16 rows, 1.2-2x with 128 and 0.7-1.1x with 512 (a window or documents mask). Set
#: ``KEYFOLD_PREFILL_MIN_ROWS`` in the environment to move it (tests run small problems through it).
PREFILL_MIN_ROWS = int(os.environ.get("KEYFOLD_PREFILL_MIN_ROWS", "512"))

#: A plan of full and causal pieces only (no mask tile, no score) runs on the kernel only where its rows
#: per key/value head are at least the keys over this: the op runs such plans at one call a piece, and
#: packing a long cache for few rows costs more than it saves (float32 over 32k keys, 8 heads: the
#: kernel took 1.08-1.16x the op's time with 1024 rows, 0.95-0.98x with 2048).
PREFILL_KEYS_PER_ROW = 8

#: float32 calls under PREFILL_MIN_ROWS rows per key/value head go to the kernel too from this many rows,
#: when the keys are at most PREFILL_KEYS_PER_ROW times the rows (a training step's short sequences):
#: there it took 0.47-0.88x the op's forward time (B*H = 32-64, 128-300 rows, causal, window, documents,
#: dense; 2 threads) and 1.12x at 32 rows. No softcap or callable (their backward, on the tile kernel,
#: recomputes P against this forward's lse) and head sizes under ORDERED_HEAD (with the lse gradient's
#: spare column the backward's width stays within it: float32 sums, the same arithmetic as this forward)
PREFILL_SQUARE_ROWS = 64

#: On AVX2 (the kernel's float32 path through simd.h's 8-lane halves) float32 calls whose q/k head size
#: passes this, or with fewer keys than PREFILL_AVX2_MIN_KEYS, stay on the fused op: the naive attention's
#: GEMM on such a CPU (AMD EPYC Zen 3) sums a longer dot product in blocks and a product of few keys
#: otherwise, more exactly than one FMA chain a score, and the kernel's forward broke the 2x rule there
#: (a review's fuzz, 2026-12-07: head sizes 193-256 at score std 20, 1-3 of 6 calls, up to 1.73x on
#: plain causal, 4.5x with ALiBi over 5 keys; 2-8 keys, 22 of 137, up to 2.06x); up to head size 192
#: and from 16 keys its error equalled the naive's (0 of 105). The backward renormalises after the op.
PREFILL_AVX2_MAX_HEAD = 192
PREFILL_AVX2_MIN_KEYS = 16

#: float32 GQA calls of at most this many rows a head stay off the prefill kernel (see _prefill_may): its
#: fuzz failures were at 1-5 rows, none in 235 calls of 9-16 rows (head sizes 63-128, 2 threads), and
#: 9-16 rows a head ran up to 1.6x slower one member at a time (MEMBER_ROWS).
PREFILL_MEMBER_ROWS = 8


def _prefill_may(q, k, v, pb: Problem, plain: bool = False, dense: bool = False) -> bool:
    """Whether a call runs on keyfold's prefill kernel (:func:`native.prefill`): bfloat16 on a CPU with
    AMX, or float32 (float16 too, widened, where :data:`FP16_AS_FP32`) on one with AVX-512 or AVX2 (there
    up to :data:`PREFILL_AVX2_MAX_HEAD` and from :data:`PREFILL_AVX2_MIN_KEYS` keys); at least
    :data:`PREFILL_MIN_ROWS` query rows per key/value head (float32 from :data:`PREFILL_SQUARE_ROWS` with
    the keys at most :data:`PREFILL_KEYS_PER_ROW` times the rows), and for a ``plain`` plan of full and causal
    pieces at least the keys over :data:`PREFILL_KEYS_PER_ROW`; a score that is additive (its tiles)
    or a softcap (computed in the kernel), no dropout. ``dense``: one piece of every pair, no score
    (see :data:`PREFILL_F32_DENSE_MAX_HEAD`).

    Not float32 GQA with at most :data:`PREFILL_MEMBER_ROWS` rows a head: the kernel folds a group's rows into
    its register tiles and sums each score in one FMA chain over the head dimension, where the naive
    attention's matmul sums a few rows' scores in vector lanes. Such calls (an MQA or GQA decode or
    speculative step over up to 8x its group's rows in keys) went past the rule in 12 of 292 cases of a
    fuzz (1-5 rows, 16-64 heads over 1-4, head sizes 63-128, scores of std 6; up to 3.4x the naive
    error); the op's one call per member (:func:`_by_members`) or the decode kernel's blocked sums
    take them instead. Nor float32 GQA of :func:`_few_keys` (up to :data:`EXACT_ROWS` rows a head over few
    keys): groups of 8 or more reach the kernel's rows from 9 rows a head, and its FMA chains put 12 rows
    over 2 keys at 3.8x the rule's allowance (27 of 60 seeds at head size 128, score std 20; a review,
    2026-12-07), where each member on the decode kernel's exact scores is at 0.03-0.08x."""
    dt = _widened(q.dtype)
    rows = q.shape[2] * (q.shape[1] // max(k.shape[1], 1))
    # a bfloat16 softcap from one row (a Gemma-2 decoding step): its other way is the tile path in torch ops,
    # which widened the whole cache to float32 every call (16k keys: 49 ms a step, plain torch's 5.9; on the
    # kernel 7.4; a review, 2026-12-08)
    capped = dt is torch.bfloat16 and q.dtype is torch.bfloat16 and softcap_cap(pb) is not None
    if dt not in (torch.bfloat16, torch.float32) or (rows <= NATIVE_ROWS and not capped):
        return False
    if q.dtype is torch.float32 and q.shape[1] != k.shape[1] and (q.shape[2] <= PREFILL_MEMBER_ROWS
                                                                  or _few_keys(q, k)):
        return False  # see the docstring: a float32 GQA group of few rows a head, or over few keys
    if dt is torch.float32 and native.isa() == "avx2" and (q.shape[-1] > PREFILL_AVX2_MAX_HEAD
                                                           or k.shape[2] < PREFILL_AVX2_MIN_KEYS):
        return False  # the naive's GEMM sums these more exactly here (PREFILL_AVX2_MAX_HEAD)
    if rows < PREFILL_MIN_ROWS and not capped and not (dt is torch.float32 and rows >= PREFILL_SQUARE_ROWS
                                        and rows * PREFILL_KEYS_PER_ROW >= k.shape[2]
                                        and (pb.score is None or pb.score.additive)
                                        and max(q.shape[-1], v.shape[-1]) < ORDERED_HEAD):
        return False
    if q.numel() == 0 or k.numel() == 0:  # an empty batch or no heads: nothing for the kernel to do
        return False
    if plain and rows * PREFILL_KEYS_PER_ROW < k.shape[2] and not capped:
        return False
    if (dense and dt is torch.float32 and max(q.shape[-1], v.shape[-1]) > PREFILL_F32_DENSE_MAX_HEAD
            and native.isa() != "avx2"):
        return False
    cap = softcap_cap(pb)
    if pb.dropout_p or not (pb.score is None or pb.score.additive or cap is not None):
        return False
    if cap is not None and not PREFILL_CAPS[0] <= cap <= PREFILL_CAPS[1]:
        return False
    return native.prefill_available(dt) and native.prefill_takes(q, k, v, dt) is None


def _plan_on_prefill(q, k, v, plan: Plan, pb: Problem) -> bool:
    """Whether :func:`prefill` runs this plan on the prefill kernel (:func:`_prefill_may` with the plan's
    ``plain`` and ``dense``); the backward asks too, to know which forward gave it lse."""
    plain = pb.score is None and all(p.kind is not PieceKind.MASKED for p in plan.pieces)
    dense = plain and len(plan.pieces) == 1 and plan.pieces[0].kind is PieceKind.FULL
    return _prefill_may(q, k, v, pb, plain, dense)


def _lse_from_op_on_avx2(q, k, v, plan: Plan, pb: Problem) -> bool:
    """Whether this plan's forward, float32 (float16 widened too) on an AVX2 CPU, ran on the fused op
    rather than the prefill kernel (asked with the call's own dtypes, as the forward asked): its lse
    is then the op's, whose GEMM sums a score in blocks of its own (past head size 192, or over a few
    keys), which the backward kernel's sums do not match (see :func:`backward`)."""
    return (native.isa() == "avx2" and _widened(q.dtype) is torch.float32
            and not _plan_on_prefill(q, k, v, plan, pb))


def prefill(q, k, v, plan: Plan, pb: Problem, keep_dtype: bool = False, wide_lse: bool = False) -> State | None:
    """Every piece of the plan in one call of the prefill kernel, or None where it does not run
    (:func:`_prefill_may`). The pieces' mask tiles (and a separable bias's row terms) are the ones the
    fused op would get; the kernel merges the pieces of a row inside its softmax, so nothing is merged
    here, and out comes back in bfloat16 for bfloat16 inputs with ``keep_dtype`` (else float32).
    ``wide_lse``: lse in float64 (the kernel's sums in double; see :func:`forward`)."""
    if not _plan_on_prefill(q, k, v, plan, pb):
        return None
    q_orig = q
    q, k, v = _widen(q, k, v)  # float16 on a CPU without its units: the float32 kernel
    memo: dict = {}
    parts = []  # (piece, k0, k1, mask, shift)
    g = q.shape[1] // k.shape[1]
    for piece in plan.pieces:
        tile = _tile(piece, pb, q_orig, False, g, memo, plan.tiles)
        k0, k1 = (piece.k0, piece.k1) if tile.cols is None else (piece.k0 + tile.cols[0], piece.k0 + tile.cols[1])
        mask, shift = tile.mask, tile.row_shift
        if mask is not None and mask.shape[-1] == 1:  # the same for every key (a row-only mask or bias):
            # a row shift, not a tile expanded to L x S (-inf hides the row, as in a tile)
            shift = mask[..., 0] if shift is None else mask[..., 0] + shift
            mask = None
        if mask is not None and mask.stride(-1) != 1:
            mask = mask.contiguous()
        parts.append((piece, k0, k1, mask, shift))
    base = _shift_base(parts, q.shape)
    rows, alive = [], []
    for piece, k0, k1, mask, shift in parts:
        if base is not None:  # the row's base out of its shift: what enters the scores is small
            shift = (0.0 if shift is None else shift.double()) - base[..., piece.q0:piece.q1]
        if shift is not None:
            L = piece.q1 - piece.q0
            shift = shift.to(torch.float32).expand(*shift.shape[:-1], L).contiguous()  # (B|1, H|1, L)
        alive += [mask, shift]  # the kernel reads them by address until it returns
        rows.append(native.piece_row(piece.q0, piece.q1, k0, k1, piece.kind is PieceKind.CAUSAL, mask, shift))
    out, lse = native.prefill(q, k, v, pb.scale, rows, cap=softcap_cap(pb) or 0.0,
                              out_dtype=torch.bfloat16 if keep_dtype and q.dtype is torch.bfloat16 else torch.float32,
                              wide_lse=wide_lse)
    if base is not None:
        lse = lse.double() + base
    return State(out, lse if wide_lse else lse.to(torch.float32))


def _shift_base(parts, shape) -> torch.Tensor | None:
    """The kernel adds a piece's row shift to every score of the row, inside one softmax over all
    the row's pieces; a shift of -slope x 2^31 (ALiBi with every key far behind) added so would swamp
    the scores in float32 (found in review: an error of 1.5 at 2^31). So each row's largest finite
    shift (0 for a piece without one) is taken out of every piece's shift and added back to lse, as
    the fused op's path adds a row term to lse only: ``(B|1, H|1, L)`` float64, or None where no piece
    has a shift."""
    shifts = [(piece, sh) for piece, _, _, _, sh in parts if sh is not None]
    if not shifts:
        return None
    B = max(sh.shape[0] for _, sh in shifts)
    H = max(sh.shape[1] for _, sh in shifts)
    base = torch.full((B, H, shape[2]), -math.inf, dtype=torch.float64)
    for piece, _, _, _, sh in parts:
        rows = base[..., piece.q0:piece.q1]
        if sh is None:
            rows.clamp_(min=0.0)
        else:
            sh = sh.double()
            torch.maximum(rows, sh.masked_fill(~torch.isfinite(sh), -math.inf), out=rows)
    return base.masked_fill_(~torch.isfinite(base), 0.0)


#: float32 GQA pieces whose group members have at most this many query rows each run once per member
#: (the rows of one head, as the naive attention multiplies them; on the decode kernel or the fused op,
#: see _by_members), not once over the group's rows folded together, where the call has a mask tile or
#: additive score, or would reach the op (without one, where neither the decode kernel nor float32
#: chunks take it). torch's matmul sums the dot products of a few
#: rows in vector lanes (up to 2 rows at head size 64, 5 at 128, 10 at 256, 15 at 512) and of more in
#: one chain a dimension, and the op blocks its own products by the keys: the folded call's scores were
#: the chained ones. At head size 128, scores of std 6, 4 heads a group: 23-68 of 100 calls of 2-5 rows
#: past the rule (up to 7.2x), MQA's one row over 16-32 heads 11-23 of 40, 20-29 of 40 with no mask at
#: 64 keys; calls of at most 5 rows (tried) still failed at head size 64 and at 384-512 keys. One call
#: per member: none of those. Against the folded call (4k keys, head size 128, 2 threads; ALiBi / a key
#: mask): 4 heads of one row 1.6x / 2.6x the time, MQA's one row over 16 heads 1.7x / 3.2x, over 32
#: heads 2.0x / 4.6x; several key/value heads' groups, once a call per member, now take one call for
#: them all (0.65-0.86x the per-member calls' time, see _by_members).
MEMBER_ROWS = 8

#: MEMBER_ROWS at head sizes above 128, where torch's lanes reach 10 rows: 9 rows a head at head size
#: 256 folded went past the rule (3 of 1,230 cases of a review's fuzz, up to 5.2x). Not at 128 and
#: below: a GQA group of 12 rows a head there took 1.2-1.6x the time one member at a time.
MEMBER_ROWS_WIDE = 16


def _members_pay(qs, mask, rows: int, way: str) -> bool:
    """Whether a folded float32 piece of ``rows`` rows a head runs once per member: its heads have few
    rows, and it has a mask tile or the decode kernel would not take it (``way``, :func:`_route`'s for
    the folded call). Without a mask the kernel takes the folded rows (an MQA step reads its keys once)."""
    most = MEMBER_ROWS_WIDE if qs.shape[-1] > 128 else MEMBER_ROWS
    return rows <= most and (mask is not None or way != "native")


def _members_few_keys(qs, ks, rows: int) -> bool:
    """Whether a folded float32 piece of more than :data:`EXACT_ROWS` rows is one of :func:`_few_keys` a
    member (``rows`` a head): each member then takes the decode kernel's exact scores (:func:`_by_members`).
    Folded, the count past EXACT_ROWS sent 4 heads of 12 rows over 2 keys to the fused op, whose float32
    sums put them at up to 6.0x the rule's allowance (7 of 10 seeds at head size 128, score std 20, with
    or without keyfold's kernels; a review, 2026-12-07), where the naive sums each head's few rows in
    vector lanes."""
    return qs.shape[2] > EXACT_ROWS and _few_keys(qs[:, :, :rows], ks)


def _by_members(qs, ks, vs, mask, g: int, scale: float, wide: bool = False, hidden: bool = True):
    """A folded piece one member at a time: each head with its own L rows, as the naive attention
    multiplies them, the folded mask's rows with them (_fold_mask always spells out g L rows);
    ``(out, lse)`` folded as the one call's. One call (:func:`_op`: the decode kernel from
    NATIVE_F32_ROWS rows, else the fused op): the batch and key/value heads flattened into its batch, a
    group's members as its heads, against keys and values expanded to every member (a view, stride 0),
    so no key is copied; where a batch's keys cannot be flattened so (B > 1, heads
    not laid out one after another), one such call per batch element. Against a call per member (head
    size 128, 2 threads; ALiBi / a key mask): 16 heads over 4, one row, 4k keys 0.76x / 0.86x the time;
    32 over 8 at 32k keys 0.65x / 0.85x; 64 over 4 of 5 rows, 394 keys, causal 0.70x. MQA's (one
    key/value head, the same call as before) 0.58-0.66x (16-32 heads, one row, 4k keys)."""
    B, Hkv, gL, W = qs.shape
    if B > 1 and Hkv > 1 and not (_flattens(ks) and _flattens(vs)):
        parts = [_by_members(qs[b:b + 1], ks[b:b + 1], vs[b:b + 1],
                             None if mask is None else mask[b:b + 1] if mask.shape[0] > 1 else mask, g, scale, wide,
                             hidden)
                 for b in range(B)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    L, S, Dv, n = gL // g, ks.shape[2], vs.shape[-1], B * Hkv
    q = qs.reshape(n, g, L, W)
    k, v = ks.reshape(n, 1, S, W).expand(n, g, S, W), vs.reshape(n, 1, S, Dv).expand(n, g, S, Dv)
    m = None
    if mask is not None:  # (b, h, g L, S) with b in (1, B), h in (1, Hkv) -> (n or 1, g, L, S)
        m = mask.unflatten(2, (g, L))
        m = m.flatten(0, 1) if m.shape[0] * m.shape[1] == 1 else m.expand(B, Hkv, g, L, S).reshape(n, g, L, S)
    out, lse = _op(q, k, v, False, m, scale, wide=wide, hidden=hidden)  # the decode kernel where it takes the members' rows
    return out.reshape(B, Hkv, gL, out.shape[-1]), lse.reshape(B, Hkv, gL)


def _flattens(x) -> bool:
    """Whether ``x``'s first two dims flatten into one as a view."""
    return x.shape[0] == 1 or x.shape[1] == 1 or x.stride(0) == x.stride(1) * x.shape[1]


def forward(q, k, v, plan: Plan, pb: Problem, keep_dtype: bool = False, wide_lse: bool = False,
            lse_needed: bool = True) -> State:
    """Attention over the plan's pieces; returns the merged State (float32 / float64).

    keep_dtype: out comes back in the input dtype, for a caller that casts it there anyway: a
    one-piece plan's out is the op's own tensor, and a plan whose pieces cover disjoint rows (no row
    in two pieces: nothing to merge, as in a sliding window's band) writes every piece's out straight
    into one output in the input dtype. Pieces that are merged are always upcast first.

    wide_lse: lse in float64 and out in float32 (float64 inputs: as without it), for a caller that
    merges the state with others (keyfold's decoding: see :class:`keyfold.State`): the prefill and
    decode kernels sum lse in double, and pieces the router sends to the fused op, whose lse is float32
    and whose 16-bit out is rounded to 16 bits, run as :func:`_op` says under ``wide`` instead.

    lse_needed: False where nobody reads the state's lse (no backward, no caller): a one-piece plan on
    the fused op then skips :func:`_hidden_rows`; pieces that are merged always take it."""
    wide = wide_lse and q.dtype is not torch.float64
    sd = state_dtype(q.dtype)
    ld = torch.float64 if wide else sd  # lse's dtype
    B, Hq, Nq, _ = q.shape
    Dv = v.shape[-1]
    if Nq == 0 or k.shape[2] == 0 or Hq == 0:  # nothing to attend (the fused op dies of SIGFPE on an empty
        # sequence, or on no heads)
        return State(*(t.to(d) for t, d in zip(empty_state(B, Hq, Nq, Dv, dtype=sd, device=q.device), (sd, ld))))
    st = prefill(q, k, v, plan, pb, keep_dtype, wide)  # the prefill kernel: the whole plan in one call
    if st is not None:
        return st
    joined = _joined_rows(q, k, v, plan, pb)
    if joined is not None:
        plan = joined
    # a call whose plain pieces go by float32 chunks or to the native kernel is not widened as a whole
    # (a piece that goes neither way is, in _op)
    nrows = Nq * (Hq // k.shape[1])
    few = _chunks_pay(q.dtype, nrows, k.shape[2]) or (
        q.dtype is torch.float16 and _native_may(q.dtype, nrows, k.shape[2]))
    inp = _Inputs(q, k, v) if few else _Inputs(*_widen(q, k, v))
    memo: dict = {}
    single = len(plan.pieces) == 1 and plan.pieces[0].q0 == 0 and plan.pieces[0].q1 == Nq
    hidden = lse_needed or wide or not single  # whether anyone reads the pieces' lse (_op's hidden)
    direct = not single and keep_dtype and _rows_disjoint(plan.pieces)
    if direct:  # filled piece by piece; rows no piece covers are set at the end
        acc = State(torch.empty(B, Hq, Nq, Dv, dtype=q.dtype, device=q.device),
                    torch.empty(B, Hq, Nq, dtype=ld, device=q.device))
    else:
        acc = None if single else State(torch.zeros(B, Hq, Nq, Dv, dtype=sd, device=q.device),
                                        torch.full((B, Hq, Nq), NEG_INF, dtype=ld, device=q.device))
    touched = None if single or direct else torch.zeros(Nq, dtype=torch.bool)
    covered = 0  # rows written, when direct
    for piece in plan.pieces:
        qs, ks, vs, causal, tile, folded, _ = _piece_args(inp, piece, pb, q, memo, plan.tiles)
        if qs.dim() == 5:  # GQA under the causal flag: one call per group member
            parts = [_op(qs[:, :, j], ks, vs, causal, tile.mask, pb.scale, wide=wide, hidden=hidden) for j in range(inp.g)]
            out = torch.stack([p[0] for p in parts], 2).flatten(1, 2)   # (B, Hq, L, W)
            lse = torch.stack([p[1] for p in parts], 2).flatten(1, 2)   # (B, Hq, L)
        else:  # routed once: a folded float32 piece asks where the folded call would run
            way = _route(qs, ks, vs, causal, tile.mask)
            if folded and q.dtype is torch.float32 and (_members_pay(qs, tile.mask, piece.q1 - piece.q0, way)
                                                        or _members_few_keys(qs, ks, piece.q1 - piece.q0)):
                out, lse = _by_members(qs, ks, vs, tile.mask, inp.g, pb.scale, wide, hidden)
            else:
                out, lse = _op(qs, ks, vs, causal, tile.mask, pb.scale, way, wide, inp.g if folded else 1, hidden)
        if folded:
            out, lse = _unfold(out, inp.g, Hq), _unfold(lse, inp.g, Hq)
        trimmed = out.shape[-1] != Dv
        if trimmed:
            out = out[..., :Dv]
        if out.dtype != sd and not ((single or direct) and keep_dtype):  # upcast before any merge
            out = out.to(sd)
        if lse.dtype != ld:  # (the decode kernel's is float64: rounded here unless wide)
            lse = lse.to(ld)
        if tile.row_shift is not None:
            lse = lse + tile.row_shift
        if tile.empty is not None:  # the op reports lse = 0 for rows it saw no key in
            lse = lse.masked_fill(tile.empty, NEG_INF)
            out = out.masked_fill(tile.empty.unsqueeze(-1), 0.0)
        if single:  # one piece covers every row: it is the whole state, no accumulator (v's head
            # size below q's leaves out a slice of the op's padded rows: made contiguous, as SDPA's
            # out is, or out.view(...) raised where torch's works)
            return State(out.contiguous() if trimmed else out, lse)
        rows = slice(piece.q0, piece.q1)
        if direct:  # no other piece has these rows (copy_ casts a float32 piece, e.g. the native kernel's)
            acc.out[:, :, rows] = out
            acc.lse[:, :, rows] = lse
            covered += piece.q1 - piece.q0
        elif not bool(touched[rows].any()):
            acc.out[:, :, rows] = out
            acc.lse[:, :, rows] = lse
            touched[rows] = True
        else:
            merge_into(State(acc.out[:, :, rows], acc.lse[:, :, rows]), State(out, lse))
            touched[rows] = True
    if acc is None:  # a single piece of no rows: nothing ran
        return State(*(t.to(d) for t, d in zip(empty_state(B, Hq, Nq, Dv, dtype=sd, device=q.device), (sd, ld))))
    if direct and covered < Nq:  # rows no piece covers see no key: out 0, lse -inf
        bare = torch.ones(Nq, dtype=torch.bool)
        for p in plan.pieces:
            bare[p.q0:p.q1] = False
        acc.out[:, :, bare] = 0
        acc.lse[:, :, bare] = NEG_INF
    return acc


#: 16-bit calls join their pieces only up to this many keys x head size: the masked call over a long cache
#: took 1.2-1.9x the pieces' time (bfloat16/float16, 2-4 rows: 4k keys at D=128-256, 8k+ at D=64)
JOIN_16BIT_KEYS_X_HEAD = 2048 * 64


def _joined_rows(q, k, v, plan: Plan, pb: Problem) -> Plan | None:
    """For a call of a few rows (a speculative decoding step, a chunk verified at once) whose pieces all hold
    every row: one piece over their keys, the mask evaluated on it as a tile, so one fused call runs instead
    of one a piece with the states merged after (causal over 1k keys, 2-8 rows, 8 heads: float32 0.61-0.86
    -> 0.41-0.62 ms on the decode kernel, bfloat16 0.51-0.62 -> 0.31-0.33 ms; 2026-12-08). The same pairs;
    a float32 call keeps its exact scores. None where the pieces do not share their rows, past
    :data:`NATIVE_MASKED_ROWS` rows (GQA's folded in), for float16 widened whole (:data:`FP16_AS_FP32`:
    its pieces go by chunks), or for a float32 GQA group: masked, it runs a call per member
    (:func:`_by_members`), which reads the keys once a member where the unmasked piece read them once for
    the group (2 tokens of 32 heads over 8, 4k keys: 1.4x the time of the pieces)."""
    pieces = plan.pieces
    if (len(pieces) < 2 or pb.mask is None or q.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or (q.dtype is torch.float16 and FP16_AS_FP32)):  # (widened whole: 3-4x the pieces' time by chunks)
        return None
    Nq, f32 = q.shape[2], q.dtype is torch.float32
    if (f32 and q.shape[1] != k.shape[1]) or Nq * (q.shape[1] // k.shape[1]) > NATIVE_MASKED_ROWS or any(
            p.q0 != 0 or p.q1 != Nq for p in pieces):
        return None
    k0, k1 = min(p.k0 for p in pieces), max(p.k1 for p in pieces)
    if k1 - k0 > sum(p.k1 - p.k0 for p in pieces) + plan.block_k:  # keys no piece reads (sinks and a window
        # far apart): the joined call would read and mask them all (32k keys: 33-54x the pieces' time)
        return None
    if not f32 and (k1 - k0) * max(q.shape[-1], v.shape[-1]) > JOIN_16BIT_KEYS_X_HEAD:
        return None
    if f32 and not native.pays(q, k[:, :, k0:k1], v[:, :, k0:k1], 1):
        return None
    return dataclasses.replace(plan, pieces=(Piece(0, Nq, k0, k1, PieceKind.MASKED),))


def _rows_disjoint(pieces) -> bool:
    """Whether the pieces, in their order, cover row ranges that never overlap (so nothing merges).
    Pieces out of row order answer False: the merging path, always right, runs then."""
    end = 0
    for p in pieces:
        if p.q0 < end:
            return False
        end = p.q1
    return True


def _fp16_down(dtype, dout, dlse) -> float:
    """The power of two a float16 backward divides dO and dlse by so that both fit the op's input
    with room (largest magnitude at most 2^14): 1 for other dtypes, for values that fit, and for
    non-finite ones (they stay what they are)."""
    if dtype != torch.float16:
        return 1.0
    big = max([float(torch.linalg.vector_norm(t.detach(), math.inf)) for t in (dout, dlse)
               if t is not None and t.numel()] or [0.0])
    if not math.isfinite(big) or big <= 2.0 ** 14:
        return 1.0
    return 2.0 ** math.ceil(math.log2(big / 2.0 ** 14))


def backward_on_tiles(q, k, v=None, plan: Plan | None = None, pb: Problem | None = None,
                      whole_rows: bool = True) -> bool:
    """Whether a CPU-backend backward of these inputs runs on the tile kernel instead (the engine
    replans it there): float32 where keyfold's backward kernel is not built (CPUs without AVX2, another
    architecture, no C compiler, ``KEYFOLD_NATIVE=0``; on AVX2 CPUs it is built since 2026-12-07); and on
    AVX2, float32 pieces of a larger call (``attend_backward``, ``whole_rows`` False, given ``v``, the
    plan and its problem) whose forward ran on the op (:func:`_lse_from_op_on_avx2`): the kernel can
    renormalise only over a row's every key, and P against the op's lse there put dv at 10.6x the rule's
    allowance (head size 256 over 5 keys; 4.0x at 64; a review, 2026-12-07), where the tile kernel's P,
    from torch's GEMM as the op's, held it (1.4x its naive error at most).

    PyTorch's fused float32 backward recomputes P with an e^x that loses precision: on the AMD EPYC
    (AVX2, before its backward kernel) its gradients broke the 3x rule in 58 of 200 random calls (up to 3.4x the allowance; 24
    of 73 at score spread 3, 31 of 66 at 6), the tile kernel's in none (a 2026-12-07 fuzz); with
    q/k and v head sizes apart (the op pads them to one) in 5-9 of 20 at D=8, Dv=32. keyfold's backward
    kernel, where built, holds the rule and is faster than both. Without that kernel 16-bit goes to the
    tile kernel too (its P and sums in float32, gradients rounded once): the op's 16-bit backward broke
    the rule in 7-8 of 1,500 random bfloat16 calls and 8-9 of float16 (up to ~10x the allowance, 31
    causal rows over 2 keys; a review, 2026-12-07; 0 of 240 in the AMD EPYC's fuzz before). float64
    stays on the op, and so do empty inputs (zeros, no plan)."""
    if not (q.dtype in (torch.float32, torch.float16, torch.bfloat16) and q.numel() > 0 and k.numel() > 0):
        return False
    if not native.backward_available():
        return True
    if q.dtype is not torch.float32:
        return False
    return not whole_rows and plan is not None and _lse_from_op_on_avx2(q, k, v, plan, pb)


def backward(q, k, v, out, lse, dout, dlse, plan: Plan, pb: Problem, whole_rows: bool = True, grad_dtype=None):
    """Per-piece gradients with the global (out, lse), summed in float32 (docs/math.md §2).

    whole_rows: these keys are all the keys the rows see (the engine's own backward); False for a
    piece of a larger computation (``attend_backward``), where a row's one key here need not be its only one.
    grad_dtype: the dtype the caller wants the gradients in (default float32, float64 for float64
    inputs). A gradient one piece computes alone comes back as the op returned it, cast once; sums
    of several pieces are taken in float32.

    Memory: besides the three gradients this holds one piece's op outputs at a time. A gradient
    that one piece covers whole is the op's own tensor (no zeroed buffer beside it), and rows
    with a single visible key are taken out of the op through their lse, not a copy of dout."""
    sd = state_dtype(q.dtype)
    gd = sd if grad_dtype is None else grad_dtype
    B, Hq, Nq, D = q.shape
    Dv = v.shape[-1]
    if Nq == 0 or k.shape[2] == 0 or Hq == 0:  # no pair: every gradient is zero (and the fused op refuses empty input)
        return (torch.zeros(q.shape, dtype=gd, device=q.device), torch.zeros(k.shape, dtype=gd, device=q.device),
                torch.zeros(v.shape, dtype=gd, device=q.device))
    spare = dlse is not None
    op_order = _lse_from_op_on_avx2(q, k, v, plan, pb)  # asked before float16 is widened, as the forward asked
    q, k, v = _widen(q, k, v)
    inp = _Inputs(q, k, v, spare=spare)
    W = inp.W
    # dO (and -dlse beside it) go to the op in q's dtype; every gradient is linear in them, so
    # float16 takes them divided by a power of two where they pass 2^14 (a z-loss on lse, a loss
    # scale): cast as they were, dlse = 7e4 made every dq and dk of the call NaN, though all of them
    # fit float16 (a helper's fuzz)
    down = _fp16_down(q.dtype, dout, dlse)
    if down != 1.0:  # in float32: dout's small entries keep their bits (single-key rows read it)
        dout = dout.float() / down
        dlse = None if dlse is None else dlse.float() / down
    o = _pad(_rows(out.to(q.dtype)), W)
    do = _pad(_rows(dout.to(q.dtype)), W)
    if spare:
        o = o.clone()
        do = do.clone()
        o[..., W - 1] = 1
        do[..., W - 1] = (-dlse).to(q.dtype)
    # Rows that saw no key anywhere have lse = -inf; every piece hides them, so any finite
    # stand-in gives P = 0 there, while -inf itself would make the op return NaN.
    lse_safe = torch.nan_to_num(lse.to(sd), nan=math.nan, posinf=math.inf, neginf=0.0)
    memo: dict = {}
    # keyfold's own backward (backward.c) where it runs: P to about 1 ulp, where the op's e^x put float32
    # dv at 3.5-11x the naive error (docs/math.md's rule is 3x), and the op's 16-bit gradients past the
    # rule too (LOW_ON_KERNEL). Past ORDERED_HEAD no forward sums its scores in the kernel's order, so
    # the kernel runs there only renormalised, which needs all of a row's keys (whole_rows)
    own = ((q.dtype is torch.float32 or (q.dtype in LOW_ON_KERNEL and whole_rows))
           and native.backward_takes(inp.q, inp.k, inp.v) is None and (W <= ORDERED_HEAD or whole_rows))
    # the kernel's pieces as float32's: its 16-bit gradients are float32 sums, rounded once
    pieces = _backward_pieces(plan, pb, q.shape[:2], k.shape[2], wide=q.dtype == sd or own, g=inp.g)
    single = _single_key_rows(inp, pieces, plan.tiles, pb, q, memo) if whole_rows else None
    if single is not None:  # those rows leave the op and are added exactly below: with lse huge,
        # P = exp(s - lse) = 0 for every key, so the op gives them dS = 0 and no dV (as dO = 0 would)
        lse_safe.masked_fill_(single[0], _OUT_OF_OP)
    # A gradient with one piece: kept as the op returns it (16-bit too), single-key rows added
    # into it with one rounding per row they touch. Several: summed in sd. The kernel's are float32:
    # kept so (one piece) or summed in float32, single-key rows added, and rounded once at the end
    alone = len(pieces) == 1 and not own
    # pieces on rows apart (a band each): every dq row comes from one call, so it is kept as that
    # call gives it (16-bit: rounded once, by the op), with no float32 sum and cast after
    acc = _Grads(q, k, W, sd, gd if alone else sd, gd if alone or (_rows_disjoint(pieces) and not own) else sd)
    delta = lse_lo = delta_lo = None
    renorm = own and whole_rows and (Nq * inp.g < RENORM_ROWS or W > ORDERED_HEAD or D < RENORM_HEAD
                                     or k.shape[2] <= RENORM_KEYS or op_order)
    # float64 sums only with the renormalised lse
    wide = renorm and (W > WIDE_HEAD or Nq <= WIDE_ROWS or k.shape[2] <= WIDE_KEYS)
    if renorm:
        # P and delta renormalised by the kernel's own scores (backward.c) where the forward's lse does not
        # give them: a forward of so few rows ran on the op or the decode kernel, which sum scores in
        # another order, or (from PREFILL_SQUARE_ROWS) on the prefill kernel, whose exponent arithmetic is
        # not this kernel's (at 128 or 256 rows instead of 512, a 700-case fuzz found 2-3 cases past the
        # rule, at 512 none; skipping it after the prefill kernel's forward, 12 more in 1,500); past
        # ORDERED_HEAD no forward sums in this kernel's order; under RENORM_HEAD the forward's lse rounding
        # outweighs the naive error; and on AVX2 where the forward ran on the op (op_order), whose GEMM there
        # blocks dot products its own way (unrenormalised, 9 of 230 random float32 calls past the rule, dk
        # 3.8x at head size 256, dv 4.2x at 64 over 5 keys; renormalised none)
        lse_safe, lse_lo, delta, delta_lo = _renormalised(inp, pieces, pb, q, memo, plan.tiles, lse_safe, o, do,
                                                          spare, wide)
    for piece in pieces:
        qs, ks, vs, causal, tile, folded, keys, rows, o_p, do_p, l_p, d_p, lo_p, dlo_p = _backward_args(
            inp, piece, pb, q, memo, plan.tiles, o, do, lse_safe, delta, lse_lo, delta_lo)
        if own:  # a GQA group's members in one call
            gq, gk, gv = native.backward(do_p, qs.flatten(1, 2) if qs.dim() == 5 else qs, ks, vs, o_p, l_p, causal,
                                         tile.mask, pb.scale, delta=d_p, lse_lo=lo_p, wide=wide, delta_lo=dlo_p)
        elif qs.dim() == 5:  # GQA under the causal flag: per member, dk / dv summed over the group
            o5, do5, l5 = (_members(t.contiguous(), inp.g) for t in (o_p, do_p, l_p))
            gq = qs.new_empty(qs.shape)  # (B, Hkv, g, L, W), in the dtype the op returns
            gk = gv = None
            for j in range(inp.g):  # one member's op outputs alive at a time
                a, b, c = _op_backward(do5[:, :, j], qs[:, :, j], ks, vs, o5[:, :, j], l5[:, :, j], causal,
                                       tile.mask, pb.scale)
                gq[:, :, j] = a
                gk = b.to(sd) if gk is None else gk.add_(b)
                gv = c.to(sd) if gv is None else gv.add_(c)
                del a, b, c
            gq = gq.flatten(1, 2)                                      # (B, Hq, L, W)
        else:
            # row slices go in as views: the op reads strided dO, O and lse (it copies them itself)
            gq, gk, gv = _op_backward(do_p, qs, ks, vs, o_p, l_p, causal, tile.mask, pb.scale)
        if folded:
            gq = _unfold(gq, inp.g, Hq)
        acc.add(gq, gk, gv, rows, keys)
        del gq, gk, gv
    dq, dk, dv = acc.grads
    del acc
    if single is not None:
        _add_single_key_rows(single, q, k, dout, dlse, dq, dk, dv, pb.scale)
    if down != 1.0:  # exact (a power of two); inf only where the gradient itself passes float16
        dq, dk, dv = dq.mul_(down), dk.mul_(down), dv.mul_(down)
    dq = _trim(dq, D, gd)  # one at a time: a float32 sum is freed as soon as its cast exists
    dk = _trim(dk, D, gd)
    return dq, dk, _trim(dv, Dv, gd)


def _backward_args(inp: _Inputs, piece: Piece, pb: Problem, q, memo: dict, cache, o, do, lse, delta, lse_lo=None,
                   delta_lo=None):
    """One piece's backward call: :func:`_piece_args` and the piece's rows of ``o``, ``do``, ``lse``,
    ``delta``, ``lse_lo`` and ``delta_lo`` (None: the call takes dO.O, lse alone), folded with its q and
    lse shifted by its row term."""
    qs, ks, vs, causal, tile, folded, keys = _piece_args(inp, piece, pb, q, memo, cache)
    # the op skips those blocks. Here, not in _piece_args: its `causal` means "no mask, top-left
    # causal", which _single_key_rows counts by formula; a masked piece must be counted by its mask
    causal = causal or _hides_above_diagonal(tile, qs.shape[-2], ks.shape[-2])
    rows = slice(piece.q0, piece.q1)
    o_p, do_p, l_p = o[:, :, rows], do[:, :, rows], lse[:, :, rows]
    d_p, lo_p, dlo_p = (None if x is None else x[:, :, rows] for x in (delta, lse_lo, delta_lo))
    if tile.row_shift is not None:  # the op sees scores without the row term
        if lo_p is None:
            l_p = l_p - tile.row_shift
        else:  # renormalised: lse + lse_lo - row_shift in float64, split again (float32 alone rounds the
            # difference by half an ulp of it, which lse_lo was there to take out of every P)
            l_p, lo_p = _split(l_p.double() + lo_p.double() - tile.row_shift.double())
    if folded:
        o_p, do_p, l_p = _fold(o_p, inp.g), _fold(do_p, inp.g), _fold(l_p, inp.g)
        d_p, lo_p, dlo_p = (None if x is None else _fold(x, inp.g) for x in (d_p, lo_p, dlo_p))
    return qs, ks, vs, causal, tile, folded, keys, rows, o_p, do_p, l_p, d_p, lo_p, dlo_p


def _renormalised(inp: _Inputs, pieces, pb: Problem, q, memo: dict, cache, lse, o, do, spare: bool, wide: bool):
    """``(lse, lse_lo, delta, delta_lo)`` float32 ``(B, Hq, Nq)`` of every row as the float32 backward
    kernel's own scores give them: lse + log(sum P) (in two parts, lse + lse_lo: float32 alone would round
    it by half an ulp of lse, a relative error of every P) and sum P dP / sum P over all the row's pieces
    (``native.backward_sums``), minus dlse with the ``spare`` column, also in two parts (the float64 dP of
    a ``wide`` call meets it whole). Rows whose sum is 0 or not finite (no key, single-key rows taken out
    of the op, NaN) keep their lse."""
    B, Hq, Nq = lse.shape
    sums = torch.zeros(2, B, Hq, Nq, dtype=torch.float64)
    for piece in pieces:
        qs, ks, vs, causal, tile, folded, _, rows, _, do_p, l_p, _, _, _ = _backward_args(
            inp, piece, pb, q, memo, cache, o, do, lse, None)
        part = native.backward_sums(do_p, qs.flatten(1, 2) if qs.dim() == 5 else qs, ks, vs, l_p, causal, tile.mask,
                                    pb.scale, wide=wide)
        if folded:
            part = torch.stack([_unfold(x, inp.g, Hq) for x in part])
        if tile.row_shift is not None:  # the sums are of exp(s - l_p), l_p = lse - row_shift rounded to
            # float32 (off by up to half an ulp of it, 2^-25 |l_p|, in every P: dv up to 3.0x the 3x rule's
            # allowance over 2-8 keys at sharp scores, a row term beside them small); taken back to lse
            l_p = _unfold(l_p, inp.g, Hq) if folded else l_p
            off = l_p.double() - (lse[:, :, rows].double() - tile.row_shift.double())
            part = part * torch.exp(off.clamp(-1.0, 1.0))  # |off| <= 2^-25 |l_p|; rows out of the op
            # (lse 1e30, sums 0) may be further off, and must not meet an infinite factor
        sums[:, :, :, rows] += part
    sigma, tau = sums
    ok = (sigma > 0) & torch.isfinite(sigma)
    one = torch.where(ok, sigma, torch.ones((), dtype=torch.float64))
    lse64 = torch.where(ok, lse.double() + torch.log(one), lse.double())
    extra = (do[..., -1].double() * o[..., -1].double()) if spare else 0.0
    # delta of a row whose sum is 0 meets only P = 0 (and one that is not finite, NaN P's): any will do
    delta64 = torch.where(ok, tau / one + extra, 0.0)
    return (*_split(lse64), *_split(delta64))


def _split(x64):
    """float64 ``x`` as float32 ``(hi, lo)`` with ``hi + lo`` its value to about 2^-48 relative."""
    hi = x64.float()
    return hi, (x64 - hi.double()).float()


#: Query rows per kv head under which the float32 backward renormalises (its forward ran on the fused op
#: or the decode kernel, or on the prefill kernel from PREFILL_SQUARE_ROWS: see backward)
RENORM_ROWS = PREFILL_MIN_ROWS
#: q and k's head size under which the float32 backward renormalises at any row count: a score of few
#: products is nearly exact in the naive attention, and the forward's lse (its float32 sum of P over
#: the row, log and add each rounded) then puts P further off than the naive softmax's own rounding:
#: 21 of 160 random calls of 512-1024 rows at head sizes 1-12 broke the 3x rule unrenormalised
#: (dv up to 7.7x at score std 6-10), none of 190 at 16-128; at sharper scores (std 12-20) 22 of 400 at
#: head sizes 17-48 did (dv up to 1.94x; 6 of 20 seeds at 17, 1 of 20 at 48, none from 64; a review,
#: 2026-12-07), so up to 63 now, at 1.4-1.5x the time of forward+backward at head sizes 16-48 (causal,
#: 512-4,096 rows, 8 heads, 2 threads)
RENORM_HEAD = 64
#: Head size (with the lse gradient's spare column) above which a renormalised float32 backward sums
#: its scores and dP in float64: a float32 sum over 256 terms put dv at 6.6x the naive error (2 keys,
#: score std 1), where over 64 the renormalised float32 sums held the rule in a 700-case fuzz; float64
#: and the first pass cost 1.5-2.3x the op's time, float32 without it 0.60-0.86x (B=1, H=8, 1k-4k, 2 threads,
#: benchmarks/backward_kernel.py)
WIDE_HEAD = 128
#: 16-bit dtypes whose backward (all of a row's keys: the engine's own) runs on keyfold's kernel, which
#: reads them as they are and computes in float32 (renormalised under RENORM_ROWS rows), the gradients
#: summed over the pieces in float32 and rounded once: the fused op's 16-bit backward broke the 3x rule
#: in 7 of 300 short random calls (dq 29x the naive bfloat16 error on a 2 x 2 causal window) and 2 of
#: 100 of 512-1024 rows (dv 3.6x: bfloat16 ALiBi, float16 causal); on the kernel in none
LOW_ON_KERNEL = (torch.float16, torch.bfloat16)
#: Head size (with the lse gradient's spare column) up to which a forward sums its scores as the float32
#: backward kernel does, one FMA a head dimension in order (the prefill kernel, the fused op's GEMM):
#: past it the forward ran on the fused op, whose blocking of long dot products is its own, and the
#: kernel renormalises (head 256 with an lse gradient, 257 wide, broke the rule on the op: dv 4.7x,
#: dk 4.6x, dq 8.7x in a 1,500-case fuzz)
ORDERED_HEAD = 256
#: Keys (of the call) up to which the float32 backward renormalises and sums in float64 whatever its rows and
#: head size: a naive attention over so few keys multiplies q by k^T in a small product that sums each
#: score more exactly than one FMA a dimension, and at sharp scores (std 6-20) the kernel's float32 sums
#: broke the 3x rule in 8 of 300 calls of 2-8 keys (dq 1.6x the allowance; the tile backward 4 of 300),
#: none of 16 or more keys; float64 sums: 0.02-0.34 of it (a review's fuzz, 2026-12-07)
WIDE_KEYS = 8
#: Keys (of the call) up to which the float32 backward renormalises at any row count: rows over so few
#: keys at sharp scores (std 12) met the forward's float32 lse rounding (2^-24 |lse| in every P) beside
#: a naive error that few keys keep small: dv 1.17-1.26x the allowance over 16 and 40 keys at 600 rows
#: a kv head (2 of 300 in a fuzz of 2-64 keys with the forward on the prefill kernel), none renormalised
RENORM_KEYS = 64
#: Query rows (per query head) up to which a renormalised float32 backward sums in float64 whatever its
#: head size: a naive float32 attention of up to 3 rows a head sums each score along the head dimension in
#: vectors (torch's matmul takes a GEMV there; from 4 rows one FMA a dimension in order, as this kernel),
#: more exactly than one FMA a dimension, and three one-row cases of a 1,500-case fuzz broke the rule on
#: float32 sums (dv 7.7x, dq 6.8x at score std 6-10). Counted per kv head (a GQA group's rows) it missed
#: 3 rows of a group of 4 (12 rows): dv 16x, dq 5.8x the naive error, 2 of 1,000 float32 cases
#: float32 sums: 9-16 rows a head under a float tensor mask put dq at 1.84x the rule's allowance (1 of 2,000
#: random calls of 9-16 rows; a review, 2026-12-07): 16 now
WIDE_ROWS = 16


#: Key span above which the backward cuts a FULL piece of a many-piece plan (see _backward_pieces)
BACKWARD_SPAN = 1024


def _backward_pieces(plan: Plan, pb: Problem, BH: tuple[int, int], Nk: int, wide: bool = True, g: int = 1):
    """The pieces the backward gives the op, one call each.

    Float32 (``wide``): the plan's, FULL ones cut into key spans of at most
    ``max(BACKWARD_SPAN, Nk // 8)`` when there are several pieces. The op returns dk and dv over
    its whole key span, which the backward adds into the sums and frees: a row band of a prefix-LM
    plan spans up to every key, so uncut it would hold two more key-length gradients at its peak.
    Cut, the pieces' own outputs stay under a quarter of one gradient (from 8k keys on). A FULL
    piece's gradient is the sum of its key spans' (the global O and lse make every span exact),
    and a span is more than half the cap, so each op call stays large. A one-piece plan is not
    cut: its outputs are the gradients themselves.

    16-bit: never cut, since the op rounds each call's dq to 16 bits and every extra span would
    add a rounding to the row's sum (measured: 5e-3 relative in bf16 dq). Fewer, fuller calls
    instead: the op's 16-bit backward costs by the 256-row x 512-key blocks it works in, about
    1.1-2.4 ms each (bfloat16, D 64, 8 heads, 2 threads: 128 rows x 64 keys 1.2 ms, 256 x 512
    2.4 ms, 256 x 640 3.9 ms), whatever part of a block the piece fills. So a plan of narrower row
    blocks (windows plan at 128) is planned again at 256 rows, and a band's pieces side by side
    are joined where that saves the op a block (:func:`_joined`). A plan whose pieces fill at least
    half of their hull, when the hull holds at most ``JOIN_AREA`` pairs (and its mask at most 8
    ``JOIN_AREA`` elements: a bias has one per query head, a GQA fold one per group member), runs as
    the one masked hull: the op's larger calls cost less a pair (1024 x 1024, D 128: 20.8 ms, against 23 ms for
    prefix-LM's five band pieces), and one piece's gradients need no sums (which cost prefix-LM
    at 1k, D 128, another 8 ms in slice copies, float32 adds and casts)."""
    if len(plan.pieces) == 1:
        return list(plan.pieces)
    if not wide:
        pieces = plan.pieces
        if plan.block_q < _OP_ROWS and pb.mask is not None and plan.Nq > plan.block_q:
            pieces = _plan(pb.mask, plan.Nq, plan.Nk, q_offset=plan.q_offset, kv_offset=plan.kv_offset,
                           B=BH[0], H=BH[1], block_size=(_OP_ROWS, max(plan.block_k, _OP_ROWS)),
                           max_span=JOIN_SPAN if pb.score is not None else None).pieces
        pieces = _joined(pieces)
        if len(pieces) < 2:
            return pieces
        hull = Piece(min(p.q0 for p in pieces), max(p.q1 for p in pieces),
                     min(p.k0 for p in pieces), max(p.k1 for p in pieces), PieceKind.MASKED)
        area = hull.area
        copies = BH[1] if _bias_needed(pb) else g  # the mask's elements per pair, at most
        computed = sum(_causal_area(p) if p.kind is PieceKind.CAUSAL else p.area for p in pieces)
        if area <= JOIN_AREA and area * copies <= 8 * JOIN_AREA and 2 * computed >= area:
            return [hull]
        return pieces
    cap = max(BACKWARD_SPAN, Nk // 8)
    out = []
    for p in plan.pieces:
        if p.kind is not PieceKind.FULL or p.k1 - p.k0 <= cap:
            out.append(p)
            continue
        n = -(-(p.k1 - p.k0) // cap)  # spans of equal length
        edges = [p.k0 + (p.k1 - p.k0) * i // n for i in range(n + 1)]
        out += [Piece(p.q0, p.q1, a, b, PieceKind.FULL) for a, b in zip(edges, edges[1:])]
    return out


#: The rows and keys of the blocks the fused op's 16-bit backward works in (see _backward_pieces)
_OP_ROWS, _OP_KEYS = 256, 512
#: Longest key span of a joined piece: its mask (with a bias, one per head) is materialised
JOIN_SPAN = 1024
#: Most pairs of the one masked piece a small, dense plan's 16-bit backward runs as (see below)
JOIN_AREA = 1024 * 1024


def _joined(pieces):
    """Pieces of one row band, in key order, joined into one MASKED piece where the joined span
    takes fewer of the op's 512-key blocks than the pieces apart, up to ``JOIN_SPAN`` keys.
    Prefix-LM at 1k: a band's FULL keys [0, 768) beside its diagonal [768, 1024) take 2 blocks
    joined, 3 apart; a sink [0, 128) beside a window [512, 1024) stays apart (2 blocks either way,
    and joined it would compute the gap). The mask of a joined piece comes from the mask itself
    (``visible``), as for any MASKED piece, so joining changes no visible pair."""
    def blocks(n):
        return -(-n // _OP_KEYS)
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (last is not None and (last.q0, last.q1) == (p.q0, p.q1) and p.k0 >= last.k1
                and p.k1 - last.k0 <= JOIN_SPAN
                and blocks(p.k1 - last.k0) < blocks(last.k1 - last.k0) + blocks(p.k1 - p.k0)):
            out[-1] = Piece(p.q0, p.q1, last.k0, p.k1, PieceKind.MASKED)
            continue
        out.append(p)
    return out


#: lse given to the op for rows it must not touch: exp(s - lse) underflows to exactly 0 for any
#: finite score s (a float32 score is at most ~3.4e38, and s - 1e30 < -88 whenever s < 1e30 - 88)
_OUT_OF_OP = 1e30


class _Grads:
    """dq, dk, dv ``(B, H, N, W)`` summed over pieces. A piece that covers a gradient's whole
    length and comes first gives its own tensor as the sum (when its dtype is the one to sum in),
    so a one-piece plan allocates nothing beside the op's outputs. Otherwise the sum starts
    empty: a piece's rows (or keys) no piece wrote yet are copied in, the others added, and what
    no piece reached is zeroed at the end (zeros, then an add, read and wrote each sum once more:
    about 1 ms of a 20 ms bfloat16 backward at 1k)."""

    def __init__(self, q, k, W, sd, dtype, dq_dtype=None):
        self.shapes = (q.shape[:3] + (W,), k.shape[:3] + (W,), k.shape[:3] + (W,))
        self.sd, self.device = sd, q.device
        # the dtype each sum is kept in; a piece's own tensor is the sum when it covers it whole in it
        self.dtypes = (dtype if dq_dtype is None else dq_dtype, dtype, dtype)
        self.sums: list = [None, None, None]
        self.written: list[list[list[int]]] = [[], [], []]  # per sum: its written spans, sorted, disjoint

    def _one(self, i, part, span):
        shape, acc = self.shapes[i], self.sums[i]
        if acc is None:
            if span.start == 0 and span.stop == shape[2] and part.dtype == self.dtypes[i] and part.shape == shape:
                self.sums[i] = part  # the op's (or our) fresh tensor: nothing else holds it
                self.written[i] = [[0, shape[2]]]
                return
            # a sum in sd when several pieces add into it, else in the dtype asked for
            acc = self.sums[i] = torch.empty(shape, dtype=self.dtypes[i] if i == 0 else self.sd, device=self.device)
        a, b = span.start, span.stop
        done = self.written[i]
        at = a
        for lo, hi in done:  # new parts [at, lo) copied, written parts [lo, hi) added
            lo, hi = max(lo, a), min(hi, b)
            if lo >= hi:
                continue
            if lo > at:
                acc[:, :, at:lo].copy_(part[:, :, at - a:lo - a])
            acc[:, :, lo:hi] += part[:, :, lo - a:hi - a]
            at = hi
        if at < b:
            acc[:, :, at:b].copy_(part[:, :, at - a:b - a])
        self.written[i] = _union(done, a, b)

    def add(self, gq, gk, gv, rows, keys):
        self._one(0, gq, rows)
        self._one(1, gk, keys)
        self._one(2, gv, keys)

    @property
    def grads(self):
        """(dq, dk, dv); zeros where no piece reached."""
        out = []
        for g, shape, done in zip(self.sums, self.shapes, self.written):
            if g is None:
                out.append(torch.zeros(shape, dtype=self.sd, device=self.device))
                continue
            at = 0
            for lo, hi in done + [[shape[2], shape[2]]]:
                if lo > at:
                    g[:, :, at:lo].zero_()
                at = hi
            out.append(g)
        return tuple(out)


def _union(spans: list[list[int]], a: int, b: int) -> list[list[int]]:
    """Sorted disjoint spans with [a, b) added (touching spans join)."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans + [[a, b]]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _trim(g, n, dtype):
    """``g[..., :n]`` in ``dtype``: a view when nothing is cut and the dtype matches; else one
    contiguous copy (autograd would copy a strided slice anyway to give ``.grad`` its layout)."""
    if g.shape[-1] == n:
        return g if g.dtype == dtype else g.to(dtype)
    return g[..., :n].to(dtype, memory_format=torch.contiguous_format, copy=True)


def _single_key_rows(inp: _Inputs, pieces, cache, pb: Problem, q, memo: dict):
    """Rows that see exactly one key in the whole call: ``(is_single (B|1, Hq|1, Nq), (b, h, i),
    key_rows)``, row i of batch b and head h seeing only one key j, or None when there are none;
    ``key_rows`` the key-side rows ``(b, h // g, j)`` those terms add into, grouped for
    :func:`_add_rows` (:func:`_row_groups`). Kept in the plan's cache beside its tiles (as they are:
    not with a score that reads tensors), since a small backward (causal at 1k) spent ~0.4 ms
    finding causal's first row again on every call, and ~0.3 ms more grouping its key rows.

    For such a row P = 1 exactly, so dS = P (dP - D) is 0 in exact arithmetic (dlse_i with an lse
    gradient), but the fused backward takes D = dO.O in another summation order than dP = dO.v and
    leaves ~1e-7 in dq and dk (FlashAttention's zero_len_k cases; the plain formula gives exactly 0).
    The counts come from the tiles the pieces use anyway (memoised), not from the mask again."""
    B, Hq, Nq = q.shape[:3]
    score = pb.score if _bias_needed(pb) else None  # a bias may hide keys too
    at = ("single", tuple(pieces), B, Hq, inp.g, score, q.device)
    hit = cache.get(at)
    if hit is not None:
        return hit[0]
    count = torch.zeros(1, 1, Nq, dtype=torch.int64)
    key = torch.zeros(1, 1, Nq, dtype=torch.int64)
    for piece in pieces:
        _, _, _, causal, tile, folded, keys = _piece_args(inp, piece, pb, q, memo, cache)
        L, S = piece.q1 - piece.q0, keys.stop - keys.start
        if causal:      # top-left causal inside the piece: row i sees keys 0..i
            c = torch.clamp(torch.arange(1, L + 1), max=S).view(1, 1, L)
            j = torch.zeros(1, 1, L, dtype=torch.int64)
        elif tile.mask is None:
            c = torch.full((1, 1, L), S, dtype=torch.int64)
            j = torch.zeros(1, 1, L, dtype=torch.int64)
        else:
            c, j = _seen(tile, folded, inp.g, L, S, inp.k.shape[1])
        shape = torch.broadcast_shapes(count.shape, c.shape[:2] + (Nq,))
        count, key = count.expand(shape).clone(), key.expand(shape).clone()
        rows = slice(piece.q0, piece.q1)
        count[:, :, rows] += c
        key[:, :, rows] = torch.where(c == 1, j + keys.start, key[:, :, rows])
    single = count == 1
    found = None
    if bool(single.any()):
        b, h, i = torch.nonzero(single.expand(B, Hq, Nq), as_tuple=True)
        j = key.expand(B, Hq, Nq)[b, h, i]
        krows = (b, torch.div(h, inp.g, rounding_mode="floor"), j)
        found = single, (b, h, i), (krows, _row_groups(krows, (B, Hq // inp.g, inp.k.shape[2])))
    if score is None or not score.tensors():
        cache.put(at, (found,), 0 if found is None else single.numel() + 80 * found[1][0].numel())  # up to 10 int64 indices a row
    return found


def _hides_above_diagonal(tile: _Tile, L: int, S: int) -> bool:
    """Whether a masked tile hides every pair above its diagonal (key j > row i of the call's L rows
    and S keys), as a causal window's or document's does: the op's causal flag, beside the mask,
    then skips the blocks up there, for the same gradients bit for bit (bfloat16 1024 x 1024,
    window 256 + sinks at D 64: 13.2 ms against 17.8 with the mask alone). Once per tile (kept
    with it). A mask that broadcasts over rows or keys (a user's (L, 1) bias) answers False: it
    hides nothing by position."""
    m = tile.mask
    if m is None or tuple(m.shape[-2:]) != (L, S):
        return False
    hit = tile.later.get("above")
    if hit is None:
        above = torch.ones(L, S, dtype=torch.bool, device=m.device).triu_(1)
        hit = tile.later["above"] = bool(torch.isneginf(m[..., above]).all())
    return hit


def _seen(tile: _Tile, folded: bool, g: int, L: int, S: int, Hkv: int):
    """Per row of a masked tile: how many keys it sees and the first of them (local), counted from
    the call's own mask (a bias may hide keys too) once per tile: a cached tile keeps them. Heads
    ``(b|1, Hq|1, L)``: a folded tile's rows are (member, row), member m of kv head h being query
    head h g + m. (It took member 0's rows for every member where the tile had one kv head: a mask
    that differs between the heads of a group, under MQA or one broadcast over kv heads, gave a
    row's one key to the whole group, and dv, dk, dq silently wrong; found by fuzzing, 2026-12-05.)"""
    at = ("seen", folded, g, L, S, Hkv)
    hit = tile.later.get(at)
    if hit is not None:
        return hit
    vis = ~torch.isneginf(tile.mask.cpu())              # (b, h, L|1, S), or folded (b, h, g*L, S|1)
    if folded:  # _fold_mask gives every member its L rows
        b_, h_, c_ = vis.shape[0], vis.shape[1], vis.shape[-1]  # c_: S, or 1 for a row term
        vis = vis.reshape(b_, h_, g, L, c_).expand(b_, Hkv, g, L, c_).reshape(b_, Hkv * g, L, c_)
    vis = torch.broadcast_to(vis, vis.shape[:2] + (L, S))
    seen = vis.sum(-1), vis.to(torch.int8).argmax(-1).long()
    tile.later[at] = seen
    return seen


def _add_single_key_rows(single, q, k, dout, dlse, dq, dk, dv, scale: float) -> None:
    """The exact gradients of rows with one visible key j (P = 1): dv_j += dO_i, and with an lse
    gradient dS = dlse_i, so dq_i += scale dlse_i k_j and dk_j += scale dlse_i q_i.

    The gradients may be the op's own 16-bit tensors (a one-piece plan) or float32 ones: the rows'
    terms are summed in float64 and each touched gradient row is rounded once more, not once per term."""
    (b, h, i), (at_k, groups_k) = single[1], single[2]
    D, Dv = q.shape[-1], dout.shape[-1]
    # the terms are summed in float64 and each gradient row rounded once: a key that is the one key of
    # many rows (one key per document, a GQA group over a one-key cache) took their float32 terms one
    # by one, dv 3-4x the naive error (its sum is blocked)
    sd = torch.float64
    _add_rows(dv[..., :Dv], at_k, dout[b, h, i].to(sd), groups_k)
    if dlse is not None:
        w = (scale * dlse[b, h, i].to(sd)).unsqueeze(-1)
        _add_rows(dq[..., :D], (b, h, i), w * k[at_k].to(sd))  # each query row once: no groups
        _add_rows(dk[..., :D], at_k, w * q[b, h, i].to(sd), groups_k)


def _row_groups(idx, shape):
    """How :func:`_add_rows` sums terms for the rows ``idx`` = (b, h, n) of a gradient of ``shape``
    (B, H, N) that repeat: ``(rows, where, n_rows)``, one (b, h, n) per distinct row and each term's
    row among them; None when no row repeats (each term is its row's sum)."""
    b, h, n = idx
    flat = (b * shape[1] + h) * shape[2] + n
    rows, where = torch.unique(flat, return_inverse=True)
    if rows.numel() == flat.numel():
        return None
    first = torch.empty_like(rows).scatter_(0, where, torch.arange(flat.numel()))  # one (b, h, n) per row
    return (b[first], h[first], n[first]), where, rows.numel()


def _add_rows(g, idx, terms, groups=None) -> None:
    """``g[idx] += terms`` row by row, with repeated indices summed (``groups``: their
    :func:`_row_groups`, None when none repeats); in g's dtype when it is the terms', else the terms
    summed in theirs and each touched row of g rounded once."""
    if g.dtype == terms.dtype:
        g.index_put_(idx, terms, accumulate=True)
        return
    at, sums = idx, terms
    if groups is not None:
        at, where, n_rows = groups
        sums = terms.new_zeros((n_rows, terms.shape[-1])).index_add_(0, where, terms)
    g.index_put_(at, (g[at].to(terms.dtype) + sums).to(g.dtype))
