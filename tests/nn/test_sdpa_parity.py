"""keyfold.scaled_dot_product_attention against torch's SDPA: the CPU cases of torch's
test/test_transformers.py (TestSDPA, math reference comparisons: sequence lengths, masks, GQA,
scale, causal with L != S, batch dims), forward and backward; tensor masks and dropout."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

import keyfold
from keyfold import scaled_dot_product_attention as kf_sdpa
from keyfold.functional import SDPAInputError
from keyfold.kernels._common import dropout_keep
from keyfold.masks import grid_positions

F64 = torch.float64


def _inputs(q_shape, k_shape, v_dim=None, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    v_shape = k_shape[:-1] + (v_dim or k_shape[-1],)
    return tuple(torch.randn(s, dtype=dtype, generator=g, requires_grad=True) for s in (q_shape, k_shape, v_shape))


def _fwd_bwd(fn, q, k, v, **kw):
    out = fn(q, k, v, **kw)
    g = torch.autograd.grad(out, [q, k, v], torch.ones_like(out) * 0.5 + torch.arange(out.shape[-1], dtype=out.dtype) * 0.1)
    return out, g


def assert_matches_sdpa(q, k, v, tol=1e-10, **kw):
    want, gw = _fwd_bwd(F.scaled_dot_product_attention, q, k, v, **kw)
    got, gg = _fwd_bwd(kf_sdpa, q, k, v, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got, want, atol=tol, rtol=0), float((got - want).abs().max())
    for a, b in zip(gg, gw):
        assert torch.allclose(a, b, atol=tol * 10, rtol=0), float((a - b).abs().max())


@pytest.mark.parametrize("L,S", [(1, 1), (1, 17), (17, 1), (16, 16), (31, 65), (65, 31), (128, 128)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_lengths_and_top_left_causal(L, S, is_causal):
    """test_transformers' different seq lengths, is_causal with L != S (top-left, as in SDPA)."""
    if is_causal and L > S:
        pytest.skip("rows past the last key see keys in both; covered below")
    assert_matches_sdpa(*_inputs((2, 3, L, 16), (2, 3, S, 16)), is_causal=is_causal)


def test_causal_more_queries_than_keys():
    q, k, v = _inputs((1, 2, 9, 8), (1, 2, 4, 8))
    assert_matches_sdpa(q, k, v, is_causal=True)


@pytest.mark.parametrize("scale", [None, 0.05, 1.0, 3.0])
def test_scale(scale):
    assert_matches_sdpa(*_inputs((2, 2, 10, 8), (2, 2, 12, 8)), scale=scale)


@pytest.mark.parametrize("shape", [(10, 8), (3, 10, 8), (2, 3, 10, 8), (2, 2, 3, 10, 8)])
def test_leading_batch_dims(shape):
    kshape = shape[:-2] + (12, 8)
    assert_matches_sdpa(*_inputs(shape, kshape))
    assert_matches_sdpa(*_inputs(shape, kshape), is_causal=True)


def test_value_dim_differs():
    assert_matches_sdpa(*_inputs((2, 2, 7, 8), (2, 2, 9, 8), v_dim=5))


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1), (6, 3), (1, 3)])
def test_gqa(hq, hkv):
    q, k, v = _inputs((2, hq, 7, 8), (2, hkv, 9, 8))
    if hq % hkv == 0:
        assert_matches_sdpa(q, k, v, enable_gqa=True)
        assert_matches_sdpa(q, k, v, enable_gqa=True, is_causal=True)
    if 1 in (hq, hkv):  # a head dim of 1 broadcasts without enable_gqa
        assert_matches_sdpa(q, k, v)
        return
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        kf_sdpa(q, k, v)


