"""Faults in the memory wall: reused slots, padding, tensors on the wrong device, and a random walk
of resets, forks and frees against a fresh-cache oracle.

An old request's NaN is the probe throughout: if any of it is read (even hidden, ``0 * NaN``),
a later request's output turns NaN.
"""

from __future__ import annotations

import random

import pytest
import torch

import keyfold
from keyfold.caches import KVCache, PagedKVCache, WindowCache, cascade, decode

H, D = 2, 8


def _kv(b, n, *, poison=False, gen=None):
    k = torch.randn(b, H, n, D, generator=gen)
    v = torch.randn(b, H, n, D, generator=gen)
    if poison:
        v[..., 0] = float("nan")
        k[..., 1] = float("inf")
    return k, v


def _fresh_decode(q_row, k, v):
    """The oracle: one fresh cache holding only this sequence's tokens."""
    c = KVCache(batch=1, heads=H, head_dim=D, capacity=max(k.shape[2], 1))
    if k.shape[2]:
        c.append(k, v)
    return decode(q_row, c)


# ------------------------------------------------------------- 6. a reset slot is a fresh slot


def test_reset_slot_does_not_leak_the_old_requests_values():
    cache = KVCache(batch=2, heads=H, head_dim=D, capacity=16)
    cache.append(*_kv(2, 10, poison=True))          # the old requests held NaN / inf
    cache.reset()
    k0, v0 = _kv(1, 3)
    k1, v1 = _kv(1, 7)
    cache.append(k0, v0, seq_ids=[0])
    cache.append(k1, v1, seq_ids=[1])                # lengths 3 and 7: the ragged path reads 7 for row 0
    q = torch.randn(2, H, 1, D)
    out = decode(q, cache)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0:1], _fresh_decode(q[0:1], k0, v0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:2], _fresh_decode(q[1:2], k1, v1), atol=1e-5, rtol=1e-5)
    fresh = KVCache(batch=2, heads=H, head_dim=D, capacity=16)
    fresh.append(k0, v0, seq_ids=[0])
    fresh.append(k1, v1, seq_ids=[1])
    assert torch.equal(cache.k, fresh.k) and torch.equal(cache.v, fresh.v)   # indistinguishable


def test_reset_of_one_row_keeps_the_others():
    cache = KVCache(batch=3, heads=H, head_dim=D, capacity=8)
    k, v = _kv(3, 5)
    cache.append(k, v)
    cache.reset([1])
    assert cache.lengths == (5, 0, 5)
    assert torch.equal(cache.keys(0), k[0:1]) and torch.equal(cache.values(2), v[2:3])
    assert not cache.k[1].any() and not cache.v[1].any()


# ---------------------------------------------------------- 7. cascade never reads past a length


def test_cascade_does_not_read_padding_past_suffix_lengths():
    g = torch.Generator().manual_seed(0)
    R, P, S = 3, 12, 6
    q = torch.randn(R, H, 1, D, generator=g)
    pk, pv = torch.randn(1, H, P, D, generator=g), torch.randn(1, H, P, D, generator=g)
    sk, sv = torch.full((R, H, S, D), float("nan")), torch.full((R, H, S, D), float("nan"))   # torch.empty-like
    lens = [2, 6, 4]
    for r, n in enumerate(lens):
        sk[r, :, :n], sv[r, :, :n] = torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g)
    out = cascade(q, pk, pv, sk, sv, suffix_lengths=lens)
    assert torch.isfinite(out).all()
    for r, n in enumerate(lens):
        full = keyfold.attention(q[r:r + 1], torch.cat([pk, sk[r:r + 1, :, :n]], 2),
                                 torch.cat([pv, sv[r:r + 1, :, :n]], 2))
        torch.testing.assert_close(out[r:r + 1], full, atol=1e-5, rtol=1e-5)


# ------------------------------------------------- 8. a tensor on the wrong device changes nothing


