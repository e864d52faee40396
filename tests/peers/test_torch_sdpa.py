"""PyTorch's own scaled_dot_product_attention tests, ported to ``keyfold.scaled_dot_product_attention``.

Sources (facts only, no code): ``test/test_transformers.py`` in pytorch/pytorch:
``TestTransformers.test_scaled_dot_product_attention``, ``TestSDPA.test_sdp_math_gradcheck``,
``TestSDPA.test_scaled_dot_product_fused_attention_vs_math_cpu``,
``TestSDPA.test_scaled_dot_product_fused_attention_mask_vs_math_cpu``,
``TestSDPA.test_scaled_dot_product_fused_attention_with_inf``,
``TestSDPA.test_scaled_dot_product_attention_math_with_negative_scale``,
``TestSDPAFailureModes.test_invalid_inputs_different_datatypes`` / ``..._1_dimensional_inputs``,
``TestAttnBias.test_causal_variants`` / ``test_is_causal_equals_upper_left`` /
``test_is_causal_and_mask_fails``; ``enable_gqa`` from SDPA's documented contract (that file has
no GQA case). Sizes, dtypes and tolerances are torch's; where torch compares its fused CPU kernel
with the MATH backend, keyfold takes the fused kernel's place against torch's MATH backend.

Deliberate differences, asserted as keyfold documents them (README, "SDPA drop-in"):
dropout draws keyfold's own random bits (same expectation and scaling, not torch's bits), so the
dropout cases check reproducibility, scaling and expectation instead of torch's exact output; and
``attn_mask`` together with ``is_causal=True`` applies both, as torch's default CPU dispatch does
for 4-D inputs (its MATH backend, which 3-D inputs take, refuses the pair; torch's docs say it raises).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalVariant, causal_lower_right, causal_upper_left

import keyfold
from keyfold.functional import SDPAInputError

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DT = {"fp64": F64, "fp32": F32, "bf16": BF16, "fp16": F16}
#: torch's fused-vs-math CPU tolerances (atol, rtol) per dtype
FUSED_TOL = {F64: (1e-5, 5e-6), F32: (1e-5, 5e-6), BF16: (5e-2, 5e-2), F16: (1e-2, 1e-2)}


def torch_math(*args, **kw):
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(*args, **kw)


def kf(*args, **kw):
    return keyfold.scaled_dot_product_attention(*args, **kw)


# ------------------------------------------------- TestTransformers.test_scaled_dot_product_attention

# (input_dim, attn_mask_dim, is_causal): torch's list
SDPA_CASES = [(3, None, False), (3, 2, False), (3, 2, True), (3, 3, False), (3, 3, True),
              (4, None, False), (4, 2, False), (4, 2, True), (4, 4, False), (4, 4, True)]
N, N_PRIME, L, S, E = 5, 2, 4, 3, 6


def _sdpa_inputs(input_dim, dtype, gen):
    lead = (N,) if input_dim == 3 else (N, N_PRIME)
    mk = lambda n: torch.randn(*lead, n, E, generator=gen, dtype=dtype)  # noqa: E731
    return mk(L), mk(S), mk(S)


def _sdpa_mask(input_dim, attn_mask_dim, is_causal, gen):
    if attn_mask_dim is None:
        return None
    shape = (L, S) if attn_mask_dim == 2 else ((N, L, S) if input_dim == 3 else (N, N_PRIME, L, S))
    if is_causal:
        return torch.ones(shape, dtype=torch.bool).tril()
    return torch.randint(0, 2, shape, generator=gen).bool()


@pytest.mark.parametrize("dtype", [F64, F32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("input_dim,attn_mask_dim,is_causal", SDPA_CASES)
def test_scaled_dot_product_attention(input_dim, attn_mask_dim, is_causal, dtype):
    """TestTransformers.test_scaled_dot_product_attention (dropout_p=0.0): 3-D and 4-D inputs, bool
    masks of 2, 3 or 4 dims (random, or tril with is_causal), torch's default assertEqual tolerances.
    The random masks hide whole rows at this size: torch's MATH gives 0 there, as keyfold does."""
    gen = torch.Generator().manual_seed(input_dim * 10 + (attn_mask_dim or 0) + is_causal)
    q, k, v = _sdpa_inputs(input_dim, dtype, gen)
    mask = _sdpa_mask(input_dim, attn_mask_dim, is_causal, gen)
    if is_causal:  # torch passes no mask with is_causal; its MATH backend refuses both
        want = torch_math(q, k, v, None, 0.0, True)
        torch.testing.assert_close(kf(q, k, v, None, 0.0, True), want)
        with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
            torch_math(q, k, v, mask, 0.0, True)
        # keyfold applies both (deliberate, see the module docstring): torch's default dispatch does so
        # for 4-D inputs (its CPU flash kernel) and raises for 3-D ones (MATH)
        tril = torch.ones(L, S, dtype=torch.bool).tril()
        torch.testing.assert_close(kf(q, k, v, mask, 0.0, True), torch_math(q, k, v, mask & tril, 0.0, False))
        if input_dim == 4:
            torch.testing.assert_close(kf(q, k, v, mask, 0.0, True), F.scaled_dot_product_attention(q, k, v, mask, 0.0, True))
    else:
        torch.testing.assert_close(kf(q, k, v, mask, 0.0, False), torch_math(q, k, v, mask, 0.0, False))


