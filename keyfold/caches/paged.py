"""``PagedKVCache``: a pool of fixed-size pages, block tables, copy-on-write forks.

Sequences take pages on demand; a sequence's block table lists its pages in order. ``fork``
shares every page (reference counts) and copies a partly filled last page only when one of
the sharers writes to it. Decoding reads each run of physically consecutive pages as one span
(a view, no gather), so large pages and a placement that keeps a sequence's pages together
make paged decoding cost what contiguous decoding costs (docs/caches.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import block_lengths, float_dtype, kv_block, positive_int, seq_list
from ._pieces import CacheFullError, Group, Span
from ._storage import zeros

__all__ = ["PagedKVCache", "PageStats", "default_page_size"]


def default_page_size(device) -> int:
    """1024 tokens on a CPU, 64 elsewhere.

    The CPU's fused kernel has no block table, so each run of pages is one call: per-page
    calls cost 6.7x a contiguous decode with 16-token pages, 1.36x with 256, 1.11x with 2048
    (DESIGN.md section 7). Large pages keep the runs long; waste stays below one page per sequence.
    """
    return 1024 if torch.device(device if device is not None else "cpu").type == "cpu" else 64


@dataclass(frozen=True)
class PageStats:
    """``stats()``: pages used / free / shared, tokens held and slots wasted in partly filled pages."""

    pages: int          # pages in the pool
    used: int           # pages holding tokens of at least one sequence
    free: int           # pages ready to hand out
    shared: int         # used pages referenced by more than one sequence (after fork)
    tokens: int         # token slots written in used pages (a shared page counts once)
    wasted: int         # slots in used pages not written yet (at most page_size - 1 per sequence)
    sequences: int      # live sequences
    bytes_used: int     # bytes of k and v in used pages


class PagedKVCache:
    """A pool of ``num_pages`` pages of ``page_size`` tokens for any number of sequences.

    Storage: ``k_pages`` ``(heads, num_pages, page_size, head_dim)`` and ``v_pages`` with
    ``value_dim``, allocated once (heads outermost, so a run of consecutive pages is one
    ``(heads, tokens, dim)`` view). Sequence ids are ints handed out by :meth:`new_sequence`
    and :meth:`fork`. ``page_size=None`` picks :func:`default_page_size`.

    >>> import torch
    >>> from keyfold.caches import PagedKVCache, decode
    >>> pool = PagedKVCache(num_pages=8, page_size=4, heads=2, head_dim=8)
    >>> a = pool.new_sequence()
    >>> pool.append(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), a)
    >>> b = pool.fork(a)                     # shares both pages
    >>> pool.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), b)  # copies the last one
    >>> pool.stats().shared, pool.length(a), pool.length(b)
    (1, 6, 7)
    >>> decode(torch.randn(2, 2, 1, 8), pool, seq_ids=[a, b]).shape
    torch.Size([2, 2, 1, 8])
    """

    def __init__(self, num_pages: int, page_size: int | None, heads: int, head_dim: int, dtype=torch.float32,
                 value_dim: int | None = None, device=None):
        positive_int(num_pages, "num_pages", "PagedKVCache")
        if page_size is None:
            page_size = default_page_size(device)
        positive_int(page_size, "page_size", "PagedKVCache")
        positive_int(heads, "heads", "PagedKVCache")
        positive_int(head_dim, "head_dim", "PagedKVCache")
        value_dim = head_dim if value_dim is None else positive_int(value_dim, "value_dim", "PagedKVCache")
        float_dtype(dtype, "PagedKVCache")
        self.num_pages, self.page_size = num_pages, page_size
        self.heads, self.head_dim, self.value_dim, self.dtype = heads, head_dim, value_dim, dtype
        self.k_pages = zeros(heads, num_pages, page_size, head_dim, dtype=dtype, device=device)   # (H, P, ps, D)
        self.v_pages = zeros(heads, num_pages, page_size, value_dim, dtype=dtype, device=device)  # (H, P, ps, Dv)
        self._tables: dict[int, list[int]] = {}
        self._len: dict[int, int] = {}
        self._ref = [0] * num_pages   # sequences referencing each page
        self._fill = [0] * num_pages  # token slots written in each page
        self._free = [True] * num_pages
        self._nfree = num_pages
        self._next_id = 0

    # ------------------------------------------------------------------ sequences
    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    @property
    def sequences(self) -> list[int]:
        """Live sequence ids, oldest first."""
        return list(self._tables)

    def _seq(self, s) -> int:
        if isinstance(s, bool) or not isinstance(s, int) or s not in self._tables:
            raise KeyError(f"PagedKVCache: unknown sequence id {s!r}; live ids are {self.sequences} "
                           f"(get one from new_sequence() or fork())")
        return s

    def new_sequence(self) -> int:
        """A new empty sequence; it takes pages only when tokens are appended."""
        s = self._next_id
        self._next_id += 1
        self._tables[s], self._len[s] = [], 0
        return s

    def fork(self, seq: int) -> int:
        """A new sequence sharing all of ``seq``'s pages (copy-on-write); returns its id.

        Nothing is copied now. Whichever sharer next writes into a shared, partly filled last
        page first copies it to a page of its own; full pages are never written again.
        """
        self._seq(seq)
        child = self.new_sequence()
        self._tables[child] = list(self._tables[seq])
        self._len[child] = self._len[seq]
        for p in self._tables[child]:
            self._ref[p] += 1
        return child

    def free(self, seq: int) -> None:
        """Forget a sequence; pages no other sequence references return to the pool."""
        self._seq(seq)
        self._drop(self._tables.pop(seq))
        del self._len[seq]

    def _drop(self, pages) -> None:
        """A sequence lets go of ``pages``: those no other sequence references return to the pool."""
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._release(p)

    def truncate(self, seq: int, length: int) -> None:
        """Keep only the first ``length`` tokens of ``seq`` (speculative decoding: roll back the draft tokens
        the target model rejected). Pages past them leave the sequence (back to the pool where no other
        sequence references them); a kept last page shared with a fork stays shared, and the next append
        copies it first, as after :meth:`fork`. A length above what ``seq`` holds, or below 0, raises
        ``ValueError`` and changes nothing."""
        self._seq(seq)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._len[seq]:
            raise ValueError(f"PagedKVCache.truncate(length={length!r}): expected an int between 0 and the "
                             f"{self._len[seq]} tokens sequence {seq} holds; truncate only drops tokens")
        table, ps = self._tables[seq], self.page_size
        keep = -(-length // ps)
        self._drop(table[keep:])
        del table[keep:]
        o = length % ps
        if o and self._ref[table[-1]] == 1 and self._fill[table[-1]] > o:  # our own last page: its tail goes
            p = table[-1]
            self.k_pages[:, p, o:self._fill[p]].zero_()
            self.v_pages[:, p, o:self._fill[p]].zero_()
            self._fill[p] = o
        self._len[seq] = length

    def length(self, seq: int) -> int:
        return self._len[self._seq(seq)]

    def block_table(self, seq: int) -> list[int]:
        """The physical pages of ``seq`` in order (a copy)."""
        return list(self._tables[self._seq(seq)])

    def stats(self) -> PageStats:
        used = [p for p in range(self.num_pages) if self._ref[p] > 0]
        # the slots some sequence still reads, from the block tables (a page's fill stayed at a freed fork's
        # length after its sharer truncated into it: tokens 8 where 6 were held; a review, 2026-12-08)
        held: dict[int, int] = {}
        for s, table in self._tables.items():
            for j, p in enumerate(table):
                held[p] = max(held.get(p, 0), min(self.page_size, self._len[s] - j * self.page_size))
        tokens = sum(held.get(p, 0) for p in used)
        per_page = self.heads * self.page_size * (self.head_dim + self.value_dim) * self.k_pages.element_size()
        return PageStats(pages=self.num_pages, used=len(used), free=self._nfree,
                         shared=sum(1 for p in used if self._ref[p] > 1), tokens=tokens,
                         wasted=len(used) * self.page_size - tokens, sequences=len(self._tables),
                         bytes_used=len(used) * per_page)

    # -------------------------------------------------------------------- pages
    def _release(self, p: int) -> None:
        self._free[p], self._fill[p] = True, 0
        self._nfree += 1

    def _take(self, after: int | None) -> int:
        """A free page: right after ``after`` when free (the sequence's run continues), else
        the middle of the largest free run (room for the sequence before it to grow into)."""
        if after is not None and after + 1 < self.num_pages and self._free[after + 1]:
            p = after + 1
        else:
            best, start, run_start = (0, 0), None, None
            for i, f in enumerate(self._free + [False]):
                if f and run_start is None:
                    run_start = i
                elif not f and run_start is not None:
                    if i - run_start > best[0]:
                        best, start = (i - run_start, run_start), run_start
                    run_start = None
            length, a = best
            p = a if a == 0 else a + length // 2
        self._free[p] = False
        self._nfree -= 1
        self._ref[p] = 1
        return p

    def _pages_needed(self, ids, lens) -> int:
        """Pages an append takes, simulating copy-on-write of shared last pages in order."""
        ref = {}
        total = 0
        for s, m in zip(ids, lens):
            if m == 0:
                continue
            L, table = self._len[s], self._tables[s]
            if L % self.page_size and table:
                last = table[-1]
                r = ref.get(last, self._ref[last])
                if r > 1:
                    total += 1
                    ref[last] = r - 1
            total += -(-(L + m) // self.page_size) - (-(-L // self.page_size))
        return total

    # ------------------------------------------------------------------- writes
    def append(self, k: torch.Tensor, v: torch.Tensor, seq_ids, lengths=None) -> None:
        """Append a block of tokens: row ``i`` of k ``(b, heads, n, head_dim)`` / v to ``seq_ids[i]``.

        ``lengths`` (``b`` ints) appends only the first ``lengths[i]`` tokens of row ``i``.
        Raises ``KeyError`` for an unknown id and ``CacheFullError`` when the pool has too few
        free pages; in both cases nothing changes.
        """
        ids = seq_list(seq_ids, "PagedKVCache.append")
        for s in ids:
            self._seq(s)
        kv_block(k, v, heads=self.heads, head_dim=self.head_dim, value_dim=self.value_dim,
                 owner="PagedKVCache", batch=len(ids), device=self.device)
        lens = block_lengths(lengths, len(ids), k.shape[2], "PagedKVCache")
        need = self._pages_needed(ids, lens)
        if need > self._nfree:
            raise CacheFullError(f"PagedKVCache.append: needs {need} free pages but the pool has {self._nfree} "
                                 f"of {self.num_pages} (page_size={self.page_size}); free() finished sequences "
                                 f"or create a larger pool")
        # a write that raises (say, an inference tensor updated outside inference mode) leaves the pool
        # as it was: the block tables, lengths, fills and the pages taken or un-shared are put back. A
        # page left in a table at an unchanged length was the one a later fork's copy-on-write took
        # for the last page, so two sequences wrote into one page (a review, 2026-12-07)
        # what a write can change, O(1) a sequence (a decoding step must not copy whole block tables):
        # a table only grows at its end or has its last page replaced (copy-on-write)
        before = {}
        for s in ids:
            last = self._tables[s][-1] if self._tables[s] else None
            before[s] = (len(self._tables[s]), last, None if last is None else self._fill[last], self._len[s])
        undo: list[tuple[str, int]] = []
        try:
            for i, (s, m) in enumerate(zip(ids, lens)):
                if m:
                    self._write(s, k[i], v[i], m, undo)
        except BaseException:
            for what, p in reversed(undo):
                if what == "took":
                    self._ref[p] = 0
                    self._release(p)
                else:  # "unshared": the copy-on-write let go of a shared page
                    self._ref[p] += 1
            for s, (n, last, fill, L) in before.items():
                table = self._tables[s]
                del table[n:]
                if last is not None:
                    table[-1], self._fill[last] = last, fill
                self._len[s] = L
            raise

    def _write(self, s: int, k: torch.Tensor, v: torch.Tensor, m: int, undo: list) -> None:
        """Write ``m`` tokens of k ``(heads, n, D)`` / v at the end of sequence ``s``; ``undo`` gets the
        pages taken and let go of, for :meth:`append` to put back if a write raises."""
        ps, table, L = self.page_size, self._tables[s], self._len[s]
        if L % ps and self._ref[table[-1]] > 1:  # copy-on-write of the shared, partly filled last page
            old, fill = table[-1], L % ps
            new = self._take(table[-2] if len(table) > 1 else None)
            undo.append(("took", new))
            self.k_pages[:, new, :fill] = self.k_pages[:, old, :fill]
            self.v_pages[:, new, :fill] = self.v_pages[:, old, :fill]
            self._fill[new] = fill
            self._ref[old] -= 1
            undo.append(("unshared", old))
            table[-1] = new
        done = 0
        while done < m:
            t = L + done
            if t % ps == 0:
                table.append(self._take(table[-1] if table else None))
                undo.append(("took", table[-1]))
            p, o = table[t // ps], t % ps
            step = min(m - done, ps - o)
            self.k_pages[:, p, o:o + step] = k[:, done:done + step]
            self.v_pages[:, p, o:o + step] = v[:, done:done + step]
            self._fill[p] = o + step
            done += step
        self._len[s] = L + m

    # -------------------------------------------------------------------- reads
    def _runs(self, s: int):
        """(first page, pages, first token, tokens) of each run of physically consecutive pages."""
        table, L, ps = self._tables[s], self._len[s], self.page_size
        runs, j = [], 0
        while j < len(table):
            e = j + 1
            while e < len(table) and table[e] == table[e - 1] + 1:
                e += 1
            runs.append((table[j], e - j, j * ps, min(L, e * ps) - j * ps))
            j = e
        return runs

    def _span(self, p0, r, t0, n) -> Span:
        """Views ``(1, H, n, D)`` of the ``n`` tokens in pages ``p0 .. p0 + r - 1`` (one view op each:
        this runs for every span of every decoding step)."""
        k, v = self.k_pages, self.v_pages  # (H, P, ps, D): consecutive pages are consecutive rows
        sk, sv = k.stride(), v.stride()
        k = k.as_strided((1, self.heads, n, self.head_dim), (sk[0], sk[0], sk[2], sk[3]),
                         k.storage_offset() + p0 * sk[1])
        v = v.as_strided((1, self.heads, n, self.value_dim), (sv[0], sv[0], sv[2], sv[3]),
                         v.storage_offset() + p0 * sv[1])
        return Span(k, v, t0)

    def keys(self, seq: int) -> torch.Tensor:
        """A gathered copy ``(1, heads, length, head_dim)`` of one sequence's keys (for inspection)."""
        self._seq(seq)
        return torch.cat([self._span(*r).k for r in self._runs(seq)] or [self.k_pages[:, :0, 0].unsqueeze(0)], 2)

    def values(self, seq: int) -> torch.Tensor:
        """A gathered copy ``(1, heads, length, value_dim)`` of one sequence's values."""
        self._seq(seq)
        return torch.cat([self._span(*r).v for r in self._runs(seq)] or [self.v_pages[:, :0, 0].unsqueeze(0)], 2)

    def implied_mask(self, n_queries: int = 1):
        return None

    def pieces(self, seq_ids=None, n_queries: int = 1, exact_positions: bool = True) -> list[Group]:
        """One group per sequence; one span per run of consecutive pages (a view)."""
        if seq_ids is None:
            raise ValueError("decode(seq_ids=...): a PagedKVCache needs the ids of the sequences q's rows "
                             "belong to, e.g. seq_ids=[a, b]")
        ids = seq_list(seq_ids, "decode")
        for s in ids:
            self._seq(s)
        return [Group(i, i + 1, self._len[s], tuple(self._span(*r) for r in self._runs(s)))
                for i, s in enumerate(ids)]

    def __repr__(self):
        st = self.stats()
        return (f"PagedKVCache(pages={self.num_pages}x{self.page_size}, heads={self.heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, sequences={st.sequences}, used={st.used})")
