"""The memory wall: KV caches, split-KV decoding and shared prefixes on the one operator.

A cache only stores keys and names them as spans with absolute positions; decoding is
:func:`keyfold.attend` over those spans merged with :func:`keyfold.merge_all`. The math and
the measurements: ``docs/caches.md``.

- :class:`KVCache`: contiguous and preallocated, sequences of different lengths.
- :class:`PagedKVCache`: a pool of pages, block tables, copy-on-write ``fork``.
- :class:`WindowCache`: the first S tokens and the last W (StreamingLLM), constant memory.
- :func:`decode`: a few query tokens against any of them, with masks, scores and split-KV.
- :func:`cascade`: requests sharing a prefix read it once.
"""

from ._pieces import CacheFullError, Group, Span
from .contiguous import KVCache
from .decoding import attend_cache, cascade, choose_splits, decode
from .paged import PagedKVCache, PageStats, default_page_size
from .window import WindowCache

__all__ = ["KVCache", "PagedKVCache", "PageStats", "WindowCache", "CacheFullError", "Group", "Span",
           "default_page_size",
           "decode", "attend_cache", "cascade", "choose_splits"]
