"""keyfold's float32 backward kernel (keyfold/kernels/backward.c, ``native.backward``): the gradients
of one fused call as PyTorch's op gives them, held to the 3x rule where the op's e^x was not.

Before it, the CPU backend's float32 backward was PyTorch's fused op, bit for bit SDPA's: dv at
3.5x the naive float32 error at score std 1, 7.8x at 3, 9.6x at 6 (a window mask, 130 rows),
past the rule (3x plus 1e-6) in every float32 case the 2026-12-06 fuzz ran at score std >= 3.
The kernel's first form (float32 sums against the forward's lse) broke it where the op had not:
calls of few rows, whose forward summed its scores in another order (up to 55x); those calls now
renormalise P by the kernel's own float64 scores (``native.backward_sums``)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keyfold as kf
from keyfold.kernels import cpu, native
from tests.helpers import assert_backward_by_rule, assert_close_by_rule, seeded_qkv

pytestmark = pytest.mark.skipif(not native.backward_available(), reason=f"native backward kernel: {native.why()}")

_OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _case(B, Hq, Hkv, L, S, W, causal, mask_kind, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, W, generator=g) * std ** 0.5
    k = torch.randn(B, Hkv, S, W, generator=g) * std ** 0.5
    v, do = torch.randn(B, Hkv, S, W, generator=g), torch.randn(B, Hq, L, W, generator=g)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(L, S, generator=g) > 0.3
        mask[:, 0] = True  # every row sees a key (the op's lse of an empty row is not ours to match)
    elif mask_kind == "float":  # a bias per query head, -inf hiding some pairs
        mask = torch.where(torch.rand(1, Hq, L, S, generator=g) > 0.3, torch.randn(1, Hq, L, S, generator=g),
                           -math.inf)
        mask[..., 0] = 0.0
    elif mask_kind == "float per kv head":
        mask = torch.randn(B, Hkv, L, S, generator=g)
    return q, k, v, do, mask


SHAPES = {  # B, Hq, Hkv, L, S, W, causal, mask
    "dense": (1, 2, 2, 64, 64, 64, False, None),
    "tails": (1, 2, 2, 37, 53, 64, False, None),           # fewer rows and keys than a tile
    "causal": (2, 2, 2, 100, 100, 64, True, None),
    "causal, more keys": (1, 2, 2, 50, 130, 32, True, None),  # top-left: keys past the rows unseen
    "gqa, bool mask": (2, 4, 2, 100, 130, 40, False, "bool"),
    "mqa, causal, float mask, spare column": (1, 4, 1, 70, 70, 65, True, "float"),
    "bias per kv head": (2, 6, 3, 45, 77, 48, False, "float per kv head"),
    "wide": (1, 3, 3, 33, 200, 128, False, None),
    "widest": (1, 2, 2, 40, 97, 256, False, "float"),
    "one head (key blocks split among threads)": (1, 1, 1, 300, 700, 16, True, None),
    "three heads (do not divide two threads)": (1, 3, 3, 150, 333, 64, False, "bool"),
}


def _op_grads(q, k, v, do, causal, mask, scale):
    """the fused op's forward and backward, k and v repeated for a GQA group, dk and dv summed back"""
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    m = mask
    if m is not None and m.dtype is torch.bool:  # the op takes the additive form only
        m = torch.zeros(m.shape).masked_fill(~m, -math.inf)
    if m is not None and m.dim() == 4 and m.shape[1] == k.shape[1] and g > 1:
        m = m.repeat_interleave(g, 1)
    out, lse = _OP(q, ke, ve, 0.0, causal, attn_mask=m, scale=scale)[:2]
    dq, dk, dv = _BWD(do, q, ke, ve, out, lse, 0.0, causal, attn_mask=m, scale=scale)
    B, Hkv = k.shape[:2]
    return out, lse, (dq, dk.reshape(B, Hkv, g, *dk.shape[2:]).sum(2), dv.reshape(B, Hkv, g, *dv.shape[2:]).sum(2))


