"""Bounded-cost streaming: a causal Transformer run one token at a time on window caches.

Each layer keeps a :class:`keyfold.caches.WindowCache` (the ``sinks`` first tokens and the
``window`` most recent, StreamingLLM): memory is the caches' fixed storage and each step
attends over at most ``sinks + window`` keys, so both stay constant however long the stream
runs. Streaming equals running the whole sequence with the mask
``causal() & (window(W - 1) | sinks(S))`` (the cache's own equivalent mask), which
:func:`full_forward` computes and the tests compare against.

A layer is a :class:`keyfold.apps.verify.certify.BlockWeights`, the same object the certifier
bounds, so the block you certify is the block you stream. ``docs/verify.md`` has the numbers.

>>> from keyfold.apps.verify.certify import BlockWeights
>>> s = Stream([BlockWeights.random(16, 2, 32, norm_first=True)], window=8, sinks=2)
>>> y = s.step(torch.randn(1, 16))
>>> y.shape
torch.Size([1, 16])
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from keyfold.caches import KVCache, WindowCache, decode
from .certify import BlockWeights, block_forward

__all__ = ["Stream", "stream", "full_forward", "LatencyReport", "measure_latency", "profile_allocations",
           "default_model"]


class Stream:
    """A causal stack of blocks, stepped one token at a time with constant memory and work.

    layers: :class:`BlockWeights` (self-attention made causal by the stream; ``norm_first``
        either way). window, sinks: each layer's :class:`WindowCache` size. batch: independent
        streams advancing together. dtype: compute dtype (weights are cast once).
    window=None with ``capacity``: the peer the report compares against, a full
        :class:`keyfold.caches.KVCache` per layer (exact causal attention, cost grows).
    """

    def __init__(self, layers: Sequence[BlockWeights], *, window: int | None, sinks: int = 0, batch: int = 1,
                 dtype: torch.dtype = torch.float32, capacity: int | None = None):
        if not layers:
            raise ValueError("Stream(layers): pass at least one BlockWeights layer")
        for i, w in enumerate(layers):
            if not isinstance(w, BlockWeights):
                raise TypeError(f"Stream(layers[{i}]): expected BlockWeights (BlockWeights.from_module(layer) "
                                f"converts a torch or keyfold encoder layer), got {type(w).__name__}")
        self.layers = [_cast(w, dtype) for w in layers]
        self.E = self.layers[0].attn.wq.shape[1]
        self.H = self.layers[0].attn.heads
        dh = self.E // self.H
        if window is None:  # the peer: a growing full cache (memory and work grow with the stream)
            if capacity is None:
                raise ValueError("Stream(window=None) keeps every token: pass capacity=<max stream length>")
            self.caches = [KVCache(batch=batch, heads=self.H, head_dim=dh, capacity=capacity, dtype=dtype)
                           for _ in self.layers]
        else:
            self.caches = [WindowCache(window=window, sinks=sinks, heads=self.H, head_dim=dh, batch=batch,
                                       dtype=dtype) for _ in self.layers]
        self.batch, self.dtype = batch, dtype

    @property
    def length(self) -> int:
        """Tokens streamed so far."""
        c = self.caches[0]
        return c.length if isinstance(c, WindowCache) else int(c.lengths[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the caches: fixed at construction."""
        return sum(c.nbytes for c in self.caches)

    def reset(self) -> None:
        for c in self.caches:
            c.reset()

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One token per stream: x ``(batch, E)`` -> ``(batch, E)``; the caches advance by one."""
        if x.dim() != 2 or tuple(x.shape) != (self.batch, self.E):
            raise ValueError(f"Stream.step(x): expected ({self.batch}, {self.E}) = (batch, d_model), "
                             f"got {tuple(x.shape)}")
        x = x.to(self.dtype)
        for w, cache in zip(self.layers, self.caches):
            x = _block_step(x, w, cache)
        return x


def _cast(w: BlockWeights, dtype) -> BlockWeights:
    a = w.attn
    c = (lambda t: t.to(dtype))
    attn = type(a)(*(c(t) for t in (a.wq, a.wk, a.wv, a.wo, a.bq, a.bk, a.bv, a.bo)), heads=a.heads, mask=a.mask)
    return BlockWeights(attn, c(w.w1), c(w.b1), c(w.w2), c(w.b2), (c(w.ln1[0]), c(w.ln1[1])),
                        (c(w.ln2[0]), c(w.ln2[1])), w.norm_first, w.eps, w.eps2)


def _attn_step(x, w, cache: WindowCache):
    B, E = x.shape
    H, dh = w.heads, E // w.heads
    q = F.linear(x, w.wq, w.bq).view(B, H, 1, dh)                           # (B, H, 1, dh)
    k = F.linear(x, w.wk, w.bk).view(B, H, 1, dh)
    v = F.linear(x, w.wv, w.bv).view(B, H, 1, dh)
    cache.append(k, v)
    o = decode(q, cache, mask=w.mask)                                       # (B, H, 1, dh); the layer's own mask
    return F.linear(o.reshape(B, E), w.wo, w.bo)


def _block_step(x, w: BlockWeights, cache):
    def ln(t, p, eps):
        return F.layer_norm(t, (t.shape[-1],), p[0], p[1], eps)

    def ff(t):
        return F.linear(torch.relu(F.linear(t, w.w1, w.b1)), w.w2, w.b2)
    if w.norm_first:
        x = x + _attn_step(ln(x, w.ln1, w.eps), w.attn, cache)
        return x + ff(ln(x, w.ln2, w.eps_of_ln2))
    x = ln(x + _attn_step(x, w.attn, cache), w.ln1, w.eps)
    return ln(x + ff(x), w.ln2, w.eps_of_ln2)


def stream(layers: Sequence[BlockWeights], tokens: Iterable[torch.Tensor], *, window: int, sinks: int = 0):
    """Yield the output for each token of ``tokens`` (each ``(batch, E)``), one step at a time."""
    s = None
    for x in tokens:
        if s is None:
            s = Stream(layers, window=window, sinks=sinks, batch=x.shape[0], dtype=x.dtype)
        yield s.step(x)


def full_forward(layers: Sequence[BlockWeights], x: torch.Tensor, *, window: int, sinks: int = 0) -> torch.Tensor:
    """What streaming must equal: the whole sequence x ``(N, E)`` through every block with the
    window cache's mask ``causal() & (window(W - 1) | sinks(S))``, in float64."""
    from keyfold.masks import causal, sinks as sinks_mask, window as window_mask
    mask = causal() & (window_mask(window - 1) | sinks_mask(sinks))
    for w in layers:
        x = block_forward(x, w, mask)
    return x


