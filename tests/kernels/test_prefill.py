"""keyfold's prefill kernel (keyfold/kernels/prefill.c, native.prefill), bfloat16 on AMX tiles and
float32 on AVX-512 or AVX2 FMAs: every variant held to the rule against float64 through ``attention``, the
pieces of a row merged inside the kernel's softmax exactly as a whole, hidden and NaN rows right, and
routed only where it runs. Every test runs once per dtype (skipped where the build lacks it)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keyfold as kf
from keyfold.kernels import cpu, native
from tests.helpers import (assert_backward_by_rule, assert_close_by_rule, assert_forward_by_rule,
                           assert_runs_on_a_small_stack, naive_attention)

BF16, F32 = torch.bfloat16, torch.float32
pytestmark = pytest.mark.parametrize("dt", [
    pytest.param(BF16, id="bf16", marks=pytest.mark.skipif(
        not native.prefill_available(BF16), reason=f"bfloat16 prefill needs AMX-BF16 and a native build ({native.why()})")),
    pytest.param(F32, id="f32", marks=pytest.mark.skipif(
        not native.prefill_available(F32), reason=f"float32 prefill needs AVX-512 or AVX2 and a native build ({native.why()})")),
])


#: lse's absolute tolerance per dtype. float32: P's 2^x is a degree-5 polynomial (relative error below
#: 1e-7). bfloat16: a degree-3 one (below 9e-5), as P is rounded to bfloat16 (a relative step of 2^-8)
#: before its product with V; the row sum's relative error is a weighted mean of those errors, so lse is off
#: by less than 9e-5, over 40x below bfloat16's rounding step (the rule's naive bfloat16 scores alone are off by
#: |score| 2^-9).
LSE_ATOL = {F32: 2e-5, BF16: 1e-4}


def assert_lse_close(lse, ref, dt):
    torch.testing.assert_close(lse.double(), ref.double(), atol=LSE_ATOL[dt], rtol=2e-6)


@pytest.fixture(autouse=True)
def _small_problems_run_on_the_kernel(monkeypatch):
    """The kernel takes calls from PREFILL_MIN_ROWS rows per key/value head (512): the cases here are
    smaller, so the threshold drops to the decoding step's for them (test_routing checks it); and on AVX2
    the kernel takes head sizes past 192 and calls of few keys here too, which route to the op there
    (test_float32_forwards_the_naive_gemm_sums_more_exactly_stay_on_the_op in tests/core checks that)."""
    monkeypatch.setattr(cpu, "PREFILL_MIN_ROWS", cpu.NATIVE_ROWS + 1)
    monkeypatch.setattr(cpu, "PREFILL_KEYS_PER_ROW", 1 << 30)
    monkeypatch.setattr(cpu, "PREFILL_AVX2_MAX_HEAD", native.PREFILL_MAX_HEAD)
    monkeypatch.setattr(cpu, "PREFILL_AVX2_MIN_KEYS", 1)


def _qkv(B=1, H=2, N=300, D=64, Hkv=None, Nk=None, Dv=None, seed=0, dt=BF16):
    g = torch.Generator().manual_seed(seed)
    Hkv, Nk, Dv = Hkv or H, Nk or N, Dv or D
    return (torch.randn(B, H, N, D, generator=g).to(dt), torch.randn(B, Hkv, Nk, D, generator=g).to(dt),
            torch.randn(B, Hkv, Nk, Dv, generator=g).to(dt))


def _ran(fn):
    """Run fn; assert that it went through the prefill kernel."""
    before = native.prefill_calls
    got = fn()
    assert native.prefill_calls > before, "the prefill kernel did not run"
    return got


def _doc_mask(b, h, q, k):
    return (q // 100 == k // 100) & (k <= q)


VARIANTS = {  # name: attention keywords
    "dense": {},
    "full": dict(mask=kf.full()),
    "causal": dict(mask=kf.causal()),
    "window": dict(mask=kf.causal() & kf.window(40)),
    "window+sinks": dict(mask=kf.causal() & (kf.window(40) | kf.sinks(4))),
    "prefix-lm": dict(mask=kf.causal() | kf.prefix(70)),
    "documents": dict(mask=kf.documents(torch.arange(300) // 90) & kf.causal()),
    "alibi+causal": dict(mask=kf.causal(), score=kf.alibi(kf.alibi_slopes(2))),
    "softcap": dict(mask=kf.causal(), score=kf.softcap(5.0)),
    "callable": dict(mask=_doc_mask),
}


@pytest.mark.parametrize("block", [None, 48])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_holds_the_rule_on_the_prefill_kernel(name, block, dt):
    """Each variant of the tour in bfloat16 through ``attention``: the kernel ran, out holds the rule
    against float64, rows that see no key are exactly 0 (assert_forward_by_rule). block 48: pieces
    that do not fall on the kernel's 32-row and 32-key blocks."""
    q, k, v = _qkv(dt=dt)
    _ran(lambda: assert_forward_by_rule(q, k, v, block_size=block, **VARIANTS[name]))


