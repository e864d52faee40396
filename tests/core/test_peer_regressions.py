"""Regressions from porting FlexAttention's and FlashAttention's tests (issue #16, items 2-6, 10, 11).

Each test failed on the code before its fix: a stale plan, NaN gradients through merge, an
unnormalised single-state merge, ALiBi in float32 positions, varlen causal in the wrong corner,
refused inputs, and non-zero gradients where the exact one is 0.
"""

import math
import os

import numpy as np
import pytest
import torch

import keyfold as kf
from keyfold import Backend
from keyfold.caches import KVCache, decode
from tests.helpers import (assert_backward_by_rule, assert_close_by_rule, assert_forward_by_rule, max_err,
                           naive_attention)

BACKENDS = [Backend.CPU, Backend.TILES]


def _qkv(B, H, Nq, Nk, D, dtype=torch.float32, seed=0, Hkv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv or H, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv or H, Nk, D, generator=g).to(dtype)
    return q, k, v


# ----------------------------------------------------------------- 2. stale plans, bounded cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_follows_inplace_change_of_captured_ids(backend):
    """Document ids of a packed batch reused across steps (``ids.copy_(new)``): the plan made
    for the old ids must not be reused (it gave max error 3.57)."""
    N = 384
    ids = torch.arange(N) * 3 // N

    def same_doc(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    q, k, v = _qkv(1, 2, N, N, 16)
    assert_forward_by_rule(q, k, v, mask=same_doc, backend=backend)
    for n_docs in (7, 2, 11):
        ids.copy_(torch.arange(N) * n_docs // N)
        assert_forward_by_rule(q, k, v, mask=same_doc, backend=backend)


def test_plan_follows_rebound_closure_value_and_global():
    q, k, v = _qkv(1, 1, 128, 128, 8)
    width = 3

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= width

    assert_forward_by_rule(q, k, v, mask=band)
    width = 40  # noqa: F841 - read by band through its closure cell
    assert_forward_by_rule(q, k, v, mask=band)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc for the resident size")
def test_plan_cache_is_bounded_by_bytes_over_fresh_lambdas(monkeypatch):
    """400 fresh mask lambdas (one per step, as a loop that builds its mask inline does): the
    cache's bytes stay within its budget and the process does not grow."""
    monkeypatch.setattr(kf.planner, "PLAN_CACHE_BYTES", 4 << 20)
    kf.clear_plan_cache()
    q, k, v = _qkv(1, 2, 512, 512, 16)
    rss = {}
    for i in range(400):
        kf.attention(q, k, v, mask=lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 3 != 0, block_size=128)
        st = kf.plan_cache_stats()
        assert st["bytes"] <= st["budget"] == 4 << 20
        if i in (99, 399):
            rss[i] = _rss_mib()
    st = kf.plan_cache_stats()
    assert st["misses"] == 400 and st["evictions"] >= 300 and 0 < st["size"] < 100
    assert rss[399] - rss[99] < 32, rss  # flat (unbounded, 300 more plans with their tiles held ~225 MiB)
    kf.clear_plan_cache()
    assert kf.plan_cache_stats()["bytes"] == 0


def test_plan_cache_hits_for_unchanged_captures():
    kf.clear_plan_cache()
    ids = torch.arange(64) // 16
    fn = lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]  # noqa: E731
    q, k, v = _qkv(1, 1, 64, 64, 8)
    for _ in range(3):
        kf.attention(q, k, v, mask=fn, backend=Backend.TILES)
    st = kf.plan_cache_stats()
    assert (st["hits"], st["misses"]) == (2, 1)
    ids[0] = 3  # in place: a new plan
    kf.attention(q, k, v, mask=fn, backend=Backend.TILES)
    assert kf.plan_cache_stats()["misses"] == 2


def test_captured_tensors_follows_closures_defaults_globals_and_objects():
    a, b_, c = torch.zeros(2), torch.ones(3), torch.full((4,), 2.0)

    class Holder:
        def __init__(self):
            self.table = c

    holder = Holder()

    def fn(b, h, q_idx, kv_idx, extra=b_):
        return (a[0] + extra[0] + holder.table[0] + _GLOBAL_TABLE[0]) > q_idx

    found = kf.masks.captured_tensors(fn)
    assert {id(t) for t in found} == {id(a), id(b_), id(c), id(_GLOBAL_TABLE)}


_GLOBAL_TABLE = torch.zeros(5)


# ------------------------------------------------------------------- 3, 4. the merge's empty rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", [None, kf.causal()], ids=["full", "causal"])
def test_split_kv_more_splits_than_keys_has_finite_exact_gradients(mask, backend):
    """FlashAttention's split-KV test: 5 splits over 3 keys leaves rows empty in several pieces;
    dq and dk were NaN through merge_all."""
    q, k, v = _qkv(1, 2, 4, 3, 8, dtype=torch.float64)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    edges = [round(i * 3 / 5) for i in range(6)]
    parts = [kf.attend(q, k[:, :, a:e], v[:, :, a:e], mask=mask, q_offset=0, kv_offset=a, backend=backend)
             for a, e in zip(edges[:-1], edges[1:])]
    st = kf.merge_all(parts)
    (st.out.sum() + st.lse.masked_fill(st.lse.isneginf(), 0).sum()).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = kf.attend(q, k, v, mask=mask, q_offset=0, backend=Backend.REFERENCE)
    (ref.out.sum() + ref.lse.masked_fill(ref.lse.isneginf(), 0).sum()).backward()
    for g, t in zip(got, (q, k, v)):
        assert torch.isfinite(g).all()
        assert max_err(g, t.grad) < 1e-12


def test_merge_of_two_empty_rows_has_zero_gradient():
    lse_a = torch.tensor([float("-inf"), 0.5, float("-inf")], requires_grad=True)
    lse_b = torch.tensor([float("-inf"), float("-inf"), 1.0], requires_grad=True)
    out_a = torch.randn(3, 2, requires_grad=True)
    out_b = torch.randn(3, 2, requires_grad=True)
    m = kf.merge(kf.State(out_a, lse_a), kf.State(out_b, lse_b))
    assert m.lse[0].isneginf() and (m.out[0] == 0).all()
    (m.out.sum() + m.lse[1:].sum()).backward()
    for t in (lse_a, lse_b, out_a, out_b):
        assert torch.isfinite(t.grad).all()
    assert lse_a.grad[0] == 0 and lse_b.grad[0] == 0 and (out_a.grad[0] == 0).all()


def test_merge_all_of_one_state_zeroes_its_empty_rows():
    """FlashAttention's combine test with one split: a state whose empty rows carry garbage."""
    out = torch.randn(2, 3, 5, 4) * 7
    lse = torch.randn(2, 3, 5)
    lse[:, :, 1] = float("-inf")
    lse[0, 2, 4] = float("-inf")
    got = kf.merge_all([kf.State(out, lse)])
    empty = lse.isneginf()
    assert (got.out[empty] == 0).all() and torch.equal(got.out[~empty], out[~empty])
    assert torch.equal(got.lse, lse)
    two = kf.merge(kf.State(out, lse), kf.empty_state(2, 3, 5, 4))  # one state or many: the same rows
    assert (two.out[empty] == 0).all()


# ----------------------------------------------------------------------- 5. ALiBi far from 0


def _alibi_ref(q, k, v, slopes, q_offset, kv_offset, causal, n_sinks=None):
    """float64 attention with ALiBi from exact integer distances (Python ints); ``n_sinks``:
    only keys before that position are visible."""
    Nq, Nk = q.shape[2], k.shape[2]
    dist = torch.tensor([[abs((q_offset + i) - (kv_offset + j)) for j in range(Nk)] for i in range(Nq)],
                        dtype=torch.float64)
    s = q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s - slopes.double().view(1, -1, 1, 1) * dist
    if causal:
        qp = torch.arange(Nq).view(-1, 1) + q_offset
        kp = torch.arange(Nk).view(1, -1) + kv_offset
        s = s.masked_fill(kp > qp, float("-inf"))
    if n_sinks is not None:
        s = s.masked_fill(torch.arange(Nk).view(1, -1) + kv_offset >= n_sinks, float("-inf"))
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("base", [2**20, 2**25, 2**31 + 7])
def test_alibi_with_every_key_far_behind_forward(backend, base):
    """Queries far past all their keys (sinks of a long stream): the bias is -slope * base, and
    added whole to the scores in float32 it swamped them (TILES error 0.2 at 2^25, 0.97 at 2^31;
    the CPU path's masked tiles likewise). The row term now shifts lse only. Forward only: the
    backward recomputes P from the float32 global lse, which at this magnitude holds ~0.03 of
    absolute error (a known limit, see the README's status)."""
    H = 4
    slopes = kf.alibi_slopes(H)
    q, k, v = _qkv(1, H, 6, 300, 16, seed=7)
    call = dict(score=kf.alibi(slopes), mask=kf.sinks(250), q_offset=base, kv_offset=0, block_size=64)
    out = kf.attention(q, k, v, backend=backend, **call)
    ref = _alibi_ref(q, k, v, slopes, base, 0, False, n_sinks=250)
    assert max_err(out, ref) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("base", [2**24 - 100, 2**24 + 3, 2**31 - 50, 2**31 + 7, 2**33 + 1])
@pytest.mark.parametrize("case", ["decode", "causal"])
def test_alibi_far_from_position_zero(backend, base, case):
    """Positions >= 2^24 held in float32 lost the distance (a stream past 16.7M tokens)."""
    H = 4
    slopes = kf.alibi_slopes(H) * 4  # steep slopes: a distance off by one shows
    if case == "decode":  # every key behind the queries: one FULL piece, the separable form
        q, k, v = _qkv(1, H, 8, 300, 16, seed=1)
        kw = dict(q_offset=base + 300, kv_offset=base, causal=False)
    else:                 # the diagonal: MASKED tiles (the bias) and FULL ones (separable)
        q, k, v = _qkv(1, H, 300, 300, 16, seed=2)
        kw = dict(q_offset=base, kv_offset=base, causal=True)
    mask = kf.causal() if kw["causal"] else None
    call = dict(mask=mask, score=kf.alibi(slopes), q_offset=kw["q_offset"], kv_offset=kw["kv_offset"])
    out = kf.attention(q, k, v, backend=backend, block_size=64, **call)
    ref = _alibi_ref(q, k, v, slopes, kw["q_offset"], kw["kv_offset"], kw["causal"])
    naive = naive_attention(q, k, v, **call)
    assert_close_by_rule(out, ref, naive, None)


def test_alibi_with_learnable_slopes_raises_instead_of_dropping_their_gradient():
    """Regression: alibi(slopes) kept a read-only copy, so slopes with requires_grad trained silently
    to nothing (.grad stayed None). It now raises naming the callable form, which does train them."""
    H = 4
    slopes = torch.rand(H, requires_grad=True)
    with pytest.raises(ValueError, match="slopes require grad"):
        kf.alibi(slopes)
    with torch.no_grad():                          # inference with a learned parameter: fine
        kf.alibi(slopes)
    kf.alibi(slopes.detach())
    q, k, v = _qkv(1, H, 24, 24, 8, seed=4)
    out = kf.attention(q, k, v, mask=kf.causal(), score=lambda s, b, h, qi, kv: s - slopes[h] * (qi - kv).abs())
    out.sum().backward()
    assert slopes.grad is not None and slopes.grad.abs().sum() > 0
    fixed = kf.attention(q, k, v, mask=kf.causal(), score=kf.alibi(slopes.detach()))
    assert max_err(out.detach(), fixed) < 1e-5


def test_alibi_per_batch_slopes():
    """FlashAttention accepts alibi_slopes of shape (B, H)."""
    B, H = 3, 4
    g = torch.Generator().manual_seed(5)
    slopes = torch.rand(B, H, generator=g)
    q, k, v = _qkv(B, H, 40, 40, 8, seed=3)
    for backend in BACKENDS:
        out = kf.attention(q, k, v, mask=kf.causal(), score=kf.alibi(slopes), backend=backend)
        for b in range(B):
            one = kf.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask=kf.causal(), score=kf.alibi(slopes[b]),
                               backend=backend)
            assert max_err(out[b:b + 1], one) < 1e-6
        assert_forward_by_rule(q, k, v, mask=kf.causal(), score=kf.alibi(slopes), backend=backend)
    with pytest.raises(ValueError, match="per batch entry"):
        kf.attention(q[:2], k[:2], v[:2], score=kf.alibi(slopes))


