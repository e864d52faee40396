"""keyfold.nn against torch.nn: the cases of torch's own MultiheadAttention / Transformer-layer tests
that run on a CPU (test/test_nn.py, test/nn/test_multihead_attention.py, test/test_transformers.py),
rewritten here, and a regression test for every silent divergence of issue #18."""

from __future__ import annotations

import itertools

import pytest
import torch

from keyfold import nn as knn

F64 = torch.float64


def _mha_pair(E, H, **kw):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, **kw).to(F64)
    ours = knn.MultiheadAttention(E, H, **kw).to(F64)
    ours.load_state_dict(ref.state_dict())  # the same keys, in both directions
    ref.load_state_dict(ours.state_dict())
    return ref.eval(), ours.eval()


def assert_close_to_torch(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=tol, rtol=0), float((a - b).abs().max())


@pytest.mark.parametrize("add_bias_kv,add_zero_attn,bias,kvdim,batch_first",
                         list(itertools.product([False, True], [False, True], [False, True], [None, (5, 3)],
                                                [False, True])))
def test_multihead_attention_matches_torch(add_bias_kv, add_zero_attn, bias, kvdim, batch_first):
    """torch's test_multihead_attention: every construction option, weights and output."""
    E, H, B, L, S = 8, 2, 3, 4, 6
    kdim, vdim = kvdim or (None, None)
    ref, ours = _mha_pair(E, H, bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim,
                          vdim=vdim, batch_first=batch_first)
    assert set(ref.state_dict()) == set(ours.state_dict())
    shape = (lambda n, d: (B, n, d)) if batch_first else (lambda n, d: (n, B, d))
    q = torch.randn(shape(L, E), dtype=F64)
    k, v = torch.randn(shape(S, kdim or E), dtype=F64), torch.randn(shape(S, vdim or E), dtype=F64)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, -2:] = True
    am = torch.rand(L, S) < 0.3
    am[:, 0] = False
    for kw in ({}, {"key_padding_mask": kpm}, {"attn_mask": am}, {"attn_mask": am, "key_padding_mask": kpm}):
        for avg in (True, False):
            want, w_want = ref(q, k, v, average_attn_weights=avg, **kw)
            got, w_got = ours(q, k, v, average_attn_weights=avg, **kw)
            assert_close_to_torch(got, want)
            assert_close_to_torch(w_got, w_want)


def test_multihead_attention_3d_and_float_masks_and_float_key_padding():
    """torch's test_multihead_attn_3d_attn_mask and float key_padding_mask, with gradients."""
    E, H, B, L, S = 12, 3, 2, 5, 7
    ref, ours = _mha_pair(E, H)
    q, k = torch.randn(L, B, E, dtype=F64), torch.randn(S, B, E, dtype=F64)
    m3 = torch.rand(B * H, L, S) < 0.3
    m3[..., 1] = False
    f3 = torch.randn(B * H, L, S, dtype=F64)
    fk = torch.randn(B, S, dtype=F64)
    for kw in ({"attn_mask": m3}, {"attn_mask": f3}, {"key_padding_mask": fk}, {"attn_mask": f3, "key_padding_mask": fk}):
        assert_close_to_torch(ours(q, k, k, **kw)[0], ref(q, k, k, **kw)[0])
        assert_close_to_torch(ours(q, k, k, **kw)[1], ref(q, k, k, **kw)[1])


def test_unbatched_inputs_match_torch():
    ref, ours = _mha_pair(8, 2)
    q, k = torch.randn(4, 8, dtype=F64), torch.randn(6, 8, dtype=F64)
    kpm = torch.tensor([False] * 4 + [True] * 2)
    for kw in ({}, {"key_padding_mask": kpm}, {"attn_mask": torch.rand(4, 6) < 0.2}):
        want, ww = ref(q, k, k, **kw)
        got, wg = ours(q, k, k, **kw)
        assert_close_to_torch(got, want)
        assert_close_to_torch(wg, ww)


