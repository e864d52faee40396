"""Mask meaning (hand-drawn literals), composition, hashing, planning and errors."""

import pytest
import torch

import keyfold as kf
from keyfold import BlockKind
from keyfold.planner import PieceKind, plan_cache_stats


def lit(rows):
    return torch.tensor([[c == "1" for c in r] for r in rows])


# Nq = Nk = 5 with the default bottom-right alignment (q_offset = 0).
LITERALS = {
    "causal": (kf.causal(), ["10000", "11000", "11100", "11110", "11111"]),
    "window(1)": (kf.window(1), ["10000", "11000", "01100", "00110", "00011"]),
    "window(1,1)": (kf.window(1, 1), ["11000", "11100", "01110", "00111", "00011"]),
    "sinks(2)": (kf.sinks(2), ["11000", "11000", "11000", "11000", "11000"]),
    "prefix(3)": (kf.prefix(3), ["11100", "11100", "11100", "11110", "11111"]),
    "documents": (kf.documents(torch.tensor([0, 0, 1, 1, 1])), ["11000", "11000", "00111", "00111", "00111"]),
    "dilated(2)": (kf.dilated(2), ["10101", "01010", "10101", "01010", "10101"]),
    "block_sparse": (kf.block_sparse(torch.tensor([[1, 0, 0], [0, 1, 1], [1, 0, 1]]).bool(), 2),
                     ["11000", "11000", "00111", "00111", "11001"]),
    "causal & (window(1) | sinks(1))": (kf.causal() & (kf.window(1) | kf.sinks(1)),
                                         ["10000", "11000", "11100", "10110", "10011"]),
    "~causal": (~kf.causal(), ["01111", "00111", "00011", "00001", "00000"]),
}


@pytest.mark.parametrize("name", sorted(LITERALS))
def test_to_dense_matches_hand_drawn(name):
    mask, rows = LITERALS[name]
    assert torch.equal(mask.to_dense(5, 5), lit(rows))


def test_to_dense_offsets_cross_attention():
    # 2 queries at the end of 4 keys (bottom-right), and top-left with q_offset=0.
    assert torch.equal(kf.causal().to_dense(2, 4), lit(["1110", "1111"]))
    assert torch.equal(kf.causal().to_dense(2, 4, q_offset=0), lit(["1000", "1100"]))
    assert torch.equal(kf.causal().to_dense(2, 2, q_offset=3, kv_offset=2), lit(["11", "11"]))


def test_prefix_per_batch_and_documents_per_batch():
    m = kf.prefix(torch.tensor([1, 3])).to_dense(3, 3, B=2)
    assert m.shape == (2, 1, 3, 3)
    assert torch.equal(m[0, 0], lit(["100", "110", "111"]))
    assert torch.equal(m[1, 0], lit(["111", "111", "111"]))
    d = kf.documents(torch.tensor([[0, 0, 1], [0, 1, 1]])).to_dense(3, 3, B=2)
    assert torch.equal(d[1, 0], lit(["100", "011", "011"]))


def test_cross_attention_documents_with_kv_ids():
    m = kf.documents(torch.tensor([0, 1]), kv_ids=torch.tensor([0, 0, 1]))
    assert torch.equal(m.to_dense(2, 3, q_offset=0), lit(["110", "001"]))


def test_sparsity_counts_hidden_pairs():
    assert kf.causal().sparsity(4, 4) == pytest.approx(6 / 16)
    assert kf.full().sparsity(3, 7) == 0.0


def test_masks_hash_by_value_and_tensors_by_content():
    assert kf.causal() & kf.window(4) == kf.causal() & kf.window(4)
    assert hash(kf.window(4, 2)) == hash(kf.window(4, 2))
    assert kf.window(4) != kf.window(5)
    ids = torch.tensor([0, 0, 1])
    a = kf.documents(ids)
    ids[0] = 7  # the mask keeps its own read-only copy
    assert a == kf.documents(torch.tensor([0, 0, 1]))
    assert a != kf.documents(torch.tensor([0, 1, 1]))


def test_repr_is_readable():
    assert repr(kf.causal() & (kf.window(255) | kf.sinks(4))) == "causal() & (window(255) | sinks(4))"
    assert repr(kf.prefix(8)) == "prefix(8)"
    assert repr(~kf.causal()) == "~causal()"


def test_bool_of_a_mask_raises_with_hint():
    with pytest.raises(TypeError, match="use & and |"):
        bool(kf.causal())
    with pytest.raises(TypeError, match="& and |"):
        _ = kf.causal() and kf.window(3)