# ------------------------------------------------------------------ 10. refused inputs


@pytest.mark.parametrize("mask", [None, kf.causal(), kf.causal() & kf.window(2)], ids=["none", "causal", "window"])
def test_decode_more_queries_than_cached_keys(mask):
    """FlashAttention's kvcache tests with seqlen_q > seqlen_k: allowed; a row with no key is 0."""
    cache = KVCache(batch=2, heads=2, head_dim=8, capacity=16)
    q, k, v = _qkv(2, 2, 7, 3, 8, seed=4)
    cache.append(k, v)
    out = decode(q, cache, mask=mask)
    ref = kf.attention(q.double(), k.double(), v.double(), mask=mask, backend=Backend.REFERENCE)
    assert max_err(out, ref) < 1e-6
    if mask is not None:
        assert (out[:, :, :4] == 0).all()  # queries at positions -4..-1 see no key


def test_window_takes_numpy_and_0d_tensor_integers():
    for left in (torch.tensor(5), np.int64(5), np.int32(5), torch.tensor(5, dtype=torch.int32)):
        m = kf.window(left, torch.tensor(1))
        assert m == kf.window(5, 1)
    with pytest.raises(TypeError, match="window"):
        kf.window(torch.tensor(5.0))
    with pytest.raises(TypeError, match="window"):
        kf.window(True)


