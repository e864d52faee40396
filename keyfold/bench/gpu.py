"""keyfold's Triton kernel against SDPA (flash), compiled FlexAttention and flash-attn on one GPU.

    PYTHONPATH=. python -m keyfold bench gpu              # on a CUDA machine, < 5 minutes
    PYTHONPATH=. python -m keyfold bench gpu --dry-run    # tiny shapes on a CPU: checks the script
    PYTHONPATH=. python -m keyfold bench gpu --accuracy   # error table by the rule of DESIGN.md §6

bfloat16, B=4, H=16, D=128, N in {2k, 8k, 32k}; variants dense, causal, causal sliding window
1024, documents (8 packed documents of uneven length, bidirectional inside each); forward and
forward + backward. TFLOP/s are counted on the work the mask needs: 4·D FLOPs per visible
(query, key) pair forward, 2.5x that backward (FlashAttention's convention), so skipping work
shows up as speed, not as inflated FLOPs. Every peer runs in the same process, alternating
with keyfold. Targets (issue 7): dense forward >= 0.8x SDPA-flash, causal and window >= 1.0x
compiled FlexAttention. Writes ``gpu.json``, ``gpu.md`` and ``gpu.png`` to ``--out``.

The script keeps a time budget (``--budget``, seconds): cases run in order of importance and
the rest are recorded as skipped when it runs out, so it always finishes and writes results.
"""

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch  # noqa: E402

