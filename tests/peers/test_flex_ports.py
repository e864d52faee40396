"""FlexAttention's public tests and attention-gym's examples, ported to keyfold.

Sources (facts only, no code): PyTorch ``test/inductor/test_flex_attention.py`` (its score
mods, mask mods, captured buffers and learnable biases) and attention-gym's ``attn_gym/masks``
and ``attn_gym/mods``. Flex runs these at B=4, H=8, S=2048, D=64; here B=2, H=4, S=128 so the
folder runs in its CPU budget (D and the dtypes are the peer's). Flex aligns queries
top-left, so calls with ``Nq != Nk`` pass ``q_offset=0``. Flex's callables are passed to
keyfold unchanged; where keyfold has a preset for the same mask, the preset is checked too.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.attention.flex_attention as flex

import keyfold
from keyfold import Backend
from keyfold.caches import PagedKVCache, decode
from tests.helpers import naive_attention, visible_rows

from ._ports import (BACKENDS, BF16, SCORE_BACKENDS, F16, F32, assert_captured_grads, assert_port, assert_state_by_rule,
                     dtypes, make_qkv)

B, H, S, D = 2, 4, 128, 64  # Flex: 4, 8, 2048, 64
NEG = float("-inf")


# ------------------------------------------------------------------ Flex's builtin score mods


def _identity(score, b, h, q, kv):
    return score


def _times_two(score, b, h, q, kv):
    return score * 2


def _squared(score, b, h, q, kv):
    return score * score


def _causal(score, b, h, q, kv):
    return torch.where(q >= kv, score, NEG)


def _inverse_causal(score, b, h, q, kv):
    return torch.where(q <= kv, score, NEG)


def _rel_bias(score, b, h, q, kv):
    return score + (q - kv)


def _rel_causal(score, b, h, q, kv):
    return torch.where(q >= kv, score + (q - kv), NEG)


def _alibi_heads(n_heads):
    def _alibi(score, b, h, q, kv):
        return score + (kv - q) * torch.exp2(-((h + 1) * 8.0 / n_heads))
    return _alibi


_alibi8 = _alibi_heads(8)

SCORE_MODS = {"identity": _identity, "times_two": _times_two, "squared": _squared, "causal": _causal,
              "inverse_causal": _inverse_causal, "rel_bias": _rel_bias, "rel_causal": _rel_causal,
              "alibi8": _alibi8}
# Flex's test_score_mask_mod_map: the block mask each score mod is paired with
BLOCK_MASKS = {"causal": lambda b, h, q, kv: q >= kv, "inverse_causal": lambda b, h, q, kv: q <= kv,
               "rel_causal": lambda b, h, q, kv: q >= kv}
MODS = [pytest.param(m, id=n) for n, m in SCORE_MODS.items()]


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("dtype", dtypes(F16, BF16, F32))
@pytest.mark.parametrize("score", MODS)
def test_builtin_score_mods(score, dtype, backend, request):
    q, k, v = make_qkv(B, H, S, D, dtype=dtype)
    assert_port(q, k, v, backend, score=score)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_builtin_score_mods_with_block_mask(name, backend):
    """Flex's dynamic test pairs each score mod with its mask mod as the block mask."""
    q, k, v = make_qkv(B, H, S, D, dtype=F16)
    assert_port(q, k, v, backend, score=SCORE_MODS[name], mask=BLOCK_MASKS.get(name))


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("score", MODS)
def test_builtin_score_mods_different_seqlen(score, backend):
    """Queries S/2, keys S; Flex aligns top-left."""
    q, k, v = make_qkv(B, H, S // 2, D, Nk=S, dtype=F16)
    assert_port(q, k, v, backend, score=score, q_offset=0)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("score", MODS)
def test_gqa(score, backend):
    """Flex's GQA case: 4x the query heads, S/8 queries against S keys."""
    q, k, v = make_qkv(B, 4 * H, S // 8, D, Hkv=H, Nk=S, dtype=F16)
    assert_port(q, k, v, backend, score=score, q_offset=0)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
def test_value_head_dim_differs(backend):
    """Flex's V_D != QK_D cases."""
    q, k, v = make_qkv(B, H, S, D, Dv=32, dtype=F16)
    assert_port(q, k, v, backend, score=_rel_bias)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("score", [pytest.param(_identity, id="identity"), pytest.param(_rel_bias, id="rel_bias"),
                                   pytest.param(_causal, id="causal"), pytest.param(_alibi8, id="alibi8")])
def test_paged_attention(score, backend):
    """Flex's run_test_with_paged_attention: the keys live in pages of 64 tokens (one of Flex's
    page sizes), written page by page for each sequence in turn; keyfold's paged cache hands
    the score mod logical positions itself."""
    q, k, v = make_qkv(B, H, S, D, dtype=F16)
    ps = 64
    pool = PagedKVCache(num_pages=B * S // ps, page_size=ps, heads=H, head_dim=D, dtype=F16)
    ids = [pool.new_sequence() for _ in range(B)]
    for c in range(0, S, ps):
        for b in range(B):
            pool.append(k[b:b + 1, :, c:c + ps], v[b:b + 1, :, c:c + ps], [ids[b]])
    out = decode(q, pool, seq_ids=ids, score=score, backend=backend)
    ref = keyfold.attention(q.double(), k.double(), v.double(), score=score, backend=Backend.REFERENCE)
    assert_state_by_rule(out, ref, naive_attention(q, k, v, score=score), visible_rows(q, k))


# ------------------------------------------------------------ Flex's captured-buffer cases


def _captured_cases():
    """(name, factory) pairs; the factory builds the score mod from fresh random captures."""
    g = torch.Generator().manual_seed(16)
    rnd = lambda *s, dtype=F32: torch.randn(*s, generator=g).to(dtype)  # noqa: E731

    def head_offset():
        off = torch.rand(H, generator=g).to(F16)
        return lambda s, b, h, q, kv: s * off[h]

    def doc_mask_sparse():
        doc = torch.arange(S) // 64  # Flex: 256-token documents at S=2048

        def document_masking_causal(s, b, h, q, kv):
            return torch.where((q >= kv) & (doc[q] == doc[kv]), s, NEG)
        return document_masking_causal

    def index_multiple():
        bias = rnd(B, S)
        return lambda s, b, h, q, kv: s + bias[b][q]

    def index_weird1():
        bias = rnd(4, B, H, S)
        return lambda s, b, h, q, kv: s + bias[0][b, h][q]

    def index_weird2():
        bias, which = rnd(B, H, 4, S), torch.tensor(0)
        return lambda s, b, h, q, kv: s + bias[b][h][which, q]

    def skip_odd_keys():
        return lambda s, b, h, q, kv: torch.where(kv % 2 == 0, s, NEG)

    def function_composition():
        one = lambda s, b, h, m, n: s + (m - n)  # noqa: E731
        two = lambda s, b, h, m, n: torch.where(m <= n, s, NEG)  # noqa: E731
        return lambda s, b, h, m, n: two(one(s, b, h, m, n), b, h, m, n)

    def captured_buffers_all_dims():
        hs, bs, ts = rnd(H), rnd(B), rnd(S)
        return lambda s, b, h, q, kv: s + ts[q] + bs[b] + hs[h]

    def seq_masking():
        half = torch.zeros(S, dtype=torch.bool)
        half[S // 2:] = True
        return lambda s, b, h, q, kv: torch.where(half[q] == half[kv], s, NEG)

    def load_from_bias_seq_only():
        bias = rnd(S, S, dtype=F16)
        return lambda s, b, h, q, kv: s + bias[q, kv]

    def load_from_bias_seq_batch():
        bias = rnd(B, S, S, dtype=F16)
        return lambda s, b, h, q, kv: s + bias[b, q, kv]

    def load_from_bias_head_seq_batch():
        bias = rnd(B, H, S, S, dtype=F16)
        return lambda s, b, h, q, kv: s + bias[b, h, q, kv]

    def load_rel_bias():
        table = rnd(2 * S, dtype=F16)
        return lambda s, b, h, q, kv: s + table[(q - kv) + S]

    def dependent_causal_bidirectional():
        nbi = torch.randint(0, S, (B,), generator=g, dtype=torch.int32)

        def mod(s, b, h, q, kv):
            n = nbi[b]
            return torch.where(((q <= n) & (kv <= n)) | (q >= kv), s, NEG)
        return mod

    def natten_2d():
        side, w = 16, 3  # Flex: H=32 rows of W=S//32 at S=2048; a 16x16 canvas at S=256

        def natten(s, b, h, q, kv):
            qx, qy, kx, ky = q / side, q % side, kv / side, kv % side  # Flex's test divides as floats
            return torch.where(((qx - kx).abs() <= w) | ((qy - ky).abs() <= w), s, NEG)
        return natten

    def subgraph_floor_divide():
        return lambda s, b, h, q, kv: s - q // (1 + kv)

    def silu_on_score():
        return lambda s, b, h, q, kv: torch.nn.functional.silu(s)

    def padded_dense_causal():
        lens = torch.arange(B, dtype=torch.int32) + 1
        return lambda s, b, h, q, kv: torch.where(s <= lens[b], _causal(s, b, h, q, kv), NEG)

    def captured_scale():
        one = torch.ones((), dtype=torch.int32)
        return lambda s, b, h, q, kv: s + one

    def trig():
        return lambda s, b, h, q, kv: torch.sin(torch.cos(s)) + torch.tan(b)

    def trig2():
        return lambda s, b, h, q, kv: torch.cos(s) * torch.sin(s) + torch.tan(b)

    def inputs_are_realized():
        x = torch.randn(S, generator=g) * 2
        return lambda s, b, h, q, kv: s + x[q]

    return [head_offset, doc_mask_sparse, index_multiple, index_weird1, index_weird2, skip_odd_keys,
            function_composition, captured_buffers_all_dims, seq_masking, load_from_bias_seq_only,
            load_from_bias_seq_batch, load_from_bias_head_seq_batch, load_rel_bias,
            dependent_causal_bidirectional, natten_2d, subgraph_floor_divide, silu_on_score,
            padded_dense_causal, captured_scale, trig, trig2, inputs_are_realized]


CAPTURED = [pytest.param(f, id=f.__name__, marks=())
            for f in _captured_cases()]


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("factory", CAPTURED)
def test_captured_buffers(factory, backend):
    q, k, v = make_qkv(B, H, S, D, dtype=F16)
    assert_port(q, k, v, backend, score=factory())


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
def test_multiple_score_mod_calls(backend):
    """Flex: the output of one attention with a score mod is the query of the next (fp32;
    Flex's 1x8x1024x64 at 1x4x256x64)."""
    q, k1, v1 = make_qkv(1, 4, 256, 64)
    _, k2, v2 = make_qkv(1, 4, 256, 64)
    out1 = keyfold.attention(q, k1, v1, score=_rel_bias, backend=backend)
    ref1 = keyfold.attention(q.double(), k1.double(), v1.double(), score=_rel_bias, backend=Backend.REFERENCE)
    assert_state_by_rule(out1, ref1, naive_attention(q, k1, v1, score=_rel_bias), visible_rows(q, k1))
    assert_port(out1, k2, v2, backend, score=_causal)


# --------------------------------------------------------------------------- mask mods

def _doc_ids(n, gen_seed=3):
    g = torch.Generator().manual_seed(gen_seed)
    cuts = sorted(torch.randperm(n - 1, generator=g)[:5].add(1).tolist())
    ids = torch.zeros(n, dtype=torch.long)
    for c in cuts:
        ids[c:] += 1
    return ids


def _natten(cw, ch, kw, kh, decode_xy):
    def natten(b, h, q, kv):
        qx, qy = decode_xy(q)
        kx, ky = decode_xy(kv)
        cx = qx.clamp(kw // 2, (cw - 1) - kw // 2)  # the kernel is clamped inside the canvas
        cy = qy.clamp(kh // 2, (ch - 1) - kh // 2)
        return ((cx - kx).abs() <= kw // 2) & ((cy - ky).abs() <= kh // 2)
    return natten


def _morton_xy(code):
    def squeeze(c):
        c = c & 0x55555555
        c = (c | (c >> 1)) & 0x33333333
        c = (c | (c >> 2)) & 0x0F0F0F0F
        c = (c | (c >> 4)) & 0x00FF00FF
        return (c | (c >> 8)) & 0x0000FFFF
    return squeeze(code), squeeze(code >> 1)


def _tiled_xy(W, tw, th):
    def xy(i):
        t, o = i // (tw * th), i % (tw * th)
        ty, tx = t // (W // tw), t % (W // tw)
        return tx * tw + o % tw, ty * th + o // tw
    return xy


def _mask_cases():
    """(name, Flex/attention-gym mask_mod, keyfold preset or None) at S=256."""
    ids = _doc_ids(S)
    W, P, SINK = 64, 64, 4
    layout = torch.rand(S // 64, S // 64, generator=torch.Generator().manual_seed(5)) < 0.5
    layout |= torch.eye(S // 64, dtype=torch.bool)
    return [
        ("causal", lambda b, h, q, kv: q >= kv, keyfold.causal()),
        ("inverse_causal", lambda b, h, q, kv: q <= kv, keyfold.window(0, None)),
        ("sliding_window", lambda b, h, q, kv: (q >= kv) & (q - kv <= W), keyfold.causal() & keyfold.window(W)),
        ("and_masks_causal_window", lambda b, h, q, kv: (q >= kv) & ((q - kv) <= S // 4),
         keyfold.causal() & keyfold.window(S // 4)),
        ("or_masks_causal_inverse", lambda b, h, q, kv: (q >= kv) | (q < kv), keyfold.full()),
        ("prefix_lm", lambda b, h, q, kv: (kv <= P) | (q >= kv), keyfold.prefix(P + 1)),
        ("document_causal", lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv), keyfold.documents(ids) & keyfold.causal()),
        ("document", lambda b, h, q, kv: ids[q] == ids[kv], keyfold.documents(ids)),
        ("dilated_sliding_window", lambda b, h, q, kv: ((q - kv).abs() <= 16) & ((q - kv).abs() % 2 == 0),
         keyfold.window(16, 16) & keyfold.dilated(2)),
        ("sink_attention", lambda b, h, q, kv: (q >= kv) & ((q - kv <= W) | (kv < SINK)),
         keyfold.causal() & (keyfold.window(W) | keyfold.sinks(SINK))),
        ("block_sparse", lambda b, h, q, kv: layout[q // 64, kv // 64], keyfold.block_sparse(layout, 64)),
        ("natten_16x16_k5", _natten(16, 16, 5, 5, lambda i: (i % 16, i // 16)), None),
        ("tiled_natten_16x16_k5_t4", _natten(16, 16, 5, 5, _tiled_xy(16, 4, 4)), None),
        ("morton_natten_16x16_k5", _natten(16, 16, 5, 5, _morton_xy), None),
        ("head_specific_window", lambda b, h, q, kv: (q >= kv) & (q - kv <= 8 * (h + 1)), None),
        ("skip_odd_keys", lambda b, h, q, kv: kv % 2 == 0, None),
    ]


MASKS = {name: (fn, preset) for name, fn, preset in _mask_cases()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", dtypes(F16))
@pytest.mark.parametrize("name", list(MASKS))
def test_mask_mod(name, dtype, backend):
    q, k, v = make_qkv(B, H, S, D, dtype=dtype)
    assert_port(q, k, v, backend, mask=MASKS[name][0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", [n for n, (_, p) in MASKS.items() if p is not None])
def test_mask_preset_matches_mod(name, backend):
    """keyfold's preset for the same mask: the same visible pairs, and the rule in bf16."""
    fn, preset = MASKS[name]
    assert torch.equal(preset.to_dense(S, S, B=1, H=H), keyfold.as_mask(fn).to_dense(S, S, B=1, H=H))
    q, k, v = make_qkv(B, H, S, D, dtype=BF16)
    assert_port(q, k, v, backend, mask=preset)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["causal", "document_causal", "sliding_window"])
def test_mask_mod_fp32(name, backend):
    q, k, v = make_qkv(B, H, S, D, dtype=F32)
    assert_port(q, k, v, backend, mask=MASKS[name][0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_multiple_mask_calls(backend):
    """Flex: causal and causal-sliding-window(32) over the same inputs (fp32; Flex's 1x4x512x64 at 1x4x256x64)."""
    q, k, v = make_qkv(1, 4, 256, 64)
    cm = lambda b, h, qi, ki: qi >= ki  # noqa: E731
    sw = lambda b, h, qi, ki: (qi >= ki) & (qi <= ki + 32)  # noqa: E731
    for m in (cm, sw):
        assert_port(q, k, v, backend, mask=m)


# -------------------------------------------------------------------- attention-gym mods


def _softcap_mods():
    cap = 30.0  # Gemma-2's attention softcap

    def tanh_softcap(s, b, h, q, kv):
        return cap * torch.tanh(s / cap)

    def tanh_softcap_approx(s, b, h, q, kv):  # attention-gym's approx variant: tanh through sigmoid
        return cap * (2 * torch.sigmoid(2 * s / cap) - 1)

    return tanh_softcap, tanh_softcap_approx


_TILES, _CPU = Backend.TILES, Backend.CPU
GYM_SCORES = [  # (maker, backend): callables and softcap run on TILES (Backend.CPU refuses them, see SCORE_BACKENDS)
    pytest.param(lambda: _softcap_mods()[0], _TILES, id="tanh_softcap-TILES"),
    pytest.param(lambda: _softcap_mods()[1], _TILES, id="tanh_softcap_approx-TILES"),
    pytest.param(lambda: keyfold.softcap(30.0), _TILES, id="keyfold_softcap-TILES"),
    pytest.param(lambda: _alibi_heads(H), _TILES, id="alibi-TILES"),
    pytest.param(lambda: keyfold.alibi(torch.exp2(-8.0 * torch.arange(1, H + 1) / H)), _CPU, id="keyfold_alibi-CPU"),
    pytest.param(lambda: keyfold.alibi(torch.exp2(-8.0 * torch.arange(1, H + 1) / H)), _TILES, id="keyfold_alibi-TILES"),
]


@pytest.mark.parametrize("dtype", dtypes(F16, BF16, F32))
@pytest.mark.parametrize("make,backend", GYM_SCORES)
def test_gym_score_mods(make, backend, dtype):
    q, k, v = make_qkv(B, H, S, D, dtype=dtype)
    assert_port(q, k, v, backend, score=make(), mask=keyfold.causal())


def test_gym_alibi_equals_keyfold_alibi():
    """attention-gym's alibi adds ``(kv - q) * 2^(-8(h+1)/H)``, keyfold's ``-slope |q - kv|``:
    equal under a causal mask."""
    q, k, v = make_qkv(1, H, 64, 16, dtype=torch.float64)
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1) / H)
    a = keyfold.attention(q, k, v, score=_alibi_heads(H), mask=keyfold.causal(), backend=Backend.TILES)
    b = keyfold.attention(q, k, v, score=keyfold.alibi(slopes), mask=keyfold.causal(), backend=Backend.TILES)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("dtype", dtypes(F16, F32))
def test_gym_mla_rope_score(dtype, backend):
    """attention-gym's latent attention: score + scale * dot(q_rope[b, h, q], k_rope[b, h // H, kv]),
    one latent key head (MQA)."""
    Hq, R = 8, 16
    q, k, v = make_qkv(1, Hq, 64, 32, Hkv=1, dtype=dtype)
    qr, kr = torch.randn(1, Hq, 64, R), torch.randn(1, 1, 64, R)
    mod = lambda s, b, h, qi, ki: s + 0.5 * torch.dot(qr[b, h, qi], kr[b, h // Hq, ki])  # noqa: E731
    assert_port(q, k, v, backend, score=mod)


# ------------------------------------------------------------ learnable biases (item 1)

LB, LH, LS = 2, 4, 128  # Flex's learnable-bias tests use small shapes; these fit them


def _learnable_cases():
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    win = 8
    offs = torch.randint(0, LS, (LS,), generator=g)
    return [
        ("relative_1d", lambda t: lambda s, b, h, q, kv: s + t[(q - kv).abs()], [rnd(LS)]),
        ("absolute_2d", lambda t: lambda s, b, h, q, kv: s + t[q, kv], [rnd(LS, LS)]),
        ("head_specific", lambda t: lambda s, b, h, q, kv: s + t[h, q, kv], [rnd(LH, LS, LS)]),
        ("batch_head", lambda t: lambda s, b, h, q, kv: s + t[b, h, q, kv], [rnd(LB, LH, LS, LS)]),
        ("multiplicative", lambda t: lambda s, b, h, q, kv: s * t[q], [rnd(LS)]),
        ("local_window", lambda t: lambda s, b, h, q, kv: s + t[(q - kv).clamp(-win, win) + win], [rnd(2 * win + 1)]),
        ("global_tokens", lambda t: lambda s, b, h, q, kv: s + t[kv], [rnd(LS)]),
        ("indirect", lambda t, o: lambda s, b, h, q, kv: s + t[o[q]], [rnd(LS), offs]),
        ("symmetric", lambda t: lambda s, b, h, q, kv: s + t[q] + t[kv], [rnd(LS)]),
        ("flipped_indexed", lambda t: lambda s, b, h, q, kv: s + t[kv, q], [rnd(LS, LS)]),
        ("transposed_3d", lambda t: lambda s, b, h, q, kv: s + t[q, h, kv], [rnd(LS, LH, LS)]),
        ("head_specific_gate", lambda t: lambda s, b, h, q, kv: s * torch.sigmoid(t[h]), [rnd(LH)]),
        ("distinct_biases", lambda t, u: lambda s, b, h, q, kv: s + t[q, kv] + u[q], [rnd(LS, LS), rnd(LS)]),
        ("alibi_learned_slopes", lambda t: lambda s, b, h, q, kv: s + t[h] * (kv - q), [rnd(LH).abs()]),
        ("graphormer_spatial_edge", lambda t, u, d: lambda s, b, h, q, kv: s + t[h, d[b, q, kv]] + u[b, h, q, kv],
         [rnd(LH, 8), rnd(LB, LH, LS, LS), torch.randint(0, 8, (LB, LS, LS), generator=g)]),
    ]


LEARNABLE = [pytest.param(make, params, id=name) for name, make, params in _learnable_cases()]


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
@pytest.mark.parametrize("dtype", dtypes(F16, F32))
@pytest.mark.parametrize("make,params", LEARNABLE)
def test_learnable_bias(make, params, dtype, backend):
    # local_window-fp32 is also the regression test for its table gradient (3.0e-5 against 3x
    # naive's 5.2e-6 while dS did not cancel along the row: its clamped end bins sum it over
    # thousands of pairs)
    q, k, v = make_qkv(LB, LH, LS, D, dtype=dtype)
    assert_captured_grads(q, k, v, make, params, backend)


@pytest.mark.parametrize("backend", SCORE_BACKENDS)
def test_float64_captured_table(backend):
    q, k, v = make_qkv(LB, LH, LS, D, dtype=F32)
    table = torch.randn(2 * LS, dtype=torch.float64)
    assert_port(q, k, v, backend, score=lambda s, b, h, qi, ki: s + table[qi - ki + LS])


# ------------------------------------------------------- crashes on B = 1 / H = 1 (item 7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_batch_lengths_batch_one(backend):
    """Padding from input lengths (Flex's padded causal) with one sequence."""
    lens = torch.tensor([S // 2])
    q, k, v = make_qkv(1, H, S, D, dtype=F16)
    assert_port(q, k, v, backend, mask=lambda b, h, qi, ki: (ki < lens[b]) & (qi >= ki))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_head_window_head_one(backend):
    reach = torch.tensor([16])
    q, k, v = make_qkv(B, 1, S, D, dtype=F16)
    assert_port(q, k, v, backend, mask=lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= reach[h]))


# ------------------------------------------------------------- stale plans (item 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_ids_mutated_in_place(backend):
    """attention-gym's document mask reused across steps: the packed batch's ids change in place."""
    ids = _doc_ids(S, 1)
    mask = lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)  # noqa: E731
    q, k, v = make_qkv(1, H, S, D, dtype=F32)
    assert_port(q, k, v, backend, mask=mask, grad=False)
    ids.copy_(_doc_ids(S, 2))
    assert_port(q, k, v, backend, mask=mask, grad=False)


# ------------------------------------------------------------------------------ refusals

REFUSALS = [
    pytest.param(lambda q, k, v: keyfold.attention(q, k[:1], v[:1]), ValueError, "batch sizes differ",
                 id="kv_batch_broadcast"),
    pytest.param(lambda q, k, v: keyfold.attention(
        q, k, v, mask=flex.create_block_mask(
            lambda b, h, qi, ki: qi >= ki, None, None, q.shape[2], k.shape[2], device="cpu")),
        TypeError, "mask must be None, a keyfold mask", id="block_mask_object"),
    pytest.param(lambda q, k, v: keyfold.attention(q, k, v, backend=Backend.TRITON), ValueError,
                 "Backend.TRITON runs on CUDA tensors", id="triton_on_cpu_tensors"),
    pytest.param(lambda q, k, v: keyfold.attention(q, k, v, mask=lambda b, h, qi, ki: (qi - ki).float()),
                 TypeError, "must return a bool tensor", id="mask_mod_returning_scores"),
]


@pytest.mark.parametrize("call,exc,match", REFUSALS)
def test_refusals(call, exc, match, monkeypatch):
    """What keyfold refuses of Flex's inputs, with the error the README's table quotes."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the suite's conftest turns the interpreter on; a user has it off
    q, k, v = make_qkv(3, 2, 128, 16)
    with pytest.raises(exc, match=match):
        call(q, k, v)
