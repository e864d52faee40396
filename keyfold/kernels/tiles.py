"""Tile-by-tile attention in torch ops: any score modifier, any device.

Each piece materialises only its own (L x S) tile of scores; the planner bounds S.
Forward returns one State per call; backward uses the global (out, lse) (docs/math.md).
"""

from __future__ import annotations

import contextlib

import torch

from ..planner import Plan
from ..state import State, empty_state, merge_into, state_dtype
from ._common import NEG_INF, Problem, dropout_keep, group_matmul, positions, row_divisor, softcap_cap, visible

__all__ = ["forward", "backward", "backward_with_score", "row_sums"]


#: The most elements of a tensor a score callable reads that :class:`_Widened` gives it as a float64
#: copy in the backward. A table whose every entry gathers many pairs (relative positions, a per-head
#: bias, ALiBi's slopes) is small, and its gradient sums that many dS; a tensor as large as the pairs
#: (a dense pair bias, a module's weights) gathers few a entry, and a float64 copy and gradient of it
#: per tile cost 1.3-1.5x the backward's time and 0.7 GB at 2k rows (a review, 2026-12-07).
WIDE_TENSOR = 1 << 16


def _proxy(t: torch.Tensor) -> torch.Tensor:
    """A score tensor's stand-in in the backward (:class:`_Widened`): a float64 copy (complex128 for a
    complex tensor: ``double()`` dropped its imaginary part, and the gradient with it) where it has at
    most :data:`WIDE_TENSOR` elements, else a detached alias; a leaf either way, outside ``t``'s graph."""
    d = t.detach()
    if d.numel() <= WIDE_TENSOR:
        d = d.to(torch.complex128 if d.is_complex() else torch.float64)
    return d.requires_grad_()


class _Proxies(dict):
    """``{id(t): stand-in}`` (:func:`_proxy`) for the score tensors ``originals``, made before any callable
    runs: inside a callable's vmap they could not be. ``values``: ``{id(t): the forward's values}`` of
    those changed in place since the forward, which their stand-ins take instead."""

    def __init__(self, originals, values=None):
        self.values = values or {}
        super().__init__((id(t), _proxy(self.values.get(id(t), t))) for t in originals)
        self.originals = tuple(originals)

    def narrow(self) -> bool:
        """Make every stand-in a detached alias in its tensor's own dtype; whether any was a widened
        copy. For callables whose ops need equal dtypes (``F.linear``, ``torch.lerp``, a matmul with a
        float32 tensor they make), which raise on a float64 stand-in beside them."""
        widened = False
        for t in self.originals:
            if self[id(t)].dtype != t.dtype:
                self[id(t)] = self.values.get(id(t), t).detach().requires_grad_()
                widened = True
        return widened


def _ancestors(score_tensors) -> list[set]:
    """For each score tensor, the indices of the other score tensors it was made from through autograd
    (``u = rel.view(...)``, ``u = rel * w``): the tensors whose gradient taken in a tile also holds the
    share of ``u``'s reads (see :func:`backward_with_score`)."""
    index = {id(t): i for i, t in enumerate(score_tensors)}
    # a tensor is its node and which of the node's outputs it is: chunk, unbind and split give several
    # tensors one node (keyed by the node alone, the last sibling stood for all: 74% off, silently)
    edges = {(t.grad_fn, t.output_nr): i for i, t in enumerate(score_tensors) if t.grad_fn is not None}
    found = []
    for j, t in enumerate(score_tensors):
        anc: set = set()
        stack = [t.grad_fn] if t.grad_fn is not None else []
        seen = set(stack)
        while stack:
            fn = stack.pop()
            var = getattr(fn, "variable", None)  # a leaf's AccumulateGrad
            if var is not None and id(var) in index and index[id(var)] != j:
                anc.add(index[id(var)])
            for nxt, nr in fn.next_functions:
                if nxt is None:
                    continue
                i = edges.get((nxt, nr))
                if i is not None and i != j:
                    anc.add(i)
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        found.append(anc)
    return found


def _own_shares(shares: list, score_tensors) -> list:
    """The gradients taken with respect to the score tensors themselves (``shares``, summed over the
    tiles), less what reached each through another score tensor made from it. The gradient with respect
    to ``rel`` holds the reads of ``u = rel.view(...)`` too; ``u``'s own share goes back to autograd as
    ``u``'s gradient and reaches ``rel`` through ``u``'s graph once more: ``rel.grad`` came out twice the
    true one. Taken off here, from the tensors made last to the first (each one's share is its own
    before it is passed on), with autograd through the tensors' own graph."""
    anc = _ancestors(score_tensors)
    left = [j for j in range(len(score_tensors)) if anc[j]]
    while left:  # a tensor goes when no tensor left was made from it
        j = next(j for j in left if not any(j in anc[i] for i in left if i != j))
        left.remove(j)
        if shares[j] is None:
            continue
        src = sorted(anc[j])
        back = torch.autograd.grad(score_tensors[j], [score_tensors[i] for i in src], shares[j],
                                   retain_graph=True, allow_unused=True)
        for i, b in zip(src, back):
            if b is not None and shares[i] is not None:
                shares[i] = shares[i] - b
    return shares