@pytest.mark.parametrize("mshape", [(7, 9), (1, 1, 7, 9), (2, 1, 7, 9), (2, 3, 7, 9), (2, 1, 1, 9), (1, 3, 7, 1)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(mshape, kind):
    q, k, v = _inputs((2, 3, 7, 8), (2, 3, 9, 8))
    g = torch.Generator().manual_seed(1)
    if kind == "bool":
        m = torch.rand(mshape, generator=g) > 0.3
        m = m | (torch.arange(mshape[-1]) == 0)  # every row sees a key (SDPA's math gives NaN otherwise)
    else:
        m = torch.randn(mshape, dtype=F64, generator=g)
    assert_matches_sdpa(q, k, v, attn_mask=m)


def test_mask_and_is_causal_together_need_both():
    q, k, v = _inputs((1, 2, 6, 4), (1, 2, 6, 4))
    m = torch.rand(6, 6) > 0.3
    m[:, 0] = True
    f = torch.randn(6, 6, dtype=F64)
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.allclose(kf_sdpa(q, k, v, attn_mask=m, is_causal=True),
                          F.scaled_dot_product_attention(q, k, v, attn_mask=m & tril), atol=1e-12)
    assert torch.allclose(kf_sdpa(q, k, v, attn_mask=f, is_causal=True),
                          F.scaled_dot_product_attention(q, k, v, attn_mask=f.masked_fill(~tril, float("-inf"))),
                          atol=1e-12)


def test_float32_matches_within_the_rule():
    q, k, v = _inputs((2, 4, 33, 16), (2, 4, 47, 16), dtype=torch.float32)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    naive = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = kf_sdpa(q, k, v, is_causal=True)
    assert (got.double() - ref).abs().max() <= 2 * (naive.double() - ref).abs().max() + 1e-6


def test_row_that_sees_no_key_is_zero():
    q, k, v = _inputs((1, 1, 3, 4), (1, 1, 5, 4))
    m = torch.ones(3, 5, dtype=torch.bool)
    m[1] = False
    out = kf_sdpa(q, k, v, attn_mask=m)
    assert torch.equal(out[0, 0, 1], torch.zeros(4, dtype=F64)) and not torch.isnan(out).any()
    out.sum().backward()
    assert not torch.isnan(q.grad).any()


# ------------------------------------------------------------------------ tensor masks (engine)


def test_tensor_mask_is_hashed_by_content_and_skips_empty_tiles():
    from keyfold.dense import tensor_mask
    m = torch.zeros(1, 1, 256, 256, dtype=torch.bool)
    m[..., :64, :64] = True
    a, _ = tensor_mask(m, B=1, H=1, Nq=256, Nk=256)
    b, _ = tensor_mask(m.clone(), B=1, H=1, Nq=256, Nk=256)
    assert a == b and hash(a) == hash(b)
    m[0, 0, 0, 0] = False            # the mask keeps its own copy: later edits do not leak in
    assert a.evaluate(*grid_positions(1, 1, 0, 1, 0, 1, None)).item() is True
    p = keyfold.plan(a, 256, 256, q_offset=0, block_size=64)
    assert p.counts()["full"] == 1 and p.counts()["empty"] == 15
    q = torch.randn(1, 2, 256, 16)
    out = keyfold.attention(q, q, q, mask=a.to_dense(256, 256, q_offset=0))
    want = F.scaled_dot_product_attention(q, q, q, attn_mask=a.to_dense(256, 256, q_offset=0))
    assert torch.allclose(out, want, atol=1e-5)


def test_tensor_mask_is_relative_to_the_call_offsets():
    q, k, v = (t.detach() for t in _inputs((1, 2, 4, 8), (1, 2, 6, 8)))
    m = torch.rand(4, 6) > 0.4
    m[:, 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    got = keyfold.attention(q, k, v, mask=m, q_offset=100, kv_offset=50)
    assert torch.allclose(got, want, atol=1e-12)


def test_float_mask_neg_inf_hides_and_float64_stays_float64():
    q, k, v = (t.detach() for t in _inputs((1, 2, 5, 8), (1, 2, 6, 8)))
    m = torch.randn(5, 6, dtype=F64) * 1e3 + 1e-9
    m[2, 3] = float("-inf")
    for be in (keyfold.Backend.AUTO, keyfold.Backend.TILES):
        got = keyfold.attention(q, k, v, mask=m, backend=be)
        assert torch.allclose(got, F.scaled_dot_product_attention(q, k, v, attn_mask=m), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="NaN"):
        keyfold.attention(q, k, v, mask=torch.full((5, 6), float("nan")))
    with pytest.raises(ValueError, match="broadcast"):
        keyfold.attention(q, k, v, mask=torch.ones(5, 7, dtype=torch.bool))


def test_float_mask_gradient():
    if not hasattr(keyfold.ScoreMod, "tensors"):
        pytest.skip("needs the engine's ScoreMod.tensors() gradient hook (#16, branch flexfa)")
    q, k, v = _inputs((2, 2, 5, 8), (2, 2, 6, 8))
    m = torch.randn(2, 1, 5, 6, dtype=F64, requires_grad=True)
    (gw,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=m).sum(), m)
    for be in (keyfold.Backend.AUTO, keyfold.Backend.TILES):
        (gg,) = torch.autograd.grad(keyfold.attention(q, k, v, mask=m, backend=be).sum(), m)
        assert torch.allclose(gg, gw, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", ["1 row over 2049 keys", "520 causal rows", "520 rows, (L, 1) mask"])
def test_a_row_whose_every_key_carries_a_huge_bias_is_the_softmax_of_its_scores(dtype, shape):
    """finfo.min on every key a row sees (HF's fully masked rows): a float32 lse near 3e38 holds no
    log of the key count, so pieces merged by it weighed each piece, not each key (error 1.1-1.7),
    and a backward from it scaled the gradients by the count; the answer also changed with the path
    (511 vs 520 rows). The row is shifted by its largest bias: softmax(s) of its keys, on every
    path, its gradients those of the unbiased row, its lse the unbiased one plus the bias
    (fuzzing, 2026-12-06)."""
    g = torch.Generator().manual_seed(0)
    L, S, causal = {"1 row over 2049 keys": (1, 2049, False), "520 causal rows": (520, 600, True),
                    "520 rows, (L, 1) mask": (520, 600, False)}[shape]
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(dtype) for n in (L, S, S))
    big = torch.finfo(dtype).min
    m = torch.full((L, 1) if "(L, 1)" in shape else (L, S), big, dtype=dtype)
    if causal:
        m = m.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(S - L + 1), float("-inf"))
    plain = keyfold.causal() if causal else None
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    got, lse = keyfold.attention(q, k, v, mask=m, return_lse=True)
    want, want_lse = keyfold.attention(q, k, v, mask=plain, return_lse=True)
    tol = dict(atol=2e-2, rtol=0) if dtype is torch.bfloat16 else dict(atol=1e-5, rtol=0)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(lse.double(), want_lse.double() + float(big), atol=0, rtol=1e-6)
    dout = torch.randn(got.shape, generator=g).to(dtype)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(kf_sdpa(q, k, v, attn_mask=m), want, **tol)


@pytest.mark.parametrize("big,dt", [(1e6, F64), (-1e6, F64), (-1e9, torch.float32),
                                    (torch.finfo(torch.float32).min, torch.float32),
                                    (torch.finfo(F64).min, F64)])
def test_attend_backward_takes_a_huge_rows_shift_off_the_lse_it_is_given(big, dt):
    """attend gives lse with the huge rows' shift; attend_backward shifts the bias again, so it
    must take the shift off that lse (it did not: dq/dk/dv off by O(1), NaN for -1e6; review of
    2026-12-06). Where the given lse cannot hold what is left after the shift (float32 near
    finfo.min, or -1e9), the piece's own lse is used: subtracting left gradients off by 10-170.
    A float mask over no key, and one seen while compiling, still run."""
    from unittest import mock
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g, dtype=dt) for n in (4, 6, 6))
    m = torch.zeros(4, 6, dtype=dt)
    m[0] = big
    m[1, :3], m[1, 3:] = big, float("-inf")
    st = keyfold.attend(q, k, v, mask=m)
    dout = torch.randn(st.out.shape, generator=g, dtype=dt)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    want = torch.autograd.grad(keyfold.attend(qq, kk, vv, mask=m).out, (qq, kk, vv), dout)
    got = keyfold.attend_backward(q, k, v, st.out, st.lse, dout, mask=m)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9 if dt is F64 else 1e-5, rtol=0)
    assert keyfold.attention(q, k[:, :, :0], v[:, :, :0], mask=torch.zeros(4, 0, dtype=dt)).shape == q.shape
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):  # tensor_mask's traced branch
        keyfold.attend_backward(q, k, v, st.out, st.lse, dout, mask=torch.zeros(4, 6, dtype=dt))