def _seeded(fn, seed=7):
    """``fn`` with a dropout generator re-seeded on every call (torch's wrapper_set_seed)."""
    return lambda *a: fn(*a, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dropout_p", [0.0, 0.2, 0.5])
def test_scaled_dot_product_attention_gradcheck(dropout_p):
    """TestTransformers.test_scaled_dot_product_attention, its gradcheck (no mask, float64, the
    (N * N', L, E) inputs) at each of torch's dropout_p, the dropout bits fixed by a seed. gradcheck's
    fast mode (a random projection of the Jacobian) keeps it to a second."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (t.reshape(-1, t.shape[-2], E).requires_grad_() for t in _sdpa_inputs(4, F64, gen))
    assert torch.autograd.gradcheck(_seeded(lambda a, b, c, generator: kf(a, b, c, None, dropout_p,
                                                                       generator=generator)), (q, k, v),
                                    fast_mode=True)


@pytest.mark.parametrize("dropout_p", [0.2, 0.5])
def test_scaled_dot_product_attention_dropout_semantics(dropout_p):
    """TestTransformers.test_scaled_dot_product_attention with dropout_p > 0. torch compares against
    F.dropout on the same RNG state; keyfold's bits are its own (deliberate), so this asserts what
    keyfold documents instead: dropout applies whenever dropout_p > 0 (no training flag), the same
    generator seed gives the same result, kept probabilities are scaled by 1/(1-p) so the mean over
    draws is the plain output."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = _sdpa_inputs(3, F64, gen)
    plain = kf(q, k, v)
    a = kf(q, k, v, dropout_p=dropout_p, generator=torch.Generator().manual_seed(3))
    b = kf(q, k, v, dropout_p=dropout_p, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert not torch.allclose(a, plain)
    draws = torch.stack([kf(q, k, v, dropout_p=dropout_p, generator=torch.Generator().manual_seed(s))
                         for s in range(400)])
    se = draws.std(0) / 400 ** 0.5
    assert bool(((draws.mean(0) - plain).abs() <= 5 * se + 1e-9).float().mean() > 0.99)


# ----------------------------------------------------------------- TestSDPA.test_sdp_math_gradcheck


@pytest.mark.parametrize("contiguous_inputs", [True, False])
def test_sdp_math_gradcheck(contiguous_inputs):
    """TestSDPA.test_sdp_math_gradcheck: batch 4, seq 4, 2 heads, head_dim 16, float64, q/k/v as
    (non-contiguous) views of one packed tensor; gradcheck's fast mode."""
    B, Ls, H, D = 4, 4, 2, 16
    qkv = torch.randn(B, Ls, 3 * H * D, dtype=F64, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def fn(x):
        q, k, v = (t.view(B, -1, H, D).transpose(1, 2) for t in x.chunk(3, dim=-1))  # (B, H, L, D)
        if contiguous_inputs:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return kf(q, k, v, None, 0.0, False)

    assert torch.autograd.gradcheck(fn, (qkv,), fast_mode=True)


# ---------------------------------------- TestSDPA.test_scaled_dot_product_fused_attention_vs_math_cpu


def assert_fused_matches_math(dtype, batch_size, seq_len, n_head, head_dim, causal, train):
    atol, rtol = FUSED_TOL[dtype]
    n_embd = n_head * head_dim
    x = torch.randn(batch_size, seq_len, 3 * n_embd, generator=torch.Generator().manual_seed(0)).to(dtype)
    x2 = x.clone().float() if dtype in (BF16, F16) else x.clone()
    x.requires_grad_(train)
    x2.requires_grad_(train)

    def heads(t):  # (B, T, n_embd) -> (B, nh, T, hs), a strided view as in torch's test
        return t.view(batch_size, seq_len, n_head, head_dim).transpose(1, 2)

    q, k, v = (heads(t) for t in x.split(n_embd, dim=2))
    q2, k2, v2 = (heads(t) for t in x2.split(n_embd, dim=2))
    actual = kf(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=causal)
    math_ref = torch_math(q2, k2, v2, attn_mask=None, dropout_p=0.0, is_causal=causal)
    torch.testing.assert_close(actual, math_ref.to(dtype), atol=atol, rtol=rtol)
    if train:
        actual.sum().backward()
        math_ref.sum().backward()
        torch.testing.assert_close(x.grad, x2.grad.to(dtype), atol=atol, rtol=rtol)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DT.values(), ids=DT.keys())
def test_scaled_dot_product_fused_attention_vs_math_cpu(dtype, causal, train):
    """TestSDPA.test_scaled_dot_product_fused_attention_vs_math_cpu at batch 2, seq 267, 3 heads,
    head_dim 8 (one point of torch's grid of batch 2/12, seq 267/1030, heads 1/3, head_dim 8/16;
    the rest is not ported, to keep the file fast). Packed qkv
    split into strided views; low precision against MATH in float32; torch's tolerances."""
    assert_fused_matches_math(dtype, 2, 267, 3, 8, causal, train)


# ---------------------------------- TestSDPA.test_scaled_dot_product_fused_attention_mask_vs_math_cpu


def _slow_unless(fast: bool):
    return () if fast else (pytest.mark.slow,)


@pytest.mark.parametrize("dtype,mask_dim,bool_mask,train", [
    pytest.param(DT[d], md, bm, tr, id=f"{d}-{md}d-{'bool' if bm else 'float'}-{'train' if tr else 'eval'}",
                 marks=_slow_unless(md == 2 and tr))  # train checks the forward too; 4-D masks: 16 shapes
    for d, md, bm, tr in itertools.product(DT, [2, 4], [0, 1], [True, False])])
def test_scaled_dot_product_fused_attention_mask_vs_math_cpu(dtype, mask_dim, bool_mask, train):
    """TestSDPA.test_scaled_dot_product_fused_attention_mask_vs_math_cpu: batch 2, 267 queries, 514
    keys, 3 heads, head_dim 8; every broadcast mask shape ((Lq|1, Lk|1) or (B|1, H|1, Lq|1, Lk|1)),
    random bool or randn additive (in the input dtype; float32 for the MATH reference of bf16/fp16).
    A bool mask of shape (.., Lq, 1) hides whole rows: torch's MATH and keyfold both give 0 there."""
    B, Lq, Lk, H, D = 2, 267, 514, 3, 8
    atol, rtol = FUSED_TOL[dtype]
    gen = torch.Generator().manual_seed(mask_dim * 4 + bool_mask * 2 + train)
    shapes = (itertools.product([Lq, 1], [Lk, 1]) if mask_dim == 2
              else itertools.product([B, 1], [H, 1], [Lq, 1], [Lk, 1]))
    low = dtype in (BF16, F16)
    for shape in shapes:
        q = torch.randn(B, Lq, H, D, generator=gen).to(dtype)
        k = torch.randn(B, Lk, H, D, generator=gen).to(dtype)
        v = torch.randn(B, Lk, H, D, generator=gen).to(dtype)
        q2, k2, v2 = ((t.float() if low else t.clone()) for t in (q, k, v))
        for t in (q, k, v, q2, k2, v2):
            t.requires_grad_(train)
        if bool_mask:
            mask = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            mask = torch.randn(shape, generator=gen).to(dtype)
        perm = lambda t: t.transpose(1, 2)  # noqa: E731  (B, L, H, D) -> (B, H, L, D)
        actual = kf(perm(q), perm(k), perm(v), attn_mask=mask, dropout_p=0.0, is_causal=False)
        ref_mask = mask.float() if (low and not bool_mask) else mask
        math_ref = torch_math(perm(q2), perm(k2), perm(v2), attn_mask=ref_mask, dropout_p=0.0, is_causal=False)
        msg = f"mask shape {shape}"
        torch.testing.assert_close(actual, math_ref.to(dtype), atol=atol, rtol=rtol, msg=msg)
        if train:
            actual.sum().backward()
            math_ref.sum().backward()
            for name, g, r in (("dq", q.grad, q2.grad), ("dk", k.grad, k2.grad), ("dv", v.grad, v2.grad)):
                torch.testing.assert_close(g, r.to(dtype), atol=atol, rtol=rtol, msg=f"{name}, {msg}")


# ------------------------------------------------------------------------ TestSDPA, single cases


def test_scaled_dot_product_fused_attention_with_inf():
    """TestSDPA.test_scaled_dot_product_fused_attention_with_inf (pytorch#127055): a (600, 600)
    band mask of -inf (triu 1 + tril -10) on (1, 2, 600, 8) float32 inputs."""
    full = torch.full((600, 600), float("-inf"))
    mask = torch.triu(full, diagonal=1) + torch.tril(full, diagonal=-10)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 600, 8, generator=gen) for _ in range(3))  # torch's SdpaShape(1, 600, 2, 8), (B, L, H, D) read as 4-D
    torch.testing.assert_close(kf(q, k, v, attn_mask=mask), torch_math(q, k, v, attn_mask=mask))


