"""The memory wall: caches and decoding equal ``attention`` over the equivalent full keys.

Every comparison uses the correctness rule (DESIGN.md section 6, tests/helpers.py): error
against the float64 reference at most 2x the plain same-dtype implementation's + 1e-6, and
rows that see no key exactly 0.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keyfold
from keyfold.caches import (CacheFullError, KVCache, PagedKVCache, WindowCache, attend_cache, cascade,
                            choose_splits, decode)
from keyfold.caches import decoding
from keyfold.kernels import cpu, native
from tests.helpers import assert_close_by_rule, naive_attention, visible_rows

# ------------------------------------------------------------------------------ helpers


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny decode steps on a shared, loaded 2-core machine: with two OpenMP threads each call
    can stall at the kernel's barrier for milliseconds, so these tests run on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_rows_by_rule(got, q, k, v, **kw):
    """``got`` = decode of q against keys k/v: hold it to the rule against attention over k/v."""
    ref = keyfold.attention(q.double(), k.double(), v.double(), backend=keyfold.Backend.REFERENCE, **kw)
    naive = naive_attention(q, k, v, **kw)
    rows = visible_rows(q, k, mask=kw.get("mask"), q_offset=kw.get("q_offset"))
    assert got.shape == naive.shape and got.dtype == q.dtype
    assert not torch.isnan(got).any()
    hidden = ~torch.broadcast_to(rows, got.shape[:3])
    assert bool((got[hidden] == 0).all()), "rows that see no key must be exactly 0"
    assert_close_by_rule(got, ref, naive, rows)


def snapshot(obj):
    """Everything a cache holds: python state deep-copied, tensors cloned."""
    return {key: (val.clone() if isinstance(val, torch.Tensor) else copy.deepcopy(val))
            for key, val in vars(obj).items()}


def assert_unchanged(obj, snap):
    now = vars(obj)
    assert now.keys() == snap.keys()
    for key, val in snap.items():
        if isinstance(val, torch.Tensor):
            assert torch.equal(now[key], val), f"{key} changed"
        elif key != "_mask":
            assert now[key] == val, f"{key} changed"


def per_batch_docs(B, N):
    """Per-batch document ids (B, N): a batch-dependent mask the caches must keep per row."""
    g = torch.Generator().manual_seed(B * 1000 + N)
    return torch.randint(0, 3, (B, N), generator=g).sort(1).values


MASKS = {
    "none": lambda B, N, H: None,
    "causal": lambda B, N, H: keyfold.causal(),
    "window": lambda B, N, H: keyfold.causal() & keyfold.window(5),
    "sinks_window": lambda B, N, H: keyfold.causal() & (keyfold.window(4) | keyfold.sinks(3)),
    "documents": lambda B, N, H: keyfold.causal() & keyfold.documents(per_batch_docs(B, N)),
    "callable_b": lambda B, N, H: (lambda b, h, q, k: (k <= q) & ((k + b) % 3 != 0)),
}
SCORES = {
    "none": lambda H: None,
    "alibi": lambda H: keyfold.alibi(keyfold.alibi_slopes(H)),
    "softcap": lambda H: keyfold.softcap(5.0),
    "callable_b": lambda H: (lambda s, b, h, q, k: s + 0.1 * b - 0.01 * (q - k)),
}


# --------------------------------------------------------------------------- KVCache


@given(B=st.integers(1, 3), Hkv=st.sampled_from([1, 2]), g=st.sampled_from([1, 2]),
       Nq=st.integers(1, 3), data=st.data(), mask=st.sampled_from(sorted(MASKS)),
       score=st.sampled_from(sorted(SCORES)), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_kv_cache_ragged_decode_equals_attention(B, Hkv, g, Nq, data, mask, score, dtype):
    D, C = 8, 40
    lens = data.draw(st.lists(st.integers(Nq, C), min_size=B, max_size=B), label="lens")
    k, v = torch.randn(B, Hkv, C, D, dtype=dtype), torch.randn(B, Hkv, C, D, dtype=dtype)
    cache = KVCache(B, Hkv, D, C, dtype=dtype)
    cache.append(k, v, lengths=lens)
    assert cache.lengths == tuple(lens)
    q = torch.randn(B, Hkv * g, Nq, D, dtype=dtype)
    m, s = MASKS[mask](B, C, Hkv * g), SCORES[score](Hkv * g)
    got = decode(q, cache, mask=m, score=s)
    for b in range(B):
        # the rule per sequence; a batch-dependent mask/score is evaluated on the whole batch
        L = lens[b]
        qq = torch.zeros(B, Hkv * g, Nq, D, dtype=dtype)
        qq[b] = q[b]
        kk, vv = k[:, :, :L], v[:, :, :L]
        ref = keyfold.attention(qq.double(), kk.double(), vv.double(), mask=m, score=s,
                                backend=keyfold.Backend.REFERENCE)[b:b + 1]
        naive = naive_attention(qq, kk, vv, mask=m, score=s)[b:b + 1]
        rows = torch.broadcast_to(visible_rows(qq, kk, mask=m), (B, Hkv * g, Nq))[b:b + 1]
        assert bool((got[b:b + 1][~rows] == 0).all())
        assert_close_by_rule(got[b:b + 1], ref, naive, rows)


def test_kv_cache_bf16_score_modifiers_hold_the_rule_over_seeds():
    """bfloat16 softcap and score callables (tile kernel) through a ragged cache, 60 seeded draws:
    the scores, softmax and P @ V stay in float32, so the error stays within the rule. (P @ V in
    bfloat16, unnormalised P rounded to bfloat16 and the product rounded again before the division,
    fails here: draw 5, error 3.75e-3 > 2x naive's 1.87e-3.)"""
    import random
    rng = random.Random(0)
    for trial in range(60):
        torch.manual_seed(trial)
        B, Hkv, g, Nq = rng.randint(1, 3), rng.choice([1, 2]), rng.choice([1, 2]), rng.randint(1, 3)
        D, C = 8, 40
        lens = [rng.randint(Nq, C) for _ in range(B)]
        k, v = torch.randn(B, Hkv, C, D, dtype=torch.bfloat16), torch.randn(B, Hkv, C, D, dtype=torch.bfloat16)
        cache = KVCache(B, Hkv, D, C, dtype=torch.bfloat16)
        cache.append(k, v, lengths=lens)
        q = torch.randn(B, Hkv * g, Nq, D, dtype=torch.bfloat16)
        m = rng.choice([None, keyfold.causal(), keyfold.causal() & keyfold.window(5)])
        s = rng.choice([keyfold.softcap(5.0), SCORES["callable_b"](Hkv * g)])
        got = decode(q, cache, mask=m, score=s)
        for b in range(B):  # as in the test above: per sequence, a batch-dependent score on the whole batch
            qq = torch.zeros_like(q)
            qq[b] = q[b]
            kk, vv = k[:, :, :lens[b]], v[:, :, :lens[b]]
            ref = keyfold.attention(qq.double(), kk.double(), vv.double(), mask=m, score=s,
                                    backend=keyfold.Backend.REFERENCE)[b:b + 1]
            naive = naive_attention(qq, kk, vv, mask=m, score=s)[b:b + 1]
            rows = torch.broadcast_to(visible_rows(qq, kk, mask=m), (B, Hkv * g, Nq))[b:b + 1]
            assert_close_by_rule(got[b:b + 1], ref, naive, rows, what=f"draw {trial}, sequence {b}")


def test_ragged_batch_without_mask_is_one_call():
    """Nothing reads positions: sequences of any lengths share one call, extra keys hidden."""
    lens, D = [30, 10, 20, 25], 8
    k, v = torch.randn(4, 2, 30, D), torch.randn(4, 2, 30, D)
    cache = KVCache(4, 2, D, 40)
    cache.append(k, v, lengths=lens)
    q = torch.randn(4, 2, 1, D)
    calls = _split_calls(lambda: decode(q, cache))
    assert calls == [((4, 2, 1, D), (4, 2, 30, D))]
    got = decode(q, cache)
    for b, L in enumerate(lens):
        assert_rows_by_rule(got[b:b + 1], q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L])
    assert len(_split_calls(lambda: decode(q, cache, mask=keyfold.causal()))) == 4  # positions differ


