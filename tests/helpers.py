"""The correctness rule every kernel and variant is held to (DESIGN.md section 6).

``ref`` is keyfold's reference in float64; ``naive`` is the plain same-dtype torch
implementation (scores and bias in the input dtype, masked entries -inf, softmax in float32
cast back, ``@ v`` in the input dtype). keyfold's error must be at most 2x naive's (3x for
gradients) plus 1e-6, on rows that see at least one key; rows that see none must be 0.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import keyfold
from keyfold.kernels._common import Problem
from keyfold.kernels.reference import attend_naive
from keyfold.masks import as_mask, grid_positions
from keyfold.scores import aligned, as_score


def naive_attention(q, k, v, *, mask=None, score=None, scale=None, q_offset=None, kv_offset=0, return_lse=False,
                    **_engine_only):
    """The plain same-dtype implementation (the yardstick, materialises Nq x Nk); with ``return_lse``
    also its float32 lse (0 on rows that see no key)."""
    Nq, Nk, D = q.shape[2], k.shape[2], q.shape[-1]
    pb = Problem(as_mask(mask), aligned(as_score(score), as_mask(mask), q.shape[0]), D ** -0.5 if scale is None else scale,
                 kv_offset + Nk - Nq if q_offset is None else q_offset, kv_offset)
    return attend_naive(q, k, v, pb, with_lse=return_lse)


def visible_rows(q, k, *, mask=None, q_offset=None, kv_offset=0):
    """``(B|1, H|1, Nq)`` bool: rows that see at least one key."""
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    q_offset = kv_offset + Nk - Nq if q_offset is None else q_offset
    mask = as_mask(mask)
    if mask is None:
        return torch.ones(1, 1, Nq, dtype=torch.bool)
    b, h, qp, kp = grid_positions(B, Hq, q_offset, Nq, kv_offset, Nk, q.device)
    return torch.broadcast_to(mask.evaluate(b, h, qp, kp), (B, Hq, Nq, Nk)).any(-1)


def max_err(a, b, rows=None):
    d = (a.double() - b.double()).abs()
    if rows is not None:
        d = d * torch.broadcast_to(rows, d.shape[:3]).unsqueeze(-1)
    d = torch.nan_to_num(d, nan=float("inf"))
    return float(d.max()) if d.numel() else 0.0


def assert_close_by_rule(got, ref, naive, rows, factor=2.0, what="out"):
    """``max|got - ref| <= factor * max|naive - ref| + 1e-6`` over visible rows."""
    e_got = max_err(got, ref, rows)
    e_naive = max_err(naive, ref, rows)
    bound = factor * e_naive + 1e-6
    assert e_got <= bound, f"{what}: keyfold error {e_got:.3e} > {factor}x naive error {e_naive:.3e} + 1e-6"
    return e_got, e_naive


def assert_forward_by_rule(q, k, v, **kw):
    """Run keyfold (AUTO backend unless given), the float64 reference and naive; assert the rule."""
    backend = kw.pop("backend", keyfold.Backend.AUTO)
    out = keyfold.attention(q, k, v, backend=backend, **kw)
    ref = keyfold.attention(q.double(), k.double(), v.double(), backend=keyfold.Backend.REFERENCE, **kw)
    naive = naive_attention(q, k, v, **kw)
    rows = visible_rows(q, k, mask=kw.get("mask"), q_offset=kw.get("q_offset"), kv_offset=kw.get("kv_offset", 0))
    assert out.dtype == q.dtype and out.shape == naive.shape
    assert not torch.isnan(out).any(), "NaN in keyfold output"
    hidden = ~torch.broadcast_to(rows, out.shape[:3])
    assert bool((out[hidden] == 0).all()), "rows that see no key must be exactly 0"
    return assert_close_by_rule(out, ref, naive, rows)


def _grads(fn, q, k, v, dout, dlse=None):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    if dlse is None:
        out.backward(dout.to(out.dtype))
    else:  # (out, lse): the loss also reads lse (a z-loss, a merge of partial states)
        out, lse = out
        ((out.double() * dout).sum() + (torch.nan_to_num(lse.double(), neginf=0.0) * dlse).sum()).backward()
    return out, q.grad, k.grad, v.grad


def assert_backward_by_rule(q, k, v, lse_grad=False, **kw):
    """Assert the rule (3x) for dq, dk, dv against the float64 reference's autograd; with ``lse_grad``
    the loss also takes a random gradient through lse (``return_lse=True``)."""
    backend = kw.pop("backend", keyfold.Backend.AUTO)
    # dO in the input dtype, as the gradient reaching out is (FlashAttention's tests draw it so and hand
    # the same tensor to the reference): a float64 dO would count its own rounding against the
    # implementation, which never sees those bits
    dout = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=torch.float64).to(q.dtype).double()
    rows = visible_rows(q, k, mask=kw.get("mask"), q_offset=kw.get("q_offset"), kv_offset=kw.get("kv_offset", 0))
    seen = torch.broadcast_to(rows, dout.shape[:3])
    dout = dout * seen.unsqueeze(-1)  # hidden rows carry no gradient
    dlse = torch.randn(q.shape[:3]).double() * seen if lse_grad else None  # lse is float32
    if lse_grad:
        kw["return_lse"] = True
    got = _grads(lambda a, b, c: keyfold.attention(a, b, c, backend=backend, **kw), q, k, v, dout, dlse)
    ref = _grads(lambda a, b, c: keyfold.attention(a, b, c, backend=keyfold.Backend.REFERENCE, **kw),
                 q.double(), k.double(), v.double(), dout, dlse)
    nai = _grads(lambda a, b, c: _finite(naive_attention(a, b, c, **kw)), q, k, v, dout, dlse)
    for name, g, r, n in zip(("dq", "dk", "dv"), got[1:], ref[1:], nai[1:]):
        assert g is not None and not torch.isnan(g).any(), f"{name} is None or NaN"
        assert_close_by_rule(g, r, n, None, factor=3.0, what=name)
    return got


def seeded_qkv(seed, B, Hq, Hkv, Nq, Nk, D, Dv=None, std=1.0, dtype=torch.float32):
    """q and k with scores of spread ``std`` (each scaled by its root), v of unit spread, from one generator
    seeded by ``seed``, in ``dtype``; then torch's own generator seeded too, from which
    :func:`assert_backward_by_rule` draws dO (and dlse)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, Nq, D, generator=g) * std ** 0.5).to(dtype)
    k = (torch.randn(B, Hkv, Nk, D, generator=g) * std ** 0.5).to(dtype)
    v = torch.randn(B, Hkv, Nk, D if Dv is None else Dv, generator=g).to(dtype)
    torch.manual_seed(seed)
    return q, k, v


def _finite(x):
    return tuple(torch.nan_to_num(t) for t in x) if isinstance(x, tuple) else torch.nan_to_num(x)


def require_extra(extra: str) -> None:
    """Skip the calling test module when an application's extra is not installed, with the
    install line as the reason (so the library's tests pass with only the core installed;
    CI installs every extra, so nothing is skipped there)."""
    from keyfold._extras import missing
    absent = missing(extra)
    if absent:
        pytest.skip(f"needs keyfold[{extra}] ({', '.join(absent)} missing): pip install 'keyfold[{extra}]'",
                    allow_module_level=True)


def assert_runs_on_a_small_stack(setup: str, call: str, check: str = "") -> None:
    """Run ``setup`` (statements), then ``call`` (an expression) on a thread with a 128 KiB stack (musl's
    default), then ``check`` (statements, say that the kernel meant ran), in a fresh Python: a
    kernel's scratch on the stack would crash it."""
    code = (f"import threading, torch\n{setup}\nthreading.stack_size(131072)\n"
            f"t = threading.Thread(target=lambda: {call})\nt.start(); t.join()\n{check}\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
