"""FlexAttention parity for callables, and clear errors for bad input."""

import warnings

import pytest
import torch

import keyfold as kf

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def _qkv(N=64, D=16, dtype=torch.float32, H=2):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, H, N, D, generator=g).to(dtype) for _ in range(3))


def _flex(q, k, v, mask_mod=None, score_mod=None):
    N = q.shape[2]
    block = None
    if mask_mod is not None:
        block = flex.create_block_mask(mask_mod, None, None, N, k.shape[2], device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block)


def sliding(b, h, q, k):
    return (q >= k) & (q - k <= 10)


def doc_mask(b, h, q, k):
    return (q // 20) == (k // 20)


def tanh_cap(score, b, h, q, k):
    return 5.0 * torch.tanh(score / 5.0)


def rel_bias(score, b, h, q, k):
    return score + 0.1 * (q - k) - 0.05 * h


@pytest.mark.parametrize("mask_mod", [None, sliding, doc_mask])
@pytest.mark.parametrize("score_mod", [None, tanh_cap, rel_bias])
def test_flex_parity(mask_mod, score_mod):
    q, k, v = _qkv()
    want = _flex(q, k, v, mask_mod, score_mod)
    got = kf.attention(q, k, v, mask=mask_mod, score=score_mod, q_offset=0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_flex_parity_cross_attention_top_left():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 32, 16, generator=g)
    k = torch.randn(1, 2, 48, 16, generator=g)
    v = torch.randn(1, 2, 48, 16, generator=g)
    want = _flex(q, k, v, sliding)
    got = kf.attention(q, k, v, mask=sliding, q_offset=0)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_keyfold_presets_equal_their_flex_callables():
    q, k, v = _qkv()
    got = kf.attention(q, k, v, mask=kf.causal() & kf.window(10))
    torch.testing.assert_close(got, _flex(q, k, v, sliding), atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------- bad input

Q = torch.randn(1, 4, 8, 16)
K = torch.randn(1, 2, 8, 16)
V = torch.randn(1, 2, 8, 16)


@pytest.mark.parametrize("args, kw, exc, match", [
    ((Q[0], K, V), {}, ValueError, "q must be 4-D"),
    ((Q, K[:, :, :, :8], V), {}, ValueError, "head dims differ"),
    ((Q, torch.randn(2, 2, 8, 16), V), {}, ValueError, "batch sizes differ"),
    ((torch.randn(1, 3, 8, 16), K, V), {}, ValueError, "multiple"),
    ((Q, K, V[:, :, :5]), {}, ValueError, "keys but v has 5"),
    ((Q, K, V.double()), {}, TypeError, "share one dtype"),
    ((Q.int(), K.int(), V.int()), {}, TypeError, "dtype"),
    ((Q, K, V), {"scale": float("nan")}, ValueError, "scale"),
    ((Q, K, V), {"kv_offset": -1}, ValueError, "kv_offset"),
    ((Q, K, V), {"mask": "causal"}, TypeError, "mask must be"),
    ((Q, K, V), {"score": 3}, TypeError, "score must be"),
    ((Q, K, V), {"mask": lambda b, h, q, k: (q - k).float()}, TypeError, "must return a bool"),
    ((Q, K, V), {"mask": kf.documents(torch.zeros(5, dtype=torch.long))}, ValueError, "covers 5 positions"),
    ((Q, K, V), {"score": kf.alibi(torch.ones(3))}, ValueError, "3 slopes for 4"),
    ((Q, K, V), {"backend": "cpu"}, TypeError, "Backend"),
])
def test_bad_input_raises_clear_errors(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        kf.attention(*args, **kw)


def test_check_inputs_scans_for_nan():
    q = Q.clone()
    q[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        kf.attention(q, K, V, check_inputs=True)


def test_merge_all_of_nothing_raises():
    with pytest.raises(ValueError, match="empty_state"):
        kf.merge_all([])


def test_finite_inputs_never_give_nan_even_with_extreme_scores():
    q = torch.full((1, 1, 4, 8), 1e4)
    k = torch.full((1, 1, 4, 8), -1e4)
    v = torch.randn(1, 1, 4, 8)
    for m in (None, kf.causal(), kf.window(1)):
        assert torch.isfinite(kf.attention(q, k, v, mask=m)).all()


def test_the_unmasked_fast_path_validates_like_the_engine():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with pytest.raises(ValueError, match="kv_offset"):
        kf.attention(q, k, v, kv_offset=-1)
    with pytest.raises(TypeError, match="q_offset"):
        kf.attention(q, k, v, q_offset=1.5)
    with pytest.raises(ValueError, match="scale"):
        kf.attention(q, k, v, scale=float("inf"))
    st = kf.attend(q, k, v)
    ref = kf.attend(q.double(), k.double(), v.double(), backend=kf.Backend.REFERENCE)
    assert st.out.dtype == torch.float32 and st.lse.dtype == torch.float32
    torch.testing.assert_close(st.out.double(), ref.out, atol=1e-6, rtol=0)
    torch.testing.assert_close(st.lse.double(), ref.lse, atol=1e-5, rtol=0)


def test_softcap_takes_a_0d_tensor_and_refuses_one_that_trains():
    """softcap(torch.tensor(30.)) (a config's value kept as a tensor) raised "must be a finite number"
    (a review, 2026-12-08); one that requires grad is refused naming the callable that trains it."""
    import torch
    import keyfold as kf
    assert kf.softcap(torch.tensor(30.0)) == kf.softcap(30.0)
    with pytest.raises(ValueError, match="learnable cap"):
        kf.softcap(torch.tensor(30.0, requires_grad=True))
