"""Faults in the proofs: certificates for the function that really runs, sound and finite at
extreme values, and attention at the fp16 maximum.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import require_extra

require_extra("verify")  # skip, naming the pip line, where the extra is missing (before the app imports)

import keyfold
import keyfold.nn as knn
from keyfold.apps.verify import certify as C
from keyfold.state import State, merge


# ------------------------------- 3. a keyfold layer's own mask is part of the certified function


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("mask", [keyfold.window(1, 1), keyfold.documents(torch.tensor([0, 0, 0, 1, 1, 2]))])
def test_block_from_module_carries_the_layers_mask(norm_first, mask):
    torch.manual_seed(0)
    layer = knn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, norm_first=norm_first, batch_first=True, mask=mask).double().eval()
    w = C.BlockWeights.from_module(layer)
    x = torch.randn(6, 8, dtype=torch.float64)
    with torch.no_grad():
        real = layer(x.unsqueeze(0))[0]
        plain = knn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, norm_first=norm_first, batch_first=True).double().eval()
        plain.load_state_dict(layer.state_dict())
        assert not torch.allclose(plain(x.unsqueeze(0))[0], real)      # the mask matters here
    torch.testing.assert_close(C.block_forward(x, w), real)
    eps = 0.05
    for method in C.Method:
        b = C.certify_block(x, w, eps=eps, method=method)
        ys = C.sample_box(x - eps, x + eps, 64, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            outs = layer(ys)                                             # the layer itself, on the box
        assert all(b.contains(y) for y in outs), method
    # the caller's mask is ANDed with the layer's: causal on top
    both = C.certify_block(x, w, eps=0.0, mask=keyfold.causal())
    with torch.no_grad():
        assert both.contains(layer(x.unsqueeze(0), mask=keyfold.causal())[0])


def test_attention_from_module_carries_the_mask_and_refuses_a_score():
    mha = knn.MultiheadAttention(8, 2, mask=keyfold.window(2)).double()
    w = C.AttentionWeights.from_module(mha)
    assert w.mask == keyfold.window(2)
    x = torch.randn(5, 8, dtype=torch.float64)
    b = C.certify_attention(x, w, eps=0.0)
    assert b.contains(C.attention_forward(x, w))
    no_mask = C.AttentionWeights(*(getattr(w, n) for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")), w.heads)
    assert not b.contains(C.attention_forward(x, no_mask))         # the old certificate's function
    with pytest.raises(ValueError, match="softcap.*score"):
        C.AttentionWeights.from_module(knn.MultiheadAttention(8, 2, score=keyfold.softcap(5.0)))
    with pytest.raises(ValueError, match="score modifier"):
        C.BlockWeights.from_module(knn.TransformerEncoderLayer(8, 2, 16, score=keyfold.softcap(5.0)))


@pytest.mark.parametrize("make", [lambda: torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True),
                                  lambda: torch.nn.MultiheadAttention(8, 2, add_zero_attn=True, batch_first=True),
                                  lambda: knn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True),
                                  lambda: knn.MultiheadAttention(8, 2, add_zero_attn=True, batch_first=True)])
def test_attention_from_module_refuses_the_keys_it_does_not_model(make):
    """add_bias_kv and add_zero_attn add a key every row sees: from_module read only the projections, so
    the certificate was for the layer without that key, and the layer's own output at the centre of
    the box lay outside it (by up to 0.87 with add_bias_kv; a review, 2026-12-07)."""
    mha = make().double().eval()
    x = torch.randn(5, 8, dtype=torch.float64)
    with torch.no_grad():
        real = mha(x[None], x[None], x[None], need_weights=False)[0][0]
    name = "add_bias_kv" if mha.bias_k is not None else "add_zero_attn"
    with pytest.raises(ValueError, match=f"{name}=True"):
        C.AttentionWeights.from_module(mha)
    # the weights alone give a certificate the layer's output escapes: what from_module used to return
    mha.bias_k, mha.bias_v, mha.add_zero_attn = None, None, False
    plain = C.AttentionWeights.from_module(mha)
    assert not C.certify_attention(x, plain, eps=1e-3).contains(real)


@pytest.mark.parametrize("cls", [torch.nn.MultiheadAttention, knn.MultiheadAttention])
def test_attention_from_module_refuses_cross_attention_by_name(cls):
    """kdim / vdim other than embed_dim: from_module took the layer, and the certificate raised a bare
    "mat1 and mat2 shapes cannot be multiplied" (a review, 2026-12-07)."""
    with pytest.raises(ValueError, match="kdim = vdim = embed_dim"):
        C.AttentionWeights.from_module(cls(8, 2, kdim=6, vdim=6, batch_first=True))


def test_block_from_module_reads_a_layer_built_without_biases():
    """bias=False (torch's and keyfold's encoder layers): no bias tensors, and from_module raised
    AttributeError on None; now zeros, and the certificate contains the layer's outputs on the box."""
    torch.manual_seed(0)
    for layer in (torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, bias=False),
                  knn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, bias=False)):
        layer = layer.double().eval()
        w = C.BlockWeights.from_module(layer)
        x = torch.randn(6, 8, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(C.block_forward(x, w), layer(x[None])[0])
            b = C.certify_block(x, w, eps=0.05)
            assert all(b.contains(y) for y in layer(C.sample_box(x - 0.05, x + 0.05, 32,
                                                                  generator=torch.Generator().manual_seed(1))))


# -------------------------------- 10. the linear relaxation at large scores: finite and sound


@pytest.mark.parametrize("gain", [10.0, 100.0, 1000.0])
@pytest.mark.parametrize("mask", [None, keyfold.causal(), keyfold.causal() & keyfold.window(2)])
def test_linear_relaxation_is_finite_and_sound_at_large_scores(gain, mask):
    w = C.AttentionWeights.random(8, 2, seed=0, gain=gain)
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    eps = 0.1
    ys = C.attention_forward(C.sample_box(x - eps, x + eps, 200, generator=torch.Generator().manual_seed(2)), w,
                             mask)
    for method in C.Method:
        b = C.certify_attention(x, w, eps=eps, mask=mask, method=method)
        assert torch.isfinite(b.lo).all() and torch.isfinite(b.hi).all(), method
        assert all(b.contains(y) for y in ys), method


def test_block_certificate_is_finite_at_large_scores():
    w = C.BlockWeights.random(8, 2, 16, seed=3)
    big = C.AttentionWeights.random(8, 2, seed=3, gain=300.0)
    w = C.BlockWeights(big, w.w1, w.b1, w.w2, w.b2, w.ln1, w.ln2)
    x = torch.randn(6, 8, dtype=torch.float64)
    b = C.certify_block(x, w, eps=0.1, mask=keyfold.causal())
    assert torch.isfinite(b.lo).all() and torch.isfinite(b.hi).all()
    ys = C.block_forward(C.sample_box(x - 0.1, x + 0.1, 100), w, keyfold.causal())
    assert all(b.contains(y) for y in ys)


# ------------------------------------------------ 10. attention in fp16 at the fp16 maximum


@pytest.mark.parametrize("backend", [keyfold.Backend.AUTO, keyfold.Backend.REFERENCE, keyfold.Backend.CPU])
@pytest.mark.parametrize("mask", [None, keyfold.causal()])
@pytest.mark.parametrize("N", [3, 300])
def test_fp16_attention_at_the_fp16_maximum(backend, mask, N):
    """Every q, k, v entry is 65504: all scores are equal (about 1e10, far past fp16), so the
    exact answer is 65504 everywhere; it used to come back inf (the weights summed to N)."""
    x = torch.full((1, 2, N, 8), 65504.0, dtype=torch.float16)
    out = keyfold.attention(x, x, x, mask=mask, backend=backend)
    assert torch.isfinite(out).all() and (out == 65504.0).all()


def test_merge_of_huge_equal_lse_is_the_average():
    """Two halves with lse ~1e10: logaddexp's log(2) rounds away in float32, and weights
    exp(lse_x - lse) used to be 1 each (the output doubled)."""
    lse = torch.full((1, 1, 2), 1.2e10)
    a, b = State(torch.full((1, 1, 2, 4), 3.0), lse), State(torch.full((1, 1, 2, 4), 5.0), lse.clone())
    m = merge(a, b)
    assert torch.allclose(m.out, torch.full_like(m.out, 4.0))
    empty = State(torch.zeros(1, 1, 2, 4), torch.full((1, 1, 2), float("-inf")))
    assert torch.equal(merge(empty, empty).out, empty.out) and torch.isneginf(merge(empty, empty).lse).all()
    assert torch.equal(merge(empty, a).out, a.out) and torch.equal(merge(a, empty).out, a.out)


# ------------------------------------------------ the fuzz count per module (README's reliability)


def test_fault_fuzz_counts_every_module_and_finds_an_injected_bug(monkeypatch, tmp_path):
    from keyfold.apps.verify import faults as F
    from keyfold.caches import KVCache

    tallies = F.run_all(dict(core=20, caches=120, distributed=30, control=4, verify=6), progress=False)
    assert [t.wrong for t in tallies] == [0] * 5, [c for t in tallies for c in t.cases]
    assert all(t.inputs > 0 for t in tallies) and sum(t.errors for t in tallies) > 0
    # the count can fail: put back the reset that kept the old request's values
    monkeypatch.setattr(KVCache, "reset", lambda self, seq_ids=None: [self._len.__setitem__(s, 0) for s in (
        range(self.batch) if seq_ids is None else seq_ids)] and setattr(self, "_whole", None))
    assert F.fuzz_caches(200, 0).wrong > 0
    assert F.main(["--quick", "--modules", "distributed", "--out", str(tmp_path)]) == 0
    assert "| keyfold.distributed |" in (tmp_path / "faults-quick.md").read_text()


def test_error_bound_takes_attends_bool_tensor_mask_and_names_what_it_refuses():
    """error_bound says it takes attend's arguments, but refused every tensor mask with a TypeError
    saying a mask must be a keyfold mask (a review, 2026-12-07). A bool tensor only decides which pairs
    are seen (the bound already charges all keys); an additive one moves the scores: refused by name."""
    from keyfold.apps.verify.bounds import error_bound
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 16, generator=g, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.rand(12, 12, generator=g) > 0.3
    keep[:, 0] = True
    bound = error_bound(q, k, v, mask=keep)
    err = (keyfold.attend(q, k, v, mask=keep).out.double()
           - keyfold.attend(q.double(), k.double(), v.double(), mask=keep).out).abs()
    assert bool((err <= bound.out).all()) and bool((err > 0).any())
    with pytest.raises(ValueError, match="additive"):
        error_bound(q, k, v, mask=torch.zeros(12, 12))


def test_a_layers_second_norm_keeps_its_own_eps():
    """from_module read norm1's eps for both LayerNorms: a layer whose norm2 had another eps put its own
    outputs 0.26-0.37 outside the certified bounds (a review, 2026-12-08). Now every sample of the box
    lies inside, for both methods; activation=torch.relu is taken as ReLU."""
    from keyfold.apps.verify.certify import BlockWeights, Method, block_forward, certify_block, sample_box
    torch.manual_seed(0)
    for activation in ("relu", torch.relu):
        layer = torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True,
                                                 activation=activation).double().eval()
        layer.norm2 = torch.nn.LayerNorm(4, eps=0.5).double()
        x = torch.randn(3, 4, dtype=torch.float64) * 0.3
        w = BlockWeights.from_module(layer)
        assert (w.eps, w.eps_of_ln2) == (layer.norm1.eps, 0.5)
        with torch.no_grad():
            ys = layer(sample_box(x - 1e-3, x + 1e-3, 200))
            torch.testing.assert_close(block_forward(x, w), layer(x))
        for method in Method:
            b = certify_block(x, w, eps=1e-3, method=method)
            assert bool((ys <= b.hi + 1e-12).all()) and bool((ys >= b.lo - 1e-12).all())


def test_the_fault_tool_counts_a_refused_valid_layer_as_wrong_and_covers_blocks(monkeypatch):
    """fuzz_verify filed any ValueError as a clear error for invalid input, but every input it draws is
    valid: a certifier that refused every layer scored 0 wrong answers; and it never ran certify_block
    (a review, 2026-12-08)."""
    from keyfold.apps.verify import faults
    calls = []
    real = C.certify_block
    monkeypatch.setattr(C, "certify_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert faults.fuzz_verify(6, 0).wrong == 0 and calls

    def refuse(*args, **kwargs):
        raise ValueError("a softmax denominator's lower bound reached 0")
    monkeypatch.setattr(C, "certify_attention", refuse)
    assert faults.fuzz_verify(6, 0).wrong > 0