def _paged_state(pool):
    return (pool.stats(), {s: pool.block_table(s) for s in pool.sequences},
            {s: pool.length(s) for s in pool.sequences}, pool.k_pages.clone(), pool.v_pages.clone())


@pytest.mark.parametrize("ids, L, Nq", [([0, 0, 1, 1, 1, 2], 2, 4), ([1, 0, 0], 3, 6)])
def test_documents_with_more_queries_than_tokens_is_refused_as_attention_refuses_it(ids, L, Nq):
    """decode classified a documents mask over the spans before the engine checked the positions:
    with more queries than the sequence has tokens (query positions below 0) it raised an IndexError
    from a reduction over an empty slice (found by a helper's cache fuzz). Now the engine's ValueError,
    naming q_offset, as keyfold.attention gives for the same call."""
    c = KVCache(batch=1, heads=H, head_dim=D, capacity=16)
    k, v = _kv(1, L)
    c.append(k, v)
    q = torch.randn(1, H, Nq, D)
    mask = keyfold.documents(torch.tensor(ids))
    with pytest.raises(ValueError, match="q_offset") as got:
        decode(q, c, mask=mask)
    with pytest.raises(ValueError) as want:
        keyfold.attention(q, k, v, mask=mask)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("which", ["k", "v"])
def test_paged_append_on_the_wrong_device_raises_before_changing_anything(which):
    pool = PagedKVCache(num_pages=6, page_size=4, heads=H, head_dim=D)
    a = pool.new_sequence()
    pool.append(*_kv(1, 3), a)
    b = pool.fork(a)
    before = _paged_state(pool)
    k, v = _kv(1, 6)
    bad = {"k": (k.to("meta"), v), "v": (k, v.to("meta"))}[which]
    with pytest.raises(ValueError, match=rf"append\({which}\).*meta.*cpu"):
        pool.append(*bad, b)
    after = _paged_state(pool)
    assert after[:3] == before[:3] and torch.equal(after[3], before[3]) and torch.equal(after[4], before[4])
    pool.append(k, v, b)                             # and the pool still works
    assert pool.length(b) == 9 and pool.stats().free == before[0].free - 3   # a copy-on-write page + 2