def test_sinks_prefix_and_padding_take_0d_tensor_integers():
    """The README's promise for every integer argument; sinks(torch.tensor(2)) and prefix(...)
    asked for a 1-D tensor (review, 2026-12-06)."""
    for make in (kf.sinks, kf.prefix, kf.padding):
        for n in (torch.tensor(3), np.int64(3), torch.tensor(3, dtype=torch.int32)):
            assert torch.equal(make(n).to_dense(6, 6), make(3).to_dense(6, 6)), make.__name__
        with pytest.raises((TypeError, ValueError), match="floating|int"):
            make(torch.tensor(3.0))


# ------------------------------------------------------------ 6. varlen: FlashAttention's packing


def _ragged(seed, n_seqs=5, max_len=40, zero=True):
    """Random cu_seqlens for queries and keys; some sequences with no queries or no keys."""
    g = torch.Generator().manual_seed(seed)
    lq = torch.randint(1, max_len, (n_seqs,), generator=g)
    lk = torch.randint(1, max_len, (n_seqs,), generator=g)
    if zero:
        lq[1] = 0
        lk[3] = 0
    cu = lambda x: torch.cat([torch.zeros(1, dtype=torch.long), x.cumsum(0)])  # noqa: E731
    return cu(lq), cu(lk)


def _fa_varlen_ref(q, k, v, cu_q, cu_k, causal, window, dtype):
    """FlashAttention's varlen formula, one sequence at a time, computed in ``dtype`` (float64:
    the reference; the input dtype: the plain same-dtype yardstick). Local query i sees local
    key j when i + Lk - Lq - left <= j <= i + Lk - Lq + right (causal: right = 0); a row with
    no key is 0."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    outs = []
    for s in range(cu_q.numel() - 1):
        a, b = int(cu_q[s]), int(cu_q[s + 1])
        c, d = int(cu_k[s]), int(cu_k[s + 1])
        qs, ks, vs = q[:, :, a:b].to(dtype), k[:, :, c:d].to(dtype), v[:, :, c:d].to(dtype)
        Lq, Lk = b - a, d - c
        i = torch.arange(Lq).view(-1, 1) + (Lk - Lq)
        j = torch.arange(Lk).view(1, -1)
        vis = torch.ones(Lq, Lk, dtype=torch.bool)
        if right is not None:
            vis &= j <= i + right
        if left is not None:
            vis &= j >= i - left
        sc = (qs @ ks.transpose(-1, -2)) * q.shape[-1] ** -0.5
        sc = sc.masked_fill(~vis, float("-inf"))
        seen = vis.any(-1, keepdim=True)
        p = torch.softmax(sc.float() if dtype != torch.float64 else sc, -1).to(dtype)
        p = torch.where(seen, p, torch.zeros_like(p))  # rows with no key: 0, not NaN
        outs.append(p @ vs)
    return torch.cat(outs, 2)


VARLEN_CASES = {
    "plain": dict(causal=False, window=None),
    "causal": dict(causal=True, window=None),
    "window": dict(causal=False, window=(5, 3)),
    "causal_window": dict(causal=True, window=(7, None)),
}


def _varlen_mask(cu_q, cu_k, causal, window, spelled):
    if spelled == "args":
        return kf.varlen(cu_q, cu_k, causal=causal, window=window)
    m = kf.varlen(cu_q, cu_k)  # the same through composition
    if causal:
        m = m & kf.causal()
    if window is not None:
        m = kf.window(*window) & m
    return m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(VARLEN_CASES))
@pytest.mark.parametrize("spelled", ["args", "and"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_matches_flash_attention_formula(backend, case, spelled, dtype):
    """flash_attn_varlen_func(cu_seqlens_q, cu_seqlens_k, causal=...): each sequence aligned
    bottom-right on its own lengths. documents(q_ids, kv_ids) & causal() put the causal edge in
    the wrong corner for every sequence but one."""
    causal, window = VARLEN_CASES[case]["causal"], VARLEN_CASES[case]["window"]
    seed = sum(map(ord, case + spelled + str(dtype)))
    cu_q, cu_k = _ragged(seed)
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = _qkv(1, 4, Tq, Tk, 16, dtype=dtype, seed=seed, Hkv=2)
    mask = _varlen_mask(cu_q, cu_k, causal, window, spelled)
    dout = torch.randn(1, 4, Tq, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def grads(fn, dt):
        leaves = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    got = grads(lambda a, b, c: kf.attention(a, b, c, mask=mask, block_size=32, backend=backend), dtype)
    rep = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731 - GQA for the per-sequence formula
    ref = grads(lambda a, b, c: _fa_varlen_ref(a, rep(b), rep(c), cu_q, cu_k, causal, window, torch.float64),
                torch.float64)
    nai = grads(lambda a, b, c: _fa_varlen_ref(a, rep(b), rep(c), cu_q, cu_k, causal, window, dtype), dtype)
    assert not any(torch.isnan(g).any() for g in got)
    for name, g, r, n, factor in zip(("out", "dq", "dk", "dv"), got, ref, nai, (2.0, 3.0, 3.0, 3.0)):
        assert_close_by_rule(g, r, n, None, factor=factor, what=name)
    seen = torch.zeros(Tq, dtype=torch.bool)
    dense = mask.to_dense(Tq, Tk, 0)
    seen |= dense.any(-1)
    assert (got[0][:, :, ~seen] == 0).all()  # rows of sequences without keys (and early causal rows)
    assert int(cu_q[2] - cu_q[1]) == 0 and int(cu_k[4] - cu_k[3]) == 0  # the empty sequences are there


def test_varlen_classification_is_sound_against_evaluation():
    """The planner's closed form never says FULL or EMPTY wrongly (checked on every tile)."""
    for seed in range(6):
        cu_q, cu_k = _ragged(100 + seed, n_seqs=7, max_len=30)
        Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
        for causal, window in [(False, None), (True, None), (False, (4, 2)), (True, (3, None))]:
            m = kf.varlen(cu_q, cu_k, causal=causal, window=window)
            dense = m.to_dense(Tq, Tk, 0)
            p = kf.plan(m, Tq, Tk, q_offset=0, block_size=8)
            for i in range(p.kinds.shape[0]):
                for j in range(p.kinds.shape[1]):
                    tile = dense[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8]
                    kind = int(p.kinds[i, j])
                    if kind == int(kf.BlockKind.FULL):
                        assert tile.all()
                    if kind == int(kf.BlockKind.EMPTY):
                        assert not tile.any()


