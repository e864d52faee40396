"""Paired A/B timing of keyfold's prefill kernel built from two or more copies of its sources.

A change to ``keyfold/kernels/prefill.c`` moves a 4k call by a few percent, less than this machine's
noise between runs (two shared cores); only builds timed side by side in one process tell. Each
argument is ``name=folder``, the folder holding ``decode.c`` (``decode_avx2.c`` on a CPU without
AVX-512), ``prefill.c`` and ``simd.h`` (a copy of ``keyfold/kernels`` with the change). Every round times each build once, in a shuffled order, each
call after a 2048 x 2048 GEMM of the dtype (the bench's rounds do the same: caches and clocks as a
call inside a model meets them); the answer is the median over rounds of each build's time over the
first's, and whether its output is bit for bit the first's::

    cp -r keyfold/kernels/. /tmp/mine   # then edit /tmp/mine/prefill.c
    .venv/bin/python benchmarks/kernel_ab.py now=keyfold/kernels mine=/tmp/mine --variant causal

With ``--fuzz N`` it times nothing: it runs every build on N random layouts (dense, causal,
prefix-LM, a window's band and mask tile, a random mask tile, a row shift, softcap; GQA, strided
keys, head sizes 2 to 256, q scaled up to force the one pass's redo; both dtypes where the build
runs them) and counts the layouts where a build's output or lse is not the first's bit for bit: a
change meant to move no arithmetic must show 0.
"""
import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from keyfold.kernels import native

_VARIANTS = ("causal", "dense")


def _builds(specs: list[str], dtype: str | None) -> dict:
    """name -> the library built from each ``name=folder``"""
    libs = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"builds: {spec!r} is not name=folder (e.g. now=keyfold/kernels)")
        d = Path(folder)
        # the decode kernel the library carries on this CPU (decode_avx2.c where it has no AVX-512)
        sources = (d / ("decode_avx2.c" if native.isa() == "avx2" else "decode.c"), d / "prefill.c")
        missing = [str(f) for f in (*sources, d / "simd.h") if not f.exists()]
        if missing:
            raise SystemExit(f"builds: {name} lacks {', '.join(missing)}; copy keyfold/kernels and change it")
        lib, why = native._load(sources)
        if lib is None:
            raise SystemExit(f"builds: {name} did not build: {why}")
        if dtype == "bfloat16" and lib.kf_prefill_init() != 0:
            raise SystemExit("bfloat16 needs AMX and the OS's leave to use it; pass --dtype float32")
        libs[name] = lib
    return libs


def _time(libs: dict, args: argparse.Namespace) -> None:
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


def _layout(rng: random.Random, seed: int, dt: torch.dtype):
    """One random call: q, k, v, the pieces' table, the tensors it points into, the softcap, a label"""
    g = torch.Generator().manual_seed(seed)
    Hkv = rng.choice([1, 2, 3])
    B, Hq = rng.choice([1, 2]), Hkv * rng.choice([1, 2, 4])
    D = rng.choice([2, 8, 16, 32, 62, 64, 80, 96, 128, 256])
    Dv = rng.choice([D, 16, 64, 100])
    L, S = rng.randint(1, 1200), rng.randint(1, 1200)
    boost = rng.choice([1, 1, 4, 20])  # large scores: the one pass redoes rows
    q = (torch.randn(B, Hq, L, D, generator=g) * boost).to(dt)  # (B, Hq, L, D)
    k = torch.randn(B, Hkv, S + 8, D, generator=g).to(dt)
    k = k[:, :, 3:3 + S] if rng.random() < 0.3 else k[:, :, :S].contiguous()  # strided keys or not
    v = torch.randn(B, Hkv, S, Dv, generator=g).to(dt)
    kind = rng.choice(["dense", "causal", "prefix-lm", "window", "mask", "shift"])
    m = min(L, S)
    keep = []
    if kind == "dense":
        rows = [native.piece_row(0, L, 0, S, False)]
    elif kind == "causal":
        rows = [native.piece_row(0, m, 0, m, True)]
    elif kind == "prefix-lm":
        p = rng.randint(1, max(1, m - 1))
        rows = [native.piece_row(0, m, 0, p, False)] + ([native.piece_row(p, m, p, m, True)] if p < m else [])
    elif kind == "window":  # rows a..b see keys i - W < j <= i: a mask tile behind the diagonal block
        W, rows = rng.randint(1, 300), []
        for a in range(0, m, 256):
            b, lo = min(m, a + 256), max(0, a - rng.randint(1, 300))
            if lo < a:
                i, j = torch.arange(a, b)[:, None], torch.arange(lo, a)[None, :]
                tile = torch.zeros(1, 1, b - a, a - lo).masked_fill_(i - j >= W, float("-inf"))
                keep.append(tile)
                rows.append(native.piece_row(a, b, lo, a, False, tile))
            rows.append(native.piece_row(a, b, a, b, True))
    elif kind == "mask":
        tile = torch.randn(1, 1, L, S, generator=g)
        tile.masked_fill_(tile < -0.5, float("-inf"))
        keep.append(tile)
        rows = [native.piece_row(0, L, 0, S, False, tile)]
    else:
        shift = torch.randn(1, Hq, L, generator=g)
        keep.append(shift)
        rows = [native.piece_row(0, m, 0, m, rng.random() < 0.5, None, shift)]
    cap = rng.choice([0.0, 0.0, 0.0, 20.0])
    label = f"{kind} {dt} B={B} Hq={Hq} Hkv={Hkv} L={L} S={S} D={D} Dv={Dv} q x{boost} cap {cap}"
    return q, k, v, torch.tensor(rows, dtype=torch.int64), keep, cap, label


def _fuzz(libs: dict, n: int) -> None:
    first, rng, differ = next(iter(libs)), random.Random(0), []
    dtypes = [dt for dt in (torch.bfloat16, torch.float32) if native.prefill_available(dt)]
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        q, k, v, table, _keep, cap, label = _layout(rng, i, dt)
        got = {}
        for name, lib in libs.items():
            out, lse = torch.empty(*q.shape[:3], v.shape[-1], dtype=dt), torch.empty(q.shape[:3])
            rc = native._prefill_on(lib, q, k, v, q.shape[-1] ** -0.5, table, cap, out, lse)
            if rc != 0:
                raise SystemExit(f"{name}: the kernel refused layout {i} ({label}; code {rc})")
            got[name] = (out, lse)
        for name in libs:
            if not all(torch.equal(a, b) for a, b in zip(got[name], got[first])):
                differ.append((name, i, label))
    print(f"{n} random layouts ({', '.join(map(str, dtypes))}), {torch.get_num_threads()} threads")
    for name in libs:
        mine = [(i, label) for who, i, label in differ if who == name]
        print(f"  {name:>12}: {len(mine)} of {n} not bit for bit {first}'s"
              + "".join(f"\n      layout {i}: {label}" for i, label in mine[:5]))


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
    ap.add_argument("--fuzz", type=int, metavar="N", help="compare outputs bit for bit on N random layouts; no timing")
    args = ap.parse_args()
    libs = _builds(args.builds, None if args.fuzz else args.dtype)
    if args.fuzz:
        for lib in libs.values():
            lib.kf_prefill_init()  # bfloat16 where this CPU and OS allow it
        _fuzz(libs, args.fuzz)
    else:
        _time(libs, args)


if __name__ == "__main__":
    main()