def test_a_float_mask_that_hides_every_pair_gets_a_zero_gradient():
    """SDPA gives such a mask a zero gradient; keyfold gave None, and code that zeroes or steps it
    broke (fuzzing, 2026-12-06)."""
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    m = torch.full((3, 5), float("-inf"), requires_grad=True)
    kf_sdpa(q, k, v, attn_mask=m).sum().backward()
    assert m.grad is not None and bool((m.grad == 0).all())


# ----------------------------------------------------------------------------------- dropout


def _dense_dropout_reference(q, k, v, p, seed, causal=False):
    """SDPA math with the same keep mask, through autograd."""
    B, H, L, D = q.shape
    S = k.shape[2]
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).tril(S - L).logical_not(), float("-inf"))
    w = torch.softmax(s, -1)
    keep = dropout_keep(seed, p, *grid_positions(B, H, S - L, L, 0, S, None), H)
    return (w * keep / (1 - p)) @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [None, 16])
def test_dropout_forward_and_gradient_match_a_dense_reference(causal, block_size):
    q, k, v = _inputs((2, 3, 40, 8), (2, 3, 52, 8))
    mask = keyfold.causal() if causal else None
    got, gg = _fwd_bwd(lambda *a: keyfold.attention(*a, mask=mask, dropout_p=0.3, dropout_seed=7,
                                                   block_size=block_size), q, k, v)
    want, gw = _fwd_bwd(lambda *a: _dense_dropout_reference(*a, 0.3, 7, causal), q, k, v)
    assert torch.allclose(got, want, atol=1e-12)
    for a, b in zip(gg, gw):
        assert torch.allclose(a, b, atol=1e-11)


