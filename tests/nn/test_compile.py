"""torch.compile: keyfold reaches dynamo as custom ops, so models compile whole (0 graph breaks,
fullgraph=True) and give eager's outputs and gradients."""

import gc
import os
import sys

import pytest
import torch

import keyfold as kf
import keyfold.nn  # noqa: F401
from keyfold.nn import TransformerEncoderLayer
from tests.helpers import assert_close_by_rule

IDS = torch.tensor([0] * 5 + [1] * 11)
SLOPES = kf.alibi_slopes(2)
# dynamo cannot trace ``~`` on a Python object (it can ``&`` and ``|``): build such masks outside
SINKS_OR_FUTURE = kf.sinks(4) | ~kf.causal()


def every_variant(q, k, v, lengths):
    """causal, window, documents + alibi, left padding + softcap, a mask_mod: masks built inside."""
    a = kf.attention(q, k, v, mask=kf.causal())
    b = kf.attention(q, k, v, mask=kf.causal() & kf.window(3))
    c = kf.attention(q, k, v, mask=kf.documents(IDS), score=kf.alibi(SLOPES))
    d = kf.attention(q, k, v, mask=kf.causal() & kf.padding(starts=q.shape[2] - lengths), score=kf.softcap(5.0))
    e = kf.attention(q, k, v, mask=lambda b, h, qi, ki: (qi - ki) % 2 == 0, q_offset=0)
    f, lse = kf.attention(q, k[:, :1], v[:, :1], mask=SINKS_OR_FUTURE, return_lse=True)  # GQA
    return a + b + c + d + e + f * lse.unsqueeze(-1).exp()


def inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g, dtype=dtype).requires_grad_(True) for _ in range(3))
    return q, k, v, torch.tensor([16, 9])


def test_explain_counts_zero_graph_breaks():
    ex = torch._dynamo.explain(every_variant)(*inputs())
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1
    ops = {str(n.target) for g in ex.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "keyfold.attend.default" in ops


def test_fullgraph_output_and_grads_equal_eager():
    q, k, v, lengths = inputs()
    compiled = torch.compile(every_variant, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, lengths), every_variant(q, k, v, lengths)
    assert torch.equal(got, want)  # the same kernels run in both
    dout = torch.randn_like(want)
    g1 = torch.autograd.grad(got, (q, k, v), dout)
    g2 = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # new padding lengths are data: the same graph serves them, with their own answer
    other = torch.tensor([4, 16])
    assert torch.equal(compiled(q, k, v, other), every_variant(q, k, v, other))


def test_keyfold_nn_model_compiles_whole():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        TransformerEncoderLayer(32, 4, 64, dropout=0.0, mask=kf.causal()),
        TransformerEncoderLayer(32, 4, 64, dropout=0.0, mask=kf.causal() & kf.window(5)),
    )
    x = torch.randn(3, 12, 32, requires_grad=True)
    ex = torch._dynamo.explain(model)(x)
    assert ex.graph_break_count == 0, ex.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got, want = compiled(x), model(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    g1 = torch.autograd.grad(got.square().sum(), [x, *model.parameters()])
    g2 = torch.autograd.grad(want.square().sum(), [x, *model.parameters()])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not os.environ.get("KEYFOLD_INDUCTOR"),
                    reason="a real inductor compile builds C++ (~140 s on 2 busy cores); set KEYFOLD_INDUCTOR=1")
def test_inductor_compiles_a_causal_block():
    """One real inductor compile: the op is opaque to it, the projections around it are fused."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 48)

    def block(x):
        q, k, v = proj(x).view(2, 10, 3, 2, 8).permute(2, 0, 3, 1, 4)  # 3 x (B, H, N, D)
        return kf.attention(q, k, v, mask=kf.causal() & kf.window(4)).transpose(1, 2).reshape(2, 10, 16)

    x = torch.randn(2, 10, 16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True)
    got, want = compiled(x), block(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g1, = torch.autograd.grad(got.sum(), x)
    g2, = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)


def test_eager_calls_do_not_go_through_the_op(monkeypatch):
    import keyfold.ops as ops
    monkeypatch.setattr(ops, "attend_op", lambda *a, **k: pytest.fail("eager call reached the custom op"))
    q, k, v, _ = inputs()
    kf.attention(q, k, v, mask=kf.causal())


def test_spec_round_trip_keeps_meaning():
    from keyfold.ops import flatten, unflatten
    for mask, score in [(kf.prefix(torch.tensor([2, 3])) & ~kf.dilated(2), [kf.alibi(SLOPES), kf.softcap(3.0)]),
                        (kf.block_sparse(torch.eye(3, dtype=torch.bool), 4) | kf.sinks(torch.tensor([1, 5])), None),
                        (kf.documents(IDS[:8], kv_ids=IDS[8:]) & kf.padding(torch.tensor([3, 8])), None)]:
        spec, tensors = flatten(mask, score, kf.Backend.TILES, (4, 8))
        m2, s2, backend, block, check = unflatten(spec, tensors)
        assert torch.equal(m2.to_dense(8, 8, B=2), mask.to_dense(8, 8, B=2))   # the same meaning
        assert s2 == kf.as_score(score) and backend is kf.Backend.TILES and block == (4, 8) and check is False
        if "prefix" not in repr(mask):
            assert m2 == mask  # and the same plan-cache key


class _EvenDistance(kf.Mask):
    """A user's own mask class (no preset spec): evaluated per tile, passed to the op by reference."""

    def evaluate(self, b, h, qp, kp):
        return (qp - kp) % 2 == 0

    def __eq__(self, other):
        return type(other) is _EvenDistance

    def __hash__(self):
        return hash("even")


