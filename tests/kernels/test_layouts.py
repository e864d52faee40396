"""Inputs whose last dim is not stride 1 (a transposed view): PyTorch's fused CPU op, which keyfold
calls directly, reads them from the wrong places without an error (the public SDPA checks first).
Before the fix keyfold's CPU path gave errors of 0.6 to 1e35 (NaN in places) for such q, k or v, wrong
gradients for such a dout, and a crash in the backward for some; every path here must meet the rule.
"""

import pytest
import torch
import torch.nn.functional as F

import keyfold as kf
from keyfold import Backend
from keyfold.caches import KVCache, decode
from tests.helpers import assert_backward_by_rule, assert_forward_by_rule, max_err


def _strided(x):
    """x's values in a tensor whose last dim has stride x.shape[-2] (a transposed copy, transposed back)"""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def _qkv(Nq, Nk, dtype, seed=0, D=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 2, n, D, generator=g).to(dtype) for n in (Nq, Nk, Nk))


MASKS = {"none": {}, "causal": {"mask": kf.causal()}, "window": {"mask": kf.causal() & kf.window(4)},
         "callable": {"mask": lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 3 != 1}}


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.CPU, Backend.TILES], ids=["auto", "cpu", "tiles"])
def test_strided_inputs_forward_and_backward(which, mask, dtype, backend):
    q, k, v = _qkv(9, 9, dtype)
    t = {"q": q, "k": k, "v": v}
    t[which] = _strided(t[which])
    assert t[which].stride(-1) != 1
    assert_forward_by_rule(t["q"], t["k"], t["v"], backend=backend, **MASKS[mask])
    assert_backward_by_rule(t["q"], t["k"], t["v"], backend=backend, **MASKS[mask])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_strided_inputs_on_the_prefill_kernel_rows(dtype):
    """600 rows: the prefill kernel's size where it runs (it copies such rows itself), the op elsewhere"""
    q, k, v = _qkv(600, 600, dtype)
    assert_forward_by_rule(_strided(q), _strided(k), v, mask=kf.causal())


def test_strided_output_gradient():
    """a dout whose last dim is not stride 1 reaches the op's backward as its dO"""
    q, k, v = (x.requires_grad_(True) for x in _qkv(9, 9, torch.float32))
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    dout = _strided(torch.randn(1, 2, 9, 16, generator=torch.Generator().manual_seed(2)))
    kf.attention(q, k, v, mask=kf.causal(), backend=Backend.CPU).backward(dout)
    F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(dout.double())
    for a, b in zip((q, k, v), (qd, kd, vd)):
        assert max_err(a.grad, b.grad) < 1e-5


def test_strided_inputs_through_the_sdpa_drop_in_and_decode():
    q, k, v = _qkv(4, 9, torch.float32)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert max_err(kf.scaled_dot_product_attention(_strided(q), _strided(k), _strided(v)), ref) < 1e-5
    cache = KVCache(1, 2, 16, 32)
    cache.append(k, v)
    assert max_err(decode(_strided(q[:, :, :2]), cache), F.scaled_dot_product_attention(
        q[:, :, :2].double(), k.double(), v.double())) < 1e-5


def _bnhd(seed, B, H, Nq, Nk, D, std):
    """q, k, v as a projection gives them, (B, N, H, D), transposed to (B, H, N, D): batch and heads that do
    not flatten into one dimension"""
    g = torch.Generator().manual_seed(seed)

    def make(n, scale):
        return (torch.randn(B, n, H, D, generator=g) * scale).transpose(1, 2)

    return make(Nq, std ** 0.5), make(Nk, std ** 0.5), make(Nk, 1.0)


@pytest.mark.parametrize("seed", [0, 3, 5, 8, 10])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "no kernels"])
def test_projection_layout_on_the_tile_kernel(seed, kernels, monkeypatch):
    """(B, N, H, D) inputs transposed to (B, H, N, D) with B and H above 1, on the tile kernel (softcap and
    score callables on any CPU; every float32 gradient without keyfold's kernels): torch's matmul could not
    batch the strided keys and summed each score in one chain, 4x the error of the naive attention's GEMM
    on its contiguous copy: up to 2.3x the rule's allowance forward with a softcap, 2.9x in gradients
    without the kernels (11-13 of 38 random calls; a review, 2026-12-07). Keys and values whose batch and
    heads do not flatten are multiplied from a contiguous copy now (_common.group_matmul)."""
    from keyfold.kernels import native
    if not kernels:
        monkeypatch.setenv("KEYFOLD_NATIVE", "0")
        native._reset()
    try:
        q, k, v = _bnhd(seed, 2, 2, 4, 32, 256, 20.0)
        assert not q.is_contiguous() and k.stride(1) == 256
        kw = {"score": kf.softcap(50.0)} if kernels else {}
        assert_forward_by_rule(q, k, v, **kw)
        assert_backward_by_rule(q, k, v, **kw)
    finally:
        monkeypatch.undo()
        native._reset()
