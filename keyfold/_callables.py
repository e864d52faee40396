"""Running users' FlexAttention-style callables: broadcast grids, or per element under vmap.

keyfold calls a ``mask_mod(b, h, q_idx, kv_idx)`` or ``score_mod(score, b, h, q_idx, kv_idx)``
once per tile with broadcastable index tensors (``(B,1,1,1)``, ``(1,H,1,1)``, ``(1,1,L,1)``,
``(1,1,1,S)``), which is fast and what tensor-op code expects. FlexAttention instead calls them
on scalar indices under ``torch.vmap``, so Flex users also write per-element code
(``bias[b][h][q_idx]``, ``torch.dot(x[q_idx], y[kv_idx])``) that raises, returns the wrong shape
or silently reduces over the whole grid when given broadcast tensors.

The first time a callable is seen, it runs on the tile in broadcast mode *and*, at up to
2x2x2x3 spread points of that tile (first/last b, h, q; first/middle/last kv), per element
under vmap (one flat vmap call, about 0.5 ms). It keeps broadcast mode when both agree (or vmap
cannot run the callable), and switches to per-element mode when broadcast raises, gives the
wrong shape or gives other values. Per-element mode is Flex's own evaluation: nested
``torch.vmap`` over (b, h, q, kv) on the tile's int32 index vectors, the whole tile at once
(about 2x the cost of broadcast mode). The decision is remembered per callable (per code object
and the shapes it captures, so a lambda re-created every step is decided once), unless the
points could not have shown a difference (see :func:`_decide`).
Gradients flow through both modes.

This module also finds the tensors a callable captures (:func:`captured_tensors`), so tensors
with ``requires_grad`` get their gradients (see :meth:`keyfold.scores.ScoreMod.tensors`).
"""

from __future__ import annotations

import array
import collections
import contextlib
import datetime
import decimal
import enum
import fractions
import functools
import hashlib
import re
import sys
import threading
import types
import weakref
from collections import OrderedDict

import numpy as np
import torch

__all__ = ["Mode", "call_mask", "call_score", "batch_head_dependence", "captured", "captured_tensors", "fn_name"]


class Mode(enum.Enum):
    BROADCAST = "broadcast"  # one call on broadcastable index grids
    ELEMENT = "element"      # per element under nested torch.vmap, as FlexAttention does


def fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


# ------------------------------------------------------------------------ mode memory

_MODES: "OrderedDict[object, Mode]" = OrderedDict()   # by code object + captured shapes
_WEAK_MODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # other callables, by object
_MODES_MAX = 4096
_LOCK = threading.Lock()


def stand_in(fn) -> bool:
    """Whether ``fn`` is dynamo's stand-in for a function made inside the traced one (it has no
    ``__closure__``: what it captures cannot be read while tracing)."""
    try:
        fn.__closure__
    except AttributeError:
        return True
    return False


def _shape_sig(x, depth: int = 0):
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype)
    if isinstance(x, (int, float, bool, str, type(None))):
        return x
    if depth < 2 and isinstance(x, types.FunctionType):  # a closure over other callables (and_masks'):
        return ("F", x.__code__)                          # the mode is theirs, told apart by their code
    if depth < 2 and isinstance(x, (tuple, list)) and len(x) <= 8:
        return (type(x), tuple(_shape_sig(y, depth + 1) for y in x))
    return type(x)


def _mode_key(fn):
    """A key that re-created lambdas share (same code, same captured shapes), or None."""
    if isinstance(fn, types.FunctionType):
        cells = fn.__closure__ or ()
        try:
            sig = tuple(_shape_sig(c.cell_contents) for c in cells)
        except ValueError:  # an empty cell
            return None
        return (fn.__code__, sig, tuple(_shape_sig(d) for d in (fn.__defaults__ or ())))
    if isinstance(fn, types.MethodType):
        return (fn.__func__, type(fn.__self__))
    return None


# ------------------------------------------------- what a compiled call's callables read

@contextlib.contextmanager
def reading(pairs):
    """While it lasts, each tensor a callable captures (``stale``) holds what ``fresh`` holds (``set_`` onto
    its storage, put back after): a compiled call's op is given the values the compiled function left
    in them (a ``copy_`` or an attribute set just before the call lands in the real objects only after
    the graph ran, and the op runs inside it). (Handing them over through a TorchFunctionMode failed
    under vmap inside the compiled op: "Cannot access storage of BatchedTensorImpl".) The version counter
    moves with each ``set_``: no stamp of the stale tensor is reused."""
    saved = []
    try:
        with torch.no_grad():
            for stale, fresh in pairs:
                saved.append((stale, stale.untyped_storage(), stale.storage_offset(), stale.size(), stale.stride()))
                stale.set_(fresh)
        yield
    finally:
        with torch.no_grad():
            for stale, storage, offset, size, stride in reversed(saved):
                stale.set_(storage, offset, size, stride)


def _stamp(fn) -> tuple:
    """What ``fn`` captures, as it is now: tensors as (object, version), numpy arrays by content, plain
    values as they are (:func:`captured`). Broadcast mode is kept only while this stays, since a choice
    made on a table's old values may not hold for its new ones (a per-element term zero when broadcast
    was chosen, then trained, was 2.9 off; review, 2026-12-05), nor on another closure of the same code
    whose captured flag takes another branch (``cfg["temp"]`` False, then True in a new closure: a
    tile-wide sum, 2.1 off; review, 2026-12-07: the values were not stamped). About 3 us a call. An
    inference tensor has no version: it stamps as new on every call (the check runs again each time, as
    after a change: reading one raised before)."""
    found, complete = captured(fn)
    out = [] if complete else [object()]  # what the walk could not see may differ: never equal (checked again)
    for x in found:
        if isinstance(x, torch.Tensor):
            out.append((id(x), object() if x.is_inference() else x._version))
        elif type(x).__module__ == "numpy":
            out.append(("numpy", _np_digest(x)))
        elif isinstance(x, float) and x != x:
            out.append("nan")
        else:
            out.append(x)
    return tuple(out)


_NP_WHOLE = 64 * 1024  # bytes of a captured numpy array hashed whole at every stamp


