"""PyTorch's own MultiheadAttention / Transformer-layer tests, ported to ``keyfold.nn``.

Sources (facts only, no code), all in pytorch/pytorch:
``test/nn/test_multihead_attention.py`` (TestMultiheadAttentionNN, TestMultiheadAttentionNNDeviceType),
``test/test_transformers.py`` (TestTransformers: the MHA, encoder and decoder cases that run on a CPU),
``test/test_nn.py`` (test_transformerdecoderlayer, _gelu, test_transformerdecoder,
test_transformer_layer_args_check). Every case builds the torch module and keyfold's with the same
weights (state_dict both ways) and compares keyfold against torch itself at torch's sizes and
tolerances; torch's hard-coded reference numbers are not copied (torch is run instead).

Deliberate differences, asserted as keyfold documents them (README, "torch.nn parity"):
- a query row that sees no key: torch gives NaN (need_weights=True, or its fast path) or 0 (its
  SDPA path); keyfold's attention gives 0, so the layer output is ``out_proj.bias`` and the weights 0.
- no inference fast path: no NestedTensor inputs (a clear AssertionError), padded positions are
  computed as torch's slow path computes them, and no fast-path warnings.
- no ``static_k``/``static_v`` (those are arguments of torch's functional
  ``multi_head_attention_forward``, which keyfold does not have): the saved_kv variants are not ported;
  nor TorchScript (torch.jit) or ``nn.Transformer`` (keyfold has the layers and the stacks).
"""

from __future__ import annotations

import itertools
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from keyfold import nn as knn

F64 = torch.float64


