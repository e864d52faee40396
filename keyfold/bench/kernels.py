"""``python -m keyfold bench kernels``: keyfold vs SDPA and compiled FlexAttention on this CPU.

For every case the implementations run alternately in one process, several repeats after a
warm-up, and we report the median time, the ratio keyfold/peer, GFLOP/s counted on the work
the mask actually needs (4·D FLOPs per visible pair forward, 2.5x that for backward), and
FlexAttention's compile time in its own column. Peak memory is measured separately, one
case per fresh subprocess, from its memory high-water mark against the resident memory just
before the call.
Results go to ``benchmarks/results/kernels.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import keyfold as kf

from .harness import interleaved, machine, matmul_fns, matmul_rate, results_dir



# ------------------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Variant:
    """One attention variant, in keyfold's terms and in its peers' terms."""

    name: str
    sdpa: str            # "dense" | "causal" | "mask" (dense bool mask) | "none" (SDPA can't)
    differentiable: bool  # fwd+bwd is benchmarked (SDPA can differentiate it)


VARIANTS = [
    Variant("dense", "dense", True),
    Variant("causal", "causal", True),
    Variant("window256", "mask", True),
    Variant("window1024", "mask", True),
    Variant("window256+sinks4", "mask", True),
    Variant("prefix-lm", "mask", True),
    Variant("documents8", "mask", True),
    Variant("alibi+causal", "mask", True),
    Variant("softcap", "none", False),
    Variant("custom-callable", "mask", True),
]
BY_NAME = {v.name: v for v in VARIANTS}


def _sliding_callable(b, h, q, k):  # a user's own mask, written Flex-style
    return (q >= k) & (q - k <= 256)


def settings(name: str, N: int, H: int):
    """keyfold mask/score and the Flex mask_mod/score_mod for a variant (absolute positions)."""
    docs = torch.arange(N) * 8 // N
    slopes = kf.alibi_slopes(H)
    if name == "dense":
        return None, None, None, None
    if name == "causal":
        return kf.causal(), None, lambda b, h, q, k: q >= k, None
    if name.startswith("window") and "sinks" not in name:
        w = int(name[len("window"):])
        return kf.causal() & kf.window(w), None, lambda b, h, q, k: (q >= k) & (q - k <= w), None
    if name == "window256+sinks4":
        return (kf.causal() & (kf.window(256) | kf.sinks(4)), None,
                lambda b, h, q, k: (q >= k) & ((q - k <= 256) | (k < 4)), None)
    if name == "prefix-lm":
        p = N // 4
        return kf.prefix(p), None, lambda b, h, q, k: (k < p) | (q >= k), None
    if name == "documents8":
        return (kf.documents(docs) & kf.causal(), None,
                lambda b, h, q, k: (docs[q] == docs[k]) & (q >= k), None)
    if name == "alibi+causal":
        return (kf.causal(), kf.alibi(slopes), lambda b, h, q, k: q >= k,
                lambda s, b, h, q, k: s - slopes[h] * (q - k).abs())
    if name == "softcap":
        return kf.causal(), kf.softcap(20.0), lambda b, h, q, k: q >= k, lambda s, b, h, q, k: 20.0 * torch.tanh(s / 20.0)
    if name == "custom-callable":
        return _sliding_callable, None, _sliding_callable, None
    raise KeyError(name)


@dataclass
class Case:
    variant: str
    N: int
    D: int
    dtype: str
    mode: str  # "fwd" | "fwd+bwd"
    B: int = 1
    H: int = 8


@dataclass
class Result:
    case: Case
    density: float
    gflop: float
    times: dict = field(default_factory=dict)      # impl -> median seconds (None: n/a)
    compile_s: float | None = None                 # FlexAttention's first call
    plan_s: float | None = None                    # keyfold plan build (first call), custom mask
    plan_reused: bool | None = None
    block_mask_s: float | None = None              # Flex's create_block_mask, same callable
    errors: dict = field(default_factory=dict)     # impl -> why it did not run
    best_times: dict = field(default_factory=dict)  # impl -> fastest sample (seconds) in the same rounds
    matmul_times: dict = field(default_factory=dict)  # GEMM -> fastest sample (seconds), timed in keyfold's rounds
    matmul_gflops: float | None = None             # the best of those GEMMs' rates (GFLOP/s)

    def of_matmul(self):
        """keyfold's fastest rate over the fastest GEMM's, both from the same rounds (or None).

        Fastest against fastest: load on a shared machine only ever adds time, and it can hit the GEMM's
        samples and miss keyfold's (a median against a median read bfloat16 dense at 137% in a loaded
        hour); each side's least-disturbed sample of the same minutes is the steady comparison."""
        t = self.best_times.get("keyfold")
        return None if t is None or not self.matmul_gflops else self.gflop / t / self.matmul_gflops

    def ratio(self, peer):
        """keyfold's time over the peer's, both from the round they were timed in together"""
        a = self.times.get(f"keyfold_beside_{peer}", self.times.get("keyfold"))
        b = self.times.get(peer)
        return None if a is None or b is None else a / b