def _np_digest(x) -> tuple:
    """A numpy array (or scalar) as a stamp: small ones by their whole content; larger ones by identity,
    address, shape and a 64 KiB strided sample of their content (an array of 64 MiB reached from a score
    callable was hashed whole on every tile: 10-94x the time of a call; a review, 2026-12-07). A
    change outside the sample is not seen: the choice it could move is broadcast or per element, and a
    term that was zero when broadcast was chosen is caught on the sampled entries."""
    a = np.asarray(x)
    if a.nbytes <= _NP_WHOLE or a.dtype.hasobject:
        return (a.dtype.str, a.shape, hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()
                if not a.dtype.hasobject else repr(a.tolist()))
    flat = a.reshape(-1)
    step = max(1, flat.size // max(1, _NP_WHOLE // a.itemsize))
    return (id(x), a.__array_interface__["data"][0], a.dtype.str, a.shape,
            hashlib.sha1(np.ascontiguousarray(flat[::step]).tobytes()).hexdigest())


def _spread(shape) -> tuple[bool, ...]:
    """Which of a grid's four dims (b, h, q, kv; missing leading dims are 1) have more than one entry."""
    shape = (1,) * (4 - len(shape)) + tuple(shape)
    return tuple(n > 1 for n in shape[-4:])


def _remembered(fn, key):
    """What :func:`_set_mode` keeps for ``fn`` (its mode key ``key``), or None."""
    with _LOCK:
        if key is not None:
            return _MODES.get(key)
        try:
            return _WEAK_MODES.get(fn)
        except TypeError:  # not weakly referenceable: decided per use
            return None


def _get_mode(fn, grid=None) -> Mode | None:
    got = _remembered(fn, _mode_key(fn))
    if got is None:
        return None
    mode, entries = got
    if mode is Mode.ELEMENT:
        return mode
    stamp = _stamp(fn)
    for st, spread in entries:
        if _same(st, stamp):
            if grid is not None and any(now and not seen for now, seen in zip(_spread(grid), spread)):
                # a dim the checks never saw spread: a reduction over it cannot have shown there (a sum
                # over the queries, checked on one-query tiles, came back one value for every query after)
                return None
            return mode
    return None  # captures changed (or another closure's): decide again


#: broadcast choices kept per mode key, one per stamp: closures of one code over different plain values
#: (a layer's config each) took turns replacing the one choice and decided again at every call (1.3-1.9x
#: the time of a decode step; a review, 2026-12-07)
_STAMPS = 8


def _same(a: tuple, b: tuple) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a captured value whose comparison raises: not the same
        return False


def _set_mode(fn, mode: Mode, grid=None) -> None:
    """Remember ``mode``: per element for every closure of the key; broadcast for the captures' stamp
    with the dims shown spread by the checks that chose it (``grid``'s, joined with an earlier choice's
    under the same stamp; all dims where no check could run), beside the choices of up to
    :data:`_STAMPS` - 1 other stamps."""
    key = _mode_key(fn)
    if mode is Mode.BROADCAST:
        stamp = _stamp(fn)
        spread = (True,) * 4 if grid is None else _spread(grid)
        old = _remembered(fn, key)
        entries = []
        for st, sp in (old[1] if old is not None and old[0] is Mode.BROADCAST else ()):
            if _same(st, stamp):
                spread = tuple(a or b for a, b in zip(spread, sp))
            else:
                entries.append((st, sp))
        mode = (mode, tuple(entries[-(_STAMPS - 1):]) + ((stamp, spread),))
    else:
        mode = (mode, ())
    with _LOCK:
        if key is not None:
            _MODES[key] = mode
            _MODES.move_to_end(key)
            while len(_MODES) > _MODES_MAX:
                _MODES.popitem(last=False)
            return
        try:
            _WEAK_MODES[fn] = mode
        except TypeError:
            pass


def mode_of(fn) -> Mode | None:
    """How ``fn`` is evaluated (None until it has been called once)."""
    return _get_mode(fn)


# --------------------------------------------------------------------- index vectors


def _vectors(b, h, qp, kp):
    """The four broadcast index tensors as 1-D int32 vectors (int64 if a position needs it),
    or None when they are not the axis-aligned grids :func:`keyfold.masks.grid_positions` gives."""
    vecs = []
    for axis, t in enumerate((b, h, qp, kp)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return None
        if any(t.shape[i] != 1 for i in range(4) if i != axis):
            return None
        vecs.append(t.reshape(-1))
    big = any(v.numel() and (int(v.max()) >= 2 ** 31 or int(v.min()) < -2 ** 31) for v in vecs)
    dt = torch.int64 if big else torch.int32  # Flex passes int32 indices
    return [v.to(dt) for v in vecs]


def _nested(fn, prefix: int):
    """``fn`` vmapped over (b, h, q, kv) with ``prefix`` leading args mapped at every level."""
    f = fn
    for level in (3, 2, 1, 0):  # kv innermost, b outermost
        f = torch.vmap(f, in_dims=(0,) * prefix + tuple(0 if i == level else None for i in range(4)))
    return f


class ControlFlowError(TypeError):
    """A callable uses a tensor in Python control flow (no grid, per element or broadcast, can answer it)."""


def _run_vmapped(fn, f, *args):
    """``f(*args)`` (``fn`` under vmap), with torch's "data-dependent control flow" error said in the
    callable's terms: Python's ``and`` / ``or`` / ``not`` / ``if`` on a tensor (Flex refuses the same)"""
    try:
        return f(*args)
    except RuntimeError as e:
        if "data-dependent control flow" not in str(e):
            raise
        raise ControlFlowError(f"callable {fn_name(fn)} uses a tensor in Python control flow (`and`, `or`, `not`, `if`, "
                        f"`bool(...)`, a comparison chain such as `a <= b < c`), which no grid of indices can "
                        f"answer; write it with tensor operators: `&`, `|`, `~`, `torch.where(...)` "
                        f"(FlexAttention refuses it too)") from e


def _element_mask(fn, vecs):
    out = _run_vmapped(fn, _nested(fn, 0), *vecs)
    if not isinstance(out, torch.Tensor) or out.dim() != 4:
        raise TypeError(f"mask callable {fn_name(fn)} must return one bool per (b, h, q_idx, kv_idx), "
                        f"got shape {tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    return out


def _element_score(fn, s, vecs):
    shape = tuple(len(v) for v in vecs)
    out = _run_vmapped(fn, _nested(fn, 1), s.expand(shape), *vecs)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        raise TypeError(f"score callable {fn_name(fn)} must return one score per (b, h, q_idx, kv_idx), "
                        f"got shape {tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    return out


def _flat(fn, prefix, idx, grid, check):
    """Per element over index tensors that are not an axis-aligned grid: one vmap over every
    element of the broadcast grid (memory and time grow with the grid; rare)."""
    grid = _bshape(tuple(grid), *(t.shape for t in (*prefix, *idx)))
    args = [torch.broadcast_to(t, grid).reshape(-1) for t in (*prefix, *idx)]
    out = _run_vmapped(fn, torch.vmap(fn), *args)
    check(fn, out)
    return out.view(grid)


def _sample_index(vecs):
    """Spread sample points of the tile: b and h at up to :data:`_SAMPLES_BH` evenly spaced indices, q
    and kv at up to :data:`_SAMPLES` (the first, middle and last among them; at most 8x8x32x32 points;
    spread so that masks see both sides of an edge). Where the first and last query alone were sampled,
    a per-query gate ``(g[q_idx] * w).sum() > 0`` that broadcasting reduced over the tile agreed at both
    and was wrong on 29 of 64 rows between (a review, 2026-12-07)."""
    out = []
    for axis, v in enumerate(vecs):
        n, m = len(v), (_SAMPLES_BH if axis < 2 else _SAMPLES)
        picks = {round(i * (n - 1) / (m - 1)) for i in range(m)} | {n // 2} if n > 0 else set()
        out.append(torch.tensor(sorted(i for i in picks if 0 <= i < n), dtype=torch.long))
    return out


_SAMPLES = 32  # queries and keys
_SAMPLES_BH = 8  # batch entries and heads (first and last alone let a per-head gate through, 1.76 off)


def _sample(t, idx, grid):
    """``t`` broadcast to ``grid``, at the sample points ``idx`` (one index vector per dim)."""
    t = torch.broadcast_to(t, grid)
    for d, i in enumerate(idx):
        t = t.index_select(d, i.to(t.device))
    return t


def _sample_grids(vecs, idx):
    """The index vectors at the sample points, as broadcastable grids (for one flat vmap)."""
    return [v[i.to(v.device)].view([-1 if d == axis else 1 for d in range(4)])
            for axis, (v, i) in enumerate(zip(vecs, idx))]


def _bshape(*shapes) -> tuple | None:
    """Broadcast shape of ``shapes`` (None if they do not broadcast); plain Python, as
    ``torch.broadcast_shapes`` costs ~20 us per call."""
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        off = n - len(s)
        for i, d in enumerate(s):
            o = out[off + i]
            if o == 1:
                out[off + i] = d
            elif d != 1 and d != o:
                return None
    return tuple(out)


def _fits(out, grid) -> bool:
    """Whether a broadcast result has the grid's shape (up to broadcasting, never beyond it)."""
    if not isinstance(out, torch.Tensor) or out.dim() > len(grid):
        return False
    shape = out.shape
    off = len(grid) - len(shape)
    return all(d == 1 or d == grid[off + i] for i, d in enumerate(shape))


def _agree(a, b, exact: bool) -> bool:
    a, b = torch.broadcast_tensors(a, b)
    if exact:
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6, equal_nan=True))


def _varies(x, tol: float = 0.0) -> bool:
    """Whether the sample points' values ``x`` (b, h, q, kv) differ by more than ``tol``: what a tile
    must show before agreement there tells the two evaluations apart (a reduction over the tile, the
    mistake broadcasting makes, gives one value everywhere)."""
    x = x.double()
    return bool(x.max() - x.min() > tol) if x.numel() else False


# ------------------------------------------------------------ reductions over the grid

# A broadcast call that reduces over the tile (``.sum()`` of a per-element expression, ``.any()``, a
# matmul over a grid dim) gives per-tile values where Flex gives per-element ones. Sampled points can
# miss it (the reduction's one value may agree at every sampled point); the code cannot: while the
# deciding broadcast call runs, a TorchFunctionMode follows which tensors derive from the index grids
# and flags a reduction, sort or contraction over a dim where the grid's axes sit (the first four) and
# that has more than one entry. A flagged callable goes per element (Flex's own evaluation), so a
# false alarm (``torch.stack([a, b]).any(0)``: write ``a | b``) costs speed, never the answer.

_ALL = "all"
#: op name -> (position of its dim argument, what it reduces when that is absent)
_REDUCTIONS = {
    **{n: (1, _ALL) for n in ("sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "max", "min", "any",
                              "all", "logsumexp", "softmax", "log_softmax", "cumsum", "cumprod", "cummax",
                              "cummin", "logcumsumexp", "median", "nanmedian", "std", "var", "std_mean",
                              "var_mean", "argmax", "argmin", "count_nonzero", "unbind")},
    **{n: (1, -1) for n in ("sort", "argsort", "mode")},
    **{n: (2, -1) for n in ("topk", "kthvalue")},
    **{n: (2, _ALL) for n in ("norm", "quantile", "nanquantile")},
    "normalize": (2, 1), "cosine_similarity": (2, 1), "msort": (None, 0),
    **{n: (None, _ALL) for n in ("aminmax", "unique", "unique_consecutive", "nonzero", "argwhere",
                                 "masked_select", "item", "tolist", "__bool__", "__int__", "__float__",
                                 "__index__", "__iter__", "__len__")},
}
_CONTRACTIONS = frozenset({"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "dot", "vdot", "inner",
                           "tensordot", "einsum", "linear", "bilinear", "chain_matmul", "multi_dot"})


def _over_grid(x, dims) -> bool:
    """Whether reducing ``x`` over ``dims`` (``_ALL``: every dim) mixes grid points: a dim among the
    first four (where index-derived tensors keep b, h, q, kv) with more than one entry."""
    n = x.dim()
    if dims is _ALL or dims is None:
        dims = range(n)
    elif isinstance(dims, int):
        dims = (dims,)
    elif not isinstance(dims, (list, tuple, torch.Size)) or not all(isinstance(d, int) for d in dims):
        dims = range(n)  # named dims or anything else: assume the worst
    for d in dims:
        if n == 0:
            return False
        d = d % n
        if d < 4 and x.shape[d] > 1:
            return True
    return False


def _reduced_dims(name, args, kwargs):
    """The dims op ``name`` reduces of its first argument (``_ALL``), or None for an elementwise call
    (``torch.max(a, b)``)."""
    pos, default = _REDUCTIONS[name]
    if name in ("max", "min") and (len(args) > 1 and isinstance(args[1], torch.Tensor) or "other" in kwargs):
        return None
    dims = kwargs.get("dim", kwargs.get("axis", _ALL))
    if dims is _ALL and pos is not None and len(args) > pos and not isinstance(args[pos], bool):
        dims = args[pos]
    return default if dims is _ALL or dims is None else dims


def _einsum_contracted(args):
    """(operand, dims it contracts) for ``torch.einsum(equation, *operands)``."""
    eq, ops = args[0], list(args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str):
        return [(t, _ALL) for t in ops if isinstance(t, torch.Tensor)]
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    subs = lhs.split(",")
    if not arrow:  # implicit output: the letters used once, and the ellipsis
        letters = re.sub(r"\.\.\.", "", lhs.replace(",", ""))
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    out = []
    for sub, t in zip(subs, ops):
        if not isinstance(t, torch.Tensor):
            continue
        head, dots, tail = sub.partition("...")
        labels = list(head) + (["..."] * (t.dim() - len(head) - len(tail)) if dots else []) + list(tail)
        out.append((t, [d for d, c in enumerate(labels) if c not in rhs and not (c == "..." and "..." in rhs)]))
    return out


def _contracted(name, args, kwargs):
    """(operand, dims it contracts) for a matmul-like op."""
    if name == "einsum":
        return _einsum_contracted(args)
    ts = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("chain_matmul", "multi_dot", "bilinear") or len(ts) < 2:
        ts = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor)]
        return [(t, _ALL) for t in ts]
    a, b = ts[0], ts[1]
    if name == "__rmatmul__":
        a, b = b, a
    if name == "tensordot":
        dims = kwargs.get("dims", args[2] if len(args) > 2 else 2)
        if isinstance(dims, int):
            return [(a, list(range(a.dim() - dims, a.dim()))), (b, list(range(dims)))]
        if isinstance(dims, torch.Tensor):
            dims = dims.tolist()
        return [(a, list(dims[0]) if isinstance(dims[0], (list, tuple)) else [dims[0]]),
                (b, list(dims[1]) if isinstance(dims[1], (list, tuple)) else [dims[1]])]
    if name in ("linear", "inner"):
        return [(a, [-1]), (b, [-1])]
    return [(a, [-1]), (b, [-2 if b.dim() > 1 else -1])]


class _GridWatch(torch.overrides.TorchFunctionMode):
    """Follows the tensors derived from the index grids through a broadcast call; ``flagged`` names the
    first op that reduced over grid points (see above)."""

    def __init__(self, roots, spread):
        super().__init__()
        self.spread = {a for a, s in enumerate(spread) if s}
        self.axes: dict[int, frozenset] = {}
        self.keep: list = []  # the tensors whose ids are in ``axes`` (an id is not reused while held)
        self.flagged: str | None = None
        for t, axes in roots:
            self._mark(t, frozenset(axes))

    def _mark(self, t, axes):
        if isinstance(t, torch.Tensor):
            self.axes[id(t)] = self.axes.get(id(t), frozenset()) | axes
            self.keep.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.spread:
            return out
        leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        axes = frozenset().union(*(self.axes.get(id(t), frozenset()) for t in leaves))
        if not axes:
            return out
        if self.flagged is None and axes & self.spread:
            self.flagged = self._check(getattr(func, "__name__", ""), args, kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            self._mark(t, axes)
        return out

    def _grid_dependent(self, t) -> bool:
        return isinstance(t, torch.Tensor) and bool(self.axes.get(id(t), frozenset()) & self.spread)

    def _check(self, name, args, kwargs) -> str | None:
        if name in _REDUCTIONS and args and self._grid_dependent(args[0]):
            dims = _reduced_dims(name, args, kwargs)
            if dims is not None and _over_grid(args[0], dims):
                return name
        elif name in _CONTRACTIONS:
            for t, dims in _contracted(name, args, kwargs):
                if self._grid_dependent(t) and _over_grid(t, dims):
                    return name
        return None


_UNSURE: "OrderedDict[object, int]" = OrderedDict()  # callables whose tiles have not told yet
_UNSURE_TILES = 16


def _unsure_again(fn) -> bool:
    """Count a tile that could not tell; True once there have been enough to stop checking."""
    key = _mode_key(fn)
    key = id(fn) if key is None else key
    with _LOCK:
        n = _UNSURE.pop(key, 0) + 1
        if n >= _UNSURE_TILES:
            return True
        _UNSURE[key] = n
        while len(_UNSURE) > _MODES_MAX:
            _UNSURE.popitem(last=False)
    return False


def _decide(fn, broadcast, element, sample_of, informative, exact, grid=None, roots=()):
    """Run ``broadcast()``; check it against ``element`` at the tile's sample points; remember
    the mode. An agreement that could not have shown a difference (a mask all True or all False
    there, a score modifier adding one constant, as a zero-initialised table does) is no evidence:
    the tile is evaluated per element too (Flex's answer, always right), the broadcast answer kept
    only where it equals that on the whole tile (else the callable goes per element for good), and
    the next tiles are checked again; after 16 tiles that could not tell, the callable goes per
    element for good (about 2x the broadcast cost, always right). Telling means values that differ
    beyond float32 rounding (:func:`_varies`). (Broadcast answers used to stand on agreement alone,
    16 uninformative checks chose broadcast for good, and a score's float32 rounding counted as
    variation: a per-element ``(x[q_idx] * y[kv_idx]).sum() > 0`` reduced over the whole tile to one
    bool and showed a row every key it must not see, and a score modifier first met on one-token
    tiles, or on one query and key of two batch entries, added a tile-wide sum to every score after
    (errors 0.5 to 1.7); found by fuzzing, 2026-12-05.) Broadcast holds while the callable's captured
    float tensors stay as they were (:func:`_stamp`); a change, such as a training step, checks again.
    A broadcast call seen reducing over grid points (:class:`_GridWatch`, given the index grids
    ``roots``) goes per element whatever the points say, where vmap can run it."""
    watch = _GridWatch(roots, _spread(grid)) if roots and grid is not None else None
    try:
        if watch is None:
            out = broadcast()
        else:
            with watch:
                out = broadcast()
        err = None
    except Exception as e:  # noqa: BLE001 - any failure sends the callable to per-element mode
        out, err = None, e
    if err is None and out is not None and watch is not None and watch.flagged:
        try:
            res = element(sample=False)
        except Exception:  # noqa: BLE001 - vmap cannot run it: broadcast mode is the only one
            _set_mode(fn, Mode.BROADCAST)
            return out
        _set_mode(fn, Mode.ELEMENT)
        return res
    if err is None and out is not None:
        try:
            ref = element(sample=True)
        except Exception:  # noqa: BLE001 - vmap cannot run it: broadcast mode is the only one
            _set_mode(fn, Mode.BROADCAST)
            return out
        got = sample_of(out)
        if _agree(got, ref, exact):
            if informative(got):
                _set_mode(fn, Mode.BROADCAST, grid)
                return out
            try:
                res = element(sample=False)
            except Exception:  # noqa: BLE001 - the whole tile is too much for vmap: as the points said
                return out
            if not _agree(out, res, exact):  # the whole tile shows the difference the points missed
                _set_mode(fn, Mode.ELEMENT)
                return res
            if _unsure_again(fn):
                _set_mode(fn, Mode.ELEMENT)
            return out  # right on this tile (checked whole), in the broadcast result's own shape
    try:
        res = element(sample=False)
    except Exception as e2:  # noqa: BLE001
        if err is not None and not isinstance(e2, ControlFlowError):  # (that one says what to write instead)
            raise err from e2
        raise
    _set_mode(fn, Mode.ELEMENT)
    return res


# ----------------------------------------------------------------------------- masks


def call_mask(fn, b, h, qp, kp) -> torch.Tensor:
    """``fn(b, h, qp, kp)`` as a bool tensor broadcastable to the grid of the four index tensors."""
    if b.dim() == h.dim() == qp.dim() == kp.dim() == 4:  # (they broadcast: callers build them so; a dim of 0
        # beside 1s is 0: as max, an empty query's grid had one row and the reference backend raised, where
        # the other backends give the empty output; a review, 2026-12-08)
        grid = tuple(max(d) if min(d) else 0 for d in zip(b.shape, h.shape, qp.shape, kp.shape))
    else:
        grid = _bshape(b.shape, h.shape, qp.shape, kp.shape)
        if grid is None:
            raise ValueError(f"index tensors of shapes {b.shape}, {h.shape}, {qp.shape}, {kp.shape} do not broadcast")
    mode = _get_mode(fn, grid)
    vecs = None
    if mode is not Mode.ELEMENT:
        def broadcast():
            out = fn(b, h, qp, kp)
            _check_bool(fn, out)
            if not _fits(out, grid):
                raise ValueError(f"shape {tuple(out.shape)} does not fit the grid {tuple(grid)}")
            return out
        if mode is Mode.BROADCAST:
            try:
                return broadcast()
            except Exception:  # noqa: BLE001 - a grid it cannot take (decided on another shape)
                vecs = _vectors(b, h, qp, kp)
                if vecs is None:
                    raise
                out = _element_mask(fn, vecs)
                _check_bool(fn, out)
                _set_mode(fn, Mode.ELEMENT)
                return out
        vecs = _vectors(b, h, qp, kp)
        if vecs is None:  # not an axis-aligned index grid: per element only if broadcast fails
            try:
                return broadcast()
            except Exception:  # noqa: BLE001
                return _flat(fn, (), (b, h, qp, kp), grid, _check_bool)
        if mode is None:
            idx = _sample_index(vecs)

            def element(sample):
                if sample:
                    c = _sample_grids(vecs, idx)
                    return _flat(fn, (), c, _bshape(*(t.shape for t in c)), _check_bool)
                out = _element_mask(fn, vecs)
                _check_bool(fn, out)
                return out
            return _decide(fn, broadcast, element, lambda o: _sample(o, idx, grid), _varies, exact=True, grid=grid,
                           roots=((b, (0,)), (h, (1,)), (qp, (2,)), (kp, (3,))))
    vecs = vecs or _vectors(b, h, qp, kp)
    if vecs is None:
        return _flat(fn, (), (b, h, qp, kp), grid, _check_bool)
    out = _element_mask(fn, vecs)
    _check_bool(fn, out)
    return out


def _check_bool(fn, out):
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"mask callable {fn_name(fn)} must return a bool tensor, got {got}; "
                        f"return a comparison such as `q_idx >= kv_idx` (a score callable goes in score=)")


def probe_sizes(B: int | None, H: int | None) -> tuple[int, int]:
    """How many batch entries and heads a batch/head probe may use: up to 2 each, never past the
    call's own B and H (``lengths[b]`` must not see b = 1 when B = 1); 2 where unknown."""
    return (2 if B is None else max(1, min(int(B), 2))), (2 if H is None else max(1, min(int(H), 2)))


def batch_head_dependence(fn, B: int | None, H: int | None) -> tuple[bool, bool]:
    """Whether mask ``fn`` reads ``b`` / ``h``, probed with b < min(B, 2), h < min(H, 2) only
    (``lengths[b]`` must not see b = 1 when B = 1), at q_idx = kv_idx = 0.

    In broadcast mode a callable that never reads b returns no batch dimension. In per-element
    mode, or while the mode is undecided (the probe's answer then came per element), the result
    always has every dimension, so the probe asks vmap instead: the output of
    the inner levels is batched over b only if it depends on b. A size-1 dimension cannot be
    told apart, and needs no telling: there is only one entry to plan for."""
    Bp, Hp = probe_sizes(B, H)
    vecs, grid = _probe_grid(Bp, Hp)
    # its own copies each time: a mask writing its index in place (q_idx += offset, which Flex takes) wrote
    # into the cached grid, and unrelated masks probed later raised IndexError (a review, 2026-12-08)
    vecs = [v.clone() for v in vecs]
    grid = [vecs[0].view(-1, 1, 1, 1), vecs[1].view(1, -1, 1, 1), vecs[2].view(1, 1, 1, 1), vecs[3].view(1, 1, 1, 1)]
    try:
        out = call_mask(fn, *grid)
    except Exception:  # noqa: BLE001
        if B is None or H is None:  # an unknown size probed too far: assume it reads both (always correct)
            return True, True
        raise
    if _get_mode(fn) is Mode.BROADCAST:
        shape = (1,) * (4 - out.dim()) + tuple(out.shape)
        return shape[0] != 1, shape[1] != 1
    # per element, or not decided yet (the probe's answer was per element): ask vmap
    return _reads(fn, vecs, 0) if Bp > 1 else False, _reads(fn, vecs, 1) if Hp > 1 else False


@functools.lru_cache(maxsize=4)
def _probe_grid(Bp: int, Hp: int):
    """The dependence probe's index vectors and grids (built once; ~30 us each time otherwise)."""
    vecs = [torch.arange(Bp, dtype=torch.int32), torch.arange(Hp, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)]
    grid = [vecs[0].view(-1, 1, 1, 1), vecs[1].view(1, -1, 1, 1), vecs[2].view(1, 1, 1, 1), vecs[3].view(1, 1, 1, 1)]
    return vecs, grid


def _reads(fn, vecs, axis: int) -> bool:
    try:
        from torch._C._functorch import is_batchedtensor
    except ImportError:  # no way to ask: assume it does (plans per entry, always correct)
        return True
    others = [i for i in range(4) if i != axis]
    seen = []

    def outer(x):
        def inner(*rest):
            args = list(rest)
            args.insert(axis, x)
            return fn(*args)
        f = inner
        for level in reversed(range(3)):
            f = torch.vmap(f, in_dims=tuple(0 if i == level else None for i in range(3)))
        out = f(*[vecs[i] for i in others])
        seen.append(bool(is_batchedtensor(out)))
        return out

    torch.vmap(outer)(vecs[axis])
    return seen[0] if seen else True


# ---------------------------------------------------------------------------- scores


def call_score(fn, s, b, h, qp, kp) -> torch.Tensor:
    """``fn(s, b, h, qp, kp)`` with ``s.shape``; s keeps its dtype (Flex's rule: the modifier
    sees float32 scores for 16/32-bit inputs, and its result is cast back to the score dtype).

    A modifier that writes its scores in place (``score += bias``) raises, as compiled Flex does: the
    checks that choose how to run it call it again on the same scores, and it was applied twice, 1.0-3.4
    off, silently (a review, 2026-12-08)."""
    if s.is_inference():  # no version counter: where the modifier may run more than once on these scores (its
        # mode undecided or per element), it gets a copy, compared after (under inference_mode the double write
        # came back, 1.59 off; a review, 2026-12-08). Decided broadcast runs it once: a write there is its answer
        if _get_mode(fn, s.shape) is Mode.BROADCAST:
            return _call_score(fn, s, b, h, qp, kp)
        mine = s.clone()
        try:
            out = _call_score(fn, mine, b, h, qp, kp)
        finally:
            if not bool(((mine == s) | (mine.isnan() & s.isnan())).all()):  # (NaN scores are no write)
                _refuse_in_place(fn, None, None)
        return out
    version = s._version
    try:
        out = _call_score(fn, s, b, h, qp, kp)
    except Exception:
        _refuse_in_place(fn, s, version)
        raise
    _refuse_in_place(fn, s, version)
    return out


def _refuse_in_place(fn, s, version) -> None:
    """Raise where the score tensor ``s`` moved past ``version`` (``s`` None: a write was seen already)."""
    if s is None or s._version != version:
        raise ValueError(f"score callable {fn_name(fn)} changed its score argument in place (score += ..., "
                         f"score.mul_(...)); return a new tensor instead (score = score + ...), as compiled "
                         f"FlexAttention requires")


def _call_score(fn, s, b, h, qp, kp) -> torch.Tensor:
    mode = _get_mode(fn, s.shape)
    vecs = None
    if mode is not Mode.ELEMENT:
        def broadcast():
            out = fn(s, b, h, qp, kp)
            _check_float(fn, out)
            if not _fits(out, s.shape):
                raise ValueError(f"shape {tuple(out.shape)} does not fit the scores' {tuple(s.shape)}")
            return out
        if mode is Mode.BROADCAST:
            try:
                return _finish(broadcast(), s)
            except Exception:  # noqa: BLE001 - a grid it cannot take (decided on another shape)
                vecs = _vectors(b, h, qp, kp)
                if vecs is None:
                    raise
                out = _element_score(fn, s, vecs)
                _check_float(fn, out)
                _set_mode(fn, Mode.ELEMENT)
                return _finish(out, s)
        vecs = _vectors(b, h, qp, kp)
        if vecs is None:  # not an axis-aligned index grid: per element only if broadcast fails
            try:
                return _finish(broadcast(), s)
            except Exception:  # noqa: BLE001
                return _finish(_flat(fn, (s,), (b, h, qp, kp), s.shape, _check_float), s)
        if mode is None:
            idx = _sample_index(vecs)
            grid = tuple(len(v) for v in vecs)
            s_at = _sample(s, idx, grid)

            def element(sample):
                if sample:
                    return _flat(fn, (s_at,), _sample_grids(vecs, idx), s_at.shape, _check_float)
                out = _element_score(fn, s, vecs)
                _check_float(fn, out)
                return out

            def informative(o):  # what the modifier adds varies, beyond float32 rounding
                o, s0 = o.detach().double(), s_at.detach().double()
                if not o.numel():
                    return False
                scale = float(torch.nan_to_num(o.abs()).max()) + float(torch.nan_to_num(s0.abs()).max())
                return _varies(torch.nan_to_num(o - s0), 1e-5 * (1.0 + scale))
            out = _decide(fn, broadcast, element, lambda o: _sample(o, idx, grid), informative, exact=False,
                          grid=grid, roots=((s, (0, 1, 2, 3)), (b, (0,)), (h, (1,)), (qp, (2,)), (kp, (3,))))
            return _finish(out, s)
    vecs = vecs or _vectors(b, h, qp, kp)
    if vecs is None:
        return _finish(_flat(fn, (s,), (b, h, qp, kp), s.shape, _check_float), s)
    out = _element_score(fn, s, vecs)
    _check_float(fn, out)
    return _finish(out, s)


def _check_float(fn, out):
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"score callable {fn_name(fn)} must return a float tensor, got {got}")


