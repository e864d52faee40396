"""``KVCache``: one preallocated block of memory per batch row, sequences of different lengths."""

from __future__ import annotations

import torch

from ._checks import block_lengths, float_dtype, kv_block, positive_int, seq_list
from ._pieces import CacheFullError, Group, Span
from ._storage import zeros

__all__ = ["KVCache"]


class KVCache:
    """Contiguous, preallocated key/value cache for ``batch`` sequences of up to ``capacity`` tokens.

    Storage: ``k`` ``(batch, heads, capacity, head_dim)`` and ``v`` ``(batch, heads, capacity,
    value_dim)`` in ``dtype``, allocated once. Sequence ``s`` is batch row ``s``; it holds
    ``lengths[s]`` tokens at absolute positions ``0 .. lengths[s] - 1``. Decoding reads views of
    this storage (no copy): see :func:`keyfold.caches.decode`. Slots past a sequence's length
    always hold zeros (fresh storage, and :meth:`reset` zeroes what it forgets).

    >>> import torch
    >>> from keyfold.caches import KVCache, decode
    >>> cache = KVCache(batch=2, heads=4, head_dim=8, capacity=64)
    >>> cache.append(torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), lengths=[5, 3])
    >>> cache.lengths
    (5, 3)
    >>> decode(torch.randn(2, 4, 1, 8), cache).shape
    torch.Size([2, 4, 1, 8])
    """

    def __init__(self, batch: int, heads: int, head_dim: int, capacity: int, dtype=torch.float32,
                 value_dim: int | None = None, device=None):
        positive_int(batch, "batch", "KVCache")
        positive_int(heads, "heads", "KVCache")
        positive_int(head_dim, "head_dim", "KVCache")
        positive_int(capacity, "capacity", "KVCache")
        value_dim = head_dim if value_dim is None else positive_int(value_dim, "value_dim", "KVCache")
        float_dtype(dtype, "KVCache")
        self.batch, self.heads, self.head_dim, self.value_dim = batch, heads, head_dim, value_dim
        self.capacity, self.dtype = capacity, dtype
        self.k = zeros(batch, heads, capacity, head_dim, dtype=dtype, device=device)   # (B, H, C, D)
        self.v = zeros(batch, heads, capacity, value_dim, dtype=dtype, device=device)  # (B, H, C, Dv)
        self._len = [0] * batch
        self._whole = None  # (k, v, L) views when every sequence holds L tokens; see whole()

    # ------------------------------------------------------------------------- state
    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens held by each sequence (batch row)."""
        return tuple(self._len)

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated storage (constant)."""
        return self.k.nbytes + self.v.nbytes

    def keys(self, seq: int) -> torch.Tensor:
        """View ``(1, heads, lengths[seq], head_dim)`` of one sequence's keys."""
        s = self._seq(seq)
        return self.k[s:s + 1, :, :self._len[s]]

    def values(self, seq: int) -> torch.Tensor:
        """View ``(1, heads, lengths[seq], value_dim)`` of one sequence's values."""
        s = self._seq(seq)
        return self.v[s:s + 1, :, :self._len[s]]

    def _seq(self, s) -> int:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.batch:
            raise KeyError(f"KVCache: unknown sequence id {s!r}; ids are batch rows 0..{self.batch - 1}")
        return s

    # ------------------------------------------------------------------------ writes
    def append(self, k: torch.Tensor, v: torch.Tensor, seq_ids=None, lengths=None) -> None:
        """Append a block of tokens to some sequences.

        k: ``(b, heads, n, head_dim)``, v: ``(b, heads, n, value_dim)``, any float dtype (cast to
        the cache's). Row ``i`` goes to sequence ``seq_ids[i]`` (default: all ``batch`` rows in
        order). ``lengths`` (``b`` ints, default ``n`` each) appends only the first
        ``lengths[i]`` tokens of row ``i``, for ragged blocks.

        Raises ``CacheFullError`` if a sequence would pass ``capacity``, ``KeyError`` for an
        unknown id; in both cases nothing is written.
        """
        ids = list(range(self.batch)) if seq_ids is None else seq_list(seq_ids, "KVCache.append")
        for s in ids:
            self._seq(s)
        kv_block(k, v, heads=self.heads, head_dim=self.head_dim, value_dim=self.value_dim,
                 owner="KVCache", batch=len(ids), device=self.device)
        n = k.shape[2]
        lens = block_lengths(lengths, len(ids), n, "KVCache")
        over = [(s, self._len[s], m) for s, m in zip(ids, lens) if self._len[s] + m > self.capacity]
        if over:
            s, have, m = over[0]
            raise CacheFullError(f"KVCache.append: sequence {s} holds {have} tokens, appending {m} would pass "
                                 f"capacity={self.capacity}; create the cache with a larger capacity, "
                                 f"use PagedKVCache, or a WindowCache for unbounded streams")
        runs = _runs(ids, lens, self._len)
        for i0, i1, s0 in runs:  # rows [i0, i1) -> sequences [s0, s0 + i1 - i0), same length and count
            L, m = self._len[s0], lens[i0]
            if m:
                self.k[s0:s0 + i1 - i0, :, L:L + m] = k[i0:i1, :, :m]
                self.v[s0:s0 + i1 - i0, :, L:L + m] = v[i0:i1, :, :m]
        for s, m in zip(ids, lens):
            self._len[s] += m
        self._whole = None

    def reset(self, seq_ids=None) -> None:
        """Forget the tokens of some sequences (default all); storage is kept.

        The slots' filled prefixes are zeroed, so a reset slot is indistinguishable from a fresh
        one: a ragged decode reads keys and values past a row's length (and hides them), and an
        old request's NaN or inf there would otherwise reach the next request as ``0 * NaN``."""
        ids = list(range(self.batch)) if seq_ids is None else seq_list(seq_ids, "KVCache.reset")
        for s in ids:
            self._seq(s)
        for s in ids:
            if self._len[s]:
                self.k[s, :, :self._len[s]].zero_()
                self.v[s, :, :self._len[s]].zero_()
            self._len[s] = 0
        self._whole = None

    def truncate(self, lengths, seq_ids=None) -> None:
        """Keep only the first ``lengths[i]`` tokens of sequence ``seq_ids[i]`` (default: every row in
        order; one int for all): speculative decoding rolls back the draft tokens the target model
        rejected. The dropped slots are zeroed, as :meth:`reset` leaves them. A length above what a
        sequence holds, or below 0, raises ``ValueError`` and changes nothing."""
        ids = list(range(self.batch)) if seq_ids is None else seq_list(seq_ids, "KVCache.truncate")
        for s in ids:
            self._seq(s)
        lens = [lengths] * len(ids) if isinstance(lengths, int) and not isinstance(lengths, bool) else (
            lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths))
        if len(lens) != len(ids) or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self._len[s]
                                        for n, s in zip(lens, ids)):
            raise ValueError(f"KVCache.truncate(lengths={lengths!r}): expected {len(ids)} int(s), each between 0 and "
                             f"the tokens its sequence holds ({[self._len[s] for s in ids]}); truncate only drops "
                             f"tokens")
        for s, n in zip(ids, lens):
            if n < self._len[s]:
                self.k[s, :, n:self._len[s]].zero_()
                self.v[s, :, n:self._len[s]].zero_()
                self._len[s] = n
        self._whole = None

    def reorder(self, index) -> None:
        """Row ``i`` becomes what row ``index[i]`` held (beam search: keep the surviving hypotheses).

        index: ``batch`` ints in ``[0, batch)``, repeats allowed (a hypothesis may continue as
        several beams). Copies only the filled prefix. Bad input raises and changes nothing.
        """
        idx = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        if (len(idx) != self.batch
                or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.batch for i in idx)):
            raise ValueError(f"KVCache.reorder(index=...): expected {self.batch} ints in [0, {self.batch}) "
                             f"(the old row each new row takes), got {idx}")
        L = max(self._len)
        if L:
            rows = torch.tensor(idx, device=self.k.device)
            self.k[:, :, :L] = self.k[:, :, :L].index_select(0, rows)  # index_select copies first
            self.v[:, :, :L] = self.v[:, :, :L].index_select(0, rows)
        self._len = [self._len[i] for i in idx]
        self._whole = None

    # ------------------------------------------------------------------------- reads
    def whole(self):
        """``(k, v, L)``: views of every sequence's keys and values when all hold ``L`` tokens,
        else None. Kept between appends, so a decoding step does not rebuild them."""
        if self._whole is None:
            L = self._len[0]
            if any(n != L for n in self._len):
                return None
            self._whole = (self.k[:, :, :L], self.v[:, :, :L], L)
        return self._whole

    def implied_mask(self, n_queries: int = 1):
        """None: every cached key is visible unless decode is given a mask."""
        return None

    def pieces(self, seq_ids=None, n_queries: int = 1, exact_positions: bool = True) -> list[Group]:
        """Query rows grouped with their key spans: row ``i`` is sequence ``seq_ids[i]``.

        Rows of neighbouring sequences with equal lengths form one group (one batched call).
        When nothing reads positions (``exact_positions=False``) neighbouring sequences of any
        lengths form one group, the keys past each one's length hidden by decode.
        """
        ids = list(range(self.batch)) if seq_ids is None else seq_list(seq_ids, "decode")
        for s in ids:
            self._seq(s)
        neighbours = ids == list(range(ids[0], ids[0] + len(ids))) if ids else False
        if not exact_positions and neighbours and len({self._len[s] for s in ids}) > 1:
            s0, s1, L = ids[0], ids[-1] + 1, max(self._len[s] for s in ids)
            span = Span(self.k[s0:s1, :, :L], self.v[s0:s1, :, :L], 0)
            return [Group(0, len(ids), L, (span,), tuple(self._len[s] for s in ids))]
        groups = []
        for i0, i1, s0 in _runs(ids, [0] * len(ids), self._len):
            L = self._len[s0]
            span = Span(self.k[s0:s0 + i1 - i0, :, :L], self.v[s0:s0 + i1 - i0, :, :L], 0)
            groups.append(Group(i0, i1, L, (span,) if L else ()))
        return groups

    def __repr__(self):
        return (f"KVCache(batch={self.batch}, heads={self.heads}, head_dim={self.head_dim}, "
                f"capacity={self.capacity}, dtype={self.dtype}, lengths={list(self._len)})")


def _runs(ids, lens, have):
    """Maximal runs of rows ``[i0, i1)`` whose sequences are consecutive and alike in length and count."""
    runs, i = [], 0
    while i < len(ids):
        j = i + 1
        while (j < len(ids) and ids[j] == ids[j - 1] + 1 and lens[j] == lens[i] and have[ids[j]] == have[ids[i]]):
            j += 1
        runs.append((i, j, ids[i]))
        i = j
    return runs