EVEN = _EvenDistance()


def test_user_mask_class_built_outside_compiles():
    q, k, v, _ = inputs(3)

    def fn(q, k, v):
        return kf.attention(q, k, v, mask=EVEN & kf.causal())

    ex = torch._dynamo.explain(fn)(q, k, v)
    assert ex.graph_break_count == 0, ex.break_reasons
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(got, fn(q, k, v))


def test_check_inputs_holds_under_compile():
    q, k, v, _ = inputs(4)
    q = q.detach().clone()
    q[0, 0, 0, 0] = float("nan")
    fn = torch.compile(lambda q, k, v: kf.attention(q, k, v, mask=kf.causal(), check_inputs=True),
                       fullgraph=True, backend="eager")
    with pytest.raises(ValueError, match="NaN"):
        fn(q, k.detach(), v.detach())


def test_learnable_score_tensor_gets_its_gradient_under_compile():
    """A score callable whose captured table requires grad trains eagerly (#16 item 1); compiled,
    the table is an input of the custom op and its backward returns the table's gradient: eager's."""
    table = torch.randn(16, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    score = kf.score_fn(lambda s, b, h, qi, ki: s + table[(qi - ki).abs()], tensors=[table])  # built outside

    def f(q, k, v):
        return kf.attention(q, k, v, score=score, mask=kf.causal())

    q, k, v, _ = inputs(8)
    ex = torch._dynamo.explain(f)(q, k, v)
    assert ex.graph_break_count == 0, ex.break_reasons
    got, want = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v), f(q, k, v)
    assert torch.equal(got, want)
    g1 = torch.autograd.grad(got.square().sum(), (q, k, v, table))
    g2 = torch.autograd.grad(want.square().sum(), (q, k, v, table))
    assert g2[3].abs().max() > 0.1  # the table's gradient is there to compare
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def packed(q, k, v, cu_q, cu_k):
    """varlen masks built inside the compiled function from its cu_seqlens inputs."""
    a = kf.attention(q, k, v, mask=kf.varlen(cu_q, cu_k, causal=True))
    b = kf.attention(q, k, v, mask=kf.varlen(cu_q, cu_k) & kf.window(2))
    return a + b


def test_varlen_compiles_whole_and_new_lengths_are_data():
    """Packed queries and keys of different totals (5 vs 9): the default q_offset is 0 under compile
    as it is eagerly (it was ``Nk - Nq`` in the op, and the call was refused), and new cu_seqlens of
    the same shape run in the same graph with their own answer."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 5, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 9, 8, generator=g, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 4, 9])
    ex = torch._dynamo.explain(packed)(q, k, v, cu_q, cu_k)
    assert ex.graph_break_count == 0, ex.break_reasons
    compiled = torch.compile(packed, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, cu_q, cu_k), packed(q, k, v, cu_q, cu_k)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    other_q, other_k = torch.tensor([0, 4, 5]), torch.tensor([0, 1, 9])
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(compiled(q, k, v, other_q, other_k), packed(q, k, v, other_q, other_k))
        with pytest.raises(ValueError, match="start at 0"):  # checked when the op rebuilds the mask
            compiled(q, k, v, torch.tensor([1, 4, 5]), other_k)


def padded(q, k, v, lengths, keys):
    """padding by lengths (right), by starts (left) and by a key mask, built inside."""
    a = kf.attention(q, k, v, mask=kf.padding(lengths))
    b = kf.attention(q, k, v, mask=kf.causal() & kf.padding(starts=k.shape[2] - lengths))
    c = kf.attention(q, k, v, mask=kf.padding(keys=keys))
    return a + b + c


def test_padding_compiles_whole_with_data_lengths():
    q, k, v, lengths = inputs(6)
    keys = torch.rand(2, 16, generator=torch.Generator().manual_seed(0)) > 0.3
    ex = torch._dynamo.explain(padded)(q, k, v, lengths, keys)
    assert ex.graph_break_count == 0, ex.break_reasons
    compiled = torch.compile(padded, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, lengths, keys), padded(q, k, v, lengths, keys))
    with torch.compiler.set_stance("fail_on_recompile"):
        other, keys2 = torch.tensor([3, 12]), ~keys
        got, want = compiled(q, k, v, other, keys2), padded(q, k, v, other, keys2)
        assert torch.equal(got, want)
        for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_tensor_q_offset_is_data_not_a_recompile():
    """A decoding position given as a 0-d tensor (a static KV cache's) reaches the op as data."""
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g)

    def step(q, k, v, pos):
        return kf.attention(q, k, v, mask=kf.causal() & kf.window(4), q_offset=pos)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(q, k, v, torch.tensor(3))
    with torch.compiler.set_stance("fail_on_recompile"):
        for pos in (5, 11, 15):
            want = kf.attention(q, k, v, mask=kf.causal() & kf.window(4), q_offset=pos)
            assert torch.equal(compiled(q, k, v, torch.tensor(pos)), want)


