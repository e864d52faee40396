"""``python -m keyfold bench scaling``: how keyfold's time grows with N, per mask.

For N from 1k to 128k tokens (float32 forward, B=1 and few heads so 128k causal takes about a
minute), the masks of one N run alternately (:func:`~keyfold.bench.harness.interleaved`), and we
report the time, the blocks keyfold's plan visits (non-empty 256x256 blocks) and the time per
visited block. :func:`fit_exponent` fits ``time ~ c * N**p`` by least squares on log-log axes: a
mask whose work per row is bounded (a window, documents of a fixed length) should give p ~ 1,
causal p ~ 2, and time per visited block should stay flat (exponent ~ 0) for every mask, i.e. a
sparse mask costs what it computes.
Results go to ``benchmarks/results/scaling.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import shlex
import gc
import sys
from pathlib import Path

import torch

import keyfold as kf

from .harness import fit_exponent, interleaved, machine, results_dir, write_json

__all__ = ["MASKS", "mask_for", "fit_exponent", "run", "markdown", "plot", "main"]

WINDOW = 1024
DOC_LEN = 1024
MASKS = ("causal", f"window{WINDOW}", f"documents{DOC_LEN}")
SIZES = tuple(1024 * 2 ** i for i in range(8))  # 1k .. 128k


def mask_for(name: str, N: int):
    """The keyfold mask of a scaling case: causal; causal within a window; causal within documents
    of a fixed length (the last one shorter)."""
    if name == "causal":
        return kf.causal()
    if name.startswith("window"):
        return kf.causal() & kf.window(int(name[len("window"):]))
    if name.startswith("documents"):
        length = int(name[len("documents"):])
        return kf.documents(torch.arange(N) // length) & kf.causal()
    raise KeyError(f"unknown scaling mask {name!r}; choose from {MASKS}")


def _repeats(N: int) -> tuple[int, int]:
    """(repeats, warm-up rounds): several up to 16k, one timed call above; always one warm-up call
    first, which builds the mask tiles the plan then keeps (timing the first call above 16k made
    documents look 2.5x dearer per block there than below: a cold call among warm ones)."""
    return (3, 1) if N <= 16384 else (1, 1)


def run(sizes=SIZES, masks=MASKS, *, H: int = 1, D: int = 64, progress=print) -> list[dict]:
    """Time every mask at every N; one row per (mask, N)."""
    rows = []
    for N in sorted(sizes):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, H, N, D, generator=g) for _ in range(3))  # (B, H, N, D)
        built = {m: mask_for(m, N) for m in masks}
        for m in built.values():  # plan outside the timing (a plan is built once and cached)
            kf.planner._plan(m, N, N, H=H)
        repeats, warmup = _repeats(N)
        progress(f"scaling: N={N} ({repeats} repeats)")
        fns = {name: (lambda m=m: kf.attention(q, k, v, mask=m)) for name, m in built.items()}
        t = interleaved(fns, repeats, warmup=warmup)
        for name, m in built.items():
            counts = kf.plan(m, N, N, H=H).counts()
            visited = counts["full"] + counts["partial"]
            rows.append({"mask": name, "N": N, "H": H, "D": D, "seconds": t[name], "best": t.best[name],
                         "repeats": repeats, "blocks_visited": visited, "blocks_total": sum(counts.values()),
                         "us_per_block": t[name] / visited * 1e6})
        del q, k, v, fns
        gc.collect()
    return rows


def fits(rows: list[dict]) -> dict:
    """Per mask: fitted exponents of time, visited blocks and time per visited block vs N."""
    out = {}
    for name in dict.fromkeys(r["mask"] for r in rows):
        rs = [r for r in rows if r["mask"] == name]
        if len(rs) < 2:
            continue
        ns = [r["N"] for r in rs]
        out[name] = {"time": fit_exponent(ns, [r["seconds"] for r in rs]),
                     "blocks": fit_exponent(ns, [r["blocks_visited"] for r in rs]),
                     "per_block": fit_exponent(ns, [r["us_per_block"] for r in rs])}
    return out


def markdown(rows: list[dict], fitted: dict, header: str) -> str:
    masks = list(dict.fromkeys(r["mask"] for r in rows))
    ns = sorted({r["N"] for r in rows})
    by = {(r["mask"], r["N"]): r for r in rows}
    lines = [header, "", "Fitted exponent p of `x ~ N**p` (least squares on log-log axes, every N):", "",
             "| mask | time | visited blocks | time per visited block |", "|---|---|---|---|"]
    for m in masks:
        if m in fitted:
            f = fitted[m]
            lines.append(f"| {m} | {f['time']:.2f} | {f['blocks']:.2f} | {f['per_block']:.2f} |")
    lines += ["", "Forward seconds (median) and µs per visited block:", "",
              "| N | " + " | ".join(f"{m} s | {m} blocks | {m} µs/block" for m in masks) + " |",
              "|---|" + "---|---|---|" * len(masks)]
    for n in ns:
        cells = []
        for m in masks:
            r = by.get((m, n))
            cells += ["n/a"] * 3 if r is None else [f"{r['seconds']:.4f}", f"{r['blocks_visited']:,}",
                                                     f"{r['us_per_block']:.0f}"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], fitted: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for m in dict.fromkeys(r["mask"] for r in rows):
        rs = sorted((r for r in rows if r["mask"] == m), key=lambda r: r["N"])
        p = fitted.get(m, {})
        ax1.plot([r["N"] for r in rs], [r["seconds"] for r in rs], "o-",
                 label=f"{m} (p={p['time']:.2f})" if p else m)
        ax2.plot([r["N"] for r in rs], [r["us_per_block"] for r in rs], "o-",
                 label=f"{m} (p={p['per_block']:.2f})" if p else m)
    for ax, ylabel in ((ax1, "forward seconds"), (ax2, "µs per visited 256×256 block")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m keyfold bench scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="sequence lengths (default 1k..128k)")
    ap.add_argument("--masks", nargs="+", default=list(MASKS), help=f"masks (default {' '.join(MASKS)})")
    ap.add_argument("--heads", type=int, default=1, help="heads H (B=1)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim D")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--note", default="", help="a sentence for the header (e.g. the machine's load)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: benchmarks/results)")
    ap.add_argument("--name", default="scaling", help="file stem for the results")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for m in args.masks:
        try:
            mask_for(m, 1024)
        except (KeyError, ValueError) as e:
            raise SystemExit(f"--masks: {e}") from None
    if len(args.sizes) < 2:
        raise SystemExit("--sizes: give two or more lengths (the exponent is a fit)")
    rows = run(args.sizes, args.masks, H=args.heads, D=args.head_dim,
               progress=lambda s: print(s, file=sys.stderr, flush=True))
    fitted = fits(rows)
    cmd = shlex.join(argv if argv is not None else sys.argv[1:])
    header = (f"# How keyfold's forward time grows with N\n\nMachine: {machine()}. B=1, H={args.heads}, "
              f"D={args.head_dim}, float32, forward; the masks of one N run alternately, median of "
              f"{_repeats(1024)[0]} repeats up to 16k and one call above, each after a warm-up call (planning and mask tiles are not timed).\n"
              + (f"\n{args.note}\n" if args.note else "")
              + f"\nCommand: `{f'python -m keyfold bench scaling {cmd}'.strip()}`")
    out = results_dir(args.out)
    md = markdown(rows, fitted, header)
    (out / f"{args.name}.md").write_text(md)
    write_json(out / f"{args.name}.json", {"machine": machine(), "threads": torch.get_num_threads(),
                                           "note": args.note, "fits": fitted, "rows": rows})
    plot(rows, fitted, out / f"{args.name}.png",
         f"keyfold forward, B=1 H={args.heads} D={args.head_dim} float32; {machine()}")
    print(md)
    return 0