# ------------------------------------------------------------------------------ timing


def _visible_pairs(mask, N, H, B):
    if mask is None:
        return float(N * N)
    return (1.0 - kf.as_mask(mask).sparsity(N, N)) * N * N


def _flex_fns(case: Case, mask_mod, score_mod, q, k, v):
    """Compiled FlexAttention with its block mask; returns (fn, compile seconds) or raises."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Each case compiles afresh: without a reset, dynamo stops compiling after its recompile
    # limit (8) and silently runs Flex eagerly, which materialises N x N and is not the peer.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    block = None
    if mask_mod is not None:
        block = create_block_mask(mask_mod, None, None, case.N, case.N, device="cpu")
    fn = lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        fn()
        return fn, time.perf_counter() - t0


def run_case(case: Case, repeats: int, with_flex: bool, matmul: dict | None = None) -> Result:
    """One row. ``matmul``: the GEMMs of ``matmul_fns`` for the case's dtype, timed in the rounds that give
    keyfold's time, so that its share of the machine's matmul rate compares the fastest samples of the
    same minutes (on a shared machine the rate moves by 20% within an hour)."""
    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(0)
    shape = (case.B, case.H, case.N, case.D)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    mask, score, mask_mod, score_mod = settings(case.variant, case.N, case.H)
    variant = BY_NAME[case.variant]
    pairs = _visible_pairs(mask, case.N, case.H, case.B)
    flops = 4.0 * case.B * case.H * case.D * pairs * (3.5 if case.mode == "fwd+bwd" else 1.0)
    plan = kf.planner._plan(mask, case.N, case.N, B=case.B, H=case.H,
                            max_span=kf.engine.TILE_SPAN if score is not None else None)
    res = Result(case, density=plan.density, gflop=flops / 1e9)

    if case.variant == "custom-callable":  # planning cost of a user's callable, cold then warm
        kf.clear_plan_cache()
        t0 = time.perf_counter()
        kf.plan(mask, case.N, case.N, B=case.B, H=case.H)
        res.plan_s = time.perf_counter() - t0
        before = kf.planner.plan_cache_stats()["hits"]
        kf.plan(mask, case.N, case.N, B=case.B, H=case.H)
        res.plan_reused = kf.planner.plan_cache_stats()["hits"] == before + 1
        try:  # the peer: Flex's create_block_mask on the same callable (DESIGN.md section 7)
            from torch.nn.attention.flex_attention import create_block_mask
            t0 = time.perf_counter()
            create_block_mask(mask, None, None, case.N, case.N, device="cpu")
            res.block_mask_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            res.errors["create_block_mask"] = f"{type(e).__name__}: {e}"

    fns = {"keyfold": lambda: kf.attention(q, k, v, mask=mask, score=score)}
    sdpa_mask = None
    sdpa_ok = variant.sdpa != "none"
    if variant.sdpa == "mask" and score is not None and case.H * case.N * case.N * 4 > 2**31:
        sdpa_ok = False  # a dense per-head float bias would not fit next to everything else
        res.errors["sdpa"] = f"ALiBi at N={case.N} needs a dense (H, N, N) float bias; skipped above 2 GiB"
    if variant.sdpa == "mask" and sdpa_ok:
        dense = kf.as_mask(mask).to_dense(case.N, case.N)
        if score is not None:  # ALiBi as an additive float mask for SDPA
            b, h, qp, kp = kf.masks.grid_positions(1, case.H, 0, case.N, 0, case.N, None)
            sdpa_mask = torch.where(dense, score.bias(b, h, qp, kp), float("-inf")).to(dtype)
        else:
            sdpa_mask = dense
    if sdpa_ok:
        causal_flag = variant.sdpa == "causal"
        fns["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, is_causal=causal_flag)

    if case.mode == "fwd+bwd":
        grads = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        dout = torch.randn(shape, generator=g).to(dtype)

        def with_backward(fn_of):
            def run():
                for t in grads:
                    t.grad = None
                fn_of(*grads).backward(dout)
            return run

        fns = {"keyfold": with_backward(lambda a, b, c: kf.attention(a, b, c, mask=mask, score=score))}
        if sdpa_ok:
            fns["sdpa"] = with_backward(lambda a, b, c: F.scaled_dot_product_attention(
                a, b, c, attn_mask=sdpa_mask, is_causal=variant.sdpa == "causal"))
        res.errors["flex"] = "FlexAttention has no CPU backward (torch raises NotImplementedError)"
    elif with_flex:
        try:
            fns["flex"], res.compile_s = _flex_fns(case, mask_mod, score_mod, q, k, v)
        except Exception as e:  # noqa: BLE001 - the peer failing is a result to report
            res.errors["flex"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    gemms = {name: fn for name, (fn, _) in (matmul or {}).items()}
    if "sdpa" in fns and "flex" in fns:
        # each peer in a round of its own beside keyfold: a call after SDPA with a dense mask (which
        # allocates and frees up to 1 GiB each time) ran slower, whoever it was (bfloat16 window 256 at
        # 16k: keyfold 30.7 ms in one round with both peers, 24.7-27.2 ms beside either alone)
        a = interleaved({"keyfold": fns["keyfold"], "flex": fns["flex"], **gemms}, repeats, lead=tuple(gemms))
        b = interleaved({"keyfold": fns["keyfold"], "sdpa": fns["sdpa"]}, repeats)
        res.times = {"keyfold": a["keyfold"], "flex": a["flex"], "sdpa": b["sdpa"], "keyfold_beside_sdpa": b["keyfold"]}
    else:
        a = interleaved({**fns, **gemms}, repeats, lead=tuple(gemms))
        res.times = {name: a[name] for name in fns}
    res.best_times = {name: a.best[name] for name in a if name not in gemms}
    res.matmul_times = {name: a.best[name] for name in gemms}
    if gemms:
        res.matmul_gflops = max(matmul[name][1] / t / 1e9 for name, t in res.matmul_times.items())
    return res


# --------------------------------------------------------------------------- presets


def cases(preset: str) -> list[Case]:
    if preset == "tiny":  # the test suite: proves the harness runs, measures nothing
        return [Case(v.name, 256, 32, "float32", "fwd", H=2) for v in VARIANTS] + \
               [Case("causal", 256, 32, "float32", "fwd+bwd", H=2)]
    if preset == "quick":  # the targets of the CPU-speed issue, under 3 minutes
        out = [Case(v.name, 4096, 64, "float32", "fwd") for v in VARIANTS]
        out += [Case("dense", 4096, 64, "bfloat16", "fwd"), Case("causal", 4096, 64, "float32", "fwd+bwd")]
        out += [Case(n, 16384, 64, "float32", "fwd") for n in ("window256", "documents8", "custom-callable")]
        return out
    # 16-bit: every variant forward in bfloat16 and float16 at 4096 and 16384 (the speed issue's
    # ≤ 0.9x Flex target is for N >= 4k), and bfloat16 forward+backward (its ≤ 1.10x SDPA target)
    lowp = [Case(v.name, N, 64, dt, "fwd") for N in (4096, 16384) for dt in ("bfloat16", "float16")
            for v in VARIANTS]
    lowp += [Case(v.name, 4096, 64, "bfloat16", "fwd+bwd") for v in VARIANTS if v.differentiable]
    if preset == "lowp":  # only the 16-bit rows of standard: ~20 min
        return lowp
    if preset == "backward":  # the ≤ 1.10x SDPA backward target at every N and D the full sweep has below 16k,
        # in bfloat16 (the issue's) and float32 (keyfold's own backward kernel): ~5 min
        return [Case(v.name, N, D, dt, "fwd+bwd") for dt in ("bfloat16", "float32") for N in (1024, 4096)
                for D in (64, 128) for v in VARIANTS if v.differentiable]
    if preset == "standard":  # every variant vs N with Flex (the plot), backward, 16-bit at 4k and 16k, memory: ~35-50 min
        out = [Case(v.name, N, 64, "float32", "fwd") for N in (1024, 4096, 16384) for v in VARIANTS]
        out += [Case(v.name, 4096, 64, "float32", "fwd+bwd") for v in VARIANTS if v.differentiable]
        out += [Case(n, 4096, 128, "float32", "fwd") for n in ("dense", "causal", "window256", "documents8")]
        return out + lowp
    out = []
    for N in (1024, 4096, 16384):
        for D in (64, 128):
            for dt in ("float32", "bfloat16"):
                for v in VARIANTS:
                    out.append(Case(v.name, N, D, dt, "fwd"))
                    if v.differentiable:
                        out.append(Case(v.name, N, D, dt, "fwd+bwd"))
    return out


def flex_wanted(preset: str, case: Case) -> bool:
    if preset == "tiny":
        return False
    if preset == "quick":
        return case.N == 16384 and case.variant in ("window256", "documents8")
    return case.mode == "fwd"


def repeats_for(case: Case, preset: str) -> int:
    if preset == "tiny":
        return 1
    return 5 if case.N <= 4096 else 3


# ----------------------------------------------------------------------------- memory


_MEM_CHILD = r"""
import resource, sys, torch
import torch.nn.functional as F
import keyfold as kf
N, impl = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(2)
q, k, v = (torch.randn(1, 8, N, 64) for _ in range(3))
# Baseline: the memory resident right now (not the high-water mark, which an earlier transient
# may have raised). peak - baseline can only over-state what the call needed.
rss_now = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
if impl == "keyfold":
    kf.attention(q, k, v, mask=kf.causal() & kf.window(256))
