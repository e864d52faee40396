"""The planner: turns a mask into pieces of the key space for the kernels.

It tiles the (query block x key block) grid, classifies every tile EMPTY / PARTIAL /
FULL (closed form for presets, exact evaluation for callables), skips empty tiles and
coalesces runs of tiles in one query block into key spans, so one kernel call covers each.
Plans are cached by the mask's hash, what its callables capture (:func:`keyfold.masks.captured_stamp`)
and the shapes, in an LRU bounded by bytes; ``plan(...).to_string()`` draws one.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .masks import BlockKind, Mask, MaskFn, MaskKind, as_mask, captured_tensors, default_q_offset, grid_positions

__all__ = ["PieceKind", "Piece", "Plan", "plan", "clear_plan_cache", "plan_cache_stats", "PLAN_CACHE_BYTES"]


class PieceKind(enum.Enum):
    FULL = "full"      # every pair visible: no mask
    CAUSAL = "causal"  # exactly top-left causal inside the piece (the fused kernel's own flag)
    MASKED = "masked"  # the mask is evaluated on the piece and passed as a tile


@dataclass(frozen=True)
class Piece:
    """Query rows ``[q0, q1)`` against keys ``[k0, k1)`` (indices local to the call)."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: PieceKind

    @property
    def area(self) -> int:
        return (self.q1 - self.q0) * (self.k1 - self.k0)


