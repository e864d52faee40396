"""``python -m keyfold bench memory``: peak memory of forward+backward, keyfold beside SDPA.

Method (a CPU has no allocator statistics): every (variant, N, implementation) runs in a fresh
Python process. The child builds q, k, v and the output gradient, warms the implementation up on a
tiny problem (so one-time library set-up is not charged to the call), resets the kernel's peak-RSS
counter (``echo 5 > /proc/self/clear_refs``), reads its resident memory, runs one forward+backward
at size N and reads the high-water mark ``VmHWM`` from ``/proc/self/status``. The reported number is
``VmHWM - resident before the call``: everything the call itself touched (output, gradients,
scratch, and for SDPA the dense N x N mask it needs, which is built inside the measured region).
``ru_maxrss`` is not used: Linux carries the forking parent's RSS into it across exec.

SDPA with a dense mask allocates O(N^2); a case whose estimate (the previous size's measurement
scaled by N^2, else the bool and float N x N masks) exceeds ``--max-gib`` is not run and the
report says how much it would need.
Results go to ``benchmarks/results/memory.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import keyfold as kf

from .harness import machine, results_dir, write_json

__all__ = ["MemCase", "VARIANTS", "blocks_visited", "measure", "run", "markdown", "main"]

#: variants of the kernels bench measured here (names from :data:`keyfold.bench.kernels.VARIANTS`)
VARIANTS = ("dense", "causal", "window1024", "documents8", "prefix-lm")
IMPLS = ("keyfold", "sdpa")


@dataclass(frozen=True)
class MemCase:
    variant: str
    N: int
    impl: str       # "keyfold" | "sdpa"
    B: int = 1
    H: int = 1
    D: int = 64
    threads: int = 2


_CHILD = r"""
import gc, json, resource, sys, time
import torch
import torch.nn.functional as F
import keyfold as kf
from keyfold.bench.kernels import BY_NAME, settings

variant, impl = sys.argv[1], sys.argv[3]
N, B, H, D, threads = int(sys.argv[2]), *map(int, sys.argv[4:8])
torch.set_num_threads(threads)
sdpa_kind = BY_NAME[variant].sdpa


def step(n, q, k, v, dout):
    mask, score, _, _ = settings(variant, n, H)
    if impl == "keyfold":
        out = kf.attention(q, k, v, mask=mask, score=score)
    else:
        m = kf.as_mask(mask).to_dense(n, n) if sdpa_kind == "mask" else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=sdpa_kind == "causal")
    out.backward(dout)


def inputs(n):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_(True) for _ in range(3))
    return q, k, v, torch.randn(B, H, n, D, generator=g)


step(128, *inputs(128))  # one-time set-up (thread pool, kernels) is not the call's memory; kept tiny,
# since the call may reuse what the warm-up freed
q, k, v, dout = inputs(N)
gc.collect()
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    reset = True
except OSError:
    reset = False
page = resource.getpagesize()
before = int(open("/proc/self/statm").read().split()[1]) * page
t0 = time.perf_counter()
step(N, q, k, v, dout)
seconds = time.perf_counter() - t0
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024
print(json.dumps({"extra": max(0, peak - before), "before": before, "peak": peak, "seconds": seconds,
                  "hwm_reset": reset}))
