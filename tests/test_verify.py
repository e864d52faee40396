"""keyfold.verify: the a-priori error bound holds, certified bounds are sound, streaming is
bounded, and bad input either works or fails clearly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keyfold
from keyfold.verify import bounds
from keyfold.verify.bounds import error_bound, observed_error, pieces_per_row

from .helpers import visible_rows

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
VARIANTS = ("none", "causal", "window", "sinks", "documents", "alibi", "softcap", "causal+alibi")


def _variant(name, Hq, N):
    if name == "none":
        return None, None
    if name == "causal":
        return keyfold.causal(), None
    if name == "window":
        return keyfold.causal() & keyfold.window(5), None
    if name == "sinks":
        return keyfold.causal() & (keyfold.window(3) | keyfold.sinks(2)), None
    if name == "documents":
        ids = torch.arange(N) // 7
        return keyfold.documents(ids) & keyfold.causal(), None
    if name == "alibi":
        return None, keyfold.alibi(keyfold.alibi_slopes(Hq))
    if name == "softcap":
        return None, keyfold.softcap(5.0)
    if name == "causal+alibi":
        return keyfold.causal(), keyfold.alibi(keyfold.alibi_slopes(Hq))
    raise AssertionError(name)


def _cuts(Nk, m, data):
    """Split [0, Nk) into at most m non-empty chunks at drawn positions."""
    if m == 1 or Nk < 2:
        return [(0, Nk)]
    inner = sorted(set(data.draw(st.lists(st.integers(1, Nk - 1), min_size=m - 1, max_size=m - 1))))
    edges = [0, *inner, Nk]
    return list(zip(edges[:-1], edges[1:]))


# ------------------------------------------------------------------- 1. the error bound


@given(dtype=st.sampled_from(DTYPES), variant=st.sampled_from(VARIANTS), m=st.integers(1, 6),
       Nq=st.integers(1, 24), extra=st.integers(0, 40), D=st.sampled_from([8, 16, 64]),
       gqa=st.booleans(), mag=st.floats(0.1, 4.0), data=st.data())
@settings(max_examples=60)
def test_observed_error_never_exceeds_the_a_priori_bound(dtype, variant, m, Nq, extra, D, gqa, mag, data):
    Nk = Nq + extra
    Hq, Hkv = (4, 2) if gqa else (2, 2)
    mask, score = _variant(variant, Hq, Nk)
    q = (torch.randn(1, Hq, Nq, D) * mag).to(dtype)
    k = (torch.randn(1, Hkv, Nk, D) * mag).to(dtype)
    v = torch.randn(1, Hkv, Nk, D).to(dtype)
    q_off = Nk - Nq
    cuts = _cuts(Nk, m, data)
    parts = [keyfold.attend(q, k[:, :, a:b], v[:, :, a:b], mask=mask, score=score, q_offset=q_off, kv_offset=a)
             for a, b in cuts]
    got = keyfold.merge_all(parts)
    ref = keyfold.attend(q.double(), k.double(), v.double(), mask=mask, score=score,
                         backend=keyfold.Backend.REFERENCE)
    pieces = pieces_per_row(Nq, [b - a for a, b in cuts], bounded_span=score is not None)
    bound = error_bound(q, k, v, mask=mask, score=score, pieces=pieces)
    err = observed_error(got.out, ref.out, ref.lse)
    assert bool((err <= bound.out).all()), f"out error {float((err / bound.out).max()):.3f} x bound"
    seen = torch.isfinite(ref.lse)
    lse_err = (got.lse.double() - ref.lse).abs()[seen]
    assert bool((lse_err <= bound.lse[seen]).all())
    # rows that see no key: exactly 0 and -inf, never NaN
    assert bool((got.out[~seen] == 0).all()) and bool(got.lse[~seen].isneginf().all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cast_output_is_bounded_too(dtype):
    q, k, v = (torch.randn(2, 2, 50, 32).to(dtype) for _ in range(3))
    out = keyfold.attention(q, k, v, mask=keyfold.causal())
    ref = keyfold.attend(q.double(), k.double(), v.double(), mask=keyfold.causal(), backend=keyfold.Backend.REFERENCE)
    bound = error_bound(q, k, v, mask=keyfold.causal())
    assert bool((observed_error(out, ref.out, ref.lse) <= bound.cast).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_exp_is_as_accurate_as_the_bound_assumes(dtype):
    """The bound's one kernel-specific constant (the fused kernel's fast exp) is re-measured."""
    measured = bounds.measure_kernel_exp(dtype)
    w = bounds.roundoff(dtype).w
    assumed = bounds.C_EXP * w if dtype == torch.float32 else bounds.EXP_REDUCED
    assert measured <= assumed


def test_bound_grows_with_keys_pieces_and_score_range():
    q, k, v = (torch.randn(1, 1, 16, 16) for _ in range(3))
    base = float(error_bound(q, k, v, pieces=1).out.max())
    assert float(error_bound(q, k, v, pieces=8).out.max()) > base
    assert float(error_bound(q * 4, k * 4, v, pieces=1).out.max()) > base
    k2, v2 = torch.cat([k] * 8, 2), torch.cat([v] * 8, 2)
    assert float(error_bound(q, k2, v2, pieces=1).out.max()) > base
    # bfloat16's bound is dominated by its own roundoff: about 2 u_in = 2^-7 per unit of |v|
    b16 = error_bound(q.bfloat16(), k.bfloat16(), v.bfloat16(), pieces=1)
    rel = float((b16.out / v.abs().amax(2, keepdim=True).double()).max())
    assert 2 ** -7 < rel < 2 ** -4


def test_error_bound_refuses_unknown_score_mods_clearly():
    q = k = v = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="score modifier"):
        error_bound(q, k, v, score=lambda s, b, h, i, j: s * 2)
    with pytest.raises(ValueError, match="pieces"):
        error_bound(q, k, v, pieces=0)