@pytest.mark.parametrize("name", ["dense", "full", "window+sinks", "documents", "alibi+causal", "softcap"])
def test_gradients_hold_the_rule_after_the_prefill_forward(name, dt):
    """The backward (the fused op's, or the tile kernel's for a softcap) reads the kernel's out and lse."""
    q, k, v = _qkv(N=160, dt=dt)
    kw = dict(VARIANTS[name])
    if name == "documents":
        kw["mask"] = kf.documents(torch.arange(160) // 50) & kf.causal()
    _ran(lambda: assert_backward_by_rule(q, k, v, **kw))


SHAPES = {  # B, Hq, Hkv, Nq, Nk, D, Dv
    "gqa": (2, 8, 2, 100, 100, 64, 64),
    "mqa": (1, 4, 1, 70, 130, 32, 32),
    "D 128": (1, 2, 2, 96, 96, 128, 128),
    "D 256, Dv 200": (1, 2, 2, 40, 70, 256, 200),
    "D 40, Dv 24": (1, 2, 2, 50, 90, 40, 24),
    "5 rows": (1, 1, 1, 5, 300, 64, 64),
    "more queries than keys": (1, 2, 2, 200, 50, 64, 64),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mask", [None, "causal", "window"])
def test_shapes_hold_the_rule(shape, mask, dt, monkeypatch):
    """float32 calls with no mask at head sizes over 64 go to the fused op by default (faster there);
    here they run on the kernel too."""
    monkeypatch.setattr(cpu, "PREFILL_F32_DENSE_MAX_HEAD", native.PREFILL_MAX_HEAD)
    B, Hq, Hkv, Nq, Nk, D, Dv = SHAPES[shape]
    q, k, v = _qkv(B, Hq, Nq, D, Hkv=Hkv, Nk=Nk, Dv=Dv, dt=dt)
    m = {None: None, "causal": kf.causal(), "window": kf.causal() & kf.window(17)}[mask]
    _ran(lambda: assert_forward_by_rule(q, k, v, mask=m, q_offset=max(Nk - Nq, 0)))


def test_views_with_strided_rows_hold_the_rule(dt):
    """q, k, v viewed from (B, N, H, D) tensors, as a model's projections come."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 150, 4, 64, generator=g).to(dt).transpose(1, 2) for _ in range(3))
    _ran(lambda: assert_forward_by_rule(q, k, v, mask=kf.causal()))


@pytest.mark.parametrize("case", ["fuzz 5738", "integer scores"])
@pytest.mark.parametrize("scale", [None, 0.3, 1 / 3])
def test_a_scale_that_is_not_a_power_of_two_is_applied_to_the_scores(case, scale, dt, monkeypatch):
    """y = S scale rounded once, as the naive implementation rounds it. float32 once multiplied q by
    the scale as it copied q: a rounding of every q element the naive scores never have, 2.1x the
    naive error on a fuzz case (head size 80, scores x10, a window: at the rule's edge here) and 7.8x
    on integer scores, which the naive product gets exactly (those fail on the code before). A
    power-of-two scale still pre-scales q (exact)."""
    monkeypatch.setattr(cpu, "PREFILL_F32_DENSE_MAX_HEAD", native.PREFILL_MAX_HEAD)
    g = torch.Generator().manual_seed(5738)
    if case == "fuzz 5738":  # the random case that found it: 533 rows, head size 80, q x10, a window
        q, k, v = (torch.randn(1, 2, 533, 80, generator=g) for _ in range(3))
        q, mask = q * 10, kf.window(100)
    else:  # small integers: every S exact in float32, so only the scale's rounding is left
        q, k = (torch.randint(-4, 5, (1, 2, 300, 80), generator=g).float() for _ in range(2))
        v, mask = torch.randn(1, 2, 300, 80, generator=g), kf.causal()
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    _ran(lambda: assert_forward_by_rule(q, k, v, mask=mask, scale=scale))


@pytest.mark.parametrize("shape", [(300, 300), (1, 300), (300, 1), (1, 2, 300, 300), (2, 1, 1, 300)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_tensor_masks_hold_the_rule(kind, shape, dt):
    """SDPA's attn_mask, bool or additive, in every broadcast shape: a mask over keys only, over rows
    only (a bias broadcast over the keys reaches the kernel expanded), per head, per batch entry."""
    q, k, v = _qkv(B=2, dt=dt)
    g = torch.Generator().manual_seed(len(shape))
    mask = torch.rand(shape, generator=g) < 0.3 if kind == "bool" else torch.randn(shape, generator=g)
    out = _ran(lambda: kf.attention(q, k, v, mask=mask))
    ref = kf.attention(q.double(), k.double(), v.double(), mask=mask if kind == "bool" else mask.double(),
                       backend=kf.Backend.REFERENCE)
    bias = mask.to(dt) if kind == "float" else torch.zeros(shape, dtype=dt).masked_fill(~mask, -math.inf)
    naive = torch.softmax((q @ k.transpose(-1, -2) * 64 ** -0.5 + bias).float(), -1).to(dt) @ v
    seen = torch.isfinite(torch.broadcast_to(bias, (2, 2, 300, 300)).float()).any(-1)
    assert bool((out[~seen] == 0).all())
    assert_close_by_rule(out, ref, naive.nan_to_num(0.0), seen)


def test_lse_is_the_natural_log_of_the_row_sum(dt):
    q, k, v = _qkv(N=200, dt=dt)
    out, lse = _ran(lambda: kf.attention(q, k, v, mask=kf.causal() & kf.window(50), return_lse=True))
    ref = kf.attend(q.double(), k.double(), v.double(), mask=kf.causal() & kf.window(50), backend=kf.Backend.REFERENCE)
    assert_lse_close(lse, ref.lse, dt)


def _run(q, k, v, pieces, cap=0.0):
    rows = [native.piece_row(*p) for p in pieces]
    return native.prefill(q, k, v, q.shape[-1] ** -0.5, rows, cap=cap)


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(1, 299), max_size=6, unique=True), rows=st.integers(1, 120),
       seed=st.integers(0, 2 ** 16))
def test_any_partition_of_the_keys_is_the_whole(cuts, rows, seed, dt):
    """The pieces of a row are merged inside the kernel's softmax: any split of the keys into pieces,
    in any order, gives the state of one piece over them all, to rounding (P is rounded to bfloat16
    against a running max that depends on the order, so not bit for bit; float32 to its rounding)."""
    q, k, v = _qkv(N=rows, Nk=300, seed=seed, dt=dt)
    whole = _run(q, k, v, [(0, rows, 0, 300, False)])
    bounds = [0, *sorted(cuts), 300]
    parts = [(0, rows, a, b, False) for a, b in zip(bounds, bounds[1:])][::-1]
    split = _run(q, k, v, parts)
    torch.testing.assert_close(split[0], whole[0], atol=1e-2 if dt is BF16 else 2e-6, rtol=0)
    # bfloat16: each off by the polynomial in its own way
    torch.testing.assert_close(split[1], whole[1], atol=1e-5 if dt is F32 else LSE_ATOL[BF16], rtol=1e-6)


def test_pieces_of_rows_rows_outside_every_piece_and_a_separable_shift(dt):
    """Pieces cover some rows only; a row no piece covers is 0 with lse -inf; a piece's mask hides a
    whole row of it; a row shift (a separable bias's row term) adds to every score of its row."""
    q, k, v = _qkv(N=100, Nk=90, dt=dt)
    g = torch.Generator().manual_seed(5)
    mask = torch.where(torch.rand(1, 2, 50, 60, generator=g) < 0.5, torch.randn(1, 2, 50, 60, generator=g),
                       torch.tensor(-math.inf))
    mask[:, :, 7] = -math.inf
    shift = torch.randn(1, 2, 50, generator=g) * 3
    out, lse = _run(q, k, v, [(10, 60, 30, 90, False, mask, shift), (60, 80, 0, 20, True)])
    bias = torch.full((1, 2, 100, 90), -math.inf, dtype=torch.float64)
    bias[:, :, 10:60, 30:90] = mask.double() + shift.double()[..., None]
    bias[:, :, 60:80, 0:20] = torch.zeros(20, 20).masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), -math.inf)
    seen = _assert_by_rule_with_bias(out, lse, q, k, v, bias, dt)
    assert seen.sum() > 0 and (~seen).sum() > 0


def _assert_by_rule_with_bias(out, lse, q, k, v, bias, dt):
    """out and lse of the kernel against float64 attention under an additive float64 ``bias`` (-inf
    hides a pair), by the rule; rows that see no key 0 and -inf. Returns the rows that see a key."""
    s = q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5 + bias
    ref_lse = torch.logsumexp(s, -1)
    ref = torch.softmax(s, -1).nan_to_num(0.0) @ v.double()
    seen = torch.isfinite(ref_lse)
    assert bool((out[~seen] == 0).all()) and bool((lse[~seen] == -math.inf).all())
    naive = (torch.softmax((q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + bias.to(dt)).float(), -1).to(dt) @ v
             ).nan_to_num(0.0)
    assert_close_by_rule(out, ref, naive, seen)
    assert_lse_close(lse[seen], ref_lse[seen], dt)
    return seen


@settings(max_examples=30, deadline=None)
@given(q0=st.integers(0, 80), rows=st.integers(1, 420), k0=st.integers(0, 300), keys=st.integers(1, 700),
       causal=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_one_piece_anywhere_holds_the_rule(q0, rows, k0, keys, causal, seed, dt):
    """One piece of rows [q0, q0 + rows) over keys [k0, k0 + keys), causal or not, placed anywhere: a
    32-row block partly outside it, a diagonal that leads or lags the blocks and the 256-key steps
    (the one-pass softmax then meets rows that see no key of a step, and rows whose last keys end
    inside a sub-block), and each row's first step seeded with the max of its first 32 keys (a
    later key above it by more than 2^8 redoes the row). Rows outside the piece are 0 and -inf."""
    L, S = q0 + rows + 5, k0 + keys + 3
    q, k, v = _qkv(N=L, Nk=S, seed=seed, dt=dt)
    out, lse = _run(q, k, v, [(q0, q0 + rows, k0, k0 + keys, causal)])
    bias = torch.full((L, S), -math.inf, dtype=torch.float64)
    seen = torch.zeros(rows, keys, dtype=torch.bool)
    seen[:] = True
    if causal:  # row q0 + t sees keys k0 .. k0 + t
        seen = torch.ones(rows, keys, dtype=torch.bool).tril()
    bias[q0:q0 + rows, k0:k0 + keys] = torch.zeros(rows, keys, dtype=torch.float64).masked_fill(~seen, -math.inf)
    _assert_by_rule_with_bias(out, lse, q, k, v, bias, dt)


def test_a_diagonal_that_lags_its_rows_leaves_some_rows_nothing_in_a_step(dt):
    """A causal piece whose keys lag its rows by 20 (row 20 + t sees keys 0 .. t): in the step of keys
    256-511, rows 256-275 of the block from 256 see none of its keys, the rest some; with a key at 270
    that every row able to see it scores far above the others (P would overflow against the running
    max). Held to the rule; the rows that see key 270 get its value."""
    q, k, v = _qkv(N=320, Nk=300, seed=3, dt=dt)
    q = torch.ones_like(q)
    k = k.clone()
    k[:, :, 270] = 32.0  # score 2560 / 8 = 320 against N(0, 1)
    out, lse = _run(q, k, v, [(20, 320, 0, 300, True)])
    bias = torch.full((320, 300), -math.inf, dtype=torch.float64)
    bias[20:320, 0:300] = torch.zeros(300, 300, dtype=torch.float64).masked_fill(
        torch.ones(300, 300, dtype=torch.bool).triu(1), -math.inf)
    _assert_by_rule_with_bias(out, lse, q, k, v, bias, dt)
    assert torch.equal(out[:, :, 290:], v[:, :, 270:271].float().expand(-1, -1, 30, -1))


@pytest.mark.parametrize("bad", ["nan q", "inf k"])
def test_a_nan_or_infinite_score_reaches_its_row(bad, dt):
    """As in PyTorch's op: the row whose score is NaN (or +inf) is NaN in out and lse; other rows
    are untouched."""
    q, k, v = _qkv(N=64, dt=dt)
    clean = _run(q, k, v, [(0, 64, 0, 64, False)])
    q, k = q.clone(), k.clone()
    if bad == "nan q":
        q[0, 1, 9, 3] = float("nan")
        rows = [(1, 9)]
    else:
        k[0, 0, 40] = float("inf")  # +inf or -inf scores, depending on q's signs: NaN rows either way
        rows = [(0, r) for r in range(64)]
    out, lse = _run(q, k, v, [(0, 64, 0, 64, False)])
    for h, r in rows:
        assert torch.isnan(out[0, h, r]).all() and torch.isnan(lse[0, h, r])
    other = 1 - rows[0][0]
    if bad == "nan q":
        assert torch.equal(out[0, other], clean[0][0, other])


@pytest.mark.parametrize("growth", ["flat", "rising", "steep", "late spikes"])
def test_scores_that_rise_step_after_step_hold_the_rule(growth, dt):
    """The one-pass softmax (softmax_stale, both dtypes) takes P against the running max as it stands
    and redoes only the rows whose scores rise more than 2^8 above it. Keys whose scores grow from step
    to step, slowly (most rows stay under the threshold), steeply (every row goes over it, some more
    than once) or in a spike at one late key per row, hold the rule and lse's bound. Measured on
    mutants of the kernel: "steep" and "late spikes" fail one that never redoes a row (P overflows),
    "rising", "steep" and "late spikes" one that forgets a redone row's alpha (O not rescaled); "flat"
    checks the one pass itself."""
    q, k, v = _qkv(N=96, Nk=1300, D=64, dt=dt)
    k = k.float()
    steps = torch.arange(1300) // 256
    if growth == "rising":  # keys 1.3x, 1.6x, ... the first step's: rows with a large q go over 2^8
        k = k * (1.0 + 0.3 * steps)[:, None]
    elif growth == "steep":  # 4x a step: a row's max rises by tens of nats, over the threshold
        k = k * (4.0 ** steps)[:, None]
    elif growth == "late spikes":  # row r's score at key 300 + 9 r is 6 (row 0) to 150 nats above the rest
        for r in range(96):
            k[:, :, 300 + 9 * r] = q[:, :, r].float() * (6.0 + 1.5 * r) / 8.0
    k = k.to(dt)
    out, lse = _run(q, k, v, [(0, 96, 0, 1300, False)])
    ref = kf.attend(q.double(), k.double(), v.double(), backend=kf.Backend.REFERENCE)
    naive = naive_attention(q, k, v)
    assert_close_by_rule(out.to(dt), ref.out, naive, torch.ones(1, 2, 96, dtype=torch.bool))
    assert_lse_close(lse, ref.lse, dt)


@pytest.mark.parametrize("bad", ["nan k", "inf k"])
def test_a_nan_or_infinite_score_in_a_later_step_reaches_its_row(bad, dt):
    """As test_a_nan_or_infinite_score_reaches_its_row, with the bad key in the third step of 256, where
    the kernel takes its one-pass softmax: a NaN score makes its rows NaN, a +inf score (inf - inf in the
    softmax) too, and a -inf score is a weight of 0, as in PyTorch's op."""
    q, k, v = _qkv(N=64, Nk=800, dt=dt)
    k = k.clone()
    k[0, 0, 600, 0] = float("nan") if bad == "nan k" else float("inf")  # score q[..., 0] x (nan | inf)
    out, lse = _run(q, k, v, [(0, 64, 0, 800, False)])
    ref = kf.attend(q.double(), k.double(), v.double(), backend=kf.Backend.REFERENCE)
    want_nan = torch.isnan(ref.lse)
    assert not want_nan[0, 1].any()  # the other head never reads the key
    if bad == "nan k":  # every row of head 0 sees the NaN key
        assert want_nan[0, 0].all()
    else:  # q[..., 0] > 0: +inf, a NaN row; q[..., 0] < 0: -inf, a weight of 0
        assert 5 < int(want_nan[0, 0].sum()) < 59
    assert torch.equal(torch.isnan(lse), want_nan) and bool(torch.isnan(out[want_nan]).all())
    fine = ~want_nan
    naive = naive_attention(q, k, v)
    assert_close_by_rule(out.to(dt), ref.out, naive, fine)
    assert_lse_close(lse[fine], ref.lse[fine], dt)


def _spiked(dt, where, value, Nk=400):
    """Rows whose scores (S = q.k, before the scale) are value at the keys in ``where`` and about
    1e19 times N(0, 1) elsewhere: q is 1e19 in its first dimension, 0 in the rest."""
    q, k, v = _qkv(N=8, Nk=Nk, D=64, dt=dt)
    q = torch.zeros_like(q)
    q[..., 0] = 1e19
    k = k.clone()
    for j in where:
        k[:, :, j, 0] = value / 1e19
    return q, k, v


def test_scores_near_the_float32_limit_keep_every_key(dt):
    """Two keys that score 2.5e38 (scale 1) share the rows' weight, one in the first step and one in
    the second. m log2 e overflows past 2.36e38, so the one-pass softmax leaves such a row to the
    general one (base e); a one pass that kept it gave every P after the first step 0, the first
    key's value alone (float32 and bfloat16 alike)."""
    q, k, v = _spiked(dt, [0, 300], 2.5e38)
    out, lse = native.prefill(q, k, v, 1.0, [native.piece_row(0, 8, 0, 400, False)])
    want = (v[:, :, 0].float() + v[:, :, 300].float()) / 2
    torch.testing.assert_close(out, want[:, :, None].expand_as(out), atol=1e-2 if dt is BF16 else 1e-6, rtol=0)
    assert bool(torch.isfinite(lse).all()) and bool((lse > 2.4e38).all())


def test_scores_further_apart_than_float32s_range_take_the_largest(dt):
    """Every key scores -1e38 but key 100, 2e38 (scale 1): y - m against the first step's seed is
    3e38, 4.3e38 in log2 units, past float32's range: 2^x is +inf (vreduceps gives 0 for +inf,
    vscalefps 2^+inf), which sends the row to its redo against its own max: out is key 100's value
    exactly and lse 2e38."""
    q, k, v = _spiked(dt, [], 0.0)
    k[:, :, :, 0] = -1e19
    k[:, :, 100, 0] = 2e19
    out, lse = native.prefill(q, k, v, 1.0, [native.piece_row(0, 8, 0, 400, False)])
    assert torch.equal(out, v[:, :, 100:101].float().expand_as(out))
    s = (q[0, 0, 0, 0].double() * k[0, 0, 100, 0].double()).item()
    torch.testing.assert_close(lse.double(), torch.full(lse.shape, s, dtype=torch.double), rtol=1e-6, atol=0)


@pytest.mark.parametrize("where", [5, 100])
def test_a_score_whose_scaled_value_overflows_makes_its_row_nan(where, dt):
    """S = 2e38 is finite, y = S scale with scale 3 is not: the row is NaN (out and lse), as in
    PyTorch's op and the kernel's general softmax, whether the key is among the first 32 a row's
    first step is seeded with (5) or past them (100). A first one pass redid the row against y =
    +inf and gave lse +inf beside a finite out."""
    q, k, v = _spiked(dt, [where], 2e38, Nk=200)  # one step: no later step to turn the row NaN
    out, lse = native.prefill(q, k, v, 3.0, [native.piece_row(0, 8, 0, 200, False)])
    assert bool(torch.isnan(lse).all()) and bool(torch.isnan(out).all())


@pytest.mark.parametrize("score", [None, "softcap", "alibi"])
def test_a_row_with_one_key_gets_its_value_exactly(score, dt):
    """Its P is 1 exactly (the row's largest score minus the max is exactly 0, and 2^0 = 1 in the
    kernel's polynomial), so out is the key's value, as a convex combination of one value must be. A
    first version fused the scaling into the subtraction and gave v (1 + 2e-7)."""
    q, k, v = _qkv(N=5, Nk=1, dt=dt)
    sc = {None: None, "softcap": kf.softcap(3.0), "alibi": kf.alibi(kf.alibi_slopes(2))}[score]
    st = _ran(lambda: kf.attend(q, k, v, mask=kf.causal(), q_offset=0, score=sc))
    assert torch.equal(st.out, v.float().expand_as(st.out))


@pytest.mark.parametrize("where", [7, 100, 280, 400])
def test_a_row_that_one_key_dominates_gets_its_value_exactly(where, dt):
    """The same for rows that see whole steps of keys (the kernel's plain softmax: bfloat16 keeps S and
    scales it in the second pass): every other key's P underflows to 0 and the dominant one's is 1, so
    out is its value exactly, whether its step comes first or after others (7: in the first 32 keys,
    the seed of the first step; 100: past them, so that step's one pass redoes the row; 280: a
    step of 44 keys; 400: a whole later step, where the one pass redoes the row against its new max). A first
    version of that pass fused the scale into the subtraction and gave v (1 - 2e-7)."""
    nk = 300 if where < 300 else 600
    q, k, v = _qkv(N=64, Nk=nk, D=80, dt=dt)  # a scale of 80^-0.5: S scale is not exact
    q = torch.ones_like(q)
    k[:, :, where] = 32.0  # score 2560 / 80^0.5 = 286.2 against N(0, 1): e^-280 underflows
    out, lse = _run(q, k, v, [(0, 64, 0, nk, False)])
    assert torch.equal(out, v[:, :, where:where + 1].float().expand_as(out))
    torch.testing.assert_close(lse.double(), torch.full(lse.shape, 2560 / 80 ** 0.5, dtype=torch.double))


def test_a_softcap_is_computed_in_the_tile(dt):
    """softcap in bfloat16 runs on the kernel (Backend.AUTO) and holds the rule; with its cap large
    it is the plain call."""
    q, k, v = _qkv(N=200, dt=dt)
    _ran(lambda: assert_forward_by_rule(q, k, v, mask=kf.causal() & kf.window(64), score=kf.softcap(2.0)))
    plain = _run(q, k, v, [(0, 200, 0, 200, True)])
    s = q.double() @ k.double().transpose(-1, -2) * 64 ** -0.5
    hide = torch.ones(200, 200, dtype=torch.bool).triu(1)
    for cap in (1e3, 1e6):  # tanh near 0 keeps its error relative to the score at any cap
        capped = _run(q, k, v, [(0, 200, 0, 200, True)], cap=cap)
        torch.testing.assert_close(capped[0], plain[0], atol=4e-3, rtol=0)
        ref = torch.logsumexp((cap * torch.tanh(s / cap)).masked_fill(hide, -math.inf), -1)
        assert_lse_close(capped[1], ref, dt)


def test_routing(dt):
    """The kernel takes bfloat16 and float32 calls (float16 widened where FP16_AS_FP32) with more rows
    than a decoding step; float64, a decoding step, odd head sizes in bfloat16, score callables,
    dropout and Backend.TILES stay where they were, and so does float32 with no mask at head sizes
    over PREFILL_F32_DENSE_MAX_HEAD on AVX-512 (the fused op is faster there; on AVX2 the kernel)."""
    q, k, v = _qkv(N=64, dt=dt)
    pb = kf.kernels._common.Problem(None, None, 0.125, 0, 0)
    assert cpu._prefill_may(q, k, v, pb)
    assert not cpu._prefill_may(q.double(), k.double(), v.double(), pb)
    assert cpu._prefill_may(q.half(), k.half(), v.half(), pb) == (cpu.FP16_AS_FP32 and native.prefill_available(F32))
    assert not cpu._prefill_may(q[:, :, :cpu.NATIVE_ROWS], k, v, pb)
    odd = cpu._prefill_may(q[..., :63], k[..., :63], v, pb)
    assert odd == (dt is F32) and (native.prefill_takes(q[..., :63], k[..., :63], v) is None) == (dt is F32)
    wide = torch.cat([q, q], -1), torch.cat([k, k], -1), torch.cat([v, v], -1)  # head size 128
    assert cpu._prefill_may(*wide, pb, True, True) == (dt is BF16 or native.isa() == "avx2")
    assert cpu._prefill_may(*wide, pb, True, False)  # causal: the kernel
    fn = kf.scores.score_fn(lambda s, b, h, qp, kp: s * 0.5)
    assert not cpu._prefill_may(q, k, v, kf.kernels._common.Problem(None, fn, 0.125, 0, 0))
    assert not cpu._prefill_may(q, k, v, kf.kernels._common.Problem(None, None, 0.125, 0, 0, dropout_p=0.1))
    before = native.prefill_calls
    kf.attention(q, k, v, score=kf.softcap(3.0), backend=kf.Backend.TILES)
    kf.attention(q, k, v, score=lambda s, b, h, qp, kp: s * 0.5)
    assert native.prefill_calls == before


def test_few_rows_over_many_keys_stay_on_the_op(dt, monkeypatch):
    """The kernel packs what its pieces read once per call: below PREFILL_MIN_ROWS rows per key/value
    head, or (a plan of full and causal pieces) below the keys over PREFILL_KEYS_PER_ROW, the op runs
    the call (a first version took every call over a decoding step's rows, up to 120x slower with 16
    rows over 32k keys and a window mask; found measuring)."""
    monkeypatch.setattr(cpu, "PREFILL_MIN_ROWS", 512)
    monkeypatch.setattr(cpu, "PREFILL_KEYS_PER_ROW", 8)
    pb = kf.kernels._common.Problem(None, None, 0.125, 0, 0)
    k = torch.zeros(1, 2, 8192, 64, dtype=dt)
    assert not cpu._prefill_may(torch.zeros(1, 2, 511, 64, dtype=dt), k, k, pb)
    assert cpu._prefill_may(torch.zeros(1, 2, 512, 64, dtype=dt), k, k, pb)
    assert cpu._prefill_may(torch.zeros(1, 8, 64, 64, dtype=dt), k[:, :1], k[:, :1], pb)  # a GQA group of 8
    assert not cpu._prefill_may(torch.zeros(1, 2, 512, 64, dtype=dt), k, k, pb, True)  # plain: 8192 / 8 rows
    assert cpu._prefill_may(torch.zeros(1, 2, 1024, 64, dtype=dt), k, k, pb, True)
    q, kk, v = _qkv(N=16, Nk=4096, dt=dt)
    before = native.prefill_calls
    assert_forward_by_rule(q, kk, v, mask=kf.causal() & kf.window(256), q_offset=4096 - 16)
    assert native.prefill_calls == before


def test_refuses_what_it_cannot_take(dt):
    q, k, v = _qkv(N=32, dt=dt)
    with pytest.raises(RuntimeError, match="bfloat16 or all float32"):
        native.prefill(q.double(), k.double(), v.double(), 0.1, [native.piece_row(0, 32, 0, 32, False)])
    with pytest.raises(RuntimeError, match="bfloat16 or all float32"):
        native.prefill(q, k.half(), v.half(), 0.1, [native.piece_row(0, 32, 0, 32, False)])
    with pytest.raises(RuntimeError, match="head sizes"):
        native.prefill(q, k, v.repeat(1, 1, 1, 5), 0.1, [native.piece_row(0, 32, 0, 32, False)])  # Dv 320
    if dt is BF16:
        with pytest.raises(RuntimeError, match="head sizes"):
            native.prefill(q[..., :63], k[..., :63], v, 0.1, [native.piece_row(0, 32, 0, 32, False)])
    else:
        with pytest.raises(ValueError, match="out_dtype"):
            native.prefill(q, k, v, 0.1, [native.piece_row(0, 32, 0, 32, False)], out_dtype=BF16)
    with pytest.raises(RuntimeError, match="refused"):  # a piece past the keys
        native.prefill(q, k, v, 0.1, [native.piece_row(0, 32, 0, 33, False)])


def test_a_mask_of_finfo_min_is_a_bias_not_an_overflow(dt):
    """Hugging Face fills masks with torch.finfo(dtype).min (-3.4e38), a finite bias: a row masked so
    everywhere sees its keys with lse near -3.4e38. Scaled to base 2 such a score overflowed to -inf in
    a first version, which gave that row 0 and lse -inf, silently (found in review)."""
    q, k, v = _qkv(N=64, Nk=100, dt=dt)
    m = torch.zeros(1, 1, 64, 100, dtype=dt)
    m[:, :, 5, :] = torch.finfo(dt).min  # every key of row 5
    m[:, :, 9, 40:] = torch.finfo(dt).min  # most keys of row 9
    out, lse = _ran(lambda: kf.attention(q, k, v, mask=m, return_lse=True))
    ref, ref_lse = kf.attention(q.double(), k.double(), v.double(), mask=m.double(), return_lse=True,
                                backend=kf.Backend.REFERENCE)
    naive = torch.softmax((q @ k.transpose(-1, -2) * 64 ** -0.5 + m).float(), -1).to(dt) @ v
    assert_close_by_rule(out, ref, naive, None)
    assert_lse_close(lse, ref_lse, dt)


def test_a_row_only_mask_is_a_row_shift_not_an_expanded_tile(dt):
    """A mask the same for every key ((B, H, L, 1): a bias or bool per row) reaches the kernel as a row
    shift: nothing of size L x S is built (a first version expanded it, 4 bytes per pair), out is the
    unmasked out where the row is visible, lse moves by the bias, and a hidden row is 0 / -inf."""
    q, k, v = _qkv(N=100, Nk=120, dt=dt)
    seen = []
    real = native.prefill
    def spy(*a, **kw):
        seen.extend(a[4])
        return real(*a, **kw)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(1, 2, 100, 1, generator=g)
    bias[:, :, 3] = -math.inf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "prefill", spy)
        out, lse = _ran(lambda: kf.attention(q, k, v, mask=bias, return_lse=True))
    assert seen and all(row[5] == 0 and row[9] != 0 for row in seen)  # no mask tile; a row shift
    plain, plain_lse = kf.attention(q, k, v, mask=kf.full(), return_lse=True)
    rows = torch.ones(100, dtype=torch.bool)
    rows[3] = False
    if dt is BF16:  # the same softmax to P's rounding: the shifted rows take P against their max (two
        # passes), the plain ones against the max of their first 32 keys (one pass), so P's bfloat16
        # roundings differ; out within a few of bfloat16's steps (2^-8 relative)
        torch.testing.assert_close(out[:, :, rows].float(), plain[:, :, rows].float(), atol=2e-3, rtol=2 ** -7)
    else:
        torch.testing.assert_close(out[:, :, rows], plain[:, :, rows], atol=2e-6, rtol=0)
    if dt is BF16:  # each within lse's bound of float64's, the bias added (P's roundings differ, as above)
        ref = kf.attend(q.double(), k.double(), v.double(), backend=kf.Backend.REFERENCE)
        assert_lse_close(lse[:, :, rows], (ref.lse + bias[..., 0].double())[:, :, rows], dt)
    else:
        torch.testing.assert_close(lse[:, :, rows], (plain_lse + bias[..., 0])[:, :, rows], atol=1e-5, rtol=1e-6)
    assert bool((out[:, :, 3] == 0).all()) and bool((lse[:, :, 3] == -math.inf).all())


def test_an_empty_row_is_zero_even_beside_a_nan_value(dt):
    """A NaN in v reaches O through a 0 in P (0 x NaN in the tile product); a row that sees no key is
    still exactly 0 with lse -inf (found in review: it was NaN with lse -inf)."""
    q, k, v = _qkv(N=64, dt=dt)
    v = v.clone()
    v[0, 0, 10] = float("nan")
    m = torch.ones(64, 64, dtype=torch.bool)
    m[7] = False
    out, lse = _ran(lambda: kf.attention(q, k, v, mask=m, return_lse=True))
    assert bool((out[0, 0, 7] == 0).all()) and lse[0, 0, 7] == -math.inf
    assert bool(torch.isnan(out[0, 0, 0]).any())  # a row that sees the NaN value is NaN


@pytest.mark.parametrize("cap", [1e-30, 1e30])
def test_caps_beyond_float32_reach_stay_on_the_tile_kernel(cap, dt):
    """The kernel takes the cap as a float32 and divides by it under flush-to-zero: a cap of 1e-50
    arrived as 0 (no softcap) and one of 1e38 flushed s / cap to 0 (found in review). Such caps run on
    the tile kernel and hold the rule."""
    q, k, v = _qkv(N=64, dt=dt)
    assert not cpu._prefill_may(q, k, v, kf.kernels._common.Problem(None, kf.softcap(cap), 0.125, 0, 0))
    before = native.prefill_calls
    assert_forward_by_rule(q, k, v, mask=kf.causal(), score=kf.softcap(cap))
    assert native.prefill_calls == before


@pytest.mark.parametrize("kw", [{}, dict(mask=kf.causal()), dict(score=kf.softcap(5.0))])
def test_an_empty_batch_gives_an_empty_output(kw, dt):
    q, k, v = (t[:0] for t in _qkv(N=64, dt=dt))
    assert kf.attention(q, k, v, **kw).shape == (0, 2, 64, 64)


def test_runs_on_a_thread_with_a_small_stack(dt):
    """Each thread's scratch (300-700 KiB) comes from the heap: a first version kept it on the stack
    and crashed on a 128 KiB thread stack (musl's default; found in review). The call must run on the
    kernel: with the 512-row threshold this one had run on the op unseen (found this session)."""
    assert_runs_on_a_small_stack(
        "import keyfold as kf\nfrom keyfold.kernels import cpu, native\ncpu.PREFILL_MIN_ROWS = 5\n"
        "cpu.PREFILL_AVX2_MAX_HEAD = 256\n"
        f"q = k = v = torch.randn(1, 2, 256, 256).to({dt})",
        "kf.attention(q, k, v, mask=kf.causal())",
        "assert native.prefill_calls == 1, native.prefill_calls")


def _alibi_exact(q, k, v, slopes, q0, n_keys):
    """Softmax in float64 with ALiBi at exact positions: queries from q0, keys from 0, keys past n_keys
    hidden."""
    qp = torch.arange(q.shape[2], dtype=torch.float64) + q0
    kp = torch.arange(k.shape[2], dtype=torch.float64)
    s = q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s - slopes.double().view(1, -1, 1, 1) * (qp[:, None] - kp[None, :]).abs()
    s[..., n_keys:] = -math.inf
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("base", [2 ** 25, 2 ** 31 + 7])
def test_a_large_row_shift_does_not_swamp_the_scores(base, dt):
    """ALiBi with every key far behind its queries: the separable bias's row term is -slope x base. The
    kernel added it to every score of the row in float32 (its pieces share one softmax), which swamped
    the scores: out was off by 0.4-2.3 at 2^25-2^31 (found in review). Each row's largest shift is now
    taken out and added back to lse."""
    slopes = kf.alibi_slopes(4)
    q, k, v = _qkv(1, 4, 300, 16, seed=7, dt=dt)
    call = dict(score=kf.alibi(slopes), mask=kf.sinks(250), q_offset=base, kv_offset=0, block_size=64)
    out, lse = _ran(lambda: kf.attention(q, k, v, return_lse=True, **call))
    exact = _alibi_exact(q, k, v, slopes, base, 250)
    assert (out.double() - exact).abs().max() < (1e-5 if dt is F32 else 1e-2)
    ref = kf.attend(q.double(), k.double(), v.double(), backend=kf.Backend.REFERENCE, **call)
    torch.testing.assert_close(lse.double(), ref.lse, atol=0, rtol=1e-6)


@pytest.mark.parametrize("B,H,Hkv", [(2, 4, 2), (1, 4, 1), (3, 2, 2)])
def test_the_output_does_not_depend_on_the_thread_count(B, H, Hkv, dt):
    """Work items run in one run of whole kv heads per thread, each thread packing its heads into a buffer
    of its own where there is a kv head for every thread (else every head is packed first, shared), and
    a thread out of work takes items from another's run. Whatever the threads, every item runs once
    over the keys its head packed: the same bits at 1, 2, 3 and 5 threads, under a causal mask whose
    items differ in cost, so threads finish apart and take from each other."""
    q, k, v = _qkv(B, H, 1100, 64, Hkv=Hkv, seed=3, dt=dt)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            outs.append(_ran(lambda: kf.attention(q, k, v, mask=kf.causal(), return_lse=True)))
    finally:
        torch.set_num_threads(before)
    assert_forward_by_rule(q, k, v, mask=kf.causal())
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