if "--dry-run" in sys.argv or ("--accuracy" in sys.argv and not torch.cuda.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU interpreter: set before triton loads

import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import keyfold as kf  # noqa: E402
import keyfold.kernels.triton as kt  # noqa: E402
from keyfold.bench.harness import interleaved, results_dir  # noqa: E402
from keyfold.scores import aligned  # noqa: E402

VARIANTS = ("dense", "causal", "window1024", "documents")
MODES = ("fwd", "fwd+bwd")
METHODS = ("keyfold", "keyfold-auto", "sdpa-flash", "flex", "flash-attn")
WINDOW = 1024
# (keyfold method, variant, mode, peer, minimum keyfold/peer TFLOP/s ratio) from issue 7; the
# dense target is reported for the Triton kernel alone and for what Backend.AUTO runs
TARGETS = (("keyfold", "dense", "fwd", "sdpa-flash", 0.8), ("keyfold-auto", "dense", "fwd", "sdpa-flash", 0.8),
           ("keyfold", "causal", "fwd", "flex", 1.0), ("keyfold", "causal", "fwd+bwd", "flex", 1.0),
           ("keyfold", "window1024", "fwd", "flex", 1.0), ("keyfold", "window1024", "fwd+bwd", "flex", 1.0))


@dataclass
class Row:
    N: int
    variant: str
    mode: str
    method: str
    ms: float | None = None
    tflops: float | None = None
    note: str = ""


# ------------------------------------------------------------------------------ settings


def doc_ids(N: int, device) -> torch.Tensor:
    """8 documents of uneven (seeded) lengths covering N positions."""
    g = torch.Generator().manual_seed(7)
    w = torch.rand(8, generator=g) + 0.5
    lengths = (w / w.sum() * N).floor().long()
    lengths[-1] += N - int(lengths.sum())
    return torch.repeat_interleave(torch.arange(8), lengths).to(device)


def visible_pairs(variant: str, N: int, ids: torch.Tensor) -> int:
    """Closed-form count of (query, key) pairs the mask needs (no N x N)."""
    if variant == "dense":
        return N * N
    if variant == "causal":
        return N * (N + 1) // 2
    if variant == "window1024":  # causal() & window(W): row i sees min(i, W) + 1 keys
        W = min(WINDOW, N - 1)
        return (W + 1) * (W + 2) // 2 + (N - W - 1) * (W + 1)
    lengths = torch.bincount(ids.cpu()).tolist()
    return sum(L * L for L in lengths)


def keyfold_mask(variant: str, ids):
    return {"dense": None, "causal": kf.causal(), "window1024": kf.causal() & kf.window(WINDOW),
            "documents": kf.documents(ids)}[variant]


def flex_mask_mod(variant: str, ids):
    if variant == "causal":
        return lambda b, h, q, k: q >= k
    if variant == "window1024":
        w = WINDOW  # a local, not a global: Flex traces the function
        return lambda b, h, q, k: (q >= k) & (q - k <= w)
    if variant == "documents":
        return lambda b, h, q, k: ids[q] == ids[k]
    return None


# ------------------------------------------------------------------------------ methods


class Methods:
    """Callables ``fn(q, k, v) -> out`` per method for one (N, variant); None when not applicable."""

    def __init__(self, variant: str, N: int, device, dry: bool):
        self.variant, self.N, self.device, self.dry = variant, N, device, dry
        self.ids = doc_ids(N, device)
        self._flex = None

    def keyfold(self, aten_dense: bool):
        mask = keyfold_mask(self.variant, self.ids)

        def run(q, k, v):
            kt.USE_ATEN_DENSE = aten_dense
            return kf.attention(q, k, v, mask=mask, backend=kf.Backend.TRITON)
        return run

    def sdpa_flash(self):
        if self.variant not in ("dense", "causal"):
            return None  # SDPA's flash backend has no window or document masks
        from torch.nn.attention import SDPBackend, sdpa_kernel
        causal = self.variant == "causal"

        def run(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    def flex(self):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        mod = flex_mask_mod(self.variant, self.ids)
        B, H = None, None
        block = None if mod is None else create_block_mask(mod, B, H, self.N, self.N, device=self.device)
        if self.dry:  # eager Flex on a CPU: correct, unfused, forward only; fine for a dry run
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        fn = flex_attention if self.dry else torch.compile(flex_attention, dynamic=False)

        def run(q, k, v):
            return fn(q, k, v, block_mask=block)
        return run

    def flash_attn(self):
        try:
            from flash_attn import flash_attn_func, flash_attn_varlen_func
        except ImportError:
            return None
        if self.variant == "documents":
            lengths = torch.bincount(self.ids)
            cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)

            def run(q, k, v):
                B, H, N, D = q.shape
                cus = torch.cat([cu[:-1] + b * N for b in range(B)] + [cu[-1:] + (B - 1) * N]).to(torch.int32)
                pack = [x.transpose(1, 2).reshape(B * N, H, D) for x in (q, k, v)]   # (B*N, H, D)
                out = flash_attn_varlen_func(*pack, cus, cus, int(lengths.max()), int(lengths.max()))
                return out.view(B, N, H, D).transpose(1, 2)
            return run
        causal = self.variant != "dense"
        window = (WINDOW, 0) if self.variant == "window1024" else (-1, -1)

        def run(q, k, v):
            out = flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal, window_size=window)
            return out.transpose(1, 2)  # (B, N, H, D) -> (B, H, N, D)
        return run

    def get(self, method: str):
        if method == "keyfold":
            return self.keyfold(False)
        if method == "keyfold-auto":  # plain dense pieces through PyTorch's own flash op
            return self.keyfold(True) if self.variant == "dense" and not self.dry else None
        if method == "sdpa-flash":
            return self.sdpa_flash()
        if method == "flex":
            return self.flex()
        return self.flash_attn()


# ------------------------------------------------------------------------------ timing


def bench_ms(fn, cuda: bool, reps: int) -> float:
    if cuda:
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=10, rep=max(40, reps * 4), return_mode="median"))
    return 1000.0 * interleaved({"fn": fn}, reps, warmup=0)["fn"]