@pytest.mark.parametrize("wide", [False, True], ids=["float32 sums", "float64 sums"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_backward_kernel_gives_the_fused_ops_gradients(shape, threads, wide):
    """Same arguments as the op, same gradients to float32 rounding: every tail of the 48-row and
    64-key tiles and of the 16-column vectors, GQA groups summed, both ways of sharing the work,
    scores and dP summed in float32 or float64."""
    B, Hq, Hkv, L, S, W, causal, mk = SHAPES[shape]
    q, k, v, do, mask = _case(B, Hq, Hkv, L, S, W, causal, mk)
    scale = W ** -0.5
    out, lse, ref = _op_grads(q, k, v, do, causal, mask, scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.backward(do, q, k, v, out, lse, causal, mask, scale, wide=wide)
    finally:
        torch.set_num_threads(before)
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        assert a.shape == b.shape and a.dtype == torch.float32 and a.is_contiguous(), name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=f"{name} of {shape}")


@pytest.mark.parametrize("std", [1.0, 3.0, 6.0])
def test_float32_cpu_backward_holds_the_rule_where_the_fused_op_did_not(std):
    """The regression: dv (and dq, dk) within 3x the naive float32 error plus 1e-6 on the case the
    README's known limits named (a causal window, 130 rows, head size 32). On the fused op this
    failed at std 3 and 6."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 130, 32, generator=g) * (std ** 0.5 if i < 2 else 1.0) for i in range(3))
    before = native.backward_calls
    assert_backward_by_rule(q, k, v, mask=kf.causal() & kf.window(9), backend=kf.Backend.CPU)
    assert native.backward_calls > before, "the CPU backend's float32 backward ran on the kernel"


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 3), g=st.sampled_from([1, 2, 4]), L=st.integers(1, 90),
       S=st.integers(1, 150), W=st.sampled_from([8, 16, 24, 64, 80]), causal=st.booleans(),
       std=st.sampled_from([0.5, 2.0, 6.0]), seed=st.integers(0, 2 ** 16))
def test_backward_kernel_holds_the_rule_on_any_shape(B, Hkv, g, L, S, W, causal, std, seed):
    """Any shape, GQA group and score spread through the CPU backend: the gradients keep the rule."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * g, L, W, generator=gen) * std ** 0.5
    k = torch.randn(B, Hkv, S, W, generator=gen) * std ** 0.5
    v = torch.randn(B, Hkv, S, W, generator=gen)
    mask = kf.causal() if causal else None
    assert_backward_by_rule(q, k, v, mask=mask, backend=kf.Backend.CPU, q_offset=S - L if causal else 0)


def test_rows_that_see_no_key_get_zero_gradients_and_nan_scores_reach_them():
    """A row every key of the mask hides (the backend gives it lse 0) contributes nothing; a NaN in q
    reaches that row's gradients as in the op, not as silent zeros."""
    q, k, v, do, _ = _case(1, 2, 2, 40, 70, 64, False, None)
    mask = torch.ones(40, 70, dtype=torch.bool)
    mask[7] = False
    out, lse, _ = _op_grads(q, k, v, do, False, mask, 0.125)
    lse = lse.clone()
    lse[:, :, 7] = 0.0
    dq, dk, dv = native.backward(do, q, k, v, out, lse, False, mask, 0.125)
    assert (dq[:, :, 7] == 0).all()
    q[0, 1, 3, 5] = math.nan
    dq, dk, dv = native.backward(do, q, k, v, out, lse, False, mask, 0.125)
    assert dq[0, 1, 3].isnan().all() and dv[0, 1].isnan().any()
    assert not dq[0, 0].isnan().any() and not dq[0, 1, 4].isnan().any()


def test_backward_kernel_names_what_it_refuses():
    q = torch.randn(1, 2, 8, 16)
    assert "float32" in native.backward_takes(q.double(), q.double(), q.double())
    assert "head size" in native.backward_takes(torch.randn(1, 1, 4, 5000), torch.randn(1, 1, 4, 5000),
                                                torch.randn(1, 1, 4, 5000))
    assert "shapes" in native.backward_takes(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))
    with pytest.raises(RuntimeError, match="use the fused op"):
        native.backward(q, q.double(), q, q, q, q[..., 0], False, None, 0.25)
    with pytest.raises(RuntimeError, match="heads"):
        native.backward(q, q, q, q, q, q[..., 0], False, torch.ones(1, 5, 8, 8, dtype=torch.bool), 0.25)



@pytest.mark.parametrize("wide", [False, True], ids=["float32 sums", "float64 sums"])
@pytest.mark.parametrize("shape", ["tails", "gqa, bool mask", "mqa, causal, float mask, spare column", "widest"])
def test_backward_sums_are_the_rows_sums_of_p_and_p_dp(shape, wide):
    """With the float64 lse, each row's sum of P is 1 and of P dP is sum P dP in float64: to the
    rounding of float32 P's and the float32 lse (6e-8) with float64 scores, and of float32 scores
    (a few 1e-6 over 256 head dimensions) with float32 ones."""
    B, Hq, Hkv, L, S, W, causal, mk = SHAPES[shape]
    q, k, v, do, mask = _case(B, Hq, Hkv, L, S, W, causal, mk)
    g = Hq // Hkv
    s = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) * W ** -0.5
    if mask is not None:
        m = mask.double() if mask.dtype is not torch.bool else torch.zeros(mask.shape, dtype=torch.float64).masked_fill(
            ~mask, -math.inf)
        s = s + (m.repeat_interleave(g, 1) if m.dim() == 4 and m.shape[1] == Hkv and g > 1 else m)
    if causal:
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -math.inf)
    p = s.softmax(-1)
    sums = native.backward_sums(do, q, k, v, torch.logsumexp(s, -1).float(), causal, mask, W ** -0.5, wide=wide)
    tol = 1e-6 if wide else 2e-5
    torch.testing.assert_close(sums[0], torch.ones_like(sums[0]), rtol=0, atol=tol)
    dp = do.double() @ v.double().repeat_interleave(g, 1).transpose(-1, -2)
    torch.testing.assert_close(sums[1], (p * dp).sum(-1), rtol=tol, atol=tol)