def _same_weights(ref, ours):
    assert set(ref.state_dict()) == set(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    return ref, ours


def mha_pair(*args, seed=0, **kw):
    torch.manual_seed(seed)
    return _same_weights(nn.MultiheadAttention(*args, **kw), knn.MultiheadAttention(*args, **kw))


def layer_pair(name, *args, seed=0, **kw):
    torch.manual_seed(seed)
    return _same_weights(getattr(nn, name)(*args, **kw), getattr(knn, name)(*args, **kw))


def cos_weights_(*modules):
    """torch's deterministic layer tests: parameter p gets cos(arange(p.numel())) in its shape."""
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                p.copy_(torch.cos(torch.arange(p.numel(), dtype=torch.float32)).view(p.shape))


def assert_matches_torch(got, want, *, empty_rows=None, fill=None, **tol):
    """``got`` equals torch's ``want``; on ``empty_rows`` (rows torch leaves NaN, shape ``got.shape[:-1]``)
    keyfold's documented value ``fill`` (``out_proj.bias``, or 0 for weights) instead."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not torch.isnan(got).any(), "keyfold output has NaN"
    if empty_rows is not None and bool(empty_rows.any()):
        exp = torch.broadcast_to(fill, got.shape).to(got.dtype)
        torch.testing.assert_close(got[empty_rows], exp[empty_rows], **tol)
        got, want = got[~empty_rows], want[~empty_rows]
    torch.testing.assert_close(got, want, **tol)


# ====================================================== test/nn/test_multihead_attention.py

MHA_VARIANTS = {  # torch's _multihead_attn_test_helper calls that do not use saved (static) k/v
    "no_masking": {},
    "add_bias_kv": {"add_bias_kv": True},
    "add_zero_attn": {"add_zero_attn": True},
    "key_padding_mask": {"add_key_padding_mask": True},
    "add_bias_kv_zero_attn": {"add_key_padding_mask": True, "add_bias_kv": True, "add_zero_attn": True},
    "same_embed_dim_kpm_zero_attn": {"add_key_padding_mask": True, "add_zero_attn": True, "same_embed_dim": True},
}
MHA_ITERS = 10  # torch draws 100 random sizes per variant; 10 keep the file fast


@pytest.mark.parametrize("variant", MHA_VARIANTS)
@pytest.mark.parametrize("average_attn_weights", [True, False])
def test_multihead_attention(variant, average_attn_weights):
    """TestMultiheadAttentionNN.test_multihead_attention: random batch 2-10, source length 2-10,
    head dim 3-10, an even 4-10 heads, kdim = vdim 5-20 (or embed_dim), one decoder-state query
    (L=1), key = value; a float attn_mask (1, S) of 0 / -inf; a bool key_padding_mask drawn once and
    repeated over the batch; out and weights within atol 1e-5 (float32). Where the two masks hide
    every key, torch gives NaN and keyfold ``out_proj.bias`` / zero weights (deliberate)."""
    opt = MHA_VARIANTS[variant]
    rng = random.Random(f"{variant}-{average_attn_weights}")
    gen = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    for _ in range(MHA_ITERS):
        bsz, S = rng.randint(2, 10), rng.randint(2, 10)
        d_head, nheads = rng.randint(3, 10), rng.randint(2, 5) * 2
        d_model = d_head * nheads
        kv_dim = d_model if opt.get("same_embed_dim") else rng.randint(5, 20)
        ref, ours = mha_pair(d_model, nheads, add_bias_kv=opt.get("add_bias_kv", False),
                             add_zero_attn=opt.get("add_zero_attn", False), kdim=kv_dim, vdim=kv_dim,
                             seed=rng.randrange(2 ** 31))
        with torch.no_grad():  # torch's init leaves in_proj_bias at 0; draw one so the bias path is checked
            ref.in_proj_bias.uniform_(-0.5, 0.5, generator=gen)
            ref.out_proj.bias.uniform_(-0.5, 0.5, generator=gen)
        ours.load_state_dict(ref.state_dict())
        q = torch.rand(1, bsz, d_model, generator=gen)                  # (L=1, B, E)
        kv = torch.rand(S, bsz, kv_dim, generator=gen)                  # (S, B, kdim)
        am = torch.zeros(1, S).masked_fill(torch.randint(0, 2, (1, S), generator=gen) == 0, float("-inf"))
        kpm = None
        if opt.get("add_key_padding_mask"):
            kpm = (torch.randint(0, 2, (1, S), generator=gen) == 1).repeat(bsz, 1)
        kw = {"key_padding_mask": kpm, "attn_mask": am, "average_attn_weights": average_attn_weights}
        want, w_want = ref(q, kv, kv, **kw)
        got, w_got = ours(q, kv, kv, **kw)
        empty = torch.isnan(want).any(-1)                               # (1, B): every key hidden
        assert_matches_torch(got, want, empty_rows=empty, fill=ours.out_proj.bias, atol=1e-5, rtol=0)
        w_empty = torch.isnan(w_want).all(-1)
        assert_matches_torch(w_got, w_want, empty_rows=w_empty, fill=torch.zeros(()), atol=1e-5, rtol=0)


def test_multihead_attn_3d_attn_mask():
    """TestMultiheadAttentionNN.test_multihead_attn_3d_attn_mask: embed 8, 4 heads, batch 8, 3 keys,
    2 queries, a float 0/-inf (N, T, S) mask repeated per head to (N*H, T, S): the 3-D call equals
    the per-sample 2-D calls, and torch."""
    E, H, B, S, T = 8, 4, 8, 3, 2
    gen = torch.Generator().manual_seed(0)
    ref, ours = mha_pair(E, H)
    query, key = torch.rand(B, T, E, generator=gen), torch.rand(B, S, E, generator=gen)
    am = torch.zeros(B, T, S).masked_fill(torch.randint(0, 2, (B, T, S), generator=gen) == 0, float("-inf"))
    am3 = torch.repeat_interleave(am, H, dim=0)
    out3 = ours(query.transpose(0, 1), key.transpose(0, 1), key.transpose(0, 1), attn_mask=am3)[0]
    want3 = ref(query.transpose(0, 1), key.transpose(0, 1), key.transpose(0, 1), attn_mask=am3)[0]
    empty = torch.isinf(am).all(-1).transpose(0, 1)                      # (T, B)
    assert_matches_torch(out3, want3, empty_rows=empty, fill=ours.out_proj.bias)
    for i in range(B):
        out2 = ours(query[i].unsqueeze(1), key[i].unsqueeze(1), key[i].unsqueeze(1), attn_mask=am[i])[0]
        torch.testing.assert_close(out3[:, i:i + 1], out2)


def test_multihead_attn_no_bias():
    """TestMultiheadAttentionNN.test_multihead_attn_no_bias: bias=False drops both projections' bias."""
    mha = knn.MultiheadAttention(8, 4, bias=False)
    assert mha.in_proj_bias is None and mha.out_proj.bias is None


def _invalid_shape_cases(fast_path: bool):
    """TestMultiheadAttentionNN._test_multihead_attn_invalid_shape_impl (and, with ``fast_path``,
    test_multihead_attn_fast_path_invalid_shape's 3-D cases: 3-long masks, (3, 3) key/value and
    need_weights=False): (args, kwargs, message)."""
    q3, q2 = torch.randn(4, 4, 4), torch.randn(4, 4)
    n = 3 if fast_path else 4
    bool1 = torch.tensor([False, False, True, True][-n:])
    nw = {"need_weights": False} if fast_path else {}
    return [
        ((q3, torch.randn(n, n), q3), nw, "expected `key` and `value` to be 3-D but found 2-D and 3-D tensors respectively"),
        ((q3, q3, torch.randn(n, n)), nw, "expected `key` and `value` to be 3-D but found 3-D and 2-D tensors respectively"),
        ((q3, q3, q3), {"key_padding_mask": bool1, **nw}, "expected `key_padding_mask` to be `None` or 2-D but found 1-D tensor instead"),
        ((q3, q3, q3), {"attn_mask": bool1, **nw}, "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"),
        ((q2, torch.randn(4, 4, 4), q2), {}, "expected `key` and `value` to be 2-D but found 3-D and 2-D tensors respectively"),
        ((q2, q2, torch.randn(4, 4, 4)), {}, "expected `key` and `value` to be 2-D but found 2-D and 3-D tensors respectively"),
        ((q2, q2, q2), {"key_padding_mask": torch.tensor([[False, False, True, True] * 2])},
         "expected `key_padding_mask` to be `None` or 1-D but found 2-D tensor instead"),
        ((q2, q2, q2), {"attn_mask": torch.tensor([False, False, True, True])},
         "expected `attn_mask` to be `None`, 2-D or 3-D but found 1-D tensor instead"),
        ((q2, q2, q2), {"attn_mask": torch.randn(5, 4, 4).bernoulli_().bool()}, r"Expected `attn_mask` shape to be \(4, 4, 4\)"),
    ]


@pytest.mark.parametrize("mode", ["train", "eval_no_grad", "fast_path_batch_first"])
def test_multihead_attn_invalid_shape(mode):
    """TestMultiheadAttentionNN.test_multihead_attn_invalid_shape (train, then eval under no_grad)
    and test_multihead_attn_fast_path_invalid_shape (batch_first, eval, need_weights=False):
    AssertionError with torch's message from keyfold everywhere, as torch's tests expect; torch 2.13's
    own fast path raises RuntimeError for the 1-D masks instead (still raises)."""
    for mod in (nn.MultiheadAttention, knn.MultiheadAttention):
        mha = mod(4, 4, batch_first=mode == "fast_path_batch_first")
        if mode != "train":
            mha.eval()
        with torch.no_grad() if mode != "train" else torch.enable_grad():
            for args, kw, msg in _invalid_shape_cases(mode == "fast_path_batch_first"):
                if mode == "fast_path_batch_first" and mod is nn.MultiheadAttention and "mask" in msg:
                    with pytest.raises((AssertionError, RuntimeError)):  # torch 2.13's fast path: RuntimeError
                        mha(*args, **kw)
                    continue
                with pytest.raises(AssertionError, match=msg):
                    mha(*args, **kw)


def test_multihead_attn_nested_tensor_outside_fast_path():
    """TestMultiheadAttentionNN.test_multihead_attn_nested_tensor_outside_fast_path: 10 dims, 5 heads,
    jagged NestedTensor inputs. torch (2.13) raises AssertionError there (odd heads: no fast path);
    keyfold has no NestedTensor support at all and raises AssertionError saying to pad (deliberate);
    an empty nested tensor raises AssertionError from both."""
    nt = torch.nested.nested_tensor([torch.randn(4, 10), torch.randn(6, 10)], layout=torch.jagged)
    for mod in (nn.MultiheadAttention, knn.MultiheadAttention):
        with pytest.raises(AssertionError):
            mod(10, 5, batch_first=True).eval()(nt, nt, nt)
    with pytest.raises(AssertionError, match="pad them"):
        knn.MultiheadAttention(10, 2, batch_first=True).eval()(nt, nt, nt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        empty = torch.nested.nested_tensor([])
    for mod in (nn.MultiheadAttention, knn.MultiheadAttention):
        with pytest.raises(AssertionError):
            mod(10, 5, batch_first=True)(empty, empty, empty)


def test_multihead_self_attn_two_masks_fast_path():
    """TestMultiheadAttentionNNDeviceType.test_multihead_self_attn_two_masks_fast_path: embed 14,
    7 heads, batch 8, length 5, batch_first, a random bool (L, L) attn_mask and (B, L)
    key_padding_mask together, against torch's slow path (need_weights=False); rows both masks hide
    entirely are excluded by torch (NaN) and are ``out_proj.bias`` in keyfold."""
    E, H, B, Ls = 14, 7, 8, 5
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(B, Ls, E, generator=gen)
    am = torch.randint(0, 2, (Ls, Ls), generator=gen).bool()
    kpm = torch.randint(0, 2, (B, Ls), generator=gen).bool()
    ref, ours = mha_pair(E, H, batch_first=True)
    with torch.no_grad():
        ref.train()  # torch's slow path
        want = ref(x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=False)[0]
        got = ours.eval()(x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=False)[0]
    empty = (am.unsqueeze(0) | kpm.unsqueeze(1)).all(-1)               # (B, L)
    assert_matches_torch(got, want, empty_rows=empty, fill=ours.out_proj.bias)


@pytest.mark.parametrize("dtype", [torch.half, torch.float, torch.double], ids=["fp16", "fp32", "fp64"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_dtype(dtype, batch_first):
    """TestMultiheadAttentionNNDeviceType.test_multihead_attention_dtype / _dtype_batch_first (CUDA
    there, the same facts on a CPU): embed 128, 8 heads, length 10, batch 8; the output keeps the
    input's size and dtype, and equals torch's (fp16 within 1e-2)."""
    ref, ours = mha_pair(128, 8, batch_first=batch_first)
    ref, ours = ref.to(dtype).eval(), ours.to(dtype).eval()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 8, 128, generator=gen).to(dtype) for _ in range(3))
    with torch.no_grad():
        got = ours(q, k, v, need_weights=False)[0]
        want = ref(q, k, v, need_weights=False)[0]
    assert got.shape == q.shape and got.dtype == dtype
    tol = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.half else {}
    torch.testing.assert_close(got, want, **tol)


def test_multihead_attn_fast_path_query_and_bias_have_different_dtypes():
    """TestMultiheadAttentionNNDeviceType.test_multihead_attn_fast_path_query_and_bias_have_different_dtypes:
    4 dims, 4 heads, batch_first, float64, in_proj_bias replaced by a float16 one: torch runs.
    Regression: keyfold raised "self and mat2 must have the same dtype"."""
    ref, ours = mha_pair(4, 4, batch_first=True, dtype=F64)
    for m in (ref, ours):
        m.eval()
        m.in_proj_bias = nn.Parameter(torch.linspace(-1, 1, 12).half())
    query = torch.randn(4, 4, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours(query, query, query)[0], ref(query, query, query)[0]
    assert got.dtype == F64
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", ["fast_path_small_test", "in_proj_bias_none", "in_proj_weight_none", "bias_is_none"])
def test_multihead_attn_small_cases(case):
    """TestMultiheadAttentionNNDeviceType.test_multihead_attn_fast_path_small_test (4 dims, 4 heads,
    batch_first, float64), test_multihead_attn_in_proj_bias_none (2, 2, bias=False),
    test_multihead_attn_in_proj_weight_none (4, 4, kdim = vdim = 2) and TestTransformers.test_bias_is_none
    (10 dims, 1 head, bias=False, batch_first, float32): keyfold runs them and equals torch."""
    gen = torch.Generator().manual_seed(0)
    if case == "fast_path_small_test":
        ref, ours = mha_pair(4, 4, batch_first=True, dtype=F64)
        q = k = torch.randn(4, 4, 4, dtype=F64, generator=gen)
    elif case == "in_proj_bias_none":
        ref, ours = mha_pair(2, 2, bias=False, dtype=F64)
        q = k = torch.rand(2, 2, 2, dtype=F64, generator=gen)
    elif case == "in_proj_weight_none":
        ref, ours = mha_pair(4, 4, vdim=2, kdim=2, dtype=F64)
        assert ours.in_proj_weight is None
        q, k = torch.rand(4, 4, 4, dtype=F64, generator=gen), torch.rand(4, 4, 2, dtype=F64, generator=gen)
    else:
        ref, ours = mha_pair(10, 1, bias=False, batch_first=True)
        q = k = torch.rand(1, 5, 10, generator=gen)
    with torch.no_grad():
        got, w_got = ours.eval()(q, k, k)
        want, w_want = ref.eval()(q, k, k)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(w_got, w_want)


def test_fast_path_check_with_mask_eager():
    """TestMultiheadAttentionNNDeviceType.test_fast_path_check_with_mask_does_not_break_in_compile,
    eagerly (keyfold's compile is tested in tests/nn/test_compile.py): d_model 512, 8 heads,
    batch_first, float64, a 2-layer encoder in eval, x (1, 41, 512), a random padding mask with
    position 0 padded; equals torch's slow path (grad enabled)."""
    ref, ours = layer_pair("TransformerEncoderLayer", 512, 8, batch_first=True, dropout=0.1, dtype=F64)
    ref_enc = nn.TransformerEncoder(ref, num_layers=2, enable_nested_tensor=False).eval()
    our_enc = knn.TransformerEncoder(ours, num_layers=2).eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 41, 512, dtype=F64, generator=gen)
    pad = torch.rand(1, 41, generator=gen) > 0.5
    pad[..., 0] = True
    torch.testing.assert_close(our_enc(x, mask=None, src_key_padding_mask=pad),
                               ref_enc(x, mask=None, src_key_padding_mask=pad))


# ====================================================== test/test_transformers.py (TestTransformers)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32], ids=["bool", "float"])
@pytest.mark.parametrize("key_padding_mask_dim", [2, None])
@pytest.mark.parametrize("attn_mask_dim", [2, 3, None])
def test_multiheadattention_fastpath_attn_mask(attn_mask_dim, key_padding_mask_dim, mask_dtype):
    """TestTransformers.test_multiheadattention_fastpath_attn_mask: B 2, L 4, D 8, H 4, batch_first,
    attn_mask (L, L) or (B*H, L, L) and key_padding_mask (B, L), bool or float32 from make_tensor
    (float: uniform in [-9, 9), added); need_weights=False; keyfold in train and eval equals torch's
    train (slow) path. Rows the bool masks hide entirely are 0 attention in both (torch's SDPA path)."""
    B, Ls, D, H = 2, 4, 8, 4
    gen = torch.Generator().manual_seed(attn_mask_dim or 0)

    def make(shape):
        if mask_dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        return torch.rand(shape, generator=gen) * 18 - 9

    am = None if attn_mask_dim is None else make((Ls, Ls) if attn_mask_dim == 2 else (B * H, Ls, Ls))
    kpm = None if key_padding_mask_dim is None else make((B, Ls))
    ref, ours = mha_pair(D, H, batch_first=True)
    x = torch.randn(B, Ls, D, generator=gen)
    with torch.no_grad():
        want = ref.train()(x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=False)[0]
        for mode in ("train", "eval"):
            getattr(ours, mode)()
            torch.testing.assert_close(ours(x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=False)[0], want)


@pytest.mark.parametrize("nhead", [1, 4, 8])
def test_transformerencoderlayer_src_mask(nhead):
    """TestTransformers.test_transformerencoderlayer_src_mask: batch 2, length 4, d_model 8, ff 32,
    batch_first, an all-False bool src_mask; train (with torch's default dropout 0.1: shape only)
    and eval under no_grad (equals torch)."""
    ref, ours = layer_pair("TransformerEncoderLayer", 8, nhead, 32, batch_first=True)
    src = torch.rand(2, 4, 8, generator=torch.Generator().manual_seed(0))
    src_mask = torch.zeros(4, 4, dtype=torch.bool)
    assert ours(src, src_mask=src_mask).shape == src.shape
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(src, src_mask=src_mask), ref.eval()(src, src_mask=src_mask))


@pytest.mark.parametrize("nhead", [3, 4])
def test_transformerencoderlayer_no_fastpath_with_hooks(nhead):
    """TestTransformers.test_transformerencoderlayer_no_fastpath_with_hooks: d_model 12, ff 12, eval,
    inference_mode: a forward hook on self_attn sees exactly one call."""
    layer = knn.TransformerEncoderLayer(12, nhead, dim_feedforward=12, batch_first=True).eval()
    seen = []
    handle = layer.self_attn.register_forward_hook(lambda m, i, o: seen.append(o[0].detach()))
    with torch.inference_mode():
        layer(torch.rand(2, 4, 12))
    handle.remove()
    assert len(seen) == 1


def _encoder_fastpath_inputs(d_model):
    """TestTransformers.test_transformerencoder_fastpath's (input shape, right-padding lengths) list."""
    return [((3, 2, d_model), [[0, 1], [0, 1], [1, 1]]),
            ((2, 100, d_model), [[0] * 98 + [1] * 2, [0] * 90 + [1] * 10]),
            ((2, 1024, d_model), [[0] * 1020 + [1] * 4, [0] * 1024]),
            ((1, 1026, d_model), [[0] * 1024 + [1] * 2]),
            ((4, 1040, d_model), [[0] * 1024 + [1] * 16, [0] * 1025 + [1] * 15, [0] * 1031 + [1] * 9, [0] * 1040])]


@pytest.mark.parametrize("d_model", [12, pytest.param(256, marks=pytest.mark.slow)])
@pytest.mark.parametrize("enable_nested_tensor", [True, False])
def test_transformerencoder_fastpath(d_model, enable_nested_tensor):
    """TestTransformers.test_transformerencoder_fastpath (no autocast: CUDA only): 2 layers, 4 heads,
    ff = d_model, batch_first, eval; torch's padding masks up to length 1040 (one row fully
    padded: [1, 1] at length 2). Padded positions zeroed in both before comparing, as torch does.
    torch's no_grad fast path against keyfold (no fast path: one path for both)."""
    torch.manual_seed(1234)
    ref_layer, our_layer = layer_pair("TransformerEncoderLayer", d_model, 4, d_model, batch_first=True, seed=1234)
    ref = nn.TransformerEncoder(ref_layer, 2, enable_nested_tensor=enable_nested_tensor).eval()
    ours = knn.TransformerEncoder(our_layer, 2, enable_nested_tensor=enable_nested_tensor).eval()
    gen = torch.Generator().manual_seed(0)
    for shape, pad in _encoder_fastpath_inputs(d_model):
        x, kpm = torch.rand(shape, generator=gen), torch.tensor(pad, dtype=torch.bool)
        with torch.no_grad():
            fast = ref(x, src_key_padding_mask=kpm)
            got = ours(x, src_key_padding_mask=kpm)
        expanded = torch.zeros(shape)
        expanded[:, :fast.shape[1]] = fast
        pad_rows = kpm.unsqueeze(-1)
        torch.testing.assert_close(got.masked_fill(pad_rows, 0), expanded.masked_fill(pad_rows, 0))


def _square_input_model(mod, layer_mod, training):
    model = mod.TransformerEncoder(layer_mod.TransformerEncoderLayer(d_model=4, nhead=2, dim_feedforward=16,
                                                                     dropout=0.0, batch_first=True), num_layers=2,
                                   enable_nested_tensor=False)
    cos_weights_(model)
    return model.train(training)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("with_no_grad", [True, False])
def test_transformerencoder_square_input(with_no_grad, training):
    """TestTransformers.test_transformerencoder_square_input: batch == length == 2, d_model 4,
    2 heads, ff 16, dropout 0, cos weights, x = arange(16).reshape(2, 2, 4), src_mask
    [[0, 1], [0, 0]] (bool)."""
    ref, ours = _square_input_model(nn, nn, training), _square_input_model(knn, knn, training)
    x = torch.arange(16, dtype=torch.float32).reshape(2, 2, 4)
    src_mask = torch.tensor([[0, 1], [0, 0]]).bool()
    with torch.no_grad() if with_no_grad else torch.enable_grad():
        torch.testing.assert_close(ours(x, mask=src_mask), ref(x, mask=src_mask))


ENCODER_INPUT = [[[0.7462, 0.6653, 0.5679, 0.4891], [0.5387, 0.1655, 0.3565, 0.0471]],
                 [[0.8335, 0.2799, 0.5031, 0.2947], [0.1402, 0.0318, 0.7636, 0.1346]],
                 [[0.6333, 0.9344, 0.1376, 0.9938], [0.8924, 0.2872, 0.6692, 0.2944]],
                 [[0.9897, 0.6915, 0.3154, 0.1733], [0.8645, 0.3513, 0.3064, 0.0767]],
                 [[0.8117, 0.2366, 0.4838, 0.7881], [0.3718, 0.4945, 0.9511, 0.0864]]]  # torch's (5, 2, 4) input


@pytest.mark.parametrize("enable_nested_tensor", [True, False])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformerencoder(batch_first, training, enable_nested_tensor):
    """TestTransformers.test_transformerencoder: d_model 4, 2 heads, ff 16, dropout 0, relu, cos
    weights, float64 default; 1 layer with no mask, an all-False src_mask, an all-False padding
    mask, padding at [0, 1], [1, 3], [1, 4]; then 2 and 6 layers without and with a final
    LayerNorm(4); atol 1e-5 (torch's)."""
    perm = (lambda t: t.transpose(0, 1)) if batch_first else (lambda t: t)  # noqa: E731
    layers = []
    for mod in (nn, knn):
        layer = mod.TransformerEncoderLayer(4, 2, dim_feedforward=16, dropout=0.0, activation=F.relu,
                                            batch_first=batch_first).to(F64)
        cos_weights_(layer)
        layers.append(layer)
    x = perm(torch.tensor(ENCODER_INPUT, dtype=F64))
    mask = torch.zeros(2, 5, dtype=torch.bool)
    masked = mask.clone()
    masked[0, 1] = masked[1, 3] = masked[1, 4] = True
    calls = [(1, None, {}), (1, None, {"mask": torch.zeros(5, 5, dtype=torch.bool)}),
             (1, None, {"src_key_padding_mask": mask}), (1, None, {"src_key_padding_mask": masked}),
             (2, None, {"src_key_padding_mask": masked}), (6, None, {"src_key_padding_mask": masked}),
             (2, "norm", {"src_key_padding_mask": masked}), (6, "norm", {"src_key_padding_mask": masked})]
    with torch.no_grad() if not training else torch.enable_grad():
        for n, norm, kw in calls:
            models = []
            for mod, layer in zip((nn, knn), layers):
                extra = {"norm": nn.LayerNorm(4).to(F64)} if norm else {}
                m = mod.TransformerEncoder(layer, n, enable_nested_tensor=enable_nested_tensor, **extra)
                models.append(m.train(training))
            torch.testing.assert_close(models[1](x, **kw), models[0](x, **kw), atol=1e-5, rtol=1e-7)


def test_encoder_padding_and_src_mask_bool():
    """TestTransformers.test_encoder_padding_and_src_mask_bool: d_model 16, 2 heads, ff 32, relu,
    batch_first, 2 layers and a final LayerNorm; a bool causal src_mask with a bool padding mask
    (lengths 3, 2): no warning (torch asserts no logs), and in eval equal to torch."""
    ref_l, our_l = layer_pair("TransformerEncoderLayer", 16, 2, 32, 0.1, "relu", batch_first=True)
    ref = nn.TransformerEncoder(ref_l, 2, nn.LayerNorm(16)).eval()
    ours = knn.TransformerEncoder(our_l, 2, nn.LayerNorm(16)).eval()
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    src_mask = torch.ones(3, 3, dtype=torch.bool).triu_(diagonal=1)
    pad = torch.arange(3)[None, :] >= torch.tensor([3, 2])[:, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours(x, mask=src_mask, src_key_padding_mask=pad)
        ours.train()(x, mask=src_mask, src_key_padding_mask=pad)
    torch.testing.assert_close(got, ref(x, mask=src_mask, src_key_padding_mask=pad))


def test_decoder_padding_and_src_mask_bool():
    """TestTransformers.test_decoder_padding_and_src_mask_bool: the decoder twin (d_model 16, 2 heads,
    ff 32, 2 layers + LayerNorm, batch_first): bool causal tgt_mask, the same bool padding mask for
    tgt and memory; no warning, and in eval equal to torch."""
    ref_l, our_l = layer_pair("TransformerDecoderLayer", 16, 2, 32, 0.1, "relu", batch_first=True)
    ref = nn.TransformerDecoder(ref_l, 2, nn.LayerNorm(16)).eval()
    ours = knn.TransformerDecoder(our_l, 2, nn.LayerNorm(16)).eval()
    gen = torch.Generator().manual_seed(0)
    x, memory = torch.randn(2, 3, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    tgt_mask = torch.ones(3, 3, dtype=torch.bool).triu_(diagonal=1)
    pad = torch.arange(3)[None, :] >= torch.tensor([3, 2])[:, None]
    kw = {"tgt_mask": tgt_mask, "tgt_key_padding_mask": pad, "memory_key_padding_mask": pad}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours(x, memory, **kw)
        ours.train()(x, memory, **kw)
    torch.testing.assert_close(got, ref(x, memory, **kw))


def test_encoder_is_causal():
    """TestTransformers.test_encoder_is_causal: d_model 3, 1 head, ff 6, batch_first, eval; with
    generate_square_subsequent_mask, is_causal=True equals the mask alone (and torch)."""
    ref, ours = layer_pair("TransformerEncoderLayer", 3, 1, 6, batch_first=True)
    ref.eval(), ours.eval()
    x = torch.randn(1, 5, 3, generator=torch.Generator().manual_seed(0))
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    torch.testing.assert_close(ours(x, src_mask=mask, is_causal=True), ours(x, src_mask=mask))
    torch.testing.assert_close(ours(x, src_mask=mask, is_causal=True), ref(x, src_mask=mask, is_causal=True))
    assert not torch.allclose(ours(x), ours(x, src_mask=mask))


def test_kpm_mask_trailing_column_with_nested_tensor():
    """TestTransformers.test_kpm_mask_trailing_column_with_nested_tensor: d_model 256, 4 heads, ff 512,
    gelu, seq-first, 3 layers; x (10, 6, 256) with a padding mask that pads every position of rows
    1-5: the output keeps batch 6 and, in eval, equals torch's slow path (rows with no key: keyfold's
    attention gives 0, torch's SDPA path too)."""
    ref_l, our_l = layer_pair("TransformerEncoderLayer", 256, 4, 512, activation="gelu")
    ref = nn.TransformerEncoder(ref_l, 3, enable_nested_tensor=True).eval()
    ours = knn.TransformerEncoder(our_l, 3, enable_nested_tensor=True).eval()
    x = torch.randn(10, 6, 256, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(6, 10)
    mask[0, :] = 0
    mask = mask.bool()
    got = ours(src=x, src_key_padding_mask=mask)
    assert got.shape[1] == 6
    torch.testing.assert_close(got, ref(src=x, src_key_padding_mask=mask))


def test_transformerencoderlayer_subclass():
    """TestTransformers.test_transformerencoderlayer_subclass / _subclass_model without torch.jit
    (keyfold's layers are not TorchScript): a subclass of the layer (nhead 4, batch 2, length 4,
    d_model 8, ff 32, batch_first) and a 6-layer encoder of it give the same result under the same
    seed in training (dropout 0.1) and equal torch in eval."""
    class Ours(knn.TransformerEncoderLayer):
        pass

    class Ref(nn.TransformerEncoderLayer):
        pass

    torch.manual_seed(0)
    ref_l, our_l = _same_weights(Ref(8, 4, 32, batch_first=True), Ours(8, 4, 32, batch_first=True))
    src = torch.rand(2, 4, 8, generator=torch.Generator().manual_seed(1))
    src_mask = torch.zeros(4, 4, dtype=torch.bool)
    for ours, ref in ((our_l, ref_l), (knn.TransformerEncoder(our_l, 6), nn.TransformerEncoder(ref_l, 6))):
        kw = {"src_mask" if isinstance(ours, knn.TransformerEncoderLayer) else "mask": src_mask}
        torch.manual_seed(42)
        a = ours.train()(src, **kw)
        torch.manual_seed(42)
        torch.testing.assert_close(ours(src, **kw), a)
        with torch.no_grad():
            torch.testing.assert_close(ours.eval()(src, **kw), ref.eval()(src, **kw))


def test_transformer_bias_is_none():
    """TestTransformers.test_transformer_bias_is_none: d_model 8, 4 heads, bias=False, batch_first,
    batch 2, length 3: the layer and a 1-layer encoder run and equal torch. torch warns that its
    fast path is off ("encoder_layer.self_attn was passed bias=False"); keyfold has no fast path and
    does not warn (deliberate)."""
    ref_l, our_l = layer_pair("TransformerEncoderLayer", 8, 4, bias=False, batch_first=True)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(our_l.eval()(x), ref_l.eval()(x))
    with pytest.warns(UserWarning, match="encoder_layer.self_attn was passed bias=False"):
        ref = nn.TransformerEncoder(ref_l, num_layers=1).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = knn.TransformerEncoder(our_l, num_layers=1).eval()
        got = ours(x)
    torch.testing.assert_close(got, ref(x))


def test_train_with_is_causal():
    """TestTransformers.test_train_with_is_causal: a 2-layer encoder (d_model 2, ff 4, 1 head, gelu,
    dropout 0, batch_first) trains a step with mask + is_causal=True (equal to torch's loss and
    gradients); MultiheadAttention with is_causal=True and no mask raises RuntimeError; an encoder
    given a causal mask and is_causal=None calls its layers with is_causal=True (torch detects it)."""
    ref_l, our_l = layer_pair("TransformerEncoderLayer", 2, 1, 4, 0, "gelu", batch_first=True)
    ref, ours = nn.TransformerEncoder(ref_l, 2), knn.TransformerEncoder(our_l, 2)
    inputs = torch.randn(1, 2, 2, generator=torch.Generator().manual_seed(0))
    mask = nn.Transformer.generate_square_subsequent_mask(2)
    losses = [F.mse_loss(m.train()(inputs, mask=mask, is_causal=True), inputs) for m in (ref, ours)]
    losses[0].backward()
    losses[1].backward()
    torch.testing.assert_close(losses[1], losses[0])
    our_params = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(our_params[name].grad, p.grad, msg=name)
    t_qvk = torch.randn(1, 2, 2)
    mha = knn.MultiheadAttention(2, 1)
    mha(t_qvk, t_qvk, t_qvk, attn_mask=nn.Transformer.generate_square_subsequent_mask(1), is_causal=True)
    with pytest.raises(RuntimeError):
        mha(t_qvk, t_qvk, t_qvk, is_causal=True)
    causal_mask = torch.triu(torch.ones(2, 2) * float("-inf"), diagonal=1).to(torch.bool)
    seen = []
    for layer in ours.layers:
        layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("is_causal")), with_kwargs=True)
    ours(inputs, mask=causal_mask)
    assert seen == [True, True]


def test_is_causal_kernels_math():
    """TestTransformers.is_causal_kernels (MATH, as on a CPU): embed 4, 1 head, all-ones in_proj
    and out_proj weights, an all-ones (1, 2, 4) input (length 1, batch 2) and a (2, 2) causal mask
    with is_causal=True, need_weights=False: exactly 16 everywhere. torch trusts the hint and never
    reads that mask (its size is wrong for length 1). Regression: keyfold checked the mask's size
    first and raised."""
    for mod in (nn, knn):
        mha = mod.MultiheadAttention(4, 1)
        mha.in_proj_weight = nn.Parameter(torch.ones(12, 4))
        mha.out_proj.weight = nn.Parameter(torch.ones(4, 4))
        qkv = torch.ones(1, 2, 4)
        mask = nn.Transformer.generate_square_subsequent_mask(qkv.size(1))
        actual, _ = mha(qkv, qkv, qkv, attn_mask=mask, need_weights=False, is_causal=True)
        assert torch.equal(actual, torch.ones(1, 2, 4) * 16), mod.__name__


def test_train_with_pad_and_catch_error():
    """TestTransformers.test_train_with_pad_and_catch_error (slowTest there, 100 steps; 3 here):
    a 2-layer encoder (d_model 2, ff 4, 2 heads, gelu, dropout 0, batch_first) trained with a bool
    padding mask [[1, 1, 0, 0]]; uint8 and int64 padding masks raise AssertionError; train and eval
    outputs agree on the unpadded positions (L1 < 1e-4)."""
    torch.manual_seed(0)
    layer = knn.TransformerEncoderLayer(d_model=2, dim_feedforward=4, nhead=2, batch_first=True,
                                        activation="gelu", dropout=0)
    encoder = knn.TransformerEncoder(layer, 2)
    opt = torch.optim.SGD(encoder.parameters(), lr=0.1, momentum=0.9)
    pad = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    for _ in range(3):
        encoder.train()
        opt.zero_grad()
        inputs = torch.cat([torch.randn(1, 2, 2), torch.zeros(1, 2, 2)], dim=1)
        out = encoder(inputs, src_key_padding_mask=pad)
        F.mse_loss(out[:, 0:2], inputs[:, 0:2]).backward()
        opt.step()
        with torch.no_grad():
            test = torch.cat([torch.randn(1, 2, 2), torch.zeros(1, 2, 2)], dim=1)
            for bad in (torch.uint8, torch.int64):
                with pytest.raises(AssertionError):
                    encoder(test, src_key_padding_mask=pad.to(bad))
            train_out = encoder(test, src_key_padding_mask=pad)
            eval_out = encoder.eval()(test, src_key_padding_mask=pad)
            assert F.l1_loss(train_out[:, 0:2], eval_out[:, 0:2]).item() < 1e-4


# ============================================================================ test/test_nn.py

DEC_INPUT = [[[0.4517, 0.6793, 0.5313, 0.0034], [0.2678, 0.3677, 0.4459, 0.7166]],
             [[0.8100, 0.3716, 0.4096, 0.1976], [0.6958, 0.8844, 0.6081, 0.8315]],
             [[0.0494, 0.9343, 0.5955, 0.3830], [0.5404, 0.3464, 0.9378, 0.6200]]]  # torch's (3, 2, 4) tgt


def _decoder_cases(perm):
    """test_transformerdecoderlayer's deterministic (tgt, memory, kwargs) calls."""
    t = lambda x: torch.tensor(x)  # noqa: E731
    dec, mem = perm(t(DEC_INPUT)), perm(t(ENCODER_INPUT))
    kpm3 = torch.zeros(2, 3, dtype=torch.bool)
    kpm3b = kpm3.clone()
    kpm3b[0, 2] = kpm3b[1, 1] = kpm3b[1, 2] = True
    kpm5 = torch.zeros(2, 5, dtype=torch.bool)
    kpm5b = kpm5.clone()
    kpm5b[0, 4] = kpm5b[1, 3] = kpm5b[1, 4] = True
    return [(t([[[20., 30., 40., 50.]]]), t([[[60., 70., 80., 90.]]]), {}),
            (perm(t([[[9., 10., 11., 12.]], [[11., 12., 13., 14.]]])), t([[[1., 2., 3., 4.]]]), {}),
            (perm(t([[[1., 2., 3., 4.]], [[5., 6., 7., 8.]]])), perm(t([[[9., 10., 11., 12.]], [[11., 12., 13., 14.]]])), {}),
            (dec, mem, {}), (dec, mem, {"tgt_key_padding_mask": kpm3}), (dec, mem, {"tgt_key_padding_mask": kpm3b}),
            (dec, mem, {"memory_key_padding_mask": kpm5}), (dec, mem, {"memory_key_padding_mask": kpm5b})]


def _cos_decoder_layers(activation, batch_first, dtype=torch.float32):
    out = []
    for mod in (nn, knn):
        layer = mod.TransformerDecoderLayer(4, 2, 16, 0.0, activation, batch_first=batch_first).to(dtype)
        cos_weights_(layer)
        out.append(layer)
    return out


@pytest.mark.parametrize("batch_first", [False, True])
def test_transformerdecoderlayer(batch_first):
    """test_nn.py test_transformerdecoderlayer: d_model 4, 2 heads, ff 16, dropout 0, cos weights,
    float32; single tokens, broadcast memory, tgt (3, 2, 4) over memory (5, 2, 4), all-False and
    partial tgt / memory padding masks; atol 1e-5."""
    perm = (lambda x: x.transpose(1, 0)) if batch_first else (lambda x: x)  # noqa: E731
    ref, ours = _cos_decoder_layers(F.relu, batch_first)
    for tgt, memory, kw in _decoder_cases(perm):
        torch.testing.assert_close(ours(tgt, memory, **kw), ref(tgt, memory, **kw), atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("activation", ["gelu", F.gelu, nn.GELU()], ids=["str", "functional", "module"])
def test_transformerdecoderlayer_gelu(activation, batch_first):
    """test_nn.py test_transformerdecoderlayer_gelu: the same layer with gelu given as 'gelu', F.gelu
    or nn.GELU(), float64 default (torch's set_default_dtype), the first four inputs; rtol 1e-5."""
    perm = (lambda x: x.transpose(1, 0)) if batch_first else (lambda x: x)  # noqa: E731
    ref, ours = _cos_decoder_layers(activation, batch_first, F64)
    for tgt, memory, kw in _decoder_cases(perm)[:4]:
        tgt, memory = tgt.to(F64), memory.to(F64)
        torch.testing.assert_close(ours(tgt, memory, **kw), ref(tgt, memory, **kw), rtol=1e-5, atol=0)


@pytest.mark.parametrize("batch_first", [False, True])
def test_transformerdecoder(batch_first):
    """test_nn.py test_transformerdecoder: 1-layer decoder over all the layer cases (relu), then 2 and
    6 layers without norm, 2 and 6 with LayerNorm(4), then 1 gelu layer; torch's tolerances
    (atol 1e-5 on the multi-token inputs; 1e-3 / 1e-4 on the single-token ones)."""
    perm = (lambda x: x.transpose(1, 0)) if batch_first else (lambda x: x)  # noqa: E731
    cases = _decoder_cases(perm)
    tol = [1e-3, 1e-4, 1e-4] + [1e-5] * 5
    ref_l, our_l = _cos_decoder_layers(F.relu, batch_first)
    runs = [(1, None, range(8)), (2, None, [0]), (6, None, [3]), (2, nn.LayerNorm(4), [0]), (6, nn.LayerNorm(4), [3])]
    gelu_ref, gelu_ours = _cos_decoder_layers("gelu", batch_first)
    for (n, norm, which), layers in zip(runs + [(1, None, range(4))], [(ref_l, our_l)] * 5 + [(gelu_ref, gelu_ours)]):
        ref, ours = nn.TransformerDecoder(layers[0], n, norm=norm), knn.TransformerDecoder(layers[1], n, norm=norm)
        for i in which:
            tgt, memory, kw = cases[i]
            torch.testing.assert_close(ours(tgt, memory, **kw), ref(tgt, memory, **kw), atol=tol[i], rtol=1e-7,
                                       msg=f"{n} layers, norm={norm is not None}, case {i}")


@pytest.mark.parametrize("name", ["TransformerEncoderLayer", "TransformerDecoderLayer"])
def test_transformer_layer_args_check(name):
    """test_nn.py test_transformer_layer_args_check: d_model 128, 4 heads, ff 65, dropout 0.3;
    F.relu and F.gelu build; activation "abc" raises RuntimeError (as in torch)."""
    for activation in (F.relu, F.gelu):
        getattr(knn, name)(128, 4, 65, 0.3, activation)
    for mod in (nn, knn):
        with pytest.raises(RuntimeError):
            getattr(mod, name)(128, 4, 65, 0.3, "abc")
