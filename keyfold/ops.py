"""The engine as ``torch.library`` custom ops, so ``torch.compile`` sees one opaque call.

``keyfold::attend(q, k, v, tensors, spec, scale, q_offset, kv_offset) -> (out, lse)`` runs the
planner and the piece kernels inside its real implementation, where dynamo never looks; its
fake implementation only gives shapes, and ``keyfold::attend_backward`` is wired to it with
``register_autograd`` (the piece backward of docs/math.md section 2). A model that calls
:func:`keyfold.attention` while being compiled reaches these ops by itself
(``torch.compiler.is_compiling()``), so it traces with zero graph breaks and ``fullgraph=True``.

Masks and score modifiers are Python value objects. Dynamo traces their construction like any
Python code; :func:`flatten` (also traced) turns one into a JSON ``spec`` string (a constant of
the graph) and the list of tensors it holds (graph values, so a padding mask built from a
traced ``attention_mask`` stays data, not a constant). The real implementation rebuilds the
objects from both with :func:`unflatten`; equal masks hash equal, so the plan cache still hits.
Dense tensor masks (SDPA's ``attn_mask``) are data the same way: a bool mask's tensor fills a slot,
and so does a float mask's, unless it needs a gradient: then it is one of the op's
``grad_tensors`` (named ``["g", i]``), the backward rebuilds it as a leaf and returns its gradient.
Values a trace cannot look at (NaN / +inf in a float mask, a float mask without -inf) are checked
when the op rebuilds the mask.
A Flex-style callable, or a user's own Mask / ScoreMod class, is not data: it is kept in a
registry and named in the spec by its key (dynamo reads the key as a constant; build such an
object outside the compiled function).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import re
import types

import torch

from . import _callables
from . import masks as M
from . import scores as S
from .dense import _DenseBias, _DenseMask, check_additive, lse_shift_of, shifted_bias, tensor_mask
from .state import State

__all__ = ["attend_op", "flatten", "unflatten"]

# ------------------------------------------------------------------ masks and scores as data

_CALLABLES: dict[int, object] = {}  # key -> a user's callable or mask/score object (kept alive)

# the callables' walk reads a function's globals by name from its module while dynamo traces, asking this
# (run eagerly) for the module and the names it holds: a mark on the function itself
torch._dynamo.assume_constant_result(_callables._space_of)


@torch._dynamo.assume_constant_result
def _register(fn) -> int:
    """Keep ``fn`` in the registry under its id (run eagerly, even under dynamo: the op looks it up)."""
    key = id(fn)
    _CALLABLES[key] = fn
    return key


def _callable_key(fn) -> int:
    """A stable int naming a user's mask_mod / score_mod callable.

    Under dynamo the key is a constant of the graph. Comparing it with ``id(fn)`` in traced code makes
    dynamo guard on the object itself, so another callable of the same code (a mask factory's new
    closure each batch: attention-gym's document masks, a window of another width) recompiles and gets
    its own key. Without that guard the graph kept the first closure's key and ran the first closure:
    errors of 1.6-3.1 after the document boundaries moved (a review, 2026-12-07). The registry keeps
    every registered callable alive, so no id is reused while a graph names it."""
    if isinstance(fn, functools.partial):  # keyed as before (one whose arguments change raises dynamo's
        return _register(fn)               # "argument conversion failed": never a stale result)
    if not isinstance(fn, types.FunctionType):  # a callable object: by identity, as a Mask object (_guarded)
        return _guarded(fn)
    if _callables.stand_in(fn):  # dynamo's stand-in for a function made inside the traced one: made anew from the
        # same code at every call (the first one's key serves); an id() there breaks the graph. One that
        # captures variables (a window width, a tensor of document ids) cannot be made a constant: dynamo
        # raised its internal ClosureConversionError, without fullgraph too (a review, 2026-12-07)
        if fn.__code__.co_freevars:
            raise TypeError(f"torch.compile cannot keep {fn.__code__.co_name}, made inside the compiled function "
                            f"and capturing {', '.join(fn.__code__.co_freevars)}, as a constant: make mask and "
                            f"score callables outside it (pass what changes as a tensor they capture)")
        return _register(fn)
    return _guarded(fn)


def _guarded(x) -> int:
    """``x``'s registry key, compared with ``id(x)`` in traced code: the comparison (never true) is what
    makes dynamo guard on ``x`` itself. For a user's own Mask or ScoreMod object or callable object: a new
    object recompiles, and one made inside the traced function breaks the graph (raises under
    ``fullgraph=True``). Keyed by :func:`_register` alone, one made inside reached the registry as dynamo
    rebuilt it, without the attributes its ``__init__`` set (``Band(2)`` ran with the class's ``width =
    40``: 2.3 off, silently, also with ``fullgraph=True``; a review, 2026-12-07)."""
    key = _register(x)
    if id(x) != key:
        raise RuntimeError("keyfold: a callable's registry key does not match it")
    return key


def _callable_node(fn) -> str:
    """The spec node of a user's callable: ``["fn", key]``, or for a bound method (``mask=self.mask_mod``)
    ``["method", key of its function, key of its object]``: dynamo cannot hand a bound method to
    :func:`_register` as one constant (``fullgraph=True`` raised its "argument conversion failed")."""
    if isinstance(fn, types.MethodType):  # its object guarded by identity too: it holds what the method reads
        return '["method",' + str(_callable_key(fn.__func__)) + ',' + str(_guarded(fn.__self__)) + ']'
    return '["fn",' + str(_callable_key(fn)) + ']'


def _callable_of(op: str, args) -> object:
    """The callable a ``["fn", key]`` or ``["method", function key, object key]`` node names."""
    fn = _CALLABLES[args[0]]
    return types.MethodType(fn, _CALLABLES[args[1]]) if op == "method" else fn


def _num(x) -> str:
    return "null" if x is None else str(x)


def _slot(t: torch.Tensor, tensors: list) -> str:
    tensors.append(t)
    return '["#",' + str(len(tensors) - 1) + ']'


def _value(x, tensors: list) -> str:
    if isinstance(x, torch.Tensor):
        return _slot(x, tensors)
    if isinstance(x, int) and not isinstance(x, bool) and torch.compiler.is_compiling():
        # a preset's number: dynamo makes it symbolic from its second value (and cannot say which it
        # is), so under compile it is data of the graph, read back in the op (it raised before)
        tensors.append(torch.scalar_tensor(x, dtype=torch.int64))
        return '["n",' + str(len(tensors) - 1) + ']'
    if x is None:
        return "null"
    if isinstance(x, str):
        return '"' + x + '"'
    return repr(x)  # int or float


def _params(params: dict, tensors: list) -> str:
    return "{" + ",".join('"' + k + '":' + _value(params[k], tensors) for k in sorted(params)) + "}"


def _flat_mask(m, tensors: list) -> str:
    """By the mask protocol: a combinator's operands, a preset's spec; padding by its bounds;
    a callable or any other mask by reference."""
    if m is None:
        return "null"
    ops = m.operands()
    if ops is not None:
        logic, parts = ops
        return '["' + logic.value + '"' + "".join("," + _flat_mask(x, tensors) for x in parts) + "]"
    spec = m.spec()
    if spec is not None:
        kind, params = spec
        return '["spec","' + kind.value + '",' + _params(params, tensors) + "]"
    if type(m) is M._Padding:
        ends = "null" if m.ends is None else _slot(m.ends.t, tensors)
        return '["padding",' + _slot(m.starts.t, tensors) + ',' + ends + ']'
    if type(m) is M._Keys:
        return '["keys",' + _slot(m.valid.t, tensors) + ']'
    if type(m) is M.Varlen:  # its cu_seqlens are data (built from traced tensors, a new batch each step)
        return ('["varlen",' + _slot(m.cu_q.t, tensors) + ',' + _slot(m.cu_k.t, tensors) + ','
                + _num(m.left) + ',' + _num(m.right) + ']')
    if type(m) is M._Remapped:  # transformers' packed positions: data, like the documents beside them
        return '["remap",' + _flat_mask(m.inner, tensors) + ',' + _slot(m.pos.t, tensors) + ']'
    if type(m) is _DenseMask:  # a dense bool mask (SDPA's attn_mask): its tensor is data
        return '["dense",' + _slot(m.table.t, tensors) + ',' + str(m.q0) + ',' + str(m.k0) + ']'
    if type(m) is M.MaskFn:
        return _callable_node(m.fn)
    # a user's own Mask class: passed by reference (build it outside the compiled function)
    return '["obj",' + str(_guarded(m)) + ']'


def _flat_score(s, tensors: list, grads) -> str:
    if s is None:
        return "null"
    parts = s.parts()
    if parts is not None:
        return '["chain"' + "".join("," + _flat_score(x, tensors, grads) for x in parts) + "]"
    spec = s.spec()
    if spec is not None:
        kind, params = spec
        return '["spec","' + kind.value + '",' + _params(params, tensors) + "]"
    if type(s) is _DenseBias:  # an additive float mask: data; one that trains is named among the grad tensors
        i = next((i for i, g in enumerate(grads) if g is s.live), None)
        # (the tensor as given, -inf included: the op finds a huge row's shift over the keys it shows)
        slot = _slot(s.live.detach(), tensors) if i is None else '["g",' + str(i) + ']'
        return '["bias",' + slot + ',' + str(s.q0) + ',' + str(s.k0) + ']'
    if type(s) is S.ScoreFn:
        return _callable_node(s.fn)
    return '["obj",' + str(_guarded(s)) + ']'


def flatten(mask, score, backend, block_size, check_inputs: bool = False, grad_tensors=()) -> tuple[str, list]:
    """``(spec, tensors)``: a JSON string naming the mask, score, backend and block size, and the
    tensors they hold in the order the spec's ``["#", i]`` slots name them. A dense float mask
    that is one of ``grad_tensors`` is named by its place there (``["g", i]``) instead: the op
    receives it as an input that gets a gradient."""
    tensors: list = []
    m = _flat_mask(M.as_mask(mask), tensors)
    s = _flat_score(S.as_score(score), tensors, grad_tensors)
    if block_size is not None and type(block_size) is not int:
        block_size = '[' + str(block_size[0]) + ',' + str(block_size[1]) + ']'
    spec = ('{"mask":' + m + ',"score":' + s + ',"backend":"' + backend.value + '","block":' + _num(block_size)
            + ',"check":' + ("true" if check_inputs else "false") + '}')
    return spec, tensors


def _args(params: dict, tensors: list) -> dict:
    return {k: tensors[v[1]] if isinstance(v, list) else v for k, v in params.items()}


def _preset_mask(kind: M.MaskKind, p: dict) -> M.Mask:
    """A preset from its spec, through the public builders."""
    if kind is M.MaskKind.CAUSAL:
        return M.causal()
    if kind is M.MaskKind.WINDOW:
        return M.window(p["left"], p["right"])
    if kind is M.MaskKind.SINKS:
        return (M.prefix if p.get("name") == "prefix" else M.sinks)(p["n"])
    if kind is M.MaskKind.DOCUMENTS:
        return M.documents(p["ids"], p.get("kv_ids"))
    if kind is M.MaskKind.BLOCK_SPARSE:
        return M.block_sparse(p["layout"], p["block_size"])
    if kind is M.MaskKind.DILATED:
        return M.dilated(p["step"])
    raise ValueError(f"keyfold.ops: no builder for the mask kind {kind}")


def _build_mask(node, tensors):
    if node is None:
        return None
    op, args = node[0], node[1:]
    t = lambda x: None if x is None else tensors[x[1]]  # noqa: E731
    if op in (M.Logic.AND.value, M.Logic.OR.value):
        parts = [_build_mask(a, tensors) for a in args]
        if op == M.Logic.AND.value:  # an all-visible dense mask (see "dense") drops out of a conjunction
            parts = [p for p in parts if p != M.full()] or [M.full()]
        if not parts:
            return M.full() if op == M.Logic.AND.value else ~M.full()
        out = parts[0]
        for x in parts[1:]:
            out = (out & x) if op == M.Logic.AND.value else (out | x)
        return out
    if op == M.Logic.NOT.value:
        return ~_build_mask(args[0], tensors)
    if op == "spec":
        return _preset_mask(M.MaskKind(args[0]), _args(args[1], tensors))
    if op == "padding":
        starts, ends = t(args[0]), t(args[1])
        return M.padding(starts=starts) if ends is None else M.padding(ends - starts, starts=starts)
    if op == "keys":
        return M.padding(keys=t(args[0]))
    if op == "remap":  # the conjunction it sits in (rebuilt with &) drops it where positions are plain
        return M._Remapped(_build_mask(args[0], tensors), t(args[1]))
    if op == "dense":  # as eagerly, where a float mask without -inf has no companion mask
        table = t(args[0])
        return M.full() if bool(table.all()) else _DenseMask(table, args[1], args[2])
    if op == "varlen":  # through the public builder, which checks the lengths
        return M.varlen(t(args[0]), t(args[1]), window=(args[2], args[3]))
    if op in ("fn", "method"):
        return M.MaskFn(_callable_of(op, args))
    if op == "obj":
        return _CALLABLES[args[0]]
    raise ValueError(f"unknown mask node {op!r}")


def _build_score(node, tensors, grads):
    if node is None:
        return None
    op, args = node[0], node[1:]
    if op == "chain":
        return S.as_score([_build_score(a, tensors, grads) for a in args])
    if op == "bias":
        where, i = args[0]
        live = grads[i] if where == "g" else tensors[i]
        check_additive(live, "attn_mask")  # (traced, tensor_mask could not look at the values)
        return shifted_bias(live, args[1], args[2])
    if op == "spec":
        kind, p = S.ScoreKind(args[0]), _args(args[1], tensors)
        if kind is S.ScoreKind.ALIBI:
            return S.alibi(p["slopes"])
        if kind is S.ScoreKind.SOFTCAP:
            return S.softcap(p["cap"])
        raise ValueError(f"keyfold.ops: no builder for the score kind {kind}")
    if op in ("fn", "method"):
        return S.ScoreFn(_callable_of(op, args))
    if op == "obj":
        return _CALLABLES[args[0]]
    raise ValueError(f"unknown score node {op!r}")


@functools.lru_cache(maxsize=256)
def _cached(spec: str):
    return _unflatten(spec, [], [])


def _unflatten(spec, tensors, grads):
    from .engine import Backend
    d = json.loads(spec)
    block = d["block"]
    return (_build_mask(d["mask"], tensors), _build_score(d["score"], tensors, grads), Backend(d["backend"]),
            tuple(block) if isinstance(block, list) else block, d.get("check", False))


_NUMBER = re.compile(r'\["n",(\d+)\]')


def unflatten(spec: str, tensors: list, grads: list = ()) -> tuple:
    """``(mask, score, backend, block_size, check_inputs)`` from :func:`flatten`'s output (specs
    without tensor slots cached). ``grads``: the op's grad tensors, which ``["g", i]`` slots name
    (taken as given: the backward passes them as leaves that require grad, the forward detached). A
    preset's number traced under compile (``["n", i]``) is read from its tensor into the spec first,
    so a compiled call with a window passed in finds its mask in the cache (building it every call
    doubled a small call's time)."""
    if '["n",' in spec:
        spec = _NUMBER.sub(lambda m: str(int(tensors[int(m.group(1))])), spec)
    if not grads and '["#",' not in spec:
        return _cached(spec)
    if not grads:
        return _rebuilt(spec, tensors)
    return _unflatten(spec, [x.detach() for x in tensors], list(grads))


#: (spec, the slots' shapes) -> [(copies of the tensors' values, the rebuilt objects)], newest last
_REBUILT: collections.OrderedDict = collections.OrderedDict()
#: entries kept, and the most bytes of tensor values one entry copies
REBUILT_ENTRIES, REBUILT_BYTES = 16, 2 << 20


@functools.lru_cache(maxsize=256)
def _object_slots(spec: str) -> tuple[int, ...]:
    """The slots the spec's mask and score read (not the offsets, the stale flag, the callables' reads)"""
    d = json.loads(spec)
    found: list[int] = []

    def walk(x):
        if isinstance(x, list):
            if len(x) == 2 and x[0] == "#" and isinstance(x[1], int):
                found.append(x[1])
            else:
                for y in x:
                    walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
    walk(d["mask"])
    walk(d["score"])
    return tuple(sorted(set(found)))


def _rebuilt(spec: str, tensors: list) -> tuple:
    """:func:`_unflatten` of a spec with tensor slots, kept while the tensors hold the same values: a
    compiled call with a preset built outside rebuilt it every call (two digests of its tensors, the plan
    cache's key): a decoding step over 128k keys took 3.9 ms compiled against 0.33 ms eager (a review,
    2026-12-08). Compared by value (a write through numpy or ``.data`` moves no version counter); calls
    whose tensors pass :data:`REBUILT_BYTES` rebuild as before."""
    ts = [x.detach() for x in tensors]
    used = [ts[i] for i in _object_slots(spec)]
    if sum(t.numel() * t.element_size() for t in used) > REBUILT_BYTES or any(t.device.type != "cpu" for t in used):
        return _unflatten(spec, ts, [])
    key = (spec, tuple((tuple(t.shape), t.dtype) for t in used))
    hit = _REBUILT.get(key)
    if hit is not None and all(torch.equal(a, b) for a, b in zip(hit[0], used)):
        with contextlib.suppress(KeyError):  # (another thread may have let it go meanwhile)
            _REBUILT.move_to_end(key)
        return hit[1]
    out = _unflatten(spec, ts, [])
    _REBUILT.pop(key, None)  # (the newest last: assigning an existing key keeps its old place)
    _REBUILT[key] = ([t.clone() for t in used], out)
    with contextlib.suppress(KeyError):
        while len(_REBUILT) > REBUILT_ENTRIES:
            _REBUILT.popitem(last=False)
    return out


# ------------------------------------------------------------------------------ the ops


@contextlib.contextmanager
def _autograd_dispatch():
    """Autograd back on inside an op's implementation (the dispatcher runs it below autograd)."""
    D = torch._C.DispatchKey
    keys = (D.AutogradFunctionality, D.AutogradOther, D.ADInplaceOrView)
    old = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    try:
        for k in keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        with torch.enable_grad():
            yield
    finally:
        for k, was in zip(keys, old):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)