def measure(run, q, k, v, mode: str, cuda: bool, reps: int) -> float:
    if mode == "fwd":
        def step():
            with torch.no_grad():
                run(q, k, v)
    else:
        qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
        dout = torch.randn_like(q)

        def step():
            out = run(qg, kg, vg)
            out.backward(dout)
            qg.grad = kg.grad = vg.grad = None
    if cuda:
        step()  # compile / plan / warm caches outside the timing
        torch.cuda.synchronize()
    return bench_ms(step, cuda, reps)


def check_outputs(methods: Methods, q, k, v) -> dict:
    """max |method - keyfold| on this case (a sanity check of the first GPU run)."""
    with torch.no_grad():
        ref = methods.get("keyfold")(q, k, v).float()
        diffs = {}
        for m in METHODS[1:]:
            fn = methods.get(m)
            if fn is not None:
                diffs[m] = float((fn(q, k, v).float() - ref).abs().max())
    return diffs


# ------------------------------------------------------------------------------ report


def ratios(rows):
    by = {(r.N, r.variant, r.mode, r.method): r for r in rows if r.tflops}
    out = []
    for method, variant, mode, peer, goal in TARGETS:
        for N in sorted({r.N for r in rows}):
            a, b = by.get((N, variant, mode, method)), by.get((N, variant, mode, peer))
            if a and b:
                out.append(dict(N=N, method=method, variant=variant, mode=mode, peer=peer, ratio=a.tflops / b.tflops,
                                target=goal, met=a.tflops / b.tflops >= goal))
    return out


def time_ratios(rows) -> list[dict]:
    """keyfold's time / each peer's on every (N, variant, mode) both ran (< 1: keyfold is faster);
    for dense, also the aten flash forward (``keyfold-auto``, ``USE_ATEN_DENSE = True``)."""
    by = {(r.N, r.variant, r.mode, r.method): r.ms for r in rows if r.ms}
    out = []
    for (N, variant, mode, method), ms in sorted(by.items()):
        if method not in ("keyfold", "keyfold-auto"):
            continue
        peers = {p: ms / by[(N, variant, mode, p)] for p in ("sdpa-flash", "flex", "flash-attn")
                 if (N, variant, mode, p) in by}
        out.append(dict(N=N, variant=variant, mode=mode, method=method, ms=ms, **peers))
    return out


def write_markdown(path: Path, meta, rows, checks, rats, trats):
    lines = [f"# keyfold Triton kernel vs peers on {meta['device']}", "",
             f"`{meta['command']}` — {meta['dtype']}, B={meta['B']} H={meta['H']} D={meta['D']}; "
             f"torch {meta['torch']} (CUDA {meta.get('cuda')}), triton {meta['triton']}; "
             f"{meta['seconds']:.0f} s in all.", "",
             "TFLOP/s counted on needed work (4·D FLOPs per visible pair forward, 3.5x that for "
             "forward + backward); `keyfold` is the Triton kernel alone (what `Backend.AUTO` runs on CUDA), "
             "`keyfold-auto` sends plain dense forward pieces to PyTorch's flash op (`USE_ATEN_DENSE = True`).", ""]
    for mode in [m for m in MODES if any(r.mode == m for r in rows)]:
        lines += [f"## {mode}", "", "| N | variant | " + " | ".join(METHODS) + " |",
                  "|---|---|" + "---|" * len(METHODS)]
        for N in sorted({r.N for r in rows}):
            for variant in [x for x in VARIANTS if any(r.variant == x for r in rows)]:
                cells = []
                for m in METHODS:
                    r = next((x for x in rows if (x.N, x.variant, x.mode, x.method) == (N, variant, mode, m)), None)
                    cells.append(f"{r.tflops:.3g}" if r and r.tflops else (r.note if r else "") or "—")
                lines.append(f"| {N} | {variant} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## targets (keyfold / peer, TFLOP/s)", "", "| N | keyfold | variant | mode | peer | ratio | target | met |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['method']} | {r['variant']} | {r['mode']} | {r['peer']} | {r['ratio']:.2f} | "
              f">= {r['target']} | {'yes' if r['met'] else 'NO'} |" for r in rats]
    lines += ["", "## keyfold's time / the peer's (< 1: keyfold faster)", "",
              "| N | variant | mode | method | ms | / SDPA-flash | / compiled Flex | / flash-attn |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['variant']} | {r['mode']} | {r['method']} | {r['ms']:.3g} | "
              + " | ".join(f"{r[p]:.2f}x" if p in r else "—" for p in ("sdpa-flash", "flex", "flash-attn")) + " |"
              for r in trats]
    lines += ["", "## output check (max |method - keyfold|, first N, forward)", ""]
    lines += [f"- {variant}: " + ", ".join(f"{m} {d:.2e}" if isinstance(d, float) else f"{m} {d}"
                                           for m, d in diffs.items()) for variant, diffs in checks.items()]
    path.write_text("\n".join(lines) + "\n")