def test_decode_is_the_last_row_of_attention():
    q_all, k, v = torch.randn(2, 4, 50, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    cache = KVCache(2, 2, 16, 64)
    cache.append(k, v)
    full = keyfold.attention(q_all, k, v, mask=keyfold.causal())
    got = decode(q_all[:, :, -1:], cache)
    assert_rows_by_rule(got, q_all[:, :, -1:], k, v)
    assert (got - full[:, :, -1:]).abs().max() < 1e-5


def test_whole_batch_step_follows_appends_and_resets():
    """The decode hot path keeps views of the cache between steps: they must follow every
    append, a reset and a ragged append (which leaves the hot path), step after step."""
    B, H, D, steps = 2, 2, 8, 6
    k, v = torch.randn(B, H, steps + 4, D), torch.randn(B, H, steps + 4, D)
    cache = KVCache(B, H, D, steps + 4)
    cache.append(k[:, :, :4], v[:, :, :4])
    for t in range(4, steps + 4):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        q = torch.randn(B, H, 1, D)
        assert_rows_by_rule(decode(q, cache), q, k[:, :, :t + 1], v[:, :, :t + 1])
        assert cache.whole()[2] == t + 1
    cache.reset([1])
    assert cache.whole() is None  # ragged now: the general path serves it
    cache.append(k[1:, :, :3], v[1:, :, :3], seq_ids=[1])
    q = torch.randn(B, H, 1, D)
    got = decode(q, cache)
    assert_rows_by_rule(got[:1], q[:1], k[:1], v[:1])
    assert_rows_by_rule(got[1:], q[1:], k[1:, :, :3], v[1:, :, :3])
    cache.reset()
    cache.append(k[:, :, :2], v[:, :, :2])
    assert cache.whole()[2] == 2
    assert_rows_by_rule(decode(q, cache), q, k[:, :, :2], v[:, :, :2])


def test_cache_storage_is_zeroed_aligned_and_owned_by_its_tensor():
    """Cache buffers may come from a huge-page mapping: they must behave as torch.zeros does."""
    import gc

    from keyfold.caches._storage import _HUGE, huge_pages_available, zeros
    big = zeros(4, 2, 1024, 64, dtype=torch.float32)  # 2 MiB: eligible
    small = zeros(2, 3, dtype=torch.bfloat16)         # too small: torch.zeros
    for t, shape, dtype in ((big, (4, 2, 1024, 64), torch.float32), (small, (2, 3), torch.bfloat16)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not bool(t.any())
    big.fill_(3.0)
    gc.collect()  # the mapping lives as long as the tensor, not the function that made it
    assert float(big.sum()) == 3.0 * big.numel()
    if huge_pages_available():
        assert big.data_ptr() % _HUGE == 0
        assert KVCache(1, 8, 64, 4096).k.data_ptr() % _HUGE == 0
    cache = KVCache(2, 8, 64, 4096)
    cache.append(torch.randn(2, 8, 5, 64), torch.randn(2, 8, 5, 64))
    twin = copy.deepcopy(cache)  # beam search and tests copy caches
    assert torch.equal(twin.k, cache.k) and twin.k.data_ptr() != cache.k.data_ptr()


def test_reorder_moves_rows_with_their_lengths_and_rejects_bad_index():
    """Beam search keeps surviving hypotheses: row i takes old row index[i], lengths included."""
    B, H, D = 3, 2, 8
    k, v = torch.randn(B, H, 12, D), torch.randn(B, H, 12, D)
    lens = [12, 5, 9]
    cache = KVCache(B, H, D, 16)
    cache.append(k, v, lengths=lens)
    index = [1, 1, 0]
    cache.reorder(torch.tensor(index))
    assert cache.lengths == (5, 5, 12)
    q = torch.randn(B, H, 1, D)
    got = decode(q, cache)
    for i, j in enumerate(index):
        assert_rows_by_rule(got[i:i + 1], q[i:i + 1], k[j:j + 1, :, :lens[j]], v[j:j + 1, :, :lens[j]])
    before = (cache.k.clone(), cache.lengths)
    for bad in ([0, 1], [0, 1, 3], [0, -1, 2], [0.0, 1, 2]):
        with pytest.raises(ValueError, match="reorder"):
            cache.reorder(bad)
    assert torch.equal(cache.k, before[0]) and cache.lengths == before[1]


def test_chunked_prefill_equals_full_causal_attention():
    """append a block, then decode(q_block, mask=causal()): prefill in chunks of any size."""
    N, D = 70, 8
    q, k, v = torch.randn(1, 4, N, D), torch.randn(1, 2, N, D), torch.randn(1, 2, N, D)
    cache = KVCache(1, 2, D, N)
    outs, t = [], 0
    for n in (1, 16, 5, 30, 18):
        cache.append(k[:, :, t:t + n], v[:, :, t:t + n])
        outs.append(decode(q[:, :, t:t + n], cache, mask=keyfold.causal()))
        t += n
    assert_rows_by_rule(torch.cat(outs, 2), q, k, v, mask=keyfold.causal())


@pytest.mark.parametrize("mask", ["none", "window", "documents"])
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_kv_equals_unsplit(mask, splits):
    """Split-KV chunks (folded into heads without a mask, serial with one) merge exactly."""
    B, Hkv, g, N, D = 2, 2, 2, 301, 16
    k, v = torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    cache = KVCache(B, Hkv, D, N + 8)
    cache.append(k, v)
    q = torch.randn(B, Hkv * g, 2, D)
    m = MASKS[mask](B, N, Hkv * g)
    got = decode(q, cache, mask=m, splits=splits)
    assert_rows_by_rule(got, q, k, v, mask=m)
    one = decode(q, cache, mask=m, splits=1)
    assert (got - one).abs().max() < 1e-5


def test_split_kv_auto_folds_long_mqa_cache():
    """Batch 1 with one key/value head has one task for all threads: auto split-KV kicks in for one
    float32 query row (the fused op's; the AVX2 kernel takes it whole); an MQA group of 4 rows goes whole to the decode kernel, which
    splits the keys among its threads itself (cpu.NATIVE_F32_ROWS, cpu.splits_itself)."""
    N, D = 3 * 4096, 16
    k, v = torch.randn(1, 1, N, D), torch.randn(1, 1, N, D)
    cache = KVCache(1, 1, D, N)
    cache.append(k, v)
    assert choose_splits(N, tasks=1, threads=2) == 3
    torch.set_num_threads(2)  # the fixture restores it
    q = torch.randn(1, 1, 1, D)
    calls = _split_calls(lambda: decode(q, cache))
    if native.available() and cpu.native_rows(torch.float32)[0] == 1:  # the AVX2 kernel takes one row whole
        assert calls == [((1, 1, 1, D), (1, 1, N, D))]
    else:
        assert calls == [((1, 3, 1, D), (1, 3, 4096, D))], "one call, 3 chunks folded into heads"
    assert_rows_by_rule(decode(q, cache), q, k, v)
    q = torch.randn(1, 4, 1, D)
    if native.available():
        assert _split_calls(lambda: decode(q, cache)) == [((1, 4, 1, D), (1, 1, N, D))]
    assert_rows_by_rule(decode(q, cache), q, k, v)


def _split_calls(fn):
    """The (q shape, k shape) of every attend call fn makes (``attend``, ``attend_out`` where nobody reads
    lse, or ``attend_wide`` for the states decoding merges)."""
    import keyfold.caches.decoding as dec
    calls, real = [], {name: getattr(dec, name) for name in ("attend", "attend_out", "attend_wide")}

    def counting(name):
        def call(q, k, *a, **kw):
            calls.append((tuple(q.shape), tuple(k.shape)))
            return real[name](q, k, *a, **kw)
        return call

    for name in real:
        setattr(dec, name, counting(name))
    try:
        fn()
    finally:
        for name, f in real.items():
            setattr(dec, name, f)
    return calls


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_is_differentiable_in_q(splits):
    """Gradients flow through the pieces and the merges (split or not) like through attention."""
    cache = KVCache(2, 2, 8, 300)
    k, v = torch.randn(2, 2, 300, 8), torch.randn(2, 2, 300, 8)
    cache.append(k, v)
    q = torch.randn(2, 4, 2, 8, dtype=torch.float32, requires_grad=True)
    dout = torch.randn(2, 4, 2, 8)
    (g,) = torch.autograd.grad((decode(q, cache, splits=splits, mask=keyfold.causal()) * dout).sum(), q)
    q64 = q.detach().double().requires_grad_(True)
    (ref,) = torch.autograd.grad((keyfold.attention(q64, k.double(), v.double(), mask=keyfold.causal(),
                                                    backend=keyfold.Backend.REFERENCE) * dout).sum(), q64)
    assert (g.double() - ref).abs().max() < 1e-5


@given(n=st.integers(1, 1 << 20), tasks=st.integers(1, 64), threads=st.integers(1, 64))
def test_choose_splits_properties(n, tasks, threads):
    s = choose_splits(n, tasks, threads)
    assert 1 <= s
    if s > 1:
        assert n // s >= 4096, "chunks stay at least MIN_CHUNK long"
        assert tasks < threads or tasks % threads, "no split when every thread already has equal work"
    if tasks % threads == 0:
        assert s == 1


def test_kv_cache_bad_input_leaves_it_unchanged():
    cache = KVCache(2, 2, 8, 10)
    cache.append(torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8), lengths=[6, 2])
    snap = snapshot(cache)
    with pytest.raises(CacheFullError, match="capacity=10"):
        cache.append(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))  # row 0 would hold 11
    with pytest.raises(KeyError, match="unknown sequence id 2"):
        cache.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), seq_ids=[2])
    with pytest.raises(ValueError, match="2 heads of size 8"):
        cache.append(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8))
    with pytest.raises(ValueError, match="lengths"):
        cache.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), lengths=[1, 2])
    with pytest.raises(ValueError, match="ids repeat"):
        cache.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), seq_ids=[1, 1])
    assert_unchanged(cache, snap)
    # more queries than sequence 1 holds (2 tokens) is FlashAttention's seqlen_q > seqlen_k: allowed,
    # and with causal() its first query (position -1) sees nothing (tests/core/test_peer_regressions.py)
    q3 = torch.randn(2, 2, 3, 8)
    out = decode(q3, cache, mask=keyfold.causal())
    assert (out[1, :, 0] == 0).all() and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="one row per"):
        decode(torch.randn(1, 2, 1, 8), cache)
    with pytest.raises(ValueError, match="splits"):
        decode(torch.randn(2, 2, 1, 8), cache, splits=-1)
    qd = torch.randn(2, 2, 1, 8)  # 0 chooses, as FlashAttention's num_splits=0 (it raised; a review, 2026-12-08)
    torch.testing.assert_close(decode(qd, cache, splits=0), decode(qd, cache))
    with pytest.raises(ValueError, match="multiple"):
        decode(torch.randn(2, 3, 1, 8), cache)
    for bad in (dict(batch=0), dict(capacity=-1), dict(dtype=torch.int32)):
        kw = dict(batch=1, heads=1, head_dim=4, capacity=4) | bad
        with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
            KVCache(**kw)