def test_shape_and_dtype_errors_raise_where_torch_raises():
    """torch's test_multihead_attn_invalid_shape and mask dtype checks: the same exception type."""
    ref, ours = _mha_pair(8, 2)
    q = torch.randn(4, 3, 8, dtype=F64)
    bad = [
        ((q, torch.randn(4, 8, dtype=F64), torch.randn(4, 8, dtype=F64)), {}),            # 3-D query, 2-D key
        ((q, q, q), {"key_padding_mask": torch.zeros(3, dtype=torch.bool)}),               # 1-D kpm, batched
        ((q, q, q), {"attn_mask": torch.zeros(4, 4, 4, dtype=torch.bool)}),                # 3-D mask not B*H
        ((q, q, q), {"attn_mask": torch.zeros(4, dtype=torch.bool)}),                      # 1-D mask
        ((q, q, q), {"key_padding_mask": torch.zeros(3, 4, dtype=torch.long)}),            # int mask
        ((q, q, q), {"attn_mask": torch.zeros(4, 5, dtype=torch.bool)}),                   # wrong 2-D size
    ]
    for args, kw in bad:
        with pytest.raises(Exception) as e_ref:
            ref(*args, **kw)
        with pytest.raises(type(e_ref.value)):
            ours(*args, **kw)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ours(q, q, q, is_causal=True)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ref(q, q, q, is_causal=True)
    with pytest.raises(AssertionError):
        torch.nn.MultiheadAttention(10, 3)
    with pytest.raises(AssertionError):
        knn.MultiheadAttention(10, 3)


def test_is_causal_hint_follows_torch():
    ref, ours = _mha_pair(8, 2)
    x = torch.randn(5, 2, 8, dtype=F64)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    for nw in (False, True):
        assert_close_to_torch(ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=nw)[0],
                              ref(x, x, x, attn_mask=causal, is_causal=True, need_weights=nw)[0])


def test_dropout_in_training_only_and_expectation():
    torch.manual_seed(0)
    ours = knn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True).to(F64)
    x = torch.randn(2, 6, 8, dtype=F64)
    ours.eval()
    base = ours(x, x, x)[0]
    assert torch.equal(base, ours(x, x, x)[0])
    ours.train()
    a, wa = ours(x, x, x, average_attn_weights=False)
    b = ours(x, x, x)[0]
    assert not torch.allclose(a, b)                       # a fresh mask per call
    assert ((wa == 0).double().mean() - 0.5).abs() < 0.1  # half the probabilities dropped ...
    assert torch.allclose(wa[wa > 0].sum() / wa.numel(), torch.tensor(1 / 6, dtype=F64), atol=0.03)  # ... rest x2
    mean = torch.stack([ours(x, x, x, need_weights=False)[0] for _ in range(400)]).mean(0)
    assert (mean - base).abs().max() < 0.1 * base.abs().max()