#: the 2026-12-06 review's cases where the kernel's first form (float32 sums against the forward's
#: lse) broke the rule and the op had not (dv 10.4x, 4.3x; dk 10.8x; dq 15.3x): few rows, whose
#: forward ran on the op or the decode kernel
FEW_ROWS = [  # B, Hq, Hkv, Nq, Nk, D, std, causal, seed
    (1, 2, 1, 2, 2, 256, 1.0, False, 0),
    (1, 1, 1, 1, 300, 128, 6.0, True, 0),
    (1, 2, 2, 4, 300, 128, 3.0, True, 1),
    (1, 1, 1, 1, 129, 48, 10.0, False, 2),
]


@pytest.mark.parametrize("case", FEW_ROWS, ids=lambda c: f"{c[3]}x{c[4]} D{c[5]} std{c[6]:g}")
def test_few_rows_renormalise_by_the_kernels_own_scores(case):
    B, Hq, Hkv, Nq, Nk, D, std, causal, seed = case
    q, k, v = seeded_qkv(seed, B, Hq, Hkv, Nq, Nk, D, std=std)
    assert_backward_by_rule(q, k, v, mask=kf.causal() if causal else None, backend=kf.Backend.CPU)


@pytest.mark.parametrize("mask", [None, kf.causal()], ids=["no mask", "causal"])
def test_an_empty_batch_has_empty_gradients(mask):
    """B = 0 reached the kernel, which took the empty dq for a failed allocation and raised (code 2)."""
    q, k, v = (torch.randn(0, 2, 10, 16, requires_grad=True) for _ in range(3))
    kf.attention(q, k, v, mask=mask, backend=kf.Backend.CPU).sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("heads", [1, 3, 5], ids=lambda h: f"{h} items")
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_gradients_are_the_same_bits_run_to_run_and_at_any_thread_count(heads, causal):
    """A review found dq moving by up to 2e-6 between 1 and 2 threads and between runs at 2 threads:
    (item, key block) pairs went to threads dynamically, each adding dq into a buffer of its own. Now
    an item is one thread's work, or two fixed halves (fewer than 4 items) summed in a fixed order."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, 600, 16, generator=g) * s for s in (1.7, 1.7, 1, 1))
    out, lse, _ = _op_grads(q, k, v, do, causal, None, 0.25)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 2, 2, 3):
            torch.set_num_threads(threads)
            runs.append(native.backward(do, q, k, v, out, lse, causal, None, 0.25))
    finally:
        torch.set_num_threads(before)
    for got in runs[1:]:
        for a, b in zip(got, runs[0]):
            assert torch.equal(a, b)


def test_the_wrappers_name_a_row_tensor_of_the_wrong_shape_and_sum_nothing_over_no_rows():
    """A review: dout, out or lse of another shape than q's reached the kernel, which read past them
    (an ASan heap overflow; the build returned gradients silently); and backward_sums over no query
    rows passed an empty tensor's null pointer, which the kernel took for gradient mode (a crash)."""
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    do, out, lse = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5)
    for kw, name in ((dict(dout=do[..., :4]), "dout"), (dict(out=out[..., :4]), "out"), (dict(lse=lse[..., :3]), "lse")):
        args = dict(dout=do, out=out, lse=lse) | kw
        with pytest.raises(RuntimeError, match=f"{name} has shape"):
            native.backward(args["dout"], q, k, v, args["out"], args["lse"], False, None, 0.25)
    with pytest.raises(RuntimeError, match="delta has shape"):
        native.backward(do, q, k, v, out, lse, False, None, 0.25, delta=lse[..., :2])
    with pytest.raises(RuntimeError, match="lse has shape"):
        native.backward_sums(do, q, k, v, lse[:, :1], False, None, 0.25)
    empty = torch.randn(1, 2, 0, 8)
    sums = native.backward_sums(empty, empty, k, v, torch.randn(1, 2, 0), False, None, 0.25)
    assert sums.shape == (2, 1, 2, 0)


@pytest.mark.parametrize("seed, keys, head, std", [(30, 200, 64, 10.0), (32, 33, 64, 6.0), (37, 33, 127, 6.0)])
def test_one_row_over_its_keys_sums_in_float64(seed, keys, head, std):
    """One query row a kv head (a GQA pair over a short cache): the naive float32 attention sums each
    score along the head dimension in vectors (a GEMV), more exactly than one FMA a dimension, and the
    renormalised float32 sums broke the rule in 18 of 120 such cases (dq 4x, dv 9x); up to
    cpu.WIDE_ROWS rows a kv head they are float64."""
    q, k, v = seeded_qkv(seed, 1, 2, 1, 1, keys, head, std=std)
    assert_backward_by_rule(q, k, v, backend=kf.Backend.CPU)