def _naive_dense(q, k, v, mask):
    """The plain implementation with a dense SDPA mask (bool True = attend, or float added), in the
    dtype of q: the float64 reference on float64 inputs, the yardstick (DESIGN.md 6) on float32."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5                         # (B, H, Nq, Nk)
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def dense_masked(q, k, v, bm, fm):
    """A bool mask through keyfold.attention, a float64 additive mask (with -inf) through SDPA's
    signature, and a bool mask with is_causal (the mask object and the tensor combined)."""
    return (kf.attention(q, k, v, mask=bm), kf.scaled_dot_product_attention(q, k, v, attn_mask=fm),
            kf.scaled_dot_product_attention(q, k, v, attn_mask=bm, is_causal=True))


def test_dense_masks_compile_whole_and_the_float_mask_gets_its_gradient():
    """Dense tensor masks are data of the op: 0 graph breaks with fullgraph, eager's outputs and
    gradients (the float64 mask's gradient too, in float64), within the rule of the float64
    reference; new masks of the same shapes run in the same graph with their own answers."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g, requires_grad=True) for _ in range(3))
    bm = (torch.rand(2, 1, 12, 12, generator=g) > 0.5) | torch.eye(12, dtype=torch.bool)  # every row sees a key
    fm = torch.randn(1, 2, 12, 12, generator=g, dtype=torch.float64)
    fm[0, :, 3, 5] = fm[0, 1, 7, :7] = float("-inf")
    fm.requires_grad_(True)
    ex = torch._dynamo.explain(dense_masked)(q, k, v, bm, fm)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    compiled = torch.compile(dense_masked, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, bm, fm), dense_masked(q, k, v, bm, fm)
    douts = [torch.randn(o.shape, generator=g) for o in want]
    g_got = torch.autograd.grad(got, (q, k, v, fm), douts, retain_graph=True)
    g_want = torch.autograd.grad(want, (q, k, v, fm), douts)
    for a, b in zip(got, want):
        assert torch.equal(a, b)  # the same kernels run in both
    assert g_got[3].dtype == torch.float64 and g_want[3].abs().max() > 0.1
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # against the float64 reference, by the rule (float mask: output and every gradient)
    x64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)] + [fm.detach().clone().requires_grad_(True)]
    x32 = [t.detach().requires_grad_(True) for t in (q, k, v)] + [fm.detach().clone().requires_grad_(True)]
    ref, naive = _naive_dense(*x64), _naive_dense(*x32)
    assert_close_by_rule(got[1].detach(), ref.detach(), naive.detach(), None)
    for name, a, r, n in zip(("dq", "dk", "dv", "dmask"), torch.autograd.grad(got[1], (q, k, v, fm), douts[1]),
                             torch.autograd.grad(ref, x64, douts[1].double()),
                             torch.autograd.grad(naive, x32, douts[1])):
        assert_close_by_rule(a, r, n, None, factor=3.0, what=name)
    with torch.no_grad():
        assert_close_by_rule(got[0], _naive_dense(q.double(), k.double(), v.double(), bm), _naive_dense(q, k, v, bm),
                             None)
    with torch.compiler.set_stance("fail_on_recompile"):  # other data, same shapes; no -inf left in fm2
        bm2, fm2 = bm.flip(-1) | torch.eye(12, dtype=torch.bool), fm.detach().clamp(min=-3.0).requires_grad_(True)
        for a, b in zip(compiled(q, k, v, bm2, fm2), dense_masked(q, k, v, bm2, fm2)):
            assert torch.equal(a, b)


def _huge_lse(q, k, v, m):
    out, lse = kf.attention(q, k, v, mask=m, return_lse=True)
    return out, lse


def test_a_huge_bias_row_is_shifted_inside_the_compiled_op_too():
    """A row whose every key carries finfo.min is shifted by it in eager calls (dense.tensor_mask);
    the compiled op, which sees the mask as data, did not, and gave the old per-piece answer
    (eager and compiled differed by O(1)). Out, lse and the gradients (the mask's too) are eager's."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, requires_grad=True) for n in (6, 9, 9))
    m = torch.randn(6, 9, generator=g)
    m[2] = torch.finfo(torch.float32).min  # float32's lse cannot hold the row's own log-sum: the
    m[4, :5], m[4, 5:] = -1e9, float("-inf")  # backward op takes the piece's own lse there
    compiled = torch.compile(_huge_lse, fullgraph=True, backend="aot_eager")
    dout = torch.randn(1, 2, 6, 8, generator=g)
    for trains in (False, True):  # the fused backward (lse taken apart) and the score-tensor one
        m = m.detach().requires_grad_(trains)
        got, want = compiled(q, k, v, m), _huge_lse(q, k, v, m)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=1e-6)
        wrt = (q, k, v, m) if trains else (q, k, v)
        for a, b in zip(torch.autograd.grad(got[0], wrt, dout), torch.autograd.grad(want[0], wrt, dout)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _sdpa_only(q, k, v, m):
    return kf.scaled_dot_product_attention(q, k, v, attn_mask=m)


def test_a_float_mask_hiding_every_pair_gets_a_zero_gradient_when_compiled():
    """As in eager calls (and SDPA): the op's backward turned the None of a tensor no piece read
    into an AttributeError (review of 2026-12-06)."""
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    m = torch.full((3, 5), float("-inf"), requires_grad=True)
    compiled = torch.compile(_sdpa_only, fullgraph=True, backend="aot_eager")
    (gm,) = torch.autograd.grad(compiled(q, k, v, m).sum(), m)
    assert bool((gm == 0).all())


def test_multihead_attention_with_tensor_masks_compiles_whole():
    """nn.MultiheadAttention with torch's masks (bool attn_mask, float key_padding_mask that trains),
    with and without the attention weights: 0 breaks, eager's outputs and gradients."""
    torch.manual_seed(0)
    mha = kf.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    am = torch.tensor([[False, True, False, False, True]]).expand(5, 5)  # True = not allowed
    kpm = torch.zeros(2, 5)
    kpm[1, 3:], kpm[0, 0] = float("-inf"), 0.5
    kpm.requires_grad_(True)

    def f(x, am, kpm):
        out, w = mha(x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=True)
        return out, w

    ex = torch._dynamo.explain(f)(x, am, kpm)
    assert ex.graph_break_count == 0, ex.break_reasons
    got, want = torch.compile(f, fullgraph=True, backend="aot_eager")(x, am, kpm), f(x, am, kpm)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    g1 = torch.autograd.grad(got[0].square().sum() + got[1].sum(), (x, kpm, *mha.parameters()))
    g2 = torch.autograd.grad(want[0].square().sum() + want[1].sum(), (x, kpm, *mha.parameters()))
    assert g2[1].abs().max() > 0.01
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_dense_mask_values_are_checked_inside_the_op():
    """Traced, the mask's values are unknown; the op checks them when it rebuilds the mask (a NaN
    raises, as eagerly), and a tensor offset with a dense mask raises naming what to pass."""
    q = torch.randn(1, 2, 5, 8)
    f = torch.compile(lambda q, m: kf.scaled_dot_product_attention(q, q, q, attn_mask=m), fullgraph=True,
                      backend="eager")
    bad = torch.zeros(5, 5)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="attn_mask contains NaN"):
        f(q, bad)
    g = torch.compile(lambda q, m, pos: kf.attention(q, q, q, mask=m, q_offset=pos), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="q_offset / kv_offset must be ints"):
        g(q, torch.ones(5, 5, dtype=torch.bool), torch.tensor(0))