class _Widened(torch.overrides.TorchFunctionMode):
    """Inside it, torch functions see each score tensor that trains as its proxy (``proxies``, ``{id(t):
    proxy}``, :func:`_proxy`): autograd then sums a small tensor's gradient over a tile's pairs in float64,
    and the backward takes each tensor's gradient with respect to its proxy (:func:`backward_with_score`),
    outside the graph of the tensors themselves: a tensor made from another score tensor (``u =
    rel.view(...)``, both listed) gets the gradient of its own reads and autograd passes it on to ``rel``
    once (taken with respect to ``rel`` itself, it reached ``rel`` twice, or raised on a freed graph).
    Arguments are looked at one list or tuple deep."""

    def __init__(self, proxies: dict):
        super().__init__()
        self.proxies = proxies

    def _swap(self, x):
        if isinstance(x, torch.Tensor):
            return self.proxies.get(id(x), x)
        if isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) and id(y) in self.proxies for y in x):
            return type(x)(self._swap(y) for y in x)
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = tuple(self._swap(a) for a in args)
        if kwargs:
            kwargs = {n: self._swap(a) for n, a in kwargs.items()}
        return func(*args, **(kwargs or {}))


def _scores(qp_, kp_, pb: Problem):
    """Scaled raw scores ``scale * q·k`` of one piece: ``(B, Hq, L, S)``."""
    B, Hq, L, D = qp_.shape
    Hkv, S = kp_.shape[1], kp_.shape[2]
    g = Hq // Hkv
    raw = group_matmul(qp_.reshape(B, Hkv, g, L, D), kp_, transpose=True).mul_(pb.scale)  # (B,Hkv,g,L,S)
    raw = raw.reshape(B, Hq, L, S)
    return raw


def _modify(raw, pb: Problem, pos, vis):
    s = pb.score.apply(raw, *pos) if pb.score is not None else raw
    if vis is not None:
        s = s.masked_fill(~vis, NEG_INF)
    return s


def _widened_modify(raw, pb: Problem, pos, vis, proxies: _Proxies):
    """:func:`_modify` with the score tensors read as their stand-ins (:class:`_Widened`). A callable
    whose op refuses a float64 stand-in beside its own tensors (dtypes that must match) gets them in
    their own dtypes from then on, for the rest of the call (``proxies`` changed in place)."""
    try:
        with _Widened(proxies):
            return _modify(raw, pb, pos, vis)
    except (RuntimeError, TypeError):
        if not proxies.narrow():
            raise
    with _Widened(proxies):
        return _modify(raw, pb, pos, vis)


def _visible_cached(q, piece, pb: Problem, plan: Plan):
    """The piece's bool tile, kept in the plan's tile cache between calls."""
    key = ("visible", piece, q.shape[0], q.shape[1], q.device)
    vis = plan.tiles.get(key)
    if vis is None:
        vis = visible(q, piece, pb)
        if vis is not None:
            plan.tiles.put(key, vis, vis.numel())
    return vis


def _separable(piece, pb: Problem, device, dtype):
    """``(row, key)`` terms of an additive bias on this piece (ALiBi with every key on one side
    of every query) in ``dtype``, or None: then the bias is applied whole."""
    if pb.score is None or not pb.score.additive:
        return None
    qa, ka = pb.q_offset + piece.q0, pb.kv_offset + piece.k0
    sep = pb.score.separable(qa, pb.q_offset + piece.q1, ka, pb.kv_offset + piece.k1, device)
    return None if sep is None else (sep[0].to(dtype), sep[1].to(dtype))


def _keep(q, piece, pb: Problem, pos):
    """Dropout's keep tile ``(B, Hq, L, S)`` for this piece (regenerated, never stored), or None."""
    if not pb.dropout_p:
        return None
    b, h, qp, kp = pos if pos is not None else positions(q, piece, pb)
    return dropout_keep(pb.dropout_seed, pb.dropout_p, b, h, qp, kp, q.shape[1])


def _bounds_cached(q, piece, pb: Problem, plan: Plan, dtype):
    """The piece's mask as two float tiles for ``clamp_max_`` (cached like :func:`_visible_cached`),
    or None when every pair is visible: ``hide`` is +inf where visible and -inf where hidden (the
    scores before the row max), ``zero`` is +inf and 0 (the probabilities after exp). A clamp
    against a float tile runs ~4x faster than ``masked_fill_`` with a broadcast bool tile on a CPU
    (measured: 0.9 ms against 3.8 ms on a (1, 4, 1024, 1024) float32 tile)."""
    key = ("bounds", piece, q.shape[0], q.shape[1], q.device, dtype)
    bounds = plan.tiles.get(key)
    if bounds is None:
        vis = _visible_cached(q, piece, pb, plan)
        if vis is None:
            return None
        inf = torch.tensor(float("inf"), dtype=dtype, device=q.device)
        bounds = (torch.where(vis, inf, -inf), torch.where(vis, inf, torch.zeros((), dtype=dtype, device=q.device)))
        plan.tiles.put(key, bounds, 2 * bounds[0].numel() * bounds[0].element_size())
    return bounds