def test_kv_cache_subset_of_sequences():
    """seq_ids picks rows; a mask's batch index is q's row, as with attention over those keys."""
    D = 8
    cache = KVCache(4, 1, D, 32)
    k, v = torch.randn(4, 1, 20, D), torch.randn(4, 1, 20, D)
    cache.append(k, v, lengths=[20, 9, 9, 14])
    ids = [2, 1, 3]
    q = torch.randn(3, 2, 1, D)
    docs = keyfold.documents(per_batch_docs(3, 32))
    got = decode(q, cache, seq_ids=ids, mask=docs)
    for i, s in enumerate(ids):
        L = cache.lengths[s]
        qq = torch.zeros(3, 2, 1, D)
        qq[i] = q[i]
        kk = k[ids, :, :L]
        vv = v[ids, :, :L]
        want = keyfold.attention(qq.double(), kk.double(), vv.double(), mask=docs,
                                 backend=keyfold.Backend.REFERENCE)[i]
        assert (got[i].double() - want).abs().max() < 1e-5


# ------------------------------------------------------------------------ PagedKVCache


class _Model:
    """The paged cache's meaning: each sequence's full key/value tensors."""

    def __init__(self):
        self.k, self.v = {}, {}


OPS = st.lists(st.tuples(st.sampled_from(["new", "append", "append", "append", "fork", "free"]),
                         st.integers(0, 1 << 16), st.integers(0, 9)), min_size=1, max_size=25)


@settings(max_examples=30)
@given(ops=OPS, page_size=st.sampled_from([1, 3, 4]))
def test_paged_cache_matches_its_model_through_forks_and_frees(ops, page_size):
    H, D, P = 2, 4, 24
    pool = PagedKVCache(P, page_size, H, D)
    model = _Model()
    for op, pick, n in ops:
        live = pool.sequences
        if op == "new" or not live:
            s = pool.new_sequence()
            model.k[s], model.v[s] = torch.zeros(1, H, 0, D), torch.zeros(1, H, 0, D)
            continue
        s = live[pick % len(live)]
        if op == "fork":
            c = pool.fork(s)
            model.k[c], model.v[c] = model.k[s].clone(), model.v[s].clone()
            parent_k = pool.keys(s)
        elif op == "free":
            pool.free(s)
            del model.k[s], model.v[s]
        else:
            k, v = torch.randn(1, H, n, D), torch.randn(1, H, n, D)
            snap = snapshot(pool)
            try:
                pool.append(k, v, s)
            except CacheFullError:
                assert_unchanged(pool, snap)
                continue
            model.k[s] = torch.cat([model.k[s], k], 2)
            model.v[s] = torch.cat([model.v[s], v], 2)
        for t in pool.sequences:  # every sequence still holds exactly its tokens
            assert torch.equal(pool.keys(t), model.k[t]) and torch.equal(pool.values(t), model.v[t])
        if op == "fork":
            assert torch.equal(pool.keys(s), parent_k)
        stats = pool.stats()
        assert stats.used + stats.free == P
        assert stats.wasted <= stats.sequences * (page_size - 1), "waste: at most one partial page per sequence"
        held = {p for t in pool.sequences for p in pool.block_table(t)}
        assert len(held) == stats.used
    live = [t for t in pool.sequences if pool.length(t) > 0]
    if live:
        q = torch.randn(len(live), 2 * H, 1, D)
        got = decode(q, pool, seq_ids=live, mask=keyfold.causal())
        for i, t in enumerate(live):
            assert_rows_by_rule(got[i:i + 1], q[i:i + 1], model.k[t], model.v[t], mask=keyfold.causal())


def test_fork_then_diverging_appends_never_change_the_parent():
    H, D, ps = 2, 8, 4
    pool = PagedKVCache(16, ps, H, D)
    a = pool.new_sequence()
    pool.append(torch.randn(1, H, 6, D), torch.randn(1, H, 6, D), a)  # last page half full
    before_k, before_v = pool.keys(a), pool.values(a)
    kids = [pool.fork(a) for _ in range(3)]
    assert pool.stats().shared == 2
    for i, c in enumerate(kids):
        pool.append(torch.full((1, H, i + 1, D), float(i)), torch.full((1, H, i + 1, D), float(i)), c)
        assert torch.equal(pool.keys(a), before_k) and torch.equal(pool.values(a), before_v)
    pool.append(torch.randn(1, H, 3, D), torch.randn(1, H, 3, D), a)  # the parent diverges too
    for i, c in enumerate(kids):
        assert torch.equal(pool.keys(c)[:, :, :6], before_k)
        assert torch.equal(pool.keys(c)[:, :, 6:], torch.full((1, H, i + 1, D), float(i)))
    assert pool.block_table(kids[0])[0] == pool.block_table(a)[0], "full pages stay shared"
    pool.free(a)
    for c in kids:
        pool.free(c)
    assert pool.stats().free == 16 and pool.stats().used == 0