@pytest.mark.skipif(not native.prefill_available(torch.float32), reason="float32 prefill kernel not built here")
def test_a_training_steps_short_float32_sequences_go_to_the_kernel(monkeypatch):
    """float32 calls of PREFILL_SQUARE_ROWS to PREFILL_MIN_ROWS rows per kv head with at most
    PREFILL_KEYS_PER_ROW keys a row run on the kernel (0.47-0.88x the op's forward at 128-300 rows);
    not 32 rows (1.12x), not a softcap or callable (their tile backward reads this forward's lse), not
    head size 256, not bfloat16; and their backward renormalises, so its P is the backward's own."""
    monkeypatch.setattr(cpu, "PREFILL_MIN_ROWS", 512)
    monkeypatch.setattr(cpu, "PREFILL_KEYS_PER_ROW", 8)
    pb = kf.kernels._common.Problem(None, None, 0.125, 0, 0)
    z = torch.zeros
    assert cpu._prefill_may(z(8, 8, 128, 64), z(8, 8, 128, 64), z(8, 8, 128, 64), pb, True, True)
    assert cpu._prefill_may(z(1, 2, 64, 64), z(1, 2, 512, 64), z(1, 2, 512, 64), pb)
    assert not cpu._prefill_may(z(1, 2, 64, 64), z(1, 2, 513, 64), z(1, 2, 513, 64), pb)
    assert not cpu._prefill_may(z(8, 8, 32, 64), z(8, 8, 32, 64), z(8, 8, 32, 64), pb)
    assert not cpu._prefill_may(z(1, 2, 128, 256), z(1, 2, 128, 256), z(1, 2, 128, 256), pb)
    b16 = z(1, 2, 128, 64, dtype=torch.bfloat16)
    assert not cpu._prefill_may(b16, b16, b16, pb)
    capped = kf.kernels._common.Problem(None, kf.softcap(20.0), 0.125, 0, 0)
    assert not cpu._prefill_may(z(1, 2, 128, 64), z(1, 2, 128, 64), z(1, 2, 128, 64), capped)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 200, 64, generator=g) for _ in range(3))
    before = native.prefill_calls
    assert_backward_by_rule(q * 2, k * 2, v, mask=kf.causal(), backend=kf.Backend.CPU)
    assert native.prefill_calls > before


#: head size 256 and an lse gradient: the call's width, with the spare column, is 257, which the kernel
#: once refused; the fused op's gradients broke the rule there (a 1,500-case fuzz: dv 4.7x, dk 4.6x,
#: dq 8.7x). B, Hq, Hkv, Nq, Nk, D, Dv, std, mask
PAST_256 = {
    "dilated, 64 x 200": (1, 2, 2, 64, 200, 200, 256, 6.0, lambda: kf.dilated(3)),
    "GQA window, 63 x 100": (1, 8, 2, 63, 100, 2, 256, 6.0, lambda: kf.causal() & kf.window(40)),
    "documents, 2 x 2": (1, 4, 1, 2, 2, 8, 256, 10.0, lambda: kf.causal()),
    "dense, 600 x 600": (1, 1, 1, 600, 600, 256, 300, 3.0, lambda: None),
}


#: the seeds that broke the rule on the op (the 600 x 600 case held it there: the kernel's large calls)
PAST_256_SEEDS = {"dilated, 64 x 200": [0, 1, 2], "GQA window, 63 x 100": [0, 1, 2], "documents, 2 x 2": [6, 9],
                  "dense, 600 x 600": [0]}


@pytest.mark.parametrize("case, seed", [(c, s) for c in sorted(PAST_256) for s in PAST_256_SEEDS[c]])
def test_head_sizes_past_256_run_renormalised_on_the_kernel(case, seed):
    """Past cpu.ORDERED_HEAD no forward sums scores in the kernel's order: the kernel takes such calls
    only renormalised (float64 sums), at any row count; before, they went to the fused op."""
    B, Hq, Hkv, Nq, Nk, D, Dv, std, mask = PAST_256[case]
    q, k, v = seeded_qkv(seed, B, Hq, Hkv, Nq, Nk, D, Dv, std)
    before = native.backward_calls
    assert_backward_by_rule(q, k, v, lse_grad=True, mask=mask(), backend=kf.Backend.CPU)
    assert native.backward_calls > before