#: The largest cap that takes the sigmoid form of :func:`_softcap_`. Its absolute score error,
#: ~cap * 2^-24, must stay far below the rounding of a 16-bit score of size 1 (2^-11 for float16):
#: at cap 1e6 it was 0.06, and float16 softcap broke the correctness rule 90-fold (0.106 against the
#: plain implementation's 0.0012), with no error raised. Larger caps take torch.tanh.
SIGMOID_CAP_MAX = 256.0


def _sigmoid_softcap(q, pb: Problem) -> float | None:
    """The cap when the score is exactly ``softcap(cap)`` with ``cap <= SIGMOID_CAP_MAX`` on 16-bit CPU
    inputs: there the scores take the sigmoid form of :func:`_softcap_`; None otherwise
    (``score.apply_``, with torch.tanh)."""
    if not q.is_cpu or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    cap = softcap_cap(pb)
    return cap if cap is not None and cap <= SIGMOID_CAP_MAX else None


def _softcap_(raw, cap: float):
    """``cap * tanh(raw / cap)`` as ``cap * (2 sigmoid(2 raw / cap) - 1)``, in place: a CPU's vector
    sigmoid runs ~5x faster than its tanh (measured: 0.52 ms against 2.65 ms on 1M float32). Near 0 the
    subtraction leaves an absolute error of ~cap * 2^-24 in the score, far below the rounding of
    16-bit scores (2^-9 relative for bfloat16) that the correctness rule's naive implementation has
    for caps up to :data:`SIGMOID_CAP_MAX`, so only 16-bit inputs with such caps take this form. Forward and backward both compute P from it, so a row with
    one key gets P = 1 exactly."""
    return raw.mul_(2.0 / cap).sigmoid_().mul_(2.0 * cap).sub_(cap)


#: Floor of ``s - max`` before exp: the lowest argument whose exp is a normal number. PyTorch's CPU exp
#: leaves its vector path for arguments whose result is subnormal or 0 (measured: -inf ~5x, -110 ~15x,
#: -90 ~50x slower per element than -87), which every hidden pair and every far-below-max score would
#: hit. A pair floored here gets P = exp(floor) (< 2^-125 of the row's largest P, itself 1) instead of a
#: smaller one, below the float's resolution of the sum; hidden pairs are set to 0 exactly after exp.
_EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}