def test_varlen_refuses_misaligned_calls_and_bad_cu_seqlens():
    cu_q, cu_k = torch.tensor([0, 3, 5]), torch.tensor([0, 4, 9])
    q, k, v = _qkv(1, 1, 5, 9, 8)
    with pytest.raises(ValueError, match="packs 5 queries and 9 keys"):
        kf.attention(q, k, v, mask=kf.varlen(cu_q, cu_k), q_offset=4)
    with pytest.raises(ValueError, match="never decrease"):
        kf.varlen(torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="same sequences"):
        kf.varlen(torch.tensor([0, 3]), cu_k)


# ---------------------------------------------------- 11. exact zeros where the gradient is 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_single_visible_key_gives_exactly_zero_dq_dk_on_tiles(dtype):
    """FlashAttention's zero_len_k varlen cases: a row that sees one key has dS = 0, so its dq
    and the key's dk are exactly 0, as the plain formula gives (keyfold gave 2e-7..6e-7)."""
    cu_q, cu_k = torch.tensor([0, 5, 9, 12, 20]), torch.tensor([0, 1, 1, 7, 8])  # seqs 0 and 3: one key
    q, k, v = _qkv(1, 2, 20, 8, 16, dtype=dtype, seed=11)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = kf.attention(q, k, v, mask=kf.varlen(cu_q, cu_k), backend=Backend.TILES)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    one_key_rows = torch.cat([torch.arange(0, 5), torch.arange(12, 20)])
    assert (q.grad[:, :, one_key_rows] == 0).all()
    assert (k.grad[:, :, [0, 7]] == 0).all()
    assert (v.grad[:, :, [0, 7]] != 0).all()  # the values still get their gradient
    (q2, k2, v2) = (t.detach()[:, :, :1].clone().requires_grad_(True) for t in (q, k, v))
    o2 = kf.attention(q2, k2, v2, backend=Backend.TILES)  # one query, one key: the plain case
    o2.backward(torch.ones_like(o2))
    assert (q2.grad == 0).all() and (k2.grad == 0).all()