def _finish(out, s):
    if out.dtype != s.dtype:
        out = out.to(s.dtype)
    if out.shape != s.shape:
        out = torch.broadcast_to(out, s.shape).contiguous()
    return out


# ----------------------------------------------------------------- what a callable reads

_SCALARS = (int, float, complex, bool, str, bytes, type(None))
_MAX_OBJECTS = 4096  # objects visited per callable; past it the plan key gives up (complete = False) ...
_HARD_OBJECTS = 16 * _MAX_OBJECTS  # ... while the walk goes on for the tensors that need gradients, to here
_MAX_DEPTH = 16  # a branch deeper than this is not followed (complete = False), the rest still is
# packages whose classes, modules and functions hold no user state worth following
_LIBRARIES = frozenset({"torch", "numpy", "keyfold", "functools", "builtins", "math", "cmath", "operator",
                        "types", "typing", "collections", "itertools", "abc", "enum", "dataclasses",
                        "logging", "threading", "weakref", "re", "inspect", "transformers"})
# instances of these hold process-wide state (a logger's manager reaches every logger), not a mask's
_OPAQUE = frozenset({"logging", "threading", "weakref", "queue", "asyncio", "concurrent", "multiprocessing"})
_LOCKS = (type(threading.Lock()), type(threading.RLock()))  # (module _thread, as threading.local's)
# the methods Python calls for a mask's code without naming them: obj(...), obj[...], obj.missing,
# a descriptor's value, int(obj), len(obj), `if obj`, iteration
_IMPLICIT = ("__call__", "__getitem__", "__getattr__", "__getattribute__", "__get__", "__index__", "__int__",
             "__float__", "__bool__", "__len__", "__iter__", "__contains__")
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_MISSING = object()
_BUILTIN_CONTAINERS = (dict, list, tuple, set, frozenset)