def test_paged_decode_equals_contiguous_and_coalesces_pages():
    """Sequences growing in lock step keep their pages together: one span each."""
    H, D, ps, S = 2, 16, 8, 4
    pool = PagedKVCache(64, ps, H, D)
    cont = KVCache(S, H, D, 128)
    ids = [pool.new_sequence() for _ in range(S)]
    for _ in range(15):  # 4 sequences, 15 steps of 7 tokens: interleaved allocation
        k, v = torch.randn(S, H, 7, D), torch.randn(S, H, 7, D)
        pool.append(k, v, ids)
        cont.append(k, v)
    assert all(len(g.spans) == 1 for g in pool.pieces(ids))
    q = torch.randn(S, 2 * H, 1, D)
    m = keyfold.window(50)
    got = decode(q, pool, seq_ids=ids, mask=m, score=keyfold.alibi(keyfold.alibi_slopes(2 * H)))
    want = decode(q, cont, mask=m, score=keyfold.alibi(keyfold.alibi_slopes(2 * H)))
    assert (got - want).abs().max() < 1e-5
    for i, s in enumerate(ids):
        assert_rows_by_rule(got[i:i + 1], q[i:i + 1], pool.keys(s), pool.values(s), mask=m,
                   score=keyfold.alibi(keyfold.alibi_slopes(2 * H)))


def test_paged_bad_input_leaves_it_unchanged():
    pool = PagedKVCache(4, 4, 1, 4)
    a, b = pool.new_sequence(), pool.new_sequence()
    pool.append(torch.randn(2, 1, 6, 4), torch.randn(2, 1, 6, 4), [a, b])  # 4 pages used
    c = pool.fork(a)
    snap = snapshot(pool)
    with pytest.raises(CacheFullError, match="needs 1 free pages but the pool has 0"):
        pool.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), c)  # copy-on-write needs a page
    with pytest.raises(CacheFullError, match="free pages"):
        pool.append(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4), [a, b])
    with pytest.raises(KeyError, match="unknown sequence id 7"):
        pool.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), 7)
    with pytest.raises(KeyError, match="unknown sequence id"):
        pool.fork(7)
    with pytest.raises(KeyError, match="unknown sequence id"):
        pool.free(7)
    with pytest.raises(ValueError, match="seq_ids"):
        decode(torch.randn(1, 1, 1, 4), pool)
    assert_unchanged(pool, snap)
    pool.free(b)  # now it fits
    pool.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), c)
    assert pool.length(c) == 7 and pool.length(a) == 6


# ------------------------------------------------------------------------- WindowCache


@pytest.mark.parametrize("W,S,alibi", [(16, 4, False), (7, 0, False), (5, 9, False), (16, 4, True)])
def test_window_cache_equals_masked_attention_at_every_step(W, S, alibi):
    """A long stream, one token per step: each step equals attention over the whole stream."""
    T, H, D = 240, 2, 8
    ks, vs, qs = torch.randn(1, H, T, D), torch.randn(1, H, T, D), torch.randn(1, 2 * H, T, D)
    cache = WindowCache(window=W, sinks=S, heads=H, head_dim=D)
    m = keyfold.causal() & (keyfold.window(W - 1) | keyfold.sinks(S))
    sc = keyfold.alibi(keyfold.alibi_slopes(2 * H)) if alibi else None  # true positions matter
    nbytes = cache.nbytes
    got = []
    for t in range(T):
        cache.append(ks[:, :, t:t + 1], vs[:, :, t:t + 1])
        got.append(decode(qs[:, :, t:t + 1], cache, score=sc))
        held = sum(sp.n for g in cache.pieces() for sp in g.spans)
        assert held == min(t + 1, W + S), "each token held once, S + W at most"
    assert cache.nbytes == nbytes and cache.length == T
    # attention over the full stream with the equivalent mask, all steps at once
    assert_rows_by_rule(torch.cat(got, 2), qs, ks, vs, mask=m, score=sc)


@settings(max_examples=25)
@given(W=st.integers(1, 9), S=st.integers(0, 5), max_block=st.integers(1, 4),
       blocks=st.lists(st.integers(1, 30), min_size=1, max_size=8), alibi=st.booleans())
def test_window_cache_property_any_blocks(W, S, max_block, blocks, alibi):
    """Any block sizes (longer than the ring too), any window/sinks: the last block's queries equal
    attention over the whole stream with the window mask."""
    H, D = 1, 4
    T = sum(blocks)
    ks, vs, qs = torch.randn(1, H, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    cache = WindowCache(window=W, sinks=S, heads=H, head_dim=D, max_block=max_block)
    t = 0
    for n in blocks:
        cache.append(ks[:, :, t:t + n], vs[:, :, t:t + n])
        t += n
    nq = min(max_block, blocks[-1])
    m = keyfold.causal() & (keyfold.window(W - 1) | keyfold.sinks(S))
    sc = keyfold.alibi(keyfold.alibi_slopes(H)) if alibi else None
    got = decode(qs[:, :, T - nq:], cache, score=sc)
    assert_rows_by_rule(got, qs[:, :, T - nq:], ks, vs, mask=m, score=sc)


def test_window_cache_blocks_alibi_and_chunked_prefill():
    """Blocks of tokens (chunked prefill) with max_block, and ALiBi at true positions."""
    W, S, T, H, D = 12, 3, 200, 2, 8
    ks, vs, qs = torch.randn(2, H, T, D), torch.randn(2, H, T, D), torch.randn(2, H, T, D)
    cache = WindowCache(window=W, sinks=S, heads=H, head_dim=D, batch=2, max_block=8)
    m = keyfold.causal() & (keyfold.window(W - 1) | keyfold.sinks(S))
    sc = keyfold.alibi(keyfold.alibi_slopes(H))
    got, t, sizes = [], 0, [3, 8, 1, 5, 8, 2, 7]
    i = 0
    while t < T:
        n = min(sizes[i % len(sizes)], T - t)
        cache.append(ks[:, :, t:t + n], vs[:, :, t:t + n])
        got.append(decode(qs[:, :, t:t + n], cache, score=sc))
        t, i = t + n, i + 1
    assert_rows_by_rule(torch.cat(got, 2), qs, ks, vs, mask=m, score=sc)
    with pytest.raises(ValueError, match="max_block=9"):
        decode(torch.randn(2, H, 9, D), cache)
    cache.append(torch.randn(2, H, 1000, D), torch.randn(2, H, 1000, D))  # one block longer than the ring
    assert cache.length == T + 1000


# ----------------------------------------------------------------------------- cascade


@settings(max_examples=20)
@given(R=st.integers(1, 5), Nq=st.integers(1, 3), P=st.integers(0, 40), data=st.data(),
       mask=st.sampled_from(["none", "causal", "window", "documents", "callable_b"]),
       score=st.sampled_from(["none", "alibi", "callable_b"]))
def test_cascade_equals_attention_over_each_full_copy(R, Nq, P, data, mask, score):
    H, g, D, Smax = 2, 2, 8, 6
    lens = data.draw(st.lists(st.integers(0, Smax), min_size=R, max_size=R), label="suffix_lengths")
    if any(P + x < Nq for x in lens):
        return
    pk, pv = torch.randn(1, H, P, D), torch.randn(1, H, P, D)
    sk, sv = torch.randn(R, H, Smax, D), torch.randn(R, H, Smax, D)
    q = torch.randn(R, H * g, Nq, D)
    m, sc = MASKS[mask](R, P + Smax, H * g), SCORES[score](H * g)
    got = cascade(q, pk, pv, sk, sv, suffix_lengths=lens, mask=m, score=sc)
    for r in range(R):
        k = torch.cat([pk.expand(R, -1, -1, -1), sk[:, :, :lens[r]]], 2)
        v = torch.cat([pv.expand(R, -1, -1, -1), sv[:, :, :lens[r]]], 2)
        qq = torch.zeros_like(q)
        qq[r] = q[r]
        ref = keyfold.attention(qq.double(), k.double(), v.double(), mask=m, score=sc,
                                backend=keyfold.Backend.REFERENCE)[r:r + 1]
        naive = naive_attention(qq, k, v, mask=m, score=sc)[r:r + 1]
        rows = torch.broadcast_to(visible_rows(qq, k, mask=m), q.shape[:3])[r:r + 1]
        assert bool((got[r:r + 1][~rows] == 0).all())
        assert_close_by_rule(got[r:r + 1], ref, naive, rows)


def test_cascade_reads_the_prefix_once():
    """The prefix is one attend call for all requests (counted through the engine)."""
    R, P = 16, 512
    pk, pv = torch.randn(1, 2, P, 8), torch.randn(1, 2, P, 8)
    sk, sv = torch.randn(R, 2, 5, 8), torch.randn(R, 2, 5, 8)
    calls = _split_calls(lambda: cascade(torch.randn(R, 4, 1, 8), pk, pv, sk, sv, mask=keyfold.causal(), splits=1))
    prefix_calls = [c for c in calls if c[1][2] == P]
    assert len(prefix_calls) == 1 and prefix_calls[0][0] == (1, 4, R, 8)
    assert len(calls) == 2  # + one batched call over the equal-length suffixes


def test_cascade_and_state_merge_with_other_pieces():
    """attend_cache gives a State: a cache can be one piece among others (e.g. a new block)."""
    cache = KVCache(1, 2, 8, 32)
    k, v = torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    cache.append(k[:, :, :20], v[:, :, :20])
    q = torch.randn(1, 2, 1, 8)
    past = attend_cache(q, cache)
    new = keyfold.attend(q, k[:, :, 20:], v[:, :, 20:], q_offset=29, kv_offset=20)
    assert_rows_by_rule(keyfold.merge(past, new).out, q, k, v)
    with pytest.raises(ValueError, match="batch 1"):
        cascade(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), k, v)