def test_scaled_dot_product_attention_math_with_negative_scale():
    """TestSDPA.test_scaled_dot_product_attention_math_with_negative_scale (pytorch#105190):
    x (1, 3, 64, 64), scale = -1 / 0.0001, against the plain matmul-softmax-matmul."""
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ref = torch.matmul((torch.matmul(x, x.transpose(-1, -2)) / -0.0001).softmax(dim=-1), x)
    torch.testing.assert_close(kf(x, x, x, scale=-1.0 / 0.0001), ref)


# ---------------------------------------------------------------------- TestSDPAFailureModes


def test_invalid_inputs_different_datatypes():
    """TestSDPAFailureModes.test_invalid_inputs_different_datatypes: float32 query with float16
    key/value raises RuntimeError (keyfold: SDPAInputError, a RuntimeError)."""
    shape = (1, 4, 8, 16)
    q, k, v = torch.randn(shape), torch.randn(shape).half(), torch.randn(shape).half()
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError, match="dtype"):
        kf(q, k, v)


def test_invalid_inputs_1_dimensional_inputs():
    """TestSDPAFailureModes.test_invalid_inputs_1_dimensional_inputs: a 1-D query raises RuntimeError."""
    q, k, v = torch.randn(4).half(), torch.randn(1, 4).half(), torch.randn(1, 4).half()
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError, match="at least 2 dims"):
        kf(q, k, v)


