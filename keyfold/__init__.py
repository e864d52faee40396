"""keyfold: attention as one associative softmax over pieces of the key space.

Attention over any piece of the keys gives a partial :class:`State` ``(out, lse)``; partial
states merge exactly, in any order (:func:`merge`). Every variant is a mask and a score
modifier on one engine (:func:`attend`, :func:`attention`). The math: ``docs/math.md``.
"""

from .engine import Backend, attend, attend_backward, attend_row_sums, attend_wide, attention
from .functional import scaled_dot_product_attention
from .masks import (BlockKind, Logic, Mask, MaskKind, Varlen, as_mask, block_sparse, causal, dilated, documents,
                    full, padding, prefix, sinks, varlen, window)
from .planner import Plan, clear_plan_cache, plan, plan_cache_stats
from .scores import ScoreKind, ScoreMod, alibi, alibi_slopes, as_score, score_fn, softcap
from .state import State, empty_state, merge, merge_all
from .caches import CacheFullError, KVCache, PagedKVCache, WindowCache, attend_cache, cascade, decode

__version__ = "0.1.0"

__all__ = [
    "State", "merge", "merge_all", "empty_state",
    "attend", "attend_wide", "attention", "attend_backward", "attend_row_sums", "Backend", "scaled_dot_product_attention",
    "Mask", "BlockKind", "MaskKind", "Logic", "ScoreKind", "as_mask", "causal", "window", "sinks", "prefix", "documents",
    "block_sparse", "dilated", "full", "padding", "varlen", "Varlen",
    "ScoreMod", "as_score", "alibi", "alibi_slopes", "softcap", "score_fn",
    "Plan", "plan", "clear_plan_cache", "plan_cache_stats",
    "KVCache", "PagedKVCache", "WindowCache", "CacheFullError", "decode", "attend_cache", "cascade",
]