#: 16-bit calls, whose gradients came from the fused op's 16-bit backward: dq 29x the naive bfloat16
#: error on a 2 x 2 causal window (seed 4; 22x seed 2, 11x seed 0; 99x in the fuzz), 3.4-4.7x on the
#: other short calls, 3.2-4.6x at 600 x 600 (6 and 7 of 30 seeds).
#: dtype, B, Hq, Hkv, Nq, Nk, D, Dv, std, mask, q_offset, lse gradient
SIXTEEN_BIT = {
    "bfloat16 causal window, 2 x 2": (torch.bfloat16, 2, 1, 1, 2, 2, 1, 100, 3.0, lambda: kf.causal() & kf.window(2), 2, False),
    "bfloat16 causal, 5 x 2, lse": (torch.bfloat16, 3, 2, 2, 5, 2, 128, 128, 10.0, lambda: kf.causal(), None, True),
    "float16 sinks | window, 17 x 3": (torch.float16, 1, 2, 1, 17, 3, 63, 63, 6.0, lambda: kf.sinks(2) | kf.window(8), None, False),
    "float16 ALiBi, 2 x 2, lse": (torch.float16, 2, 4, 1, 2, 2, 33, 128, 10.0, lambda: kf.causal(), None, True),
    "bfloat16 ALiBi, 600 x 600": (torch.bfloat16, 1, 1, 1, 600, 600, 64, 64, 1.0, lambda: kf.causal(), None, False),
    "float16 causal, 600 x 600": (torch.float16, 1, 2, 2, 600, 600, 16, 16, 1.0, lambda: kf.causal(), None, False),
}


#: the seeds that broke the rule on the op
SIXTEEN_BIT_SEEDS = {"bfloat16 causal window, 2 x 2": [0, 2, 4], "bfloat16 causal, 5 x 2, lse": [1, 6, 7],
                      "float16 sinks | window, 17 x 3": [6], "float16 ALiBi, 2 x 2, lse": [9, 14],
                      "bfloat16 ALiBi, 600 x 600": [0, 6, 16], "float16 causal, 600 x 600": [4, 17, 18]}


@pytest.mark.parametrize("case, seed", [(c, s) for c in sorted(SIXTEEN_BIT) for s in SIXTEEN_BIT_SEEDS[c]])
def test_16_bit_calls_take_their_gradients_from_the_float32_kernel(case, seed):
    """cpu.LOW_ON_KERNEL: q, k, v, out and dO read by the kernel as they are, computed in float32
    (renormalised under cpu.RENORM_ROWS rows), the gradients summed in float32 and rounded to the input
    dtype once."""
    dt, B, Hq, Hkv, Nq, Nk, D, Dv, std, mask, q_offset, lse_grad = SIXTEEN_BIT[case]
    q, k, v = seeded_qkv(seed, B, Hq, Hkv, Nq, Nk, D, Dv, std, dt)
    kw = dict(mask=mask(), q_offset=q_offset)
    if "ALiBi" in case:
        kw["score"] = kf.alibi(kf.alibi_slopes(Hq))
    before = native.backward_calls
    got = assert_backward_by_rule(q, k, v, lse_grad=lse_grad, backend=kf.Backend.CPU, **kw)
    assert native.backward_calls > before
    assert all(t.dtype == dt for t in got[1:])


#: float32 calls of many rows and a small head (cpu.RENORM_HEAD): the naive attention's scores of few
#: products are nearly exact, and P against the forward's lse (a float32 sum of P, its log and an add,
#: each rounded) broke the rule unrenormalised: at head size 1-2 in half of 20 seeds (dv up to 8x).
#: B, Hq, Hkv, N, D, std, mask
SMALL_HEADS = {
    "D 1, causal, 1024": (1, 2, 2, 1024, 1, 10.0, lambda: kf.causal()),
    "D 8, GQA, 1024": (1, 2, 1, 1024, 8, 6.0, lambda: None),
    "D 2, causal window, 600": (1, 2, 1, 600, 2, 10.0, lambda: kf.causal() & kf.window(100)),
}
#: seeds that broke the rule before
SMALL_HEAD_SEEDS = {"D 1, causal, 1024": [0, 1, 5], "D 8, GQA, 1024": [3, 5], "D 2, causal window, 600": [0, 1, 11]}


@pytest.mark.parametrize("case, seed", [(c, s) for c in sorted(SMALL_HEADS) for s in SMALL_HEAD_SEEDS[c]])
def test_small_heads_renormalise_at_any_row_count(case, seed):
    B, Hq, Hkv, N, D, std, mask = SMALL_HEADS[case]
    q, k, v = seeded_qkv(seed, B, Hq, Hkv, N, N, D, std=std)
    assert_backward_by_rule(q, k, v, mask=mask(), backend=kf.Backend.CPU)


def _grads_by_rule(q, k, v, dout, attend, naive):
    """dq, dk, dv of ``attend(q, k, v, backend=...)`` (AUTO, and the float64 reference) against ``naive``'s,
    by the 3x rule, for the output gradient ``dout``"""
    def grads(fn, *xs):
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        fn(*xs).backward(dout.to(xs[0].dtype))
        return [x.grad for x in xs]

    got = grads(lambda a, b, c: attend(a, b, c, backend=kf.Backend.AUTO), q, k, v)
    ref = grads(lambda a, b, c: attend(a, b, c, backend=kf.Backend.REFERENCE), q.double(), k.double(), v.double())
    nai = grads(naive, q, k, v)
    return [assert_close_by_rule(a, r, n, None, factor=3.0, what=name)
            for name, a, r, n in zip(("dq", "dk", "dv"), got, ref, nai)]