def test_bench_decode_smoke(tmp_path):
    """The benchmark's sections run end to end on tiny sizes and write md, json and png."""
    import json

    from keyfold.bench import decode as bench
    cfg = dict(quick=True, machine="test", torch=torch.__version__, threads=1, load_before=0.0,
               window=64, sinks=4, stream_tokens=2048)
    res = bench.run(cfg, [256, 512], reps=3, paged_tokens=256, cascade_shape=(2, 128, 8), window_steps=2,
                    progress=False)
    md = bench.write(res, tmp_path, "decode", "test")
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert (tmp_path / "decode.png").stat().st_size > 0 and "## 4. Window cache" in md
    # float32 at every length; bfloat16 and float16 at the long ones; MQA at the longest
    assert [(r["tokens"], r["case"]) for r in saved["decode"]] == [
        (256, "float32"), (512, "float32"), (512, "bfloat16"), (512, "float16"), (512, "MQA float32")]
    assert saved["cascade"]["max_abs_diff"] < 1e-5
    assert [(r["tokens"], r["case"]) for r in saved["scored"]] == [
        (256, "ALiBi float32"), (512, "ALiBi float32"), (256, "ALiBi bfloat16"), (512, "ALiBi bfloat16")]
    assert saved["scored"][0]["max_abs_diff_vs_float64"] < 1e-5 and "### A score modifier: ALiBi" in md
    assert saved["ragged"]["lengths"] == [128, 146, 164, 182, 201, 219, 237, 256]
    assert saved["ragged"]["max_abs_diff"] < 1e-5
    assert len({r["cache_bytes"] for r in saved["window"]}) == 1
    assert [r["tokens"] for r in saved["window"]] == [1024, 2048]


def test_window_cache_bad_input_leaves_it_unchanged():
    cache = WindowCache(window=4, sinks=2, heads=2, head_dim=8, batch=2)
    cache.append(torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8))
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="2 heads of size 8"):
        cache.append(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8))
    with pytest.raises(ValueError, match="2 sequences"):
        cache.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    with pytest.raises(ValueError, match="advance together"):
        decode(torch.randn(1, 2, 1, 8), cache, seq_ids=[1])
    with pytest.raises(ValueError, match="window"):
        WindowCache(window=0, heads=1, head_dim=4)
    assert_unchanged(cache, snap)


def test_cascade_ragged_suffixes_read_only_their_own_lengths():
    R, P, S, D = 5, 64, 7, 8
    pk, pv = torch.randn(1, 2, P, D), torch.randn(1, 2, P, D)
    sk, sv = torch.randn(R, 2, S, D), torch.randn(R, 2, S, D)
    q, lens = torch.randn(R, 2, 1, D), [7, 0, 3, 3, 5]
    calls = _split_calls(lambda: cascade(q, pk, pv, sk, sv, suffix_lengths=lens))
    # the prefix once, then each run of equal lengths: no call reads past a request's length
    assert [c[1] for c in calls] == [(1, 2, P, D), (1, 2, 7, D), (2, 2, 3, D), (1, 2, 5, D)]
    got = cascade(q, pk, pv, sk, sv, suffix_lengths=lens)
    for r, L in enumerate(lens):
        k = torch.cat([pk, sk[r:r + 1, :, :L]], 2)
        v = torch.cat([pv, sv[r:r + 1, :, :L]], 2)
        assert_rows_by_rule(got[r:r + 1], q[r:r + 1], k, v)
    empty_prefix = cascade(q, pk[:, :, :0], pv[:, :, :0], sk, sv)  # no shared prefix at all
    assert_rows_by_rule(empty_prefix[:1], q[:1], sk[:1], sv[:1])