def test_regression_sdpa_argument_errors_are_runtime_errors():
    """Regression: keyfold raised ValueError / TypeError here, which torch-style `except RuntimeError`
    code did not catch; SDPAInputError is both."""
    with pytest.raises(SDPAInputError):
        kf(torch.randn(4), torch.randn(1, 4), torch.randn(1, 4))
    assert issubclass(SDPAInputError, RuntimeError) and issubclass(SDPAInputError, ValueError)


# ------------------------------------------------------------------------------- TestAttnBias

ATTN_BIAS_SHAPES = [(16, 16, 128, 128, 16), (16, 16, 128, 256, 32), (16, 16, 256, 128, 32), (1, 1, 23, 56, 15)]
ATTN_BIAS_IDS = ["128x128", "128x256", "256x128", "23x56"]


def _bias_inputs(shape, seed=0):
    bsz, heads, lq, lk, d = shape
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(bsz, heads, lq, d, generator=gen).half(), torch.rand(bsz, heads, lk, d, generator=gen).half(),
            torch.rand(bsz, heads, lk, d, generator=gen).half())


@pytest.mark.parametrize("shape", ATTN_BIAS_SHAPES, ids=ATTN_BIAS_IDS)
@pytest.mark.parametrize("variant", [CausalVariant.UPPER_LEFT, CausalVariant.LOWER_RIGHT], ids=["upper_left", "lower_right"])
def test_causal_variants(variant, shape):
    """TestAttnBias.test_causal_variants: fp16 rand inputs, attn_mask = causal_upper_left /
    causal_lower_right, against SDPA with the materialized mask; forward tol 1e-3, grads 5e-3.
    torch skips lower-right with more queries than keys ("will produce NaNs"); keyfold runs it
    and gives its documented 0 on the rows that see no key (torch's CPU SDPA gives 0 there too)."""
    _, _, lq, lk, _ = shape
    bias = causal_upper_left(lq, lk) if variant == CausalVariant.UPPER_LEFT else causal_lower_right(lq, lk)
    q, k, v = (t.requires_grad_() for t in _bias_inputs(shape))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    realized = bias._materialize(q.device)  # (lq, lk) bool, True = attend
    want = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=realized, dropout_p=0.0, is_causal=False)
    got = kf(q, k, v, attn_mask=bias, dropout_p=0.0, is_causal=False, scale=None)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).half()
    want.backward(dout)
    got.backward(dout)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    for g, r in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(g, r, atol=5e-3, rtol=5e-3)
    hidden = ~realized.any(-1)  # rows that see no key (lower right, lq > lk)
    assert bool((got[..., hidden, :] == 0).all())