def _by_name(item) -> str:
    """Sort key of an attribute ``(name, value)`` (a name that is not a string: its repr)."""
    return item[0] if isinstance(item[0], str) else repr(item[0])


def _code_names(code) -> list[str]:
    """Names a code object and the code nested in it read: globals and attributes (``co_names``),
    and the string constants that could name one (``getattr(Cfg, "size")``, ``globals()["T"]``)."""
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += _code_names(c)
        elif isinstance(c, str) and c.isidentifier():
            names.append(c)
    return names


class _Spaces:
    """Modules whose globals a walk traced by dynamo reads, held here as attributes (see _globals_read)."""


def _space_of(fn, names: tuple) -> tuple:
    """``(attribute of _Spaces holding fn's module, the names in its globals)``; ``("", ())`` where fn's
    globals are not a loaded module's (code run by exec with a dict of its own). Run eagerly while dynamo
    traces: :mod:`keyfold.ops` marks it a constant of the graph (``import keyfold`` loads no dynamo)."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    g = fn.__globals__
    if module is None or vars(module) is not g:
        return "", ()
    key = "m" + str(id(module))
    setattr(_Spaces, key, module)
    return key, tuple(n for n in names if n in g)


def _globals_read(fn, names: list) -> list:
    """The values of ``fn``'s globals that its code names, in the order of ``names``.

    While dynamo traces, each is read as an attribute of its module, never through ``fn.__globals__``:
    dynamo builds that dict whole, iterating it, and its own compiled frames' entries in the same dict
    (``__compiled_fn_*``, put in the user's module) were deleted by a garbage collection meanwhile:
    ``InternalTorchDynamoError: dictionary changed size during iteration`` on a recompile (2026-12-07)."""
    if torch.compiler.is_compiling():
        key, present = _space_of(fn, tuple(names))
        if key:
            module = getattr(_Spaces, key)
            present = set(present)
            return [getattr(module, n) for n in names if n in present]
    g = fn.__globals__
    return [g[n] for n in names if n in g]


# objects without a __dict__ that are values: keyed by what they show (a range or dtype rebound in a
# list or a global kept an old plan when they were skipped; review, 2026-12-06). By repr where
# equality would hide a difference the mask can read (range(2, 2) == range(30, 30); two aware
# datetimes of one instant in two zones), or where hashing can raise (Decimal("sNaN")).
_BY_REPR = (range, slice, datetime.date, datetime.time, datetime.timedelta, datetime.tzinfo, decimal.Decimal,
            fractions.Fraction, torch.finfo, torch.iinfo)
_BY_VALUE = (torch.dtype, torch.device, torch.layout, torch.memory_format, type(Ellipsis), type(NotImplemented))


def _value(obj):
    """``obj`` as a hashable value of the plan key, or ``_MISSING`` when it is not a known value."""
    if isinstance(obj, _BY_VALUE) or type(obj) is object:  # (a sentinel: keyed by identity)
        return (type(obj).__qualname__, obj)
    if isinstance(obj, _BY_REPR):
        return (type(obj).__qualname__, repr(obj))
    if isinstance(obj, re.Pattern):  # (its repr is cut at 200 characters)
        return ("Pattern", obj.pattern, obj.flags)
    if isinstance(obj, (bytearray, memoryview, array.array)):  # mutable buffers: a digest of their bytes now
        try:
            return (type(obj).__name__, len(obj), hashlib.sha1(obj).hexdigest())
        except (ValueError, TypeError, BufferError):  # a released view, an odd layout
            return _MISSING
    if _package(type(obj).__module__) == "numpy" and isinstance(getattr(obj, "str", None), str):
        return ("numpy.dtype", str(obj))
    return _MISSING


def _torch_c_object(obj) -> bool:
    """An object of torch's C++ side without a __dict__ (a process group, a stream, a generator):
    process state, not what a mask computes from; not followed, as before the walk keyed C objects."""
    return _package(type(obj).__module__) == "torch" and not hasattr(obj, "__dict__")


def _library(obj) -> bool:
    """A class, module or function of torch, numpy, keyfold or the standard library's basics."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return _package(name) in _LIBRARIES


def _package(name) -> str:
    """The top package of a ``__module__`` value; "" where it is not a string (a Cython class's can be a
    descriptor: ``.split`` raised in a mask reading ``sys.modules[...]``; a review, 2026-12-07)."""
    return name.split(".")[0] if isinstance(name, str) else ""


def _static_attr(space, name: str):
    """``space.name`` for a user class or module, looked up without running anything (no property,
    no module ``__getattr__``, no import); a class's static or class method as its function and a
    property as its getter, whose code is what runs. ``_MISSING`` when there is none."""
    if isinstance(space, types.ModuleType):
        return vars(space).get(name, _MISSING)
    for c in space.__mro__:
        if _library(c):  # object's, type's and torch's own attributes hold no user state
            continue
        if name in c.__dict__:
            x = c.__dict__[name]
            if isinstance(x, (staticmethod, classmethod)):
                return x.__func__
            return x.fget if isinstance(x, property) else x
    return _MISSING


def same_callable(a, b) -> bool:
    """``a`` and ``b`` are one callable: the same object, or bound methods of one function on one object
    (``self.mask_mod`` is a new method object at every attribute access: compared by identity, every
    call missed the plan cache)."""
    if a is b:
        return True
    return (isinstance(a, types.MethodType) and isinstance(b, types.MethodType)
            and a.__func__ is b.__func__ and a.__self__ is b.__self__)


def callable_id(fn) -> int | tuple:
    """What :func:`same_callable` compares, as a hashable value."""
    return (id(fn.__func__), id(fn.__self__)) if isinstance(fn, types.MethodType) else id(fn)


def captured(fn, leaf=None, *, every: bool = False) -> tuple[list, bool]:
    """Everything a callable can read that its result may depend on: tensors, numpy arrays and
    plain values in its closure cells, defaults, the globals its code names, a bound method's
    object, a partial's arguments, followed into nested functions, containers and objects (an
    ``nn.Module``'s parameters, buffers and attributes), and the attributes of user classes and
    modules that some of that code names (``Cfg.window``, ``config.table``, a class attribute read
    as ``self.scale``). Returns ``(objects, complete)``; ``complete`` is False when the walk gave up
    (too many objects, or an object it cannot see into safely: a C callable, a slotted object).

    leaf: ``leaf(obj) -> (values, follow) | None`` for the caller's own value objects (masks):
    ``values`` are kept as they are, ``follow`` walked on; None leaves ``obj`` to the rules above.
    every: a tensor met again is listed again (at each place it is held): two walks of one structure
    then list as many tensors whichever of its places hold the same tensor (:mod:`keyfold.ops` matches
    a traced walk with a later one place by place).

    The one walk behind the plan cache's key (:func:`keyfold.masks.captured_stamp`) and a score
    callable's tensors that get gradients (:func:`captured_tensors`): what one of them sees, the
    other does (a table behind a class attribute had no gradient while the mask side keyed it)."""
    found, seen, complete, lookups = [], set(), True, 0
    names: dict[str, int] = {}  # names code reads: the depth of the shallowest code that reads each
    by_depth: dict[int, set] = {}  # the same names, by that depth
    held: set[str] = set()  # identifier strings held as values (a dict of modules holds thousands)
    spaces: dict[int, tuple] = {}  # user classes and modules met: (object, depth, names followed)
    stack = [(fn, 0)]
    if isinstance(fn, torch.nn.Module):  # what calling it runs
        stack.append((getattr(type(fn), "forward", None), 1))
    while stack:
        while stack:
            obj, depth = stack.pop()
            if isinstance(obj, torch.Tensor):
                if every and id(obj) in seen:
                    found.append(obj)
                if id(obj) not in seen:
                    seen.add(id(obj))
                    found.append(obj)
                    # Python attributes set on it (t.win = 3); Dynamo cannot trace a tensor's __dict__
                    extra = None if torch.compiler.is_compiling() else getattr(obj, "__dict__", None)
                    if extra:
                        stack += [(x, depth + 1) for x in extra.values()]
                continue
            if isinstance(obj, _SCALARS):
                found.append(obj)
                if isinstance(obj, str) and obj.isidentifier():  # a name held in a variable: getattr(m, NAME)
                    held.add(obj)
                continue
            if isinstance(obj, (types.ModuleType, type)):
                if not _library(obj) and id(obj) not in spaces:
                    spaces[id(obj)] = (obj, depth, set())
                    if isinstance(obj, type) and type(obj) is not type:  # a metaclass's attributes read
                        stack.append((type(obj), depth + 1))            # through the class (Cfg.size)
                    if isinstance(obj, types.ModuleType) and "__getattr__" in vars(obj):  # answers m.name
                        stack.append((vars(obj)["__getattr__"], depth + 1))
                continue
            if isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):  # d.get, t.item:
                owner = getattr(obj, "__self__", None)                                 # what they read
                if owner is not None and not isinstance(owner, types.ModuleType):
                    stack.append((owner, depth + 1))
                continue
            if isinstance(obj, (weakref.WeakValueDictionary, weakref.WeakKeyDictionary)):
                stack += [(x, depth + 1) for kv in list(obj.items()) for x in kv]
                continue
            # what a weak reference names, as if held (a layer's weakref to its model's config: the weakref
            # module's objects were skipped as process state, and a window read through ref().window kept
            # the old plan; a review, 2026-12-07): a ref's (or WeakMethod's) referent, a proxy's attributes
            # and class, a WeakSet's members
            if isinstance(obj, weakref.ref):
                found.append(type(obj).__qualname__)
                stack.append((obj(), depth + 1))
                continue
            if isinstance(obj, weakref.ProxyTypes):
                try:
                    stack += [(x, depth + 1) for x in (*vars(obj).values(), obj.__class__)]
                except ReferenceError:  # its referent is gone: every read raises
                    found.append(None)
                except TypeError:  # a referent without a __dict__: what it holds is hidden
                    complete = False
                continue
            if isinstance(obj, weakref.WeakSet):
                stack.append((set(obj), depth + 1))
                continue
            if isinstance(obj, types.MethodType):  # a bound method: its function and its object. The method
                # itself is a fresh object at every attribute access: its id names nothing, and under
                # torch.compile a guard on it failed in the frame that made it (score=self.score_mod)
                stack += [(obj.__func__, depth + 1), (obj.__self__, depth + 1)]
                continue
            if isinstance(obj, types.FunctionType) and id(obj) not in seen and _library(obj):
                # a library's closure over the user's callables and tensors (torch's and_masks / or_masks,
                # transformers' padding_mask_function): its cells and defaults are followed, its code and
                # globals are the library's. Skipped whole, a tensor its inner masks read kept the old plan
                # after an in-place change, and one and_masks' broadcast choice served every other (1.8-2.8
                # off; a review, 2026-12-08)
                seen.add(id(obj))
                try:
                    cells = obj.__closure__ or ()
                except AttributeError:  # dynamo's stand-in: nothing it captures can be read
                    cells = ()
                    complete = False
                for cell in cells:
                    try:
                        stack.append((cell.cell_contents, depth + 1))
                    except ValueError:  # a cell not yet assigned
                        pass
                stack += [(x, depth + 1) for x in obj.__defaults__ or ()]
                continue
            if id(obj) in seen or (isinstance(obj, types.FunctionType) and _library(obj)) \
                    or (type(obj) not in _BUILTIN_CONTAINERS and _package(type(obj).__module__) in _OPAQUE) \
                    or isinstance(obj, _LOCKS):  # (a dict's module name: dynamo cannot split it)
                continue
            if depth > _MAX_DEPTH:  # this branch only: what comes after it is still found
                complete = False
                continue
            seen.add(id(obj))
            if len(seen) > _MAX_OBJECTS:
                complete = False
                if len(seen) > _HARD_OBJECTS:
                    return found, False
            nxt: list = []
            mine = leaf(obj) if leaf is not None else None
            if mine is not None:
                found += mine[0]
                nxt += mine[1]
            elif isinstance(obj, types.FunctionType):
                substitute = stand_in(obj)
                if not substitute:
                    cells = obj.__closure__ or ()
                else:  # dynamo's stand-in for a function made inside the traced one: what it captures is
                    # hidden, but one that captures nothing reads only its globals, defaults and code (dynamo
                    # gives neither its __globals__ nor its __kwdefaults__: see _globals_read)
                    if not obj.__code__.co_freevars:
                        cells = ()
                    else:
                        raise TypeError(f"torch.compile cannot read what {fn_name(obj)} captures (a callable made "
                                        f"inside the compiled function): make score callables outside it") from None
                for cell in cells:
                    try:
                        nxt.append(cell.cell_contents)
                    except ValueError:  # a cell not yet assigned
                        nxt.append(None)
                if not substitute:
                    nxt += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
                elif obj.__code__.co_argcount > 4 or obj.__code__.co_kwonlyargcount:  # defaults it may have:
                    complete = False  # dynamo gives a stand-in's as a bare tuple (reading them crashed it)
                # its code too (code objects compare by their bytecode, constants and names): a helper the
                # mask calls, redefined (a notebook cell run again), or a lambda swapped in a captured dict
                # kept the old plan (errors 1.6-1.8; a review, 2026-12-07)
                found.append(obj.__code__)
                code = _code_names(obj.__code__)
                for n in code:
                    was = names.get(n)
                    if was is None or depth < was:
                        if was is not None:
                            by_depth[was].discard(n)
                        names[n] = depth
                        by_depth.setdefault(depth, set()).add(n)
                nxt += _globals_read(obj, code)
                # attributes set on the function itself (``sliding.window = 40``, read as ``sliding.window``
                # inside): not followed, the old plan (a review, 2026-12-07)
                nxt += list(getattr(obj, "__dict__", {}).values())
            elif isinstance(obj, functools.partial):
                nxt += [obj.func, *obj.args, *obj.keywords.values(), *getattr(obj, "__dict__", {}).values()]
            elif isinstance(obj, (list, tuple, collections.deque)):  # (a deque: its items now)
                nxt += list(obj)
                found.append(len(obj))
            elif isinstance(obj, (dict, types.MappingProxyType)):
                nxt += [x for kv in obj.items() for x in kv]
                found.append(len(obj))
            elif isinstance(obj, (set, frozenset)):
                try:
                    nxt += sorted(obj, key=repr)
                except Exception:  # noqa: BLE001 - a member whose repr raises: order unknown
                    nxt += list(obj)
                    complete = False
                found.append(len(obj))
            elif type(obj).__module__ == "numpy" and hasattr(obj, "tobytes"):  # an array or numpy scalar
                found.append(obj)
            elif isinstance(obj, np.ndarray):  # a subclass (np.ma): its data, and its own attributes (the mask)
                found.append(np.asarray(obj))
                nxt += list(getattr(obj, "__dict__", {}).values())
            elif isinstance(obj, torch.nn.Module):  # its tensors, submodules and own attributes (self._size
                # too), not its hook tables: a whole model then stays inside the object budget
                nxt += [*obj._parameters.values(), *obj._buffers.values(), *obj._modules.values()]
                # attributes by name: while dynamo traces, an attribute the traced code set comes first in its
                # view of __dict__, and keyfold.ops matches that walk with an eager one place by place
                nxt += [x for name, x in sorted(vars(obj).items(), key=_by_name)
                        if name not in _MODULE_TABLES and "hook" not in name]
                nxt.append(type(obj))
            elif hasattr(obj, "__dict__") or _slots(type(obj)):
                try:  # (by name, as a module's attributes above)
                    nxt += [x for _, x in sorted(vars(obj).items(), key=_by_name)] if hasattr(obj, "__dict__") else []
                except Exception:  # noqa: BLE001 - a __dict__ that is not a dict
                    complete = False
                # a slotted object's fields (a dataclass(slots=True) config: hidden, and the evaluation
                # choice of one closure was kept for another reading other values; a review, 2026-12-07)
                nxt += [getattr(obj, n, None) for n in _slots(type(obj))]
                nxt.append(type(obj))  # its class attributes that the code names (self.scale)
                if not _library(type(obj)):  # what runs when it is called, indexed, read or converted
                    nxt += [m for m in map(functools.partial(_static_attr, type(obj)), _IMPLICIT)
                            if isinstance(m, types.FunctionType)]
            elif (value := _value(obj)) is not _MISSING:
                found.append(value)
            elif not _torch_c_object(obj):  # a C callable or another C object (no __dict__, no slots): what it
                complete = False  # holds is hidden (deques and bytearrays filled in place kept old plans)
            stack += [(x, depth + 1) for x in reversed(nxt)]
        # the attributes of the user classes and modules met that some code names, until none is new: the
        # names the shallowest code reads first (the callable's own), then deeper code's, then names held
        # in variables (getattr(m, NAME)); at most _HARD_OBJECTS look-ups (a mask reading sys.modules[...]
        # meets every loaded module, the module names as strings and the names of every function those
        # hold: 8.6 million look-ups, 25 s a call, or with a bound but in no order the table the callable
        # itself named was not reached and got no gradient; a review, 2026-12-07)
        tiers = [by_depth[d] for d in sorted(by_depth)] + [held]
        for pool in tiers:
            if lookups >= _HARD_OBJECTS:  # (each space's set difference below costs as much as its look-ups)
                complete = False
                break
            for space, depth, done in list(spaces.values()):
                todo = sorted(pool - done)
                if lookups + len(todo) > _HARD_OBJECTS:
                    complete = False
                    todo = todo[:max(0, _HARD_OBJECTS - lookups)]
                lookups += len(todo)
                for n in todo:
                    x = _static_attr(space, n)
                    if x is not _MISSING:
                        stack.append((x, depth + 1))
                done.update(todo)
            if stack:  # what shallower names found is followed before deeper names are looked up
                break
    return found, complete