def test_dropout_lse_unchanged_reproducible_and_scaled():
    q, k, v = (t.detach() for t in _inputs((1, 2, 64, 8), (1, 2, 64, 8)))
    _, lse0 = keyfold.attention(q, k, v, return_lse=True)
    o1, lse1 = keyfold.attention(q, k, v, return_lse=True, dropout_p=0.4, dropout_seed=3)
    assert torch.allclose(lse0, lse1, atol=1e-12)
    assert torch.equal(o1, keyfold.attention(q, k, v, dropout_p=0.4, dropout_seed=3))
    torch.manual_seed(5)
    a = keyfold.attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(5)
    assert torch.equal(a, keyfold.attention(q, k, v, dropout_p=0.4))
    g = torch.Generator().manual_seed(9)
    assert torch.equal(keyfold.attention(q, k, v, dropout_p=0.4, generator=g),
                       keyfold.attention(q, k, v, dropout_p=0.4, generator=torch.Generator().manual_seed(9)))
    keep = dropout_keep(3, 0.4, *grid_positions(4, 8, 0, 64, 0, 64, None), 8)
    assert abs(keep.double().mean().item() - 0.6) < 0.01
    # a value column of ones: each output is (kept probability mass) / (1 - p), expectation 1
    ones = torch.ones(1, 2, 64, 1, dtype=F64)
    o = torch.stack([keyfold.attention(q, k, ones, dropout_p=0.4, dropout_seed=s) for s in range(300)])
    assert abs(o.mean().item() - 1.0) < 0.01