def _layer_pair(cls, kcls, *args, **kw):
    torch.manual_seed(0)
    ref = cls(*args, **kw).to(F64).eval()
    ours = kcls(*args, **kw).to(F64).eval()
    assert set(ref.state_dict()) == set(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    return ref, ours


@pytest.mark.parametrize("norm_first,batch_first,activation,bias",
                         list(itertools.product([False, True], [False, True], ["relu", "gelu", torch.tanh],
                                                [True, False])))
def test_encoder_and_decoder_layers_match_torch(norm_first, batch_first, activation, bias):
    """torch's test_transformerencoderlayer / decoderlayer (and _gelu, norm_first, bias=False)."""
    d, h, ff = 8, 2, 16
    kw = dict(dropout=0.0, activation=activation, layer_norm_eps=1e-6, batch_first=batch_first,
              norm_first=norm_first, bias=bias)
    enc_ref, enc = _layer_pair(torch.nn.TransformerEncoderLayer, knn.TransformerEncoderLayer, d, h, ff, **kw)
    dec_ref, dec = _layer_pair(torch.nn.TransformerDecoderLayer, knn.TransformerDecoderLayer, d, h, ff, **kw)
    B, T, S = 2, 5, 7
    src = torch.randn((B, S, d) if batch_first else (S, B, d), dtype=F64)
    tgt = torch.randn((B, T, d) if batch_first else (T, B, d), dtype=F64)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -3:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(T, dtype=F64)
    with torch.no_grad():
        assert_close_to_torch(enc(src, src_key_padding_mask=kpm), enc_ref(src, src_key_padding_mask=kpm))
        mem = enc_ref(src)
        assert_close_to_torch(dec(tgt, mem, tgt_mask=causal, memory_key_padding_mask=kpm, tgt_is_causal=True),
                              dec_ref(tgt, mem, tgt_mask=causal, memory_key_padding_mask=kpm, tgt_is_causal=True))


def test_stacks_match_torch():
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0).to(F64)
    ref = torch.nn.TransformerEncoder(layer, 2, norm=torch.nn.LayerNorm(8).to(F64), enable_nested_tensor=False).eval()
    ours = knn.TransformerEncoder(knn.TransformerEncoderLayer(8, 2, 16, dropout=0.0).to(F64), 2,
                                  norm=torch.nn.LayerNorm(8).to(F64)).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 2, 8, dtype=F64)
    with torch.no_grad():
        assert_close_to_torch(ours(x), ref(x))
    dl = torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0).to(F64)
    dref = torch.nn.TransformerDecoder(dl, 2).eval()
    dours = knn.TransformerDecoder(knn.TransformerDecoderLayer(8, 2, 16, dropout=0.0).to(F64), 2).eval()
    dours.load_state_dict(dref.state_dict())
    t = torch.randn(4, 2, 8, dtype=F64)
    with torch.no_grad():
        assert_close_to_torch(dours(t, x), dref(t, x))


def test_bad_activation_raises_like_torch():
    with pytest.raises(RuntimeError, match="relu/gelu"):
        torch.nn.TransformerEncoderLayer(8, 2, activation="swish")
    with pytest.raises(RuntimeError, match="relu/gelu"):
        knn.TransformerEncoderLayer(8, 2, activation="swish")


# ------------------------------------------------------------------- #18's silent divergences


def test_regression_seq_first_input_is_attended_along_the_sequence():
    """(L, B, E) with the default batch_first=False was attended along the batch axis (diff 0.70)."""
    ref, ours = _mha_pair(8, 2)
    x = torch.randn(6, 3, 8, dtype=F64)
    assert_close_to_torch(ours(x, x, x)[0], ref(x, x, x)[0])
    assert ours.batch_first is False


def test_regression_float_attn_mask_gets_its_gradient():
    """A float attn_mask with requires_grad got no gradient (it was detached)."""
    ref, ours = _mha_pair(8, 2)
    x = torch.randn(4, 2, 8, dtype=F64)
    m = torch.randn(4, 4, dtype=F64, requires_grad=True)
    (g_ref,) = torch.autograd.grad(ref(x, x, x, attn_mask=m, need_weights=False)[0].sum(), m)
    (g_ours,) = torch.autograd.grad(ours(x, x, x, attn_mask=m, need_weights=False)[0].sum(), m)
    assert_close_to_torch(g_ours, g_ref, 1e-9)


def test_regression_float64_mask_is_not_rounded_through_float32():
    ref, ours = _mha_pair(8, 2)
    x = torch.randn(4, 2, 8, dtype=F64)
    m = torch.randn(4, 4, dtype=F64) * 1e3 + torch.rand(4, 4, dtype=F64) * 1e-7
    assert_close_to_torch(ours(x, x, x, attn_mask=m)[0], ref(x, x, x, attn_mask=m)[0], 1e-12)


def test_regression_gelu_as_fifth_positional_argument():
    """TransformerEncoderLayer(d, h, ff, p, "gelu") built a different layer (norm_first was 5th)."""
    enc_ref, enc = _layer_pair(torch.nn.TransformerEncoderLayer, knn.TransformerEncoderLayer, 8, 2, 16, 0.0, "gelu")
    assert enc.activation is torch.nn.functional.gelu and enc.norm_first is False
    x = torch.randn(5, 2, 8, dtype=F64)
    with torch.no_grad():
        assert_close_to_torch(enc(x), enc_ref(x))


