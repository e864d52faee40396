"""The fused CPU kernel's handling of float16: on CPUs without float16 units it runs in float32."""

import pytest
import torch

import keyfold as kf
from keyfold.kernels import cpu, native
from tests.helpers import assert_backward_by_rule, assert_forward_by_rule

MASKS = {"dense": None, "causal": kf.causal(), "window": kf.causal() & kf.window(9),
         "documents": kf.documents(torch.arange(70) // 20) & kf.causal()}


def _qkv(dtype, B=1, H=2, N=70, D=16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(3))


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_float16_runs_the_fused_op_in_float32_where_told(mask, monkeypatch):
    """With FP16_AS_FP32 (CPUs without float16 units) a float16 call is the float32 call on the same
    values, rounded once at the end; either way it holds the rule, forward and backward."""
    q, k, v = _qkv(torch.float16)
    kw = dict(mask=MASKS[mask], block_size=16)
    monkeypatch.setattr(cpu, "FP16_AS_FP32", True)
    got = kf.attention(q, k, v, **kw)
    assert got.dtype == torch.float16
    wide = kf.attention(q.float(), k.float(), v.float(), **kw).half()
    assert torch.equal(got, wide)
    for widen in (True, False):
        monkeypatch.setattr(cpu, "FP16_AS_FP32", widen)
        assert_forward_by_rule(q, k, v, **kw)
        assert_backward_by_rule(q, k, v, **kw)


def test_bfloat16_is_not_widened(monkeypatch):
    monkeypatch.setattr(cpu, "FP16_AS_FP32", True)
    q, k, v = _qkv(torch.bfloat16)
    assert cpu._widen(q, k, v)[0] is q


# ---------------------------------------------------------------- 16-bit keys read by few rows


def _spy_chunks(monkeypatch):
    """Count the calls that went by float32 chunks; chunks of 256 keys (the floor) from here on. The
    native decode kernel, which takes such calls first where it is built, is set aside: this is the
    path of machines without it (tests/kernels/test_native.py holds the kernel to the rule), and so is
    the prefill kernel."""
    calls = []
    real = cpu._by_chunks
    monkeypatch.setattr(cpu, "_native_may", lambda *a: False)
    monkeypatch.setattr(cpu, "_prefill_may", lambda *a: False)
    monkeypatch.setattr(cpu, "CHUNK_BYTES", 1)
    monkeypatch.setattr(cpu, "_by_chunks", lambda *a: calls.append(a[1].shape[2]) or real(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nk", [8192, 8192 + 300])
def test_few_rows_over_16_bit_keys_go_by_float32_chunks(dtype, Nk, monkeypatch):
    """One query row over >= 8k bfloat16 (or float16) keys: the keys are cast a chunk at a time
    and the chunks' states merged. It equals the float32 op on the same values (the casts are
    exact), lse included, and holds the rule; a length that is no multiple of the chunk included."""
    monkeypatch.setattr(cpu, "FP16_AS_FP32", True)
    monkeypatch.setattr(cpu, "BF16_BY_CHUNKS", True)
    calls = _spy_chunks(monkeypatch)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 1, 16, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, Nk, 16, generator=g).mul(3).to(dtype) for _ in range(2))
    st = kf.attend(q, k, v)
    assert calls == [Nk]
    wide = cpu._FWD(q.float(), k.float(), v.float(), 0.0, False, attn_mask=None, scale=0.25)
    torch.testing.assert_close(st.out, wide[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(st.lse, wide[1], atol=2e-6, rtol=1e-6)
    assert_forward_by_rule(q, k, v)


@pytest.mark.parametrize("mask", [None, "window"])
def test_float16_decode_with_gqa_and_masks_by_chunks(mask, monkeypatch):
    """float16 from a cache, GQA (query heads folded into rows) and a window mask whose partial
    tile is not a chunked piece (that piece is widened alone): the same result as float32, by the rule."""
    from keyfold.caches import KVCache, decode
    monkeypatch.setattr(cpu, "FP16_AS_FP32", True)
    calls = _spy_chunks(monkeypatch)
    g = torch.Generator().manual_seed(2)
    N = 9000
    k, v = (torch.randn(1, 2, N, 16, generator=g).half() for _ in range(2))
    q = torch.randn(1, 4, 3, 16, generator=g).half()
    cache = KVCache(1, 2, 16, N, dtype=torch.float16)
    cache.append(k, v)
    m = None if mask is None else kf.causal() & kf.window(6000)
    got = decode(q, cache, mask=m, splits=1)
    assert calls, "no piece went by chunks"
    want = decode(q.float(), _as_float_cache(cache), mask=m, splits=1)
    torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=0)
    assert_forward_by_rule(q, k, v, mask=m, q_offset=N - 3)


def _as_float_cache(cache):
    from keyfold.caches import KVCache
    c = KVCache(1, cache.heads, cache.head_dim, cache.capacity)
    c.append(cache.k.float(), cache.v.float())
    return c


def test_bfloat16_with_two_rows_keeps_the_op(monkeypatch):
    """From two query rows on PyTorch's bfloat16 op is the faster one: no chunks (nor with AMX)."""
    monkeypatch.setattr(cpu, "BF16_BY_CHUNKS", True)
    assert cpu._chunks_pay(torch.bfloat16, 1, 8192) and not cpu._chunks_pay(torch.bfloat16, 2, 8192)
    assert not cpu._chunks_pay(torch.bfloat16, 1, 4096) and not cpu._chunks_pay(torch.float32, 1, 1 << 20)
    monkeypatch.setattr(cpu, "BF16_BY_CHUNKS", False)
    assert not cpu._chunks_pay(torch.bfloat16, 1, 1 << 20)


# ---------------------------------------------------------------- tiles trimmed to visible keys


TRIMMED = {"sinks": kf.causal() & (kf.window(20) | kf.sinks(3)),
           "documents": kf.documents(torch.arange(200) // 45) & kf.causal(),
           "dilated": kf.causal() & kf.dilated(4)}


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("score", [None, "alibi"])
@pytest.mark.parametrize("mask", sorted(TRIMMED))
def test_a_masked_tile_reads_only_the_keys_its_rows_see(mask, score, gqa, monkeypatch):
    """A sink column or a document edge inside a 32-key tile: the fused call reads only the key
    range holding visible pairs (its mask trimmed alike). Same result and gradients as the whole
    tile, by the rule, with GQA (folded masks) and with a bias (trimmed with the mask); dilated
    tiles see keys across the tile and are left whole."""
    seen = []
    real = cpu._visible_cols
    monkeypatch.setattr(cpu, "_visible_cols", lambda vis: seen.append(real(vis)) or seen[-1])
    g = torch.Generator().manual_seed(3)
    H, Hkv = (4, 2) if gqa else (2, 2)
    q = torch.randn(1, H, 200, 16, generator=g)
    k, v = (torch.randn(1, Hkv, 200, 16, generator=g) for _ in range(2))
    kw = dict(mask=TRIMMED[mask], block_size=32, score=None if score is None else kf.alibi(kf.alibi_slopes(H)))
    assert_forward_by_rule(q, k, v, **kw)
    assert_backward_by_rule(q, k, v, **kw)
    trimmed = [c for c in seen if c is not None]
    if mask == "dilated":
        assert not trimmed
    else:
        assert trimmed


# ---------------------------------------------------------------- pieces over disjoint rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pieces_over_disjoint_rows_write_one_output_in_the_input_dtype(dtype, monkeypatch):
    """A plan whose pieces never share a row (here packed sequences, the middle one with queries
    but no keys) has nothing to merge: `attention` gets every piece's out written straight into one
    output in the input dtype. It holds the rule, and the middle sequence's rows, which no piece
    covers, are exactly 0 (checked by assert_forward_by_rule). This is the fused op's path: the
    prefill kernel, which takes bfloat16 plans first where it runs (AMX), is set aside
    (tests/kernels/test_prefill.py holds it to the rule)."""
    monkeypatch.setattr(cpu, "_prefill_may", lambda *a: False)
    seen = []
    real = cpu._rows_disjoint
    monkeypatch.setattr(cpu, "_rows_disjoint", lambda pieces: seen.append(real(pieces)) or seen[-1])
    N = 300
    mask = kf.varlen(torch.tensor([0, 96, 224, 300]), torch.tensor([0, 96, 96, 300]))
    q, k, v = _qkv(dtype, N=N)
    assert_forward_by_rule(q, k, v, mask=mask, block_size=32)
    assert seen and all(seen)
    plan = kf.plan(mask, N, N, q_offset=0, block_size=32)
    assert len(plan.pieces) > 1 and sum(p.q1 - p.q0 for p in plan.pieces) < N  # some rows in no piece


@pytest.mark.parametrize("Hq, Hkv, rows, keys, D, how", [
    (8, 2, 2, 272, 128, "alibi"), (8, 2, 5, 272, 128, "padding"),  # 4 heads a group
    (16, 1, 1, 450, 128, "padding"), (32, 1, 1, 272, 128, "alibi"),  # MQA, one row
    (8, 2, 1, 450, 128, "padding"),                                 # folds into 4 rows, 450 keys
    (16, 1, 1, 300, 64, "padding"), (4, 2, 6, 300, 256, "padding"), (8, 2, 8, 300, 256, "alibi"),
    (8, 2, 3, 64, 128, "none")])                        # no mask, fewer keys than the decode kernel takes
def test_a_gqa_groups_few_float32_rows_go_to_the_op_one_head_at_a_time(Hq, Hkv, rows, keys, D, how, monkeypatch):
    """torch's matmul sums the dot products of a few rows in vector lanes (up to 2 rows at head size 64,
    5 at 128, 10 at 256) and of more in one chain a dimension, and the op blocks its products by the
    keys: the naive attention (per head) got the lanes, keyfold's one fused call over a GQA group's rows
    folded together the chain. At scores of std 6: 23-68 of 100 calls past the rule (2-5 rows, 4 heads
    a group, head size 128), 11-23 of 40 (MQA's one row), 32-38 of 40 (6-8 rows at head size 256),
    20-29 of 40 (no mask, 64 keys), up to 7.2x; and calls of at most 5 rows, tried in between, 6-9 of
    20 at 450 keys and 7-8 of 40 at head size 64. Such a piece now reaches the op one member at a time
    (cpu.MEMBER_ROWS): one call, every group's members as the op's heads against keys expanded to them.
    Without a mask over fewer keys than the decode kernel pays for, the folded call goes to the kernel's
    exact scores instead (cpu._exact_few_keys, 2026-12-07), whose sums round like no one's."""
    calls = []
    op = cpu._op
    monkeypatch.setattr(cpu, "_op", lambda q, *a, **kw: calls.append(tuple(q.shape[1:3])) or op(q, *a, **kw))
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, Hq, rows, D, generator=g) * 6 ** 0.5
        k = torch.randn(1, Hkv, keys, D, generator=g) * 6 ** 0.5
        v = torch.randn(1, Hkv, keys, D, generator=g)
        kw = {"alibi": {"score": kf.alibi(torch.rand(Hq, generator=g) * 0.3)},
              "padding": {"mask": kf.padding(keys=torch.rand(1, keys, generator=g) < 0.8)},  # a mask tile
              "none": {}}[how]
        assert_forward_by_rule(q, k, v, q_offset=keys - rows, backend=kf.Backend.CPU, **kw)
    # a group's members as the op's heads, one call; the folded rows on the kernel's exact scores
    assert calls and set(calls) == {(Hkv, Hq // Hkv * rows) if how == "none" else (Hq // Hkv, rows)}


@pytest.mark.parametrize("Hq, Hkv, rows, keys, D, how", [
    (64, 4, 5, 394, 123, "causal"), (64, 2, 2, 167, 104, "window"), (64, 2, 3, 595, 125, "padding"),
    (16, 1, 4, 400, 128, "padding")])
def test_a_gqa_groups_few_float32_rows_stay_off_the_prefill_kernel(Hq, Hkv, rows, keys, D, how, monkeypatch):
    """The same bend on keyfold's prefill kernel: a float32 GQA group of 64+ rows over at most 8x as many
    keys went there (PREFILL_SQUARE_ROWS), whose register tiles sum each score in one FMA chain over the
    head dimension, where the naive attention's matmul sums a few rows' scores in vector lanes: 10-20 of
    20 seeds past the rule at these shapes, up to 3.4x. Now such calls (at most cpu.PREFILL_MEMBER_ROWS rows a
    head) go to the op one member at a time."""
    ran = []
    prefill = native.prefill
    monkeypatch.setattr(native, "prefill", lambda *a, **kw: ran.append(1) or prefill(*a, **kw))
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, Hq, rows, D, generator=g) * 6 ** 0.5
        k = torch.randn(1, Hkv, keys, D, generator=g) * 6 ** 0.5
        v = torch.randn(1, Hkv, keys, D, generator=g)
        kw = {"causal": {"mask": kf.causal()}, "window": {"mask": kf.window(keys // 3)},
              "padding": {"mask": kf.padding(keys=torch.rand(1, keys, generator=g) < 0.8)}}[how]
        assert_forward_by_rule(q, k, v, **kw)
    assert not ran


@pytest.fixture
def threads_set():
    """torch.set_num_threads(2) called, as a user's script (or a test fixture restoring its count) does:
    from then on the op sums its products inside its parallel loop another way than before."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("rows, keys, how", [(4, 399, "none"), (4, 399, "causal"), (4, 1000, "padding"),
                                             (5, 399, "padding"), (4, 399, "alibi")])
def test_few_float32_rows_hold_the_rule_after_set_num_threads(rows, keys, how, threads_set):
    """After torch.set_num_threads(n > 1), PyTorch's fused op summed a few rows' products (4-5 rows a
    head at head size 128, 16 heads) another way than torch's matmul does, in lanes: 3-7 of 8 calls
    past the rule, up to 5.8x the naive error, with no mask, causal, a key mask or ALiBi (one thread,
    or no call to set_num_threads: none). Such calls now run on keyfold's decode kernel, which sums a
    row's scores in lanes, masks and scores' tiles included (cpu.NATIVE_F32_ROWS, NATIVE_MASKED_ROWS)."""
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 16, rows, 128, generator=g) * 6 ** 0.5
        k = torch.randn(1, 16, keys, 128, generator=g) * 6 ** 0.5
        v = torch.randn(1, 16, keys, 128, generator=g)
        kw = {"none": {}, "causal": {"mask": kf.causal()}, "alibi": {"score": kf.alibi(kf.alibi_slopes(16))},
              "padding": {"mask": kf.padding(keys=torch.rand(1, keys, generator=g) < 0.7)}}[how]
        assert_forward_by_rule(q, k, v, **kw)


@pytest.mark.parametrize("B, H, rows, keys, D", [(3, 3, 2, 12000, 64), (3, 3, 2, 12000, 65),
                                                   (1, 4, 4, 192, 255), (1, 4, 5, 224, 192)])
def test_few_float32_rows_hold_the_rule_over_long_chunks_and_short_wide_heads(B, H, rows, keys, D, threads_set):
    """Two bends a review found in the routing above. (1) The decode kernel ran a head's 12k keys as one
    chunk, one online-softmax chain a row: 2.6-3.1x the naive error in 1 of 24 calls at head sizes
    64-65 (native.CHUNK_KEYS now caps a chunk at 1024 keys). (2) Under native.MIN_KEYS keys the op kept
    few rows, and its sums bend from about 40k keys x head size: head size 255 over 192 keys, 192 over
    224, 4-9 of 20 calls past the rule (cpu.NATIVE_F32_AREA now sends them to the kernel)."""
    bad = 0
    for seed in range(24 if keys > 1024 else 10):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(B, H, rows, D, generator=g) * 6 ** 0.5
        k = torch.randn(B, H, keys, D, generator=g) * 6 ** 0.5
        v = torch.randn(B, H, keys, D, generator=g)
        try:
            assert_forward_by_rule(q, k, v)
        except AssertionError:
            bad += 1
    assert bad == 0, f"{bad} calls past the rule"


@pytest.mark.parametrize("Hkv, keys, how", [(8, 17, "alibi"), (4, 16, "window")])
def test_nine_rows_a_head_at_head_size_256_run_one_member_at_a_time(Hkv, keys, how, threads_set):
    """torch's matmul sums up to 10 rows in lanes at head size 256, and a GQA group folded past 8 rows a
    head (the old MEMBER_ROWS) reached the op as one chained call: 9 rows, 4 heads a group, 5.1-5.2x
    the naive error. Above head size 128 up to cpu.MEMBER_ROWS_WIDE (16) rows a head go one head's rows
    a call now."""
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 4 * Hkv, 9, 256, generator=g) * 6 ** 0.5
        k = torch.randn(2, Hkv, keys, 256, generator=g) * 6 ** 0.5
        v = torch.randn(2, Hkv, keys, 256, generator=g)
        kw = {"alibi": {"score": kf.alibi(kf.alibi_slopes(4 * Hkv))}, "window": {"mask": kf.window(7) | kf.sinks(4)}}[how]
        assert_forward_by_rule(q, k, v, **kw)


@pytest.mark.parametrize("Hq, rows", [(8, 5), (8, 1), (4, 2)])
@pytest.mark.parametrize("backend", [kf.Backend.TILES, kf.Backend.REFERENCE])
def test_the_tile_and_reference_paths_take_a_gqa_groups_few_float32_rows_per_head(backend, Hq, rows):
    """The same bend on keyfold's tile and reference paths: their scores and P.V met a GQA group's rows
    folded together by broadcasting (one chain a dimension; over 2 kv heads a contiguous copy of the keys,
    the same) where the naive attention multiplies one head at a time (vector lanes for a few rows): 23-25
    of 40 calls past the rule with 4 heads of 5 rows, 4-9 of 40 with groups folding into 2-4 rows, up to
    6.2x. Now _common.group_matmul multiplies one head at a time there."""
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, Hq, rows, 128, generator=g) * 6 ** 0.5
        k = torch.randn(1, 2, 272, 128, generator=g) * 6 ** 0.5
        v = torch.randn(1, 2, 272, 128, generator=g)
        assert_forward_by_rule(q, k, v, backend=backend, score=kf.alibi(torch.rand(Hq, generator=g) * 0.3))


def test_rows_whose_every_score_is_minus_inf_get_lse_minus_inf_on_the_op():
    """PyTorch's op gives a row whose every score is -inf (infinite keys, no mask) out 0 and lse 0, the lse
    of a row that saw one key of score 0; keyfold passed it on where the call ran on the op (40 rows over
    100 keys), the kernels gave -inf, and keyfold.merge of such a state with another weighed the other by
    sigmoid(its lse) instead of 1 (a review, 2026-12-07). The op's candidates (lse 0, out 0) are checked."""
    q = torch.rand(1, 2, 40, 8) + 0.1
    k = torch.randn(1, 2, 100, 8)
    k[:, :, 50:] = float("-inf")
    v = torch.randn(1, 2, 100, 8)
    hidden = kf.attend(q, k[:, :, 50:], v[:, :, 50:], backend=kf.Backend.CPU)
    assert bool(torch.isneginf(hidden.lse).all()) and bool((hidden.out == 0).all())
    seen = kf.attend(q, k[:, :, :50], v[:, :, :50], kv_offset=50, backend=kf.Backend.CPU)
    whole = kf.attend(q, k[:, :, :50], v[:, :, :50], backend=kf.Backend.CPU)
    torch.testing.assert_close(kf.merge(hidden, seen).out, whole.out, atol=1e-6, rtol=1e-6)
    one = kf.attend(q * 0, k[:, :, :1], v[:, :, :1] * 0, backend=kf.Backend.CPU)  # a key of score 0: lse 0, out 0
    assert bool((one.lse == 0).all()) and bool((one.out == 0).all())


@pytest.mark.parametrize("seed, Nq, N, D, Dv, std, mask", [(18807, 1, 27, 96, 32, 1.0, None),
                                                           (105235, 2, 5, 128, 128, 5.0, kf.causal())])
def test_16bit_calls_over_few_keys_run_in_float32(seed, Nq, N, D, Dv, std, mask):
    """PyTorch's 16-bit op rounds the unnormalised weights to 16 bits before P @ V (the naive attention its
    normalised ones), and over a few keys the naive's roundings can all fall near the answer: one bfloat16
    row over 27 keys went to 2.26x the naive error, two causal rows over 5 keys to 2.46x (the 2 of 26,000
    random 16-bit calls of 1-16 rows past the rule, these seeds, 2026-12-07). A 16-bit call of up to
    EXACT_ROWS rows over fewer than native.MIN_KEYS keys now runs in float32 and is rounded once."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, 1, Nq, D, generator=g) * std).bfloat16()
    k = torch.randn(1, 1, N, D, generator=g).bfloat16()
    v = torch.randn(1, 1, N, Dv, generator=g).bfloat16()
    assert cpu._tiny_16bit(q, k)
    assert kf.attention(q, k, v, mask=mask).dtype == torch.bfloat16
    assert_forward_by_rule(q, k, v, mask=mask)
    assert_backward_by_rule(q, k, v, mask=mask)


@pytest.mark.parametrize("mask,score", [(kf.causal(), None), (kf.prefix(640) | kf.causal(), None),
                                        (kf.causal(), kf.alibi(torch.tensor([0.25, 0.5]))),
                                        (kf.documents(torch.arange(700) // 300), None)])
@pytest.mark.parametrize("rows,dtype,group", [(2, torch.float32, 1), (8, torch.float32, 1), (16, torch.float32, 1),
                                              (2, torch.bfloat16, 1), (8, torch.bfloat16, 1), (4, torch.bfloat16, 4)])
def test_a_few_rows_run_their_pieces_in_one_fused_call(mask, score, rows, dtype, group, monkeypatch):
    """A speculative decoding step (a few rows, causal over a cache) planned as a full piece and the
    diagonal's ran a fused call a piece and merged the states: 1.4-1.5x the time of one call in float32,
    1.6-2.1x in bfloat16. Its pieces now run as one tile of the mask (one call), by the rule, forward and
    backward."""
    if not native.available():
        pytest.skip("no native kernel built")
    q, k, v = (torch.randn(1, 2 * (group if i == 0 else 1), n, 64, generator=torch.Generator().manual_seed(i))
               .mul(3 if i < 2 else 1).to(dtype) for i, n in enumerate((rows, 700, 700)))
    if score is not None and group > 1:
        score = kf.alibi(torch.tensor([0.25, 0.5] * group))
    calls = []  # the kernels' calls: the decode kernel's and torch's fused op's
    for owner, name in ((native, "run"), (cpu, "_FWD")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, **kw: calls.append(a[0].shape) or real(*a, **kw))
    kw = dict(mask=mask, score=score, q_offset=700 - rows)
    assert_forward_by_rule(q, k, v, **kw)
    assert len(calls) == 1
    assert_backward_by_rule(q, k, v, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_far_apart_or_over_long_16_bit_caches_stay_apart(dtype):
    """Joined across the keys between them (sinks and a window over a long cache), the call read and masked
    every key no row sees: 33-54x the pieces' time over 32k keys; a 16-bit causal step over a long cache
    took 1.2-1.9x on the fused op with its tile (a review, 2026-12-08). Those keep their pieces."""
    from keyfold.kernels._common import Problem
    q, k = torch.randn(1, 2, 4, 64, dtype=dtype), torch.randn(1, 2, 32768, 64, dtype=dtype)
    for mask, n in ((kf.window(256) | kf.sinks(4), 32768), (kf.causal(), 8192)):
        p = kf.plan(mask, 4, n, q_offset=n - 4)
        assert len(p.pieces) >= 2
        joined = cpu._joined_rows(q, k[:, :, :n], k[:, :, :n], p, Problem(mask, None, 0.125, n - 4, 0))
        assert joined is None or (dtype is torch.float32 and mask == kf.causal())


def test_a_gqa_groups_few_float32_rows_keep_their_pieces():
    """Under GQA a masked call runs once per member (reading the keys once each), so the pieces stay apart: the
    full piece's folded call reads the keys once for the group (joined: 1.4x the time at 4k keys)."""
    from keyfold.kernels._common import Problem
    q, k = torch.randn(1, 8, 2, 64), torch.randn(1, 2, 700, 64)
    p = kf.plan(kf.causal(), 2, 700, q_offset=698)
    assert len(p.pieces) == 2
    pb = Problem(kf.causal(), None, 0.125, 698, 0)
    assert cpu._joined_rows(q, k, k, p, pb) is None
    assert cpu._joined_rows(q[:, :2], k, k, p, pb) is not None or not native.available()


@pytest.mark.parametrize("rows,mask", [(1, None), (1, kf.causal()), (4, kf.causal() & kf.window(300))])
def test_a_bfloat16_softcap_decode_step_runs_on_the_prefill_kernel(rows, mask, monkeypatch):
    """A bfloat16 softcap with a few rows (Gemma-2's decoding step) ran on the tile path in torch ops, which
    widened the whole cache to float32 every call: 49 ms a step over 16k keys where plain torch takes 5.9
    (a review, 2026-12-08). The prefill kernel computes the softcap itself (7.4 ms); by the rule."""
    if not native.prefill_available(torch.bfloat16):
        pytest.skip("no AMX prefill kernel on this CPU")
    calls = []
    real = native.prefill
    monkeypatch.setattr(native, "prefill", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(1, 4, rows, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 900, 64, generator=g).bfloat16() for _ in range(2))
    assert_forward_by_rule(q, k, v, mask=mask, score=kf.softcap(20.0))
    assert calls