def write_png(path: Path, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    Ns = sorted({r.N for r in rows})
    modes = [m for m in MODES if any(r.mode == m for r in rows)]
    variants = [v for v in VARIANTS if any(r.variant == v for r in rows)]
    fig, axes = plt.subplots(len(modes), len(variants), figsize=(4 * len(variants), 3.2 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for j, variant in enumerate(variants):
            ax = axes[i][j]
            for c, m in enumerate(METHODS):  # one colour per method in every panel (the legend is shared)
                ys = [next((r.tflops for r in rows if (r.N, r.variant, r.mode, r.method) == (N, variant, mode, m)
                            and r.tflops), float("nan")) for N in Ns]
                if not all(math.isnan(y) for y in ys):
                    ax.plot(Ns, ys, marker="o", label=m, color=f"C{c}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(Ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in Ns])
            ax.minorticks_off()
            ax.set_title(f"{variant}, {mode}")
            ax.set_xlabel("N")
            ax.set_ylabel("TFLOP/s (needed work)")
            ax.grid(alpha=0.3)
    seen = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    labels = [m for m in METHODS if m in seen]
    handles = [seen[m] for m in labels]
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ accuracy


@dataclass(frozen=True)
class Case:
    """One accuracy case: a mask and score on B=2 batch rows, ``Hq`` query heads on ``Hkv``."""

    name: str
    mask: object = None
    score: object = None
    Nq: int | None = None  # None: N
    Nk: int | None = None  # None: N
    kv_offset: int = 0
    Hq: int = 4
    Hkv: int = 2
    half_dv: bool = False  # v's head dim D / 2
    backend: str = "TRITON"  # a Backend member's name


def accuracy_cases(N: int, extended: bool) -> list[Case]:
    """The six standard cases (the benchmark's kernels), and with ``extended`` every preset, the
    in-kernel score modifiers, decode and chunked-prefill shapes, Dv != D and a score callable
    (which ``Backend.AUTO`` routes to the tile kernel)."""
    cases = [Case("dense"), Case("causal", kf.causal()), Case("causal & window(24)", kf.causal() & kf.window(24)),
             Case("documents", kf.documents(torch.arange(N) * 4 // N)),
             Case("causal & (window(16) \\| sinks(4))", kf.causal() & (kf.window(16) | kf.sinks(4))),
             Case("callable `\\|q-k\\| % 7 < 4`", lambda b, h, q, k: (q - k).abs() % 7 < 4)]
    if not extended:
        return cases
    g = torch.Generator().manual_seed(3)
    layout = torch.rand(4, N // 64 + 1, N // 64 + 1, generator=g) < 0.4  # per head, blocks of 64
    per_batch_ids = torch.stack([torch.arange(N) * 3 // N, torch.arange(N) * 5 // N])  # (B, N)
    cases += [
        Case("window(40, 24)", kf.window(40, 24)),
        Case("prefix(N/3)", kf.prefix(N // 3)),
        Case("causal & (window(16) \\| sinks([2, 200]))", kf.causal() & (kf.window(16) | kf.sinks(torch.tensor([2, 200])))),
        Case("documents (B, N) & causal", kf.documents(per_batch_ids) & kf.causal()),
        Case("block_sparse per head", kf.block_sparse(layout, 64)),
        Case("dilated(3) & causal", kf.dilated(3) & kf.causal()),
        Case("~causal (last row empty)", ~kf.causal()),
        Case("window(6) & ~window(3) (first rows empty)", kf.window(6) & ~kf.window(3)),
        Case("causal + alibi", kf.causal(), kf.alibi(kf.alibi_slopes(4))),
        Case("causal + softcap(5)", kf.causal(), kf.softcap(5.0)),
        Case("documents + [alibi, softcap]", kf.documents(torch.arange(N) * 4 // N),
             [kf.alibi(kf.alibi_slopes(4)), kf.softcap(5.0)]),
        Case("decode: 1 query, causal, GQA 8 on 1", kf.causal(), Nq=1, Hq=8, Hkv=1),
        Case("chunked prefill: N/4 queries, kv_offset 64", kf.causal() & kf.window(300), Nq=N // 4, kv_offset=64),
        Case("causal, Dv = D/2", kf.causal(), half_dv=True),
        Case("score callable (AUTO: tiles)", kf.causal(), lambda s, b, h, q, k: s - 0.01 * (q - k), backend="AUTO"),
    ]
    return cases


def _seen_rows(mask, B, H, Nq, Nk, q_offset, kv_offset, device) -> torch.Tensor:
    """``(B, H, Nq)`` bool: rows that see at least one key (evaluates the Nq x Nk grid: a check)."""
    from keyfold.masks import grid_positions
    if mask is None:
        return torch.ones(B, H, Nq, dtype=torch.bool, device=device)
    b, h, qp, kp = grid_positions(B, H, q_offset, Nq, kv_offset, Nk, device)
    return torch.broadcast_to(mask.evaluate(b, h, qp, kp), (B, H, Nq, Nk)).any(-1)


ACCURACY_HEADER = ("| mask | dtype | backend | out error | out ratio | dq ratio | dk ratio | dv ratio | empty = 0 | rule met |",
                   "|---|---|---|---|---|---|---|---|---|---|")


def check_case(case: Case, dt: torch.dtype, N: int, D: int, device) -> tuple[str, bool]:
    """One markdown row of :func:`accuracy` and whether the case meets the rule."""
    from keyfold.kernels._common import Problem
    from keyfold.kernels.reference import attend_naive
    m = kf.as_mask(case.mask)
    Nq, Nk = case.Nq or N, case.Nk or N
    Dv = D // 2 if case.half_dv else D
    q_offset = case.kv_offset + Nk - Nq
    backend = kf.Backend[case.backend]
    seen = _seen_rows(m, 2, case.Hq, Nq, Nk, q_offset, case.kv_offset, device)  # (B, Hq, Nq)
    kw = dict(mask=m, score=case.score, kv_offset=case.kv_offset)
    x = [torch.randn(2, case.Hq, Nq, D, dtype=dt, device=device),
         torch.randn(2, case.Hkv, Nk, D, dtype=dt, device=device),
         torch.randn(2, case.Hkv, Nk, Dv, dtype=dt, device=device)]
    dout = torch.randn(2, case.Hq, Nq, Dv, dtype=torch.float64, device=device) * seen[..., None]
    pb = Problem(m, aligned(kf.as_score(case.score), m, 2), D ** -0.5, q_offset, case.kv_offset)
    res = {}
    for who, fn, cast in (
            ("keyfold", lambda a, b, c: kf.attention(a, b, c, backend=backend, **kw), dt),
            ("ref", lambda a, b, c: kf.attention(a, b, c, backend=kf.Backend.REFERENCE, **kw), torch.float64),
            ("naive", lambda a, b, c: attend_naive(a, b, c, pb).nan_to_num(), dt)):
        t = [y.detach().to(cast).clone().requires_grad_(True) for y in x]
        out = fn(*t)
        out.backward(dout.to(out.dtype))
        res[who] = [out.detach()] + [y.grad for y in t]

    def err(a, r, rows):
        d = (a.double() - r.double()).abs()
        return float((d * seen[..., None] if rows else d).nan_to_num(float("inf")).max())
    ratios_, met = [], True
    for i, factor in enumerate((2.0, 3.0, 3.0, 3.0)):
        e_k, e_n = err(res["keyfold"][i], res["ref"][i], i == 0), err(res["naive"][i], res["ref"][i], i == 0)
        ratios_.append(e_k / max(e_n, 1e-30))
        met = met and e_k <= factor * e_n + 1e-6
        if i == 0:
            e_out = e_k
    zeros = bool((res["keyfold"][0][~seen] == 0).all())
    met = met and zeros
    row = (f"| {case.name} | {str(dt).replace('torch.', '')} | {backend.name} | {e_out:.2e} | "
           + " | ".join(f"{r:.2f}" for r in ratios_) + f" | {'yes' if zeros else 'NO'} | {'yes' if met else 'NO'} |")
    return row, met


def accuracy(cuda: bool, dtypes=None, extended: bool = False, shard: tuple[int, int] = (0, 1),
             echo=None) -> tuple[str, bool]:
    """Markdown table of keyfold's error against float64, as a multiple of the naive same-dtype
    implementation's (DESIGN.md §6: out <= 2x + 1e-6, dq/dk/dv <= 3x + 1e-6, rows that see no
    key exactly 0), and whether every case meets the rule; forward and backward. Each case runs
    on ``Backend.TRITON``, or on ``Backend.AUTO`` where the kernel cannot (a score callable).
    shard ``(k, n)``: every n-th case from the k-th (parallel processes); echo: called with each
    line as it is made (a run cut short keeps the rows it finished); a case that raises is a row
    that says so and fails the table."""
    device = "cuda" if cuda else "cpu"
    N, D = (2048, 128) if cuda else (96, 64)
    # on a GPU bfloat16 alone by default: its kernels are the benchmark's (the compile cache is shared)
    dtypes = dtypes or ((torch.bfloat16,) if cuda else (torch.float32, torch.float16))
    lines = [f"B=2, Hq=4, Hkv=2 unless named, N={N}, D={D}; error = max |x - float64 reference| over rows that "
             "see a key; ratio = keyfold's error / the naive same-dtype implementation's; `empty = 0`: rows that "
             "see no key are exactly 0", "", *ACCURACY_HEADER]
    echo = echo or (lambda line: None)
    for line in lines:
        echo(line)
    ok_all = True
    torch.manual_seed(0)
    cases = accuracy_cases(N, extended)[shard[0]::shard[1]]
    for case in tqdm(cases, desc="accuracy"):
        for dt in dtypes:
            try:
                row, met = check_case(case, dt, N, D, device)
            except Exception as e:  # noqa: BLE001 - a crash is a result of the table
                row, met = f"| {case.name} | {str(dt).replace('torch.', '')} | error: {e!r:.200} | NO |", False
            ok_all = ok_all and met
            lines.append(row)
            echo(row)
    return "\n".join(lines), ok_all


# ------------------------------------------------------------------------------ backward tuning

# (block_m, block_n, num_warps, num_stages) tried for each backward kernel, bf16 head_dim 128;
# the first of each is the table's current entry
DQ_CANDIDATES = ((64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2))
DKDV_CANDIDATES = ((64, 64, 8, 2), (64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2), (64, 32, 4, 2))


def tune_backward(N: int = 8192, B: int = 4, H: int = 16, D: int = 128, echo=print, device="cuda",
                  dtype=torch.bfloat16, check_N: int = 2048, candidates=(DQ_CANDIDATES, DKDV_CANDIDATES)) -> list[str]:
    """Time forward + backward (bf16, causal, N) with each dQ config (dK/dV at its current one),
    then each dK/dV config (dQ at the fastest); a config counts only if causal and documents at
    N=2048 still meet the rule with it. Leaves the fastest pair set in the launch table's
    override (so a benchmark run after it uses them) and returns the markdown lines."""
    from keyfold.kernels.triton import launch
    cuda = torch.device(device).type == "cuda"
    q, k, v = (torch.randn(B, H, N, D, device=device, dtype=dtype) for _ in range(3))
    run = Methods("causal", N, q.device, not cuda).keyfold(False)
    checks = (Case("causal", kf.causal()), Case("documents", kf.documents(torch.arange(check_N) * 4 // check_N)))
    dt = str(dtype).replace("torch.", "")
    lines = [f"{dt}, causal, B={B} H={H} N={N} D={D}; ms of forward + backward (median); the rule checked on "
             f"causal and documents at N={check_N} with each config", "",
             "| kernel | block_m | block_n | warps | stages | fwd+bwd ms | rule met |", "|---|---|---|---|---|---|---|"]
    for line in lines:
        echo(line)
    for name, cands in zip(("dq", "dkdv"), candidates):
        best = None
        for c in cands:
            launch._CONFIG_OVERRIDE[name] = launch._Config(*c)
            try:
                ok = all(check_case(case, dtype, check_N, D, device)[1] for case in checks)
                ms = measure(run, q, k, v, "fwd+bwd", cuda, 10 if cuda else 1)
                row = f"| {name} | {c[0]} | {c[1]} | {c[2]} | {c[3]} | {ms:.2f} | {'yes' if ok else 'NO'} |"
            except Exception as e:  # noqa: BLE001 - out of shared memory, say: a result
                ok, ms, row = False, None, f"| {name} | {c[0]} | {c[1]} | {c[2]} | {c[3]} | error: {e!r:.120} | — |"
            lines.append(row)
            echo(row)
            if ok and (best is None or ms < best[0]):
                best = (ms, c)
        launch._CONFIG_OVERRIDE[name] = launch._Config(*(best[1] if best else cands[0]))
    chosen = f"chosen: dq {launch._CONFIG_OVERRIDE['dq']}, dkdv {launch._CONFIG_OVERRIDE['dkdv']}"
    lines += ["", chosen]
    echo("")
    echo(chosen)
    return lines


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m keyfold bench gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for gpu.json / gpu.md / gpu.png (default: the repository's benchmarks/results)")
    ap.add_argument("--dry-run", action="store_true", help="tiny float32 shapes on the CPU (interpreter)")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; later cases are skipped past it")
    ap.add_argument("--sizes", default=None, help="comma-separated N (default 2048,8192,32768)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--accuracy", action="store_true", help="print the error table (DESIGN.md §6) and exit")
    ap.add_argument("--all-cases", action="store_true", help="--accuracy over every preset, the in-kernel score "
                    "modifiers, decode and chunked-prefill shapes, Dv != D and a score callable (21 cases, not 6)")
    ap.add_argument("--dtypes", default=None, help="--accuracy dtypes, e.g. bfloat16,float16,float32 "
                    "(default: bfloat16 on a GPU, float32,float16 in the CPU interpreter)")
    ap.add_argument("--shard", default="0/1", help="--accuracy: K/N runs every N-th case from the K-th")
    ap.add_argument("--tune", action="store_true", help="first time the backward kernels' candidate configs "
                    "(gpu-tune.md), then run the benchmark with the fastest that meet the rule")
    args = ap.parse_args(argv)
    if args.accuracy:
        dts = tuple(getattr(torch, d) for d in args.dtypes.split(",")) if args.dtypes else None
        shard = tuple(int(x) for x in args.shard.split("/"))
        _, ok = accuracy(torch.cuda.is_available() and not args.dry_run, dts, extended=args.all_cases, shard=shard,
                         echo=lambda line: print(line, flush=True))
        return 0 if ok else 1

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device: run with --dry-run to check the script on a CPU", file=sys.stderr)
        return 2
    tuned = None
    if args.tune:
        if not cuda:
            ap.error("--tune needs a CUDA GPU")
        with open(results_dir(args.out) / "gpu-tune.md", "w") as f:
            tuned = tune_backward(echo=lambda line: (f.write(line + "\n"), f.flush(), print(line, flush=True)))[-1]
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's bf16 dot is garbage
    B, H, D = (4, 16, 128) if cuda else (1, 2, 16)
    Ns = [int(x) for x in args.sizes.split(",")] if args.sizes else ([2048, 8192, 32768] if cuda else [48])
    reps = 10 if cuda else 1
    t_start = time.time()
    torch.manual_seed(0)
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):  # Flex recompiles per mask and shape: never fall back to eager
            setattr(torch._dynamo.config, name, 512)

    # Most important first (the sizes as given, forward first), so the budget can only cut what matters least.
    variants = [x for x in args.variants.split(",") if x]
    modes = [x for x in args.modes.split(",") if x]
    bad = sorted(set(variants) - set(VARIANTS)) + sorted(set(modes) - set(MODES))
    if bad:
        ap.error(f"unknown variant/mode {bad}; choose from {VARIANTS} and {MODES}")
    order = [(N, var, mode) for N in Ns for mode in modes for var in variants]  # sizes in the order given
    rows, checks = [], {}
    for N, variant, mode in tqdm(order, desc="cases"):
        q, k, v = (torch.randn(B, H, N, D, device=device, dtype=dtype) for _ in range(3))
        methods = Methods(variant, N, device, not cuda)
        if N == Ns[0] and mode == "fwd":
            try:
                checks[variant] = check_outputs(methods, q, k, v)
            except Exception as e:  # noqa: BLE001 - a peer's failure is a result, not a crash
                checks[variant] = {"error": repr(e)}
                print(f"check {variant}: {e!r}", file=sys.stderr)
        flops = 4.0 * B * H * D * visible_pairs(variant, N, methods.ids) * (3.5 if mode == "fwd+bwd" else 1.0)
        for m in METHODS:
            row = Row(N, variant, mode, m)
            rows.append(row)
            if time.time() - t_start > args.budget:
                row.note = "skipped (budget)"
                continue
            try:
                fn = methods.get(m)
                if fn is None:
                    row.note = "n/a"
                    continue
                row.ms = measure(fn, q, k, v, mode, cuda, reps)
                row.tflops = flops / (row.ms * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - record and go on
                row.note = f"error: {type(e).__name__}"
                print(f"{N} {variant} {mode} {m}: {e!r}", file=sys.stderr)
        del q, k, v
        if cuda:
            torch.cuda.empty_cache()

    import triton
    meta = dict(device=torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or 'dry run'})",
                command="PYTHONPATH=. python -m keyfold bench gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
                cuda=torch.version.cuda, sms=torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
                dtype=str(dtype).replace("torch.", ""), B=B, H=H, D=D, Ns=Ns, torch=torch.__version__,
                triton=triton.__version__, seconds=time.time() - t_start, dry_run=args.dry_run, tuned=tuned)
    rats = ratios(rows)
    out = results_dir(args.out)
    stem = "gpu-dry-run" if args.dry_run else ("gpu-tuned" if args.tune else "gpu")
    trats = time_ratios(rows)
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=[asdict(r) for r in rows], checks=checks,
                                                      targets=rats, time_ratios=trats), indent=1))
    write_markdown(out / f"{stem}.md", meta, rows, checks, rats, trats)
    write_png(out / f"{stem}.png", rows)
    print((out / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