# ---------------------------------------------------------------------------- measuring


def _rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@dataclass
class LatencyReport:
    """Per-step latency of a stream (milliseconds) and what memory did meanwhile."""

    steps: int
    p50: float
    p99: float
    p999: float
    max: float
    first_median: float          # median of the first 10 % of steps
    last_median: float           # median of the last 10 %
    rss_start: int               # bytes, after warm-up
    rss_end: int
    cache_bytes: int
    budget_ms: float | None
    worst_step: int              # index of the slowest step
    cpu_p50: float = 0.0         # this thread's CPU time per step (ms): the work, without preemption
    cpu_p99: float = 0.0
    cpu_max: float = 0.0
    allocs_per_step: dict = field(default_factory=dict)

    @property
    def margin_ms(self) -> float | None:
        """Budget minus the worst observed step (negative: the budget was missed)."""
        return None if self.budget_ms is None else self.budget_ms - self.max

    @property
    def growth(self) -> float:
        """Ratio of late to early median step time (1.0: no growth with stream length)."""
        return self.last_median / self.first_median


def profile_allocations(s: Stream, x: torch.Tensor, steps: int = 20) -> dict:
    """Allocations per step counted by ``torch.profiler`` (ops that allocate, and bytes)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            s.step(x)
    allocs = [e.self_cpu_memory_usage for e in prof.events()
              if e.name != "[memory]" and e.self_cpu_memory_usage > 0]
    return {"count": len(allocs) / steps, "bytes": sum(allocs) / steps}


def measure_latency(s: Stream, steps: int, *, budget_ms: float | None = None, warmup: int = 200,
                    threads: int | None = 1, progress: bool = True, seed: int = 0) -> tuple[LatencyReport, torch.Tensor]:
    """Step ``s`` ``steps`` times with random tokens; time each step with ``perf_counter_ns``
    (wall clock, what a deadline sees) and ``thread_time_ns`` (CPU time: the work itself, which
    other processes on the machine cannot inflate).

    Inputs are drawn up front (outside the timed region). Warm-up fills the window caches.
    Allocation is counted with the profiler over 20 steps right after warm-up and over 20 steps
    at the same phase of the ring at the end (a whole number of ring turns later), so a
    constant-cost stream gives identical counts.
    ``threads`` pins torch's intra-op threads for the run (1: one core, the least jitter).
    Returns the report and the per-step times in ms.
    """
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(seed)
        xs = torch.randn(1024, s.batch, s.E, generator=g, dtype=s.dtype)
        first = s.caches[0]
        ring = first.ring if isinstance(first, WindowCache) else 1
        if isinstance(first, WindowCache):
            warmup = max(warmup, first.window + first.sinks + 1)
        for i in range(warmup):
            s.step(xs[i % 1024])
        start_len = s.length
        allocs_start = profile_allocations(s, xs[0])
        rss_start = _rss_bytes()
        times = torch.empty(steps, dtype=torch.float64)
        cpu = torch.empty(steps, dtype=torch.float64)
        it = range(steps)
        if progress:
            from tqdm import tqdm
            it = tqdm(it, desc="stream steps", mininterval=1.0, leave=False)
        gc.collect()
        gc.freeze()                       # long-lived objects out of the collector's way
        clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
        for i in it:
            x = xs[i & 1023]
            c0 = cpu_clock()
            t0 = clock()
            s.step(x)
            times[i] = clock() - t0
            cpu[i] = cpu_clock() - c0
        gc.unfreeze()
        rss_end = _rss_bytes()
        for i in range(-(s.length - start_len) % ring):   # back to the ring phase of the first count
            s.step(xs[i % 1024])
        allocs_end = profile_allocations(s, xs[0])
    finally:
        torch.set_num_threads(old_threads)
    ms, cpu_ms = times / 1e6, cpu / 1e6
    tenth = max(1, steps // 10)
    cq = torch.quantile(cpu_ms, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
    q = torch.quantile(ms, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)).tolist()
    rep = LatencyReport(steps=steps, p50=q[0], p99=q[1], p999=q[2], max=float(ms.max()),
                        first_median=float(ms[:tenth].median()), last_median=float(ms[-tenth:].median()),
                        rss_start=rss_start, rss_end=rss_end, cache_bytes=s.nbytes, budget_ms=budget_ms,
                        worst_step=int(ms.argmax()), cpu_p50=cq[0], cpu_p99=cq[1], cpu_max=float(cpu_ms.max()),
                        allocs_per_step={"start": allocs_start, "end": allocs_end})
    return rep, ms


def default_model(E: int = 64, heads: int = 4, F_: int = 256, n_layers: int = 2, seed: int = 0) -> list[BlockWeights]:
    """The report's streaming model: ``n_layers`` pre-LN blocks with random weights."""
    return [BlockWeights.random(E, heads, F_, seed=seed + i, norm_first=True) for i in range(n_layers)]