def test_callable_plan_at_positions_past_2_31():
    """Exact classification evaluated callables on int32 positions, which wrap past 2^31: tiles
    across the wrap were classified FULL/EMPTY wrongly (a silently wrong plan)."""
    base = 2**31 - 32
    fn = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx  # noqa: E731
    p = kf.plan(fn, 64, 64, q_offset=base, kv_offset=base, block_size=16)
    assert torch.equal(p.kinds, kf.plan(kf.causal(), 64, 64, q_offset=base, kv_offset=base, block_size=16).kinds)
    q, k, v = _qkv(1, 2, 64, 64, 8, seed=9)
    for backend in BACKENDS:
        assert_forward_by_rule(q, k, v, mask=fn, q_offset=base, kv_offset=base, block_size=16, backend=backend)


def test_alibi_per_batch_slopes_through_decode_groups():
    """A ragged cache splits the batch into groups (the score sees shifted batch rows): each row
    still gets its own slopes."""
    B, H = 3, 2
    slopes = torch.rand(B, H, generator=torch.Generator().manual_seed(2))
    cache = KVCache(batch=B, heads=H, head_dim=8, capacity=32)
    q, k, v = _qkv(B, H, 2, 20, 8, seed=12)
    lengths = [20, 12, 12]
    cache.append(k, v, lengths=lengths)
    out = decode(q, cache, mask=kf.causal(), score=kf.alibi(slopes))
    for b, L in enumerate(lengths):
        one = kf.attention(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L], mask=kf.causal(),
                           score=kf.alibi(slopes[b]))
        assert max_err(out[b:b + 1], one) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("Hkv", [2, 1])