"""


def blocks_visited(variant: str, N: int, H: int = 1) -> tuple[int, int]:
    """(blocks keyfold's plan visits, all blocks) at the default block size."""
    from .kernels import settings

    mask = settings(variant, N, H)[0]
    counts = kf.plan(mask, N, N, H=H).counts()
    return counts["full"] + counts["partial"], sum(counts.values())


def measure(case: MemCase, timeout: float | None = None) -> dict:
    """Run one case in a fresh process; returns its JSON line, or ``{"error": ...}``."""
    cmd = [sys.executable, "-c", _CHILD, case.variant, str(case.N), case.impl, str(case.B), str(case.H), str(case.D),
           str(case.threads)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return {"error": tail[:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _sdpa_estimate(case: MemCase, done: dict) -> float:
    """Bytes SDPA with a dense mask is expected to need at ``case.N``: the largest smaller size
    measured, scaled by N^2; without one, the bool mask and its float copy (5 bytes per pair)."""
    smaller = [(n, r["extra"]) for (v, n, i), r in done.items()
               if v == case.variant and i == "sdpa" and n < case.N and "extra" in r]
    if smaller:
        n, extra = max(smaller)
        return extra * (case.N / n) ** 2
    return 5.0 * case.N * case.N * case.B


def run(variants=VARIANTS, sizes=(16384, 65536), *, H: int = 1, D: int = 64, threads: int = 2,
        max_gib: float = 8.0, timeout: float | None = None, progress=print, on_row=None) -> list[dict]:
    """Measure every (variant, N, impl); returns one row per (variant, N).

    on_row: called with the rows so far after each row (the command writes its files then, so an
    interrupted run keeps what it measured)."""
    from .kernels import BY_NAME

    done: dict = {}
    rows = []
    for N in sorted(sizes):
        for variant in variants:
            visited, total = blocks_visited(variant, N, H)
            row = {"variant": variant, "N": N, "B": 1, "H": H, "D": D, "threads": threads,
                   "blocks_visited": visited, "blocks_total": total, "qkv_bytes": 3 * H * N * D * 4}
            for impl in IMPLS:
                case = MemCase(variant, N, impl, H=H, D=D, threads=threads)
                est = _sdpa_estimate(case, done) if impl == "sdpa" and BY_NAME[variant].sdpa == "mask" else None
                if est is not None and est > max_gib * 2**30:
                    r = {"skipped": f"would need about {est / 2**30:.2g} GiB (over --max-gib {max_gib:g})",
                         "estimate": est}
                else:
                    progress(f"memory: {variant} N={N} {impl} ...")
                    r = measure(case, timeout)
                done[(variant, N, impl)] = r
                row[impl] = r
            rows.append(row)
            if on_row is not None:
                on_row(rows)
    return rows


def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:,.0f}"


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| variant | N | blocks visited | keyfold MiB | SDPA MiB | kf/SDPA | keyfold / (q,k,v bytes) | "
             "keyfold KiB per visited block | keyfold s | SDPA s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in rows:
        kf_ = r["keyfold"].get("extra")
        sd = r["sdpa"].get("extra")
        sd_cell = _mib(sd)
        if "skipped" in r["sdpa"]:
            sd_cell = f"({r['sdpa']['skipped']})"
        elif "error" in r["sdpa"]:
            sd_cell = "error"
            notes.append(f"SDPA {r['variant']} N={r['N']}: {r['sdpa']['error']}")
        if "error" in r["keyfold"]:
            notes.append(f"keyfold {r['variant']} N={r['N']}: {r['keyfold']['error']}")
        ratio = "n/a" if kf_ is None or not sd else f"{kf_ / sd:.2f}"
        per_qkv = "n/a" if kf_ is None else f"{kf_ / r['qkv_bytes']:.2f}"
        per_block = "n/a" if kf_ is None else f"{kf_ / 1024 / r['blocks_visited']:.1f}"
        secs = [("n/a" if r[i].get("seconds") is None else f"{r[i]['seconds']:.1f}") for i in IMPLS]
        lines.append(f"| {r['variant']} | {r['N']} | {r['blocks_visited']:,} of {r['blocks_total']:,} "
                     f"({r['blocks_visited'] / r['blocks_total']:.1%}) | {_mib(kf_)} | {sd_cell} | {ratio} | "
                     f"{per_qkv} | {per_block} | {secs[0]} | {secs[1]} |")
    if notes:
        lines += ["", "Errors:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


HOW = ("Peak memory of one forward+backward (float32), each case in a fresh process: the kernel's peak-RSS "
       "counter is reset (`/proc/self/clear_refs`) after inputs are built and a tiny warm-up has run, and the "
       "table shows `VmHWM` minus the resident memory just before the call, i.e. everything the call itself "
       "touched: output, gradients, scratch, and for SDPA the dense N×N mask it needs (built inside the "
       "measured region). `blocks visited` are the non-empty 256×256 blocks of keyfold's plan. SDPA is "
       "`F.scaled_dot_product_attention` with `is_causal` for causal and a dense bool mask for the sparse "
       "masks.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m keyfold bench memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536], help="sequence lengths N")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="kernels-bench variant names")
    ap.add_argument("--heads", type=int, default=1, help="heads H (B=1)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim D")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    ap.add_argument("--max-gib", type=float, default=8.0,
                    help="skip an SDPA dense-mask case expected to need more than this (default 8)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds allowed per case")
    ap.add_argument("--note", default="", help="a sentence for the header (e.g. the machine's load)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: benchmarks/results)")
    ap.add_argument("--name", default="memory", help="file stem for the results")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in the results file (a row measured again is replaced)")
    args = ap.parse_args(argv)
    from .kernels import BY_NAME

    unknown = [v for v in args.variants if v not in BY_NAME]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(BY_NAME)}")
    out = results_dir(args.out)
    command = f"python -m keyfold bench memory {shlex.join(argv if argv is not None else sys.argv[1:])}".strip()
    prior = {"rows": [], "commands": [], "notes": []}
    if args.append and (out / f"{args.name}.json").is_file():
        prior = json.loads((out / f"{args.name}.json").read_text())
        prior.setdefault("commands", []), prior.setdefault("notes", [prior.get("note", "")])
    commands = prior["commands"] + [command]
    notes = [n for n in prior["notes"] + [args.note] if n]
    header = (f"# Peak memory of forward+backward, keyfold vs SDPA\n\nMachine: {machine()}; each case ran with "
              f"{args.threads} threads. B=1, H={args.heads}, D={args.head_dim}, float32.\n"
              + "".join(f"\n{n}\n" for n in notes) + f"\n{HOW}\n\n"
              + "Command" + ("s" if len(commands) > 1 else "") + ": " + "; ".join(f"`{c}`" for c in commands))

    def write(rows):
        new = {(r["variant"], r["N"]) for r in rows}
        merged = [r for r in prior["rows"] if (r["variant"], r["N"]) not in new] + rows
        merged.sort(key=lambda r: (r["N"], VARIANTS.index(r["variant"]) if r["variant"] in VARIANTS else 99))
        (out / f"{args.name}.md").write_text(markdown(merged, header))
        write_json(out / f"{args.name}.json", {"machine": machine(), "threads": args.threads, "method": HOW,
                                               "notes": notes, "commands": commands, "rows": merged})
        return merged

    rows = run(args.variants, args.sizes, H=args.heads, D=args.head_dim, threads=args.threads,
               max_gib=args.max_gib, timeout=args.timeout, progress=lambda s: print(s, file=sys.stderr, flush=True),
               on_row=write)
    rows = write(rows)
    print(markdown(rows, header))
    return 0