def forward(q, k, v, plan: Plan, pb: Problem, lse_exact: bool = True, wide_lse: bool = False) -> State:
    """Scores, softmax and ``P @ V`` in float32 (float64 for float64) for every input dtype, tile
    by tile; q, k and v are cast once per call, not per piece (neighbouring pieces share keys).

    lse_exact: lse is computed with the same ``torch.exp`` a backward recomputes P with (``exp(s - lse)``
    then sums to 1 to rounding). False when no backward and no caller will see lse (``attention``
    without ``return_lse`` or autograd): the softmax runs through ``torch.softmax``, faster.
    wide_lse: lse in float64 (float32 and 16-bit inputs; float64's is anyway), ``m + log(sum)`` summed
    there (see :func:`keyfold.kernels.cpu.forward`), and for float32 inputs the scores, the score
    modifier and the row max in float64 (exact scores, as the decode kernel's for the states keyfold
    merges: float32 scores rounded apart from the naive's broke the 2x rule, softcap window caches in
    23 of 300 decodes, up to 1.7x), weights ``exp(s - m)`` rounded to float32 once. That costs: a float32
    softcap decode over 8k keys split in 2-4, or a window cache's, took 3-4x the time of float32 scores."""
    sd = state_dtype(q.dtype)
    ld = torch.float64 if wide_lse else sd  # lse's dtype (float64 inputs: float64 anyway)
    # the scores' dtype: float64 for float32 inputs under wide_lse (16-bit ones' naive attention rounds
    # its scores to 16 bits, far above float32's sums: their scores stay float32, 3x faster)
    cd = torch.float64 if wide_lse and q.dtype is torch.float32 else sd
    B, Hq, Nq, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    g = Hq // Hkv
    acc = empty_state(B, Hq, Nq, Dv, dtype=sd, device=q.device)
    if ld is not sd:
        acc = State(acc.out, acc.lse.to(ld))
    floor = _EXP_FLOOR[sd]
    cap = _sigmoid_softcap(q, pb)
    q, k, v = q.to(sd), k.to(sd), v.to(sd)
    for piece in plan.pieces:
        bounds = _bounds_cached(q, piece, pb, plan, cd)
        zero = None if bounds is None or cd is sd else _bounds_cached(q, piece, pb, plan, sd)[1]
        pos = positions(q, piece, pb) if pb.score is not None or pb.dropout_p else None
        vs = v[:, :, piece.k0:piece.k1]
        s = _scores(q[:, :, piece.q0:piece.q1].to(cd), k[:, :, piece.k0:piece.k1].to(cd), pb)  # (B, Hq, L, S)
        sep = _separable(piece, pb, q.device, cd)
        if sep is not None:  # key term into the scores, row term into lse (exact far from the keys)
            s = s.add_(sep[1])
        elif cap is not None:
            s = _softcap_(s, cap)
        elif pb.score is not None:
            s = pb.score.apply_(s, *pos)
        if bounds is not None:
            s = s.clamp_max_(bounds[0])
        m = s.amax(-1, keepdim=True)                                         # (B, Hq, L, 1)
        if bounds is not None and bool(torch.isnan(m).any()):
            # clamp_max keeps a NaN a NaN: hide the pairs again the exact way, so a score that is NaN
            # only where the mask hides it (a callable's log(0) there) leaves no trace, as masked_fill
            s = s.masked_fill_(~_visible_cached(q, piece, pb, plan), NEG_INF)
            m = s.amax(-1, keepdim=True)
        empty = torch.isneginf(m)  # no visible key, or a score of -inf at every one (a callable's own mask)
        keep = _keep(q, piece, pb, pos)
        if lse_exact or keep is not None or cd is not sd:
            m = m.masked_fill(empty, 0.0)
            p = s.sub_(m).clamp_min_(floor).to(sd).exp_()  # (exact scores: s - m rounded once)
            if bounds is not None:
                p = p.clamp_max_(bounds[1] if zero is None else zero)         # hidden pairs: exactly 0
            total = p.sum(-1, keepdim=True).masked_fill_(empty, 0.0)         # (B, Hq, L, 1)
            lse = m.to(ld) + total.to(ld).log()                              # -inf where total = 0
            if keep is not None:  # SDPA's dropout: drop probabilities after softmax; lse is unchanged
                p = p.masked_fill_(~keep, 0.0)
                total = total * (1.0 - pb.dropout_p)                         # kept ones scale by 1/(1-p)
            total = row_divisor(total)
        else:
            # torch.softmax keeps each row in cache and its exp fast for every argument: ~1.6x faster
            # than the exp pass above. lse, read from P at the row max (exp(m - lse)), is as accurate,
            # but a backward's torch.exp(s - lse) would sum to 1 only to ~1e-7 (a captured table's
            # gradient sums that over thousands of pairs), so only calls whose lse nobody sees take it.
            p = torch.softmax(s, -1)                                         # empty rows: NaN, zeroed below
            lse = (m.to(ld) - p.amax(-1, keepdim=True).to(ld).log()).masked_fill_(empty, NEG_INF)
            total = None
        lse = lse.squeeze(-1)
        if sep is not None:
            lse = lse + sep[0]
        L, S = p.shape[-2:]
        out = group_matmul(p.reshape(B, Hkv, g, L, S), vs).reshape(B, Hq, L, Dv)
        out = (out.div_(total) if total is not None else out).masked_fill_(empty, 0.0)
        rows = slice(piece.q0, piece.q1)
        merge_into(State(acc.out[:, :, rows], acc.lse[:, :, rows]), State(out, lse))
    return acc


def backward(q, k, v, out, lse, dout, dlse, plan: Plan, pb: Problem, whole_rows: bool = True, sums=None):
    """Gradients of every piece from the global ``out``/``lse`` (and ``dlse``), summed.

    whole_rows: these keys are all the keys the rows see (the engine's own backward). False
    for a piece of a larger computation (``attend_backward``): a row's D_i must then come
    from the global ``out``, as the pieces outside this call also contribute to it, unless
    ``sums`` gives the row's totals (see :func:`row_sums`)."""
    return backward_with_score(q, k, v, out, lse, dout, dlse, plan, pb, (), whole_rows, sums)[:3]


