"""Argument checks shared by the caches: each error names the argument and says what to do."""

from __future__ import annotations

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def positive_int(x, name: str, owner: str, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{owner}({name}=...): expected an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{owner}({name}=...): must be >= {minimum}, got {x}")
    return x


def float_dtype(dtype, owner: str) -> torch.dtype:
    if dtype not in _FLOATS:
        raise TypeError(f"{owner}(dtype=...): use float32, bfloat16, float16 or float64, got {dtype}")
    return dtype


def kv_block(k, v, *, heads: int, head_dim: int, value_dim: int, owner: str, batch: int | None = None,
             device: torch.device | None = None):
    """Check an appended ``k`` ``(b, heads, n, head_dim)`` / ``v`` ``(b, heads, n, value_dim)``,
    on the cache's ``device``. Runs before any write, so a bad block changes nothing."""
    for name, t, last in (("k", k, head_dim), ("v", v, value_dim)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{owner}.append({name}): expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{owner}.append({name}): expected (batch, heads, tokens, dim), "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{owner}.append({name}): expected a floating dtype, got {t.dtype}")
        if device is not None and t.device != device:
            raise ValueError(f"{owner}.append({name}): the tensor is on device {t.device} but the cache is on "
                             f"{device}; move it first: {name}.to(cache.device)")
        if t.shape[1] != heads or t.shape[3] != last:
            raise ValueError(f"{owner}.append({name}): the cache holds {heads} heads of size {last}, "
                             f"got shape {tuple(t.shape)}; pass (batch, {heads}, tokens, {last})")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{owner}.append: k {tuple(k.shape)} and v {tuple(v.shape)} must agree on "
                         f"batch, heads and tokens")
    if batch is not None and k.shape[0] != batch:
        raise ValueError(f"{owner}.append(k): {k.shape[0]} rows for {batch} sequences; pass one row "
                         f"per sequence id")


def seq_list(seq_ids, owner: str, what: str = "seq_ids") -> list[int]:
    """A list of distinct int ids."""
    if isinstance(seq_ids, torch.Tensor):
        seq_ids = seq_ids.tolist()
    if isinstance(seq_ids, int) and not isinstance(seq_ids, bool):
        seq_ids = [seq_ids]
    ids = list(seq_ids)
    for s in ids:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{owner}({what}=...): sequence ids are ints, got {s!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{owner}({what}=...): ids repeat in {ids}; pass each sequence once")
    return ids


def block_lengths(lengths, rows: int, n: int, owner: str) -> list[int]:
    """Valid tokens per row of an appended block: ``rows`` ints in ``[0, n]`` (default ``n`` each)."""
    if lengths is None:
        return [n] * rows
    lens = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    if len(lens) != rows or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= n for x in lens):
        raise ValueError(f"{owner}.append(lengths=...): expected {rows} ints in [0, {n}] (valid tokens "
                         f"per row), got {lens}")
    return lens