def test_dropout_expectation_is_the_plain_output():
    q, k, v = (t.detach() for t in _inputs((1, 2, 16, 8), (1, 2, 16, 8)))
    base = kf_sdpa(q, k, v)
    mean = torch.stack([kf_sdpa(q, k, v, dropout_p=0.2, generator=torch.Generator().manual_seed(s))
                        for s in range(1000)]).mean(0)
    assert (mean - base).abs().max() < 0.05


def test_dropout_masks_of_nearby_seeds_and_of_rows_are_independent():
    """Seeds s and s ^ d (d below B H) gave the same masks on other (batch, head) slots: the seed was
    xored into the slot index before one bijection, so dropout_seed=step reused a mask set for 16
    steps at 16 heads (240 of 496 seed pairs aliased); and two rows whose one 32-bit state differed
    by d < S had keep masks that were permutations of each other (a helper's fuzz)."""
    H, N = 16, 32
    pos = grid_positions(1, H, 0, N, 0, N, None)
    masks = torch.stack([dropout_keep(s, 0.5, *pos, H)[0] for s in range(32)]).flatten(0, 1)  # (32 H, N, N)
    flat = masks.flatten(1).double()
    agree = (flat @ flat.T + (1 - flat) @ (1 - flat).T) / flat.shape[1]  # share of equal entries
    agree.fill_diagonal_(0.5)
    assert float(agree.max()) < 0.6 and float(agree.min()) > 0.4  # 1024 entries: 6 standard deviations
    # rows of 64 keys (16 seeds x 16 heads x 64 rows): no row is another's keys xor-permuted (by
    # chance: 16384^2 / 2^64 pairs); each row packed into two 32-bit words
    S = 64
    rows = torch.stack([dropout_keep(s, 0.5, *grid_positions(1, H, 0, S, 0, S, None), H)[0]
                        for s in range(16)]).flatten(0, 2).long()   # (16 H S, S)
    bits = 2 ** torch.arange(32)

    def packed(r):
        return set(zip((r[:, :32] * bits).sum(1).tolist(), (r[:, 32:] * bits).sum(1).tolist()))

    plain = packed(rows)
    assert len(plain) == rows.shape[0]
    for d in (1, 2, 3, 5, 8, 13, 21, 31, 63):
        assert not plain & packed(rows[:, torch.arange(S) ^ d]), d
    with pytest.raises(ValueError, match="dropout_seed"):
        keyfold.attention(*(torch.randn(1, 1, 4, 8),) * 3, dropout_p=0.1, dropout_seed=2 ** 64)


def test_dropout_backend_errors_and_bad_p():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="TILES"):
        keyfold.attention(q, q, q, dropout_p=0.1, backend=keyfold.Backend.TRITON)
    with pytest.raises(ValueError, match="dropout_p"):
        keyfold.attention(q, q, q, dropout_p=1.0)
    for p in (1.0, -0.5, float("nan"), True):  # the drop-in raises its own error type, as for every bad argument
        with pytest.raises(SDPAInputError, match="dropout_p"):
            kf_sdpa(q, q, q, dropout_p=p)
    for p in (np.float32(0.0), np.int64(0), torch.tensor(0.0)):  # numbers SDPA takes
        torch.testing.assert_close(kf_sdpa(q, q, q, dropout_p=p), kf_sdpa(q, q, q))


@pytest.mark.parametrize("mask", [torch.ones(4, 4, dtype=torch.int64), torch.ones(4, 4, dtype=torch.uint8),
                                  torch.ones(4, 4, dtype=torch.complex64), [[True] * 4] * 4, torch.ones(2, 3, 4, 4).bool(),
                                  torch.ones(1, 1, 1, 1, 4, 4).bool()])