@pytest.mark.parametrize("name", sorted(LITERALS))
def test_closed_form_classification_is_sound(name):
    """Closed-form FULL/EMPTY claims agree with exact evaluation on every tile."""
    mask, _ = LITERALS[name]
    big = mask
    if name == "documents":
        big = kf.documents(torch.arange(64) * 3 // 64)
    if name == "block_sparse":
        big = kf.block_sparse(torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) < 0.5, 4)
    p = kf.plan(big, 64, 64, block_size=8)
    dense = big.to_dense(64, 64)
    for i in range(8):
        for j in range(8):
            tile = dense[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8]
            kind = BlockKind(int(p.kinds[i, j]))
            if kind is BlockKind.FULL:
                assert bool(tile.all())
            elif kind is BlockKind.EMPTY:
                assert not bool(tile.any())


def test_plan_skips_empty_tiles_and_draws():
    p = kf.plan(kf.causal() & kf.window(8), 64, 64, block_size=8)
    c = p.counts()
    assert c["empty"] > 0 and c["full"] == 0
    assert p.density < 0.5
    drawing = p.to_string()
    assert drawing.splitlines()[1].startswith("~.") and "#" not in drawing.splitlines()[1]
    assert len(drawing.splitlines()) == 9


def test_causal_plan_uses_the_fused_causal_flag():
    p = kf.plan(kf.causal(), 100, 100)
    assert [x.kind for x in p.pieces] == [PieceKind.CAUSAL]
    p = kf.plan(kf.causal(), 10, 100)
    assert [x.kind for x in p.pieces] == [PieceKind.FULL, PieceKind.CAUSAL]
    assert p.density == pytest.approx((10 * 90 + 55) / 1000)


def test_plan_cache_reuses_plans_for_equal_masks_and_callables_by_identity():
    kf.clear_plan_cache()
    fn = lambda b, h, q, k: q >= k  # noqa: E731
    kf.plan(fn, 256, 256)
    kf.plan(fn, 256, 256)
    kf.plan(kf.causal() & kf.window(3), 256, 256)
    kf.plan(kf.causal() & kf.window(3), 256, 256)
    s = plan_cache_stats()
    assert s["hits"] == 2 and s["misses"] == 2


def test_no_piece_covers_more_than_a_band_for_windows():
    """The engine never plans an N x N tile for a local mask (nothing outside reference is N x N)."""
    N = 8192
    p = kf.plan(kf.causal() & kf.window(256), N, N)
    assert max(x.area for x in p.pieces) <= 256 * 768
    assert sum(x.area for x in p.pieces) <= N * 768


@pytest.mark.parametrize("bad, exc, match", [
    (lambda: kf.window(-1), ValueError, "left"),
    (lambda: kf.window(3, -2), ValueError, "right"),
    (lambda: kf.sinks(-1), ValueError, "n"),
    (lambda: kf.dilated(0), ValueError, "step"),
    (lambda: kf.documents(torch.zeros(3)), ValueError, "integer"),
    (lambda: kf.softcap(0.0), ValueError, "cap"),
    (lambda: kf.window(2.5), TypeError, "int"),
])
def test_bad_mask_arguments(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()


def test_callables_plan_once_unless_they_read_batch_or_head():
    from keyfold.masks import MaskFn
    assert MaskFn(lambda b, h, q, k: q >= k).depends_on_batch_head() == (False, False)
    assert MaskFn(lambda b, h, q, k: (q >= k) & (h < 1)).depends_on_batch_head() == (False, True)
    assert MaskFn(lambda b, h, q, k: (q >= k) | (b == 0)).depends_on_batch_head() == (True, False)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    per_head = lambda b, h, qi, ki: (qi >= ki) & ((qi - ki) <= h)  # noqa: E731 - head h sees h+1 keys
    out = kf.attention(q, k, v, mask=per_head, block_size=4)
    for h in range(3):
        want = kf.attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], mask=kf.causal() & kf.window(h))
        torch.testing.assert_close(out[:, h:h + 1], want, atol=1e-6, rtol=0)


def test_narrow_windows_prefer_smaller_tiles():
    """A band at most 256 keys wide plans on 128-tiles (half the wasted work of 256-tiles);
    wider bands and other masks keep the default, and a block_sparse block still wins."""
    import keyfold as kf
    from keyfold.planner import plan
    assert (kf.causal() & kf.window(256)).preferred_block() == 128
    assert (kf.causal() & (kf.window(256) | kf.sinks(4))).preferred_block() == 128
    assert kf.window(1024).preferred_block() is None and kf.causal().preferred_block() is None
    layout = torch.ones(4, 4, dtype=torch.bool)
    assert (kf.window(256) & kf.block_sparse(layout, 64)).preferred_block() == 64
    narrow, wide = plan(kf.causal() & kf.window(256), 1024, 1024), plan(kf.causal() & kf.window(1024), 1024, 1024)
    assert sum(narrow.counts().values()) == 64 and sum(wide.counts().values()) == 16  # 8x8 vs 4x4 tiles


