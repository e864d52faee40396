"""What the peer ports share: backends, dtypes, input makers, the rule and the xfail marks.

The ports restate the peers' public test cases (PyTorch's FlexAttention tests and
attention-gym's examples; FlashAttention's tests) as keyfold calls. Facts carry over
(which mods, sizes, dtypes, what is compared); the code is keyfold's own. Every case is
judged by the correctness rule of DESIGN.md section 6 through ``tests/helpers.py``.
"""

from __future__ import annotations

import pytest
import torch

import keyfold
from keyfold import Backend
from tests.helpers import (assert_backward_by_rule, assert_close_by_rule, assert_forward_by_rule,
                           naive_attention, visible_rows)

#: the two CPU engines every port runs on (AUTO picks CPU on this machine)
BACKENDS = [pytest.param(Backend.CPU, id="CPU"), pytest.param(Backend.TILES, id="TILES")]

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPE_IDS = {F16: "fp16", BF16: "bf16", F32: "fp32", torch.float64: "fp64"}


def dtypes(*ds):
    return [pytest.param(d, id=DTYPE_IDS[d]) for d in ds]


def known(item: int, why: str):
    """A port that fails today because of a numbered item of issue #16 (strict: it XPASSes once fixed)."""
    return pytest.mark.xfail(strict=True, reason=f"#16 item {item}: {why}")


def new_bug(why: str):
    """A port that fails today for a reason issue #16 does not list."""
    return pytest.mark.xfail(strict=True, reason=f"new: {why}")


def randn(*shape, dtype=F32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


def make_qkv(B, Hq, Nq, D, *, Hkv=None, Nk=None, Dv=None, dtype=F32):
    """q ``(B, Hq, Nq, D)``, k ``(B, Hkv, Nk, D)``, v ``(B, Hkv, Nk, Dv)`` from a normal distribution."""
    Hkv = Hq if Hkv is None else Hkv
    Nk = Nq if Nk is None else Nk
    Dv = D if Dv is None else Dv
    return randn(B, Hq, Nq, D, dtype=dtype), randn(B, Hkv, Nk, D, dtype=dtype), randn(B, Hkv, Nk, Dv, dtype=dtype)


def assert_port(q, k, v, backend, *, grad=True, **kw):
    """Forward (and backward) by the rule: error <= 2x (grads 3x) naive's + 1e-6, hidden rows exactly 0."""
    assert_forward_by_rule(q, k, v, backend=backend, **kw)
    if grad:
        assert_backward_by_rule(q, k, v, backend=backend, **kw)


def assert_captured_grads(q, k, v, make_score, params, backend, **kw):
    """A score callable built by ``make_score(*params)`` from captured tensors that require grad
    (Flex's learnable biases): their gradients obey the rule (3x naive's error vs the float64
    reference's autograd + 1e-6); q, k, v's too."""
    dout = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
    rows = visible_rows(q, k, mask=kw.get("mask"), q_offset=kw.get("q_offset"))
    dout = dout * torch.broadcast_to(rows, dout.shape[:3]).unsqueeze(-1)

    def grads(fn, cast):
        ps = [cast(p).detach().clone().requires_grad_(p.is_floating_point()) for p in params]
        qq, kk, vv = (cast(t).detach().clone().requires_grad_(True) for t in (q, k, v))
        out = fn(qq, kk, vv, make_score(*ps))
        out.backward(dout.to(out.dtype))
        return [qq.grad, kk.grad, vv.grad] + [p.grad for p in ps if p.is_floating_point()]

    same = lambda t: t  # noqa: E731
    f64 = lambda t: t.double() if t.is_floating_point() else t  # noqa: E731
    got = grads(lambda a, b, c, s: keyfold.attention(a, b, c, score=s, backend=backend, **kw), same)
    ref = grads(lambda a, b, c, s: keyfold.attention(a, b, c, score=s, backend=Backend.REFERENCE, **kw), f64)
    nai = grads(lambda a, b, c, s: torch.nan_to_num(naive_attention(a, b, c, score=s, **kw)), same)
    names = ["dq", "dk", "dv"] + [f"d(captured {i})" for i in range(len(got) - 3)]
    for name, g, r, n in zip(names, got, ref, nai):
        assert g is not None, f"{name} is None: the captured tensor got no gradient"
        assert not torch.isnan(g).any(), f"{name} has NaN"
        assert_close_by_rule(g, r, n, None, factor=3.0, what=name)


def assert_state_by_rule(out, ref, naive, rows):
    """The rule for an output computed outside ``attention`` (caches, merges): 2x naive's error."""
    assert not torch.isnan(out).any(), "NaN in keyfold output"
    hidden = ~torch.broadcast_to(rows, out.shape[:3])
    assert bool((out[hidden] == 0).all()), "rows that see no key must be exactly 0"
    return assert_close_by_rule(out, ref, naive, rows)


#: score callables and softcap are not additive: Backend.CPU refuses them (engine._resolve) and
#: Backend.AUTO routes them to TILES, so their cases run once, on TILES
SCORE_BACKENDS = [pytest.param(Backend.TILES, id="TILES")]


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(out.dtype))
    return q.grad, k.grad, v.grad


def assert_fn_by_rule(fn, q, k, v, *, grad=True, **kw):
    """The rule for keyfold computed some other way (pieces merged by hand): ``fn(q, k, v)``
    against the float64 reference and naive of one ``attention(q, k, v, **kw)`` call."""
    rows = visible_rows(q, k, mask=kw.get("mask"), q_offset=kw.get("q_offset"))
    ref_fn = lambda a, b, c: keyfold.attention(a, b, c, backend=Backend.REFERENCE, **kw)  # noqa: E731
    nai_fn = lambda a, b, c: torch.nan_to_num(naive_attention(a, b, c, **kw))  # noqa: E731
    out = fn(q, k, v)
    assert out.dtype == q.dtype
    assert_state_by_rule(out, ref_fn(q.double(), k.double(), v.double()), nai_fn(q, k, v), rows)
    if grad:
        dout = torch.randn(out.shape, dtype=torch.float64) * torch.broadcast_to(rows, out.shape[:3]).unsqueeze(-1)
        got = _grads(fn, q, k, v, dout)
        ref = _grads(ref_fn, q.double(), k.double(), v.double(), dout)
        nai = _grads(nai_fn, q, k, v, dout)
        for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, nai):
            assert g is not None and not torch.isnan(g).any(), f"{name} is None or NaN"
            assert_close_by_rule(g, r, n, None, factor=3.0, what=name)
