"""Context parallelism on ``torch.distributed``: the communication wall.

Each rank holds a shard of the sequence; key/value shards travel and the partial states merge
with the core operator (:func:`keyfold.merge`). Gloo on CPU, NCCL on GPU, launched by torchrun.
The math and the measurements: ``docs/distributed.md``.

- :func:`shard` / :func:`unshard` and :class:`Layout` (CONTIGUOUS, ZIGZAG, STRIPED);
- :func:`ring_attention` with :class:`Strategy` (RING, ALL_GATHER, ALL_TO_ALL);
- :func:`tree_decode` for a KV cache split across ranks;
- :mod:`keyfold.distributed.costs`: the cost model (``python -m keyfold costs``).
"""

from .comm import Comm, DistributedError, ShardError
from .decode import Reduce, tree_decode
from .layout import Layout, Run, shard, shard_of, shard_positions, shard_runs, unshard, unshard_of
from .ring import Strategy, ring_attention

__all__ = [
    "Layout", "Run", "shard", "unshard", "shard_of", "unshard_of", "shard_runs", "shard_positions",
    "Strategy", "ring_attention", "Reduce", "tree_decode",
    "Comm", "DistributedError", "ShardError",
]