def test_single_visible_key_gives_exactly_zero_dq_dk_on_cpu(dtype, Hkv):
    """Item 11 on the fused CPU path: its backward takes D = dO.O in another summation order than
    dP = dO.v, so a row with one visible key left ~1e-7 in dq and dk. Such rows now take their exact
    gradient (dv_j += dO_i; dq, dk exactly 0), with GQA, causal's first row and varlen's one-key sequences."""
    cu_q, cu_k = torch.tensor([0, 5, 9, 12, 20]), torch.tensor([0, 1, 1, 7, 8])  # seqs 0 and 3: one key
    q, _, _ = _qkv(1, 2, 20, 8, 16, dtype=dtype, seed=11)
    _, k, v = _qkv(1, Hkv, 20, 8, 16, dtype=dtype, seed=12)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = kf.attention(q, k, v, mask=kf.varlen(cu_q, cu_k), backend=Backend.CPU)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(dout)
    one_key_rows = torch.cat([torch.arange(0, 5), torch.arange(12, 20)])
    assert (q.grad[:, :, one_key_rows] == 0).all()
    assert (k.grad[:, :, [0, 7]] == 0).all()
    g = 2 // Hkv  # key 0 is seen by rows 0..4 only: its dv is their dout summed (P = 1)
    expect = dout[:, :, 0:5].float().sum(2).reshape(1, Hkv, g, 16).sum(2)
    torch.testing.assert_close(v.grad[:, :, 0].float(), expect, atol=1e-2 if dtype != torch.float32 else 1e-5,
                               rtol=1e-2 if dtype != torch.float32 else 1e-5)
    # causal: the first row sees one key
    qc, kc, vc = (t.detach()[:, :, :12].clone().requires_grad_(True) for t in (q, k, v))
    kf.attention(qc, kc, vc, mask=kf.causal(), backend=Backend.CPU).backward(dout[:, :, :12])
    assert (qc.grad[:, :, 0] == 0).all()
    assert_backward_by_rule(q.detach(), k.detach(), v.detach(), mask=kf.varlen(cu_q, cu_k), backend=Backend.CPU)


def test_single_key_rows_with_an_lse_gradient_on_cpu():
    """With dlse, a one-key row has dS = dlse exactly: dq_i = scale dlse_i k_j, dk_j = scale dlse_i q_i."""
    q, k, v = _qkv(1, 2, 6, 6, 8, dtype=torch.float64, seed=3)
    for backend in (Backend.CPU, Backend.REFERENCE):
        a, b, c = (t.clone().requires_grad_(True) for t in (q, k, v))
        st = kf.attend(a, b, c, mask=kf.causal() & kf.window(0), backend=backend)  # one key per row
        (st.out.sum() + (st.lse * torch.arange(6.0, dtype=torch.float64)).sum()).backward()
        if backend is Backend.CPU:
            got = (a.grad, b.grad, c.grad)
        else:
            torch.testing.assert_close(got[0], a.grad), torch.testing.assert_close(got[1], b.grad)
            torch.testing.assert_close(got[2], c.grad)


def test_the_float64_reference_takes_alibi_distances_past_2_to_the_24_exactly():
    """The float64 reference took ALiBi's bias in float32: a distance past 2^24 rounded, and at -slope x
    2^31 the bias's ulp is 32, so the 'reference' was off by 0.4 (2^25) to 1.9 (2^31) with every key that
    far behind (found in review). Float64 scores now get the bias in float64."""
    H = 4
    slopes = kf.alibi_slopes(H)
    q, k, v = (t.double() for t in _qkv(1, H, 300, 300, 16, seed=7))
    for base in (2 ** 25, 2 ** 31 + 7):
        out = kf.attention(q, k, v, score=kf.alibi(slopes), mask=kf.sinks(250), q_offset=base, kv_offset=0,
                           backend=kf.Backend.REFERENCE)
        assert max_err(out, _alibi_ref(q, k, v, slopes, base, 0, False, n_sinks=250)) < 1e-12


@pytest.mark.parametrize("q_offset", [12, 5, None])
def test_one_decoding_row_under_causal_is_one_full_piece(q_offset):
    """A single query row under causal() sees keys up to its position whole: the plan is one FULL
    piece. It was a FULL piece and a one-key CAUSAL piece merged; in bfloat16 the first piece's out was
    rounded before the merge, and 7 of 100 steps over 13 keys broke the correctness rule (fuzzing,
    2026-12-05). Now the CPU path makes one call: since 2026-12-07 (a 16-bit call over so few keys runs
    in float32, cpu._tiny_16bit) bit for bit the float32 call on the same values, rounded once."""
    from keyfold.planner import Piece, PieceKind, _causal_pieces
    d = 12 if q_offset is None else q_offset
    assert _causal_pieces(1, 13, d) == (Piece(0, 1, 0, min(d + 1, 13), PieceKind.FULL),)
    for seed in range(10):
        q, k, v = _qkv(1, 2, 1, 13, 16, torch.bfloat16, seed=seed)
        got = kf.attention(q, k, v, mask=kf.causal(), q_offset=q_offset, backend=Backend.CPU)
        want = kf.attention(q.float(), k[:, :, :d + 1].float(), v[:, :, :d + 1].float(), backend=Backend.CPU)
        assert torch.equal(got, want.bfloat16())
        assert_forward_by_rule(q, k, v, mask=kf.causal(), q_offset=q_offset)
        assert_forward_by_rule(q.float(), k.float(), v.float(), mask=kf.causal(), q_offset=q_offset)