@pytest.mark.parametrize("shape", ATTN_BIAS_SHAPES, ids=ATTN_BIAS_IDS)
def test_is_causal_equals_upper_left(shape):
    """TestAttnBias.test_is_causal_equals_upper_left: attn_mask=causal_upper_left(Lq, Lk) equals
    is_causal=True, which is top-left also when Lq != Lk (tol 1e-3); both equal torch's."""
    _, _, lq, lk, _ = shape
    q, k, v = _bias_inputs(shape, seed=2)
    out_bias = kf(q, k, v, attn_mask=causal_upper_left(lq, lk), dropout_p=0.0)
    out_causal = kf(q, k, v, is_causal=True, dropout_p=0.0)
    torch.testing.assert_close(out_bias, out_causal, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out_causal, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-3, rtol=1e-3)


def test_is_causal_and_mask_fails():
    """TestAttnBias.test_is_causal_and_mask_fails: a CausalBias with is_causal=True raises ValueError."""
    q, k, v = _bias_inputs((16, 16, 128, 128, 16))
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(128, 128), is_causal=True)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        kf(q, k, v, attn_mask=causal_upper_left(128, 128), is_causal=True, dropout_p=0.0)


def test_regression_causal_bias_is_not_read_as_a_mask():
    """Regression (silent): a CausalBias holds no mask in its storage (SDPA dispatches on its type);
    keyfold read that storage as a float mask and returned a wrong answer (error 1.5) for
    causal_upper_left with no exception."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen) for n in (6, 6, 6))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(kf(q, k, v, attn_mask=causal_upper_left(6, 6)), want)
    k2, v2 = torch.randn(2, 3, 9, 8, generator=gen), torch.randn(2, 3, 9, 8, generator=gen)
    torch.testing.assert_close(kf(q, k2, v2, attn_mask=causal_lower_right(6, 9)),
                               F.scaled_dot_product_attention(q, k2, v2, attn_mask=causal_lower_right(6, 9)._materialize()))


# ------------------------------------------------------------------- enable_gqa (SDPA's contract)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_enable_gqa(hq, hkv, is_causal):
    """SDPA's documented enable_gqa (torch's docstring; test_transformers.py has no GQA case):
    query heads a multiple of key/value heads, each key head shared by hq // hkv query heads;
    float64, against torch's SDPA with enable_gqa=True, forward and gradients."""
    gen = torch.Generator().manual_seed(hq + hkv)
    q = torch.randn(2, hq, 12, 16, dtype=F64, generator=gen, requires_grad=True)
    k = torch.randn(2, hkv, 20, 16, dtype=F64, generator=gen, requires_grad=True)
    v = torch.randn(2, hkv, 20, 16, dtype=F64, generator=gen, requires_grad=True)
    got = kf(q, k, v, is_causal=is_causal, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    torch.testing.assert_close(got, want)
    dout = torch.randn(got.shape, dtype=F64, generator=gen)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(g, w)


def test_enable_gqa_errors():
    """SDPA raises RuntimeError when query heads are not a multiple of key heads with enable_gqa,
    and when the heads differ (and do not broadcast) without it; keyfold raises there too."""
    q, k3, k2 = torch.randn(2, 8, 4, 16), torch.randn(2, 3, 4, 16), torch.randn(2, 2, 4, 16)
    for fn in (F.scaled_dot_product_attention, kf):
        with pytest.raises(RuntimeError):
            fn(q, k3, k3, enable_gqa=True)
        with pytest.raises(RuntimeError):
            fn(q, k2, k2)


@pytest.mark.parametrize("is_causal", [False, True])
def test_zero_heads_give_an_empty_output(is_causal):
    """SDPA returns an empty (B, 0, L, Ev) output for zero heads. keyfold's one-fused-call path
    handed them to the fused op, which killed the process with SIGFPE, and the planned path raised
    (fuzzing, 2026-12-06)."""
    q = torch.randn(2, 0, 5, 8, requires_grad=True)
    k, v = torch.randn(2, 0, 7, 8), torch.randn(2, 0, 7, 4)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    got = keyfold.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert got.shape == want.shape == (2, 0, 5, 4)
    (g,) = torch.autograd.grad(got.sum(), q)
    assert g.shape == q.shape
    for backend in keyfold.Backend:
        if backend in (keyfold.Backend.AUTO, keyfold.Backend.REFERENCE, keyfold.Backend.CPU, keyfold.Backend.TILES):
            assert keyfold.attention(q, k, v, backend=backend).shape == (2, 0, 5, 4)


def test_sdpa_shapes_torch_takes_that_were_refused():
    """Key and value head counts that differ with one of them 1 broadcast in torch's SDPA, and a head or
    value dim of 0 gives the average of the values / an empty output; keyfold's drop-in raised plain
    ValueErrors (a review, 2026-12-08). Its own refusals are SDPAInputError (a RuntimeError, as SDPA's)."""
    import torch.nn.functional as F
    from keyfold.functional import SDPAInputError
    from keyfold import scaled_dot_product_attention as kf_sdpa
    g = torch.Generator().manual_seed(0)
    cases = [((2, 3, 5, 8), (2, 1, 7, 8), (2, 3, 7, 6), {}), ((2, 3, 5, 8), (2, 3, 7, 8), (2, 1, 7, 6), {}),
             ((2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, 6), {}), ((2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, 6), {"is_causal": True}),
             ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 0), {})]
    for qs, ks, vs, kw in cases:
        q, k, v = (torch.randn(*s, generator=g, requires_grad=True) for s in (qs, ks, vs))
        want, got = F.scaled_dot_product_attention(q, k, v, **kw), kf_sdpa(q, k, v, **kw)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
        got.sum().backward()
    with pytest.raises(SDPAInputError):
        kf_sdpa(torch.randn(1, 4, 5, 8), torch.randn(1, 3, 7, 8), torch.randn(1, 3, 7, 8))
    with pytest.raises(SDPAInputError):
        kf_sdpa(torch.randn(1, 3, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 3, 7, 8))