def test_cascade_with_an_empty_prefix_and_a_per_request_mask():
    """An empty shared prefix is no prefix: with a per-request documents mask the prefix's blocks
    were classified anyway and raised IndexError (fuzzing, 2026-12-05)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 1, 8, generator=g)
    pk = torch.randn(1, 1, 0, 8)
    sk, sv = torch.randn(2, 1, 5, 8, generator=g), torch.randn(2, 1, 5, 8, generator=g)
    ids = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    out = cascade(q, pk, pk, sk, sv, mask=keyfold.documents(ids))
    for r in range(2):
        want = keyfold.attention(q[r:r + 1], sk[r:r + 1], sv[r:r + 1], mask=keyfold.documents(ids[r]))
        torch.testing.assert_close(out[r:r + 1], want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("where", ["empty cache", "every key hidden", "cascade, every key hidden"])
def test_a_result_of_no_visible_key_takes_backward_with_zero_gradients(where):
    """As attention over keys that are all hidden does: out 0, and backward gives q (and the
    prefix's k and v) zero gradients. decode, attend_cache and cascade returned an out outside the
    graph there, and backward raised (fuzzing, 2026-12-06)."""
    q = torch.randn(1, 2, 1, 8, requires_grad=True)
    if where == "empty cache":
        out, grads = decode(q, KVCache(1, 2, 8, 4)), (q,)
    elif where == "every key hidden":
        cache = KVCache(1, 2, 8, 4)
        cache.append(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
        out, grads = decode(q, cache, mask=keyfold.sinks(0)), (q,)
    else:
        pk, pv = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(2))
        out = cascade(q, pk, pv, torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), mask=keyfold.sinks(0))
        grads = (q, pk, pv)
    assert bool((out == 0).all())
    for g in torch.autograd.grad(out.sum(), grads):
        assert bool((g == 0).all())


# A split decode merges its chunks' states, each weighed by exp(lse - lse_total): a float32 lse carries
# 2^-24 |lse| (4e-6 at 65) into out, so the chunks' lse come in float64 (engine.attend_wide); and a GQA
# group's rows stay a group of query heads of each chunk (folded into one head's rows, torch's GEMM of
# more than 5 rows summed them less exactly than the naive's of a head's own rows). Each case broke the
# rule on the code before (1.55-3.42x the allowance on the Intel Xeon, 2026-12-07; a fuzz of 600
# such decodes found 49 of 400 GQA and 5 of 600 MHA ones past it, now only those that one attention
# call over the same keys breaks too, at scores near 100).
@pytest.mark.parametrize("seed, Hkv, g, Nq, D, n, spread, splits", [
    (128, 1, 1, 2, 64, 300, 30, 2), (125, 2, 1, 1, 128, 3000, 20, 3), (55, 2, 1, 1, 128, 3000, 20, 3),
    (45, 2, 2, 3, 128, 64, 20, 4), (93, 2, 4, 2, 64, 64, 20, 3), (186, 2, 4, 3, 128, 64, 30, 2),
    (246, 1, 4, 3, 128, 64, 30, 3)])
def test_float32_split_decodes_hold_the_rule_at_large_scores(seed, Hkv, g, Nq, D, n, spread, splits):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hkv * g, Nq, D, generator=gen) * spread  # scores of std `spread`
    k, v = (torch.randn(1, Hkv, n, D, generator=gen) for _ in range(2))
    cache = KVCache(1, Hkv, D, n)
    cache.append(k, v)
    assert_rows_by_rule(decode(q, cache, splits=splits), q, k, v)


@pytest.mark.parametrize("seed, H, R, n, D, std, splits", [(71, 4, 3, 3000, 128, 30, 5), (175, 2, 2, 3000, 128, 20, 3)])
def test_split_decodes_that_autograd_records_merge_a_float64_lse(seed, H, R, n, D, std, splits):
    """A decode whose q requires grad ran its chunks through autograd with attend's float32 lse, which a
    merge carries into out (2^-24 |lse|): 2 of 300 such float32 split decodes past the rule at score std
    5-30 (1.33x, 1.65x; these seeds), none of the same decodes without grad. The autograd function now
    gives attend_wide's float64 lse too (its backward reads it in float32): 0 of 300, gradients as before."""
    from keyfold.engine import attend_wide
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, H, R, D, generator=g) * std ** 0.5).requires_grad_()
    k = torch.randn(1, H, n, D, generator=g) * std ** 0.5
    v = torch.randn(1, H, n, D, generator=g)
    cache = KVCache(1, H, D, n)
    cache.append(k, v)
    got = decode(q, cache, splits=splits)
    assert got.requires_grad
    assert_rows_by_rule(got.detach(), q.detach(), k, v)
    got.sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32 and bool(torch.isfinite(q.grad).all())
    assert attend_wide(q, k, v).lse.dtype == torch.float64


def test_merged_decode_states_keep_a_float64_lse_until_they_return():
    """The states decoding merges carry lse in float64 beside a float32 out; what decode, attend_cache and
    cascade return has lse in out's dtype again, equal to one call's to float32 rounding."""
    from keyfold.engine import attend_wide
    q, k, v = torch.randn(1, 2, 3, 16) * 8, torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    for backend in (keyfold.Backend.AUTO, keyfold.Backend.TILES):
        wide = attend_wide(q, k, v, backend=backend)
        st = keyfold.attend(q, k, v, backend=backend)
        assert wide.out.dtype == torch.float32 and wide.lse.dtype == torch.float64
        torch.testing.assert_close(wide.out, st.out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(wide.lse, st.lse.double(), atol=1e-4, rtol=1e-6)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):  # 16-bit: float32 out, never 16-bit pieces
        w = attend_wide(q.to(dtype), k.to(dtype), v.to(dtype))
        assert w.lse.dtype == torch.float64
        assert w.out.dtype == (torch.float64 if dtype is torch.float64 else torch.float32)
    cache = KVCache(1, 2, 16, 300)
    cache.append(k, v)
    out, lse = decode(q, cache, splits=3, return_lse=True)
    whole = keyfold.attend(q, k, v)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(lse, whole.lse, atol=1e-4, rtol=1e-6)
    st = attend_cache(q, cache, splits=4)
    assert st.lse.dtype == torch.float32
    out, lse = cascade(q[:1], k[:, :, :200], v[:, :, :200], k[:, :, 200:], v[:, :, 200:], return_lse=True)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse, whole.lse, atol=1e-4, rtol=1e-6)


# 16-bit pieces that a decode merges ran on the fused op in 16 bits, each piece's out rounded to 16 bits
# before the merge (one rounding per piece where the naive attention rounds once): they now run in
# float32 (the decode kernel, or the naive's arithmetic on widened inputs). Each case broke the rule on
# the code before (1.01-1.04x the allowance on the Intel Xeon, 2026-12-07; 5 of 4,800 short 16-bit
# decodes in a fuzz, none since) while one attention call over the same keys held it (0.40-0.50).
@pytest.mark.parametrize("kind, seed, dtype, Hkv, g, Nq, D, n, spread, extra", [
    ("window", 503, torch.float16, 1, 1, 2, 64, 90, 2, (8, 16)),
    ("cascade", 18, torch.float16, 1, 1, 3, 128, 20, 1, None),
    ("window", 457, torch.bfloat16, 1, 2, 2, 128, 40, 1, (8, 1)),
    ("splits", 515, torch.bfloat16, 1, 2, 2, 64, 13, 1, 5),
    ("splits", 521, torch.bfloat16, 1, 1, 2, 128, 90, 3, 3)])
def test_16bit_decodes_that_merge_pieces_hold_the_rule(kind, seed, dtype, Hkv, g, Nq, D, n, spread, extra):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, Hkv * g, Nq, D, generator=gen) * spread).to(dtype)
    k, v = (torch.randn(1, Hkv, n, D, generator=gen).to(dtype) for _ in range(2))
    mask = None
    if kind == "window":
        W, S = extra
        cache = WindowCache(W, S, heads=Hkv, head_dim=D, max_block=Nq, dtype=dtype)
        for a in range(0, n, 7):
            cache.append(k[:, :, a:a + 7], v[:, :, a:a + 7])
        got, mask = decode(q, cache), cache.mask
    elif kind == "cascade":
        P = n // 2
        got = cascade(q, k[:, :, :P], v[:, :, :P], k[:, :, P:], v[:, :, P:])
    else:
        cache = KVCache(1, Hkv, D, n, dtype=dtype)
        cache.append(k, v)
        got = decode(q, cache, splits=extra)
    assert_rows_by_rule(got, q, k, v, mask=mask)


def test_a_split_decode_folds_its_chunks_on_a_cache_with_room_left():
    """Split-KV runs its chunks as key/value heads of one call when the cache's keys view as
    ``(b * Hkv, s, n / s, D)``, which a cache holding fewer tokens than its capacity does: a layout
    ``(b, Hkv * s, ...)`` did not (a review, 2026-12-07), so eager decoding fell back to one call per
    chunk (1.13-1.41x the time) and torch.compile of the decode raised. GQA groups stay query heads."""
    cache = KVCache(1, 2, 32, 300)
    k, v = torch.randn(1, 2, 201, 32), torch.randn(1, 2, 201, 32)
    cache.append(k, v)
    q = torch.randn(1, 4, 1, 32)
    calls = _split_calls(lambda: decode(q, cache, splits=3))
    assert calls == [((2, 6, 1, 32), (2, 3, 67, 32))]
    assert_rows_by_rule(decode(q, cache, splits=3), q, k, v)
    compiled = torch.compile(lambda q: decode(q, cache, splits=3))
    torch.testing.assert_close(compiled(q), decode(q, cache, splits=3), atol=1e-6, rtol=1e-6)