def test_a_bad_attn_mask_raises_the_drop_ins_error_where_torch_raises(mask):
    """As every bad argument of the drop-in: SDPAInputError (a RuntimeError, as torch's SDPA raises, and a
    TypeError / ValueError), naming attn_mask. An integer mask raised a bare TypeError (a review,
    2026-12-07)."""
    q = torch.randn(1, 2, 4, 8)
    if isinstance(mask, torch.Tensor):
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    with pytest.raises(SDPAInputError, match="attn_mask"):
        kf_sdpa(q, q, q, attn_mask=mask)


def test_meta_tensors_run_with_autocast_off_and_on():
    """A shape dry run on meta tensors: the autocast check asked torch about a device autocast
    does not know and raised (review of 2026-12-06)."""
    q = torch.empty(1, 2, 8, 16, device="meta")
    assert keyfold.attention(q, q, q).shape == (1, 2, 8, 16)
    assert kf_sdpa(q, q, q).shape == (1, 2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert keyfold.attention(q, q, q).device.type == "meta"


@pytest.mark.parametrize("big", [-1e5, -65504.0])
def test_attend_backward_over_merged_chunks_of_a_huge_row(big):
    """Ring-style: two key chunks attended, merged, then each chunk's attend_backward given the
    merged out and lse. A float32 lse at -65504 still holds the row's log-sum to 0.004, so the shift
    comes off by subtraction; taking a chunk's own lse there put each chunk at 1 (gradients off by
    0.1-1.6; review of 2026-12-06)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g) for n in (4, 8, 8))
    m = torch.randn(4, 8, generator=g)
    m[1] = big
    dout = torch.randn(1, 1, 4, 8, generator=g)
    x64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(keyfold.attend(*x64, mask=m.double(), q_offset=0).out, x64, dout.double())
    halves = (slice(0, 4), slice(4, 8))
    st = keyfold.merge(*[keyfold.attend(q, k[:, :, h], v[:, :, h], mask=m[:, h], q_offset=0, kv_offset=h.start)
                         for h in halves])
    parts = [keyfold.attend_backward(q, k[:, :, h], v[:, :, h], st.out, st.lse, dout, mask=m[:, h], q_offset=0,
                                     kv_offset=h.start) for h in halves]
    got = (parts[0][0] + parts[1][0], torch.cat([p[1] for p in parts], 2), torch.cat([p[2] for p in parts], 2))
    for a, b in zip(got, want):
        assert float((a.double() - b).abs().max()) < 5e-3


def test_a_float64_masks_huge_row_on_float32_inputs_keeps_a_finite_lse():
    """The shift of a float64 finfo.min row, cast to a float32 lse, overflowed to -inf: a row that
    sees keys read as empty (merges drop it). It is held at float32's finfo.min (review of
    2026-12-06); out and attend_backward's gradients are those of the unbiased row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g) for n in (3, 5, 5))
    m = torch.zeros(3, 5, dtype=F64)
    m[1] = torch.finfo(F64).min
    st = keyfold.attend(q, k, v, mask=m)
    assert bool(torch.isfinite(st.lse).all())
    x = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = torch.softmax(x[0] @ x[1].transpose(-1, -2) * 8 ** -0.5, -1) @ x[2]
    torch.testing.assert_close(st.out.double(), ref.detach(), atol=1e-6, rtol=0)
    dout = torch.randn(st.out.shape, generator=g)
    for a, b in zip(keyfold.attend_backward(q, k, v, st.out, st.lse, dout, mask=m),
                    torch.autograd.grad(ref, x, dout.double())):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)