elif impl == "sdpa":
    i = torch.arange(N)
    m = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= 256)
    F.scaled_dot_product_attention(q, k, v, attn_mask=m)
# VmHWM, the high-water mark of this process's own memory. (ru_maxrss would do, except that
# Linux carries the forking parent's RSS across exec into it, and the parent here is big.)
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
print(max(0, peak - rss_now))
"""


def memory(N: int = 32768) -> dict:
    """Peak extra RSS of sliding-window-256 attention, one fresh process per implementation."""
    qkv_bytes = 3 * 8 * N * 64 * 4
    out = {"N": N, "qkv_bytes": qkv_bytes}
    for impl in ("keyfold", "sdpa"):
        r = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(N), impl], capture_output=True, text=True)
        out[impl] = int(r.stdout.strip()) if r.returncode == 0 else None
        if r.returncode != 0:
            out[f"{impl}_error"] = r.stderr.strip().splitlines()[-1:]
    out["keyfold_over_qkv"] = None if out["keyfold"] is None else out["keyfold"] / qkv_bytes
    return out


# ---------------------------------------------------------------------------- reports


def _fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def markdown(results: list[Result], mem: dict | None, header: str, limits: dict | None = None) -> str:
    limits = limits or {}
    lines = [header, ""]
    if limits:
        lines += ["The machine's matmul rate is the best square GEMM, n = 1024 or 2048 (a 16-bit dtype natively or "
                  "cast to float32, whichever is faster). keyfold's GFLOP/s are counted on the visible pairs (4·D "
                  "FLOPs each forward, 3.5x that forward+backward). `of matmul` = keyfold's fastest sample's rate "
                  "over the fastest GEMM sample of the same rounds (load only adds time; on a shared machine the "
                  "rate moves by 20% within an hour). `of best roof` = keyfold's median rate over the best GEMM sample of "
                  "the whole run (sampled every 15 cases; a fast minute's GEMM against keyfold's median: the "
                  "lowest reading). Best roof of this run: " + ", ".join(
            f"{dt} {g:.0f} GFLOP/s" for dt, g in limits.items()) + ".", ""]
    lines += ["| variant | N | D | dtype | mode | work | keyfold s | SDPA s | Flex s | Flex compile s | "
              "kf/SDPA | kf/Flex | keyfold GFLOP/s | of matmul | of best roof |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, t = r.case, r.times
        gflops = None if t.get("keyfold") is None else r.gflop / t["keyfold"]
        frac = None if gflops is None or c.dtype not in limits else gflops / limits[c.dtype]
        beside = r.of_matmul()
        lines.append(
            f"| {c.variant} | {c.N} | {c.D} | {c.dtype} | {c.mode} | {r.density:.1%} | {_fmt(t.get('keyfold'), '.4f')} | "
            f"{_fmt(t.get('sdpa'), '.4f')} | {_fmt(t.get('flex'), '.4f')} | {_fmt(r.compile_s, '.1f')} | "
            f"{_fmt(r.ratio('sdpa'), '.2f')} | {_fmt(r.ratio('flex'), '.2f')} | {_fmt(gflops, '.1f')} | "
            f"{_fmt(beside, '.0%')} | {_fmt(frac, '.0%')} |")
    plans = [r for r in results if r.plan_s is not None]
    if plans:
        lines += ["", "Planning a user's mask callable (cold, then cached):", ""]
        for r in plans:
            lines.append(f"- N={r.case.N}: plan built in {r.plan_s:.3f} s; Flex's create_block_mask on the same "
                         f"callable {_fmt(r.block_mask_s, '.3f')} s; one keyfold call "
                         f"{_fmt(r.times.get('keyfold'), '.3f')} s; the second call reused the plan: {r.plan_reused}")
    if mem:
        lines += ["", f"Peak extra memory, sliding window 256, N={mem['N']} (fresh process each, VmHWM over resident memory before the call):", "",
                  f"- keyfold: {_fmt(mem['keyfold'] and mem['keyfold'] / 2**20, '.0f')} MiB = "
                  f"{_fmt(mem['keyfold_over_qkv'], '.2f')}x the bytes of q, k, v ({mem['qkv_bytes'] / 2**20:.0f} MiB)",
                  f"- SDPA with the dense mask: {_fmt(mem['sdpa'] and mem['sdpa'] / 2**20, '.0f')} MiB"]
    notes = sorted({f"{k}: {v}" for r in results for k, v in r.errors.items()})
    if notes:
        lines += ["", "Not measured:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fwd = [r for r in results if r.case.mode == "fwd" and r.case.dtype == "float32"]
    if not fwd:
        return
    D = min(r.case.D for r in fwd)
    fwd = [r for r in fwd if r.case.D == D]
    names = sorted({r.case.variant for r in fwd})
    cols = 4
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        rs = sorted((r for r in fwd if r.case.variant == name), key=lambda r: r.case.N)
        for impl, style in (("keyfold", "o-"), ("sdpa", "s--"), ("flex", "^:")):
            pts = [(r.case.N, r.times[impl]) for r in rs if r.times.get(impl) is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("N")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(f"forward time vs N (B=1, H={fwd[0].case.H}, D={D}, float32)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: Cases between two samples of the matmul roof (a sample costs ~1-3 s per dtype; 15 cases of the
#: standard run are ~5 minutes, slow and fast minutes on a shared machine alternate at that scale)
ROOF_EVERY = 15


class Roof:
    """The matmul rate per dtype, sampled at the start of a run, every ``every`` cases, and at its end;
    ``best`` is the highest sample (the ceiling, which a loaded minute can only lower)."""

    def __init__(self, dtypes, every: int = ROOF_EVERY, rate=matmul_rate):
        self.dtypes, self.every, self.rate = tuple(dtypes), every, rate
        self.samples: dict[str, list[float]] = {dt: [] for dt in self.dtypes}

    def sample(self) -> None:
        for dt in self.dtypes:
            self.samples[dt].append(self.rate(getattr(torch, dt)))

    def maybe_sample(self, i: int) -> None:
        """Sample before case ``i`` when it opens a stretch of ``every`` cases."""
        if i % self.every == 0:
            self.sample()

    @property
    def best(self) -> dict[str, float]:
        return {dt: max(v) for dt, v in self.samples.items() if v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m keyfold bench kernels", description=__doc__)
    ap.add_argument("--preset", choices=("tiny", "quick", "lowp", "backward", "standard", "full"), default="standard",
                    help="quick: the issue's targets (< 3 min); lowp: every variant in bfloat16 and float16 at 4096 and "
                         "16384, and bfloat16 backward (~20 min); backward: bfloat16 and float32 forward+backward of every "
                         "differentiable variant at N 1024 and 4096, D 64 and 128 (~5 min); standard: every variant vs N, plus lowp "
                         "and the memory table (~35-50 min); full: N x D x dtype x mode (50 min on the Intel Xeon with AMX, ~2 h on the AMD EPYC)")
    ap.add_argument("--quick", action="store_const", const="quick", dest="preset", help="the issue's targets, < 3 min")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: the repository's benchmarks/results)")
    ap.add_argument("--name", default=None,
                    help="file stem for the results (default: kernels-quick for --quick, kernels-backward for "
                         "--preset backward, else kernels)")
    ap.add_argument("--no-memory", action="store_true", help="skip the subprocess peak-memory measurement")
    ap.add_argument("--memory", type=int, nargs="*", default=None, metavar="N",
                    help="the forward+backward peak-memory table of `bench memory` (keyfold vs SDPA per mask, "
                         "blocks visited) at these N (default 16384 65536; standard and full include it "
                         "unless --no-memory)")
    ap.add_argument("--variants", nargs="*", help="only these variants")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for every implementation")
    args = ap.parse_args(argv)
    if args.name is None:  # --quick and --preset backward must not overwrite the standard run's kernels.md
        args.name = {"quick": "kernels-quick", "backward": "kernels-backward"}.get(args.preset, "kernels")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory is None and args.preset in ("standard", "full") and not args.no_memory:
        args.memory = []  # the issue's memory column: 16k and 64k, one fresh process per case

    todo = [c for c in cases(args.preset) if not args.variants or c.variant in args.variants]
    # the machine's matmul rate per dtype, sampled through the run and the best kept: a roof taken in
    # a slow minute flatters every row (one standard run measured float32 at 156 GFLOP/s at its start
    # and end, another 198; a run with only a start and an end sample put a float16 row at "104%")
    roof = Roof(() if args.preset == "tiny" else sorted({c.dtype for c in todo}))
    # and the same GEMMs in keyfold's rounds of every case (tiny: one small GEMM, to run the code)
    gemms = {dt: matmul_fns(getattr(torch, dt), (64,) if args.preset == "tiny" else (1024, 2048))
             for dt in sorted({c.dtype for c in todo})}
    results = []
    for i, case in enumerate(tqdm(todo, desc="bench kernels", unit="case")):
        roof.maybe_sample(i)
        results.append(run_case(case, repeats_for(case, args.preset), flex_wanted(args.preset, case),
                                gemms[case.dtype]))
        torch._dynamo.reset()  # free the compiled peer and its block mask before the next case
        gc.collect()
    roof.sample()
    limits = roof.best
    mem = None if (args.no_memory or args.preset == "tiny") else memory()
    header = (f"# keyfold kernels vs SDPA and compiled FlexAttention ({args.preset})\n\n"
              f"Machine: {machine()}. Median of alternating repeats, keyfold beside each peer in a round of its "
              f"own (`keyfold s` is the Flex round's where Flex ran); `work` is the fraction of the dense "
              f"N×N work keyfold's plan computes. B=1, H=8.")
    args.out = results_dir(args.out)
    md = markdown(results, mem, header, limits)
    mem_rows = None
    if args.memory is not None:  # the memory column: one fresh process per (mask, N, implementation)
        from . import memory as memory_bench

        mem_rows = memory_bench.run(sizes=args.memory or (16384, 65536), threads=torch.get_num_threads())
        md += "\n" + memory_bench.markdown(mem_rows, "## Peak memory, forward+backward\n\n" + memory_bench.HOW)
    (args.out / f"{args.name}.md").write_text(md)
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"machine": machine(), "preset": args.preset, "memory": mem, "memory_table": mem_rows, "matmul_gflops": limits,
         "matmul_gflops_samples": roof.samples,
         "results": [dict(asdict(r), ratio_sdpa=r.ratio("sdpa"), ratio_flex=r.ratio("flex"), of_matmul=r.of_matmul())
                     for r in results]},
        indent=1))
    plot(results, args.out / f"{args.name}.png")
    print(md)
    return 0