def test_merged_pieces_of_few_keys_hold_the_rule():
    """A merged piece of few keys (a window cache's 4 sinks, chunks of 3-4 keys) ran torch's matmul of a
    small product, which sums each score in one chain: 4.0-5.0x the rule's allowance where one attention
    call held it (a review's reproducers, 2026-12-07); such pieces now compute in float64."""
    g = torch.Generator().manual_seed(90)
    k, v = torch.randn(1, 2, 400, 64, generator=g), torch.randn(1, 2, 400, 64, generator=g)
    q = torch.randn(1, 2, 1, 64, generator=g) * 10
    cache = WindowCache(128, 4, heads=2, head_dim=64, max_block=2)  # sinks and band: separate pieces
    cache.append(k, v)
    assert_rows_by_rule(decode(q, cache), q, k, v, mask=cache.mask)
    g = torch.Generator().manual_seed(20954)
    q = torch.randn(3, 4, 1, 64, generator=g) * 30
    k, v = torch.randn(3, 2, 27, 64, generator=g), torch.randn(3, 2, 27, 64, generator=g)
    cache = KVCache(3, 2, 64, 32)
    cache.append(k, v)
    out = decode(q, cache, splits=7)
    for b in range(3):
        assert_rows_by_rule(out[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1])


@pytest.mark.parametrize("seed, B, H, Nq, D, n, cap, splits, spread", [
    (1111, 1, 2, 2, 128, 200, 200, 3, 30), (303, 3, 1, 4, 96, 333, 383, 5, 20)])
def test_split_chunks_whose_batch_dims_do_not_flatten_hold_the_rule(seed, B, H, Nq, D, n, cap, splits, spread):
    """Split-KV's chunks of a cache with room left (or with leftover keys) view as (b*Hkv, s, c, D) with
    batch dims that do not merge into one stride: torch's matmul copied such keys to a layout whose GEMM
    summed each score over the head dimension in one chain (1.30-1.89x the rule's allowance where one
    attention call held it, and 16-25x the time; a review, 2026-12-07); they are multiplied batch by batch."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=gen) * spread
    k, v = torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)
    cache = KVCache(B, H, D, cap)
    cache.append(k, v)
    out = decode(q, cache, splits=splits)
    for b in range(B):
        assert_rows_by_rule(out[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1])


@pytest.mark.parametrize("keys", [5, 700])  # the float64 path of small pieces, and the float32 one
def test_wide_pieces_give_rows_that_see_no_key_zero_and_keep_nan(keys):
    """cpu._wide_piece (the merged pieces the fused op would have run) gives a row whose every score is -inf
    (a mask, or infinite keys, which the op and the kernels take as hidden) out 0 and lse -inf, and a row
    with a NaN input NaN, as the op does."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 64, generator=g) for _ in range(3))
    k, v = torch.randn(1, 2, keys, 64, generator=g), torch.randn(1, 2, keys, 64, generator=g)
    k[0, 0] = float("-inf") * torch.sign(q[0, 0, 0]).expand(keys, 64)   # head 0, row 0: every score -inf
    q[0, 1, 2, 0] = float("nan")
    mask = torch.zeros(1, 1, 3, keys)
    mask[..., 1, :] = float("-inf")                                     # row 1 hidden
    out, lse = cpu._wide_piece(q, k, v, False, mask, 0.125)
    assert out.dtype == torch.float32 and lse.dtype == torch.float64
    assert bool((out[0, 0, 0] == 0).all()) and float(lse[0, 0, 0]) == float("-inf")
    # (head 0's other rows meet its infinite keys with mixed signs: inf - inf, NaN, as in the op)
    assert bool((out[0, 1, 1] == 0).all()) and float(lse[0, 1, 1]) == float("-inf")
    assert bool(torch.isnan(out[0, 1, 2]).all()) and bool(torch.isnan(lse[0, 1, 2]))
    assert bool(torch.isfinite(out[0, 1, :2]).all())
    out, lse = cpu._wide_piece(q, k, v, False, None, 0.125)   # no mask: the infinite keys alone hide row 0
    assert bool((out[0, 0, 0] == 0).all()) and float(lse[0, 0, 0]) == float("-inf")


@pytest.mark.parametrize("seed, R, Hkv, S", [(9, 4, 8, 16), (20, 4, 8, 16), (23, 4, 8, 16), (29, 4, 8, 16),
                                             (32, 4, 8, 16), (39, 4, 8, 16), (3, 16, 2, 8), (8, 16, 2, 8)])
def test_a_float32_cascade_at_sharp_scores_holds_the_rule(seed, R, Hkv, S):
    """cascade's prefix call folds the requests' query rows into one call, which ran on the decode kernel's
    float32 scores (4 rows over the prefix), summed in another order than the naive attention's one row
    over all its keys: past a few units of score spread that rounding is what the rule measures, and 47
    of 200 cascades (4 requests, 1,000-token prefix, head size 128, scores of std 30) broke it, up to 5.7x,
    where one attention call a request held it (these seeds: 1.2-2.2x on the Intel Xeon, 2026-12-07).
    Merged float32 pieces now take exact scores (double sums of the exact float32 products): 0 of 200.
    16 requests over GQA groups of 4 (64 rows in the prefix call): 7 of 12 before, 0 of 60 after."""
    g = torch.Generator().manual_seed(seed)
    H, P, D = 8, 1000, 128
    q = torch.randn(R, H, 1, D, generator=g) * 30 ** 0.5
    pk, pv = torch.randn(1, Hkv, P, D, generator=g) * 30 ** 0.5, torch.randn(1, Hkv, P, D, generator=g)
    sk, sv = torch.randn(R, Hkv, S, D, generator=g) * 30 ** 0.5, torch.randn(R, Hkv, S, D, generator=g)
    got = cascade(q, pk, pv, sk, sv, mask=keyfold.causal())
    for r in range(R):
        assert_rows_by_rule(got[r:r + 1], q[r:r + 1], torch.cat([pk, sk[r:r + 1]], 2),
                            torch.cat([pv, sv[r:r + 1]], 2), mask=keyfold.causal())


