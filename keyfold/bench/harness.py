"""The one timing harness every benchmark uses, and where results go.

- :func:`interleaved`: warm-up, then the callables run *alternately* (so a drifting load hits
  every implementation alike), median and minimum per name; the peer is always timed in the
  same run. CUDA work is synchronised around each sample.
- :func:`results_dir`: ``--out`` if given, else ``benchmarks/results/`` of the repository
  keyfold was imported from (never a path relative to the current directory), else
  ``./benchmarks/results`` for an installed package.
- :func:`machine`: the CPU, its instruction sets (AVX2, AVX-512, AVX-512-BF16, AMX), threads
  and versions, for the header of every results file.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..kernels._common import cpu_flags

__all__ = ["Timing", "interleaved", "results_dir", "machine", "isa_flags", "write_json", "matmul_rate", "matmul_fns",
           "stream_bandwidth", "fit_exponent"]


class Timing(dict):
    """Median seconds per name (the dict itself); minima in ``.best`` (steadier on a loaded machine)."""

    best: dict


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1, *,
                cuda: bool = False, lead: tuple[str, ...] = ()) -> Timing:
    """Median seconds of each callable over ``repeats`` alternating rounds after ``warmup`` rounds.

    lead: names among ``fns`` (the GEMMs a bench times beside attention) that run, in turn, right
    before each of the others, so every other callable runs after the same kind of work. Without
    it a round ran them in a fixed cycle, and whichever came after the GEMMs ran with their
    matrices in the cache every time: keyfold, so its bfloat16 fwd+bwd at 1k read 1.07-1.13x
    SDPA's in rounds with GEMMs and 1.01-1.07x beside SDPA alone. A round with ``lead`` is
    ``l1 a l2 b l1 c``, the next ``l2 a l1 b l2 c``; a lead is timed each time it runs.

    >>> t = interleaved({"a": lambda: None, "b": lambda: None}, repeats=3)
    >>> sorted(t), sorted(t.best)
    (['a', 'b'], ['a', 'b'])
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    unknown = [name for name in lead if name not in fns]
    if unknown:
        raise ValueError(f"lead names {unknown} that are not among fns ({sorted(fns)})")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(cuda)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    rest = [name for name in fns if name not in lead]
    order = list(fns)
    for r in range(repeats):
        if lead and rest:  # the leads turn from round to round; one no other took this round ends it
            before = [lead[(r + i) % len(lead)] for i in range(len(rest))]
            order = [name for pair in zip(before, rest) for name in pair] + [n for n in lead if n not in before]
        for name in order:
            fn = fns[name]
            _sync(cuda)
            t0 = time.perf_counter()
            fn()
            _sync(cuda)
            samples[name].append(time.perf_counter() - t0)
    out = Timing({name: statistics.median(ts) for name, ts in samples.items()})
    out.best = {name: min(ts) for name, ts in samples.items()}
    return out


def _repo_root() -> Path | None:
    """The checkout keyfold runs from (a folder with pyproject.toml and benchmarks/), if any."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "benchmarks").is_dir():
            return parent
    return None


def results_dir(out: str | Path | None = None) -> Path:
    """Where a benchmark writes: ``out``, else the repository's ``benchmarks/results/``."""
    if out is not None:
        path = Path(out)
    else:
        root = _repo_root()
        path = (root if root is not None else Path.cwd()) / "benchmarks" / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path


def isa_flags() -> list[str]:
    """The vector/matrix instruction sets this CPU reports (from /proc/cpuinfo), by common name."""
    names = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512-BF16", "avx512_fp16": "AVX-512-FP16",
             "amx_tile": "AMX", "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8"}
    return [v for k, v in names.items() if k in cpu_flags()]