def _offsets(spec: str, tensors: list, q_offset: int, kv_offset: int) -> tuple[int, int]:
    """The offsets, read from their tensors where the spec names slots for them (``"qoff"`` /
    ``"kvoff"``: a static cache's position, data of the graph rather than a constant)."""
    if '"qoff"' not in spec and '"kvoff"' not in spec:
        return q_offset, kv_offset
    d = json.loads(spec)
    q = d.get("qoff")
    kv = d.get("kvoff")
    return (q_offset if q is None else int(tensors[q[1]])), (kv_offset if kv is None else int(tensors[kv[1]]))


# -------------------------------------------- what callables read, as the compiled function left it

def _users(m) -> list:
    """The user callables and objects of a mask tree, in the order :func:`_flat_mask` writes their nodes."""
    if m is None:
        return []
    ops = m.operands()
    if ops is not None:
        return [u for x in ops[1] for u in _users(x)]
    if m.spec() is not None or type(m) in (M._Padding, M._Keys, M.Varlen, _DenseMask):
        return []
    if type(m) is M._Remapped:
        return _users(m.inner)
    return [m.fn if type(m) is M.MaskFn else m]


def _score_users(s) -> list:
    """The same for a score tree (:func:`_flat_score`'s order)."""
    if s is None:
        return []
    parts = s.parts()
    if parts is not None:
        return [u for x in parts for u in _score_users(x)]
    if s.spec() is not None or type(s) is _DenseBias:
        return []
    return [s.fn if type(s) is S.ScoreFn else s]