@pytest.mark.parametrize("Hkv", [1, 2])
@pytest.mark.parametrize("mask", [lambda b, h, q_idx, kv_idx: kv_idx == h,
                                  lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & ((kv_idx + h) % 3 != 0)],
                         ids=["one-key-per-head", "per-head-causal"])
@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.CPU])
def test_gqa_backward_with_a_mask_that_differs_between_the_heads_of_a_group(Hkv, mask, backend):
    """The CPU backward found rows that see one key from the first member's mask rows only, for
    every member of a group (under MQA, or a mask broadcast over kv heads): the row's one key went
    to the whole group, dv of 0.17 where 0.19 and -0.02 were due (fuzzing, 2026-12-05)."""
    q, k, v = _qkv(1, 4, 5, 7, 8, Hkv=Hkv)
    assert_forward_by_rule(q, k, v, mask=mask, q_offset=0, backend=backend)
    assert_backward_by_rule(q, k, v, mask=mask, q_offset=0, backend=backend)


def test_gqa_backward_with_a_per_head_row_mask_of_one_key_column():
    """A bool mask (B, H, Nq, 1) under GQA: its folded tile has one key column, which the count of
    rows with one key reshaped as if it had all of them (a RuntimeError in the backward)."""
    q, k, v = _qkv(2, 4, 6, 5, 8, Hkv=2)
    m = torch.rand(2, 4, 6, 1, generator=torch.Generator().manual_seed(3)) > 0.4
    grads = []
    for be, dt in ((Backend.CPU, torch.float32), (Backend.REFERENCE, torch.float64)):
        x = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)]
        kf.attention(*x, mask=m, backend=be).backward(torch.ones(2, 4, 6, 8, dtype=dt))
        grads.append([t.grad for t in x])
    for a, b in zip(*grads):
        assert max_err(a, b) < 1e-5


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.CPU, Backend.TILES])
def test_float64_alibi_keeps_float64_accuracy(backend):
    """ALiBi's separable row and key terms were computed in float32 for every input: float64 calls
    on the CPU backend came out 1.6e-5 off (the rule allows 1e-6; fuzzing, 2026-12-05)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 217, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 8, 58, 8, generator=g, dtype=torch.float64) for _ in range(2))
    slopes = torch.rand(1, 8, generator=g)
    qp, kp = torch.arange(217).view(-1, 1) + 33, torch.arange(58).view(1, -1)
    bias = -slopes.double().view(1, 8, 1, 1) * (qp - kp).abs()
    want = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + bias, -1) @ v
    got = kf.attention(q, k, v, score=kf.alibi(slopes), q_offset=33, backend=backend)
    assert max_err(got, want) < 1e-9


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -float("inf")])
def test_merge_ignores_what_an_empty_rows_out_holds(fill):
    """A row with lse -inf is empty whatever its out holds: merge multiplied that out by its weight
    0, and 0 x NaN (or inf) made the merged row NaN, in value and gradient (fuzzing, 2026-12-05)."""
    a_out = torch.tensor([[[[1.0, 2.0]]]], requires_grad=True)
    a = kf.State(a_out, torch.tensor([[[0.5]]]))
    b = kf.State(torch.full((1, 1, 1, 2), fill), torch.tensor([[[-math.inf]]]))
    for got in (kf.merge(a, b).out, kf.merge(b, a).out, kf.merge_all([a, b, b]).out):
        assert torch.equal(got.detach(), a_out.detach())
    assert torch.equal(kf.merge(b, b).out, torch.zeros(1, 1, 1, 2))
    kf.merge(a, b).out.sum().backward()
    assert torch.equal(a_out.grad, torch.ones(1, 1, 1, 2))


@pytest.mark.parametrize("mask,same_as", [
    (lambda: kf.dilated(2 ** 32 + 1), lambda: kf.dilated(2 ** 33)),            # only the diagonal
    (lambda: kf.window(2 ** 32 + 5) & kf.dilated(2), lambda: kf.causal() & kf.dilated(2)),
    (lambda: kf.window(None, 2 ** 32 + 5) & (lambda b, h, q, k: (q - k) % 2 == 0),
     lambda: (lambda b, h, q, k: (q - k) % 2 == 0)),
    (lambda: kf.window(None, 2 ** 63 - 1), lambda: None),                        # sys.maxsize: no bound
])
@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES])
def test_mask_parameters_past_two_to_the_31_are_not_cut_to_32_bits(mask, same_as, backend):
    """Tiles of masks without a closed form were classified on int32 positions, where a mask's own
    parameter past 2^31 wraps to 32 bits: tiles called FULL or EMPTY that are not (errors 0.5-3.8);
    and window(None, sys.maxsize) wrapped qp + right around int64 (a helper's fuzz)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 600, 16, generator=g) for _ in range(3))
    want = kf.attention(q, k, v, mask=same_as(), backend=Backend.REFERENCE)
    torch.testing.assert_close(kf.attention(q, k, v, mask=mask(), backend=Backend.REFERENCE), want)
    torch.testing.assert_close(kf.attention(q, k, v, mask=mask(), backend=backend), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("mask", [lambda: kf.dilated(300), lambda: kf.dilated(7), lambda: kf.window(5) | kf.dilated(64)])
@pytest.mark.parametrize("block_size", [None, 3, 64])
def test_preset_positions_far_apart_are_not_cut_to_32_bits(mask, block_size):
    """Queries near -2^30 and keys near +2^30: a preset's query minus key position spans 2^31, and the
    planner's int32 positions (chosen when each position fit) wrapped it: tiles called EMPTY or FULL that
    are not, rows off by up to 5 (a review, 2026-12-07)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 256, 16, generator=g, dtype=torch.float64) for _ in range(3))
    qo, ko = -2 ** 30 - 5, 2 ** 30
    m = mask()
    vis = m.evaluate(None, None, torch.arange(qo, qo + 256).view(1, 1, -1, 1), torch.arange(ko, ko + 256).view(1, 1, 1, -1))
    assert bool(vis.any()) and not bool(vis.all())
    got = kf.attention(q, k, v, mask=m, q_offset=qo, kv_offset=ko, block_size=block_size)
    want = kf.attention(q, k, v, mask=m, q_offset=qo, kv_offset=ko, backend=Backend.REFERENCE)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_keys_expanded_along_the_sequence_run_as_sdpa_runs_them():
    """k and v with stride 0 along the sequence: the prefill kernel refuses such keys (-1), and the
    call raised instead of going to the fused op (a helper's fuzz)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 600, 64, generator=g)
    k, v = (torch.randn(1, 2, 1, 64, generator=g).expand(1, 2, 3000, 64) for _ in range(2))
    for mask in (None, kf.causal()):  # every key alike: out is v's row, up to a sum of 2400-3000 roundings
        for out in (kf.attention(q, k, v, mask=mask), kf.scaled_dot_product_attention(q, k, v)):
            torch.testing.assert_close(out, v[:, :, :600], atol=1e-4, rtol=0)


_PER_BATCH = {
    "padding(lengths)": (lambda: kf.padding(torch.tensor([5, 3, 4])), r"padding\(\.\.\.\): it holds 3 batch entries"),
    "padding(keys)": (lambda: kf.padding(keys=torch.tensor([[1, 1, 0, 0, 0], [1] * 5, [1, 0, 1, 0, 1]]).bool()),
                      r"padding\(keys=\.\.\.\): it holds 3 batch entries"),
    "documents(ids)": (lambda: kf.documents(torch.tensor([[0, 0, 1, 1, 1], [0, 1, 2, 3, 4], [0] * 5])),
                       r"documents\(ids\): it holds 3 batch entries"),
}


@pytest.mark.parametrize("name", list(_PER_BATCH))
def test_a_per_batch_mask_with_more_entries_than_a_batch_of_one_names_the_argument(name):
    """A mask holding 3 batch entries on a batch of 1 raised torch's RuntimeError from a view
    ("shape '[1, 1, 1, 5]' is invalid for input of size 15"): the check let any batch of 1 pass
    (review, 2026-12-06). The same for decode rows picked by seq_ids."""
    make, message = _PER_BATCH[name]
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=message):
        kf.attention(q, q, q, mask=make())
    cache = KVCache(batch=3, heads=2, head_dim=4, capacity=16)
    cache.append(torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4))
    for nq, splits in ((1, 1), (3, 2)):
        with pytest.raises(ValueError, match=message):
            decode(torch.randn(1, 2, nq, 4), cache, seq_ids=[0], splits=splits, mask=kf.causal() & make())
    # one entry per row is still right: each row as its own entry
    q3 = torch.randn(3, 2, 5, 4)
    whole = kf.attention(q3, q3, q3, mask=make())
    for i in range(3):
        one = make()
        part = kf.attention(q3[i:i + 1], q3[i:i + 1], q3[i:i + 1], mask=_row(one, i))
        torch.testing.assert_close(whole[i:i + 1], part)


def _row(mask, i):
    """The same mask with only batch entry i (rebuilt from its own tensors)."""
    if hasattr(mask, "valid"):
        return kf.padding(keys=mask.valid.t[i:i + 1])
    if hasattr(mask, "starts"):
        return kf.padding(mask.ends.t[i:i + 1] - mask.starts.t[i:i + 1])
    return kf.documents(mask.ids.t[i:i + 1])
