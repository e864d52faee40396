"""Backend.TRITON: placeholder until the Triton piece kernel lands (issue: GPU path)."""

from __future__ import annotations


def available() -> bool:
    return False


def check_supported(q, score) -> None:
    raise NotImplementedError("Backend.TRITON is not built yet; use Backend.AUTO (CPU or tile kernel)")


def forward(q, k, v, plan, pb):  # pragma: no cover - guarded by check_supported
    raise NotImplementedError


def backward(q, k, v, out, lse, dout, dlse, plan, pb):  # pragma: no cover
    raise NotImplementedError
