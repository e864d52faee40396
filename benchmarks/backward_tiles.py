"""keyfold's CPU backward against SDPA's, and the tile kernel's backward beside both, in one run.

keyfold's gradients come from its backward kernel where built (AVX-512, or AVX2 since 2026-12-07), else
from the tile kernel's backward (`kernels.cpu.backward_on_tiles`: PyTorch's fused float32 backward, which
SDPA runs, breaks the 3x correctness rule). This measures backward alone, forward+backward and the
forward+backward peak memory against SDPA on the same inputs, and the tile kernel's backward
(``Backend.TILES``, what a CPU without the backward kernel runs), alternating, best of ``--repeat``.

    .venv/bin/python benchmarks/backward_tiles.py [--out benchmarks/results] [--name backward-tiles] [--quick]
        [--sizes 1024,4096] [--repeat 3] [--dtype float32]

Writes NAME.md and NAME.json under --out, naming the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
import keyfold as kf  # noqa: E402
from keyfold.kernels import cpu, native  # noqa: E402


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _isa() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags) or "none"


def _cases(N):
    return [("dense", None, False), ("causal", kf.causal(), True), ("window256", kf.causal() & kf.window(256), None)]


def _peak_bytes(fn) -> int:
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with prof:
        fn()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="backward-tiles")
    ap.add_argument("--quick", action="store_true", help="1k tokens, 2 repeats, no memory column")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", default=None, help="comma-separated token counts (default 1024,4096; --quick 1024)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [1024] if args.quick else [1024, 4096]
    repeat = 2 if args.quick else args.repeat
    H, D = 8, 64
    probe = torch.ones(1, dtype=dtype)
    rows = []
    for N in sizes:
        q, k, v = (torch.randn(1, H, N, D, dtype=dtype, requires_grad=True) for _ in range(3))
        do = torch.randn(1, H, N, D, dtype=dtype)
        for name, mask, is_causal in _cases(N):
            def ours():
                return kf.attention(q, k, v, mask=mask)

            def tiles():
                return kf.attention(q, k, v, mask=mask, backend=kf.Backend.TILES)

            def sdpa():
                if is_causal is None:  # a window: SDPA with the mask as a dense bool tensor
                    i = torch.arange(N)
                    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= 256)
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

            who_fn = (("keyfold", ours), ("sdpa", sdpa), ("tiles", tiles))
            best = {who: [float("inf")] * 2 for who, _ in who_fn}
            for _, fn in who_fn:  # warm: plans, caches, the allocator
                fn().backward(do)
            q.grad = k.grad = v.grad = None
            for _ in range(repeat):
                for who, fn in who_fn:
                    t0 = time.perf_counter()
                    out = fn()
                    t1 = time.perf_counter()
                    out.backward(do)
                    t2 = time.perf_counter()
                    q.grad = k.grad = v.grad = None
                    best[who] = [min(best[who][0], t2 - t1), min(best[who][1], t2 - t0)]
            row = dict(N=N, variant=name, keyfold_bwd_s=best["keyfold"][0], sdpa_bwd_s=best["sdpa"][0],
                       keyfold_fwdbwd_s=best["keyfold"][1], sdpa_fwdbwd_s=best["sdpa"][1],
                       tiles_bwd_s=best["tiles"][0])
            if not args.quick:
                row["keyfold_peak_mib"] = _peak_bytes(lambda: ours().backward(do)) / 2 ** 20
                row["sdpa_peak_mib"] = _peak_bytes(lambda: sdpa().backward(do)) / 2 ** 20
                q.grad = k.grad = v.grad = None
            rows.append(row)
            print(f"N={N} {name}: backward {row['keyfold_bwd_s']:.3f} s vs SDPA {row['sdpa_bwd_s']:.3f} s, "
                  f"tiles {row['tiles_bwd_s']:.3f} s", flush=True)
    machine = dict(cpu=_cpu_name(), isa=_isa(), threads=torch.get_num_threads(),
                   torch=torch.__version__, backward_kernel=native.backward_available(),
                   dtype=args.dtype, backward_on_tiles=cpu.backward_on_tiles(probe, probe))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(dict(machine=machine, heads=H, head_dim=D, repeat=repeat, rows=rows), f, indent=1)
    lines = [f"# {args.dtype} backward: keyfold vs SDPA, the tile kernel's beside them ({args.name})", "",
             f"Machine: {machine['cpu']}, instruction sets: {machine['isa']}, {machine['threads']} threads, torch "
             f"{machine['torch']}; keyfold's backward kernel built: {machine['backward_kernel']}; {args.dtype} "
             f"gradients on the tile kernel: {machine['backward_on_tiles']}. B=1, H={H}, D={D}, {args.dtype}, best of "
             f"{repeat}, alternating. SDPA gets the window as a dense bool mask. `tiles bwd s`: the same call on "
             "`Backend.TILES`.", "",
             "| N | variant | keyfold bwd s | SDPA bwd s | bwd ratio | keyfold fwd+bwd s | SDPA fwd+bwd s | "
             "fwd+bwd ratio | peak MiB keyfold / SDPA | tiles bwd s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = (f"{r['keyfold_peak_mib']:.1f} / {r['sdpa_peak_mib']:.1f}" if "keyfold_peak_mib" in r else "n/a")
        lines.append(f"| {r['N']} | {r['variant']} | {r['keyfold_bwd_s']:.3f} | {r['sdpa_bwd_s']:.3f} | "
                     f"{r['keyfold_bwd_s'] / r['sdpa_bwd_s']:.2f} | {r['keyfold_fwdbwd_s']:.3f} | "
                     f"{r['sdpa_fwdbwd_s']:.3f} | {r['keyfold_fwdbwd_s'] / r['sdpa_fwdbwd_s']:.2f} | {peak} | "
                     f"{r['tiles_bwd_s']:.3f} |")
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
