"""What a cache hands to :func:`keyfold.caches.decode`: groups of query rows and key spans.

A cache never computes attention. It only says where its keys live: for a group of query
rows (sequences of equal length, stored side by side) a few contiguous *spans* of keys,
each a view of the cache's storage with the absolute position of its first key. Decoding
is then :func:`keyfold.attend` per span (``kv_offset`` = that position, so every mask and
score modifier sees the true positions) merged with :func:`keyfold.merge_all`.

The views that keep a mask meaning the same when decode runs on a slice of the batch, or when
cascade folds many requests' queries into the rows of one call, are :mod:`keyfold.views`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..masks import Mask

__all__ = ["Cache", "Span", "Group", "CacheFullError"]


class CacheFullError(RuntimeError):
    """Raised when an append does not fit (capacity, or the page pool); the cache is unchanged."""


@dataclass(frozen=True)
class Span:
    """Keys ``[kv_offset, kv_offset + n)`` of a group: ``k`` ``(b, Hkv, n, D)``, ``v`` ``(b, Hkv, n, Dv)``.

    ``k`` and ``v`` are views of the cache's storage (no copy).
    """

    k: torch.Tensor
    v: torch.Tensor
    kv_offset: int

    @property
    def n(self) -> int:
        return self.k.shape[2]


@dataclass(frozen=True)
class Group:
    """Query rows ``[r0, r1)`` of ``q``: sequences holding ``length`` tokens each, keys in ``spans``.

    The group's queries are the last ``Nq`` tokens of each sequence (bottom-right):
    query ``i`` sits at absolute position ``length - Nq + i``.

    ``row_lengths`` (only when nothing reads positions): the rows' sequences hold different
    numbers of tokens, row ``r``'s keys are the positions below ``row_lengths[r]`` (``length`` is
    the largest); decode hides the rest with a per-row key count, so a ragged batch is one call.
    """

    r0: int
    r1: int
    length: int
    spans: tuple[Span, ...]
    row_lengths: tuple[int, ...] | None = None


class Cache(Protocol):
    """What :func:`keyfold.caches.decode` needs from a cache (all three caches implement it).

    ``pieces(seq_ids, n_queries, exact_positions)``: the groups of query rows and the spans of
    keys they read. With ``exact_positions=False`` (no mask or score reads positions) a span's
    keys may come in any order and its ``kv_offset`` is then meaningless.
    ``implied_mask(n_queries)``: the mask the cache stands for when ``n_queries`` queries read
    it (the window cache's ``causal() & (window(W - 1) | sinks(S))``), or None when every key in
    the spans is visible to every query.
    """

    dtype: torch.dtype
    heads: int
    head_dim: int
    value_dim: int

    def pieces(self, seq_ids=None, n_queries: int = 1, exact_positions: bool = True) -> list[Group]: ...

    def implied_mask(self, n_queries: int) -> Mask | None: ...