def _walkable(u, nargs: int) -> bool:
    """Whether the walk can follow ``u`` while dynamo traces: not a function made inside the traced
    function that captures variables (dynamo's stand-in has no ``__closure__``; :func:`_callable_key`
    refuses those). One that captures nothing is walked: its globals, defaults and code (a lambda made
    there reading a module's dict the function changed before the call read the old entry, 1.1-1.4 off,
    and a score one raised; 2026-12-08)."""
    if isinstance(u, types.FunctionType) and _callables.stand_in(u):  # (``nargs``: a mask's 4 or a score's 5; one
        # with more has defaults, whose values dynamo's stand-in gives as a bare tuple: reading them crashed
        # dynamo; a review, 2026-12-08)
        code = u.__code__
        return not code.co_freevars and code.co_argcount == nargs and not code.co_kwonlyargcount
    return True


def _walked(users) -> tuple[list, list]:
    """``(tensors, numbers)`` the callables ``users`` can read (:func:`keyfold._callables.captured`), in the
    walk's order: every tensor once at each place that holds it, and the numbers and flags among their plain
    values (what a traced call saw, compared with what the real objects hold when the op runs). One walk
    for both: dynamo traces it."""
    from ._callables import captured
    found = [x for u in users for x in captured(u, every=True)[0]]
    return ([x for x in found if isinstance(x, torch.Tensor)],
            [float(x) for x in found if isinstance(x, (bool, int, float)) and not isinstance(x, torch.Tensor)])


