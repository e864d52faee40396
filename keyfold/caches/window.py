"""``WindowCache``: the first S tokens and a ring of the last W (StreamingLLM), constant memory."""

from __future__ import annotations

import torch

from ..masks import causal, sinks, window
from ._checks import float_dtype, kv_block, positive_int, seq_list
from ._pieces import Group, Span
from ._storage import zeros

__all__ = ["WindowCache"]


class WindowCache:
    """Keeps the ``sinks`` first tokens and the ``window`` most recent ones, however long the stream.

    A token is held once: while the stream is shorter than ``sinks + window`` the two sets
    overlap and nothing is stored twice. Decoding the newest token against the cache equals
    ``attention`` over the whole stream with ``causal() & (window(W - 1) | sinks(S))``; the
    newest token is one of the W. ``max_block`` > 1 keeps ``max_block - 1`` more recent tokens
    so a block of up to ``max_block`` queries (chunked prefill) sees every key its window needs;
    the mask is then applied inside the pieces.

    Storage: ``sink_k`` ``(batch, heads, sinks, head_dim)`` and a ring ``ring_k`` ``(batch,
    heads, window + max_block - 1, head_dim)`` (values alike), allocated once; the ``batch``
    streams advance together. Position ``t >= sinks`` lives in ring slot ``(t - sinks) % ring``.

    >>> import torch, keyfold
    >>> from keyfold.caches import WindowCache, decode
    >>> cache = WindowCache(window=4, sinks=2, heads=2, head_dim=8)
    >>> ks, vs = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    >>> for t in range(20):
    ...     cache.append(ks[:, :, t:t + 1], vs[:, :, t:t + 1])
    >>> q = torch.randn(1, 2, 1, 8)
    >>> m = keyfold.causal() & (keyfold.window(3) | keyfold.sinks(2))
    >>> torch.allclose(decode(q, cache), keyfold.attention(q, ks, vs, mask=m), atol=1e-6)
    True
    """

    def __init__(self, window: int, sinks: int = 0, *, heads: int, head_dim: int, batch: int = 1,
                 dtype=torch.float32, value_dim: int | None = None, max_block: int = 1, device=None):
        positive_int(window, "window", "WindowCache")
        positive_int(sinks, "sinks", "WindowCache", minimum=0)
        positive_int(heads, "heads", "WindowCache")
        positive_int(head_dim, "head_dim", "WindowCache")
        positive_int(batch, "batch", "WindowCache")
        positive_int(max_block, "max_block", "WindowCache")
        value_dim = head_dim if value_dim is None else positive_int(value_dim, "value_dim", "WindowCache")
        float_dtype(dtype, "WindowCache")
        self.window, self.sinks, self.max_block = window, sinks, max_block
        self.heads, self.head_dim, self.value_dim, self.batch, self.dtype = heads, head_dim, value_dim, batch, dtype
        self.ring = window + max_block - 1
        kw = dict(dtype=dtype, device=device)
        # one buffer per tensor: the sinks, then the ring. Until the ring wraps it holds positions
        # 0 .. length-1 in order; afterwards, whole, it is exactly the keys one query sees.
        self.k_buf = zeros(batch, heads, sinks + self.ring, head_dim, **kw)   # (B, H, S+R, D)
        self.v_buf = zeros(batch, heads, sinks + self.ring, value_dim, **kw)  # (B, H, S+R, Dv)
        self.sink_k, self.ring_k = self.k_buf[:, :, :sinks], self.k_buf[:, :, sinks:]  # views
        self.sink_v, self.ring_v = self.v_buf[:, :, :sinks], self.v_buf[:, :, sinks:]
        self.length = 0  # tokens streamed so far (all of them, not only those held)
        self._mask = causal() & (_window_mask(window) | _sinks_mask(sinks))

    @property
    def device(self) -> torch.device:
        return self.ring_k.device

    @property
    def nbytes(self) -> int:
        """Bytes of storage: constant, whatever the stream length."""
        return self.k_buf.nbytes + self.v_buf.nbytes

    @property
    def mask(self):
        """The equivalent mask over the whole stream: ``causal() & (window(W - 1) | sinks(S))``."""
        return self._mask

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stream ``n`` more tokens: k ``(batch, heads, n, head_dim)``, v ``(batch, heads, n, value_dim)``.

        Blocks of any length are fine (only the sinks and the last ``ring`` tokens are kept).
        """
        kv_block(k, v, heads=self.heads, head_dim=self.head_dim, value_dim=self.value_dim,
                 owner="WindowCache", batch=self.batch, device=self.device)
        n, L, S, R = k.shape[2], self.length, self.sinks, self.ring
        if L < S:  # positions L .. min(S, L + n) - 1 are sinks
            e = min(S, L + n)
            self.sink_k[:, :, L:e] = k[:, :, :e - L]
            self.sink_v[:, :, L:e] = v[:, :, :e - L]
        a = max(S, L, L + n - R)  # first position the ring keeps
        while a < L + n:
            slot = (a - S) % R
            step = min(L + n - a, R - slot)
            self.ring_k[:, :, slot:slot + step] = k[:, :, a - L:a - L + step]
            self.ring_v[:, :, slot:slot + step] = v[:, :, a - L:a - L + step]
            a += step
        self.length = L + n

    def reset(self) -> None:
        """Start a new stream (storage is kept)."""
        self.length = 0

    def implied_mask(self, n_queries: int = 1):
        """None for one query (the spans hold exactly its keys), else :attr:`mask`."""
        return None if n_queries == 1 else self._mask

    def pieces(self, seq_ids=None, n_queries: int = 1, exact_positions: bool = True) -> list[Group]:
        """The held keys as spans: one while the ring has not wrapped (positions in order);
        after that the sinks and the ring's held positions as one or two spans (where it wraps),
        or, when nothing reads positions (``exact_positions=False``, one query, ``max_block=1``),
        the whole buffer as one span: softmax does not care about the order of its keys."""
        if seq_ids is not None and seq_list(seq_ids, "decode") != list(range(self.batch)):
            raise ValueError(f"decode(seq_ids=...): a WindowCache's {self.batch} streams advance together; "
                             f"pass seq_ids=None and one query row per stream")
        if n_queries > self.max_block:
            raise ValueError(f"decode(q): {n_queries} query tokens but this WindowCache was built for blocks "
                             f"of at most max_block={self.max_block}; the earliest query's window would "
                             f"reach evicted keys. Create it with max_block={n_queries}")
        L, S, R, W = self.length, self.sinks, self.ring, self.window
        a = max(S, L - R, L - W - n_queries + 1)  # oldest non-sink position any query can see
        kb, vb = self.k_buf, self.v_buf
        if L <= S + R:  # not wrapped: buffer index = position
            if a <= S:
                spans = [Span(kb[:, :, :L], vb[:, :, :L], 0)] if L else []
            else:
                spans = [Span(kb[:, :, :S], vb[:, :, :S], 0)] if S else []
                spans.append(Span(kb[:, :, a:L], vb[:, :, a:L], a))
        elif not exact_positions and n_queries == 1 and R == W:
            spans = [Span(kb, vb, 0)]  # exactly the keys the query sees, in ring order
        else:
            spans = [Span(self.sink_k, self.sink_v, 0)] if S else []
            while a < L:
                slot = (a - S) % R
                step = min(L - a, R - slot)
                spans.append(Span(self.ring_k[:, :, slot:slot + step], self.ring_v[:, :, slot:slot + step], a))
                a += step
        return [Group(0, self.batch, L, tuple(spans))]

    def __repr__(self):
        return (f"WindowCache(window={self.window}, sinks={self.sinks}, heads={self.heads}, "
                f"head_dim={self.head_dim}, batch={self.batch}, length={self.length}, nbytes={self.nbytes})")


def _window_mask(W: int):
    return window(W - 1)


def _sinks_mask(S: int):
    return sinks(S)