def test_a_huge_positive_entry_shifts_nothing():
    """A row's huge positive entry may sit on a key another mask hides (is_causal): shifting by it
    pushed the visible keys to -7e5, where their scores round (gradients 3-6x the naive error;
    fuzzing, 2026-12-06). Only rows whose largest entry is hugely negative are shifted."""
    from keyfold.dense import tensor_mask
    m = torch.full((3, 4), -2e5)
    m[0, 3] = 5e5
    m[1] = torch.finfo(torch.float32).min
    _, bias = tensor_mask(m, B=1, H=1, Nq=3, Nk=4)
    assert bias.lse_shift.flatten().tolist() == [0.0, float(torch.finfo(torch.float32).min), -2e5]


@pytest.mark.parametrize("backend", [keyfold.Backend.AUTO, keyfold.Backend.TILES])
def test_a_float_mask_changed_in_place_before_backward_gets_the_forwards_gradients(backend):
    """A learnable bias changed in place between the forward and the backward (an optimizer step,
    a clamp): the backward re-read the live tensor, so its scores moved (gradients off by 1-2, a
    helper's fuzz). It differentiates the values the forward saw, as torch's SDPA does."""
    g = torch.Generator().manual_seed(0)
    q0, k0, v0, do = (torch.randn(2, 2, 16, 8, generator=g, dtype=F64) for _ in range(4))
    bias0 = torch.randn(1, 2, 16, 16, generator=g, dtype=F64)
    x = [t.clone().requires_grad_(True) for t in (q0, k0, v0, bias0)]
    want = torch.autograd.grad(torch.softmax(x[0] @ x[1].transpose(-1, -2) / 8 ** 0.5 + x[3], -1) @ x[2], x, do)
    bias = torch.nn.Parameter(bias0.clone())
    q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
    out = keyfold.attention(q, k, v, mask=bias, backend=backend)
    with torch.no_grad():
        bias.mul_(3.0)
        bias[0, 0, 3, 5] = float("-inf")  # hidden now, seen by the forward: its gradient is still the forward's
    for got, ref in zip(torch.autograd.grad(out, (q, k, v, bias), do), want):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("score", [None, "softcap"])
def test_autocast_casts_inputs_as_sdpas_are_and_runs_keyfold_without_it(score):
    """Under torch.autocast the tile path's products, meant in float32, ran in bfloat16, its lse
    from those scores against a backward recomputing them in float32 (dv 4.4x torch's error); and
    float32 q, k beside a bfloat16 v (RoPE models) raised. Now the inputs are cast as SDPA's are
    and the call runs as it does on bfloat16 inputs, backward included; float64 stays float64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 16, generator=g) for _ in range(3))
    do = torch.randn(2, 2, 24, 16, generator=g).bfloat16()
    kw = {"score": keyfold.softcap(5.0)} if score else {}

    def run(fn, *xs, autocast):
        xs = [x.clone().requires_grad_(True) for x in xs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*xs)
        return out, torch.autograd.grad(out, xs, do.to(out.dtype))

    want, wgrads = run(lambda a, b, c: keyfold.attention(a, b, c, **kw), q.bfloat16(), k.bfloat16(), v.bfloat16(),
                       autocast=False)
    for inputs in ((q, k, v), (q, k, v.bfloat16())):  # float32, and float32 q, k beside a bfloat16 v
        got, grads = run(lambda a, b, c: keyfold.attention(a, b, c, **kw), *inputs, autocast=True)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        for a, b in zip(grads, wgrads):
            torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0)
    if score is None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert kf_sdpa(q, k, v.bfloat16()).dtype == torch.bfloat16
            assert kf_sdpa(q.double(), k.double(), v.double()).dtype == F64


def test_an_output_with_vs_own_head_size_is_contiguous():
    """v's head size below q's: out was a slice of the op's padded rows, so out.view(...) raised
    where torch's works (a helper's check, 24 of 168 layouts)."""
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 4, 9, 16)
    v = torch.randn(2, 4, 9, 8)
    for out in (keyfold.attention(q, k, v), kf_sdpa(q, k, v)):
        assert out.is_contiguous()
        torch.testing.assert_close(out.view(2, -1), F.scaled_dot_product_attention(q, k, v).view(2, -1))
