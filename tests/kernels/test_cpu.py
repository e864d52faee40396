"""The fused CPU kernel's handling of float16: on CPUs without float16 units it runs in float32."""

import pytest
import torch

import keyfold as kf
from keyfold.kernels import cpu
from tests.helpers import assert_backward_by_rule, assert_forward_by_rule

MASKS = {"dense": None, "causal": kf.causal(), "window": kf.causal() & kf.window(9),
         "documents": kf.documents(torch.arange(70) // 20) & kf.causal()}


def _qkv(dtype, B=1, H=2, N=70, D=16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(3))


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_float16_runs_the_fused_op_in_float32_where_told(mask, monkeypatch):
    """With FP16_AS_FP32 (CPUs without float16 units) a float16 call is the float32 call on the same
    values, rounded once at the end; either way it holds the rule, forward and backward."""
    q, k, v = _qkv(torch.float16)
    kw = dict(mask=MASKS[mask], block_size=16)
    monkeypatch.setattr(cpu, "FP16_AS_FP32", True)
    got = kf.attention(q, k, v, **kw)
    assert got.dtype == torch.float16
    wide = kf.attention(q.float(), k.float(), v.float(), **kw).half()
    assert torch.equal(got, wide)
    for widen in (True, False):
        monkeypatch.setattr(cpu, "FP16_AS_FP32", widen)
        assert_forward_by_rule(q, k, v, **kw)
        assert_backward_by_rule(q, k, v, **kw)


def test_bfloat16_is_not_widened(monkeypatch):
    monkeypatch.setattr(cpu, "FP16_AS_FP32", True)
    q, k, v = _qkv(torch.bfloat16)
    assert cpu._widen(q, k, v)[0] is q
