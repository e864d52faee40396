"""Decoding against a cache, split-KV and cascade: :func:`keyfold.attend` over pieces, merged.

Every function here is a thin loop over the core operator (docs/caches.md):

- a cache names its keys as spans with absolute offsets (:meth:`pieces`);
- each span is one ``attend(..., kv_offset=span start)``, so masks and ALiBi see true positions;
- a long span is split into chunks computed independently (split-KV / flash-decoding);
- the partial states are merged with :func:`keyfold.merge_all`, never a second merge.
"""

from __future__ import annotations

import math

import torch

from ..engine import Backend, attend, attend_out, attend_wide
from ..kernels import cpu as _cpu
from ..kernels import native as _native
from ..masks import BlockKind, Mask, as_mask, check_unchanged, sinks
from ..scores import as_score
from ..state import State, empty_state, merge, merge_all, state_dtype
from ..views import MaskView, Remap, RowTable, ScoreView, span_kinds
from ._pieces import Cache, Group, Span
from .contiguous import KVCache

__all__ = ["decode", "attend_cache", "cascade", "choose_splits", "MIN_CHUNK"]

MIN_CHUNK = 4096  # shortest split-KV chunk: below it the per-call cost outweighs the parallelism
_ITEMS_PER_THREAD = 4  # split until every thread has about this many (head, chunk) work items


