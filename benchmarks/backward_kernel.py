"""keyfold's float32 backward kernel alone against PyTorch's fused CPU backward, on the same arguments.

Both take the op's own forward (out, lse) and compute dq, dk, dv of a causal or dense call (B=1, H=8),
alternating, median of 15 rounds after one (`harness.interleaved`); the kernel also with its renormalised first pass
and float64 sums (what a call of few rows and more than 128 head dimensions takes, timed here at
the same sizes to show its cost). GFLOP/s are counted on the visible pairs, 5 products of 2 D FLOPs
each a pair.

    .venv/bin/python benchmarks/backward_kernel.py [--out benchmarks/results] [--quick]

Writes backward-kernel.md under --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from keyfold.bench.harness import interleaved, machine, write_lines
from keyfold.kernels import native

OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def measure(N: int, D: int, causal: bool, repeats: int = 15, H: int = 8) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, H, N, D, generator=g) for _ in range(4))
    out, lse = OP(q, k, v, 0.0, causal)[:2]
    scale = D ** -0.5

    def renormalised():
        native.backward_sums(do, q, k, v, lse, causal, None, scale, wide=True)
        native.backward(do, q, k, v, out, lse, causal, None, scale, wide=True)

    fns = {"op": lambda: BWD(do, q, k, v, out, lse, 0.0, causal, scale=scale),
           "kernel": lambda: native.backward(do, q, k, v, out, lse, causal, None, scale),
           "renormalised float64": renormalised}
    return dict(interleaved(fns, repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    ap.add_argument("--quick", action="store_true", help="N=256 only (a smoke run)")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"keyfold's native kernels are not built here: {native.why()}")
    sizes = [(256, 64)] if args.quick else [(1024, 64), (4096, 64), (4096, 128)]
    lines = ["# keyfold's float32 backward kernel alone vs PyTorch's fused CPU backward", "",
             f"Machine: {machine()}. B=1, H=8; median of 15 rounds, the three alternating.", "",
             "| N | D | mask | op ms | kernel ms | kernel / op | kernel GFLOP/s | renormalised float64 ms | / op |",
             "|---|---|---|---|---|---|---|---|---|"]
    for N, D in sizes:
        for causal in (True, False):
            t = measure(N, D, causal)
            flops = 10 * D * 8 * N * (N + 1) / 2 if causal else 10 * D * 8 * N * N
            lines.append(f"| {N} | {D} | {'causal' if causal else 'none'} | {t['op'] * 1e3:.1f} | "
                         f"{t['kernel'] * 1e3:.1f} | {t['kernel'] / t['op']:.2f} | {flops / t['kernel'] / 1e9:.0f} | "
                         f"{t['renormalised float64'] * 1e3:.1f} | {t['renormalised float64'] / t['op']:.2f} |")
            print(lines[-1], flush=True)
    write_lines(args.out / "backward-kernel.md", lines)


if __name__ == "__main__":
    main()