def _reads_slots(mask, score, tensors: list, grad_tensors) -> str:
    """While dynamo traces: the tensors the mask's and score's callables capture, as the traced function
    sees them (a buffer it ``copy_``-ed into, an attribute or dict entry it set: those land in the real
    objects only after the graph has run, and the op runs inside it), appended to ``tensors``; the spec's
    ``"reads"`` says where each stands in the callables' walk. Tensors that train are left out (the op's
    grad tensors, named there)."""
    users = [u for u in _users(mask) if _walkable(u, 4)] + [u for u in _score_users(score) if _walkable(u, 5)]
    if not users:
        return ""
    keys = tuple(_user_keys(users))
    found, numbers = _walked(users)
    if ",".join(str(t.dtype) for t in found) != _walk_signature(keys):
        # the traced function rebinds what a callable reads before the call (self.doc = doc where another
        # name also held doc): the walks cannot be matched place by place. Raised while tracing: dynamo
        # runs the call eagerly (after its writes), or says so under fullgraph=True
        raise RuntimeError("keyfold under torch.compile: a mask or score callable reads state the compiled "
                           "function replaces before the call; set that state outside the compiled function "
                           "(or update a tensor it captures in place)")
    at = []
    for i, t in enumerate(found):
        j = next((j for j, g in enumerate(grad_tensors) if t is g), None)
        if j is None:
            tensors.append(t)
            at.append("[" + str(len(tensors) - 1) + "," + str(i) + "]")
        else:  # a tensor that trains is already an input of the op: named by its place there, -1 - j
            at.append("[" + str(-1 - j) + "," + str(i) + "]")
    names = ",".join("[" + str(k[0]) + "," + str(k[1]) + "]" if isinstance(k, tuple) else str(k) for k in keys)
    # the numbers as the traced code sees them (a symbolic one too): data the op compares with the objects'
    tensors.append(torch.tensor(numbers, dtype=torch.float64))
    return (',"reads":{"users":[' + names + '],"n":' + str(len(found)) + ',"at":[' + ",".join(at) + '],"plain":'
            + str(len(tensors) - 1) + "}")


