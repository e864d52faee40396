"""The small communication object context parallelism runs on (torch.distributed).

Everything that talks to other ranks goes through :class:`Comm`, so the attention loops read
as "compute a piece, merge, pass the keys on". Gloo on CPU and NCCL on GPU both work; a group
of one rank needs no communication at all (every call returns its input).

Failures must end every rank with a clear error, never a hang:

- :meth:`Comm.agree` runs before any transfer: every rank sends its shard shapes and its own
  validation error (if any); every rank then raises the same :class:`ShardError`;
- every wait is bounded by the process group's timeout (``init_process_group(timeout=...)``;
  the default is 30 minutes, set it shorter) and a failed wait is re-raised as
  :class:`DistributedError` naming the rank, the transfer and what to look at.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import re
import types
from typing import Callable

import torch
import torch.distributed as dist

from .._callables import _code_names, _library

__all__ = ["Comm", "DistributedError", "ShardError", "fingerprint"]

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DistributedError(RuntimeError):
    """A transfer between ranks failed or timed out (usually: another rank raised or exited)."""


class ShardError(ValueError):
    """The ranks' inputs disagree, or one rank's input is invalid; raised on every rank."""


def fingerprint(obj) -> str:
    """A digest of what a mask or score modifier *holds*, equal in every process for equal content.

    Class names, numbers, strings, and the shape, dtype and bytes of every tensor it holds
    (recursively; a callable by its module, name, code and captured values). Neither ``repr``
    (it abbreviates tensors: two ``documents`` masks with different ids print alike) nor
    ``hash()`` (Python salts string hashes per process) can tell ranks apart.

    >>> import torch, keyfold
    >>> a = keyfold.documents(torch.tensor([0, 0, 1, 1]))
    >>> fingerprint(a) == fingerprint(keyfold.documents(torch.tensor([0, 1, 1, 1])))
    False
    """
    h = hashlib.sha1()
    _feed(h, obj, {})
    return h.hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Described:
    """A mask or score modifier in an agreement check (:meth:`Comm.agree`): equal by content (its
    fingerprint), shown by its repr. Its text alone would not do: a class without a ``__repr__``
    prints its address, which differs between the ranks (ring_attention and tree_decode refused
    equal custom masks so; found by fuzzing, 2026-12-05)."""

    __slots__ = ("text", "key", "own", "own_text")

    def __init__(self, x):
        self.text, self.key = repr(x), fingerprint(x)
        self.own = type(x).__repr__ is not object.__repr__  # a repr of its own shows content too
        # ...but not an address: a plain function prints "<function f at 0x7f...>", different in
        # every spawned rank (tree_decode refused equal function masks so; review, 2026-12-06)
        self.own_text = _ADDRESS.sub("", self.text)

    def __eq__(self, other):  # the repr's text as well where it has its own (the fingerprint skips
        # private attributes: two masks told apart only by a `_ids` differ in their repr)
        return (isinstance(other, Described) and other.key == self.key
                and (not (self.own and other.own) or other.own_text == self.own_text))

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        return f"{self.text} #{self.key[:16]}"


_SCALAR = (bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device)


def _feed(h, x, seen: dict) -> None:
    if x is None or isinstance(x, _SCALAR):
        h.update(repr((type(x).__name__, x)).encode())
        return
    if type(x).__module__ == "numpy" and hasattr(x, "tobytes"):  # (a repr abbreviates a large array;
        dtype = getattr(x, "dtype", None)               # an object array's bytes are pointers)
        h.update(f"ndarray{getattr(x, 'shape', ())}{dtype}".encode())
        h.update(repr(x.tolist()).encode() if getattr(dtype, "hasobject", False) else x.tobytes())
        return
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        h.update(f"tensor{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return
    if id(x) in seen:
        h.update(b"<cycle>")
        return
    seen[id(x)] = x  # held until the digest is done: a freed temporary's id is reused by the next one
    if isinstance(x, (list, tuple)):
        h.update(f"{type(x).__name__}[".encode())
        for e in x:
            _feed(h, e, seen)
        h.update(b"]")
    elif isinstance(x, (set, frozenset)):
        h.update(("set" + ",".join(sorted(fingerprint(e) for e in x))).encode())
    elif isinstance(x, dict):
        h.update(b"dict{")
        for k in sorted(x, key=repr):
            _feed(h, k, seen)
            _feed(h, x[k], seen)
        h.update(b"}")
    elif isinstance(x, (types.FunctionType, types.MethodType)):
        fn = x.__func__ if isinstance(x, types.MethodType) else x
        h.update(f"fn {fn.__module__}.{fn.__qualname__}".encode())
        h.update(fn.__code__.co_code)
        _feed(h, fn.__code__.co_consts, seen)
        _feed(h, fn.__defaults__, seen)
        _feed(h, [c.cell_contents for c in fn.__closure__ or () if _has_contents(c)], seen)
        # and the plain values among the globals it names (two ranks whose mask read a different
        # global W agreed; review, 2026-12-06); not whole objects or models, hashed every call
        _feed(h, _global_values(fn), seen)
        if isinstance(x, types.MethodType):
            _feed(h, x.__self__, seen)
    elif isinstance(x, types.CodeType):
        h.update(x.co_code)
    elif isinstance(x, functools.partial):  # its arguments are not in its __dict__
        h.update(b"partial(")
        _feed(h, [x.func, x.args, x.keywords], seen)
        h.update(b")")
    elif hasattr(x, "__dict__") or hasattr(type(x), "__slots__"):
        cls = type(x)
        h.update(f"obj {cls.__module__}.{cls.__qualname__}(".encode())
        call = getattr(cls, "__call__", None)
        if isinstance(call, types.FunctionType) and not _library(cls):  # what its __call__ names
            _feed(h, _global_values(call), seen)
        names = set(getattr(x, "__dict__", {})) | {n for c in cls.__mro__ for n in getattr(c, "__slots__", ())}
        for n in sorted(names):
            if n.startswith("_") or not hasattr(x, n):   # private caches and digests are derived
                continue
            h.update(n.encode())
            _feed(h, getattr(x, n), seen)
        h.update(b")")
    else:
        h.update(repr(x).encode())


_PLAIN = (*_SCALAR, torch.Tensor)


def _global_values(fn) -> list:
    """The globals ``fn``'s code names that hold plain values (numbers, strings, tensors, arrays,
    tuples of those), by name: what a rank's mask reads besides its cells. Objects, modules and
    functions are left out (a model's weights would be hashed at every call)."""
    g, out = fn.__globals__, []
    for n in sorted(set(_code_names(fn.__code__))):
        x = g.get(n)
        if isinstance(x, _PLAIN) or (type(x).__module__ == "numpy" and hasattr(x, "tobytes")) or \
                (isinstance(x, tuple) and all(isinstance(e, _PLAIN) for e in x)):
            out.append((n, x))
    return out


def _has_contents(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


class _Pending:
    """A posted transfer; :meth:`wait` returns its result or raises :class:`DistributedError`."""

    def __init__(self, works, result, what: str, comm: "Comm", finish: Callable | None = None):
        self.works, self.result, self.what, self.comm, self.finish = works, result, what, comm, finish

    def wait(self) -> torch.Tensor:
        try:
            for w in self.works:
                w.wait()
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses of many kinds
            raise DistributedError(
                f"rank {self.comm.rank} of {self.comm.size}: {self.what} failed: {e!s:.300}\n"
                f"Another rank probably raised or exited (see its error) or did not call the same "
                f"function with the same arguments; waits are bounded by init_process_group(timeout=...)"
            ) from e
        return self.finish(self.result) if self.finish is not None else self.result


class Comm:
    """Rank, size and the four collectives the walls need, over one process group.

    group: a ``torch.distributed`` process group, or None for the default (world) group.
    """

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("keyfold.distributed needs an initialised process group: call "
                               "torch.distributed.init_process_group('gloo' or 'nccl', timeout=...) first, "
                               "or launch with torchrun")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given group; call keyfold.distributed "
                             "only on the ranks of the group you pass")

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    # -------------------------------------------------------------------------- ring
    def shift(self, t: torch.Tensor, what: str = "ring transfer", tag: int = 0) -> _Pending:
        """Send ``t`` to the next rank and receive the previous rank's tensor of the same shape.

        Both are posted at once with ``batch_isend_irecv`` and this returns immediately, so the
        caller computes while the bytes travel; ``t`` must not be modified until ``wait()``.
        """
        if self.size == 1:
            return _Pending([], t, what, self)
        t = t.contiguous()
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self._global(self.next), self.group, tag),
               dist.P2POp(dist.irecv, buf, self._global(self.prev), self.group, tag)]
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:  # noqa: BLE001
            raise DistributedError(f"rank {self.rank}: posting {what} failed: {e!s:.300}") from e
        return _Pending(works, (t, buf), f"{what} from rank {self.prev}", self, finish=lambda r: r[1])

    # ------------------------------------------------------------------- collectives
    def all_gather(self, t: torch.Tensor, what: str = "all-gather") -> _Pending:
        """Every rank's ``t`` stacked in rank order: ``(P, *t.shape)`` (posted asynchronously)."""
        if self.size == 1:
            return _Pending([], t.unsqueeze(0), what, self)
        t = t.contiguous()
        out = torch.empty((self.size,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        work = _ALL_GATHER(out.view(-1), t.view(-1), group=self.group, async_op=True)
        return _Pending([work], out, what, self)

    def reduce_scatter(self, t: torch.Tensor, what: str = "reduce-scatter") -> _Pending:
        """``t``: ``(P, ...)``; rank r receives ``sum over ranks of t[r]`` (posted asynchronously)."""
        if self.size == 1:
            return _Pending([], t[0], what, self)
        t = t.contiguous()
        out = torch.empty(tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        work = _REDUCE_SCATTER(out.view(-1), t.view(-1), group=self.group, async_op=True)
        return _Pending([work], out, what, self)

    def all_to_all(self, t: torch.Tensor, what: str = "all-to-all") -> _Pending:
        """``t``: ``(P, ...)``; rank r receives ``(P, ...)`` whose row s is rank s's ``t[r]``."""
        if self.size == 1:
            return _Pending([], t, what, self)
        t = t.contiguous()
        out = torch.empty_like(t)
        work = dist.all_to_all_single(out, t, group=self.group, async_op=True)
        return _Pending([work], out, what, self)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "all-reduce") -> _Pending:
        """Elementwise reduction of ``t`` over the ranks (a new tensor; posted asynchronously)."""
        if self.size == 1:
            return _Pending([], t, what, self)
        t = t.clone().contiguous()
        work = dist.all_reduce(t, op=op, group=self.group, async_op=True)
        return _Pending([work], t, what, self)

    # --------------------------------------------------------------------- agreement
    def agree(self, what: str, meta, error: BaseException | None):
        """Exchange ``meta`` (a small picklable description of this rank's inputs) and any local
        validation ``error``; raise the same :class:`ShardError` on every rank if a rank failed
        or the metas differ. Returns every rank's meta."""
        if self.size == 1:
            if error is not None:
                raise error
            return [meta]
        mine = (meta, None if error is None else f"{type(error).__name__}: {error}")
        everyone = [None] * self.size
        try:
            dist.all_gather_object(everyone, mine, group=self.group)
        except Exception as e:  # noqa: BLE001
            raise DistributedError(
                f"rank {self.rank} of {self.size}: {what}: exchanging input shapes failed: {e!s:.300}\n"
                f"Another rank probably raised or exited before calling {what} (see its error); "
                f"waits are bounded by init_process_group(timeout=...)") from e
        failed = [(r, msg) for r, (_, msg) in enumerate(everyone) if msg is not None]
        if failed:
            lines = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
            if error is not None:
                raise ShardError(f"{what}: {lines}") from error
            raise ShardError(f"{what}: invalid input on another rank ({lines})")
        metas = [m for m, _ in everyone]
        if any(m != metas[0] for m in metas):
            raise ShardError(f"{what}: the ranks' shards disagree ({_differences(metas)}); every rank of the "
                             f"group must pass local shards of one shape and dtype and the same settings")
        return metas

    def agree_sizes(self, what: str, sizes: list[int], error: BaseException | None):
        """The cheap check: one all-gather of a small int64 tensor (an error flag and ``sizes``,
        e.g. the shard shapes and dtype), no pickling. Every rank raises :class:`ShardError` if a
        rank failed its own validation or the sizes differ, so a transfer never starts between
        buffers of different sizes (gloo aborts the process on that)."""
        if self.size == 1:
            if error is not None:
                raise error
            return
        row = torch.tensor([0 if error is None else 1, len(sizes)] + list(sizes), dtype=torch.int64)
        width = self.all_reduce(torch.tensor([row.numel()]), op=dist.ReduceOp.MAX,
                                what=f"{what}: shard size check").wait()
        row = torch.nn.functional.pad(row, (0, int(width) - row.numel()), value=-1)
        every = self.all_gather(row, what=f"{what}: shard size check").wait()        # (P, width)
        failed = [r for r in range(self.size) if int(every[r, 0])]
        if failed:
            if error is not None:
                raise ShardError(f"{what}: rank {self.rank}: {type(error).__name__}: {error}") from error
            raise ShardError(f"{what}: invalid input on rank(s) {failed} (see their errors)")
        if not bool((every == every[0]).all()):
            lines = "; ".join(f"rank {r}: {every[r, 2:2 + int(every[r, 1])].tolist()}" for r in range(self.size))
            raise ShardError(f"{what}: the ranks' shard shapes disagree, or their dtype or schedule ({lines}); "
                             f"every rank of the group must pass local shards of one shape and dtype, and the "
                             f"same strategy, layout and head groups")


def _differences(metas) -> str:
    """Which rank differs from rank 0 in what (dict metas name the field), for error messages."""
    if not all(isinstance(m, dict) for m in metas):
        return "; ".join(f"rank {r}: {m}" for r, m in enumerate(metas))
    keys = [k for k in metas[0] if any(m.get(k) != metas[0].get(k) for m in metas)]
    keys += [k for m in metas for k in m if k not in metas[0] and k not in keys]
    return "; ".join(f"rank {r}: " + ", ".join(f"{k} {m.get(k)}" for k in keys) for r, m in enumerate(metas))