def _two_halves_merged(q, k, v):
    a = kf.attend(q, k[:, :, :8], v[:, :, :8], q_offset=0)
    b = kf.attend(q, k[:, :, 8:], v[:, :, 8:], q_offset=0, kv_offset=8)
    return kf.merge(a, b).out


def test_merge_compiles_whole():
    """merge's in-place path asked functorch whether its tensor was wrapped, which dynamo cannot
    trace: a merge inside a compiled function failed under fullgraph=True (a helper's fuzz)."""
    q, k, v, _ = inputs()
    got = torch.compile(_two_halves_merged, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, _two_halves_merged(q, k, v))
    torch.testing.assert_close(got, kf.attend(q, k, v).out)


def _score_made_inside(q, k, v):
    return kf.attention(q, k, v, score=lambda s, b, h, qi, ki: s - 0.1 * (qi - ki).abs())


def _score_made_inside_capturing(q, k, v):
    slope = q.shape[-1] / 80  # a local the lambda captures: dynamo shows no closure of it
    return kf.attention(q, k, v, score=lambda s, b, h, qi, ki: s - slope * (qi - ki).abs())


def test_a_score_callable_made_inside_the_compiled_function_is_named_in_the_error():
    """dynamo cannot read the closure of a function made inside the traced one, so keyfold cannot
    see which tensors it captures: fullgraph=True raises saying to make it outside (it raised an
    AttributeError from inside dynamo); without fullgraph the call breaks the graph and runs eagerly.
    One that captures nothing compiles whole (its globals are walked; it raised too until 2026-12-08)."""
    q, k, v, _ = inputs()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="callables outside it"):
        torch.compile(_score_made_inside_capturing, fullgraph=True, backend="aot_eager")(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(_score_made_inside_capturing, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, _score_made_inside_capturing(q, k, v))
    got = torch.compile(_score_made_inside, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, _score_made_inside(q, k, v))


def _window_factory(w):
    def mask_mod(b, h, q_idx, kv_idx):  # attention-gym style: one closure per setting
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= w)
    return mask_mod


def _doc_factory(ids):
    def mask_mod(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]
    return mask_mod