def _user_keys(users) -> list:
    """Registry keys of the user callables (bound methods as a pair), as constants of the graph."""
    return [(_callable_key(u.__func__), _guarded(u.__self__)) if isinstance(u, types.MethodType)
            else _callable_key(u) if callable(u) and not isinstance(u, (M.Mask, S.ScoreMod)) else _guarded(u)
            for u in users]


def _users_of(keys) -> list:
    """The callables and objects registry keys name (a pair: a bound method)."""
    return [types.MethodType(_CALLABLES[k[0]], _CALLABLES[k[1]]) if isinstance(k, (tuple, list)) else _CALLABLES[k]
            for k in keys]


@torch._dynamo.assume_constant_result
def _walk_signature(keys: tuple) -> str:
    """The dtypes of the tensors the callables named by ``keys`` capture, walked on the real objects (run
    eagerly, even while dynamo traces: the objects as they were before the compiled function ran)."""
    return ",".join(str(t.dtype) for t in _walked(_users_of(keys))[0])


@functools.lru_cache(maxsize=256)
def _reads_of(spec: str) -> dict:
    """The spec's ``"reads"`` (parsed once per spec: the forward and backward of every call ask)."""
    return json.loads(spec)["reads"]


def _stand_ins(spec: str, tensors: list, grads: list) -> list:
    """``[(tensor a callable reads now, the op's tensor for it)]`` for a spec with ``"reads"``: the
    callables' walk again, on the real objects (still as they were before the compiled function ran),
    matched place by place with the traced one."""
    if '"reads"' not in spec:
        return []
    reads = _reads_of(spec)
    users = _users_of(reads["users"])
    now, numbers = _walked(users)
    now_numbers, then = torch.tensor(numbers, dtype=torch.float64), tensors[reads["plain"]]
    if now_numbers.shape != then.shape or not torch.allclose(now_numbers, then, rtol=0, atol=0, equal_nan=True):
        # a number or flag the compiled function set before the call (self.window = w) is not yet in the
        # object: the callable would read the previous call's (it did, silently: 1.3-1.7 off; 2026-12-07)
        raise RuntimeError(
            "keyfold under torch.compile: a mask or score callable reads a plain value (a number, flag or "
            "string) that the compiled function changes before the call; the op runs before that change "
            "reaches the object. Set it outside the compiled function, or pass it as a preset's argument "
            "(window(w)) or as a tensor the callable captures")
    given = [(now[i] if i < len(now) else None, tensors[s] if s >= 0 else grads[-1 - s]) for s, i in reads["at"]]
    if len(now) != reads["n"] or any(a.dtype != b.dtype for a, b in given):
        raise RuntimeError(
            "keyfold under torch.compile: the tensors a mask or score callable reads are not those it read when "
            "traced (the compiled function adds or replaces what the callable captures before the call, or "
            "changes its dtype); keyfold cannot hand the callable the values the compiled function gave them. "
            "Set that state outside the compiled function, or pass it to the callable as a tensor it captures "
            "and update that tensor in place")
    # only where they differ (a set_ moves the version counter, which autograd checks on saved tensors)
    return [(a, b.detach()) for a, b in given if a is not b and not _same_values(a, b)]