def test_sharp_scores_at_head_sizes_under_64_renormalise():
    """512 rows of head size 17 over 65 keys at score std 20: unrenormalised (RENORM_HEAD was 16) dv was at
    1.61x the 3x rule's allowance; 22 of 400 random calls at head sizes 17-48 and std 12-20 broke it (a
    review, 2026-12-07). Renormalised below head size 64 now: 0.37x here (511 rows, renormalised by the
    row count before, 0.27x)."""
    g = torch.Generator().manual_seed(88)
    q = torch.randn(1, 1, 512, 17, generator=g) * 20.0 ** 0.5
    k = torch.randn(1, 1, 65, 17, generator=g) * 20.0 ** 0.5
    v = torch.randn(1, 1, 65, 17, generator=g)
    dout = torch.randn(1, 1, 512, 17, generator=torch.Generator().manual_seed(7865), dtype=torch.float64).float()
    errs = _grads_by_rule(q, k, v, dout, kf.attention,
                          lambda a, b, c: torch.softmax((a @ b.transpose(-1, -2)) * 17 ** -0.5, -1) @ c)
    assert all(e <= 3.0 * n + 1e-6 for e, n in errs)


@pytest.mark.parametrize("seed, Nq, Nk, std, bstd, per_head", [(6243, 10, 100, 12.0, 10.0, True),
                                                               (915, 9, 16, 20.0, 0.5, False)])
def test_float_masks_of_9_to_16_rows_sum_in_float64(seed, Nq, Nk, std, bstd, per_head):
    """float32 gradients of 9-16 rows a head under a float tensor mask summed in float32 (WIDE_ROWS was 8):
    dq 1.84x and 1.27x the 3x rule's allowance in these cases (1 of 2,000 random calls of 9-16 rows; a
    review, 2026-12-07). float64 up to 16 rows now: 0.03-0.08x."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, Nq, 32, generator=g) * std ** 0.5
    k = torch.randn(1, 2, Nk, 32, generator=g) * std ** 0.5
    v = torch.randn(1, 2, Nk, 32, generator=g)
    bias = torch.randn(1, 2 if per_head else 1, Nq, Nk, generator=torch.Generator().manual_seed(seed + 31)) * bstd
    dout = torch.randn(1, 2, Nq, 32, generator=torch.Generator().manual_seed(seed + 7777), dtype=torch.float64).float()
    errs = _grads_by_rule(q, k, v, dout, lambda a, b, c, **kw: kf.attention(a, b, c, mask=bias.to(a.dtype), **kw),
                          lambda a, b, c: torch.softmax((a @ b.transpose(-1, -2)) * 32 ** -0.5 + bias, -1) @ c)
    assert all(e <= 3.0 * n + 1e-6 for e, n in errs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["tails", "gqa, bool mask", "mqa, causal, float mask, spare column"])
def test_16_bit_inputs_are_read_as_the_float32_values_they_are(shape, dtype, monkeypatch):
    """The kernel reads bfloat16 and float16 q, k, v, out and dO without a float32 copy: the same bits
    as on those copies, in gradients and in the renormalisation's sums (bfloat16 on the FMA path; its
    AMX tile path sums the products otherwise: test_the_bfloat16_tile_path_*)."""
    monkeypatch.setattr(native, "backward_amx", False)
    B, Hq, Hkv, L, S, W, causal, mk = SHAPES[shape]
    q, k, v, do, mask = _case(B, Hq, Hkv, L, S, W, causal, mk, std=2.0)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    out, lse, _ = _op_grads(q.float(), k.float(), v.float(), do.float(), causal, mask, 0.2)
    out = out.to(dtype)
    low = native.backward(do, q, k, v, out, lse, causal, mask, 0.2)
    wide = native.backward(do.float(), q.float(), k.float(), v.float(), out.float(), lse, causal, mask, 0.2)
    for a, b in zip(low, wide):
        assert torch.equal(a, b)
    assert torch.equal(native.backward_sums(do, q, k, v, lse, causal, mask, 0.2),
                       native.backward_sums(do.float(), q.float(), k.float(), v.float(), lse, causal, mask, 0.2))


@pytest.mark.parametrize("seed", [0, 1, 4])
def test_a_peaked_bfloat16_row_keeps_its_gradient(seed):
    """3 bfloat16 rows over 6 keys at scale 2 (a README known limit: dq 4-8x the naive error, up to 200x
    in a fuzz; 9 of 40 seeds past the rule): the fused op took each row's delta from the bfloat16 out, and
    a row one key dominates lost its gradient to the cancellation. The kernel's renormalised
    delta = sum P dP / sum P is the naive backward's."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).bfloat16() for n in (3, 6, 6))
    torch.manual_seed(seed)
    assert_backward_by_rule(q, k, v, scale=2.0, backend=kf.Backend.CPU)


