"""Paired A/B timing of keyfold's prefill kernel built from two or more copies of its sources.

A change to ``keyfold/kernels/prefill.c`` moves a 4k call by a few percent, less than this machine's
noise between runs (two shared cores); only builds timed side by side in one process tell. Each
argument is ``name=folder``, the folder holding ``decode.c``, ``prefill.c`` and ``simd.h`` (a copy of
``keyfold/kernels`` with the change). Every round times each build once, in a shuffled order, each
call after a 2048 x 2048 GEMM of the dtype (the bench's rounds do the same: caches and clocks as a
call inside a model meets them); the answer is the median over rounds of each build's time over the
first's, and whether its output is bit for bit the first's::

    cp -r keyfold/kernels/. /tmp/mine   # then edit /tmp/mine/prefill.c
    .venv/bin/python benchmarks/kernel_ab.py now=keyfold/kernels mine=/tmp/mine --variant causal
"""
import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from keyfold.kernels import native

_VARIANTS = ("causal", "dense")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", metavar="name=folder", help="a build: its name and source folder")
    ap.add_argument("--variant", choices=_VARIANTS, default="causal")
    ap.add_argument("--n", type=int, default=4096, help="rows and keys (default 4096)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--no-gemm", action="store_true", help="no GEMM between calls")
    args = ap.parse_args()

    libs = {}
    for spec in args.builds:
        name, sep, folder = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"builds: {spec!r} is not name=folder (e.g. now=keyfold/kernels)")
        d = Path(folder)
        sources = (d / "decode.c", d / "prefill.c")
        missing = [str(f) for f in (*sources, d / "simd.h") if not f.exists()]
        if missing:
            raise SystemExit(f"builds: {name} lacks {', '.join(missing)}; copy keyfold/kernels and change it")
        lib, why = native._load(sources, d / "simd.h")
        if lib is None:
            raise SystemExit(f"builds: {name} did not build: {why}")
        if args.dtype == "bfloat16" and lib.kf_prefill_init() != 0:
            raise SystemExit("bfloat16 needs AMX and the OS's leave to use it; pass --dtype float32")
        libs[name] = lib

    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    H, N, D = args.heads, args.n, args.head_dim
    q, k, v = (torch.randn(1, H, N, D, generator=g).to(dt) for _ in range(3))  # (B, H, N, D)
    table = torch.tensor([native.piece_row(0, N, 0, N, args.variant == "causal")], dtype=torch.int64)
    outs = {n: (torch.empty(1, H, N, D, dtype=dt), torch.empty(1, H, N)) for n in libs}
    gemm = torch.randn(2048, 2048, generator=g).to(dt)

    def call(name):
        rc = native._prefill_on(libs[name], q, k, v, D ** -0.5, table, 0.0, *outs[name])
        if rc != 0:
            raise SystemExit(f"{name}: the kernel refused the call (code {rc})")

    names = list(libs)
    for n in names:  # warm: build the threads, touch the buffers
        call(n)
    first = names[0]
    times = {n: [] for n in names}
    for _ in range(args.rounds):
        for n in random.sample(names, len(names)):
            if not args.no_gemm:
                gemm @ gemm
            t = time.perf_counter()
            call(n)
            times[n].append(time.perf_counter() - t)
    print(f"{args.variant} N={N} H={H} D={D} {args.dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds"
          f"{'' if args.no_gemm else ', a GEMM before each call'}")
    for n in names:
        ratio = statistics.median(a / b for a, b in zip(times[n], times[first]))
        same = all(torch.equal(x, y) for x, y in zip(outs[n], outs[first]))
        print(f"  {n:>12}: median {statistics.median(times[n]) * 1e3:7.2f} ms, fastest {min(times[n]) * 1e3:7.2f} ms, "
              f"x{ratio:.3f} of {first}'s time, output {'bit for bit' if same else 'NOT bit for bit'} {first}'s")


if __name__ == "__main__":
    main()