def _watch_entries(m, s) -> list:
    """The watch entries (:func:`keyfold.masks.watch`) of the presets in the mask tree ``m`` and score tree
    ``s``, in the nodes :func:`_flat_mask` / :func:`_flat_score` rebuild (an ``"obj"`` node runs the user's
    own object, whose presets the call checks itself)."""
    out, stack = [], [m, s]
    while stack:
        x = stack.pop()
        if x is None:
            continue
        out += list(getattr(x, "_watched", ()))
        ops = x.operands() if isinstance(x, M.Mask) else None
        parts = x.parts() if isinstance(x, S.ScoreMod) else None
        if ops is not None:
            stack += list(ops[1])
        elif parts is not None:
            stack += list(parts)
        elif type(x) is M._Remapped:
            stack.append(x.inner)
    return out


def _stale_slot(mask, score, tensors: list) -> str:
    """While dynamo traces: one flag tensor saying whether a preset built OUTSIDE the compiled function has seen
    its tensor change in place since (the tensor as the graph holds it now against the preset's copy), as the
    spec's ``"stale"`` slot; the op raises as the eager call does. Without it the op ran on the preset's old
    copy, silently (1.25 off; 2026-12-08). A preset built inside the function watches nothing: its tensor is
    data of the graph already."""
    flags = []
    for entry in _watch_entries(mask, score):
        try:
            t = entry.now()
        except RuntimeError:  # the buffer took other storage (set_): its view no longer fits
            flags.append(torch.ones((), dtype=torch.bool))
            continue
        if t is not None and entry.values is not None:
            flags.append(entry.moved(t))
    if not flags:
        return ""
    flag = torch.stack([f.to("cpu") for f in flags]).any()
    return ',"stale":' + _slot(flag, tensors)