@pytest.mark.parametrize("shared", [False, True])
def test_paged_append_whose_write_raises_changes_nothing(shared):
    """A pool made under inference_mode, one append outside it: the tensor write raises after the page
    was taken. The page stayed in the block table at the old length, and after a fork the child's
    copy-on-write copied that empty page, not the partly filled one: the child decoded its parent's
    token (error 0.76; a review, 2026-12-07). Now the pool is as before, and a fork decodes right."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        pool = PagedKVCache(num_pages=16, page_size=4, heads=H, head_dim=D)
        a = pool.new_sequence()
        ka, va = _kv(1, 8 if not shared else 6, gen=gen)
        pool.append(ka, va, a)
        other = pool.fork(a) if shared else None    # a shared, partly filled last page: the write copies it
    before = _paged_state(pool)
    with torch.no_grad(), pytest.raises(RuntimeError, match="[Ii]nference"):
        pool.append(*_kv(1, 3, gen=gen), a)
    after = _paged_state(pool)
    assert after[:3] == before[:3]                   # tables, lengths, pages free and shared
    assert torch.equal(pool.keys(a), ka) and torch.equal(pool.values(a), va)   # what is read
    with torch.inference_mode():
        k1, v1 = _kv(1, 1, gen=gen)
        pool.append(k1, v1, a)
        b = pool.fork(a)
        kb, vb = _kv(1, 3, gen=gen)
        pool.append(kb, vb, b)
        ka2, va2 = _kv(1, 1, gen=gen)
        pool.append(ka2, va2, a)
        q = torch.randn(2, H, 1, D, generator=gen)
        got = decode(q, pool, seq_ids=[a, b])
    hist_a = (torch.cat([ka, k1, ka2], 2), torch.cat([va, v1, va2], 2))
    hist_b = (torch.cat([ka, k1, kb], 2), torch.cat([va, v1, vb], 2))
    for i, (s, (k, v)) in enumerate([(a, hist_a), (b, hist_b)]):
        assert torch.equal(pool.keys(s), k) and torch.equal(pool.values(s), v)
        torch.testing.assert_close(got[i:i + 1], _fresh_decode(q[i:i + 1], k, v))
    if other is not None:
        assert torch.equal(pool.keys(other), ka)


@pytest.mark.parametrize("make", [lambda: KVCache(batch=2, heads=H, head_dim=D, capacity=8),
                                  lambda: WindowCache(4, 1, heads=H, head_dim=D, batch=2)])
def test_contiguous_and_window_append_on_the_wrong_device_changes_nothing(make):
    cache = make()
    cache.append(*_kv(2, 3))
    snap = [t.clone() for t in (getattr(cache, "k", None), getattr(cache, "v", None),
                                getattr(cache, "k_buf", None), getattr(cache, "v_buf", None)) if t is not None]
    length = getattr(cache, "lengths", getattr(cache, "length", None))
    k, v = _kv(2, 2)
    with pytest.raises(ValueError, match=r"append\(k\).*device meta.*cache\.device"):
        cache.append(k.to("meta"), v)
    now = [t for t in (getattr(cache, "k", None), getattr(cache, "v", None),
                       getattr(cache, "k_buf", None), getattr(cache, "v_buf", None)) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(snap, now))
    assert getattr(cache, "lengths", getattr(cache, "length", None)) == length


# ------------------------------------- every slot reused after reset / fork / free, random order


@pytest.mark.parametrize("seed", range(2))
def test_paged_random_walk_of_forks_and_frees_matches_fresh_caches(seed):
    """200 random operations; poisoned sequences (NaN values) are freed while clean ones live on.
    Every clean live sequence must decode exactly as a fresh cache holding only its tokens."""
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    pool = PagedKVCache(num_pages=12, page_size=4, heads=H, head_dim=D)
    oracle: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}     # id -> (k, v, poisoned)
    checks = 0
    for step in range(200):
        op = rnd.choice(["new", "append", "append", "fork", "free", "decode"])
        live = pool.sequences
        if op == "new" or not live:
            s = pool.new_sequence()
            oracle[s] = (torch.zeros(1, H, 0, D), torch.zeros(1, H, 0, D), rnd.random() < 0.3)
        elif op == "append":
            s = rnd.choice(live)
            k0, v0, bad = oracle[s]
            k, v = _kv(1, rnd.randint(1, 6), poison=bad, gen=gen)
            try:
                pool.append(k, v, s)
            except keyfold.caches.CacheFullError:
                continue
            oracle[s] = (torch.cat([k0, k], 2), torch.cat([v0, v], 2), bad)
        elif op == "fork":
            s = rnd.choice(live)
            oracle[pool.fork(s)] = oracle[s]
        elif op == "free":
            s = rnd.choice(live)
            pool.free(s)
            del oracle[s]
        else:
            clean = [s for s in live if not oracle[s][2] and oracle[s][0].shape[2]]
            if not clean:
                continue
            q = torch.randn(len(clean), H, 1, D, generator=gen)
            out = decode(q, pool, seq_ids=clean)
            for i, s in enumerate(clean):
                want = _fresh_decode(q[i:i + 1], *oracle[s][:2])
                torch.testing.assert_close(out[i:i + 1], want, atol=1e-5, rtol=1e-5, msg=f"step {step} seq {s}")
                assert torch.equal(pool.keys(s), oracle[s][0]) and torch.equal(pool.values(s), oracle[s][1])
                checks += 1
        st = pool.stats()
        assert st.used + st.free == st.pages and st.sequences == len(oracle)
    assert checks > 20


@pytest.mark.parametrize("seed", range(2))
def test_contiguous_random_walk_of_resets_and_reorders_matches_fresh_caches(seed):
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    B, C = 4, 16
    cache = KVCache(batch=B, heads=H, head_dim=D, capacity=C)
    rows = [(torch.zeros(1, H, 0, D), torch.zeros(1, H, 0, D), False) for _ in range(B)]
    checks = 0
    for step in range(200):
        op = rnd.choice(["append", "append", "reset", "reorder", "decode"])
        if op == "append":
            ids = sorted(rnd.sample(range(B), rnd.randint(1, B)))
            n = rnd.randint(1, 5)
            lens = [min(rnd.randint(0, n), C - rows[s][0].shape[2]) for s in ids]
            k, v = _kv(len(ids), n, gen=gen)
            for i, s in enumerate(ids):
                if rows[s][2] or rnd.random() < 0.15:    # this request goes bad: NaN in its own tokens
                    k[i, :, :, 1], v[i, :, :, 0] = float("inf"), float("nan")
            cache.append(k, v, seq_ids=ids, lengths=lens)
            for i, (s, m) in enumerate(zip(ids, lens)):
                bad = rows[s][2] or bool(m and not torch.isfinite(v[i, :, :m]).all())
                rows[s] = (torch.cat([rows[s][0], k[i:i + 1, :, :m]], 2), torch.cat([rows[s][1], v[i:i + 1, :, :m]], 2),
                           bad)
        elif op == "reset":
            ids = sorted(rnd.sample(range(B), rnd.randint(1, B)))
            cache.reset(ids)
            for s in ids:
                rows[s] = (torch.zeros(1, H, 0, D), torch.zeros(1, H, 0, D), False)
        elif op == "reorder":
            idx = [rnd.randrange(B) for _ in range(B)]
            cache.reorder(idx)
            rows = [rows[i] for i in idx]
        else:
            q = torch.randn(B, H, 1, D, generator=gen)
            if min(r[0].shape[2] for r in rows) == 0:
                continue
            out = decode(q, cache)                       # ragged: reads up to the longest row
            for s in range(B):
                if not rows[s][2]:
                    torch.testing.assert_close(out[s:s + 1], _fresh_decode(q[s:s + 1], *rows[s][:2]), atol=1e-5,
                                               rtol=1e-5, msg=f"step {step} row {s}")
                    checks += 1
        for s in range(B):
            assert cache.lengths[s] == rows[s][0].shape[2]
            assert not cache.k[s, :, cache.lengths[s]:].any() and not cache.v[s, :, cache.lengths[s]:].any()
    assert checks > 20


def test_an_empty_batch_decodes_to_an_empty_batch():
    """Every request finished: decode(seq_ids=[]) over any cache and cascade with no request raised
    torch.cat's "expected a non-empty list" (a review, 2026-12-07); now (0, Hq, Nq, Dv), as attention
    gives for a batch of 0."""
    c = KVCache(batch=2, heads=H, head_dim=D, capacity=8)
    c.append(*_kv(2, 3))
    pool = PagedKVCache(num_pages=4, page_size=4, heads=H, head_dim=D)
    a = pool.new_sequence()
    pool.append(*_kv(1, 3), a)
    q0 = torch.randn(0, H, 1, D)
    assert keyfold.attention(q0, torch.randn(0, H, 3, D), torch.randn(0, H, 3, D)).shape == (0, H, 1, D)
    for cache in (c, pool):
        out, lse = decode(q0, cache, seq_ids=[], return_lse=True)
        assert out.shape == (0, H, 1, D) and lse.shape == (0, H, 1)
    for mask in (None, keyfold.causal()):
        out = cascade(q0, *_kv(1, 4), *_kv(0, 2), mask=mask)
        assert out.shape == (0, H, 1, D) and out.dtype == q0.dtype
