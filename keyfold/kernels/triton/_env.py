"""Backend.TRITON's environment: the optional triton import, limits, availability checks."""

import os
import warnings

import torch

try:  # triton is optional: without it the backend reports itself unavailable
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

    class _NoTriton:  # lets the kernels below be defined (never run) without triton
        constexpr = object

    tl = _NoTriton()

    def _jit(fn):
        return fn

_FALLBACK_SPAN = 1024   # the tile kernel's longest key span per piece (its tile memory bound)
_MAX_POS = 1 << 30      # absolute positions stay below this so int32 arithmetic cannot wrap
_BIG = _MAX_POS         # stands for "unbounded" in window/sinks parameters
_TILE_BITMAP_BUDGET = 1 << 28  # bytes of per-tile bitmaps a mask callable may use


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """Triton importable, and a CUDA device or the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and (torch.cuda.is_available() or _interpreting())


def check_supported(q, score) -> None:
    """Raise, saying what to do, when Backend.TRITON cannot run on ``q`` at all.

    What the kernel cannot run for these particular inputs (float64, a ``score_mod`` callable,
    head_dim > 256) is :func:`why_not_native`'s to say.
    """
    if triton is None:
        raise RuntimeError("Backend.TRITON needs the triton package: `pip install triton` "
                           "(it ships with CUDA builds of torch), or use Backend.AUTO")
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu" and _interpreting():
        return
    if q.device.type == "cpu":
        raise ValueError("Backend.TRITON runs on CUDA tensors; on a CPU use Backend.AUTO (the fused CPU "
                         "kernel), or set TRITON_INTERPRET=1 before triton is imported to run the kernel "
                         "in Triton's (slow) interpreter, as the tests do")
    raise ValueError(f"Backend.TRITON runs on CUDA tensors, got {q.device}; use Backend.TILES there")


_WARNED: set = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"keyfold Backend.TRITON: {msg}", RuntimeWarning, stacklevel=4)


# ============================================================================ the mask program