def _piece_terms(q, k, v, dout, safe_lse, plan: Plan, pb: Problem, alone, need_grad: bool, cap, pieces=None,
                 proxies=None):
    """Per piece of the plan: ``(piece, raw, s, p, dp, z)`` with p = exp(s - lse) (or, on rows
    ``alone`` marks, exp(s - row max)) and dp = dO V^T (times dropout's z, which is None
    without dropout). :func:`row_sums` and the backward both take P and dP from here, so a
    sum of the one matches the other's terms bit for bit (the same tiles, the same ops). q, k, v, dout:
    already in the state dtype; cap: :func:`_sigmoid_softcap` of the caller's q."""
    B, Hq, Nq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    g = Hq // Hkv
    sd = q.dtype
    nonadd = pb.score is not None and not pb.score.additive
    for piece in plan.pieces if pieces is None else pieces:
        vis = _visible_cached(q, piece, pb, plan)
        pos = positions(q, piece, pb) if pb.score is not None or pb.dropout_p else None
        rows, keys = slice(piece.q0, piece.q1), slice(piece.k0, piece.k1)
        qs, ks, vs = q[:, :, rows], k[:, :, keys], v[:, :, keys]
        do = dout[:, :, rows]
        L, S = piece.q1 - piece.q0, piece.k1 - piece.k0
        sep = None if nonadd else _separable(piece, pb, q.device, sd)
        lse_p = safe_lse[:, :, rows] - sep[0] if sep is not None else safe_lse[:, :, rows]
        own = alone[rows].to(q.device)
        if need_grad:  # s keeps its graph to raw and the score's tensors; P from a detached copy
            with torch.enable_grad():
                raw = _scores(qs, ks, pb)
                if nonadd:
                    raw.requires_grad_(True)
                if sep is not None:  # as in forward: the row term stays in lse
                    s = raw + sep[1]
                    s = s.masked_fill(~vis, NEG_INF) if vis is not None else s
                elif proxies:
                    s = _widened_modify(raw, pb, pos, vis, proxies)
                else:
                    s = _modify(raw, pb, pos, vis)
            s_p = s.detach().to(sd)  # (a callable reading float64 stand-ins gives float64 scores)
            if cap is not None:  # P from the scores the forward used (its sigmoid form); dS/draw from apply above
                s_p = _softcap_(raw.detach().clone(), cap)
                s_p = s_p.masked_fill_(~vis, NEG_INF) if vis is not None else s_p
        else:  # the same values, in place, hidden pairs cut by clamp_max against the cached tile (NaN aside);
            # outside autograd even under create_graph (P is not differentiated again: only v is, through dP)
            with torch.no_grad():
                raw = _scores(qs, ks, pb)
                if cap is not None:
                    s_p = _softcap_(raw, cap)
                elif sep is not None:
                    s_p = raw.add_(sep[1])
                else:
                    s_p = pb.score.apply(raw, *pos) if pb.score is not None else raw
                bounds = _bounds_cached(q, piece, pb, plan, sd) if vis is not None else None
                if bounds is not None:
                    s_p = s_p.clamp_max_(bounds[0])
                    # clamp_max keeps a NaN a NaN: a score that is NaN only where the mask hides the pair must
                    # leave no trace, as in forward (NaN gradients through ring attention, a review 2026-12-07);
                    # the row maxima show one for the cost of a reduction
                    if bool(torch.isnan(s_p.amax(-1)).any()):
                        s_p = s_p.masked_fill_(~vis, NEG_INF)
            raw = s = None  # nobody differentiates them
        base = lse_p.unsqueeze(-1)
        if bool(own.any()):  # rows one piece covers: P as the naive softmax takes it, in the backward
            m = s_p.amax(-1, keepdim=True)
            base = torch.where(own.unsqueeze(-1), torch.where(torch.isfinite(m), m, torch.zeros_like(m)), base)
        if need_grad:
            p = torch.exp(s_p - base)                                        # (B, Hq, L, S)
        else:
            with torch.no_grad():  # (s_p is a view made there)
                p = s_p.sub_(base).exp_()
        dp = (do.reshape(B, Hkv, g, L, Dv) @ vs.unsqueeze(2).transpose(-1, -2)).reshape(B, Hq, L, S)
        keep = _keep(q, piece, pb, pos)
        z = None
        if keep is not None:  # out = (P * Z) V with Z = keep / (1 - p): dP = Z * dO V^T, dV = (P Z)^T dO
            z = keep.to(sd) / (1.0 - pb.dropout_p)
            dp = dp * z
        # with the stand-ins s was made from: a later tile's _widened_modify may narrow them while a band holds
        # this one (its scores' gradient asked of the new ones came back None: that share lost, silently)
        yield piece, raw, s, p, dp, z, own, vis, (dict(proxies) if proxies else None)
        del raw, s, s_p, p, dp, z  # the next piece's tiles are made without this one's beside them


#: what :func:`row_sums` gives per row, in this order
ROW_SUMS = ("sum P", "sum P dP", "keys with P > 0")


def row_sums(q, k, v, lse, dout, plan: Plan, pb: Problem, pieces=None) -> torch.Tensor:
    """``(3, B, Hq, Nq)`` float64: each row's sums over this call's keys of P = exp(s - lse), of
    P dP (dP = dO V^T) and of sign(P) (its keys with P > 0), with P and dP exactly as
    :func:`backward` takes them (:data:`ROW_SUMS`).

    A row whose keys lie in several calls (ring attention's shards) sums these over the calls and
    hands the totals to each call's backward (``sums``): P is then renormalised to sum to 1 over
    the row and D_i = sum P dP, as one softmax's backward takes them, and a row whose P is one key's
    gets P = 1 and D_i = dP there exactly (dq = dk = 0). With D_i = dO . O and the forward's float32
    lse instead, P is off by lse's rounding (up to 2^-24 |lse| relative) and D_i by another summation
    order: a row with one key got dq, dk of 1e-6 to 3e-5 where they are exactly 0, and gradients up
    to 2.1x the correctness rule's allowance (a review, 2026-12-07). Each tile's sums are float32
    (as the naive backward's D_i), the pieces' are added in float64. pieces: those of the plan to
    sum (default all; rows no piece given touches get zeros)."""
    sd = state_dtype(q.dtype)
    return _row_sums(q.to(sd), k.to(sd), v.to(sd), dout.to(sd), _safe_lse(lse, sd), plan, pb, pieces,
                     _sigmoid_softcap(q, pb))