_AMX = pytest.mark.skipif(not native.backward_amx_available(), reason="no AMX-BF16 build or tile registers here")
#: the tile path's own tails: rows past 64 (its row tiles) and 32 (its row pairs' steps), keys past 32
#: and 64, head sizes that are not a multiple of 32 (the head-dimension chunks) or of 16, an odd number
#: of 16-column tiles, one key, one row, and what SHAPES covers
AMX_SHAPES = {**SHAPES,
              "one row, one key": (1, 1, 1, 1, 1, 16, False, None),
              "rows 65, keys 40, head 48": (1, 2, 1, 65, 40, 48, False, None),
              "rows 130, keys 131, head 80, causal": (1, 2, 2, 130, 131, 80, True, None),
              "rows 17, keys 33, head 2": (2, 2, 2, 17, 33, 2, False, "bool"),
              "head 112, float mask": (1, 4, 2, 96, 200, 112, False, "float")}


@_AMX
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", sorted(AMX_SHAPES))
def test_the_bfloat16_tile_path_gives_the_fma_paths_gradients(shape, threads):
    """bfloat16 products on AMX tiles (scores and dP of the inputs as they are, dV, dK and dQ of P and dS as
    two bfloat16 terms each): the FMA path's float32 gradients and sums to 2^-15 of each tensor's
    largest value, on every tail of the tile path's 64 rows, 64 keys and 32-wide head chunks."""
    B, Hq, Hkv, L, S, W, causal, mk = AMX_SHAPES[shape]
    q, k, v, do, mask = _case(B, Hq, Hkv, L, S, W, causal, mk, std=2.0)
    q, k, v, do = (t.bfloat16() for t in (q, k, v, do))
    out, lse, _ = _op_grads(q.float(), k.float(), v.float(), do.float(), causal, mask, 0.2)
    out = out.bfloat16()
    before, calls = torch.get_num_threads(), native.backward_amx_calls
    torch.set_num_threads(threads)
    try:
        tiles = native.backward(do, q, k, v, out, lse, causal, mask, 0.2)
        sums = native.backward_sums(do, q, k, v, lse, causal, mask, 0.2)
        assert native.backward_amx_calls == calls + 2, "both calls ran on the tiles"
        native.backward_amx = False
        fma = native.backward(do, q, k, v, out, lse, causal, mask, 0.2)
        fma_sums = native.backward_sums(do, q, k, v, lse, causal, mask, 0.2)
    finally:
        native.backward_amx = True
        torch.set_num_threads(before)
    for name, a, b in zip(("dq", "dk", "dv"), tiles, fma):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, rtol=0, atol=2 ** -15 * b.abs().max().item() + 1e-30, msg=f"{name} of {shape}")
    torch.testing.assert_close(sums, fma_sums, rtol=1e-5, atol=1e-6 * fma_sums.abs().max().item())


@_AMX
@pytest.mark.parametrize("heads", [1, 3, 5], ids=lambda h: f"{h} items")
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_the_bfloat16_tile_path_gives_the_same_bits_at_any_thread_count(heads, causal):
    """The tile path shares work as the FMA path does (whole items, or two fixed halves of each key
    block's rows): the same gradients run to run and at 1, 2 or 3 threads."""
    q, k, v, do, _ = _case(1, heads, heads, 300, 300, 64, causal, None)
    q, k, v, do = (t.bfloat16() for t in (q, k, v, do))
    out, lse, _ = _op_grads(q.float(), k.float(), v.float(), do.float(), causal, None, 0.125)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 2, 3):
            torch.set_num_threads(threads)
            runs.append(native.backward(do, q, k, v, out.bfloat16(), lse, causal, None, 0.125))
    finally:
        torch.set_num_threads(before)
    for got in runs[1:]:
        for a, b in zip(got, runs[0]):
            assert torch.equal(a, b)


@_AMX
def test_the_bfloat16_tile_path_lets_nan_reach_the_gradients_and_hidden_rows_stay_zero():
    """As on the FMA path: a row a mask hides has zero gradients, a NaN in q reaches its row (and the
    keys it meets), never silently 0."""
    q, k, v, do, _ = _case(1, 2, 2, 70, 90, 64, False, None)
    q, k, v, do = (t.bfloat16() for t in (q, k, v, do))
    mask = torch.ones(70, 90, dtype=torch.bool)
    mask[7] = False
    out, lse, _ = _op_grads(q.float(), k.float(), v.float(), do.float(), False, mask, 0.125)
    lse = lse.clone()
    lse[:, :, 7] = 0.0
    dq, dk, dv = native.backward(do, q, k, v, out.bfloat16(), lse, False, mask, 0.125)
    assert (dq[:, :, 7] == 0).all() and dq.isfinite().all() and dk.isfinite().all()
    q[0, 1, 3, 5] = math.nan
    dq, dk, dv = native.backward(do, q, k, v, out.bfloat16(), lse, False, mask, 0.125)
    assert dq[0, 1, 3].isnan().all() and dv[0, 1].isnan().any()
    assert not dq[0, 0].isnan().any() and not dq[0, 1, 4].isnan().any()