@dataclass(frozen=True, eq=False)
class Plan:
    """How one call covers the (Nq x Nk) pairs. ``kinds`` is ``(nq_blocks, nk_blocks)`` int8.

    Plans compare and hash by identity (they hold tensors, whose ``==`` is elementwise): the plan
    cache hands out one object per key, so ``plan(...) is plan(...)`` on a hit.
    """

    Nq: int
    Nk: int
    q_offset: int
    kv_offset: int
    block_q: int
    block_k: int
    kinds: torch.Tensor
    pieces: tuple[Piece, ...]
    #: Evaluated mask tiles the kernels keep between calls with this plan (bounded, see TileCache).
    tiles: "TileCache" = field(default_factory=lambda: TileCache(), compare=False, repr=False)

    @property
    def density(self) -> float:
        """Fraction of the dense Nq x Nk work that the pieces compute."""
        causal_area = sum(_causal_area(p) for p in self.pieces if p.kind is PieceKind.CAUSAL)
        other = sum(p.area for p in self.pieces if p.kind is not PieceKind.CAUSAL)
        return (causal_area + other) / max(1, self.Nq * self.Nk)

    def counts(self) -> dict[str, int]:
        return {k.name.lower(): int((self.kinds == int(k)).sum()) for k in BlockKind}

    def to_string(self, max_blocks: int = 64) -> str:
        """ASCII drawing of the block mask: ``#`` full, ``~`` partial, ``.`` empty."""
        glyph = {int(BlockKind.FULL): "#", int(BlockKind.PARTIAL): "~", int(BlockKind.EMPTY): "."}
        kinds = self.kinds
        step_q = max(1, -(-kinds.shape[0] // max_blocks))
        step_k = max(1, -(-kinds.shape[1] // max_blocks))
        rows = []
        for i in range(0, kinds.shape[0], step_q):
            sub = kinds[i:i + step_q]
            row = ""
            for j in range(0, kinds.shape[1], step_k):
                cell = sub[:, j:j + step_k]
                row += glyph[int(cell.max())] if int(cell.min()) == int(cell.max()) else "~"
            rows.append(row)
        c = self.counts()
        head = (f"Plan(Nq={self.Nq}, Nk={self.Nk}, q_offset={self.q_offset}, kv_offset={self.kv_offset}, "
                f"blocks {self.block_q}x{self.block_k}: {c['full']} full, {c['partial']} partial, "
                f"{c['empty']} empty; {len(self.pieces)} pieces; {self.density:.1%} of dense work)")
        return head + "\n" + "\n".join(rows)

    def __repr__(self):
        c = self.counts()
        return (f"Plan(Nq={self.Nq}, Nk={self.Nk}, blocks={self.block_q}x{self.block_k}, "
                f"full={c['full']}, partial={c['partial']}, empty={c['empty']}, "
                f"pieces={len(self.pieces)}, density={self.density:.3f})")


class TileCache:
    """Mask tiles a plan's calls reuse, so a training or decoding loop evaluates each partial
    tile once, like Flex's BlockMask. At most ``budget`` bytes per plan; past that, kernels
    rebuild tiles per call (still memoised within the call). While its plan is in the plan
    cache, every byte stored here counts against the cache's budget (``on_grow``)."""

    budget = 64 << 20

    def __init__(self):
        self._d: dict = {}
        self.bytes = 0
        self.on_grow = None  # set by the plan cache while it holds the plan

    def get(self, key):
        return self._d.get(key)

    def put(self, key, value, nbytes: int) -> None:
        if key not in self._d and self.bytes + nbytes <= self.budget:
            self._d[key] = value
            self.bytes += nbytes
            grow = self.on_grow
            if grow is not None:
                grow(nbytes)

    def shared(self, fingerprint, value, same):
        """A tile already stored under ``fingerprint`` for which ``same(stored, value)`` holds, else
        ``value`` (remembered for the next one, at no charge: its bytes are counted by ``put``).
        Partial tiles at different places are often equal (every diagonal tile inside one
        document is the same causal triangle); sharing one tensor keeps the cache's memory
        proportional to the distinct tiles. The fingerprint only narrows the search; ``same``
        decides."""
        seen = self._d.setdefault(("shared", fingerprint), [])
        for old in seen:
            if same(old, value):
                return old
        seen.append(value)
        return value

    def __len__(self):
        return len(self._d)


def _causal_area(p: Piece) -> int:
    L, S = p.q1 - p.q0, p.k1 - p.k0
    # top-left causal: row i sees min(i + 1, S) keys
    m = min(L, S)
    return m * (m + 1) // 2 + max(0, L - S) * S


# ------------------------------------------------------------------------- the cache

#: Bytes the plan cache may hold: every cached plan's block kinds, pieces and mask tiles, and
#: the tensors its mask callable captures (the cache keeps them alive). Least recently used
#: plans go first. A module attribute, read at every insertion.
PLAN_CACHE_BYTES = 256 << 20
_CACHE_MAX_PLANS = 4096  # and never more plans than this, however small
_PLAN_OVERHEAD = 512     # bytes a Plan and its key cost before any tensor (rough)

_CACHE: "OrderedDict[tuple, Plan]" = OrderedDict()
_BASE: dict = {}  # key -> bytes of the plan apart from its tiles
_LOCK = threading.RLock()
_STATS = {"hits": 0, "misses": 0, "evictions": 0, "bytes": 0}


def clear_plan_cache() -> None:
    """Drop every cached plan (and its tiles) and reset :func:`plan_cache_stats`."""
    with _LOCK:
        for p in _CACHE.values():
            p.tiles.on_grow = None
        _CACHE.clear()
        _BASE.clear()
        _STATS.update(hits=0, misses=0, evictions=0, bytes=0)


def plan_cache_stats() -> dict[str, int]:
    """The plan cache's counters: ``hits``, ``misses``, ``evictions``, ``bytes`` held (plans,
    their mask tiles and the tensors their callables capture), ``size`` (plans) and
    ``budget`` (:data:`PLAN_CACHE_BYTES`).

    >>> import keyfold
    >>> sorted(keyfold.plan_cache_stats())
    ['budget', 'bytes', 'evictions', 'hits', 'misses', 'size']
    """
    with _LOCK:
        return dict(_STATS, size=len(_CACHE), budget=PLAN_CACHE_BYTES)


def _grew(nbytes: int) -> None:
    with _LOCK:
        _STATS["bytes"] += nbytes
        _evict()


def _evict() -> None:
    """Drop least recently used plans until the cache fits its budget (caller holds _LOCK)."""
    while _CACHE and (_STATS["bytes"] > PLAN_CACHE_BYTES or len(_CACHE) > _CACHE_MAX_PLANS):
        key, old = _CACHE.popitem(last=False)
        old.tiles.on_grow = None
        _STATS["bytes"] -= _BASE.pop(key) + old.tiles.bytes
        _STATS["evictions"] += 1


def _plan_bytes(p: Plan, mask) -> int:
    captured = sum(t.numel() * t.element_size() for t in _captured_tensors_of(mask))
    return _PLAN_OVERHEAD + p.kinds.numel() * p.kinds.element_size() + 64 * len(p.pieces) + captured


def _captured_tensors_of(mask) -> list:
    """Tensors the callables inside ``mask`` capture (kept alive by a cache key holding it)."""
    if mask is None:
        return []
    if isinstance(mask, MaskFn):
        return captured_tensors(mask.fn)
    return [t for m in vars(mask).values() if isinstance(m, Mask) for t in _captured_tensors_of(m)]


def default_block(Nq: int, Nk: int) -> tuple[int, int]:
    """Tile sizes: large enough that per-call overhead vanishes, small enough to skip work."""
    bq = 256 if Nq > 256 else max(1, Nq)
    bk = 256 if Nk > 256 else max(1, Nk)
    return bq, bk


def plan(mask: Mask | None, Nq: int, Nk: int, *, q_offset: int | None = None, kv_offset: int = 0,
         B: int = 1, H: int = 1, block_size: int | tuple[int, int] | None = None) -> Plan:
    """Plan ``mask`` over ``Nq`` queries and ``Nk`` keys (cached): which tiles are EMPTY, PARTIAL
    or FULL and the pieces the kernels compute.

    q_offset, kv_offset: absolute positions of the first query / key, as in :func:`keyfold.attend`.
    B, H: batch and query heads (they matter only for masks that depend on them).
    block_size: tile size (an int, or ``(block_q, block_k)``); default from :func:`default_block`.

    >>> from keyfold import causal, window
    >>> plan(causal() & window(4), 16, 16, block_size=4).counts()
    {'empty': 9, 'partial': 7, 'full': 0}
    """
    return _plan(mask, Nq, Nk, q_offset=q_offset, kv_offset=kv_offset, B=B, H=H, block_size=block_size)


def _plan(mask: Mask | None, Nq: int, Nk: int, *, q_offset: int | None = None, kv_offset: int = 0,
          B: int = 1, H: int = 1, block_size: int | tuple[int, int] | None = None,
          max_span: int | None = None, allow_causal: bool = True) -> Plan:
    """:func:`plan` with the kernels' own settings (the engine and the Triton launcher set them).

    max_span: longest key span one piece may cover (the kernels bound their tile memory by it).
    allow_causal: whether a piece may use the fused kernel's own causal flag.
    """
    mask = as_mask(mask)
    q_offset = default_q_offset(mask, Nq, Nk, kv_offset) if q_offset is None else q_offset
    if block_size is None:
        bq, bk = default_block(Nq, Nk)
        hint = mask.preferred_block() if mask is not None else None
        if hint:
            bq, bk = min(bq, hint), min(bk, hint)
    elif isinstance(block_size, int):
        bq = bk = block_size
    else:
        bq, bk = block_size
    if bq < 1 or bk < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    dep_b, dep_h = mask.depends_on_batch_head(B, H) if mask is not None else (False, False)
    # the stamp of what callables inside the mask capture: a plan is never reused for other contents
    stamp = mask.captured_stamp() if mask is not None else ()
    key = (mask, stamp, Nq, Nk, q_offset, kv_offset, B if dep_b else 0, H if dep_h else 0, bq, bk, max_span,
           allow_causal)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            _STATS["hits"] += 1
            return hit
    if mask is not None:
        mask.check_positions(q_offset, q_offset + Nq, kv_offset, kv_offset + Nk)
    result = _build(mask, Nq, Nk, q_offset, kv_offset, B, H, bq, bk, max_span, allow_causal)
    base = _plan_bytes(result, mask)
    with _LOCK:
        _STATS["misses"] += 1
        if key not in _CACHE:
            _CACHE[key] = result
            _BASE[key] = base
            _STATS["bytes"] += base
            result.tiles.on_grow = _grew
            _evict()
    return result


def _build(mask, Nq, Nk, q_offset, kv_offset, B, H, bq, bk, max_span, allow_causal) -> Plan:
    q_starts = torch.arange(0, Nq, bq)
    k_starts = torch.arange(0, Nk, bk)
    q0 = (q_offset + q_starts).view(-1, 1)
    q1 = (q_offset + torch.clamp(q_starts + bq, max=Nq)).view(-1, 1)
    k0 = (kv_offset + k_starts).view(1, -1)
    k1 = (kv_offset + torch.clamp(k_starts + bk, max=Nk)).view(1, -1)

    if mask is None:
        kinds = torch.full((len(q_starts), len(k_starts)), int(BlockKind.FULL), dtype=torch.int8)
    else:
        empty = len(q_starts) == 0 or len(k_starts) == 0  # no rows or no keys: nothing to classify
        kinds = torch.zeros(len(q_starts), len(k_starts), dtype=torch.int8) if empty else mask.classify(q0, q1, k0, k1)
        if kinds is None:
            kinds = _classify_exact(mask, B, H, Nq, Nk, q_offset, kv_offset, bq, bk)
        kinds = torch.broadcast_to(kinds, (len(q_starts), len(k_starts))).contiguous()

    if mask is None and max_span is None:
        pieces = (Piece(0, Nq, 0, Nk, PieceKind.FULL),)
    elif _is_causal(mask) and allow_causal and max_span is None:
        pieces = _causal_pieces(Nq, Nk, q_offset - kv_offset)
    else:
        pieces = _grid_pieces(kinds, Nq, Nk, bq, bk, max_span)
    return Plan(Nq, Nk, q_offset, kv_offset, bq, bk, kinds, pieces)


def _is_causal(mask: Mask | None) -> bool:
    spec = mask.spec() if mask is not None else None
    return spec is not None and spec[0] is MaskKind.CAUSAL


def _causal_pieces(Nq: int, Nk: int, d: int) -> tuple[Piece, ...]:
    """Closed form for ``causal()``: row i sees local keys j <= i + d.

    Keys below d are seen by every row (one FULL piece); the rest is top-left causal
    against the rows, which the fused kernel does natively with its own flag. One row (a decoding
    step) sees keys up to d whole: one FULL piece, not a FULL and a one-key CAUSAL piece merged (two
    calls, and in 16 bits a rounding of the first piece's out before the merge: 7 of 100 bfloat16
    steps over 13 keys broke the correctness rule, up to 7.8x the naive error; found by fuzzing).
    """
    pieces = []
    if Nq == 1 and d >= 0:
        return (Piece(0, 1, 0, min(d + 1, Nk), PieceKind.FULL),)
    if d >= 0:
        if d > 0:
            pieces.append(Piece(0, Nq, 0, min(d, Nk), PieceKind.FULL))
        if d < Nk:
            pieces.append(Piece(0, Nq, d, Nk, PieceKind.CAUSAL))
    elif -d < Nq:
        pieces.append(Piece(-d, Nq, 0, Nk, PieceKind.CAUSAL))  # rows above -d see no key
    return tuple(pieces)


def _grid_pieces(kinds, Nq, Nk, bq, bk, max_span) -> tuple[Piece, ...]:
    """Per query block: maximal runs of FULL tiles become FULL pieces, runs of PARTIAL tiles
    MASKED pieces; vertically identical FULL pieces of consecutive query blocks fuse."""
    EMPTY, FULL = int(BlockKind.EMPTY), int(BlockKind.FULL)
    rows = kinds.tolist()
    per_block = []
    for i, row in enumerate(rows):
        q0, q1 = i * bq, min(Nq, (i + 1) * bq)
        spans = []
        j = 0
        while j < len(row):
            if row[j] == EMPTY:
                j += 1
                continue
            kind = row[j]
            j2 = j
            while j2 < len(row) and row[j2] == kind:
                j2 += 1
            spans.append([j * bk, min(Nk, j2 * bk), PieceKind.FULL if kind == FULL else PieceKind.MASKED])
            j = j2
        per_block.append((q0, q1, _bounded(_absorb_short_full(spans), max_span)))

    pieces: list[Piece] = []
    open_full: dict[tuple[int, int], list[int]] = {}  # (k0, k1) -> [q0, q1] being extended
    for q0, q1, spans in per_block:
        still_open = {}
        for k0, k1, kind in spans:
            if kind is PieceKind.FULL and max_span is None:
                prev = open_full.get((k0, k1))
                if prev is not None and prev[1] == q0:
                    prev[1] = q1
                    still_open[(k0, k1)] = prev
                else:
                    still_open[(k0, k1)] = [q0, q1]
            else:
                pieces.append(Piece(q0, q1, k0, k1, kind))
        for (k0, k1), (a, b) in open_full.items():
            if (k0, k1) not in still_open or still_open[(k0, k1)] is not open_full[(k0, k1)]:
                pieces.append(Piece(a, b, k0, k1, PieceKind.FULL))
        open_full = still_open
    for (k0, k1), (a, b) in open_full.items():
        pieces.append(Piece(a, b, k0, k1, PieceKind.FULL))
    pieces.sort(key=lambda p: (p.q0, p.k0))
    return tuple(pieces)


ABSORB_FULL = 256  # a FULL run this short between/next to MASKED spans rides along in their call
#: A FULL run this short with MASKED spans on *both* sides (a sliding window's band) rides along too:
#: one call over the band with a mask beats three calls and two merges. Window 1024 at 4k keys
#: (Intel Xeon, 2 threads): 0.76x the time in bfloat16, 0.81x in float32. Runs with a MASKED span on
#: one side only stay apart: absorbing a prefix-LM's prefix or a causal row's past cost 1.05-1.7x.
ABSORB_BETWEEN = 1024


def _absorb_short_full(spans):
    """Fold short FULL runs that touch a MASKED span into it: one fused call with a slightly
    larger mask beats an extra call plus a merge (sliding windows: MASKED|FULL|MASKED -> one)."""
    out = []
    for span in spans:
        k0, k1, kind = span
        prev = out[-1] if out else None
        touching = prev is not None and prev[1] == k0
        if touching and prev[2] is PieceKind.MASKED and (kind is PieceKind.MASKED or k1 - k0 <= ABSORB_FULL):
            prev[1] = k1
        elif touching and kind is PieceKind.MASKED and prev[2] is PieceKind.FULL and prev[1] - prev[0] <= ABSORB_FULL:
            prev[1], prev[2] = k1, PieceKind.MASKED
        else:
            out.append([k0, k1, kind])
    return _absorb_between(out)


def _absorb_between(spans):
    """MASKED | FULL (at most ABSORB_BETWEEN keys) | MASKED, touching, becomes one MASKED span."""
    out = []
    for span in spans:
        if (span[2] is PieceKind.MASKED and len(out) >= 2 and out[-1][2] is PieceKind.FULL
                and out[-2][2] is PieceKind.MASKED and out[-2][1] == out[-1][0] and out[-1][1] == span[0]
                and out[-1][1] - out[-1][0] <= ABSORB_BETWEEN):
            out.pop()
            out[-1][1] = span[1]
        elif span[2] is PieceKind.MASKED and out and out[-1][2] is PieceKind.MASKED and out[-1][1] == span[0]:
            out[-1][1] = span[1]
        else:
            out.append(span)
    return out


def _bounded(spans, max_span):
    if max_span is None:
        return spans
    out = []
    for k0, k1, kind in spans:
        for s in range(k0, k1, max_span):
            out.append([s, min(k1, s + max_span), kind])
    return out


def _int32_evaluates(mask, reach: int) -> bool:
    """Whether ``mask`` gives on int32 positions (below ``reach`` in magnitude) what it gives on
    int64 ones: its presets' integer parameters plus ``reach`` stay below 2^31 (a Python int beside
    an int32 tensor is taken mod 2^32); a callable is handed int32 positions anyway (_callables); a
    mask class of one's own, whose numbers are its own, is not. A preset subtracts positions (a query's
    minus a key's spans twice ``reach``): ``dilated(300)`` with q_offset -2^30 and kv_offset 2^30 had
    wrapped there, tiles called EMPTY or FULL that are not (errors up to 5; a review, 2026-12-07)."""
    ops = mask.operands()
    if ops is not None:
        return all(_int32_evaluates(m, reach) for m in ops[1])
    if isinstance(mask, MaskFn):
        return reach < 2 ** 31
    spec = mask.spec()
    if spec is None:
        return False
    ints = [abs(v) for v in spec[1].values() if isinstance(v, int) and not isinstance(v, bool)]
    return 2 * reach + max(ints, default=0) < 2 ** 31


def _classify_exact(mask, B, H, Nq, Nk, q_offset, kv_offset, bq, bk) -> torch.Tensor:
    """Evaluate the mask on every pair, a few query blocks at a time (never Nq x Nk at once),
    and count the visible pairs of every tile in one reduction: EMPTY at 0, FULL at all."""
    dep_b, dep_h = mask.depends_on_batch_head(B, H)
    Be, He = (B if dep_b else 1), (H if dep_h else 1)
    nkb = -(-Nk // bk)
    pad = nkb * bk - Nk
    rows_per_chunk = max(bq, ((1 << 23) // max(1, Nk * Be * He)) // bq * bq)
    cols = torch.full((nkb,), bk, dtype=torch.int32)
    cols[-1] = Nk - (nkb - 1) * bk
    # int32 positions (half the bytes of int64 arithmetic: planning a 16k callable mask took 1.45x
    # the time in int64) where they give what the tiles' int64 ones give: positions and the mask's
    # own integers summed below 2^31. A parameter past it (dilated(2**32 + 1), window(2**32 + 5)
    # & ...) had wrapped to 32 bits here: tiles called FULL or EMPTY that are not (errors 0.5-3.8,
    # a helper's fuzz)
    reach = max(abs(q_offset), abs(q_offset + Nq), abs(kv_offset), abs(kv_offset + Nk))
    pos_dtype = torch.int32 if _int32_evaluates(mask, reach) else torch.int64
    out = []
    for r0 in range(0, Nq, rows_per_chunk):
        r1 = min(Nq, r0 + rows_per_chunk)
        R = r1 - r0
        nrb = -(-R // bq)
        b, h, qp, kp = grid_positions(Be, He, q_offset + r0, R, kv_offset, Nk, None, dtype=pos_dtype)
        m = torch.broadcast_to(mask.evaluate(b, h, qp, kp), (Be, He, R, Nk))
        if pad or nrb * bq != R:
            m = torch.nn.functional.pad(m, (0, pad, 0, nrb * bq - R), value=False)
        count = m.view(torch.uint8).reshape(Be * He, nrb, bq, nkb, bk).sum(dim=(0, 2, 4), dtype=torch.int32)
        rows = torch.full((nrb, 1), bq, dtype=torch.int32)
        rows[-1] = R - (nrb - 1) * bq
        kinds = torch.full((nrb, nkb), int(BlockKind.PARTIAL), dtype=torch.int8)
        kinds[count == 0] = int(BlockKind.EMPTY)
        kinds[count == rows * cols * (Be * He)] = int(BlockKind.FULL)
        out.append(kinds)
    return torch.cat(out) if out else torch.empty(0, nkb, dtype=torch.int8)  # no query rows