@functools.lru_cache(maxsize=256)
def _stale_of(spec: str) -> int:
    """The slot of the spec's ``"stale"`` flag (parsed once per spec: every compiled call asks)"""
    return json.loads(spec)["stale"][1]


def _check_stale(spec: str, tensors: list) -> None:
    """Raise as :func:`keyfold.masks.check_unchanged` where the spec's ``"stale"`` flag is set (the forward
    only: a backward takes the forward's values)."""
    if '"stale"' not in spec:
        return
    if bool(tensors[_stale_of(spec)]):
        raise ValueError("a preset (documents, varlen, padding, sinks(tensor), block_sparse, alibi) used in this "
                         "compiled function was built from a tensor that has changed in place since; a preset keeps "
                         "the values its tensors had when it was built. Build it again after changing the tensor "
                         "(inside the compiled function, where its tensor is data of the graph), or pass a mask_mod "
                         "/ score_mod callable that reads the tensor")


def _same_values(a, b) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.device == b.device
            and bool(torch.equal(a.detach(), b.detach())))


def _call(q, k, v, tensors, spec, scale, q_offset, kv_offset, grads=()):
    from .engine import _Call
    q_offset, kv_offset = _offsets(spec, tensors, q_offset, kv_offset)
    mask, score, backend, block, check = unflatten(spec, tensors, grads)
    return _Call(q, k, v, mask, score, scale, q_offset, kv_offset, backend, block, check)


def _state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("keyfold::attend", mutates_args=())
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor], spec: str,
            scale: float | None, q_offset: int, kv_offset: int,
            grad_tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    # grad_tensors: the tensors a score modifier (passed by reference) reads that need gradients;
    # inputs only so that autograd routes their gradients to the backward (the modifier reads them)
    from ._callables import reading
    from .engine import Backend, _reference
    _check_stale(spec, tensors)
    with reading(_stand_ins(spec, tensors, grad_tensors)):
        call = _call(q, k, v, tensors, spec, scale, q_offset, kv_offset, [g.detach() for g in grad_tensors])
        with torch.no_grad():
            st = (_reference.attend_reference(q, k, v, call.pb) if call.backend is Backend.REFERENCE
                  else call.forward(q, k, v))
    shift = lse_shift_of(call.pb.score)  # a huge row's shift of a dense float mask: lse gets it back
    if shift is not None:
        from .engine import with_lse_shift
        st = with_lse_shift(st, shift)
    # contiguous, as the fake ones say; a custom op's outputs may not alias its inputs or each other
    out, lse = st.out.contiguous(), st.lse.contiguous()
    return (out.clone() if out._base is not None else out), (lse.clone() if lse._base is not None else lse)


@_attend.register_fake
def _(q, k, v, tensors, spec, scale, q_offset, kv_offset, grad_tensors):
    B, Hq, Nq, _ = q.shape
    dt = _state_dtype(q.dtype)
    return q.new_empty((B, Hq, Nq, v.shape[-1]), dtype=dt), q.new_empty((B, Hq, Nq), dtype=dt)


def _reference_backward(q, k, v, dout, dlse, call):
    """``(dq, dk, dv, d_score_tensors)`` by autograd through the float64-capable reference forward."""
    from .engine import _reference
    with torch.enable_grad():
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        st = _reference.attend_reference(*qkv, call.pb)
        outs, grads = (st.out, st.lse), (dout.to(st.out.dtype), None if dlse is None else dlse.to(st.lse.dtype))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        wrt = [*qkv, *call.score_tensors]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    got = [torch.zeros_like(t) if d is None else d for t, d in zip(wrt, got)]
    return (*got[:3], tuple(got[3:]))