@_AMX
def test_the_bfloat16_tile_path_keeps_an_infinite_ds_infinite(monkeypatch):
    """dP past float32's range makes dS infinite: its two bfloat16 terms are inf and 0 (inf - inf was NaN,
    a review's find), so dq and dk are infinite where the FMA path's are, not NaN."""
    q, k = torch.full((1, 1, 4, 2), 0.5).bfloat16(), torch.ones(1, 1, 4, 2).bfloat16()
    v = torch.zeros(1, 1, 4, 2)
    v[..., 0, 0] = 3e38
    v, do = v.bfloat16(), torch.full((1, 1, 4, 2), 4.0).bfloat16()
    lse, delta = torch.full((1, 1, 4), 0.5 + math.log(4)), torch.zeros(1, 1, 4)
    args = (do, q, k, v, torch.zeros_like(do), lse, False, None, 1.0)
    tiles = native.backward(*args, delta=delta)
    monkeypatch.setattr(native, "backward_amx", False)
    fma = native.backward(*args, delta=delta)
    for a, b in zip(tiles[:2], fma[:2]):
        assert b.isinf().any() and torch.equal(a.isinf(), b.isinf()) and not a.isnan().any()


@_AMX
@pytest.mark.parametrize("case", ["D 128 causal 300", "D 64 GQA window 200", "D 256 prefix 600"])
def test_bfloat16_training_on_the_tiles_holds_the_rule(case):
    """Through the CPU backend (forward on the prefill kernel, backward on the tile path): every
    gradient within 3x the naive bfloat16 error of the float64 reference."""
    B, Hq, Hkv, N, D, mask = {"D 128 causal 300": (1, 2, 2, 300, 128, kf.causal()),
                              "D 64 GQA window 200": (2, 4, 2, 200, 64, kf.causal() & kf.window(50)),
                              "D 256 prefix 600": (1, 2, 1, 600, 256, kf.prefix(40))}[case]
    q, k, v = seeded_qkv(3, B, Hq, Hkv, N, N, D, std=2.0, dtype=torch.bfloat16)
    calls = native.backward_amx_calls
    assert_backward_by_rule(q, k, v, mask=mask, backend=kf.Backend.CPU)
    assert native.backward_amx_calls > calls


@pytest.mark.parametrize("dtype, seed", [(torch.float32, 4), (torch.float32, 12), (torch.float32, 33),
                                         (torch.bfloat16, 4), (torch.bfloat16, 18)])
def test_a_row_one_key_dominates_gets_its_zero_ds_in_float64_sums(dtype, seed):
    """7 rows at head size 80, scale 1, score spread 6 (each row's softmax one key): a renormalised call of
    float64 sums (``wide``) took dP - delta against delta rounded to float32, so the dominant key's dS was
    an ulp of delta where the naive backward's is 0: dq 2.5-5x the naive float32 error (3 of 40 seeds;
    bfloat16 2 of 40). delta now reaches the kernel in two parts (``delta_lo``)."""
    q, k, v = seeded_qkv(seed, 1, 1, 1, 7, 7, 80, std=6.0, dtype=dtype)
    assert_backward_by_rule(q, k, v, scale=1.0, backend=kf.Backend.CPU)


@pytest.mark.parametrize("case", ["3 rows over 31 keys, ALiBi, lse gradient", "3 rows over 90 keys, scale 1"])
def test_three_rows_of_a_gqa_group_sum_in_float64(case):
    """Up to 3 rows a head, torch's matmul (the naive attention) sums each score in vectors, more exactly
    than one FMA a dimension; the renormalised backward sums in float64 there (``cpu.WIDE_ROWS``), but
    counted the rows per kv head: 3 rows of a GQA group of 4 (12) took float32 sums, dq 5.8x and dv 16x
    the naive float32 error (2 of 1,000 fuzz cases). Now counted per query head."""
    seed, Nk, D, std, lse_grad, kw = {
        "3 rows over 31 keys, ALiBi, lse gradient":
            (603, 31, 96, 0.5, True, dict(mask=kf.causal(), score=kf.alibi(kf.alibi_slopes(4)), q_offset=28, scale=2.0)),
        "3 rows over 90 keys, scale 1": (994, 90, 80, 3.0, False, dict(scale=1.0)),
    }[case]
    q, k, v = seeded_qkv(seed, 1, 4, 1, 3, Nk, D, std=std)
    assert_backward_by_rule(q, k, v, lse_grad=lse_grad, backend=kf.Backend.CPU, **kw)