def test_need_weights_default_and_fully_masked_rows():
    ref, ours = _mha_pair(8, 2)
    x = torch.randn(3, 2, 8, dtype=F64)
    out, w = ours(x, x, x)
    assert w is not None and w.shape == (2, 3, 3)
    kpm = torch.ones(2, 3, dtype=torch.bool)
    kpm[1, 0] = False
    out, w = ours(x, x, x, key_padding_mask=kpm)
    assert torch.equal(out[:, 0], torch.zeros(3, 8, dtype=F64)) and torch.equal(w[0], torch.zeros(3, 3, dtype=F64))
    assert torch.isnan(ref(x, x, x, key_padding_mask=kpm)[0][:, 0]).all()  # torch gives NaN (documented)


@pytest.mark.parametrize("average", [True, False])
def test_float32_weights_are_as_accurate_as_torchs_and_rows_sum_to_one(average):
    """Weights were exp(s - lse) with lse from the attention call's own rounding of the scores: on
    peaked float32 rows 24x torch's error, rows summing to 1 +- 1.4e-5; and with finfo.min on every
    key of a row (a float key_padding_mask over a fully padded entry) each weight was 1, rows summing
    to S (fuzzing, 2026-12-06). Each row is now normalised by its own sum."""
    ref, ours = _mha_pair(32, 2, batch_first=True)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.6)
    ours.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(2, 8, 32, generator=g, dtype=F64) * 3, torch.randn(2, 31, 32, generator=g, dtype=F64) * 3
    _, w64 = ref(x, m, m, need_weights=True, average_attn_weights=average)
    _, w_t = ref.float()(x.float(), m.float(), m.float(), need_weights=True, average_attn_weights=average)
    _, w_k = ours.float()(x.float(), m.float(), m.float(), need_weights=True, average_attn_weights=average)
    e_t, e_k = float((w_t.double() - w64).abs().max().detach()), float((w_k.double() - w64).abs().max().detach())
    assert e_k <= 2 * e_t + 1e-6, (e_k, e_t)
    pad = torch.zeros(2, 31).masked_fill(torch.tensor([[False] * 31, [True] * 31]), torch.finfo(torch.float32).min)
    _, w = ours(x.float(), m.float(), m.float(), key_padding_mask=pad, need_weights=True, average_attn_weights=average)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)), atol=1e-5, rtol=0)


def test_key_padding_to_mask_serves_more_queries_than_keys():
    """A padding pattern that is not a suffix became documents ids covering max(n_queries, S) query positions:
    with more queries than keys (the default n_queries) the call raised about documents(ids) (a review,
    2026-12-08). It is padding(keys=...) now, for any number of queries; equal to torch's SDPA."""
    from keyfold.nn import key_padding_to_mask
    kpm = torch.tensor([[True, False, False], [False, True, False]])
    q, k = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 3, 8)
    import keyfold as kf
    got = kf.attention(q, k, k, mask=key_padding_to_mask(kpm), q_offset=0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=~kpm[:, None, None, :])
    torch.testing.assert_close(got, want)


def test_torch_transformer_takes_keyfolds_encoder_and_decoder():
    """keyfold has no Transformer class of its own: torch.nn.Transformer(custom_encoder=, custom_decoder=)
    takes keyfold's stacks, loads torch's state_dict and gives torch's outputs (a review, 2026-12-08)."""
    torch.manual_seed(0)
    t = torch.nn.Transformer(16, 4, 2, 2, 32, dropout=0.0, batch_first=True)
    enc = knn.TransformerEncoder(knn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2,
                                 norm=torch.nn.LayerNorm(16))
    dec = knn.TransformerDecoder(knn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2,
                                 norm=torch.nn.LayerNorm(16))
    k = torch.nn.Transformer(16, 4, custom_encoder=enc, custom_decoder=dec, batch_first=True)
    k.load_state_dict(t.state_dict())
    src, tgt = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    for kw in (dict(), dict(tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=pad, memory_key_padding_mask=pad)):
        torch.testing.assert_close(k(src, tgt, **kw), t(src, tgt, **kw), atol=2e-6, rtol=1e-5)
