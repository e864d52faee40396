"""``python -m keyfold bench decode``: KV-cache decoding, paged, cascade and the window cache.

Every number is a ratio against a peer measured in the same run: the implementations run
alternately (interleaved), several repeats after a warm-up, and we take medians, because
this machine's 2 cores are shared. Sections (DESIGN.md section 7 targets):

1. decode step vs SDPA over the same contiguous cache, 4k / 32k / 128k tokens, fp32 (target
   <= 1.10x at 4k, <= 1.05x at 128k) with the achieved GB/s; a bf16 cache (fewer bytes);
   and an MQA cache (one key/value head), where split-KV gives the idle thread work;
2. paged vs contiguous decode (target <= 1.10x);
3. cascade: 16 requests sharing an 8k prefix vs attending to each request's full copy
   (target <= 0.3x);
4. the window cache streamed from 1k to 1M tokens: step time and memory stay flat (plot).

Results: ``benchmarks/results/decode.{md,json,png}`` (``--quick``: ``decode.quick.*``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..caches import KVCache, PagedKVCache, WindowCache, cascade, choose_splits, decode
from ..kernels import cpu, native
from ..masks import causal
from ..scores import alibi, alibi_slopes
from .harness import fit_exponent, interleaved, machine, results_dir, stream_bandwidth

B, H, D = 1, 8, 64  # the decode shape of DESIGN.md section 5


# ---------------------------------------------------------------------------- timing


def rss_bytes() -> int:
    """Resident memory of this process now (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _filled_cache(N, dtype, heads=H, batch=B) -> KVCache:
    cache = KVCache(batch, heads, D, N, dtype=dtype)
    block = 8192
    for t in range(0, N, block):
        n = min(block, N - t)
        cache.append(torch.randn(batch, heads, n, D, dtype=dtype), torch.randn(batch, heads, n, D, dtype=dtype))
    return cache


# ---------------------------------------------------------------------------- sections


def bench_decode(lengths, reps, bar) -> list[dict]:
    """keyfold decode vs SDPA over the very same cache views, per length and dtype."""
    rows = []
    cases = [(N, torch.float32, H) for N in lengths]
    # every cache dtype at the long lengths (the bandwidth goal is for >= 16k tokens)
    cases += [(N, dt, H) for dt in (torch.bfloat16, torch.float16) for N in lengths[1:]]
    cases += [(lengths[-1], torch.float32, 1)]
    for N, dtype, hkv in cases:
        cache = _filled_cache(N, dtype, heads=hkv)
        k, v = cache.k[:, :, :N], cache.v[:, :, :N]
        q = torch.randn(B, H, 1, D, dtype=dtype)
        # the same bytes in torch's own allocation (what a user's plain tensor cache is):
        # keyfold's caches live on huge pages where the OS allows (caches/_storage.py)
        k_plain, v_plain = k.clone(), v.clone()
        fns = {"keyfold": lambda: decode(q, cache),
               "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != H)}
        # SDPA over the torch-allocated copy is timed in a round of its own: run between the others it
        # slowed whatever came next (an MQA step after it took 3.8 ms, 2.4 ms after SDPA on the cache)
        plain = {"keyfold": fns["keyfold"],
                 "sdpa_plain": lambda: F.scaled_dot_product_attention(q, k_plain, v_plain, enable_gqa=hkv != H)}
        # split-KV: keyfold's own chunks in Python (merged states), or the native kernel's (it takes
        # the span whole and splits the keys among its threads itself); the other way timed beside it
        py_splits = choose_splits(N, B * hkv, torch.get_num_threads())
        in_kernel = py_splits > 1 and cpu.splits_itself(q, k, v)
        if hkv != H:
            fns["keyfold_other"] = lambda: decode(q, cache, splits=py_splits if in_kernel else 1)
        n_reps = max(3, reps * 4096 // N)
        before = native.calls
        decode(q, cache)
        path = "native" if native.calls > before else "op"  # which kernel keyfold's step ran on
        t = interleaved(fns, n_reps, warmup=2)
        tp = interleaved(plain, n_reps, warmup=1)
        gb = (k.nbytes + v.nbytes) / 1e9
        name = f"{'MQA ' if hkv != H else ''}{str(dtype).replace('torch.', '')}"
        row = dict(case=name, tokens=N, kv_heads=hkv, dtype=str(dtype), reps=n_reps,
                   keyfold_ms=t["keyfold"] * 1e3, sdpa_ms=t["sdpa"] * 1e3, ratio=t["keyfold"] / t["sdpa"],
                   ratio_of_min=t.best["keyfold"] / t.best["sdpa"],
                   keyfold_GBps=gb / t["keyfold"], sdpa_GBps=gb / t["sdpa"],
                   splits=f"{native._chunks(B * hkv, N, torch.get_num_threads(), dtype)} in the kernel" if in_kernel else py_splits,
                   kernel=path, sdpa_plain_ms=tp["sdpa_plain"] * 1e3, ratio_plain=tp["keyfold"] / tp["sdpa_plain"])
        if "keyfold_other" in t:
            row["other_ms"] = t["keyfold_other"] * 1e3
            row["other"] = f"split into {py_splits} attends" if in_kernel else "no split"
            row["gain"] = t["keyfold_other"] / t["keyfold"]
        rows.append(row)
        del cache, k, v, k_plain, v_plain
        bar.update(1)
    return rows


def bench_scored(lengths, reps, bar) -> list[dict]:
    """A decoding step with ALiBi (BLOOM's and MPT's bias) vs SDPA given that bias as its float
    attn_mask, over the same cache, float32 and bfloat16."""
    rows = []
    slopes = alibi_slopes(H)
    for dtype in (torch.float32, torch.bfloat16):
        for N in lengths:
            cache = _filled_cache(N, dtype)
            k, v = cache.k[:, :, :N], cache.v[:, :, :N]
            q = torch.randn(B, H, 1, D, dtype=dtype)
            bias = (-slopes.view(1, H, 1, 1) * torch.arange(N - 1, -1, -1).view(1, 1, 1, N)).to(dtype)
            score = alibi(slopes)
            t = interleaved({"keyfold": lambda: decode(q, cache, score=score),
                             "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)},
                            max(3, reps * 4096 // N), warmup=2)
            err = (decode(q, cache, score=score).double()
                   - F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
                   ).abs().max().item()
            rows.append(dict(case=f"ALiBi {str(dtype).replace('torch.', '')}", tokens=N, keyfold_ms=t["keyfold"] * 1e3,
                             sdpa_ms=t["sdpa"] * 1e3, ratio=t["keyfold"] / t["sdpa"],
                             ratio_of_min=t.best["keyfold"] / t.best["sdpa"], max_abs_diff_vs_float64=err))
            del cache, k, v
            bar.update(1)
    return rows


def bench_ragged(N, batch, reps, bar) -> dict:
    """A batch of sequences of different lengths (N/2 .. N): keyfold's one ragged call vs SDPA with a
    key-padding mask over the same cache, and keyfold one call per sequence (what a mask forces)."""
    lens = [N // 2 + (N // 2) * i // max(1, batch - 1) for i in range(batch)]
    cache = KVCache(batch, H, D, N)
    for t in range(0, N, 8192):
        n = min(8192, N - t)
        cache.append(torch.randn(batch, H, n, D), torch.randn(batch, H, n, D),
                     lengths=[max(0, min(n, L - t)) for L in lens])
    q = torch.randn(batch, H, 1, D)
    k, v = cache.k[:, :, :N], cache.v[:, :, :N]
    pad = (torch.arange(N).view(1, 1, 1, N) < torch.tensor(lens).view(batch, 1, 1, 1))  # (b, 1, 1, N)
    t = interleaved({"keyfold": lambda: decode(q, cache),
                     "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=pad),
                     # causal() reads positions, which differ per sequence: one call each
                     "per_sequence": lambda: decode(q, cache, mask=causal())}, max(3, reps * 4096 // N), warmup=2)
    gb = sum(lens) * H * D * 2 * 4 / 1e9
    err = (decode(q, cache) - F.scaled_dot_product_attention(q, k, v, attn_mask=pad)).abs().max().item()
    bar.update(1)
    return dict(case=f"ragged batch of {batch}", tokens=N, lengths=lens, keyfold_ms=t["keyfold"] * 1e3,
                sdpa_ms=t["sdpa"] * 1e3, per_sequence_ms=t["per_sequence"] * 1e3, ratio=t["keyfold"] / t["sdpa"],
                ratio_of_min=t.best["keyfold"] / t.best["sdpa"], keyfold_GBps=gb / t["keyfold"],
                sdpa_GBps=gb / t["sdpa"], max_abs_diff=err)


def bench_paged(N, seqs, reps, bar) -> list[dict]:
    """``seqs`` sequences grown in lock step (interleaved page allocation) vs a contiguous batch.

    Two comparisons per page size: one of the sequences alone (the cost of paging: runs of
    pages vs one block) and all of them (paged decodes each sequence in its own call, the
    contiguous cache all in one batched call).
    """
    rows = []
    cont = _filled_cache(N, torch.float32, batch=seqs)
    q = torch.randn(seqs, H, 1, D)
    for page_size in (None, 256, 16):
        pool = PagedKVCache(seqs * (-(-N // (page_size or 1024))) + 1, page_size, H, D)
        ids = [pool.new_sequence() for _ in range(seqs)]
        step = 2048
        for t in range(0, N, step):
            n = min(step, N - t)
            pool.append(cont.k[:, :, t:t + n], cont.v[:, :, t:t + n], ids)
        spans = [len(g.spans) for g in pool.pieces(ids)]
        n_reps = max(3, reps * 4096 // N)
        one = interleaved({"paged": lambda: decode(q[:1], pool, seq_ids=ids[:1]),
                           "contiguous": lambda: decode(q[:1], cont, seq_ids=[0])}, n_reps, warmup=2)
        every = interleaved({"paged": lambda: decode(q, pool, seq_ids=ids), "contiguous": lambda: decode(q, cont)},
                            n_reps, warmup=2)
        st = pool.stats()
        for label, t, n_seq, n_spans in (("one sequence", one, 1, spans[0]), (f"{seqs} sequences", every, seqs,
                                                                               sum(spans) / seqs)):
            rows.append(dict(page_size=pool.page_size, decoded=label, sequences=n_seq, tokens=N,
                             spans_per_seq=n_spans, paged_ms=t["paged"] * 1e3, contiguous_ms=t["contiguous"] * 1e3,
                             ratio=t["paged"] / t["contiguous"], ratio_of_min=t.best["paged"] / t.best["contiguous"],
                             wasted_tokens=st.wasted, pages_used=st.used))
        del pool
        bar.update(1)
    return rows


def bench_cascade(R, P, S, reps, bar) -> dict:
    """R requests sharing a P-token prefix, S own tokens each, one new query token each."""
    pk, pv = torch.randn(1, H, P, D), torch.randn(1, H, P, D)
    sk, sv = torch.randn(R, H, S, D), torch.randn(R, H, S, D)
    full_k = torch.cat([pk.expand(R, -1, -1, -1), sk], 2).contiguous()  # (R, H, P + S, D): each its copy
    full_v = torch.cat([pv.expand(R, -1, -1, -1), sv], 2).contiguous()
    full = KVCache(R, H, D, P + S)
    full.append(full_k, full_v)
    q = torch.randn(R, H, 1, D)
    t = interleaved({"cascade": lambda: cascade(q, pk, pv, sk, sv),
                     "sdpa_copies": lambda: F.scaled_dot_product_attention(q, full_k, full_v),
                     "keyfold_copies": lambda: decode(q, full)}, max(3, reps // 4), warmup=2)
    err = (cascade(q, pk, pv, sk, sv) - F.scaled_dot_product_attention(q, full_k, full_v)).abs().max().item()
    bar.update(1)
    return dict(requests=R, prefix=P, suffix=S, cascade_ms=t["cascade"] * 1e3, sdpa_copies_ms=t["sdpa_copies"] * 1e3,
                keyfold_copies_ms=t["keyfold_copies"] * 1e3, ratio=t["cascade"] / t["sdpa_copies"],
                ratio_of_min=t.best["cascade"] / t.best["sdpa_copies"],
                max_abs_diff=err)


def bench_window(W, S, max_tokens, steps, bar) -> list[dict]:
    """Stream tokens into a WindowCache; at checkpoints time single-token steps (append + decode).

    One thread: a step is small, and with one thread its CPU time is the work done, free of
    waiting for a core or for a second thread (the medians of wall time on a loaded machine
    mostly measure the scheduler).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _stream(W, S, max_tokens, steps, bar)
    finally:
        torch.set_num_threads(threads)


def _stream(W, S, max_tokens, steps, bar) -> list[dict]:
    cache = WindowCache(window=W, sinks=S, heads=H, head_dim=D)
    block_k, block_v = torch.randn(1, H, 8192, D), torch.randn(1, H, 8192, D)  # reused: content is irrelevant
    k1, v1, q = torch.randn(1, H, 1, D), torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    full_limit = min(max_tokens, 1 << 17)  # the growing-cache contrast, up to 128k tokens
    full = KVCache(1, H, D, full_limit)
    full.k.zero_(), full.v.zero_()  # commit its memory now (caches commit as they fill), so the RSS
    #                                 column shows what the window cache and the stream add: nothing
    checkpoints = [1 << p for p in range(10, 21) if (1 << p) <= max_tokens]
    rows = []
    for cp in checkpoints:
        with_full = cp <= full_limit
        while cache.length < cp - steps:  # fast-forward the stream in blocks
            n = min(8192, cp - steps - cache.length)
            cache.append(block_k[:, :, :n], block_v[:, :, :n])
            if with_full:
                full.append(block_k[:, :, :n], block_v[:, :, :n])
        times, ftimes, cpu = [], [], []
        for _ in range(steps):  # the window cache alone, so no other cache evicts its bytes
            t0, c0 = time.perf_counter(), time.process_time()
            cache.append(k1, v1)
            decode(q, cache)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        fcpu = []
        for _ in range(steps if with_full else 0):
            t0, c0 = time.perf_counter(), time.process_time()
            full.append(k1, v1)
            decode(q, full)
            ftimes.append(time.perf_counter() - t0)
            fcpu.append(time.process_time() - c0)
        rows.append(dict(tokens=cache.length, step_ms=statistics.median(times) * 1e3,
                         step_min_ms=min(times) * 1e3, step_cpu_ms=statistics.median(cpu) * 1e3,
                         cache_bytes=cache.nbytes, rss_bytes=rss_bytes(),
                         full_cache_step_ms=statistics.median(ftimes) * 1e3 if ftimes else None,
                         full_cache_step_min_ms=min(ftimes) * 1e3 if ftimes else None,
                         full_cache_step_cpu_ms=statistics.median(fcpu) * 1e3 if fcpu else None))
        bar.update(1)
    return rows


# ---------------------------------------------------------------------------- report


def _plot(res, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(17, 5))
    dec = [r for r in res["decode"] if r["case"] == "float32"]
    ax[0].plot([r["tokens"] for r in dec], [r["ratio"] for r in dec], "o-", label="keyfold / SDPA, fp32")
    for r in res["decode"]:
        if r["case"] != "float32":
            ax[0].plot([r["tokens"]], [r["ratio"]], "s", label=f"keyfold / SDPA, {r['case']}")
    ax[0].axhline(1.0, color="gray", lw=0.8)
    ax[0].set(xscale="log", xlabel="cache tokens", ylabel="time ratio (lower is better)",
              title="decode step vs SDPA, same cache")
    ax[0].legend(fontsize=8)

    labels = [f"paged {r['page_size']}\n{r['decoded']}" for r in res["paged"]] + ["cascade"]
    ratios = [r["ratio"] for r in res["paged"]] + [res["cascade"]["ratio"]]
    ax[1].tick_params(axis="x", labelsize=7, labelrotation=35)
    ax[1].bar(labels, ratios, color=["C0"] * len(res["paged"]) + ["C2"])
    ax[1].axhline(1.0, color="gray", lw=0.8)
    ax[1].set(ylabel="time ratio vs peer", title="paged / contiguous; cascade / full copies (SDPA)")
    for i, r in enumerate(ratios):
        ax[1].text(i, r, f"{r:.2f}x", ha="center", va="bottom", fontsize=8)

    win = res["window"]
    xs = [r["tokens"] for r in win]
    ax[2].plot(xs, [r["step_cpu_ms"] for r in win], "o-", label="window cache step, CPU ms (median)")
    ax[2].plot(xs, [r["step_min_ms"] for r in win], "o:", color="C0", alpha=0.6, label="window cache step, fastest wall ms")
    fx = [(r["tokens"], r["full_cache_step_cpu_ms"]) for r in win if r["full_cache_step_cpu_ms"] is not None]
    ax[2].plot([a for a, _ in fx], [b for _, b in fx], "x--", label="full KV cache step, CPU ms (median)")
    ax2 = ax[2].twinx()
    ax2.plot(xs, [r["cache_bytes"] / 2**20 for r in win], "g.-", label="window cache MiB")
    ax2.plot(xs, [r["rss_bytes"] / 2**20 for r in win], "r:", label="process RSS MiB")
    ax2.set_ylabel("MiB")
    ax2.set_ylim(bottom=0)
    ax[2].set(xscale="log", yscale="log", xlabel="tokens streamed", ylabel="ms per step (log)",
              title=f"WindowCache(W={res['config']['window']}, S={res['config']['sinks']}) streamed")
    h1, l1 = ax[2].get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax[2].legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _roof(gbps: float, cfg: dict) -> str:
    """A decode rate as a fraction of the stream bandwidth measured in the same run."""
    return f"{gbps / cfg['stream_GBps']:.0%}" if cfg.get("stream_GBps") else "n/a"


def _markdown(res, cmd: str) -> str:
    c = res["config"]
    out = [f"# Decode benchmark ({'quick' if c['quick'] else 'full'})", "",
           f"`{cmd}` on {c['machine']}, "
           f"load average before / after the run {c['load_before']} / {c.get('load_after')}. Medians of "
           f"interleaved runs (minima beside them: on a shared, loaded machine they show the cost without "
           f"waiting for a core); every ratio is against a peer measured in the same run. B={B}, H={H}, D={D} unless stated.", "",
           "## 1. Decode step vs SDPA over the same cache", "",
           "Targets (DESIGN.md §7): <= 1.10x at 4k, <= 1.05x at 128k at the same cache dtype.", "",
           (f"Memory bandwidth measured in this run (a {c['stream_copy_bytes'] >> 20} MiB stream copy): "
            f"{c['stream_GBps']:.1f} GB/s; `of bandwidth` = keyfold's GB/s over it." if c.get("stream_GBps") else ""),
           "",
           "| cache | tokens | keyfold ms | SDPA ms | ratio (medians) | ratio (minima) | keyfold GB/s | of bandwidth "
           "| SDPA GB/s | splits | kernel | SDPA on a torch-allocated copy ms | keyfold / that |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["decode"]:
        extra = f" ({r['other']}: {r['other_ms']:.2f} ms, {r['gain']:.2f}x this row's time)" if "other_ms" in r else ""
        plain = (f"{r['sdpa_plain_ms']:.3f} | {r['ratio_plain']:.2f}x" if "sdpa_plain_ms" in r else "— | —")
        out.append(f"| {r['case']}{extra} | {r['tokens']} | {r['keyfold_ms']:.3f} | {r['sdpa_ms']:.3f} | "
                   f"**{r['ratio']:.2f}x** | {r['ratio_of_min']:.2f}x | {r['keyfold_GBps']:.1f} | {_roof(r['keyfold_GBps'], c)} | "
                   f"{r['sdpa_GBps']:.1f} | {r['splits']} | {r.get('kernel', '—')} | {plain} |")
    rg = res["ragged"]
    out.append(f"| {rg['case']} ({rg['lengths'][0]}..{rg['lengths'][-1]} tokens; SDPA with a key-padding mask; "
               f"one call per sequence: {rg['per_sequence_ms']:.2f} ms; max abs diff {rg['max_abs_diff']:.1e}) | {rg['tokens']} | {rg['keyfold_ms']:.3f} | "
               f"{rg['sdpa_ms']:.3f} | **{rg['ratio']:.2f}x** | {rg['ratio_of_min']:.2f}x | {rg['keyfold_GBps']:.1f} | "
               f"{_roof(rg['keyfold_GBps'], c)} | {rg['sdpa_GBps']:.1f} | 1 | — | — | — |")
    out += ["", "SDPA reads the very cache keyfold reads (the ratio the targets are about). The last two "
                "columns time SDPA on a copy of the same bytes in torch's own allocation, which is what a "
                "plain tensor cache gets: keyfold's caches are allocated on transparent huge pages where "
                "the OS allows (`keyfold/caches/_storage.py`), and decode is bound by memory and TLB, so "
                "that difference is the allocation, not the kernel (timed in a round of their own, keyfold "
                "alternating with SDPA on the copy: between the others it slowed the call after it). `kernel`: where keyfold's step ran, "
                "`native` (keyfold's own decode kernel, `keyfold/kernels/decode.c`, or `decode_avx2.c` on CPUs without AVX-512) or `op` (PyTorch's "
                f"fused CPU op); the native kernel here: {c.get('native', 'n/a')}."]
    fp32 = {r["tokens"]: r for r in res["decode"] if r["case"] == "float32"}
    for half in ("bfloat16", "float16"):
        r16 = [r for r in res["decode"] if r["case"] == half and r["tokens"] in fp32]
        if r16:
            r = r16[-1]
            out += ["", f"A {half} cache reads half the bytes: keyfold on it takes "
                        f"{r['keyfold_ms'] / fp32[r['tokens']]['sdpa_ms']:.2f}x the time of SDPA on the float32 cache "
                        f"at {r['tokens']} tokens, and {r['ratio']:.2f}x SDPA's on the same {half} cache."]
    if res.get("scored"):
        out += ["", "### A score modifier: ALiBi", "",
                "keyfold's `decode(q, cache, score=alibi(slopes))` against SDPA given the same bias as a float "
                "`attn_mask` (what a BLOOM or MPT decoding step passes), over the same cache.", "",
                "| cache | tokens | keyfold ms | SDPA + bias ms | ratio (medians) | ratio (minima) | max abs diff vs float64 |",
                "|---|---|---|---|---|---|---|"]
        for r in res["scored"]:
            out.append(f"| {r['case']} | {r['tokens']} | {r['keyfold_ms']:.3f} | {r['sdpa_ms']:.3f} | "
                       f"**{r['ratio']:.2f}x** | {r['ratio_of_min']:.2f}x | {r['max_abs_diff_vs_float64']:.1e} |")
    out += ["", "## 2. Paged vs contiguous (target <= 1.10x)", "",
            f"{res['paged'][-1]['sequences']} sequences of {res['paged'][0]['tokens']} tokens grown in lock step "
            f"(their pages interleave); decoded: one of them, or all (paged: one call per sequence, "
            f"contiguous: one batched call).", "",
            "| page size | decoded | spans per sequence | paged ms | contiguous ms | ratio (medians) | ratio (minima) | wasted slots |",
            "|---|---|---|---|---|---|---|---|"]
    for r in res["paged"]:
        out.append(f"| {r['page_size']} | {r['decoded']} | {r['spans_per_seq']:.1f} | "
                   f"{r['paged_ms']:.2f} | {r['contiguous_ms']:.2f} | **{r['ratio']:.2f}x** | {r['ratio_of_min']:.2f}x | "
                   f"{r['wasted_tokens']} |")
    cs = res["cascade"]
    out += ["", "## 3. Cascade (target <= 0.3x)", "",
            f"{cs['requests']} requests share a {cs['prefix']}-token prefix and own {cs['suffix']} tokens each; "
            f"one new query token per request.", "",
            "| cascade ms | SDPA over full copies ms | keyfold over full copies ms | ratio cascade / SDPA (medians) | (minima) | max abs diff |",
            "|---|---|---|---|---|---|",
            f"| {cs['cascade_ms']:.2f} | {cs['sdpa_copies_ms']:.2f} | {cs['keyfold_copies_ms']:.2f} | "
            f"**{cs['ratio']:.2f}x** | {cs['ratio_of_min']:.2f}x | {cs['max_abs_diff']:.1e} |"]
    win = res["window"]
    out += ["", f"## 4. Window cache streamed (W={c['window']}, S={c['sinks']})", "",
            "| tokens streamed | step ms (append + decode), median | minimum | CPU ms, median "
            "| cache bytes | process RSS MiB | full KV cache step ms / CPU ms, medians |",
            "|---|---|---|---|---|---|---|"]
    for r in win:
        f = "—" if r["full_cache_step_ms"] is None else f"{r['full_cache_step_ms']:.3f} / {r['full_cache_step_cpu_ms']:.3f}"
        out.append(f"| {r['tokens']} | {r['step_ms']:.3f} | {r['step_min_ms']:.3f} | {r['step_cpu_ms']:.3f} | "
                   f"{r['cache_bytes']} | {r['rss_bytes'] / 2**20:.0f} | {f} |")
    full = [r for r in win if r["tokens"] >= c["window"] + c["sinks"]] or win
    cpu, best = [r["step_cpu_ms"] for r in full], [r["step_min_ms"] for r in full]
    grow = [r for r in win if r["full_cache_step_ms"] is not None]
    # the trend, robust to a noisy step here and there: the fitted exponent of step time vs tokens
    trend = (fit_exponent([r["tokens"] for r in full], best) if len(full) > 1 else None)
    trend_full = (fit_exponent([r["tokens"] for r in grow], [r["full_cache_step_min_ms"] for r in grow])
                  if len(grow) > 1 else None)
    out += ["", "Steps run on one thread, so CPU time is the work a step does (wall-time medians on a loaded "
                "machine mostly measure waiting for a core).",
            "", f"Once the window is full (from {c['window'] + c['sinks']} tokens on) the step's CPU time varies "
                f"{max(cpu) / min(cpu):.2f}x and its fastest wall time {max(best) / min(best):.2f}x over the "
                f"stream"
                + (f" (fitted exponent of the fastest step time vs tokens: {trend:.2f}; a full KV cache's: "
                   f"{trend_full:.2f})" if trend is not None and trend_full is not None else "")
                + "; cache bytes "
                f"{'constant' if len({r['cache_bytes'] for r in win}) == 1 else 'NOT constant'}; process RSS "
                f"{min(r['rss_bytes'] for r in win) / 2**20:.0f} to {max(r['rss_bytes'] for r in win) / 2**20:.0f} MiB."
            + (f" A full KV cache's step (fastest) grows "
               f"{grow[-1]['full_cache_step_min_ms'] / grow[0]['full_cache_step_min_ms']:.1f}x "
               f"from {grow[0]['tokens']} to {grow[-1]['tokens']} tokens." if len(grow) > 1 else ""), "",
            "![decode benchmark](" + res["config"]["png"] + ")", ""]
    return "\n".join(out)


def run(cfg: dict, lengths, reps: int, paged_tokens: int, cascade_shape, window_steps: int, progress=True) -> dict:
    """All four sections; ``cfg`` is stored with the results (window, sinks, stream_tokens used)."""
    n_win = len([p_ for p_ in range(10, 21) if (1 << p_) <= cfg["stream_tokens"]])
    with tqdm(total=len(lengths) + 2 + 1 + 3 + 1 + n_win + 2 * len(lengths[:2]), desc="bench decode",
              disable=not progress) as bar:
        res = dict(config=cfg)
        cfg["stream_copy_bytes"] = 1 << 28
        cfg["stream_GBps"] = stream_bandwidth(cfg["stream_copy_bytes"])  # the roof every decode row is held to
        res["decode"] = bench_decode(lengths, reps, bar)
        res["scored"] = bench_scored(lengths[:2], reps, bar)
        res["ragged"] = bench_ragged(paged_tokens, 8, reps, bar)
        res["paged"] = bench_paged(paged_tokens, 4, reps, bar)
        res["cascade"] = bench_cascade(*cascade_shape, reps, bar)
        res["window"] = bench_window(cfg["window"], cfg["sinks"], cfg["stream_tokens"], window_steps, bar)
    return res


def write(res: dict, out: Path, stem: str, cmd: str) -> str:
    """decode.{md,json,png} under ``out``; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    res["config"]["png"] = f"{stem}.png"
    res["config"]["load_after"] = round(os.getloadavg()[0], 2)
    _plot(res, out / f"{stem}.png")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    md = _markdown(res, cmd)
    (out / f"{stem}.md").write_text(md)
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m keyfold bench decode", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small preset (< 3 minutes)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default: the repository's benchmarks/results)")
    p.add_argument("--reps", type=int, default=None, help="repeats at 4k tokens (fewer for longer caches)")
    p.add_argument("--name", default=None, help="results file stem (default: decode, decode.quick)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); results then go to decode.<n>threads.*")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    quick = args.quick
    reps = args.reps or (40 if quick else 120)
    lengths = [4096, 32768, 131072]
    cfg = dict(quick=quick, machine=machine(), torch=torch.__version__, native=native.why(),
               threads=torch.get_num_threads(), load_before=round(os.getloadavg()[0], 2),
               window=4096, sinks=4, stream_tokens=(1 << 16) if quick else (1 << 20))
    torch.manual_seed(0)
    res = run(cfg, lengths, reps, 8192 if quick else 32768, (16, 8192, 128), 10 if quick else 30)
    cmd = "python -m keyfold bench decode" + (" --quick" if quick else "")
    stem = "decode.quick" if quick else "decode"
    if args.threads is not None:
        cmd += f" --threads {args.threads}"
        stem += f".{args.threads}threads"
    if args.name:
        cmd += f" --name {args.name}"
        stem = args.name
    print(write(res, results_dir(args.out), stem, cmd))
    return 0