def choose_splits(n_keys: int, tasks: int, threads: int | None = None, *, min_chunk: int = MIN_CHUNK) -> int:
    """How many chunks to split ``n_keys`` keys into when ``tasks`` (batch x kv heads) share ``threads``.

    The fused kernel already runs one task per thread; splitting pays only when there are
    fewer tasks than threads (batch 1 with few key/value heads, MQA) or they do not divide
    evenly. Then we aim at ``4 * threads`` work items, with chunks of at least ``min_chunk``.

    >>> choose_splits(131072, tasks=8, threads=2), choose_splits(131072, tasks=1, threads=2)
    (1, 8)
    """
    threads = torch.get_num_threads() if threads is None else threads
    if n_keys < 2 * min_chunk or (tasks >= threads and tasks % threads == 0):
        return 1
    want = math.ceil(_ITEMS_PER_THREAD * threads / max(1, tasks))
    return max(1, min(want, n_keys // min_chunk))


def _threads(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


def _auto_splits(n_keys: int, tasks: int, q: torch.Tensor) -> int:
    """:func:`choose_splits` for a span read by ``q``; a span too short to split answers 1 without
    asking the device for its threads (this runs on every decoding step)."""
    if n_keys < 2 * MIN_CHUNK:
        return 1
    return choose_splits(n_keys, tasks, _threads(q.device))


# ------------------------------------------------------------------------- one span


def _kinds(mask: Mask, q0: int, q1: int, spans) -> list[BlockKind | None]:
    """The mask's closed-form kind for query positions [q0, q1) against each span (None: no closed form)."""
    return span_kinds(mask, q0, q1, [(sp.kv_offset, sp.kv_offset + sp.n) for sp in spans])


def _folded(q, span: Span, s: int, scale, backend) -> list[State] | None:
    """Split-KV in one call: ``s`` equal chunks of the span become ``s`` key/value heads of one attend.

    Only for pieces without mask or score (positions do not matter). k ``(b, Hkv, n, D)`` is
    viewed as ``(b*Hkv, s, n/s, D)`` (no copy: a cache's view of its first n slots is one), each
    chunk a key/value head, and q's GQA group stays a group of ``g`` query heads of each chunk's
    head, as in one call over the span: folded into one head as rows, a group's rows met torch's
    GEMM of more than 5 rows, which sums them less exactly than the naive's of a head's own rows
    (split decodes past the 2x rule, up to 3.5x the allowance at 6-12 rows). Returns the states of
    the folded part and of the leftover keys, or None if k cannot be viewed so.
    """
    b, Hq, Nq, D = q.shape
    Hkv, n, Dv = span.k.shape[1], span.n, span.v.shape[-1]
    g, c = Hq // Hkv, n // s
    try:
        kf = span.k[:, :, :s * c].view(b * Hkv, s, c, D)   # (b*Hkv, s, c, D)
        vf = span.v[:, :, :s * c].view(b * Hkv, s, c, Dv)  # (b*Hkv, s, c, Dv)
    except RuntimeError:
        return None
    qf = q.reshape(b * Hkv, 1, g, Nq, D).expand(b * Hkv, s, g, Nq, D).reshape(b * Hkv, s * g, Nq, D)
    st = attend_wide(qf, kf, vf, scale=scale, q_offset=0, backend=backend)
    out, lse = st.out.reshape(b, Hkv, s, g, Nq, Dv), st.lse.reshape(b, Hkv, s, g, Nq)
    chunks = [State(out[:, :, i].reshape(b, Hq, Nq, Dv), lse[:, :, i].reshape(b, Hq, Nq)) for i in range(s)]
    states = [merge_all(chunks)]
    if s * c < n:
        states.append(attend_wide(q, span.k[:, :, s * c:], span.v[:, :, s * c:], scale=scale, q_offset=0,
                                  backend=backend))
    return states


def _span_states(q, span: Span, mask, score, scale, q_offset, splits, backend, merged: bool = False,
                 lse: bool = True) -> list[State]:
    """States of one span, split into chunks when that pays (or when ``splits`` asks). States that are
    merged (chunks, or every state of a span whose caller merges it with others': ``merged``) carry a
    float64 lse and a float32 out (:func:`attend_wide`: a float32 lse, or a 16-bit piece's out, rounded
    before the merge broke the 2x rule); :func:`_narrow` rounds the result's lse once. One unmerged
    call stays :func:`attend`'s (the fused op, where it is faster); :func:`attend_out`'s where nobody reads
    its lse (``lse=False``)."""
    b, Hq = q.shape[:2]
    n = span.n
    free = mask is None and score is None
    if splits is None:
        s = _auto_splits(n, b * span.k.shape[1], q) if free else 1
        if s > 1 and backend in (Backend.AUTO, Backend.CPU) and _cpu.splits_itself(q, span.k, span.v):
            s = 1
    else:
        s = min(splits, n)
    if s <= 1:
        one = attend_wide if merged else attend if lse else attend_out
        return [one(q, span.k, span.v, mask=mask, score=score, scale=scale, q_offset=q_offset,
                    kv_offset=span.kv_offset, backend=backend)]
    if free:
        states = _folded(q, span, s, scale, backend)
        if states is not None:
            return states
    # serial chunks with their own offsets: what a masked or scored split is
    edges = [round(i * n / s) for i in range(s + 1)]
    return [attend_wide(q, span.k[:, :, a:e], span.v[:, :, a:e], mask=mask, score=score, scale=scale,
                        q_offset=q_offset, kv_offset=span.kv_offset + a, backend=backend)
            for a, e in zip(edges[:-1], edges[1:]) if e > a]


def _group_state(q, group: Group, mask, score, scale, splits, backend, Dv: int, merged: bool = False,
                 lse: bool = True) -> State:
    """Attention of the group's query rows over all its spans, merged (``merged``: the caller merges the
    result with another state, so its spans' states are wide even where there is one; ``lse``: whether
    anyone reads the result's lse)."""
    b, Hq, Nq, _ = q.shape
    q_offset = group.length - Nq
    if group.row_lengths is not None:  # a ragged group (nothing reads positions): row r sees keys < its length
        mask = sinks(torch.tensor(group.row_lengths))
    states: list[State] = []
    if mask is not None:  # the engine's check, before the spans are classified (a documents mask with
        # more queries than the sequence has tokens raised IndexError there, not the engine's ValueError)
        for sp in group.spans:
            mask.check_positions(q_offset, group.length, sp.kv_offset, sp.kv_offset + sp.n)
    kinds = _kinds(mask, q_offset, group.length, group.spans) if mask is not None else [None] * len(group.spans)
    seen = [(span, kind) for span, kind in zip(group.spans, kinds) if kind is not BlockKind.EMPTY]
    for span, kind in seen:
        m = None if kind is BlockKind.FULL else mask
        states += _span_states(q, span, m, score, scale, q_offset, splits, backend, merged or len(seen) > 1, lse)
    if not states:  # every key hidden: the identity, out 0 and lse -inf
        return empty_state(b, Hq, Nq, Dv, dtype=state_dtype(q.dtype), device=q.device,
                           of=(q, *(t for s in group.spans for t in (s.k, s.v))))
    return states[0] if len(states) == 1 else merge_all(states)


def _groups_state(q, groups: list[Group], mask, score, scale, splits, backend, Dv: int,
                  merged: bool = False, lse: bool = True) -> State:
    """Per group of rows, then the rows put back together in order (``merged``, ``lse``: as
    :func:`_group_state`'s)."""
    B = q.shape[0]
    if not groups:  # no sequence (seq_ids=[]: every request finished): an empty batch, as attention gives
        return empty_state(0, q.shape[1], q.shape[2], Dv, dtype=state_dtype(q.dtype), device=q.device, of=(q,))
    states = []
    for g in groups:
        m, sc = mask, score
        if (g.r0, g.r1) != (0, B):  # the group is a slice of the batch: keep b meaning q's row
            rows = Remap(batch=(B, g.r0))
            if m is not None and m.depends_on_batch_head(B, q.shape[1])[0]:
                m = MaskView(m, rows, n_batch=g.r1 - g.r0)
            if sc is not None:
                sc = ScoreView(sc, rows)
        states.append(_group_state(q[g.r0:g.r1], g, m, sc, scale, splits, backend, Dv, merged, lse))
    if len(states) == 1:
        return states[0]
    return State(torch.cat([s.out for s in states], 0), torch.cat([s.lse for s in states], 0))


def _narrow(st: State) -> State:
    """A merged state as the public functions return it: lse in out's dtype (float32 for float32
    inputs, float64 for float64), rounded once after every merge (see :func:`_span_states`)"""
    return st if st.lse.dtype == st.out.dtype else State(st.out, st.lse.to(st.out.dtype))


# ------------------------------------------------------------------------------ public


def _check_q(q, heads: int, head_dim: int, owner: str):
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"{owner}(q): expected a tensor (batch, heads, tokens, head_dim), got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    if not q.dtype.is_floating_point:
        raise TypeError(f"{owner}(q): expected a floating dtype, got {q.dtype}")
    if q.shape[-1] != head_dim:
        raise ValueError(f"{owner}(q): head_dim {q.shape[-1]} but the keys have {head_dim}; they must match")
    if q.shape[1] % heads:
        raise ValueError(f"{owner}(q): {q.shape[1]} query heads for {heads} key/value heads; query heads "
                         f"must be a multiple (GQA/MQA)")
    if q.shape[2] < 1:
        raise ValueError(f"{owner}(q): needs at least one query token")


def _check_splits(splits):
    """``splits`` checked; 0 is None (FlashAttention's ``num_splits=0``: choose), which it returns"""
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 0):
        raise ValueError(f"decode(splits=...): an int >= 1, or None (or 0, as FlashAttention's num_splits) to "
                         f"choose from the cache length and threads; got {splits!r}")
    return None if splits == 0 else splits


def _whole_batch(q, cache: KVCache, scale, splits, backend, lse: bool = True) -> State | None:
    """The common decode step: every sequence of a contiguous cache at one length, as many query
    heads as key heads, nothing that reads positions, no split worth making. One call over the
    cache's kept views, without groups and spans. Anything unusual (including bad input) answers
    None and takes the general path, which checks and explains. ``lse``: as :func:`_group_state`'s."""
    whole = cache.whole()
    if whole is None or type(q) is not torch.Tensor or q.dtype != cache.dtype:
        return None
    k, v, L = whole
    shape = q.shape
    if len(shape) != 4 or shape[0] != cache.batch or shape[1] != cache.heads or shape[3] != cache.head_dim \
            or not 0 < shape[2] <= L:
        return None
    if splits is None:
        if _auto_splits(L, cache.batch * cache.heads, q) > 1:
            return None
    elif type(splits) is not int or splits != 1:
        return None
    return (attend if lse else attend_out)(q, k, v, scale=scale, backend=backend)


def attend_cache(q, cache: Cache, *, mask=None, score=None, scale=None, seq_ids=None, splits=None,
                 backend=Backend.AUTO) -> State:
    """Partial-state form of :func:`decode`: a mergeable ``State`` (float32; float64 for float64)."""
    return _cache_state(q, cache, mask, score, scale, seq_ids, splits, backend)


def _cache_state(q, cache: Cache, mask, score, scale, seq_ids, splits, backend, lse: bool = True) -> State:
    """:func:`attend_cache`'s state (``lse``: whether anyone reads its lse; :func:`decode` without
    ``return_lse`` does not)."""
    splits = _check_splits(splits)
    if mask is None and score is None and seq_ids is None and type(cache) is KVCache:
        st = _whole_batch(q, cache, scale, splits, backend, lse)
        if st is not None:
            return st
    return _narrow(_attend_groups(q, cache, mask, score, scale, seq_ids, splits, backend, lse))


def _attend_groups(q, cache: Cache, mask, score, scale, seq_ids, splits, backend, lse: bool = True) -> State:
    """The general path: check, ask the cache for its groups of rows and spans, attend, merge (``lse``:
    whether anyone reads the result's lse)."""
    _check_q(q, cache.heads, cache.head_dim, "decode")
    splits = _check_splits(splits)
    Nq = q.shape[2]
    mask, score, implied = as_mask(mask), as_score(score), cache.implied_mask(Nq)
    # here, before the spans are classified: a block the preset's old copy called full or empty is attended
    # without the mask, past the engine's own check (0.85-0.89 off, silently; a review, 2026-12-08)
    check_unchanged(mask, score)
    mask = implied if mask is None else (mask if implied is None else mask & implied)
    # with neither a mask nor a score nothing reads positions, and a cache may hand its keys
    # out in any order (softmax does not care): the window cache then reads one span
    groups = cache.pieces(seq_ids, Nq, exact_positions=mask is not None or score is not None)
    rows = sum(g.r1 - g.r0 for g in groups)
    if rows != q.shape[0]:
        raise ValueError(f"decode(q): {q.shape[0]} query rows for {rows} sequences; pass one row per "
                         f"sequence id (seq_ids)")
    if score is not None:
        score.check_batch(q.shape[0])
    # More queries than a sequence holds is allowed (FlashAttention's seqlen_q > seqlen_k): they
    # stay bottom-right aligned, the first ones at negative positions, and see what the mask allows.
    qc = q if q.dtype == cache.dtype else q.to(cache.dtype)
    return _groups_state(qc, groups, mask, score, scale, splits, backend, cache.value_dim, lse=lse)


def decode(q, cache: Cache, *, mask=None, score=None, scale=None, seq_ids=None, splits=None,
           backend=Backend.AUTO, return_lse=False):
    """Attention of a few new query tokens against a KV cache (any of the three).

    q: ``(b, Hq, Nq, D)``, the last ``Nq`` tokens of each sequence (append their k/v first);
    ``Hq`` a multiple of the cache's heads (GQA/MQA). Row ``i`` is sequence ``seq_ids[i]``
    (default: every sequence in order; for :class:`PagedKVCache`, ``seq_ids`` is required).
    mask / score: as in :func:`keyfold.attention`, at absolute positions (query ``i`` of a
    sequence of ``L`` tokens sits at ``L - Nq + i``), except that an SDPA-style tensor mask is not
    taken (its columns would have to follow the cache's spans): write it as a mask (``padding``,
    ``documents``, a ``mask_mod``). A window cache adds its own mask.
    splits: chunks per long span (split-KV); None chooses from the length and the threads.

    Returns ``out`` ``(b, Hq, Nq, Dv)`` in q's dtype (and lse ``(b, Hq, Nq)`` float32 with
    ``return_lse=True``), equal to the last ``Nq`` rows of ``attention`` over the sequence's
    full keys; a row that sees no key gives 0 (lse -inf). A 16-bit cache computes in its dtype.

    >>> import torch, keyfold
    >>> from keyfold.caches import KVCache, decode
    >>> cache = KVCache(batch=1, heads=2, head_dim=8, capacity=32)
    >>> k, v, q = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 1, 8)
    >>> cache.append(k, v)
    >>> torch.allclose(decode(q, cache), keyfold.attention(q, k, v), atol=1e-6)
    True
    """
    st = _cache_state(q, cache, mask, score, scale, seq_ids, splits, backend, lse=return_lse)
    out = st.out if st.out.dtype == q.dtype else st.out.to(q.dtype)
    return (out, st.lse) if return_lse else out


#: Query rows a key/value head (requests x tokens x GQA group) of one float32 call over a cascade's prefix:
#: the decode kernel's exact scores take up to native.MAX_ROWS, and the prefill kernel from
#: cpu.PREFILL_SQUARE_ROWS; below both, every request's rows get the exact scores its own naive product
#: is held to (see cascade)
CASCADE_ROWS = min(_native.MAX_ROWS, _cpu.PREFILL_SQUARE_ROWS - 1)


def _prefix_state(qc, a: int, R: int, lens, P: int, Nq: int, prefix: Span, mask, score, scale, splits,
                  backend) -> State:
    """The state of requests ``a .. a + len(qc)`` of a cascade over its prefix: their rows folded into one
    call ``(1, Hq, rows, Dv)``, masks and scores seeing each row's request and position."""
    n = qc.shape[0]
    Hq = qc.shape[1]
    qf = qc.permute(1, 0, 2, 3).reshape(1, Hq, n * Nq, qc.shape[-1])       # (1, Hq, n*Nq, D)
    pos = torch.tensor([P + lens[r] - Nq + i for r in range(a, a + n) for i in range(Nq)])
    req = torch.arange(a, a + n).repeat_interleave(Nq)
    m, sc = mask, score
    if m is not None and P > 0:  # an empty prefix has no block to classify (it raised IndexError)
        kind = _kinds(m, int(pos.min()), int(pos.max()) + 1, [prefix])[0]
        m = None if kind is BlockKind.FULL else m
    if m is not None or sc is not None:
        rows = Remap(rows=RowTable(pos, req, R))
        m = None if m is None else MaskView(m, rows)
        sc = None if sc is None else ScoreView(sc, rows)
    if P == 0 or (m is not None and _kinds(m, 0, n * Nq, [prefix])[0] is BlockKind.EMPTY):
        return empty_state(1, Hq, n * Nq, prefix.v.shape[-1], dtype=state_dtype(qc.dtype), device=qc.device,
                           of=(qf, prefix.k, prefix.v))
    return merge_all(_span_states(qf, prefix, m, sc, scale, 0, splits, backend, merged=True))


def cascade(q, prefix_k, prefix_v, suffix_k, suffix_v, *, suffix_lengths=None, mask=None, score=None,
            scale=None, splits=None, backend=Backend.AUTO, return_lse=False):
    """A batch of requests sharing a prefix: the prefix is read once for all of them.

    q: ``(R, Hq, Nq, D)``, the last ``Nq`` tokens of each request.
    prefix_k / prefix_v: ``(1, Hkv, P, D)`` / ``(1, Hkv, P, Dv)``, shared, at positions ``0 .. P-1``.
    suffix_k / suffix_v: ``(R, Hkv, S, D)`` / ``(R, Hkv, S, Dv)``: request ``r``'s own tokens at
    positions ``P ..``; only the first ``suffix_lengths[r]`` are real (default ``S`` each) and
    nothing past them is read (the padding may hold anything, NaN included).

    All requests' queries become rows of one call over the prefix (their own positions kept,
    so masks and ALiBi stay exact); each request's suffix is its own piece; the two states
    merge per request. Returns ``(R, Hq, Nq, Dv)`` in q's dtype (plus lse with ``return_lse``),
    equal to attention over each request's full ``prefix + suffix`` keys.

    >>> import torch, keyfold
    >>> from keyfold.caches import cascade
    >>> q = torch.randn(3, 2, 1, 8)
    >>> pk, pv = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    >>> sk, sv = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8)
    >>> out = cascade(q, pk, pv, sk, sv, mask=keyfold.causal())
    >>> full = keyfold.attention(q[1:2], torch.cat([pk, sk[1:2]], 2), torch.cat([pv, sv[1:2]], 2))
    >>> torch.allclose(out[1:2], full, atol=1e-6)
    True
    """
    for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v), ("suffix_k", suffix_k), ("suffix_v", suffix_v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"cascade({name}): expected a 4-D tensor (batch, heads, tokens, dim), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if prefix_k.shape[0] != 1 or prefix_v.shape[0] != 1:
        raise ValueError(f"cascade(prefix_k): the shared prefix has batch 1, got {tuple(prefix_k.shape)}; "
                         f"pass it once, not once per request")
    _check_q(q, prefix_k.shape[1], prefix_k.shape[-1], "cascade")
    splits = _check_splits(splits)
    R, Hq, Nq, _ = q.shape
    P, Hkv = prefix_k.shape[2], prefix_k.shape[1]
    if suffix_k.shape[0] != R or suffix_k.shape[1] != Hkv:
        raise ValueError(f"cascade(suffix_k): expected ({R}, {Hkv}, tokens, dim) for {R} requests, "
                         f"got {tuple(suffix_k.shape)}")
    S = suffix_k.shape[2]
    lens = [S] * R if suffix_lengths is None else (
        suffix_lengths.tolist() if isinstance(suffix_lengths, torch.Tensor) else list(suffix_lengths))
    if len(lens) != R or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= S for x in lens):
        raise ValueError(f"cascade(suffix_lengths=...): expected {R} ints in [0, {S}], got {lens}")
    if any(P + x < Nq for x in lens):
        raise ValueError(f"cascade(q): {Nq} query tokens but a request holds only {P + min(lens)} tokens; "
                         f"the queries are each request's last tokens")
    dtype = prefix_k.dtype
    qc = q if q.dtype == dtype else q.to(dtype)
    mask, score = as_mask(mask), as_score(score)
    check_unchanged(mask, score)
    if R == 0:  # no request: an empty batch (the prefix call had no rows, and torch.cat no states)
        st = empty_state(0, Hq, Nq, prefix_v.shape[-1], dtype=state_dtype(dtype), device=q.device,
                         of=(q, prefix_k, prefix_v, suffix_k, suffix_v))
        out = st.out.to(q.dtype)
        return (out, st.lse) if return_lse else out

    # the shared prefix, once: request r's queries are rows r*Nq .. r*Nq + Nq - 1 of one call. In
    # float32, at most CASCADE_ROWS rows a key/value head a call: each request's naive attention is its own
    # small product, which the decode kernel's exact scores follow, and past them the rows went to float32
    # sums over every request's rows (torch's matmul, or the prefill kernel with a mask or ALiBi): 53 of
    # 400 random cascades of 8-130 requests past the rule, up to 3.1x the allowance (14x against one
    # request's own naive error; a review, 2026-12-07); so 65 requests read the prefix twice
    prefix = Span(prefix_k, prefix_v, 0)
    per = R
    if dtype is torch.float32:
        per = max(1, CASCADE_ROWS // (Nq * max(1, Hq // Hkv)))
    parts = [_prefix_state(qc[a:a + per], a, R, lens, P, Nq, prefix, mask, score, scale, splits, backend)
             for a in range(0, R, per)]
    pre = parts[0] if len(parts) == 1 else State(torch.cat([s_.out for s_ in parts], 2),
                                                 torch.cat([s_.lse for s_ in parts], 2))
    Dv = prefix_v.shape[-1]
    pre = State(pre.out.reshape(Hq, R, Nq, Dv).permute(1, 0, 2, 3),               # (R, Hq, Nq, Dv)
                pre.lse.reshape(Hq, R, Nq).permute(1, 0, 2))                       # (R, Hq, Nq)

    # each request's own suffix, at positions P..: equal-length neighbours share a call. Never a
    # ragged call over the longest suffix: the padding past suffix_lengths[r] is the caller's
    # (often torch.empty) and even a hidden NaN there reaches the output as 0 * NaN
    groups, r = [], 0
    while r < R:
        e = r + 1
        while e < R and lens[e] == lens[r]:
            e += 1
        L = lens[r]
        spans = (Span(suffix_k[r:e, :, :L], suffix_v[r:e, :, :L], P),) if L else ()
        groups.append(Group(r, e, P + L, spans))
        r = e
    suf = _groups_state(qc, groups, mask, score, scale, splits, backend, Dv, merged=True)
    st = _narrow(merge(pre, suf))
    out = st.out.to(q.dtype)
    return (out, st.lse) if return_lse else out