@pytest.mark.parametrize("case", ["65 requests", "GQA 8, 8 tokens, ALiBi"])
def test_a_float32_cascade_past_64_prefix_rows_holds_the_rule(case):
    """Past 64 rows a key/value head in the prefix call (65 one-token requests; 3 requests of 8 tokens over
    GQA groups of 8, 192 rows) the folded rows left the decode kernel's exact scores for float32 sums over
    every request's rows (torch's matmul, or the prefill kernel under ALiBi): 53 of 400 random cascades of
    8-130 requests past the rule, up to 3.1x (14x against one request's own naive error; a review,
    2026-12-07). float32 prefix calls now take at most decoding.CASCADE_ROWS rows a key/value head: 0 of
    400, the prefix read once a call."""
    g = torch.Generator().manual_seed(0 if case == "65 requests" else 380)
    if case == "65 requests":
        R, Hkv, Hq, D, Dv, Nq, P, S, std, kw = 65, 2, 2, 128, 128, 1, 200, 5, 10.0, {}
    else:
        R, Hkv, Hq, D, Dv, Nq, P, S, std = 3, 3, 24, 256, 48, 8, 200, 21, 3.0
        kw = {"score": keyfold.alibi(keyfold.alibi_slopes(Hq))}
    pk, pv = torch.randn(1, Hkv, P, D, generator=g) * std ** 0.5, torch.randn(1, Hkv, P, Dv, generator=g)
    sk, sv = torch.randn(R, Hkv, S, D, generator=g) * std ** 0.5, torch.randn(R, Hkv, S, Dv, generator=g)
    q = torch.randn(R, Hq, Nq, D, generator=g) * std ** 0.5
    calls = _split_calls(lambda: cascade(q, pk, pv, sk, sv, splits=1, **kw))
    per = max(1, decoding.CASCADE_ROWS // (Nq * Hq // Hkv))
    assert len([c for c in calls if c[1][2] == P]) == -(-R // per) > 1
    got = cascade(q, pk, pv, sk, sv, **kw)
    for r in range(R):
        assert_rows_by_rule(got[r:r + 1], q[r:r + 1], torch.cat([pk, sk[r:r + 1]], 2),
                            torch.cat([pv, sv[r:r + 1]], 2), **kw)


@pytest.mark.parametrize("kind, seed", [("split", 139), ("split", 175), ("split", 201),
                                        ("window", 4), ("window", 18), ("window", 22)])
def test_float32_score_callables_in_merged_decodes_hold_the_rule(kind, seed):
    """Pieces with a score callable (softcap) run the tile kernel, whose float32 scores rounded apart from
    the naive attention's: where a decode merges them (split-KV over 13 keys in 7 chunks, a window cache's
    sinks and band) 5 of 300 split decodes and 23 of 300 window decodes broke the rule, up to 1.7x (these
    seeds, Intel Xeon, 2026-12-07). Under wide_lse the tile kernel now takes exact scores (float64
    products, the callable and the row max in float64): 0 of 300 each."""
    g = torch.Generator().manual_seed(seed)
    if kind == "split":
        q = torch.randn(2, 8, 1, 64, generator=g) * 10
        k, v = torch.randn(2, 2, 13, 64, generator=g), torch.randn(2, 2, 13, 32, generator=g)
        cache = KVCache(2, 2, 64, 13, value_dim=32)
        cache.append(k, v)
        score = keyfold.softcap(10.0)
        assert_rows_by_rule(decode(q, cache, score=score, splits=7), q, k, v, score=score)
    else:
        q = torch.randn(1, 8, 1, 96, generator=g) * 5
        k, v = torch.randn(1, 2, 20, 96, generator=g), torch.randn(1, 2, 20, 96, generator=g)
        cache = WindowCache(8, 8, heads=2, head_dim=96)
        cache.append(k, v)
        score = keyfold.softcap(30.0)
        assert_rows_by_rule(decode(q, cache, score=score), q, k, v, mask=cache.mask, score=score)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoding_step_with_a_score_over_a_long_cache_is_one_piece(dtype):
    """A score's pieces were cut at 1,024 keys whatever their rows (the tile area a 256-row block needs):
    one ALiBi decoding row over 16k keys ran as 16 pieces merged, 2.1-3.9x SDPA's time with the bias as
    a mask (a review, 2026-12-07). A piece of fewer rows may span as many more keys: one piece here."""
    from keyfold.engine import Backend, _Call
    g = torch.Generator().manual_seed(3)
    H, L = 4, 5000
    q, k, v = torch.randn(1, H, 1, 32, generator=g), torch.randn(1, H, L, 32, generator=g), torch.randn(1, H, L, 32, generator=g)
    score = keyfold.alibi(keyfold.alibi_slopes(H))
    call = _Call(q.to(dtype), k.to(dtype), v.to(dtype), None, score, None, None, 0, Backend.AUTO, None, False)
    assert len(call.plan.pieces) == 1
    cache = KVCache(batch=1, heads=H, head_dim=32, capacity=L, dtype=dtype)
    cache.append(k.to(dtype), v.to(dtype))
    got = decode(q.to(dtype), cache, score=score)
    bias = -keyfold.alibi_slopes(H).view(1, H, 1, 1) * torch.arange(L - 1, -1, -1).view(1, 1, 1, L)

    def plain(t):
        s = q.to(dtype).to(t) @ k.to(dtype).to(t).mT * 32 ** -0.5 + bias.to(t)
        return torch.softmax(s, -1) @ v.to(dtype).to(t)
    assert_close_by_rule(got, plain(torch.float64), plain(dtype), None)


def test_decode_and_cascade_raise_for_a_preset_whose_tensor_changed():
    """decode() classified each span with the preset's old copy and attended a span it called full with no
    mask, past the engine's check: a padding(lengths) buffer changed in place gave 0.85-0.89 off, or zeros
    for a row that now sees keys (a review, 2026-12-08). The caches check at their entry now."""
    kf = keyfold
    from keyfold.caches import KVCache, cascade, decode
    H, D, N = 2, 16, 10
    k, v, q = torch.randn(1, H, N, D), torch.randn(1, H, N, D), torch.randn(1, H, 1, D)
    cache = KVCache(batch=1, heads=H, head_dim=D, capacity=16)
    cache.append(k, v)
    for start, then in ((N, 4), (0, N)):
        lengths = torch.tensor([start])
        mask = kf.padding(lengths)
        decode(q, cache, mask=mask)
        lengths.fill_(then)
        with pytest.raises(ValueError, match="changed in place"):
            decode(q, cache, mask=mask)
    ids = torch.zeros(12, dtype=torch.long)
    mask = kf.documents(ids)
    cascade(q, k[:, :, :8], v[:, :, :8], k[:, :, 8:].expand(1, H, 2, D), v[:, :, 8:].expand(1, H, 2, D), mask=mask)
    ids[9:] = 1
    with pytest.raises(ValueError, match="changed in place"):
        cascade(q, k[:, :, :8], v[:, :, :8], k[:, :, 8:].expand(1, H, 2, D), v[:, :, 8:].expand(1, H, 2, D), mask=mask)


def test_truncate_rolls_back_draft_tokens():
    """Speculative decoding drops the draft tokens the target rejected: truncate keeps a prefix of each
    sequence (zeroing the rest), and the next decode equals attention over what is kept; a paged fork
    keeps its own tokens, pages past the kept ones return to the pool; growing or negative lengths raise."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)
    q = torch.randn(2, 2, 1, 8, generator=g)
    cache = KVCache(2, 2, 8, 16)
    cache.append(k, v)
    cache.truncate([9, 5])
    assert cache.lengths == (9, 5) and bool((cache.k[1, :, 5:] == 0).all())
    got = decode(q, cache)
    for b, n in ((0, 9), (1, 5)):
        torch.testing.assert_close(got[b:b + 1], keyfold.attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n]))
    cache.append(k[:, :, :2], v[:, :, :2])
    assert cache.lengths == (11, 7)
    for bad in ([12, 5], [-1, 0], 20):
        with pytest.raises(ValueError, match="truncate"):
            cache.truncate(bad)
    assert cache.lengths == (11, 7)

    pool = PagedKVCache(num_pages=8, page_size=4, heads=2, head_dim=8)
    a = pool.new_sequence()
    pool.append(k[:1], v[:1], [a])
    b = pool.fork(a)
    pool.truncate(b, 6)  # pages 3 of a: b keeps 2, its last one still shared
    assert pool.length(a) == 12 and pool.length(b) == 6 and pool.stats().used == 3
    pool.append(k[1:, :, :3], v[1:, :, :3], [b])  # copies the shared page first
    torch.testing.assert_close(pool.keys(a), k[:1])
    torch.testing.assert_close(pool.keys(b), torch.cat([k[:1, :, :6], k[1:, :, :3]], 2))
    pool.truncate(a, 1)
    assert pool.stats().used == 3  # a's first page (shared with b) + b's two
    with pytest.raises(ValueError, match="truncate"):
        pool.truncate(a, 2)
    out = decode(q, pool, seq_ids=[a, b])
    torch.testing.assert_close(out[:1], keyfold.attention(q[:1], k[:1, :, :1], v[:1, :, :1]))


def test_paged_stats_count_the_tokens_sequences_hold_after_truncate_and_free():
    """A sequence truncated into a page it shares with a fork, the fork then freed: stats() counted the fork's
    tokens still (8 where 6 are held, wasted 0 where 2; a review, 2026-12-08)."""
    pool = PagedKVCache(num_pages=4, page_size=4, heads=1, head_dim=4)
    a = pool.new_sequence()
    pool.append(torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4), [a])
    b = pool.fork(a)
    pool.truncate(a, 6)
    pool.free(b)
    st = pool.stats()
    assert (st.used, st.tokens, st.wasted) == (2, 6, 2)