def machine() -> str:
    """One line naming the machine a result holds on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    isa = ", ".join(isa_flags()) or "no AVX2"
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu} ({isa}){gpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def write_lines(path: Path, lines: list[str]) -> None:
    """Write a results table's lines to ``path`` (its folder made first) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def write_json(path: Path, obj) -> None:
    """Write ``obj`` as indented JSON (atomically: a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


# ------------------------------------------------------------------ the machine's limits


def matmul_fns(dtype: torch.dtype = torch.float32, sizes=(1024, 2048)) -> dict[str, tuple[Callable[[], object], float]]:
    """The square GEMMs that define the machine's matmul rate for ``dtype``: ``{name: (call, FLOPs)}``,
    one or two per size in ``sizes``. A 16-bit dtype also counts the product cast to float32 (the casts
    timed too): on a CPU without float16 units torch's float16 GEMM runs at ~1 GFLOP/s, and the way to
    multiply float16 there, the one keyfold takes, is through float32, so that is the machine's rate for
    the dtype. The native 16-bit GEMM is left out where a probe at n=256 finds it 4x slower than the cast
    (it cannot be the best at any size, and would take minutes). Each writes into its own buffer."""
    half = dtype in (torch.float16, torch.bfloat16)
    native = True
    if half:
        a, b = torch.randn(256, 256).to(dtype), torch.randn(256, 256).to(dtype)
        probe = interleaved({"mm": lambda: a @ b, "cast": lambda: (a.float() @ b.float()).to(dtype)}, 3,
                            warmup=1).best
        native = probe["mm"] < 4 * probe["cast"]
    fns = {}
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        c = torch.empty(n, n, dtype=dtype)
        if native:
            fns[f"mm{n}"] = ((lambda a=a, b=b, c=c: torch.mm(a, b, out=c)), 2.0 * n ** 3)
        if half:
            wide = [torch.empty(n, n) for _ in range(3)]

            def via_float32(a=a, b=b, c=c, wide=wide):
                wide[0].copy_(a)
                wide[1].copy_(b)
                torch.mm(wide[0], wide[1], out=wide[2])
                return c.copy_(wide[2])

            fns[f"mm{n} via float32"] = (via_float32, 2.0 * n ** 3)
    return fns


def matmul_rate(dtype: torch.dtype = torch.float32, sizes=(1024, 2048), repeats: int = 5) -> float:
    """The machine's dense matmul rate for ``dtype`` in GFLOP/s: the best of ``matmul_fns`` (fastest
    repeat, after warm-up), the ceiling an attention forward can approach (its FLOPs are two GEMMs per
    tile). The best, not the median: a roof measured low would flatter every row."""
    fns = matmul_fns(dtype, sizes)
    best = 0.0
    for n in sizes:  # the ways of one size timed against each other
        ways = {name: fn for name, fn in fns.items() if name.split()[0] == f"mm{n}"}
        t = interleaved({k: f for k, (f, _) in ways.items()}, repeats, warmup=3).best
        best = max(best, max(flop / t[k] / 1e9 for k, (_, flop) in ways.items()))
    return best


def stream_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Main-memory bandwidth in GB/s from a stream copy (bytes read + bytes written, median):
    the ceiling of decode, which reads each cached key and value once."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = interleaved({"copy": lambda: dst.copy_(src)}, repeats, warmup=2).best["copy"]
    return 2.0 * nbytes / t / 1e9  # the best repeat, for the same reason as matmul_rate


def fit_exponent(ns, ts) -> float:
    """The slope ``p`` of the least-squares line through ``(log N, log t)``: ``t ~ c * N**p``.

    >>> round(fit_exponent([1, 2, 4, 8], [3, 12, 48, 192]), 6)
    2.0
    """
    ns, ts = np.asarray(ns, dtype=float), np.asarray(ts, dtype=float)
    if ns.shape != ts.shape or ns.size < 2:
        raise ValueError(f"fit_exponent needs two or more (N, t) pairs of equal length, got {ns.size} and {ts.size}")
    if (ns <= 0).any() or (ts <= 0).any():
        raise ValueError("fit_exponent: every N and time must be positive (it fits on log-log axes)")
    return float(np.polyfit(np.log(ns), np.log(ts), 1)[0])
