"""``python -m keyfold tour`` (``make demo``): every variant through one engine.

Each variant is a mask and/or a score modifier on the same ``keyfold.attention`` call. For
each we print the fraction of the dense work the planner keeps, the error against the
float64 reference (on a block of rows at each end of the sequence) next to the bound of the
correctness rule, and the time against SDPA given an equivalent dense mask.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import keyfold as kf
from keyfold.kernels._common import Problem
from keyfold.kernels.reference import attend_naive
from keyfold.masks import grid_positions
from keyfold.scores import aligned


def _custom(b, h, q, k):
    """A user's own Flex-style mask: causal, plus every 64th key as a 'landmark'."""
    return (k <= q) & ((q - k < 128) | (k % 64 == 0))


def variants(N: int, H: int):
    """(name, kwargs for attention, kv heads) for every variant of the tour."""
    layout = torch.rand(N // 128, N // 128, generator=torch.Generator().manual_seed(0)) < 0.25
    layout |= torch.eye(N // 128, dtype=torch.bool)
    docs = torch.arange(N) * 8 // N
    return [
        ("dense", {}, H),
        ("causal", dict(mask=kf.causal()), H),
        ("sliding window 256", dict(mask=kf.causal() & kf.window(256)), H),
        ("window 256 + 4 sinks", dict(mask=kf.causal() & (kf.window(256) | kf.sinks(4))), H),
        ("prefix-LM (N/4)", dict(mask=kf.prefix(N // 4)), H),
        ("8 packed documents", dict(mask=kf.documents(docs) & kf.causal()), H),
        ("block-sparse 25% (128)", dict(mask=kf.block_sparse(layout, 128)), H),
        ("dilated 4, causal", dict(mask=kf.dilated(4) & kf.causal()), H),
        ("bidirectional window ±128", dict(mask=kf.window(128, 128)), H),
        ("GQA 8q/2kv causal", dict(mask=kf.causal()), 2),
        ("ALiBi + causal", dict(mask=kf.causal(), score=kf.alibi(kf.alibi_slopes(H))), H),
        ("softcap 20 + causal", dict(mask=kf.causal(), score=kf.softcap(20.0)), H),
        ("custom mask callable", dict(mask=_custom), H),
    ]


def _median(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _sdpa_equivalent(q, k, v, kw):
    """SDPA given the same variant as a dense mask (N x N, as SDPA needs) — the peer."""
    N = q.shape[2]
    mask, score = kf.as_mask(kw.get("mask")), kf.as_score(kw.get("score"))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if score is not None and not score.additive:
        return None  # SDPA cannot apply a softcap
    attn = None if mask is None else mask.to_dense(N, N)
    if score is not None:
        b, h, qp, kp = grid_positions(1, q.shape[1], 0, N, 0, N, None)
        attn = torch.where(attn, score.bias(b, h, qp, kp), float("-inf"))
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn)


def _check_rows(q, k, v, kw, out, rows: slice):
    """keyfold's error on a block of rows vs float64, and the rule's bound 2*naive + 1e-6."""
    qs = q[:, :, rows]
    q_offset = rows.start
    ref = kf.attention(qs.double(), k.double(), v.double(), q_offset=q_offset,
                       backend=kf.Backend.REFERENCE, **kw)
    pb = Problem(kf.as_mask(kw.get("mask")), aligned(kf.as_score(kw.get("score")), kf.as_mask(kw.get("mask")), q.shape[0]),
                 q.shape[-1] ** -0.5, q_offset, 0)
    naive = attend_naive(qs, k, v, pb)
    err = float((out[:, :, rows].double() - ref).abs().max())
    bound = 2 * float((naive.double() - ref).abs().max()) + 1e-6
    return err, bound


def _decode_rows(H: int, D: int, tokens: int, repeats: int):
    """One decoding step (one new query token) over a cache of ``tokens`` keys in each cache dtype:
    keyfold's ``decode`` vs SDPA on the same cache, its error against float64 by the rule, and the
    kernel it ran on (PyTorch's fused op, or keyfold's native decode kernel)."""
    from keyfold.bench.harness import interleaved
    from keyfold.caches import KVCache, decode
    from keyfold.kernels import native

    g = torch.Generator().manual_seed(1)
    lines, failures = [], 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cache = KVCache(1, H, D, tokens, dtype=dtype)
        cache.append(torch.randn(1, H, tokens, D, generator=g).to(dtype), torch.randn(1, H, tokens, D, generator=g).to(dtype))
        k, v = cache.k[:, :, :tokens], cache.v[:, :, :tokens]
        q = torch.randn(1, H, 1, D, generator=g).to(dtype)
        before = native.calls
        out = decode(q, cache)
        kernel = "native" if native.calls > before else "op"
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        naive = attend_naive(q, k, v, Problem(None, None, D ** -0.5, tokens - 1, 0))
        err = float((out.double() - ref).abs().max())
        bound = 2 * float((naive.double() - ref).abs().max()) + 1e-6
        ok = err <= bound and not bool(torch.isnan(out).any())
        failures += not ok
        # alternately, medians (a decoding step is short: whichever ran second would find the cache warm)
        t = interleaved({"kf": lambda: decode(q, cache), "sdpa": lambda: F.scaled_dot_product_attention(q, k, v)},
                        repeats, warmup=2)
        t_kf, t_sdpa = t["kf"], t["sdpa"]
        name = f"decode, {str(dtype).replace('torch.', '')} cache"
        lines.append(f"{name:<28}{kernel:>7}{err:>11.2e}{bound:>11.2e}{'ok' if ok else 'FAIL':>4}"
                     f"{t_kf * 1e3:>12.2f}{t_sdpa * 1e3:>14.2f}{t_kf / t_sdpa:8.2f}")
    return lines, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m keyfold tour", description=__doc__)
    ap.add_argument("-N", type=int, default=4096)
    ap.add_argument("-H", type=int, default=8)
    ap.add_argument("-D", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--decode-tokens", type=int, default=32768,
                    help="cache length of the decoding rows (0 leaves them out)")
    args = ap.parse_args(argv)
    N, H, D = args.N, args.H, args.D
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, N, D, generator=g).to(dtype)
    rows_check = [slice(0, 64), slice(N - 64, N)]

    print(f"keyfold tour: B=1, H={H}, N={N}, D={D}, {args.dtype}, {torch.get_num_threads()} threads\n")
    header = f"{'variant':<28}{'work':>7}{'max err':>11}{'bound':>11}{'':>4}{'keyfold ms':>12}{'SDPA+mask ms':>14}{'ratio':>8}"
    lines = [header, "-" * len(header)]
    failures = 0
    for name, kw, hkv in tqdm(variants(N, H), desc="tour", unit="variant", leave=False):
        k = torch.randn(1, hkv, N, D, generator=g).to(dtype)
        v = torch.randn(1, hkv, N, D, generator=g).to(dtype)
        out = kf.attention(q, k, v, **kw)
        checks = [_check_rows(q, k, v, kw, out, r) for r in rows_check]
        err, bound = max(c[0] for c in checks), max(c[1] for c in checks)
        ok = err <= bound and not bool(torch.isnan(out).any())
        failures += not ok
        plan = kf.planner._plan(kw.get("mask"), N, N, H=H, max_span=kf.engine.TILE_SPAN if "score" in kw else None)
        t_kf = _median(lambda: kf.attention(q, k, v, **kw), args.repeats)
        sdpa = _sdpa_equivalent(q, k, v, kw)
        t_sdpa = _median(sdpa, args.repeats) if sdpa is not None else None
        ratio = f"{t_kf / t_sdpa:8.2f}" if t_sdpa else f"{'n/a':>8}"
        sd = f"{t_sdpa * 1e3:14.1f}" if t_sdpa else f"{'n/a':>14}"
        lines.append(f"{name:<28}{plan.density:>7.1%}{err:>11.2e}{bound:>11.2e}{'ok' if ok else 'FAIL':>4}"
                     f"{t_kf * 1e3:>12.1f}{sd}{ratio}")
    print("\n".join(lines))
    print("\nwork: fraction of the dense N×N work the plan computes. err: max |keyfold - float64| on 128 rows;"
          "\nbound: 2 × the plain same-dtype error + 1e-6 (DESIGN.md §6). ratio: keyfold / SDPA with a dense mask.")
    if args.decode_tokens > 0:
        rows, bad = _decode_rows(H, D, args.decode_tokens, max(20, args.repeats))
        failures += bad
        head = f"{'decoding, ' + str(args.decode_tokens) + ' cached tokens':<28}{'kernel':>7}{'max err':>11}{'bound':>11}{'':>4}" \
               f"{'keyfold ms':>12}{'SDPA ms':>14}{'ratio':>8}"
        print("\n" + "\n".join([head, "-" * len(head)] + rows))
        print("\nOne new token over a KVCache in each cache dtype; SDPA reads the same cache. kernel: where keyfold's"
              "\nstep ran, PyTorch's fused op or keyfold's native decode kernel (keyfold/kernels/decode.c;"
              "\ndecode_avx2.c on CPUs without AVX-512).")
    return 1 if failures else 0


def plan_main(argv=None) -> int:
    """``python -m keyfold plan``: draw the block plan of a preset mask."""
    ap = argparse.ArgumentParser(prog="python -m keyfold plan")
    ap.add_argument("-N", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--sinks", type=int, default=4)
    args = ap.parse_args(argv)
    mask = kf.causal() & (kf.window(args.window) | kf.sinks(args.sinks))
    print(repr(mask))
    print(kf.plan(mask, args.N, args.N).to_string(max_blocks=48))
    return 0