@torch.library.custom_op("keyfold::attend_backward", mutates_args=())
def _attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     dout: torch.Tensor, dlse: torch.Tensor | None, tensors: list[torch.Tensor], spec: str,
                     scale: float | None, q_offset: int, kv_offset: int, grad_tensors: list[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    from ._callables import reading
    from .engine import Backend
    if dlse is not None and q.device.type == "cpu" and not bool(dlse.any()):
        dlse = None
    # a non-additive score's backward takes autograd of the score tile (built with grad mode on when the
    # score's tensors need gradients: the call finds them then)
    with _autograd_dispatch(), reading(_stand_ins(spec, tensors, grad_tensors)):
        with torch.set_grad_enabled(bool(grad_tensors)):  # (a dense float mask's slot: a leaf of its own)
            call = _call(q, k, v, tensors, spec, scale, q_offset, kv_offset,
                         [g.detach().requires_grad_() for g in grad_tensors])
        if len(call.score_tensors) != len(grad_tensors):
            raise RuntimeError(f"keyfold::attend_backward: the score modifier reads {len(call.score_tensors)} tensor(s) "
                               f"with requires_grad here and {len(grad_tensors)} when traced; build it outside the "
                               f"compiled function and do not change which of its tensors require grad")
        if call.backend is Backend.REFERENCE:  # the reference's backward is autograd through its own forward
            dq, dk, dv, dts = _reference_backward(q, k, v, dout, dlse, call)
        else:
            shift = lse_shift_of(call.pb.score)  # the forward gave lse the shift; the bias has it again
            if shift is not None:
                from .engine import unshifted_lse
                lse = unshifted_lse(q, k, v, call, lse, shift)
            dq, dk, dv, dts = call.backward(q, k, v, out, lse, dout, dlse)
    # a custom op returns tensors: zeros for a tensor the callable never read (eager gives it None)
    dts = [torch.zeros_like(t) if d is None else d.to(t.dtype).contiguous() for d, t in zip(dts, grad_tensors)]
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dts


@_attend_backward.register_fake
def _(q, k, v, out, lse, dout, dlse, tensors, spec, scale, q_offset, kv_offset, grad_tensors):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),  # contiguous, as the real ones
            [t.new_empty(t.shape) for t in grad_tensors])


def _setup_context(ctx, inputs, output):
    q, k, v, tensors, spec, scale, q_offset, kv_offset, grad_tensors = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *tensors, *grad_tensors)
    ctx.n_tensors = len(tensors)
    ctx.args = (spec, scale, q_offset, kv_offset)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    tensors, grad_tensors = rest[:ctx.n_tensors], rest[ctx.n_tensors:]
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dts = _attend_backward(q, k, v, out, lse, dout.contiguous(), dlse, tensors, *ctx.args, grad_tensors)
    return dq, dk, dv, [None] * len(tensors), None, None, None, None, list(dts)


_attend.register_autograd(_backward, setup_context=_setup_context)


def attend_op(q, k, v, *, mask, score, scale, q_offset, kv_offset, backend, block_size, check_inputs=False) -> State:
    """:func:`keyfold.attend` through the custom op (what it calls while dynamo traces)."""
    if isinstance(mask, torch.Tensor):  # SDPA's attn_mask, relative to this call (as _Call converts it)
        if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor):
            raise NotImplementedError("keyfold under torch.compile: a dense tensor mask is indexed relative to the "
                                      "call, so q_offset / kv_offset must be ints with it, not tensors; pass a "
                                      "mask object (causal(), window(), padding(...)), which sees absolute positions")
        B, Hq, Nq, _ = q.shape
        Nk = k.shape[2]
        mask, bias = tensor_mask(mask, B=B, H=Hq, Nq=Nq, Nk=Nk, q_offset=kv_offset + Nk - Nq if q_offset is None
                                 else q_offset, kv_offset=kv_offset)
        if bias is not None:
            score = [score, bias]
    score_obj = S.as_score(score)
    grad_tensors = []
    if score_obj is not None and torch.is_grad_enabled():
        grad_tensors = [t for t in score_obj.tensors() if t.requires_grad]
    spec, tensors = flatten(mask, score_obj, backend, block_size, check_inputs, grad_tensors)
    if any(t is x for t in grad_tensors for x in tensors):
        # a preset's tensors travel as detached data (presets keep read-only copies today): refuse, never drop
        raise NotImplementedError(
            "keyfold under torch.compile gives gradients to the tensors a score callable reads, not to those a "
            "preset holds as data: write the modifier as a score_mod callable, or freeze those tensors")
    if q_offset is None:  # as the eager call: bottom-right, or 0 for packed queries (varlen)
        m = None if isinstance(mask, torch.Tensor) else M.as_mask(mask)
        q_offset = 0 if m is not None and m.packed_queries else kv_offset + (k.shape[2] - q.shape[2])
    # an offset given as a tensor (a static cache's position) travels as data: no recompile per step
    mask_obj = M.as_mask(mask) if not isinstance(mask, torch.Tensor) else None
    slots = _reads_slots(mask_obj, score_obj, tensors, grad_tensors) + _stale_slot(mask_obj, score_obj, tensors)
    if isinstance(q_offset, torch.Tensor):
        slots += ',"qoff":' + _slot(q_offset.reshape(()), tensors)
        q_offset = 0
    if isinstance(kv_offset, torch.Tensor):
        slots += ',"kvoff":' + _slot(kv_offset.reshape(()), tensors)
        kv_offset = 0
    spec = spec[:-1] + slots + "}"
    out, lse = _attend(q, k, v, tensors, spec, None if scale is None else float(scale), q_offset, kv_offset,
                       grad_tensors)
    return State(out, lse)
