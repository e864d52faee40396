"""Causal forward+backward of small float32 calls, keyfold against SDPA, the two alternating.

Small calls are where keyfold's float32 backward pays most for its accuracy: a call of fewer than 512
rows per kv head renormalises P by the kernel's own scores in a first pass (README, "How it runs on a
CPU"), and rows of few keys pay the kernel's fixed cost per key block. This measures it at the shapes
a short-sequence training step has (B * H from 64 to 256 rows of 32 to 1024 tokens, D=64).

    .venv/bin/python benchmarks/small_calls.py [--out benchmarks/results]

Writes small-calls.md (median of 15 alternating repeats, after two warm-ups: `harness.interleaved`)
under --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import keyfold as kf
from keyfold.bench.harness import interleaved, machine, write_lines

SHAPES = [(32, 8, 32, 64), (16, 8, 64, 64), (8, 8, 128, 64), (8, 8, 256, 64), (4, 8, 511, 64), (1, 8, 1024, 64)]


def measure(B: int, H: int, N: int, D: int, repeats: int = 15) -> tuple[float, float]:
    """(keyfold, SDPA) median seconds of one causal forward+backward"""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, N, D, generator=g)

    def step(attend):
        q.grad = k.grad = v.grad = None
        attend().backward(do)

    t = interleaved({"keyfold": lambda: step(lambda: kf.attention(q, k, v, mask=kf.causal())),
                     "sdpa": lambda: step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))},
                    repeats, warmup=2)
    return t["keyfold"], t["sdpa"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = ap.parse_args()
    lines = ["# Small calls: causal forward+backward, float32, keyfold vs SDPA", "", f"Machine: {machine()}.", "",
             "| B | H | N | D | keyfold ms | SDPA ms | keyfold / SDPA |", "|---|---|---|---|---|---|---|"]
    for B, H, N, D in SHAPES:
        a, b = measure(B, H, N, D)
        lines.append(f"| {B} | {H} | {N} | {D} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f} |")
        print(lines[-1], flush=True)
    write_lines(args.out / "small-calls.md", lines)


if __name__ == "__main__":
    main()