def test_a_new_closure_of_the_same_code_is_a_new_mask_under_compile():
    """A mask factory's new closure (a window of another width, attention-gym's document mask built per
    batch) was run as the first closure: the graph held the first one's registry key, and dynamo had
    no guard on the callable (errors 1.6-3.1 against eager; a review, 2026-12-07). Now every step
    matches eager, passed as an argument or held on a module."""
    q, k, v = (torch.randn(1, 2, 64, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    layer = torch.compile(lambda q, k, v, m: kf.attention(q, k, v, mask=m), backend="aot_eager", fullgraph=True)

    class Model(torch.nn.Module):
        def forward(self, q, k, v):
            return kf.attention(q, k, v, mask=self.mask_mod)
    model = torch.compile(Model(), backend="aot_eager", fullgraph=True)
    makers = [_window_factory(w) for w in (10, 40, 3)]
    makers += [_doc_factory(torch.arange(64) >= cut) for cut in (50, 20)]
    for make in makers:
        want = kf.attention(q, k, v, mask=make)
        torch.testing.assert_close(layer(q, k, v, make), want)
        model.mask_mod = make
        torch.testing.assert_close(model(q, k, v), want)


class _WindowLayer(torch.nn.Module):
    """A layer whose bound-method mask and score read its window ``self.w``."""

    def __init__(self):
        super().__init__()
        self.w = 10

    def mask_mod(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= self.w)

    def score_mod(self, s, b, h, q_idx, kv_idx):
        return s - 0.01 * self.w * (q_idx - kv_idx).abs()

    def forward(self, q, k, v):
        return kf.attention(q, k, v, mask=self.mask_mod, score=self.score_mod)


def test_a_bound_method_mask_compiles_whole():
    """mask=self.mask_mod under fullgraph=True raised dynamo's "assume_constant_result argument
    conversion failed" (a review, 2026-12-07): a bound method is now named by its function and its
    object. The object's state is read when the op runs (a changed window gives a new plan)."""
    q, k, v = (torch.randn(1, 2, 64, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    eager = _WindowLayer()
    compiled = torch.compile(eager, backend="aot_eager", fullgraph=True)
    for w in (10, 3):
        eager.w = w
        torch.testing.assert_close(compiled(q, k, v), eager(q, k, v))


class _Band(kf.Mask):
    width = 40  # a class default, which an object rebuilt without its __init__ reads

    def __init__(self, width):
        self.width = width

    def evaluate(self, b, h, qp, kp):
        return (qp - kp).abs() <= self.width


class _Temperature(kf.ScoreMod):
    t = 1.0

    def __init__(self, t):
        self.t = t

    def apply(self, s, b, h, qp, kp):
        return s * self.t


class _BandCall:  # a mask_mod as a callable object
    width = 40

    def __init__(self, width):
        self.width = width

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= self.width


def _made_inside(q, k, v, w):
    return (kf.attention(q, k, v, mask=_Band(w), score=_Temperature(w / 2), q_offset=0)
            + kf.attention(q, k, v, mask=_BandCall(w + 1), q_offset=0))


def test_a_mask_or_score_object_made_inside_the_compiled_function_is_never_run_without_its_attributes():
    """A Mask or ScoreMod object of one's own (or a mask_mod that is a callable object) made inside the
    compiled function reached keyfold's registry as dynamo rebuilt it, without what its __init__ set:
    Band(2) ran with the class's width 40 (2.3 off) and Temperature(3.0) with t = 1.0, silently, under
    fullgraph=True too (a review, 2026-12-07). Now
    such an object breaks the graph (fullgraph=True raises) and the call runs eagerly; objects made
    outside compile whole, each new one a recompile, and one changed in place is read as it is now."""
    q, k, v = (torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch._dynamo.reset()
    with pytest.raises(Exception):
        torch.compile(_made_inside, backend="aot_eager", fullgraph=True)(q, k, v, 2)
    torch._dynamo.reset()
    compiled = torch.compile(_made_inside, backend="aot_eager")
    for w in (2, 5):
        torch.testing.assert_close(compiled(q, k, v, w), _made_inside(q, k, v, w))
    torch._dynamo.reset()
    outside = torch.compile(lambda q, k, v, m, s: kf.attention(q, k, v, mask=m, score=s, q_offset=0),
                            backend="aot_eager", fullgraph=True)
    for w in (3, 7):
        m, s = _Band(w), _Temperature(w / 2)
        torch.testing.assert_close(outside(q, k, v, m, s), kf.attention(q, k, v, mask=m, score=s, q_offset=0))
    m.width, s.t = 11, 0.25
    torch.testing.assert_close(outside(q, k, v, m, s), kf.attention(q, k, v, mask=m, score=s, q_offset=0))


def _window_made_inside(q, k, v, w):
    return kf.attention(q, k, v, mask=lambda b, h, qi, ki: (qi - ki).abs() <= w, q_offset=0)


def _documents_made_inside(q, k, v, ids):
    return kf.attention(q, k, v, mask=lambda b, h, qi, ki: ids[qi] == ids[ki], q_offset=0)


def test_a_mask_callable_made_inside_that_captures_a_variable_runs_eagerly_or_says_why():
    """A mask lambda made inside the compiled function over a changing int (after dynamo made it dynamic)
    or over a tensor of document ids raised dynamo's InternalTorchDynamoError "ClosureConversionError",
    also without fullgraph (a review, 2026-12-07). Now it breaks the graph and runs eagerly, and
    fullgraph=True raises naming what it captures."""
    q, k, v = (torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch._dynamo.reset()
    window = torch.compile(_window_made_inside, backend="aot_eager")
    for w in (1, 4, 9):
        torch.testing.assert_close(window(q, k, v, w), _window_made_inside(q, k, v, w))
    ids = torch.arange(40) // 15
    torch.testing.assert_close(torch.compile(_documents_made_inside, backend="aot_eager")(q, k, v, ids),
                               _documents_made_inside(q, k, v, ids))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="capturing ids"):
        torch.compile(_documents_made_inside, backend="aot_eager", fullgraph=True)(q, k, v, ids)


def test_preset_numbers_passed_in_compile_whole_and_each_gives_its_own_answer():
    """A window, sink count or dilation step passed into a ``fullgraph=True`` function: from the second
    value dynamo makes the int symbolic, and keyfold raised ``Unsupported`` (``hasattr`` on it; the
    workaround was ``dynamic=False``, a graph per value). Under compile a preset's number now reaches
    the op as data: one graph after the second value, each value its own answer and gradients."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g).requires_grad_(True) for _ in range(3))

    def f(q, k, v, w, n, step):
        a = kf.attention(q, k, v, mask=kf.causal() & (kf.window(w) | kf.sinks(n)))
        b = kf.attention(q, k, v, mask=kf.dilated(step) & kf.causal())
        return a + b

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    compiled(q, k, v, 3, 1, 2)
    compiled(q, k, v, 5, 2, 3)  # dynamo makes the numbers symbolic here
    with torch.compiler.set_stance("fail_on_recompile"):
        for w, n, step in ((9, 4, 5), (40, 0, 7), (1, 3, 1)):
            got, want = compiled(q, k, v, w, n, step), f(q, k, v, w, n, step)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            dout = torch.randn_like(want)
            for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# ----------------------------------- state a callable reads, changed by the compiled function itself

def _doc_batches(seed, n=3):
    """``n`` batches ``(q, k, v, doc)``: two sequences of 12 tokens in sorted documents 0-2."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        q, k, v = (torch.randn(2, 2, 12, 8, generator=g) for _ in range(3))
        yield q, k, v, torch.sort(torch.randint(0, 3, (2, 12), generator=g), dim=1)[0]


def _doc_reference(q, k, v, doc):
    """Attention within documents, causal, in float64, by hand."""
    N = q.shape[2]
    i = torch.arange(N)
    allowed = (doc[:, :, None] == doc[:, None, :])[:, None] & (i[None, :] <= i[:, None])
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.double()


class _CopiedDocs(torch.nn.Module):
    """The README's advice for changing data, done inside the compiled forward: a buffer updated in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("doc", torch.zeros(2, 12, dtype=torch.long))

    def mask_mod(self, b, h, qi, ki):
        return (self.doc[b, qi] == self.doc[b, ki]) & (ki <= qi)

    def forward(self, q, k, v, doc):
        self.doc.copy_(doc)
        return kf.attention(q, k, v, mask=self.mask_mod)


class _SetDocs(_CopiedDocs):
    """The same state set as an attribute."""

    def forward(self, q, k, v, doc):
        self.doc = doc
        return kf.attention(q, k, v, mask=self.mask_mod)


_DOC_STATE = {"doc": torch.zeros(2, 12, dtype=torch.long)}


def _dict_mask(b, h, qi, ki):
    return (_DOC_STATE["doc"][b, qi] == _DOC_STATE["doc"][b, ki]) & (ki <= qi)


def _dict_docs(q, k, v, doc):
    _DOC_STATE["doc"] = doc
    return kf.attention(q, k, v, mask=_dict_mask)


@pytest.mark.parametrize("make", [_CopiedDocs, _SetDocs, lambda: _dict_docs], ids=["copy_", "attribute", "dict"])
def test_state_a_mask_reads_changed_inside_the_compiled_function_is_what_it_reads(make):
    """A mask callable reading documents that the compiled function itself wrote just before the call
    (``self.doc.copy_(doc)``, ``self.doc = doc``, ``STATE["doc"] = doc``) read the previous call's
    documents, 2.1-3.2 off with ``fullgraph=True``, silently: those writes land in the real objects
    only after the graph has run, and keyfold's op runs inside it (a review, 2026-12-07; torch's
    flex_attention was right). The op is now given what the callables capture as the traced function
    left it, and the callables read that."""
    compiled = torch.compile(make(), backend="aot_eager", fullgraph=True)
    for q, k, v, doc in _doc_batches(12):
        got = compiled(q, k, v, doc)
        want = _doc_reference(q, k, v, doc)
        assert_close_by_rule(got, want, _doc_reference(q, k, v, doc).float(), None)


class _TableEachForward(torch.nn.Module):
    """A score table recomputed from parameters at every forward (a continuous position bias)."""

    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Linear(1, 2)
        self.table = torch.zeros(2, 15)

    def score_mod(self, s, b, h, qi, ki):
        return s + self.table[h, (qi - ki).clamp(-7, 7) + 7]

    def forward(self, q, k, v):
        self.table = self.mlp(torch.arange(-7.0, 8.0)[:, None]).t()
        return kf.attention(q, k, v, mask=kf.causal(), score=self.score_mod)


def test_a_score_table_rebuilt_in_the_compiled_forward_is_the_one_read():
    """The score twin: ``self.table = self.mlp(...)`` then ``score=self.score_mod``: the forward read the
    previous call's table, 2.3 off (a review, 2026-12-07); its gradients were right."""
    torch.manual_seed(13)
    m = TableModel = _TableEachForward()
    compiled = torch.compile(m, backend="aot_eager")
    for _ in range(3):
        with torch.no_grad():
            m.mlp.weight.normal_()
        q, k, v = (torch.randn(1, 2, 10, 8, requires_grad=True) for _ in range(3))
        got, want = compiled(q, k, v), TableModel(q, k, v)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        g1 = torch.autograd.grad(got.sum(), [q, m.mlp.weight])
        g2 = torch.autograd.grad(want.sum(), [q, m.mlp.weight])
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_per_batch_sinks_compile_whole_and_a_tensor_position_runs_eagerly_too():
    """``sinks(n)`` with a per-batch tensor raised dynamo's "data-dependent branching" under
    ``fullgraph=True`` (its ``n >= 0`` check; the op checks the rebuilt mask instead), and a 0-d tensor
    ``q_offset``, taken compiled, raised ``TypeError`` eagerly (a review, 2026-12-07)."""
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(3))

    def f(q, k, v, n):
        return kf.attention(q, k, v, mask=kf.causal() | kf.sinks(n))

    n = torch.tensor([3, 7])
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, n), f(q, k, v, n))
    with pytest.raises(ValueError, match="sinks"):
        compiled(q, k, v, torch.tensor([3, -1]))
    q1 = q[:, :, :1]
    want = kf.attention(q1, k, v, mask=kf.causal() & kf.window(4), q_offset=9)
    assert torch.equal(kf.attention(q1, k, v, mask=kf.causal() & kf.window(4), q_offset=torch.tensor(9)), want)


class _TwoTables(torch.nn.Module):
    """Two tensors of one dtype a mask reads, one of them set in the compiled forward."""

    def __init__(self):
        super().__init__()
        self.zeta = torch.zeros(2, 12, dtype=torch.long)
        self.zeta[:, :2] = 1
        self.doc = torch.zeros(2, 12, dtype=torch.long)

    def mask_mod(self, b, h, qi, ki):
        return (self.doc[b, qi] == self.doc[b, ki]) & (ki <= qi) | (self.zeta[b, ki] > 0)

    def forward(self, q, k, v, doc):
        self.doc = doc
        return kf.attention(q, k, v, mask=self.mask_mod)


def test_the_tensors_a_callable_reads_are_matched_by_place_not_by_the_order_dynamo_lists_them():
    """Dynamo lists an attribute the traced code set first in its view of the module's ``__dict__``: the
    traced walk and the eager one listed ``doc`` and ``zeta`` in other orders, and ``zeta``'s values
    stood in for ``doc`` (2.2-2.5 off; found the day the hand-over landed). The walk takes attributes by
    name."""
    compiled = torch.compile(_TwoTables(), backend="aot_eager", fullgraph=True)
    for q, k, v, doc in _doc_batches(15):
        other = _TwoTables()
        other.doc = doc
        torch.testing.assert_close(compiled(q, k, v, doc), kf.attention(q, k, v, mask=other.mask_mod))


class _WindowSetInside(_WindowLayer):
    """The window set in the compiled forward itself."""

    def forward(self, q, k, v, w):
        self.w = w
        return kf.attention(q, k, v, mask=self.mask_mod)


def test_a_number_a_callable_reads_set_inside_the_compiled_function_raises_instead_of_reading_the_old_one():
    """``self.window = w`` in the compiled forward, read by the mask: the op ran before the attribute was
    set and read the previous call's window (1.3-1.7 off, silently; 2026-12-07). keyfold cannot hand a
    Python number over as it does a tensor: it compares the numbers the traced call saw with the
    object's, and raises naming the fix."""
    q, k, v = (torch.randn(1, 2, 32, 8, generator=torch.Generator().manual_seed(16)) for _ in range(3))
    compiled = torch.compile(_WindowSetInside(), backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="plain value"):
        compiled(q, k, v, 5)


_GC_BAND = torch.tensor(5)


def _gc_band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= _GC_BAND


def _gc_scaled(s, b, h, q_idx, kv_idx):
    return s * _GC_BAND.float() / 5


def test_a_collection_changing_the_callables_module_meanwhile_is_harmless():
    """Dynamo's compiled frames live in the user's module globals (``__compiled_fn_*``) and a garbage
    collection deletes old ones. The callables' walk read a mask's globals through ``fn.__globals__``,
    which dynamo builds whole by iterating it: a collection meanwhile raised ``InternalTorchDynamoError:
    dictionary changed size during iteration`` (on recompiles in the suite, 2026-12-07). Here every
    collection adds or deletes a global of this module, and collections run every few allocations."""
    module = sys.modules[__name__]

    def tick(phase, info):
        if phase == "start":
            if "_gc_tick" in vars(module):
                del module._gc_tick
            else:
                module._gc_tick = 1

    q, k, v = (torch.randn(1, 2, 32, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    fn = torch.compile(lambda q, k, v: kf.attention(q, k, v, mask=_gc_band, score=_gc_scaled),
                       backend="aot_eager", fullgraph=True)
    before = gc.get_threshold()
    gc.callbacks.append(tick)
    gc.set_threshold(5)
    try:
        out = fn(q, k, v)
    finally:
        gc.set_threshold(*before)
        gc.callbacks.remove(tick)
        vars(module).pop("_gc_tick", None)
    torch.testing.assert_close(out, kf.attention(q, k, v, mask=_gc_band, score=_gc_scaled))


_INSIDE = {"doc": torch.zeros(32, dtype=torch.long), "t": torch.tensor(1.0)}


def test_a_lambda_made_inside_reads_the_module_state_the_function_set_before_the_call():
    """A mask made inside the compiled function, reading a module-level dict the function changes just
    before the call, read the old entry: 1.1-1.4 off on every call, silently; the same as a score raised
    TypeError (2026-12-08). Such a lambda captures nothing, so its globals are walked as any callable's;
    the score's tensor that trains gets its gradient."""
    def masked(q, k, v, doc):
        _INSIDE["doc"] = doc
        return kf.attention(q, k, v, mask=lambda b, h, qi, ki: _INSIDE["doc"][qi] == _INSIDE["doc"][ki])

    def scored(q, k, v, t):
        _INSIDE["t"] = t
        return kf.attention(q, k, v, score=lambda s, b, h, qi, ki: s * _INSIDE["t"])

    q, k, v = (torch.randn(1, 2, 32, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for fullgraph in (True, False):
        cm = torch.compile(masked, backend="aot_eager", fullgraph=fullgraph)
        cs = torch.compile(scored, backend="aot_eager", fullgraph=fullgraph)
        for cut in (5, 20, 11):
            doc = (torch.arange(32) >= cut).long()
            torch.testing.assert_close(cm(q, k, v, doc), kf.attention(q, k, v, mask=lambda b, h, qi, ki: doc[qi] == doc[ki]))
        for t in (1.0, 3.0, 0.5):
            got_t, want_t = torch.tensor(t, requires_grad=True), torch.tensor(t, requires_grad=True)
            got = cs(q, k, v, got_t)
            want = kf.attention(q, k, v, score=lambda s, b, h, qi, ki: s * want_t)
            torch.testing.assert_close(got, want)
            got.sum().backward()
            want.sum().backward()
            torch.testing.assert_close(got_t.grad, want_t.grad)


def test_a_lambda_with_a_default_made_inside_compiles():
    """mask=lambda b, h, q, kv, w=w: ... made inside the compiled function crashed dynamo on its first call
    (the walk read a stand-in's defaults, which dynamo gives as a bare tuple; a review of 2026-12-08's
    changes): it runs again."""
    q, k, v = (torch.randn(1, 2, 32, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def f(q, k, v, w):
        return kf.attention(q, k, v, mask=lambda b, h, qi, ki, w=w: (qi - ki <= w) & (ki <= qi))
    for fullgraph in (True, False):
        torch._dynamo.reset()
        out = torch.compile(f, backend="aot_eager", fullgraph=fullgraph)(q, k, v, 9)
        torch.testing.assert_close(out, kf.attention(q, k, v, mask=kf.causal() & kf.window(9)))


def test_a_preset_built_outside_raises_once_its_tensor_changed_in_place():
    """A preset built outside the compiled function and reused after its tensor changed in place ran on the
    preset's old copy under torch.compile, silently (documents 1.25 off; eager raised since 2026-12-08). The
    graph now compares the tensor as it is with the preset's copy and the op raises as the eager call does;
    unchanged, the call matches eager under fullgraph=True, gradients included."""
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ids = torch.repeat_interleave(torch.arange(4), 16)
    cu_buf = torch.tensor([0, 32, 64, 64, 64])
    lengths = torch.tensor([64])
    slopes = torch.tensor([0.5, 0.25])
    cases = [(lambda: ids, kf.masks.documents(ids), None, lambda: ids.copy_(torch.repeat_interleave(torch.arange(2), 32))),
             (lambda: cu_buf, kf.masks.varlen(cu_buf[:3]), None, lambda: cu_buf[1].fill_(16)),
             (lambda: lengths, kf.masks.padding(lengths), None, lambda: lengths.fill_(40)),
             (lambda: slopes, None, kf.scores.alibi(slopes), lambda: slopes.mul_(2))]
    for _, mask, score, change in cases:
        torch._dynamo.reset()
        f = torch.compile(lambda q, k, v: kf.attention(q, k, v, mask=mask, score=score, q_offset=0),
                          backend="aot_eager", fullgraph=True)
        qg = q.clone().requires_grad_()
        got = f(qg, k, v)
        want = kf.attention(q, k, v, mask=mask, score=score, q_offset=0)
        torch.testing.assert_close(got, want)
        got.sum().backward()
        assert qg.grad is not None and torch.isfinite(qg.grad).all()
        change()
        with pytest.raises(ValueError, match="changed in place"):
            f(q, k, v)
        with pytest.raises(ValueError, match="changed in place"):  # as the eager call
            kf.attention(q, k, v, mask=mask, score=score, q_offset=0)


def test_a_preset_built_inside_from_a_changing_tensor_is_data_of_the_graph():
    """Built inside the compiled function, a preset's tensor is data: each call sees its values, no check needed."""
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ids = torch.repeat_interleave(torch.arange(4), 16)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, ids: kf.attention(q, k, v, mask=kf.masks.documents(ids), q_offset=0),
                      backend="aot_eager", fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(f(q, k, v, ids), kf.attention(q, k, v, mask=kf.masks.documents(ids), q_offset=0))
        ids.copy_(torch.repeat_interleave(torch.arange(2), 32))


def test_a_preset_built_inside_is_used_across_a_graph_break():
    """A preset built inside a compiled function and used after a graph break (a print, a logger) is that
    call's data: it runs as eager does. (A check of presets kept from an earlier trace, by compile id, raised
    here on valid code, since the code after a break is another compile; it was taken out the same night.)"""
    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])

    def f(q, k, v, ids):
        m = kf.masks.documents(ids)
        torch._dynamo.graph_break()
        return kf.attention(q, k, v, mask=m)

    torch._dynamo.reset()
    g = torch.compile(f, backend="aot_eager")
    for _ in range(2):
        torch.testing.assert_close(g(q, k, v, ids), f(q, k, v, ids))
        ids.copy_(torch.tensor([0, 1, 1, 1, 1, 1, 2, 2]))


def test_a_preset_whose_tensor_only_changed_dtype_does_not_raise():
    """alibi(a frozen parameter) then model.double(): the slopes took another dtype, no other value, and every
    call raised "changed in place", eager and compiled (a review, 2026-12-08)."""
    q, k, v = (torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    p = torch.nn.Parameter(torch.tensor([0.5, 0.25]), requires_grad=False)
    score = kf.scores.alibi(p)
    want = kf.attention(q, k, v, score=score)
    p.data = p.data.double()
    torch.testing.assert_close(kf.attention(q, k, v, score=score), want)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: kf.attention(q, k, v, score=score), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(q, k, v), want)


def test_softcap_of_a_0d_tensor_built_inside_fullgraph():
    """softcap(torch.tensor(2.0)) (a config's value kept as a tensor) inside torch.compile(fullgraph=True)
    crashed in dynamo ("Unsupported repr() on tensor"; a review, 2026-12-08): the tensor is data of the graph."""
    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    cap = torch.tensor(2.0)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: kf.attention(q, k, v, score=kf.scores.softcap(cap), mask=kf.causal()),
                      backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(q, k, v), kf.attention(q, k, v, score=kf.scores.softcap(2.0), mask=kf.causal()))


def test_a_compiled_call_rebuilds_its_preset_only_when_the_values_change(monkeypatch):
    """Each compiled call rebuilt its presets from their tensors (digests of the ids for the plan cache): a
    decoding step over 128k keys took 3.9 ms compiled, 0.33 ms eager (a review, 2026-12-08). The op keeps
    what it rebuilt while the tensors hold the same values, compared by value: a write through numpy (no
    version bump) is seen."""
    from keyfold import ops
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ids = torch.repeat_interleave(torch.arange(4), 16)
    built = []
    real = ops._unflatten
    monkeypatch.setattr(ops, "_unflatten", lambda *a: built.append(1) or real(*a))
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, ids: kf.attention(q, k, v, mask=kf.masks.documents(ids) & kf.causal(),
                                                         q_offset=0), backend="aot_eager", fullgraph=True)
    for _ in range(3):
        f(q, k, v, ids)
    assert len(built) == 1
    ids.numpy()[:] = torch.repeat_interleave(torch.arange(2), 32).numpy()
    want = kf.attention(q, k, v, mask=kf.masks.documents(ids.clone()) & kf.causal(), q_offset=0)
    torch.testing.assert_close(f(q, k, v, ids), want)
    assert len(built) == 2