def _safe_lse(lse, sd):
    """lse with -inf (rows that see no key) as 0, in ``sd``: every P of such a row is 0 anyway."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(sd)


def _row_sums(qd, kd, vd, dd, safe_lse, plan: Plan, pb: Problem, pieces, cap, values=None) -> torch.Tensor:
    """:func:`row_sums` on inputs already in the state dtype (the backward's own casts); ``values``: as in
    :class:`_Proxies`, read in place of those tensors (in their own dtypes)."""
    B, Hq, Nq, _ = qd.shape
    out = torch.zeros(3, B, Hq, Nq, dtype=torch.float64, device=qd.device)
    alone = torch.zeros(Nq, dtype=torch.bool)
    with _Widened(values) if values else contextlib.nullcontext():
        for piece, _, _, p, dp, _, _, _, _ in _piece_terms(qd, kd, vd, dd, safe_lse, plan, pb, alone, False, cap,
                                                           pieces):
            _add_row_sums(out[:, :, :, piece.q0:piece.q1], p, dp)
            del p, dp
    return out


def _from_totals(tot, sd):
    """``(divisor, delta, single)`` of rows with these totals (``(3, ...)`` float64): P's divisor, D_i =
    sum P dP / sum P, and whether P is 1 at one key and 0 elsewhere (D_i is then that key's dP)."""
    total = row_divisor(tot[0])
    return total.to(sd), (tot[1] / total).to(sd), tot[2] == 1


def _add_row_sums(acc, p, dp) -> None:
    """Add a tile's row sums of P, P dP and sign(P) to ``acc`` ``(3, B, Hq, L)`` float64 (a view)."""
    acc[0] += p.sum(-1)
    acc[1] += torch.linalg.vecdot(p, dp)
    acc[2] += torch.sign(p).sum(-1)  # a count: 5x faster than count_nonzero


#: A row band whose rows several pieces cover runs in one pass when its pieces' P and dP tiles together
#: take at most this: held whole, its rows' totals come from them before their gradients. Past it the
#: band's pieces are computed twice (a pass for the totals first). A constant, never a function of N.
BAND_BYTES = 32 << 20


def _row_bands(pieces) -> list[list]:
    """The pieces grouped by their row band (q0, q1), in the order the bands first appear."""
    bands: dict = {}
    for pc in pieces:
        bands.setdefault((pc.q0, pc.q1), []).append(pc)
    return list(bands.values())


def backward_with_score(q, k, v, out, lse, dout, dlse, plan: Plan, pb: Problem, score_tensors=(),
                        whole_rows: bool = True, sums=None, values=None):
    """``(dq, dk, dv, dts)``: as :func:`backward`, plus the gradients of ``score_tensors`` (tensors
    the score modifier reads, see ``ScoreMod.tensors``), one per tensor (None if unused), by
    autograd of ``score.apply`` on each tile, ``grad(s, [raw, *tensors], dS)``, summed over pieces.

    sums: ``(3, B, Hq, Nq)`` float64 totals of :func:`row_sums` over all of each row's keys (this
    call's and others'), or None: P is divided by the first and D_i is the second over the first."""
    sd = state_dtype(q.dtype)
    B, Hq, Nq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    g = Hq // Hkv
    dq = torch.zeros(q.shape, dtype=sd, device=q.device)
    dk = torch.zeros(k.shape, dtype=sd, device=q.device)
    dv = torch.zeros(v.shape, dtype=sd, device=q.device)
    dts: list = [None] * len(score_tensors)
    # The score callable reads each small such tensor as a float64 copy (_Widened), so autograd sums its
    # gradient over a tile's pairs in float64 and the tiles' sums in float64, rounded to its dtype once at
    # the end: a relative-position table's far bin gathers most pairs of every row, and float32 sums of
    # its dS in the tiles' order went to 1.8-2.6x the 3x rule's allowance (the naive's one float32
    # scatter is as inexact, in its own order); in float64, 0.002-0.14x
    proxies = _Proxies(score_tensors, values)  # (values: the forward's, of tensors changed in place since)
    # gradients with respect to the tensors themselves (their reads the mode does not see), summed over
    # the tiles apart from the stand-ins' until the shares that passed through another score tensor are
    # taken off (_own_shares); their graphs stay: a tile's autograd may go through them again, and so may
    # the caller's backward (a tensor made by an op that saves its inputs, u = rel * 1.0, raised on a freed graph)
    direct: list = [None] * len(score_tensors)
    keep_graph = any(t.grad_fn is not None for t in score_tensors)
    safe_lse = _safe_lse(lse, sd)
    nonadd = pb.score is not None and not pb.score.additive
    need_grad = nonadd or bool(score_tensors)
    cap = _sigmoid_softcap(q, pb)
    qd, kd, vd, dd = q.to(sd), k.to(sd), v.to(sd), dout.to(sd)  # once per call, sliced per piece as in forward
    # Rows that one piece covers alone take P and D_i = sum_j P_ij dP_ij from that piece (equal to
    # dO_i . O_i in exact arithmetic, as softmax's own backward computes it): then dS cancels
    # exactly where it should, e.g. a row with one visible key gets dS = 1 * (dP - dP) = 0,
    # while dO . O (a different summation order than the dP product) leaves ~1e-7. Rows that
    # several pieces cover (more keys than TILE_SPAN) take them from the pieces' totals
    # (:func:`row_sums`, a pass over those pieces first), as rows of a larger computation do when
    # their caller gives the totals (``sums``).
    cover = torch.zeros(Nq, dtype=torch.int32)
    for piece in plan.pieces:
        cover[piece.q0:piece.q1] += 1
    renorm = None  # (Nq,) bool: rows that take the totals
    groups = [list(plan.pieces)]  # pieces run in these groups; a banded one sums its rows' totals itself
    banded: set[int] = set()
    if sums is not None:
        renorm = torch.ones(Nq, dtype=torch.bool)
    elif whole_rows and bool((cover > 1).any()):
        # every such row: with the CPU op's forward lse, off by up to 3x float32's rounding at |lse| 13, a
        # renormalisation only past |lse| 16 left 5 of 400 long rows past the rule (3.1x), and a row of one
        # key behind a long band got dq 2e-5 where it is 0 (a review, 2026-12-07); all of them: 0 of 400.
        # A row band whose pieces are all its rows' keys and whose tiles fit BAND_BYTES is held whole and
        # summed as it runs; the others take a pass over their pieces first (~40% of their backward)
        renorm = cover > 1
        groups = _row_bands(plan.pieces)
        # bytes per (row, key) a held band keeps: P and dP, and the scores beside them where autograd needs them
        width = B * Hq * torch.finfo(sd).bits // 8 * (4 if need_grad else 2)
        for i, grp in enumerate(groups):
            q0, q1 = grp[0].q0, grp[0].q1
            if (len(grp) > 1 and bool((cover[q0:q1] == len(grp)).all())
                    and width * (q1 - q0) * sum(pc.k1 - pc.k0 for pc in grp) <= BAND_BYTES):
                banded.add(i)
        shared = [pc for i, grp in enumerate(groups) if i not in banded for pc in grp
                  if bool(renorm[pc.q0:pc.q1].any())]
        with torch.no_grad():  # totals are not differentiated again (under create_graph only v is, via dP)
            sums = (_row_sums(qd, kd, vd, dd, safe_lse, plan, pb, shared, cap, values) if shared
                    else torch.zeros(3, B, Hq, Nq, dtype=torch.float64, device=q.device))
    alone = (cover == 1) & whole_rows & (renorm is None or ~renorm)
    divisor = single = None
    delta = None if renorm is not None and bool(renorm.all()) else (dd * out.to(sd)).sum(-1)  # (B, Hq, Nq)
    if sums is not None:  # the rows' own totals: P renormalised, D_i = sum P dP over the whole row
        keep = renorm.to(q.device)
        divisor, from_sums, single = _from_totals(sums, sd)
        divisor = torch.where(keep, divisor, 1.0)  # other rows: P / 1, unchanged
        delta = from_sums if delta is None else torch.where(keep, from_sums, delta)
        single = single & keep  # D_i = that key's dP, taken below
    # dlse joins dS as its own term, P * dlse, not through D_i: dP - (D_i - dlse) rounds D_i - dlse
    # first, and a row with one key got dS = dlse off by an ulp of dP (dq, dk 5e-6 at |dP| ~ 50)
    dl = None if dlse is None else dlse.to(sd)
    inplace = not torch.is_grad_enabled()
    read = [False]  # whether any tile ran (else every pair was hidden: zeros for every score tensor)

    def _grads_of(term):  # one piece's share of dq, dk, dv and the score tensors' gradients
        piece, raw, s, p, dp, z, own, vis, stand = term
        read[0] = True
        rows, keys = slice(piece.q0, piece.q1), slice(piece.k0, piece.k1)
        qs, ks, do = qd[:, :, rows], kd[:, :, keys], dd[:, :, rows]
        L, S = piece.q1 - piece.q0, piece.k1 - piece.k0
        d_rows = delta[:, :, rows]
        if divisor is not None and bool(renorm[rows].any()):
            p = p.div_(divisor[:, :, rows].unsqueeze(-1)) if inplace else p / divisor[:, :, rows].unsqueeze(-1)
            one = single[:, :, rows]
            if bool(one.any()):  # a sum of one nonzero term is that term: dS = 1 * (dP - dP) = 0 exactly
                d_rows = torch.where(one, (p * dp).sum(-1), d_rows)
        if bool(own.any()):
            # P = exp(s - row max) / its sum on those rows, as the naive softmax takes it by its own
            # scores: exp(s - lse) is off by lse's rounding, a relative error of every P of the row (up
            # to 2^-24 |lse|), which took score callables and softcap past the 3x rule in 6 of 400
            # random float32 calls (dq 3.6-5.5x; small heads, where the naive error is small), none so.
            # Captured tensors that train sum dS over many pairs
            # (a clamped relative-position bin gathers most of each row), so dS must cancel along the
            # row as softmax's own backward makes it, with D_i = sum_j P_ij dP_ij: exp(s - lse) sums to
            # 1 only up to lse's rounding, which the bins add up (local_window's table: 5.7x naive's
            # error with it, 2.8x without); only rows one piece covers can do this. A row with one
            # key has P = 1 exactly: ALiBi's row term taken off lse rounds, and P's excess times dP
            # left dq and dk of 1e-5 where they are 0 (a helper's fuzz)
            if bool(own.all()) and inplace:  # in place: the tile's temporaries are what its memory peak is made of
                p = p.div_(row_divisor(p.sum(-1, keepdim=True)))
                d_rows = torch.linalg.vecdot(p, dp)
            else:
                p = torch.where(own.unsqueeze(-1), p / row_divisor(p.sum(-1, keepdim=True)), p)
                d_rows = torch.where(own, torch.linalg.vecdot(p, dp), d_rows)
        pv = p if z is None else p * z                                       # the probabilities V saw
        if inplace:
            ds = dp.sub_(d_rows.unsqueeze(-1)).mul_(p)                        # P (dP - D_i), dP's tile reused
        else:  # under create_graph dP carries v's graph (a second derivative through v)
            ds = (dp - d_rows.unsqueeze(-1)) * p
        if dl is not None:  # lse_i = log sum_j e^(s_ij): d lse_i / d s_ij = P_ij
            ds = ds.addcmul_(p, dl[:, :, rows].unsqueeze(-1)) if inplace else ds + p * dl[:, :, rows].unsqueeze(-1)
        if score_tensors and s.requires_grad:
            # with respect to the stand-ins, and to the tensors themselves for reads the mode does not see (a
            # user's autograd.Function.apply takes the tensor as it is: its share reaches the tensor alone)
            n = len(score_tensors)
            inputs = ([raw] if nonadd else []) + [stand[id(t)] for t in score_tensors] + list(score_tensors)
            grads = torch.autograd.grad(s, inputs, ds.to(s.dtype), allow_unused=True, retain_graph=keep_graph)
            shares = grads[1:] if nonadd else grads
            for i in range(n):
                for acc, gt in ((dts, shares[i]), (direct, shares[n + i])):
                    if gt is not None:
                        acc[i] = gt if acc[i] is None else acc[i] + gt
            if nonadd:
                ds = grads[0] if grads[0] is not None else torch.zeros_like(ds)
        elif nonadd:
            (ds,) = torch.autograd.grad(s, raw, ds)  # (with score_tensors, s always needs grad through raw)
        if nonadd and vis is not None:  # a modifier's derivative may be non-finite where the mask hides the pair
            ds = torch.where(vis, ds, torch.zeros_like(ds))
        ds5 = ds.reshape(B, Hkv, g, L, S)
        dq[:, :, rows] += (ds5 @ ks.unsqueeze(2)).reshape(B, Hq, L, D) * pb.scale
        dk[:, :, keys] += (ds5.transpose(-1, -2) @ qs.reshape(B, Hkv, g, L, D)).sum(2) * pb.scale
        dv[:, :, keys] += (pv.reshape(B, Hkv, g, L, S).transpose(-1, -2) @ do.reshape(B, Hkv, g, L, Dv)).sum(2)

    for i, grp in enumerate(groups):
        terms = _piece_terms(qd, kd, vd, dd, safe_lse, plan, pb, alone, need_grad, cap, grp, proxies)
        if i in banded:  # the band's tiles held together: its rows' totals from them, then their gradients
            terms = list(terms)
            rows = slice(grp[0].q0, grp[0].q1)
            with torch.no_grad():  # as the totals of a pass before: outside autograd (a review: under
                # create_graph the in-place writes of one band's totals broke the next band's saved view)
                tot = torch.zeros(3, B, Hq, rows.stop - rows.start, dtype=torch.float64, device=q.device)
                for term in terms:
                    _add_row_sums(tot, term[3], term[4])
                divisor[:, :, rows], delta[:, :, rows], single[:, :, rows] = _from_totals(tot, sd)
            del tot
            while terms:  # each piece's tiles let go once its gradients are in
                _grads_of(terms.pop(0))
        else:
            for term in terms:
                _grads_of(term)
                del term  # the generator makes the next piece's tiles without this one's beside them
    if values and any(o is not None and id(t) in values for o, t in zip(direct, score_tensors)):
        raise RuntimeError("keyfold: a tensor the score modifier reads was modified in place between the forward and "
                           "the backward, and the modifier reads it where the backward cannot give it the forward's "
                           "values (a user's autograd.Function.apply): change it after backward(), or pass a copy")
    if any(o is not None for o in direct):
        for i, o in enumerate(_own_shares(direct, score_tensors)):
            if o is not None:
                dts[i] = o if dts[i] is None else dts[i] + o
    # a tensor the callable never read keeps no gradient (None, as autograd leaves it: an optimizer then
    # leaves it be; zeros made AdamW decay it and its moments move it); with no pair visible, every one
    # gets zeros, as SDPA gives a float mask that hides every pair
    return dq, dk, dv, tuple((None if read[0] else torch.zeros_like(t)) if d is None else d.to(t.dtype)
                             for d, t in zip(dts, score_tensors))