# ------------------------------------------------------------------ one row's keys in closed form

from hypothesis import given, settings, strategies as st  # noqa: E402

from keyfold.masks import key_spans  # noqa: E402


def _closed_forms():
    leaf = st.one_of(
        st.just(kf.causal()), st.just(kf.full()),
        st.builds(kf.window, st.integers(0, 12), st.one_of(st.none(), st.integers(0, 6))),
        st.builds(kf.sinks, st.integers(0, 9)))
    return st.recursive(leaf, lambda inner: st.one_of(
        st.builds(lambda a, b: a & b, inner, inner), st.builds(lambda a, b: a | b, inner, inner),
        st.builds(lambda a: ~a, inner)), max_leaves=5)


@settings(max_examples=300, deadline=None)
@given(mask=_closed_forms(), qp=st.integers(-5, 40), k0=st.integers(0, 20), n=st.integers(0, 25))
def test_key_spans_are_exactly_the_keys_a_row_sees(mask, qp, k0, n):
    """key_spans (a decoding row's keys, run with no mask and no plan) lists exactly the positions the
    mask's own evaluate shows for that row, as sorted disjoint ranges."""
    spans = key_spans(mask, qp, k0, k0 + n)
    kp = torch.arange(k0, k0 + n).view(1, 1, 1, -1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    seen = torch.broadcast_to(mask.evaluate(zero, zero, torch.tensor(qp).view(1, 1, 1, 1), kp), kp.shape).flatten()
    want = [k0 + i for i in range(n) if bool(seen[i])]
    assert [p for a, b in spans for p in range(a, b)] == want
    assert all(a < b for a, b in spans) and all(x[1] < y[0] for x, y in zip(spans, spans[1:]))


def test_key_spans_answer_none_for_what_has_no_closed_form():
    ids = torch.tensor([0, 0, 1, 1])
    for mask in (kf.documents(ids), kf.causal() & kf.documents(ids), kf.dilated(2), kf.sinks(torch.tensor([1, 2])),
                 ~kf.as_mask(lambda b, h, q, k: q >= k)):
        assert key_spans(mask, 3, 0, 4) is None


def _all_watched(obj) -> list:
    """The watch entries of ``obj`` and of the presets it is made of."""
    out = list(getattr(obj, "_watched", ()))
    for x in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(x, kf.Mask):
            out += _all_watched(x)
    return out


def _stale_cases():
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    lengths, starts = torch.tensor([6, 8]), torch.tensor([2, 0])
    keys = torch.ones(2, 8, dtype=torch.bool)
    n = torch.tensor([2, 3])
    layout = torch.ones(2, 2, dtype=torch.bool)
    slopes = torch.full((2,), 0.1)
    return [
        ("documents", lambda: dict(mask=kf.documents(ids)), lambda: ids.copy_(torch.tensor([0, 0, 1, 1, 1, 1, 1, 1]))),
        ("causal & documents", lambda: dict(mask=kf.causal() & kf.documents(ids)), lambda: ids.fill_(3).index_fill_(0, torch.tensor([0]), 1)),
        ("varlen", lambda: dict(mask=kf.varlen(cu, cu, causal=True)), lambda: cu.__setitem__(1, 2)),
        ("varlen & window", lambda: dict(mask=kf.varlen(cu, cu) & kf.window(2)), lambda: cu.__setitem__(1, 5)),
        ("padding lengths", lambda: dict(mask=kf.padding(lengths)), lambda: lengths.sub_(1)),
        ("padding starts", lambda: dict(mask=kf.padding(starts=starts)), lambda: starts.add_(1)),
        ("padding keys", lambda: dict(mask=kf.padding(keys=keys)), lambda: keys[0, 3:].fill_(False)),
        ("sinks", lambda: dict(mask=kf.causal() | kf.sinks(n)), lambda: n.add_(2)),
        ("block_sparse", lambda: dict(mask=kf.block_sparse(layout, 4)), lambda: layout[0, 1].fill_(False)),
        ("alibi", lambda: dict(score=kf.alibi(slopes)), lambda: slopes.fill_(2.0)),
    ]


@pytest.mark.parametrize("case", range(10))
def test_a_preset_whose_tensor_changed_in_place_raises(case):
    """Presets keep the values their tensors had when built. One reused after its tensor was changed in
    place (a static cu_seqlens buffer filled each step, FlashAttention style) ran with the old values,
    1.5-2.7 off, silently (a review, 2026-12-08): now the call raises. A write of the same values is fine."""
    name, build, change = _stale_cases()[case]
    q, k, v = (torch.randn(2, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    kw = build()
    kf.attention(q, k, v, **kw)
    watched = [e.now() for obj in kw.values() for e in _all_watched(obj)]
    for t in watched:
        t.copy_(t.clone())  # the same values: no error
    kf.attention(q, k, v, **kw)
    change()
    with pytest.raises(ValueError, match="changed in place"):
        kf.attention(q, k, v, **kw)


def test_short_documents_plan_128_tiles():
    """Documents of at most 128 positions took 256-tiles, computing up to twice their pairs (a relative
    bias callable over eight documents of 128 at 1.6-4x compiled Flex's time; a review, 2026-12-08)."""
    assert kf.documents(torch.arange(1024) // 128).preferred_block() == 128
    assert kf.documents(torch.arange(4096) // 512).preferred_block() is None
    assert (kf.causal() & kf.documents(torch.arange(512) // 64)).preferred_block() == 128
    plan = kf.plan(kf.documents(torch.arange(1024) // 128), 1024, 1024)
    assert plan.counts()["empty"] > 0 and plan.counts()["partial"] == 0


def test_presets_pickle_and_keep_their_meaning():
    """The watch's weak references made presets unpicklable (a DataLoader worker returning documents(ids)
    hung); a pickled preset carries no watch (its tensors are copies) and means the same."""
    import pickle
    ids = (torch.arange(16) >= 5).long()
    for m in (kf.documents(ids), kf.padding(torch.tensor([3, 9])), kf.varlen(torch.tensor([0, 4, 16]), causal=True)):
        back = pickle.loads(pickle.dumps(m))
        assert back == m
        assert torch.equal(back.to_dense(16, 16, B=2), m.to_dense(16, 16, B=2))


def test_a_pieces_backward_takes_the_presets_values_and_inference_slices_are_watched():
    """A piece's backward (attend_backward, attend_row_sums: the ring's) differentiates the forward that ran,
    with the preset's own values: it raised mid-exchange on one rank and the others waited out the group's
    timeout. A slice of an inference tensor keeps no base: a varlen built from one was never checked again
    (1.93 off; reviews, 2026-12-08)."""
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    mask = kf.documents(ids)
    st = kf.attend(q, k, v, mask=mask)
    want = kf.attend_backward(q, k, v, st.out, st.lse, torch.ones_like(st.out), mask=mask)
    ids[1:] = 1
    got = kf.attend_backward(q, k, v, st.out, st.lse, torch.ones_like(st.out), mask=mask)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with torch.inference_mode():
        cu_buf = torch.tensor([0, 4, 8, 8], dtype=torch.int32)
        m = kf.varlen(cu_buf[:3], causal=True)
        kf.attention(q, k, v, mask=m)
        cu_buf[1] = 2
        with pytest.raises(ValueError, match="changed in place"):
            kf.attention(q, k, v, mask=m)


def test_the_watch_sees_data_and_numpy_writes_new_storage_and_survives_pickling_before_use():
    """A write through .data or a numpy view moves no version counter (a small tensor is compared by value
    now); a buffer given new storage (set_) made the watched view's as_strided raise an unclear
    RuntimeError; a documents() preset pickled before its first use crashed the planner (its tile
    preference was a sentinel object; reviews, 2026-12-08)."""
    import pickle
    q = torch.randn(1, 2, 8, 16)
    def through_data(t):
        t.data[1] = 2

    def through_numpy(t):
        t.numpy()[1] = 2

    def new_storage(t):
        t.set_(torch.tensor([0, 2, 8, 8]))

    for write in (through_data, through_numpy, new_storage):
        cu_buf = torch.tensor([0, 4, 8, 8])
        m = kf.varlen(cu_buf[:3], causal=True)
        kf.attention(q, q, q, mask=m)
        write(cu_buf)
        with pytest.raises(ValueError, match="changed in place"):
            kf.attention(q, q, q, mask=m)
    ids = torch.tensor([0] * 4 + [1] * 4)
    back = pickle.loads(pickle.dumps(kf.documents(ids)))
    torch.testing.assert_close(kf.attention(q, q, q, mask=back), kf.attention(q, q, q, mask=kf.documents(ids)))


def test_a_score_mod_given_as_the_mask_says_so():
    """A 5-argument Flex score_mod passed as mask= got Python's "missing 1 required positional argument"
    (a review, 2026-12-08); bound methods and masks with defaults are mask_mods as before."""
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(TypeError, match="pass it as score="):
        kf.attention(q, q, q, mask=lambda s, b, h, qi, ki: s)

    class Layer:
        w = 1

        def mask_mod(self, b, h, qi, ki):
            return qi - ki <= self.w
    kf.attention(q, q, q, mask=Layer().mask_mod)
    kf.attention(q, q, q, mask=lambda b, h, qi, ki, w=2: qi - ki <= w)