def _slots(cls) -> tuple[str, ...]:
    """The ``__slots__`` fields of a user class and its bases (not ``__dict__`` / ``__weakref__``); the
    walk asks for every object it meets, so once a class."""
    try:
        return _slots_cached(cls)
    except TypeError:  # a class whose metaclass makes it unhashable
        return _slots_of(cls)


@functools.lru_cache(maxsize=1024)
def _slots_cached(cls) -> tuple[str, ...]:
    return _slots_of(cls)


def _slots_of(cls) -> tuple[str, ...]:
    if _library(cls):
        return ()
    out = []
    for c in cls.__mro__:
        sl = c.__dict__.get("__slots__", ())
        for n in ((sl,) if isinstance(sl, str) else sl):
            if n not in ("__dict__", "__weakref__") and n not in out:
                out.append(n)
    return tuple(out)


def captured_tensors(fn) -> tuple[torch.Tensor, ...]:
    """Floating-point tensors ``fn`` can read (:func:`captured`), each once, in a stable order."""
    return float_tensors(captured(fn)[0])


def float_tensors(found) -> tuple[torch.Tensor, ...]:
    """The floating-point (and complex) tensors among what :func:`captured` found."""
    return tuple(x for x in found  # (the walk lists each tensor once)
                 if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()))
