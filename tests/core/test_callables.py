"""Flex-style callables run unchanged and train (#16 items 1, 7, 8, 9).

Mods are modelled on attention-gym's examples and PyTorch's test_flex_attention.py: Graphormer
biases, relative-position tables, ALiBi with a learnable slope, index_multiple / index_weird
chains, an MLA-style RoPE dot product, per-batch lengths, per-head biases, a float64 table.
Gradients of captured tensors are held to the correctness rule against float64 autograd
through Backend.REFERENCE (3x the naive same-dtype implementation's error + 1e-6).
"""

import array
import collections
import dataclasses
import datetime
import decimal
import itertools
import functools
import gc
import logging
import re
import threading
import types
import warnings
import weakref

import numpy as np
import pytest
import torch

import keyfold as kf
from keyfold import Backend, _callables
from keyfold.masks import MaskFn
from tests.helpers import assert_close_by_rule, assert_forward_by_rule, naive_attention

# score callables are not additive: Backend.CPU refuses them and AUTO routes them to the tiles
BACKENDS = [Backend.AUTO, Backend.TILES, Backend.REFERENCE]


def _rand(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _qkv(B, H, N, D=16, seed=0, dtype=torch.float32, Nk=None):
    Nk = N if Nk is None else Nk
    return (_rand(B, H, N, D, seed=seed, dtype=dtype), _rand(B, H, Nk, D, seed=seed + 1, dtype=dtype),
            _rand(B, H, Nk, D, seed=seed + 2, dtype=dtype))


def _run(attn, q, k, v, params, factory, dout, **kw):
    """Forward + backward of ``attn`` with fresh leaf copies of q, k, v and the parameters."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    prm = {n: t.detach().clone().requires_grad_(True) for n, t in params.items()}
    out = attn(q, k, v, score=factory(prm), **kw)
    out.backward(dout.to(out.dtype))
    return out.detach(), {"dq": q.grad, "dk": k.grad, "dv": v.grad, **{"d" + n: t.grad for n, t in prm.items()}}


def assert_score_grads_by_rule(factory, params, backend, *, B=2, H=2, N=40, D=16, mask=None, seed=0):
    """keyfold (float32) vs float64 autograd through REFERENCE vs naive float32, by the rule,
    for the output, dq, dk, dv and every captured parameter's gradient."""
    q, k, v = _qkv(B, H, N, D, seed=seed)
    dout = _rand(B, H, N, D, seed=seed + 7, dtype=torch.float64)
    got, g_got = _run(lambda *a, **kw: kf.attention(*a, backend=backend, **kw), q, k, v, params, factory, dout,
                      mask=mask)
    ref, g_ref = _run(lambda *a, **kw: kf.attention(*a, backend=Backend.REFERENCE, **kw),
                      q.double(), k.double(), v.double(), {n: t.double() for n, t in params.items()}, factory,
                      dout, mask=mask)
    nai, g_nai = _run(lambda *a, **kw: naive_attention(*a, **kw), q, k, v, params, factory, dout, mask=mask)
    assert_close_by_rule(got, ref, nai, None, factor=2.0, what="out")
    for name in g_ref:
        assert g_got[name] is not None, f"{name}: no gradient on {backend}"
        assert not torch.isnan(g_got[name]).any(), f"{name}: NaN"
        assert float(g_ref[name].abs().max()) > 0, f"{name}: the test's reference gradient is 0"
        assert_close_by_rule(g_got[name], g_ref[name], g_nai[name], None, factor=3.0, what=name)


# --------------------------------------------------------------- 1. learnable tensors


def graphormer(p):
    """Graphormer: a learnable bias per (head, shortest-path distance) plus a per-pair edge bias."""
    dist = torch.randint(0, 6, (40, 40), generator=torch.Generator().manual_seed(3))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + p["spatial"][h, dist[q_idx, kv_idx]] + p["edge"][b, h, q_idx, kv_idx]
    return score_mod


def rel_1d(p):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + p["rel"][q_idx - kv_idx + 39]
    return score_mod


def rel_2d(p):
    """Swin-style 2-D relative positions on an 8 x 5 grid of tokens."""
    table = p["rel2d"]

    def score_mod(score, b, h, q_idx, kv_idx):
        dr = q_idx // 5 - kv_idx // 5 + 7
        dc = q_idx % 5 - kv_idx % 5 + 4
        return score + table[h, dr, dc]
    return score_mod


def alibi_learnable(p):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - p["slope"][h] * (q_idx - kv_idx).abs()
    return score_mod


def transposed_bias(p):
    """A (N, N, H) parameter read through a transposed (H, N, N) view: a non-leaf capture."""
    bias = p["base"].permute(2, 0, 1)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]
    return score_mod


PARAM_MODS = {
    "graphormer": (graphormer, lambda: {"spatial": _rand(2, 6, seed=11), "edge": _rand(2, 2, 40, 40, seed=12)}),
    "rel_1d": (rel_1d, lambda: {"rel": _rand(79, seed=13)}),
    "rel_2d": (rel_2d, lambda: {"rel2d": _rand(2, 15, 9, seed=14)}),
    "alibi_slope": (alibi_learnable, lambda: {"slope": _rand(2, seed=15).abs() * 0.3}),
    "transposed_3d": (transposed_bias, lambda: {"base": _rand(40, 40, 2, seed=16)}),
}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("name", list(PARAM_MODS))
def test_captured_tensors_get_gradients(name, backend):
    factory, params = PARAM_MODS[name]
    assert_score_grads_by_rule(factory, params(), backend, mask=kf.causal() if name == "rel_1d" else None)


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES], ids=lambda b: b.name)
def test_gradients_with_a_mask_gqa_and_many_pieces(backend):
    """Pieces of a plan (block_size 16, windowed) each add their share of the table's gradient."""
    rel = {"rel": _rand(79, seed=21)}

    def attn(q, k, v, **kw):
        return kf.attention(q, k[:, :1], v[:, :1], mask=kf.window(12), block_size=16, backend=backend, **kw)

    q, k, v = _qkv(1, 2, 40)
    dout = _rand(1, 2, 40, 16, seed=5, dtype=torch.float64)
    got, g = _run(attn, q, k, v, rel, rel_1d, dout)
    ref, r = _run(lambda q, k, v, **kw: kf.attention(q, k[:, :1], v[:, :1], mask=kf.window(12),
                                                     backend=Backend.REFERENCE, **kw),
                  q.double(), k.double(), v.double(), {"rel": rel["rel"].double()}, rel_1d, dout)
    nai, n = _run(lambda q, k, v, **kw: naive_attention(q, k[:, :1], v[:, :1], mask=kf.window(12), **kw),
                  q, k, v, rel, rel_1d, dout)
    for name in r:
        assert_close_by_rule(g[name], r[name], n[name], None, factor=3.0, what=name)


class _TableBias(kf.ScoreMod):
    """An additive modifier reading a (possibly learnable) (Nq, Nk) table: the fused CPU forward
    takes it as a bias tile; the ``tensors()`` hook gives the table its gradient."""

    additive = True

    def __init__(self, table):
        self.table = table

    def bias(self, b, h, qp, kp):
        return self.table[qp, kp]   # (1, 1, L, S)

    def apply(self, s, b, h, qp, kp):
        return s + self.bias(b, h, qp, kp)

    def tensors(self):
        return (self.table,)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_additive_modifier_with_tensors_gets_gradients(backend):
    assert_score_grads_by_rule(lambda p: _TableBias(p["table"]), {"table": _rand(40, 40, seed=17)}, backend,
                      mask=kf.window(9), N=40)


def test_additive_tiles_follow_in_place_updates():
    """The CPU kernel keeps bias tiles between calls; a table that trains must not go stale."""
    q, k, v = _qkv(1, 2, 40)
    table = torch.zeros(40, 40)
    mod = _TableBias(table)
    kf.attention(q, k, v, score=mod, mask=kf.window(9), backend=Backend.CPU)
    with torch.no_grad():
        table.copy_(_rand(40, 40, seed=18))
    got = kf.attention(q, k, v, score=mod, mask=kf.window(9), backend=Backend.CPU)
    want = kf.attention(q, k, v, score=mod, mask=kf.window(9), backend=Backend.REFERENCE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gradient_without_qkv_grads():
    """Only the table requires grad (q, k, v frozen): it still gets its gradient."""
    q, k, v = _qkv(1, 2, 24)
    rel = torch.zeros(79, requires_grad=True)
    kf.attention(q, k, v, score=rel_1d({"rel": rel}), backend=Backend.AUTO).square().sum().backward()
    assert rel.grad is not None and float(rel.grad.abs().max()) > 0


def test_explicit_tensors_and_discovery():
    """score_fn(fn, tensors=[...]) for tensors discovery cannot reach; discovery of closures,
    globals, partials, bound methods and nn.Modules."""
    class Holder:
        pass
    hold = Holder()
    hold.t = torch.randn(79, requires_grad=True)
    getter = lambda: hold.t  # noqa: E731 - reached only through a call discovery does not follow

    def hidden(score, b, h, q_idx, kv_idx):
        return score + getter()[q_idx - kv_idx + 39]
    q, k, v = _qkv(1, 1, 16)
    kf.attention(q, k, v, score=kf.score_fn(hidden, tensors=[hold.t]), backend=Backend.TILES).sum().backward()
    assert hold.t.grad is not None

    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rel = torch.nn.Parameter(torch.randn(79))

        def mod(self, score, b, h, q_idx, kv_idx):
            return score + self.rel[q_idx - kv_idx + 39]
    m = Bias()
    assert any(t is m.rel for t in kf.score_fn(m.mod).tensors())
    import functools
    w = torch.randn(3, requires_grad=True)
    part = functools.partial(lambda score, b, h, q, kv, w: score * w[0], w=w)
    assert any(t is w for t in kf.score_fn(part).tensors())
    assert any(t is _GLOBAL_TABLE for t in kf.score_fn(_global_mod).tensors())


_GLOBAL_TABLE = torch.randn(79, requires_grad=True)


def _global_mod(score, b, h, q_idx, kv_idx):
    return score + _GLOBAL_TABLE[q_idx - kv_idx + 39]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("derive", ["view", "times one"])
def test_a_score_tensor_made_from_another_gets_its_gradient_once(derive, dtype):
    """A callable that reads ``u``, made from a table ``rel`` that is also listed (``tensors=[rel]``, as the
    docs suggest for tensors discovery cannot see), while ``u`` is found in its closure: the backward took
    the tiles' gradients with respect to both, through ``u``'s graph into ``rel``, and autograd then passed
    ``u``'s to ``rel`` again: ``rel.grad`` twice the true one (a view), or a crash on a freed graph
    (``rel * 1.0``; a review, 2026-12-07). The tiles' gradients are taken with respect to proxies of the
    tensors now, outside their graph."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 32, generator=g) for _ in range(3))

    def rel_grad(dt, backend):
        rel = torch.zeros(4, 17, dtype=dt).requires_grad_()
        u = rel.view(4, 17) if derive == "view" else rel * 1.0
        mod = kf.score_fn(lambda s, b, h, qi, ki: s + u[h, (qi - ki).clamp(-8, 8) + 8], tensors=[rel])
        kf.attention(q.to(dt), k.to(dt), v.to(dt), score=mod, backend=backend).pow(2).sum().backward()
        return rel.grad

    ref = rel_grad(torch.float64, Backend.REFERENCE)
    got = rel_grad(dtype, Backend.AUTO)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


class _Scale(torch.autograd.Function):
    """A user's own autograd function, read inside a score callable"""

    @staticmethod
    def forward(ctx, t):
        return t * 1.5

    @staticmethod
    def backward(ctx, g):
        return g * 1.5


@pytest.mark.parametrize("extra", [0, 70000], ids=["small table", "large table"])
def test_a_table_read_through_a_users_autograd_function_gets_its_gradient(extra):
    """``_Scale.apply(t)`` takes the table as it is (a TorchFunctionMode does not see Function.apply), so its
    share of the gradient reaches ``t`` itself, not the backward's stand-in: taken with respect to the
    stand-ins alone, the table got zeros, silently (a review of 2026-12-07). Both are asked now."""
    N, H = 24, 2
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, N, 16, generator=g) for _ in range(3))
    t0 = torch.randn(H, 2 * N - 1 + extra, generator=g) * 0.5

    def grad(dt, backend):
        t = t0.to(dt).requires_grad_()
        mod = lambda s, b, h, qi, ki: s + _Scale.apply(t)[h, qi - ki + N - 1]  # noqa: E731
        kf.attention(q.to(dt), k.to(dt), v.to(dt), score=mod, backend=backend).sum().backward()
        return t.grad[:, :2 * N - 1]

    ref = grad(torch.float64, Backend.REFERENCE)
    got = grad(torch.float32, Backend.AUTO)
    assert float(ref.abs().sum()) > 1.0
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("derive", ["view", "reshape", "times one"])
@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES])
def test_a_derived_tensor_read_through_a_users_autograd_function_gets_its_gradient_once(derive, backend):
    """``u`` made from a listed ``t`` (``tensors=[t]``, ``u`` found in the closure), read through a user's
    ``Function.apply(u)``, which no stand-in replaces: the gradient taken with respect to ``t`` itself went
    through ``u``'s graph, and ``u``'s own went back to autograd and reached ``t`` again: ``t.grad`` 2.000x
    the true one (a view), or a crash on a freed graph (``t * 1.0``; a review, 2026-12-07). What reached a
    tensor through another score tensor is taken off its share now (``tiles._own_shares``)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    t0 = torch.randn(2, 31, generator=g, dtype=torch.float64)
    make = {"view": lambda t: t.view(2, 31), "reshape": lambda t: t.reshape(62).reshape(2, 31),
            "times one": lambda t: t * 1.0}[derive]

    def grad(dt, be):
        t = t0.clone().to(dt).requires_grad_()
        u = make(t)
        mod = kf.score_fn(lambda s, b, h, qi, ki: s + _Scale.apply(u)[h, qi - ki + 15], tensors=[t])
        kf.attention(q.to(dt), k.to(dt), v.to(dt), score=mod, backend=be).sum().backward()
        return t.grad

    ref = grad(torch.float64, Backend.REFERENCE)
    assert float(ref.abs().max()) > 1.0
    torch.testing.assert_close(grad(torch.float32, backend).double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", ["chunk", "unbind"])
def test_score_tensors_split_from_one_tensor_get_their_gradients_once(split):
    """``u, w = rel.chunk(2)`` (or ``unbind``) give two tensors one autograd node; with ``x = u * 2`` read
    through a user's Function.apply, the walk that takes off what reached ``u`` through ``x`` keyed tensors
    by their node alone, took ``x`` for a child of ``w`` and left ``x``'s share in ``u``'s twice: rel.grad
    20.7 off against 28.0, silently (a review of the day's change, 2026-12-07). Keyed by node and output."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rel0 = torch.randn(2, 16, generator=g, dtype=torch.float64)

    def grad(dt, backend):
        rel = rel0.clone().to(dt).requires_grad_()
        u, w = rel.chunk(2, 0) if split == "chunk" else (t.unsqueeze(0) for t in rel.unbind(0))
        x = u * 2.0
        mod = kf.score_fn(lambda s, b, h, qi, ki: s + u[0, ki] * (h == 0) + w[0, ki] * (h == 1)
                          + _Scale.apply(x)[0, ki], tensors=[u, w, x])
        kf.attention(q.to(dt), k.to(dt), v.to(dt), score=mod, backend=backend).pow(2).sum().backward()
        return rel.grad

    ref = grad(torch.float64, Backend.REFERENCE)
    assert float(ref.abs().max()) > 1.0
    torch.testing.assert_close(grad(torch.float32, Backend.AUTO).double(), ref, atol=1e-5, rtol=1e-5)


def test_a_callable_that_needs_equal_dtypes_on_later_tiles_only_keeps_every_tiles_gradient():
    """A callable that refuses the float64 stand-ins only on some tiles (a torch.lerp on far keys): the
    tiles of a row band held together were made first, with the float64 stand-ins, and the band's later
    tile turned them into same-dtype ones before the gradients were taken: asked of the new stand-ins,
    the first tiles' share of the table came back None, and the table's gradient was 0 on keys below
    1024 (a review, 2026-12-07). Each tile's gradient is asked of the stand-ins it was made with. (256
    query rows: a piece of fewer rows may span more than 1,024 keys, and this callable differs by tile.)"""
    g = torch.Generator().manual_seed(0)
    Nk = 2500
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (256, Nk, Nk))
    tab0 = torch.randn(2, Nk, generator=g, dtype=torch.float64) * 0.5

    def grad(dt, backend):
        tab = tab0.clone().to(dt).requires_grad_()

        def mod(s, b, h, qi, ki):
            if backend is Backend.REFERENCE:  # the same function on the whole grid
                return torch.where(ki >= 1024, torch.lerp(s, s + tab[h, ki], 0.5), s + tab[h, ki])
            if int(ki.min()) >= 1024:
                return torch.lerp(s, s + tab[h, ki], 0.5)
            return s + tab[h, ki]
        kf.attention(q.to(dt), k.to(dt), v.to(dt), score=mod, backend=backend).pow(2).sum().backward()
        return tab.grad

    ref = grad(torch.float64, Backend.REFERENCE)
    got = grad(torch.float32, Backend.AUTO).double()
    assert float(ref[:, :1024].abs().max()) > 1e-3
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_an_unread_parameter_under_torch_compile():
    """A bound method whose module holds a parameter the score does not read: eager gives it no gradient
    (None); the compiled custom op returned None where it must return a tensor and raised (a review,
    2026-12-07). It returns zeros there now."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tab = torch.nn.Parameter(torch.randn(2))
            self.other = torch.nn.Parameter(torch.randn(3))

        def score(self, s, b, h, qi, ki):
            return s + self.tab[h]

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g).requires_grad_() for _ in range(3))
    m = M()
    f = torch.compile(lambda q, k, v: kf.attention(q, k, v, score=m.score, mask=kf.causal()), backend="eager")
    f(q, k, v).sum().backward()
    assert m.tab.grad is not None and bool(m.tab.grad.abs().sum() > 0)
    assert m.other.grad is None or not bool(m.other.grad.any())


def test_a_score_callable_capturing_an_inference_tensor():
    """A table made under torch.inference_mode (a model loaded for serving) has no version counter: reading
    one raised in the broadcast check's stamp, inside inference mode or out (a review, 2026-12-07). It
    stamps as new on each call now (the check runs again, as after a change)."""
    with torch.inference_mode():
        tab = torch.randn(2, 16)
    q, k, v = _qkv(1, 2, 16)
    mod = lambda s, b, h, qi, ki: s + tab[h, ki]  # noqa: E731
    with torch.inference_mode():
        inside = kf.attention(q, k, v, score=mod)
    err, naive = assert_forward_by_rule(q, k, v, score=mod)
    assert err <= 2.0 * naive + 1e-6
    torch.testing.assert_close(inside, kf.attention(q, k, v, score=mod))


class _Slots:
    __slots__ = ("t",)  # a holder the closure walk cannot read: the tensor must be listed


class _RepeatedBias(kf.ScoreMod):
    """A modifier of one's own whose tensors() names its table twice"""
    additive = True

    def __init__(self, t):
        self.t = t

    def bias(self, b, h, qp, kp):
        return self.t[h, (qp - kp).clamp(-8, 8) + 8]

    def apply(self, s, b, h, qp, kp):
        return s + self.bias(b, h, qp, kp)

    def tensors(self):
        return (self.t, self.t)


@pytest.mark.parametrize("kind, backend", [(kind, backend) for kind in ["score_fn listed twice", "ScoreMod repeating it"]
                                           for backend in [Backend.AUTO, Backend.TILES, Backend.CPU]
                                           if not (backend is Backend.CPU and kind.startswith("score_fn"))])
def test_a_tensor_named_twice_gets_its_gradient_once(kind, backend):
    """``score_fn(fn, tensors=[t, t])`` or a ScoreMod whose ``tensors()`` repeats ``t``: each entry was an input
    of the autograd function, each got the whole gradient, and autograd added both into ``t.grad``: 2.000x
    the true one on every backend but the reference (a review, 2026-12-07). Each tensor is taken once now."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    t0 = torch.randn(2, 17, generator=g, dtype=torch.float64)

    def grad(dt, be):
        t = t0.clone().to(dt).requires_grad_()
        if kind.startswith("score_fn"):
            box = _Slots()
            box.t = t
            mod = kf.score_fn(lambda s, b, h, qi, ki: s + box.t[h, (qi - ki).clamp(-8, 8) + 8], tensors=[t, t])
        else:
            mod = _RepeatedBias(t)
        kf.attention(q.to(dt), k.to(dt), v.to(dt), score=mod, backend=be).sum().backward()
        return t.grad

    ref = grad(torch.float64, Backend.REFERENCE)
    assert float(ref.abs().max()) > 1.0
    torch.testing.assert_close(grad(torch.float32, backend).double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_complex_table_keeps_its_imaginary_gradient(dtype):
    """A callable that reads a complex table (a rotary phase, say) and takes the real part: the backward's
    float64 stand-in was ``t.double()``, which drops the imaginary part, so the table's gradient lost it
    (12.8 off against 15.0; complex128 without even a warning; a review, 2026-12-07). complex128 now."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    t0 = torch.randn(2, 31, generator=g, dtype=torch.complex128)

    def grad(real, cdt, be):
        t = t0.clone().to(cdt).requires_grad_()
        mod = kf.score_fn(lambda s, b, h, qi, ki: s + (t[h, qi - ki + 15] * (1 + 2j)).real, tensors=[t])
        kf.attention(q.to(real), k.to(real), v.to(real), score=mod, backend=be).pow(2).sum().backward()
        return t.grad

    ref = grad(torch.float64, torch.complex128, Backend.REFERENCE)
    assert float(ref.imag.abs().max()) > 1.0
    real = torch.float32 if dtype is torch.complex64 else torch.float64
    torch.testing.assert_close(grad(real, dtype, Backend.AUTO).to(torch.complex128), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES])
@pytest.mark.parametrize("rows", [16, 3000], ids=["one piece", "rows past a tile"])
def test_a_score_tensor_changed_in_place_before_the_backward_gets_the_forwards_gradient(backend, rows):
    """The backward runs the modifier again, on its tensors as they are then: a per-head scale changed under
    no_grad between forward and backward (a clamp in the next layer's forward) gave dq 4.3 off and the scale
    the gradient of another function ([-3.93, -0.74] for [-0.22, 2.11]), silently (a review, 2026-12-07).
    The forward keeps a copy of each small trained tensor now and the backward reads that, as autograd of
    a plain attention differentiates the forward's values."""
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, 2, n, 8, generator=g) for n in (16, rows, rows))

    def grads(change):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        hs = torch.tensor([0.5, 1.5], requires_grad=True)
        out = kf.attention(q, k, v, score=kf.score_fn(lambda s, b, h, qi, ki: s * hs[h]), backend=backend)
        if change:
            with torch.no_grad():
                hs.mul_(3.0)
        out.pow(2).sum().backward()
        return q.grad, k.grad, hs.grad

    for got, want in zip(grads(True), grads(False)):
        assert got is not None and bool(want.abs().sum() > 0)
        torch.testing.assert_close(got, want)


def test_a_tensor_read_live_and_changed_in_place_before_the_backward_raises():
    """Where the backward cannot read the forward's values, a change in between raises, as PyTorch does for
    a saved tensor changed in place: a buffer the callable reads (it does not train, so no copy is kept:
    dq came out 2.2 off against 0.9, silently; a review, 2026-12-07), and a trained table read through a
    user's Function.apply, which takes the live tensor."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g).requires_grad_() for _ in range(3))
    buf = torch.randn(2, 16, generator=g)
    out = kf.attention(q, k, v, score=lambda s, b, h, qi, ki: s + buf[h, ki] * 3)
    with torch.no_grad():
        buf.mul_(-1)
    with pytest.raises(RuntimeError, match="modified in place between the forward and the backward"):
        out.sum().backward()
    t = torch.randn(2, 31, generator=g).requires_grad_()
    out = kf.attention(q, k, v, score=lambda s, b, h, qi, ki: s + _Scale.apply(t)[h, qi - ki + 15])
    with torch.no_grad():
        t.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place between the forward and the backward"):
        out.sum().backward()
    out = kf.attention(q, k, v, score=lambda s, b, h, qi, ki: s + _Scale.apply(t)[h, qi - ki + 15])
    out.sum().backward()  # a change after the backward is fine
    assert t.grad is not None and bool(t.grad.abs().sum() > 0)


class _LinearOnScore(torch.nn.Module):
    """A score callable that is a module with its own layer on the score (float32 weights)"""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.rel = torch.nn.Parameter(torch.randn(31) * 0.3)

    def forward(self, s, b, h, qi, ki):
        return self.lin(s.unsqueeze(-1)).squeeze(-1) + self.rel[qi - ki + 15]


@pytest.mark.parametrize("case", ["nn.Linear", "lerp", "matmul"])
def test_callables_whose_ops_need_equal_dtypes_train(case):
    """The backward's float64 stand-ins met ops that need their operands in one dtype (``F.linear`` of a
    float32 weight, ``torch.lerp``, a matmul with a float32 tensor the callable makes): the forward ran and
    the backward raised (a review, 2026-12-07). Such a callable gets its tensors in their own dtypes now,
    and its gradients hold the rule."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    rel0 = torch.randn(31, generator=g) * 0.3
    module = _LinearOnScore()

    def run(dt, backend):
        if case == "nn.Linear":
            m = module.to(dt)
            m.zero_grad()
            mod, params = m, [m.rel, m.lin.weight]
        else:
            rel = rel0.to(dt).requires_grad_()
            if case == "lerp":
                mod = lambda s, b, h, qi, ki: torch.lerp(s, s + rel[qi - ki + 15], 0.5)  # noqa: E731
            else:
                mod = lambda s, b, h, qi, ki: s + (torch.ones(1, 2, dtype=s.dtype) @ rel[:2].view(2, 1)).squeeze()  # noqa: E731
            params = [rel]
        out = kf.attention(q.to(dt), k.to(dt), v.to(dt), score=mod, backend=backend)
        out.pow(2).sum().backward()
        return out.detach(), [p.grad.clone() for p in params]

    ref_out, ref = run(torch.float64, Backend.REFERENCE)
    out, got = run(torch.float32, Backend.AUTO)
    _, nai = run(torch.float32, Backend.REFERENCE)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    for a, r, n in zip(got, ref, nai):
        assert float(r.abs().max()) > 0
        assert_close_by_rule(a, r, n, None, factor=3.0, what=case)


def test_a_parameter_the_score_never_reads_keeps_no_gradient():
    """A module callable's parameter the score does not read (found by the closure walk all the same)
    got zeros for its gradient, not None: an optimizer then decays it and its moments move it, where
    plain PyTorch leaves it be (a review, 2026-12-07). None now, as autograd leaves it; a float mask that
    hides every pair still gets zeros, as SDPA gives."""
    class Mod(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rel = torch.nn.Parameter(torch.randn(31) * 0.3)
            self.unused = torch.nn.Parameter(torch.randn(4))

        def forward(self, s, b, h, qi, ki):
            return s + self.rel[qi - ki + 15]

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    m = Mod()
    assert any(t is m.unused for t in kf.score_fn(m).tensors())
    kf.attention(q, k, v, score=m).sum().backward()
    assert m.rel.grad is not None and m.unused.grad is None
    t = torch.randn(3, requires_grad=True)  # listed, and the callable reads no tensor at all
    kf.attention(q, k, v, score=kf.score_fn(lambda s, b, h, qi, ki: s * 2.0, tensors=[t])).sum().backward()
    assert t.grad is None
    mask = torch.full((16, 16), float("-inf"), requires_grad=True)
    kf.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    assert mask.grad is not None and not bool(mask.grad.any())


@pytest.mark.parametrize("seed, threads", [(0, 1), (7, 1), (0, 2)])
def test_a_relative_position_tables_far_bin_sums_its_gradient_in_float64(seed, threads):
    """A clamped relative-position table's far bin gathers most pairs of every row; its gradient is the sum
    of their dS over 300 rows of up to 2,200 keys, with a gradient through lse. Autograd of the callable
    summed it in float32, tile by tile: 1.8-2.6x the 3x rule's allowance in these cases, 4 of 10 seeds
    past it at one thread, 1 of 10 at two (the naive's one float32 scatter is as inexact, in its own
    order; a review of 2026-12-07 saw 2.9x). The callable now reads the tensors that train as float64
    copies in the backward, and the sums are float64: 0.004-0.06x."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads)  # (the sums' order, and so which seeds broke the rule, moves with it)
    try:
        got, ref, nai = _far_bin_grads(seed)
    finally:
        torch.set_num_threads(n)
    assert got.dtype == torch.float32
    assert_close_by_rule(got, ref, nai, None, factor=3.0, what="table")


def _far_bin_grads(seed):
    """The far-bin table's gradient: keyfold's (float32), the float64 reference's and the naive's"""
    g = torch.Generator().manual_seed(seed)
    Nq, Nk, H, D, bins = 300, 2200, 2, 64, 65
    q = torch.randn(1, H, Nq, D, generator=g) * 3 ** 0.5
    k = torch.randn(1, H, Nk, D, generator=g) * 3 ** 0.5
    v = torch.randn(1, H, Nk, D, generator=g)
    table0 = torch.randn(bins, generator=g)
    dout, dlse = torch.randn(1, H, Nq, D, generator=g), torch.randn(1, H, Nq, generator=g)

    def table_grad(dtype, attend):
        t = table0.to(dtype).clone().requires_grad_()
        mod = kf.score_fn(lambda s, b, h, qi, ki: s + t[(qi - ki).clamp(0, bins - 1)], tensors=[t])
        qq, kk, vv = (x.to(dtype).clone().requires_grad_() for x in (q, k, v))  # (a step that trains them too)
        out, lse = attend(qq, kk, vv, score=mod, mask=kf.causal(), return_lse=True)
        ((out * dout.to(dtype)).sum() + (lse * dlse.to(dtype)).sum()).backward()
        return t.grad

    ref = table_grad(torch.float64, lambda *a, **kw: kf.attention(*a, backend=Backend.REFERENCE, **kw))
    return table_grad(torch.float32, kf.attention), ref, table_grad(torch.float32, naive_attention)


def test_triton_refuses_score_gradients_naming_tiles(monkeypatch):
    from keyfold import engine
    monkeypatch.setattr(engine, "_resolve", lambda backend, q, score, dropout_p=0.0: Backend.TRITON)
    q, k, v = _qkv(1, 1, 8)
    rel = torch.zeros(79, requires_grad=True)
    with pytest.raises(ValueError, match="Backend.TILES"):
        kf.attention(q, k, v, score=rel_1d({"rel": rel}), backend=Backend.TRITON)


def test_attend_backward_returns_score_gradients_or_refuses():
    q, k, v = _qkv(1, 2, 24)
    rel = _rand(79, seed=4).requires_grad_(True)
    mod = rel_1d({"rel": rel})
    out, lse = kf.attention(q, k, v, score=mod, backend=Backend.TILES, return_lse=True)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match="score_grads=True"):
        kf.attend_backward(q, k, v, out, lse, dout, score=mod)
    total = torch.zeros_like(rel)
    for a, c in ((0, 10), (10, 24)):  # two key pieces: shares add up
        *_, pairs = kf.attend_backward(q, k[:, :, a:c], v[:, :, a:c], out, lse, dout, score=mod,
                                       q_offset=0, kv_offset=a, score_grads=True)
        (t, g), = pairs
        assert t is rel
        total += g
    rel.grad = None
    kf.attention(q, k, v, score=mod, backend=Backend.REFERENCE).backward(dout)
    torch.testing.assert_close(total, rel.grad, atol=1e-5, rtol=1e-4)


def _train_step_on_a_view(q, k, v, backend):
    """One step whose score reads a non-leaf view of a parameter; returns (weakref to the view, param)."""
    base = torch.randn(24, 24, 2, requires_grad=True)
    bias = base.permute(2, 0, 1) * 1.0

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]
    kf.attention(q, k, v, score=mod, mask=kf.causal(), backend=backend).sum().backward()
    return weakref.ref(bias), base


def test_no_graph_kept_alive_after_backward():
    """Plans and caches hold no tensor with a grad graph: the captured non-leaf is freed."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 2, 24))
    for backend in (Backend.AUTO, Backend.TILES):
        alive, base = _train_step_on_a_view(q, k, v, backend)
        gc.collect()
        assert alive() is None, backend
        assert base.grad is not None


# -------------------------------------------------------- 7. probes within real B, H


def test_per_batch_lengths_with_batch_one():
    """Padding from input lengths, B = 1: the probe must not read lengths[1]."""
    lengths = torch.tensor([13])

    def padding(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]
    q, k, v = _qkv(1, 2, 32)
    for backend in (Backend.CPU, Backend.TILES):
        assert_forward_by_rule(q, k, v, mask=padding, backend=backend)


def test_per_head_bias_with_one_head():
    head_bias = _rand(1, 32, 32, seed=9)

    def per_head(score, b, h, q_idx, kv_idx):
        return score + head_bias[h][q_idx, kv_idx]

    def per_head_mask(b, h, q_idx, kv_idx):
        return head_bias[h][q_idx, kv_idx] > -1.0
    q, k, v = _qkv(2, 1, 32)
    for backend in (Backend.AUTO, Backend.TILES):
        assert_forward_by_rule(q, k, v, score=per_head, mask=per_head_mask, backend=backend)


def test_flamingo_cross_attention_batch_one():
    """Text tokens see the image their media id points at (Flamingo), B = 1, Nq != Nk."""
    media = torch.tensor([[0] * 10 + [1] * 14])   # (B, Nq): image each text token follows
    image_of_kv = torch.arange(16) // 8           # 2 images of 8 latent tokens

    def cross(b, h, q_idx, kv_idx):
        return media[b, q_idx] == image_of_kv[kv_idx]
    q, k, v = _qkv(1, 2, 24, Nk=16)
    assert_forward_by_rule(q, k, v, mask=cross, q_offset=0)


def test_probe_keeps_plan_once_for_all_heads():
    assert MaskFn(lambda b, h, q, kv: q >= kv).depends_on_batch_head(4, 8) == (False, False)
    lengths = torch.tensor([5])
    assert MaskFn(lambda b, h, q, kv: kv < lengths[b]).depends_on_batch_head(1, 8) == (False, False)
    lengths2 = torch.tensor([5, 7])
    assert MaskFn(lambda b, h, q, kv: kv < lengths2[b]).depends_on_batch_head(2, 8) == (True, False)
    # per-element callables (decided under vmap): the probe asks vmap what they read
    iv = torch.tensor([[0, 5], [2, 9]])
    fn = lambda b, h, q, kv: (kv >= iv[b][0]) & (kv < iv[b][1])  # noqa: E731
    assert MaskFn(fn).depends_on_batch_head(2, 4) == (True, False)
    hb = torch.randn(4, 8)
    fn2 = lambda b, h, q, kv: hb[h][q] > 0  # noqa: E731
    assert MaskFn(fn2).depends_on_batch_head(2, 4) == (False, True)


# ------------------------------------------------------------ 8. per-element code

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def _flex(q, k, v, score_mod=None, mask_mod=None):
    B, H, N = q.shape[:3]
    block = None
    if mask_mod is not None:
        block = flex.create_block_mask(mask_mod, B, H, N, k.shape[2], device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block)


B8, H8, N8 = 2, 2, 32
_bias_bs = _rand(B8, N8, seed=30)
_bias_4bhs = _rand(4, B8, H8, N8, seed=31)
_bias_bh4s = _rand(B8, H8, 4, N8, seed=32)
_which = torch.tensor(0)
_xr, _yr = _rand(N8, 8, seed=33), _rand(N8, 8, seed=34)
_intervals = torch.tensor([[3, 20], [0, 9]])


def index_multiple(score, b, h, q_idx, kv_idx):
    return score + _bias_bs[b][q_idx]


def index_weird1(score, b, h, q_idx, kv_idx):
    return score + _bias_4bhs[0][b, h][q_idx]


def index_weird2(score, b, h, q_idx, kv_idx):
    return score + _bias_bh4s[b][h][_which, q_idx]


def dot_score(score, b, h, q_idx, kv_idx):
    return score + 0.1 * torch.dot(_xr[q_idx], _yr[kv_idx])


def summed_score(score, b, h, q_idx, kv_idx):
    """Per element a dot product; on a broadcast grid ``.sum()`` would add up the whole tile."""
    return score + 0.1 * (_xr[q_idx] * _yr[kv_idx]).sum()


def test_zero_initialised_table_is_checked_again_once_it_trains():
    """With a zero table, broadcast and per-element agree by accident (both add 0): the choice
    must not be frozen then, or the first real values give a silently wrong answer."""
    x = torch.zeros(N8, 8)
    y = _rand(N8, 8, seed=35)

    def dot_sum(score, b, h, q_idx, kv_idx):
        return score + (x[q_idx] * y[kv_idx]).sum()
    q, k, v = _qkv(B8, H8, N8)
    kf.attention(q, k, v, score=dot_sum, q_offset=0, backend=Backend.TILES)
    with torch.no_grad():
        x.copy_(_rand(N8, 8, seed=36) * 0.1)   # an optimizer step
    got = kf.attention(q, k, v, score=dot_sum, q_offset=0, backend=Backend.TILES)
    torch.testing.assert_close(got, _flex(q, k, v, score_mod=dot_sum), atol=2e-5, rtol=1e-4)


def interval_mask(b, h, q_idx, kv_idx):
    return (kv_idx >= _intervals[b][0]) & (kv_idx < _intervals[b][1]) | (q_idx == kv_idx)


ELEMENT_SCORES = [index_multiple, index_weird1, index_weird2, dot_score, summed_score]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("score_mod", ELEMENT_SCORES, ids=lambda f: f.__name__)
def test_per_element_scores_match_flex(score_mod, backend):
    q, k, v = _qkv(B8, H8, N8)
    want = _flex(q, k, v, score_mod=score_mod)
    got = kf.attention(q, k, v, score=score_mod, q_offset=0, backend=backend)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert _callables.mode_of(score_mod) is _callables.Mode.ELEMENT


@pytest.mark.parametrize("backend", [Backend.CPU, Backend.TILES], ids=lambda b: b.name)
def test_per_element_mask_matches_flex(backend):
    q, k, v = _qkv(B8, H8, N8)
    want = _flex(q, k, v, mask_mod=interval_mask)
    got = kf.attention(q, k, v, mask=interval_mask, q_offset=0, backend=backend, block_size=8)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert_forward_by_rule(q, k, v, mask=interval_mask, q_offset=0, backend=backend)


def mla_rope(p):
    """MLA-style decoupled RoPE: a rotated low-rank query/key pair adds its dot product."""
    pos = torch.arange(40, dtype=torch.float64).unsqueeze(-1) * torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)
    cos, sin = pos.cos().to(p["qr"].dtype), pos.sin().to(p["qr"].dtype)

    def rot(x, i):                   # x: (8,) for one position i, rotated in 4 pairs
        a, b = x[:4], x[4:]
        return torch.cat([a * cos[i] - b * sin[i], a * sin[i] + b * cos[i]])

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 0.25 * torch.dot(rot(p["qr"][b, h, q_idx], q_idx), rot(p["kr"][b, kv_idx], kv_idx))
    return score_mod


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_per_element_rope_score_gets_gradients(backend):
    """Gradients flow through the vmap path to both captured tables."""
    assert_score_grads_by_rule(mla_rope, {"qr": _rand(2, 2, 40, 8, seed=40), "kr": _rand(2, 40, 8, seed=41)}, backend,
                      mask=kf.causal())


def test_index_chain_gradients_through_vmap():
    assert_score_grads_by_rule(lambda p: (lambda s, b, h, qi, ki: s + p["t"][b][h][qi] * p["u"][ki]),
                      {"t": _rand(2, 2, 40, seed=42), "u": _rand(40, seed=43)}, Backend.TILES)


def test_broadcast_callables_stay_in_broadcast_mode():
    def rel(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (q_idx - kv_idx)
    q, k, v = _qkv(1, 2, 16)
    kf.attention(q, k, v, score=rel, mask=lambda b, h, qi, ki: qi >= ki)
    assert _callables.mode_of(rel) is _callables.Mode.BROADCAST


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_a_per_element_mask_that_reduces_the_grid_to_one_bool(backend):
    """Called on the whole tile, this Flex-style mask sums over every pair and returns one bool;
    the spread sample points all saw True, and that bool stood for the tile: row 3, which must see
    no key, saw all of them (fuzzing, 2026-12-05). Now such a tile takes Flex's own answer."""
    x = torch.ones(8, 1)
    x[3] = -1.0
    y = torch.ones(8, 1)

    def dot_mask(b, h, q_idx, kv_idx):
        return (x[q_idx] * y[kv_idx]).sum() > 0
    q, k, v = _qkv(1, 1, 8)
    out, lse = kf.attention(q, k, v, mask=dot_mask, q_offset=0, backend=backend, return_lse=True)
    assert bool((out[0, 0, 3] == 0).all()) and lse[0, 0, 3] == float("-inf")
    torch.testing.assert_close(out, _flex(q, k, v, mask_mod=dot_mask), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("first", ["two batch entries", "two heads"])
def test_float32_rounding_is_not_evidence_for_broadcast(first):
    """A first call of one query over one key for two batch entries (or heads): s + c rounds
    differently at two scores, which counted as the modifier varying, and broadcast was chosen for
    good; the next ordinary call was 0.48 off (fuzzing, 2026-12-05)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, generator=g) * 0.3, torch.randn(64, 3, generator=g)

    def dot_score(score, b, h, q_idx, kv_idx):
        return score + (x[q_idx] * y[kv_idx]).sum()
    one = torch.tensor([1.0, 0.0, 3.0, 0.0]).view(2, 1, 1, 2)
    if first == "two heads":
        one = one.view(1, 2, 1, 2)
    kf.attention(one, torch.ones_like(one), torch.ones_like(one), score=dot_score)
    assert _callables.mode_of(dot_score) is not _callables.Mode.BROADCAST
    q, k, v = _qkv(1, 2, 40)
    got = kf.attention(q, k, v, score=dot_score, q_offset=0)
    torch.testing.assert_close(got, _flex(q, k, v, score_mod=dot_score), atol=2e-5, rtol=1e-4)


def test_one_token_tiles_do_not_decide_a_per_element_score_for_good():
    """Sixteen calls of one query over one key cannot tell broadcast from per-element evaluation;
    they used to choose broadcast for good, and the next full call added a tile-wide sum to every
    score (error 1.7; fuzzing, 2026-12-05)."""
    x, y = _rand(8, 3, seed=60), _rand(8, 3, seed=61)

    def dot_score(score, b, h, q_idx, kv_idx):
        return score + (x[q_idx] * y[kv_idx]).sum()
    q, k, v = _qkv(1, 1, 8)
    for i in range(20):
        j = i % 8
        kf.attention(q[:, :, j:j + 1], k[:, :, j:j + 1], v[:, :, j:j + 1], score=dot_score, q_offset=j,
                     kv_offset=j, backend=Backend.TILES)
    got = kf.attention(q, k, v, score=dot_score, q_offset=0, backend=Backend.TILES)
    torch.testing.assert_close(got, _flex(q, k, v, score_mod=dot_score), atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------ 9. dtype rules


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float64_table_with_lower_precision_inputs(backend, dtype):
    table = _rand(24, 24, seed=50, dtype=torch.float64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[q_idx, kv_idx]
    q, k, v = _qkv(1, 2, 24, dtype=dtype)
    out = kf.attention(q, k, v, score=score_mod, backend=backend)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, _flex(q, k, v, score_mod=score_mod), atol=2e-5, rtol=1e-4)
    assert_forward_by_rule(q, k, v, score=score_mod, backend=backend)


class _Float64Bias(kf.ScoreMod):
    """An additive modifier of one's own holding a float64 table; its apply returns what torch's promotion gives"""
    additive = True

    def __init__(self, t):
        self.t = t

    def bias(self, b, h, qp, kp):
        return self.t[(qp - kp).clamp(-8, 8) + 8]

    def apply(self, s, b, h, qp, kp):
        return s + self.bias(b, h, qp, kp)

    def tensors(self):
        return (self.t,)


@pytest.mark.parametrize("backend", [Backend.REFERENCE, Backend.AUTO, Backend.CPU])
def test_a_modifier_of_ones_own_with_a_float64_table_on_float32_inputs(backend):
    """Its apply gives float64 scores beside float32 inputs: the reference backend took P in float64 and
    raised at P @ v (a review, 2026-12-07); it takes the scores in the state dtype now, as the others do."""
    t = torch.randn(17, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    q, k, v = _qkv(1, 2, 24)
    out = kf.attention(q, k, v, score=_Float64Bias(t), backend=backend)
    assert out.dtype == torch.float32
    assert_forward_by_rule(q, k, v, score=_Float64Bias(t.detach()), backend=backend)
    out.sum().backward()
    assert t.grad is not None and t.grad.dtype == torch.float64 and bool(t.grad.abs().sum() > 0)


def test_user_mask_whose_probe_takes_no_sizes():
    """The protocol's ``depends_on_batch_head()`` may leave out B and H (docs/masks.md)."""
    class PerBatchLength(kf.Mask):
        def __init__(self, n):
            self.n = n

        def evaluate(self, b, h, qp, kp):
            return kp < self.n[b]

        def depends_on_batch_head(self):
            return True, False

    q, k, v = _qkv(2, 2, 24)
    assert_forward_by_rule(q, k, v, mask=PerBatchLength(torch.tensor([7, 19])), backend=Backend.CPU)
    assert PerBatchLength(None).depends_on_batch_head(2, 2) == (True, False)


@pytest.mark.parametrize("backend", [Backend.CPU, Backend.TILES], ids=lambda b: b.name)
def test_attend_backward_shares_sum_to_the_whole(backend):
    """attend_backward over key pieces of one row (split-KV, ring attention): each row's D_i is
    the global one, even where this call's plan covers the row with a single piece."""
    q, k, v = _qkv(1, 2, 24)
    out, lse = kf.attention(q, k, v, return_lse=True)
    dout = _rand(1, 2, 24, 16, seed=8)
    dq = dk = dv = 0
    for a, c in ((0, 10), (10, 24)):
        gq, gk, gv = kf.attend_backward(q, k[:, :, a:c], v[:, :, a:c], out, lse, dout, q_offset=0, kv_offset=a,
                                        backend=backend)
        dq = dq + gq
        dk = torch.cat([dk, gk], 2) if a else gk
        dv = torch.cat([dv, gv], 2) if a else gv
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    kf.attention(qq, kk, vv, backend=Backend.REFERENCE).backward(dout)
    for got, want in ((dq, qq.grad), (dk, kk.grad), (dv, vv.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_per_head_score_decides_broadcast_and_identity_decides_per_element():
    """What a callable adds may vary along b or h only (a per-head bias): that tells too, so the
    callable runs broadcast (it was checked whole on every tile, 5-7x the time; review, 2026-12-05).
    One that adds nothing at all never tells, and goes per element after 16 tiles."""
    hb = _rand(2, seed=70)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + hb[h]

    def same(score, b, h, q_idx, kv_idx):
        return score
    q, k, v = _qkv(1, 2, 64)
    kf.attention(q, k, v, score=head_bias, backend=Backend.TILES, block_size=16)
    assert _callables.mode_of(head_bias) is _callables.Mode.BROADCAST
    for _ in range(16):  # a call of one piece is one tile here
        assert _callables.mode_of(same) is None
        kf.attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], score=same, backend=Backend.TILES)
    assert _callables.mode_of(same) is _callables.Mode.ELEMENT


def test_broadcast_is_checked_again_when_a_captured_table_changes():
    """Broadcast chosen while a per-element term's table was zero (the softcap part told), then the
    table trained in place: the broadcast answer was 2.9 off (review, 2026-12-05). Since 2026-12-07 the
    tile-wide ``.sum()`` is seen in the code itself while the table is still zero: per element at once."""
    x, y = torch.zeros(16, 4), _rand(16, 4, seed=80)

    def pair_score(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / 5) * 5 + (x[q_idx] * y[kv_idx]).sum()
    q, k, v = _qkv(1, 2, 16)
    kf.attention(q, k, v, score=pair_score, q_offset=0)
    assert _callables.mode_of(pair_score) is _callables.Mode.ELEMENT
    x.copy_(_rand(16, 4, seed=81))
    got = kf.attention(q, k, v, score=pair_score, q_offset=0)
    torch.testing.assert_close(got, _flex(q, k, v, score_mod=pair_score), atol=2e-5, rtol=1e-4)
    assert _callables.mode_of(pair_score) is _callables.Mode.ELEMENT


# ------------------------------------- state read through classes, modules and plain objects
# A review (2026-12-06) found both walks blind to it: a mask reading `Cfg.window` kept its old plan
# after the attribute changed (output off by 2.25), and a score table held by a dataclass, a
# SimpleNamespace, a class or a module got no gradient (norm 5.8 in eager), both without a word.

class _Window:
    size = 2


_window_module = types.ModuleType("keyfold_test_window_config")
_window_module.size = 2


def _band(qi, ki, c):  # reads the attribute in a helper the mask calls: the name is not in the mask's code
    return (qi - ki).abs() <= c.size


class _BandMask:
    size = 2  # a class attribute read through self

    def __call__(self, b, h, qi, ki):
        return (qi - ki).abs() <= self.size


_WINDOW_READERS = {
    "class attribute": (lambda b, h, qi, ki: (qi - ki).abs() <= _Window.size, _Window),
    "module attribute": (lambda b, h, qi, ki: (qi - ki).abs() <= _window_module.size, _window_module),
    "through a helper": (lambda b, h, qi, ki: _band(qi, ki, _Window), _Window),
    "class attribute via self": (_BandMask(), _BandMask),
}


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES], ids=lambda b: b.name)
@pytest.mark.parametrize("name", list(_WINDOW_READERS))
def test_a_mask_reading_a_class_or_module_attribute_is_planned_again_when_it_changes(name, backend):
    fn, space = _WINDOW_READERS[name]
    q, k, v = _qkv(1, 2, 48, seed=31)
    try:
        for size in (2, 30, 5):
            space.size = size
            got = kf.attention(q, k, v, mask=fn, q_offset=0, backend=backend)
            band = lambda b, h, qi, ki, w=size: (qi - ki).abs() <= w  # noqa: E731
            ref = kf.attention(q.double(), k.double(), v.double(), mask=band, q_offset=0, backend=Backend.REFERENCE)
            nai = naive_attention(q, k, v, mask=band, q_offset=0)
            assert_close_by_rule(got, ref, nai, None, what=f"window {size}")
    finally:
        space.size = 2


class _ByName:
    size = 2


_by_name_module = types.ModuleType("keyfold_test_window_by_name")
_by_name_module.size = 2


class _SizeMeta(type):
    size = 2  # read as _ViaMeta.size: the metaclass's attribute


class _ViaMeta(metaclass=_SizeMeta):
    pass


_SIZE_LOCAL = threading.local()  # (its type lives in _thread, beside the locks the walk skips)
_SIZE_LOCAL.size = 2
_SIZE_DEQUE = collections.deque([2])
_SIZE_BYTES = bytearray([2])
_SIZE_ARRAY = array.array("i", [2])
_SIZE_RANGES = [range(2)]
_SIZE_TIMES = {"w": datetime.timedelta(seconds=2)}


def _set_ranges(n):
    _SIZE_RANGES[0] = range(n)


def _set_times(n):
    _SIZE_TIMES["w"] = datetime.timedelta(seconds=n)


class _WindowFromSettings:
    def __get__(self, obj, cls):  # a descriptor: Cfg.size runs this, which reads another class
        return _ByName.size


class _DescribedCfg:
    size = _WindowFromSettings()


class _Lookup:
    def __getitem__(self, key):  # o["size"]: the mask's code never names what this reads
        return getattr(_window_module, key)


_SIZE_TENSOR = torch.tensor(2)
_SIZE_TAGGED = torch.zeros(1)
_SIZE_TAGGED.size_of_window = 2
_SIZE_DICT = {"size": 2}
_SIZE_GET = _SIZE_DICT.get
_SIZE_LOOKUP = _Lookup()
_SIZE_NAME = "size"  # an attribute name held in a variable
class _Holder:
    size = 2


_SIZE_WEAK_HOLDER = _Holder()
_SIZE_WEAK = weakref.WeakValueDictionary({"cfg": _SIZE_WEAK_HOLDER})
_SIZE_MASKED = np.ma.masked_array([2], mask=[False])
_SIZE_REF_HOLDER = _Holder()  # (instances of their own: another entry's setter must not move them)
_SIZE_REF = weakref.ref(_SIZE_REF_HOLDER)
_SIZE_PROXY_HOLDER = _Holder()
_SIZE_PROXY = weakref.proxy(_SIZE_PROXY_HOLDER)
_SIZE_SET_HOLDER = _Holder()
_SIZE_SET = weakref.WeakSet([_SIZE_SET_HOLDER])


class _SizeOwner:
    size = 2

    def window_size(self):
        return self.size


_SIZE_OWNER = _SizeOwner()


def _size_of_self(b, h, qi, ki):  # reads an attribute set on itself
    return (qi - ki).abs() <= _size_of_self.size


def _size_helper():
    return _size_helper.size


_size_of_self.size = _size_helper.size = 2
_SIZE_PARTIAL = functools.partial(lambda b, h, qi, ki, p=None: (qi - ki).abs() <= _SIZE_PARTIAL.size)
_SIZE_PARTIAL.size = 2


class _HoldsAFunction:
    helper = staticmethod(_size_helper)
_SIZE_METHOD = weakref.WeakMethod(_SIZE_OWNER.window_size)


# a mask that reads its window where the first walk did not look: (mask, set the window)
_HIDDEN_READERS = {
    "getattr on a class": (lambda b, h, qi, ki: (qi - ki).abs() <= getattr(_ByName, "size"),
                           lambda n: setattr(_ByName, "size", n)),
    "getattr on a module": (lambda b, h, qi, ki: (qi - ki).abs() <= getattr(_by_name_module, "size"),
                            lambda n: setattr(_by_name_module, "size", n)),
    "metaclass attribute": (lambda b, h, qi, ki: (qi - ki).abs() <= _ViaMeta.size,
                            lambda n: setattr(_SizeMeta, "size", n)),
    "threading.local attribute": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_LOCAL.size,
                                  lambda n: setattr(_SIZE_LOCAL, "size", n)),
    "deque filled in place": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_DEQUE[0],
                              lambda n: _SIZE_DEQUE.__setitem__(0, n)),
    "bytearray written in place": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_BYTES[0],
                                   lambda n: _SIZE_BYTES.__setitem__(0, n)),
    "array written in place": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_ARRAY[0],
                               lambda n: _SIZE_ARRAY.__setitem__(0, n)),
    "tensor written through .data": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_TENSOR,
                                     lambda n: _SIZE_TENSOR.data.fill_(n)),
    "python attribute on a tensor": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_TAGGED.size_of_window,
                                     lambda n: setattr(_SIZE_TAGGED, "size_of_window", n)),
    "bound dict.get": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_GET("size"),
                       lambda n: _SIZE_DICT.__setitem__("size", n)),
    "descriptor reading another class": (lambda b, h, qi, ki: (qi - ki).abs() <= _DescribedCfg.size,
                                         lambda n: setattr(_ByName, "size", n)),
    "__getitem__ of a user class": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_LOOKUP["size"],
                                    lambda n: setattr(_window_module, "size", n)),
    "getattr with a name in a variable": (lambda b, h, qi, ki: (qi - ki).abs() <= getattr(_by_name_module, _SIZE_NAME),
                                          lambda n: setattr(_by_name_module, "size", n)),
    "WeakValueDictionary": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_WEAK["cfg"].size,
                            lambda n: setattr(_SIZE_WEAK_HOLDER, "size", n)),
    # a layer's weak reference to its model's config (the weakref module's objects were skipped as process
    # state: the old plan; a review, 2026-12-07)
    "weakref.ref": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_REF().size,
                    lambda n: setattr(_SIZE_REF_HOLDER, "size", n)),
    "weakref.proxy": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_PROXY.size,
                      lambda n: setattr(_SIZE_PROXY_HOLDER, "size", n)),
    "WeakSet": (lambda b, h, qi, ki: (qi - ki).abs() <= max(x.size for x in _SIZE_SET),
                lambda n: setattr(_SIZE_SET_HOLDER, "size", n)),
    "WeakMethod": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_METHOD()(),
                   lambda n: setattr(_SIZE_OWNER, "size", n)),
    # attributes set on a function object or a partial (a review, 2026-12-07: not followed, the old plan)
    "attribute of the mask function itself": (_size_of_self, lambda n: setattr(_size_of_self, "size", n)),
    "attribute of a helper it calls": (lambda b, h, qi, ki: (qi - ki).abs() <= _size_helper(),
                                       lambda n: setattr(_size_helper, "size", n)),
    "attribute of a partial": (_SIZE_PARTIAL, lambda n: setattr(_SIZE_PARTIAL, "size", n)),
    "attribute of a function held by a class": (lambda b, h, qi, ki: (qi - ki).abs() <= _HoldsAFunction.helper(),
                                                lambda n: setattr(_size_helper, "size", n)),
    "numpy masked array": (lambda b, h, qi, ki: (qi - ki).abs() <= int(_SIZE_MASKED[0]),
                           lambda n: _SIZE_MASKED.__setitem__(0, n)),
    "range in a list": (lambda b, h, qi, ki: (qi - ki).abs() <= len(_SIZE_RANGES[0]), _set_ranges),
    "timedelta in a dict": (lambda b, h, qi, ki: (qi - ki).abs() <= _SIZE_TIMES["w"].seconds, _set_times),
}


@pytest.mark.parametrize("name", list(_HIDDEN_READERS))
def test_a_mask_reading_state_the_first_walk_missed_is_planned_again_when_it_changes(name):
    """The plan key's blind spots of the last session, closed (each kept the window-2 plan after
    the window became 30): an attribute read by a string constant, a metaclass's attribute, C
    containers changed in place, and values without a __dict__ (a range, a timedelta) rebound."""
    fn, set_size = _HIDDEN_READERS[name]
    q, k, v = _qkv(1, 2, 48, seed=33)
    try:
        for size in (2, 30, 5):
            set_size(size)
            got = kf.attention(q, k, v, mask=fn, q_offset=0)
            band = lambda b, h, qi, ki, w=size: (qi - ki).abs() <= w  # noqa: E731
            ref = kf.attention(q.double(), k.double(), v.double(), mask=band, q_offset=0, backend=Backend.REFERENCE)
            nai = naive_attention(q, k, v, mask=band, q_offset=0)
            assert_close_by_rule(got, ref, nai, None, what=f"{name}, window {size}")
    finally:
        set_size(2)


def test_a_mask_holding_a_c_object_the_walk_cannot_read_is_never_planned_from_the_cache():
    """What the walk cannot see into (an itertools iterator's position) makes the key incomplete:
    such a mask is planned again at every call rather than from a plan that may be stale."""
    counter = itertools.count()
    fn = lambda b, h, qi, ki: (qi - ki).abs() <= 2 + 0 * next(counter)  # noqa: E731
    assert kf.masks.captured_stamp(fn) != kf.masks.captured_stamp(fn)
    table = torch.zeros(3)
    values = lambda b, h, qi, ki: (qi - ki).abs() <= table[0] + len((torch.float32, range(2)))  # noqa: E731
    assert kf.masks.captured_stamp(values) == kf.masks.captured_stamp(values)  # values: a stable key


def test_process_objects_beside_a_masks_state_keep_its_key_complete():
    """A lock, a process group's stand-in (torch's C objects), Ellipsis and a compiled pattern beside
    the state a mask reads: the key stays complete, so the plan is reused (the review of the walk
    that keys C objects found each of them re-planning every call: 95 ms a call, not 20)."""
    holder = types.SimpleNamespace(window=3, lock=threading.Lock(), rlock=threading.RLock(),
                                   gen=torch.Generator(), index=(Ellipsis, 0), pattern=re.compile("x+"))
    fn = lambda b, h, qi, ki: (qi - ki).abs() <= holder.window  # noqa: E731
    objs, complete = kf.masks._captured(fn)
    assert complete and 3 in objs
    assert kf.masks.captured_stamp(fn) == kf.masks.captured_stamp(fn)
    # a compiled pattern is keyed by its pattern and flags, not its repr (cut at 200 characters)
    box = [re.compile("a" * 300 + "b")]
    g = lambda b, h, qi, ki: (qi - ki).abs() <= len(box[0].pattern)  # noqa: E731
    stamp = kf.masks.captured_stamp(g)
    box[0] = re.compile("a" * 300 + "c")
    assert kf.masks.captured_stamp(g) != stamp


class _Ring(collections.deque):  # a deque subclass: it has a __dict__ too
    pass


def _aware(n):
    return datetime.datetime(2026, 1, 1, n, tzinfo=datetime.timezone(datetime.timedelta(hours=n)))


_VALUE_CORNERS = {
    # ranges compare as sequences: range(2, 2) == range(30, 30)
    "empty range's start": (lambda: range(2, 2), lambda n: range(n, n), lambda r: r.start),
    # aware datetimes compare by instant: the same instant in another zone shows another hour
    "aware datetime's hour": (lambda: _aware(2), _aware, lambda t: t.hour),
}


@pytest.mark.parametrize("name", [*_VALUE_CORNERS, "deque subclass"])
def test_values_that_compare_equal_but_read_differently_key_apart(name):
    q, k, v = _qkv(1, 2, 48, seed=35)
    if name == "deque subclass":
        box = _Ring([2])
        fn = lambda b, h, qi, ki: (qi - ki).abs() <= box[0]  # noqa: E731
        set_size = lambda n: box.__setitem__(0, n)  # noqa: E731
    else:
        first, make, read = _VALUE_CORNERS[name]
        box = [first()]
        fn = lambda b, h, qi, ki: (qi - ki).abs() <= read(box[0])  # noqa: E731
        set_size = lambda n: box.__setitem__(0, make(n))  # noqa: E731
    for size in (2, 20):
        set_size(size)
        got = kf.attention(q, k, v, mask=fn, q_offset=0)
        want = kf.attention(q, k, v, mask=lambda b, h, qi, ki, w=size: (qi - ki).abs() <= w, q_offset=0)
        torch.testing.assert_close(got, want)


def test_a_buffers_key_is_a_digest_and_odd_values_do_not_raise():
    """A 20 MB bytearray's key held a copy of it per plan (600 MiB after 30 calls); a captured
    Decimal("sNaN") or a released memoryview made attention raise while hashing its key."""
    buf = bytearray(20 * 2 ** 20)
    fn = lambda b, h, qi, ki: (qi - ki).abs() <= 2 + buf[0]  # noqa: E731
    stamp = kf.masks.captured_stamp(fn)
    assert sum(len(x[-1]) for x in stamp if isinstance(x, tuple) and x and x[0] == "bytearray") < 100
    buf[0] = 1
    assert kf.masks.captured_stamp(fn) != stamp
    view = memoryview(b"ab")
    view.release()
    q, k, v = _qkv(1, 2, 16, seed=36)
    for odd in (decimal.Decimal("sNaN"), view):
        g = lambda b, h, qi, ki, o=odd: (qi - ki).abs() <= 2 if o is not None else qi >= ki  # noqa: E731
        torch.testing.assert_close(kf.attention(q, k, v, mask=g, q_offset=0),
                                   kf.attention(q, k, v, mask=lambda b, h, qi, ki: (qi - ki).abs() <= 2, q_offset=0))


@dataclasses.dataclass
class _Table:
    table: torch.Tensor


class _TableOnClass:
    table = None


_table_module = types.ModuleType("keyfold_test_table_config")


def _holders():
    yield "dataclass", lambda t: _Table(t), lambda p: (lambda s, b, h, qi, ki: s + p.table[h, qi, ki])
    yield "namespace", lambda t: types.SimpleNamespace(table=t), \
        lambda p: (lambda s, b, h, qi, ki: s + p.table[h, qi, ki])
    yield "class attribute", lambda t: setattr(_TableOnClass, "table", t), \
        lambda p: (lambda s, b, h, qi, ki: s + _TableOnClass.table[h, qi, ki])
    yield "module attribute", lambda t: setattr(_table_module, "table", t), \
        lambda p: (lambda s, b, h, qi, ki: s + _table_module.table[h, qi, ki])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("holder", [h[0] for h in _holders()])
def test_a_score_table_held_by_a_plain_object_class_or_module_gets_its_gradient(holder, backend):
    _, hold, make = next(h for h in _holders() if h[0] == holder)
    q, k, v = _qkv(1, 2, 16, seed=41)
    t64 = _rand(2, 16, 16, seed=42, dtype=torch.float64)
    dout = _rand(1, 2, 16, 16, seed=43, dtype=torch.float64)

    def grad(attn, q, k, v, table):
        table = table.detach().clone().requires_grad_(True)
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))  # as in training
        score = make(hold(table))
        out = attn(q, k, v, score)
        (g,) = torch.autograd.grad(out, table, dout.to(out.dtype))
        return g.double()

    try:
        got = grad(lambda q, k, v, s: kf.attention(q, k, v, score=s, backend=backend), q, k, v, t64.float())
        ref = grad(lambda q, k, v, s: kf.attention(q, k, v, score=s, backend=Backend.REFERENCE),
                   q.double(), k.double(), v.double(), t64)
        nai = grad(lambda q, k, v, s: naive_attention(q, k, v, score=s), q, k, v, t64.float())
    finally:
        _TableOnClass.table = None
        vars(_table_module).pop("table", None)
    assert float(got.abs().max()) > 0.1  # the table had no gradient at all before
    assert_close_by_rule(got.unsqueeze(0), ref.unsqueeze(0), nai.unsqueeze(0), None, factor=3.0, what="dtable")


def test_a_score_table_inside_a_large_captured_model_is_found():
    """An nn.Module is walked by its parameters, buffers, submodules and own attributes, not its hook
    tables: a model of 300 layers stays inside the walk's budget of objects (through every entry of
    each module's __dict__ it did not, and the table at its end would have had no gradient)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(300)])
    model[-1].table = table = torch.nn.Parameter(_rand(2, 8, 8, seed=51))  # a parameter of the last layer

    def score(s, b, h, qi, ki):
        return s + model[-1].table[h, qi, ki]

    assert _callables.captured(score)[1]  # the whole walk: a mask reading the model keeps its plan
    assert any(t is table for t in _callables.captured_tensors(score))
    q, k, v = (x.requires_grad_(True) for x in _qkv(1, 2, 8, seed=52))
    kf.attention(q, k, v, score=score, backend=Backend.TILES).sum().backward()
    assert table.grad is not None and float(table.grad.abs().max()) > 0


_log = logging.getLogger("keyfold.tests.window_module")


class _WindowModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._size = 2  # a private attribute: the walk keyed public ones only for a while (review)

    def forward(self, b, h, qi, ki):
        if self._size < 0:
            _log.warning("negative window")  # a module-level logger reaches every logger of the process
        return (qi - ki).abs() <= self._size


def test_a_mask_module_is_planned_again_when_its_attribute_changes():
    fn = _WindowModule()
    assert _callables.captured(fn)[1]  # complete: the logger is not walked into
    q, k, v = _qkv(1, 2, 48, seed=53)
    for size in (2, 30):
        fn._size = size
        _assert_band(fn, q, k, v, size)


def _assert_band(fn, q, k, v, size):
    """``fn`` as a mask gives the band ``|q - k| <= size`` by the rule (top-left positions)."""
    got = kf.attention(q, k, v, mask=fn, q_offset=0)
    band = lambda b, h, qi, ki: (qi - ki).abs() <= size  # noqa: E731
    ref = kf.attention(q.double(), k.double(), v.double(), mask=band, q_offset=0, backend=Backend.REFERENCE)
    assert_close_by_rule(got, ref, naive_attention(q, k, v, mask=band, q_offset=0), None, what=f"window {size}")


def test_a_table_after_a_model_past_the_walks_budget_still_gets_its_gradient():
    """Past its object budget the walk no longer keys a plan (complete False) but still finds the
    tensors that need gradients: it stopped at once, and a table captured after a 1,500-layer model
    (closure cells are walked in name order) had no gradient (review, 2026-12-06)."""
    big = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(1500)])
    table = _rand(2, 8, 8, seed=54).requires_grad_(True)

    def make():
        a_model, z_table = big, table
        return lambda s, b, h, qi, ki: s + z_table[h, qi, ki] + 0 * a_model[0].bias[0]

    score = make()
    assert not _callables.captured(score)[1]
    assert any(t is table for t in _callables.captured_tensors(score))


def _by_hand(q, k, v, scores_of, visible=None):
    """softmax(scores_of(q k^T / sqrt(D))) v in q's dtype, rows that see no key 0: a yardstick that
    shares none of keyfold's evaluation of callables."""
    s = scores_of(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return torch.nan_to_num(torch.softmax(s, -1)) @ v


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES])
def test_a_reduction_over_the_queries_first_met_on_one_query_is_checked_again_on_many(backend):
    """A Flex score_mod whose per-element code reduces (a learned per-query temperature,
    ``(tq[q_idx] * w).sum()``) and a mask_mod doing the same, first met on a one-query call (a decoding
    step, a warm-up): broadcast gave the one-query answer there, passed its checks, and was kept for
    later calls of 128 queries, where it summed over every query of the tile (out 0.74 off). A dim the
    checks never saw spread is checked when a tile spreads it (a review, 2026-12-07)."""
    g = torch.Generator().manual_seed(0)
    N, D, R = 128, 32, 4
    q, k, v = (torch.randn(1, 2, N, D, generator=g) for _ in range(3))
    tq, w = torch.randn(N, R, generator=g) * 0.3, torch.randn(R, generator=g) * 0.3
    tk = torch.randn(N, R, generator=g)

    def temperature(score, b, h, q_idx, kv_idx):
        return score * (1.0 + (tq[q_idx] * w).sum())

    def agree(b, h, q_idx, kv_idx):
        return (tq[q_idx] * tk[kv_idx]).sum() > -0.3

    kf.attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], score=temperature, mask=agree, q_offset=0, backend=backend)
    got = kf.attention(q, k, v, score=temperature, mask=agree, q_offset=0, backend=backend)
    vis = (tq @ tk.T) > -0.3
    assert bool(vis.any(-1).all()) and not bool(vis.all())
    ref = _by_hand(q.double(), k.double(), v.double(), lambda s: s * (1.0 + tq.double() @ w.double())[:, None], vis)
    naive = _by_hand(q, k, v, lambda s: s * (1.0 + tq @ w)[:, None], vis)
    assert_close_by_rule(got, ref, naive, None)


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES])
def test_a_closure_whose_captured_flag_takes_another_branch_is_checked_again(backend):
    """A score_mod factory called again with another config: the same code, the same captured shapes, so
    the broadcast choice made for ``cfg["temp"] = False`` was kept for ``True``, whose branch reduces per
    element (out 2.1 off). The plain values a callable captures are part of what the choice stands on
    (a review, 2026-12-07)."""
    g = torch.Generator().manual_seed(1)
    N, D, R = 128, 32, 4
    q, k, v = (torch.randn(1, 2, N, D, generator=g) for _ in range(3))
    rel = torch.randn(33, generator=g) * 0.5
    tq, w = torch.randn(N, R, generator=g) * 0.3, torch.randn(R, generator=g) * 0.3

    def make(cfg):
        def score_mod(score, b, h, q_idx, kv_idx):
            score = score + rel[(q_idx - kv_idx).clamp(-16, 16) + 16]
            if cfg["temp"]:
                score = score * (1.0 + (tq[q_idx] * w).sum())
            return score
        return score_mod

    kf.attention(q, k, v, score=make({"temp": False}), q_offset=0, backend=backend)
    got = kf.attention(q, k, v, score=make({"temp": True}), q_offset=0, backend=backend)
    i = torch.arange(N)
    bias = rel[(i[:, None] - i[None, :]).clamp(-16, 16) + 16]
    ref = _by_hand(q.double(), k.double(), v.double(),
                   lambda s: (s + bias.double()) * (1.0 + tq.double() @ w.double())[:, None])
    naive = _by_hand(q, k, v, lambda s: (s + bias) * (1.0 + tq @ w)[:, None])
    assert_close_by_rule(got, ref, naive, None)


def test_a_mask_reading_its_config_through_sys_modules_runs_and_follows_it():
    """``sys.modules["cfg"].W`` in a mask: the walk meets every loaded module, numpy.random's Cython
    classes among them, whose ``__module__`` is a descriptor: ``AttributeError: 'getset_descriptor'
    object has no attribute 'split'`` (a review, 2026-12-07). Now it runs, and a new W is a new plan."""
    import sys
    import numpy.random  # noqa: F401 - a Cython 3 module loaded, as in most programs
    cfg = types.ModuleType("_keyfold_test_cfg")
    cfg.W = 2
    sys.modules["_keyfold_test_cfg"] = cfg
    try:
        fn = lambda b, h, qi, ki: (qi - ki).abs() <= sys.modules["_keyfold_test_cfg"].W  # noqa: E731
        q, k, v = _qkv(1, 2, 48, seed=5)
        for w in (2, 30):
            cfg.W = w
            _assert_band(fn, q, k, v, w)
    finally:
        del sys.modules["_keyfold_test_cfg"]


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES])
def test_a_per_query_gate_that_agrees_at_the_first_and_last_query_is_still_evaluated_per_element(backend):
    """``where((g[q_idx] * w).sum() > 0, ...)``, Flex code per element, on its first call: broadcasting
    reduces over the whole tile to one gate; the checks sampled the first and last query only, where
    that gate happened to be right, and chose broadcast (out 0.78 off, mask 1.95). The checks now sample
    32 queries and keys spread over the tile (a review, 2026-12-07)."""
    g_ = torch.Generator().manual_seed(0)
    N, D, R = 64, 32, 4
    q, k, v = (torch.randn(1, 2, N, D, generator=g_) for _ in range(3))
    w = torch.randn(R, generator=g_)
    g = torch.randn(N, R, generator=g_)
    g[0] *= -torch.sign(g[0] @ w)
    g[-1] *= -torch.sign(g[-1] @ w)  # the first and last rows' gates shut, as the tile-wide one
    gate = g @ w
    assert gate[0] < 0 and gate[-1] < 0 and gate.sum() < 0 and 8 < int((gate > 0).sum()) < N - 8

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where((g[q_idx] * w).sum() > 0, score, 0.25 * score - 1.0)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((g[q_idx] * w).sum() > 0) | (kv_idx <= q_idx)

    got = kf.attention(q, k, v, score=score_mod, mask=mask_mod, q_offset=0, backend=backend)
    i = torch.arange(N)
    vis = (gate > 0)[:, None] | (i[None, :] <= i[:, None])
    ref = _by_hand(q.double(), k.double(), v.double(), lambda s: torch.where((gate > 0)[:, None], s, 0.25 * s - 1.0), vis)
    naive = _by_hand(q, k, v, lambda s: torch.where((gate > 0)[:, None], s, 0.25 * s - 1.0), vis)
    assert_close_by_rule(got, ref, naive, None)


@dataclasses.dataclass(slots=True)
class _SlottedCfg:
    per_key: bool


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES])
def test_a_closure_over_a_slotted_config_is_checked_again_when_its_fields_differ(backend):
    """Closures of one code over ``dataclass(slots=True)`` configs: the walk could not see inside a
    slotted object, so the stamp of the broadcast choice made for ``per_key=False`` matched the
    ``per_key=True`` closure, whose per-element ``(tab[kv_idx] * w).sum()`` then summed the whole tile
    (a review, 2026-12-07). The walk reads slots; a walk that cannot see everything never matches."""
    g = torch.Generator().manual_seed(4)
    tab, w = torch.randn(64, 8, generator=g), torch.randn(8, generator=g)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))

    def make(cfg):
        def score_mod(score, b, h, q_idx, kv_idx):
            if cfg.per_key:
                return score + (tab[kv_idx] * w).sum()
            return score + 0.1 * (q_idx - kv_idx)
        return score_mod

    def mask_of(cfg):
        def mask_mod(b, h, q_idx, kv_idx):
            if cfg.per_key:
                return ((tab[kv_idx] * w).sum() > 0) | (q_idx == kv_idx)
            return q_idx >= kv_idx
        return mask_mod

    kf.attention(q, k, v, score=make(_SlottedCfg(False)), mask=mask_of(_SlottedCfg(False)), q_offset=0, backend=backend)
    got = kf.attention(q, k, v, score=make(_SlottedCfg(True)), mask=mask_of(_SlottedCfg(True)), q_offset=0,
                       backend=backend)
    bias = tab[:16] @ w
    i = torch.arange(16)
    vis = (bias > 0)[None, :] | (i[:, None] == i[None, :])
    assert not bool(vis.all())
    ref = _by_hand(q.double(), k.double(), v.double(), lambda s: s + bias.double(), vis)
    assert_close_by_rule(got, ref, _by_hand(q, k, v, lambda s: s + bias, vis), None)


def test_a_per_head_gate_that_agrees_at_the_first_and_last_head_is_still_evaluated_per_element():
    """The head's twin of the per-query gate: b and h were sampled at their first and last index, so a
    gate open at heads 0 and 3 and shut between was taken for broadcast (heads 1 and 2 off by 1.6-1.8;
    a review, 2026-12-07). Batch entries and heads are sampled at up to 8 spread indices now."""
    g = torch.Generator().manual_seed(5)
    H, N = 4, 64
    gate, w = torch.tensor([[1.0], [-0.5], [-0.2], [1.0]]), torch.ones(1)
    q, k, v = (torch.randn(1, H, N, 16, generator=g) for _ in range(3))

    def mask_mod(b, h, q_idx, kv_idx):
        return (((gate[h] * w).sum() > 0) & (kv_idx < 40)) | (q_idx >= kv_idx)

    got = kf.attention(q, k, v, mask=mask_mod, q_offset=0, backend=Backend.TILES)
    i = torch.arange(N)
    vis = torch.stack([((gate[h] @ w) > 0) & (i[None, :] < 40) | (i[:, None] >= i[None, :]) for h in range(H)])[None]
    ref = _by_hand(q.double(), k.double(), v.double(), lambda s: s, vis)
    assert_close_by_rule(got, ref, _by_hand(q, k, v, lambda s: s, vis), None)


def test_a_table_read_through_sys_modules_gets_its_gradient():
    """The walk's look-ups of module attributes, bounded since 2026-12-07, spent the bound on the module
    names ``sys.modules`` holds as strings before the names the code reads: the table was not found
    and got no gradient (a review, 2026-12-07). Names code reads are looked up first."""
    import sys
    mod = types.ModuleType("_keyfold_test_tables")
    mod.bias = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(6)) * 0.5)
    sys.modules["_keyfold_test_tables"] = mod
    try:
        def score_mod(s, b, h, q_idx, kv_idx):
            return s + sys.modules["_keyfold_test_tables"].bias[kv_idx]

        g = torch.Generator().manual_seed(7)
        q, k, v, do = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(4))
        if not any(t is mod.bias for t in _callables.captured_tensors(score_mod)):
            # a program with many more modules loaded (the whole suite in one worker): past the walk's
            # bound, which keyfold says instead of leaving the table without a gradient
            with pytest.raises(ValueError, match="tensors=\\[table\\]"):
                kf.attention(q, k, v, score=score_mod, backend=Backend.TILES)
            return
        (kf.attention(q, k, v, score=score_mod, backend=Backend.TILES) * do).sum().backward()

        def plain(dt):
            bias = mod.bias.detach().to(dt).requires_grad_()
            o = torch.softmax((q.to(dt) @ k.to(dt).transpose(-1, -2)) * 8 ** -0.5 + bias, -1) @ v.to(dt)
            (o * do.to(dt)).sum().backward()
            return bias.grad
        assert mod.bias.grad is not None
        assert_close_by_rule(mod.bias.grad, plain(torch.float64), plain(torch.float32), None, factor=3.0)
    finally:
        del sys.modules["_keyfold_test_tables"]


def test_closures_of_one_code_over_different_configs_keep_their_own_choice(monkeypatch):
    """Four layers' closures of one score code, each over its own config dict, called in turn: with one
    remembered choice a key, each replaced the last one's and every call decided again (48 decisions in
    12 steps; 1.3-1.9x a decode step's time; a review, 2026-12-07). One choice per stamp: 4 decisions."""
    decided = []
    real = _callables._decide
    monkeypatch.setattr(_callables, "_decide", lambda fn, *a, **kw: decided.append(fn) or real(fn, *a, **kw))
    rel = torch.randn(33, generator=torch.Generator().manual_seed(8))

    def make(cfg):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score * cfg["temperature"] + rel[(q_idx - kv_idx).clamp(-16, 16) + 16]
        return score_mod

    layers = [make({"temperature": t}) for t in (0.5, 0.8, 1.3, 2.0)]
    q, k, v = _qkv(1, 2, 48, seed=9)
    for _ in range(12):
        for fn in layers:
            kf.attention(q, k, v, score=fn, q_offset=0, backend=Backend.TILES)
    assert len(decided) == 4
    assert all(_callables.mode_of(fn) is _callables.Mode.BROADCAST for fn in layers)


def test_a_trained_tensor_past_the_walks_bound_is_an_error_not_a_missing_gradient(monkeypatch):
    """Where the walk gives up before a tensor the callable reads and that tensor requires grad, its
    gradient was silently None (a review, 2026-12-07, through sys.modules in the whole suite's process).
    A probe call finds that the output needs a gradient none of the found tensors gives: ValueError."""
    table = torch.nn.Parameter(torch.randn(16))
    holder = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(table=table)))

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + holder.a.b.table[kv_idx]

    q, k, v = _qkv(1, 2, 16, seed=10)
    monkeypatch.setattr(_callables, "_MAX_DEPTH", 1)  # the walk stops before the table
    assert not _callables.captured(score_mod)[1]
    with pytest.raises(ValueError, match="gave up before finding it"):
        kf.attention(q, k, v, score=score_mod, backend=Backend.TILES)
    other = torch.nn.Parameter(torch.zeros(16))  # a trained tensor the walk does find is not the table

    def with_another(s, b, h, q_idx, kv_idx):
        return s + other[kv_idx] + holder.a.b.table[kv_idx]
    with pytest.raises(ValueError, match="gave up before finding it"):
        kf.attention(q, k, v, score=with_another, backend=Backend.TILES)
    with torch.no_grad():  # no gradient asked: nothing to miss
        kf.attention(q, k, v, score=score_mod, backend=Backend.TILES)
    got = kf.attention(q, k, v, score=kf.score_fn(score_mod, tensors=[table]), backend=Backend.TILES)
    got.sum().backward()
    assert table.grad is not None and bool(table.grad.abs().sum() > 0)


# ------------------------------------------------ reductions over the grid, seen in the code itself


def _unsampled(n: int) -> torch.Tensor:
    """The query rows of an n-row tile that the sampled check never looks at."""
    picked = _callables._sample_index([torch.arange(1), torch.arange(1), torch.arange(n), torch.arange(n)])[2]
    rows = torch.ones(n, dtype=torch.bool)
    rows[picked] = False
    assert rows.any()
    return rows


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.TILES])
def test_a_gate_summed_over_the_tile_that_agrees_at_every_sampled_point_is_still_per_element(backend):
    """A per-element gate ``g[q_idx].sum() > 0`` (Flex: one row's own value) broadcast over a tile sums
    the whole tile. With g positive at every row the sampled check looks at and slightly negative at
    the others, the broadcast answer agreed at every sampled point, the causal part made the points
    informative, and broadcast was chosen: the gated-off rows saw every earlier key, 3.78 off (found by
    reasoning about the sampling, 2026-12-07). The broadcast call is now watched for reductions over the
    grid's dims (``_callables._GridWatch``): per element at once."""
    n = 256
    g = torch.ones(n)
    g[_unsampled(n)] = -0.01
    assert float(g.sum()) > 0

    def mask_mod(b, h, q_idx, kv_idx):
        return (g[q_idx].sum() > 0) & (q_idx >= kv_idx) | (kv_idx == 0)
    q, k, v = _qkv(1, 1, n)
    got = kf.attention(q, k, v, mask=mask_mod, backend=backend)
    i = torch.arange(n)
    vis = ((g > 0)[:, None] & (i[:, None] >= i[None, :])) | (i[None, :] == 0)
    ref = _by_hand(q.double(), k.double(), v.double(), lambda s: s, vis)
    assert_close_by_rule(got, ref, _by_hand(q, k, v, lambda s: s, vis), None)
    assert _callables.mode_of(mask_mod) is _callables.Mode.ELEMENT


def test_a_score_term_reduced_over_the_tile_that_agrees_at_every_sampled_point_is_still_per_element():
    """The score twin: ``s + 0.5 * g[q_idx].amax()`` is the row's own value per element; broadcast, the
    tile's maximum. With g at its maximum on every sampled row and lower elsewhere, the points agreed and
    varied (the scores do), and the unsampled rows got the wrong bias (2026-12-07)."""
    n = 256
    g = torch.full((n,), 2.0)
    g[_unsampled(n)] = -3.0

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + 0.5 * g[q_idx].amax() * (kv_idx % 3 == 0)
    q, k, v = _qkv(1, 1, n)
    got = kf.attention(q, k, v, score=score_mod, backend=Backend.TILES)
    bias = 0.5 * g[:, None] * (torch.arange(n)[None, :] % 3 == 0)
    ref = _by_hand(q.double(), k.double(), v.double(), lambda s: s + bias.double())
    assert_close_by_rule(got, ref, _by_hand(q, k, v, lambda s: s + bias), None)
    assert _callables.mode_of(score_mod) is _callables.Mode.ELEMENT


_TAB_X, _TAB_Y = _rand(64, 8, seed=90), _rand(64, 8, seed=91)
_KEPT_BROADCAST = {  # reductions over what is not the grid: broadcast gives Flex's answer, and runs as fast
    "sum over the table's last dim": lambda b, h, q, k: ((_TAB_X[q] * _TAB_Y[k]).sum(-1) > 0) | (q == k),
    "einsum with an ellipsis": lambda b, h, q, k: (torch.einsum("...d,...d->...", _TAB_X[q], _TAB_Y[k]) > 0) | (q == k),
    "elementwise max of two tensors": lambda b, h, q, k: torch.max(q, k) - torch.min(q, k) < 9,
    "stack on a new last dim, any over it": lambda b, h, q, k: torch.stack(torch.broadcast_tensors(q >= k, k == 0), -1).any(-1),
    "matmul over the table's dim": lambda b, h, q, k: ((_TAB_X[q] * _TAB_Y[k]).unsqueeze(-2) @ torch.ones(8, 1)).squeeze(-1).squeeze(-1) > 0,
}
_SENT_PER_ELEMENT = {  # per-element code reducing over the whole tile when broadcast
    "sum()": lambda b, h, q, k: ((_TAB_X[q] * _TAB_Y[k]).sum() > 0) | (q >= k),
    "any()": lambda b, h, q, k: (_TAB_X[q] > 2.5).any() | (q >= k),
    "einsum d,d->": lambda b, h, q, k: (torch.einsum("...d,...d->", _TAB_X[q], _TAB_Y[k]) > 0) | (q >= k),
    "amax over the last dim, then over all": lambda b, h, q, k: (_TAB_X[q].amax(-1).amax() > 1) | (q >= k),
    "torch.max(x) of one tensor": lambda b, h, q, k: (torch.max(_TAB_X[q]) > 1) | (q >= k),
    "norm()": lambda b, h, q, k: (_TAB_X[q].norm() > 30) | (q >= k),
}


@pytest.mark.parametrize("name,fn,mode", [(n, f, _callables.Mode.BROADCAST) for n, f in sorted(_KEPT_BROADCAST.items())]
                         + [(n, f, _callables.Mode.ELEMENT) for n, f in sorted(_SENT_PER_ELEMENT.items())],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_a_reduction_goes_per_element_exactly_when_it_spans_grid_points(name, fn, mode):
    """Flex's answer either way; broadcast kept for reductions over a table's own dims, per element for
    reductions over the grid's (``_callables._GridWatch``)."""
    q, k, v = _qkv(1, 2, 64)
    got = kf.attention(q, k, v, mask=fn, q_offset=0, backend=Backend.TILES)
    torch.testing.assert_close(got, _flex(q, k, v, mask_mod=fn), atol=2e-5, rtol=1e-4)
    assert _callables.mode_of(fn) is mode


# ------------------------------------------------- torch's and_masks / or_masks, in-place writes (2026-12-08)

def _dense_of(fn, N):
    """The mask per element, by plain Python (the meaning Flex gives a mask_mod)."""
    i = torch.arange(N)
    z = torch.zeros((), dtype=torch.long)
    return torch.tensor([[bool(fn(z, z, i[a], i[c])) for c in range(N)] for a in range(N)])


def test_torchs_and_masks_follow_what_their_inner_masks_read():
    """A mask built once with torch's and_masks / or_masks over a mask reading a tensor changed in place
    kept its first plan (2.75 / 2.4 off Flex): the walk skipped the library's closure whole. And the
    broadcast choice made for one and_masks served a later one whose inner mask reduces per element
    (1.91 off): every and_masks is the same code."""
    from torch.nn.attention.flex_attention import and_masks, or_masks
    N = 48
    q, k, v = (torch.randn(1, 2, N, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    doc = torch.zeros(N, dtype=torch.long)
    x, y = torch.randn(N, 4), torch.randn(N, 4)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 5

    def gate(b, h, q_idx, kv_idx):
        return (x[q_idx] * y[kv_idx]).sum() > 0

    for combine in (and_masks, or_masks):
        mask = combine(causal, same_doc)
        for cut in (30, 11):
            doc.copy_((torch.arange(N) >= cut).long())
            got = kf.attention(q, k, v, mask=mask, q_offset=0)
            want = kf.attention(q, k, v, mask=_dense_of(mask, N))
            torch.testing.assert_close(got, want)
    first, second = and_masks(causal, near), and_masks(causal, gate)
    torch.testing.assert_close(kf.attention(q, k, v, mask=first, q_offset=0),
                               kf.attention(q, k, v, mask=_dense_of(first, N)))
    torch.testing.assert_close(kf.attention(q, k, v, mask=second, q_offset=0),
                               kf.attention(q, k, v, mask=_dense_of(second, N)))


@pytest.mark.parametrize("backend", [kf.Backend.AUTO, kf.Backend.TILES, kf.Backend.REFERENCE])
def test_a_score_callable_writing_its_scores_in_place_raises(backend):
    """score += bias was applied twice (the checks call the modifier again on the same scores): 1.0-3.4
    off, silently. Compiled Flex raises for it; keyfold now does too."""
    q, k, v = (torch.randn(1, 2, 32, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    bias = torch.randn(63)

    def plus_eq(score, b, h, q_idx, kv_idx):
        score += bias[q_idx - kv_idx + 31]
        return score

    with pytest.raises(ValueError, match="in place"):
        kf.attention(q, k, v, score=plus_eq, backend=backend)
    out = kf.attention(q, k, v, score=lambda s, b, h, qi, ki: s + bias[qi - ki + 31], backend=backend)
    want = kf.attention(q.double(), k.double(), v.double(), score=lambda s, b, h, qi, ki: s + bias.double()[qi - ki + 31],
                        backend=kf.Backend.REFERENCE)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_callables_writing_their_positions_in_place_touch_nothing_else():
    """A score shifting q_idx in place moved the mask's positions on the reference backend (2.2-3.8 off);
    a mask doing q_idx += offset wrote into the cached probe grid, and later masks raised IndexError."""
    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def shifted(score, b, h, q_idx, kv_idx):
        q_idx += 7
        return score - 0.1 * (q_idx - kv_idx).abs()

    for mask in (kf.causal(), kf.window(5)):
        want = kf.attention(q, k, v, mask=mask, score=shifted, backend=kf.Backend.TILES)
        torch.testing.assert_close(kf.attention(q, k, v, mask=mask, score=shifted, backend=kf.Backend.REFERENCE), want)

    def ahead(b, h, q_idx, kv_idx):
        q_idx += 1000
        return q_idx >= kv_idx

    doc = (torch.arange(40) >= 17).long()
    for _ in range(3):
        kf.attention(q, k, v, mask=ahead)
    out = kf.attention(q, k, v, mask=lambda b, h, qi, ki: doc[qi] == doc[ki])
    torch.testing.assert_close(out, kf.attention(q, k, v, mask=kf.documents(doc)))


@pytest.mark.parametrize("backend", [kf.Backend.REFERENCE, kf.Backend.AUTO, kf.Backend.CPU, kf.Backend.TILES])
def test_an_empty_query_with_a_callable_mask_gives_an_empty_output(backend):
    """The mask's grid took max(1, 0) = 1 row for an empty query: the reference backend raised "does not fit
    the grid" (and `python -m keyfold verify faults`, as the README prints it, counted 6 wrong answers); the
    other backends and SDPA give the empty output (a review, 2026-12-08)."""
    for score in (None, kf.alibi(kf.alibi_slopes(1))):
        q, k, v = (torch.randn(1, 1, n, d, requires_grad=True) for n, d in ((0, 8), (7, 8), (7, 11)))
        st = kf.attend(q, k, v, mask=lambda b, h, qi, ki: (qi - ki) % 3 != 1, score=score, q_offset=7, backend=backend)
        assert tuple(st.out.shape) == (1, 1, 0, 11) and tuple(st.lse.shape) == (1, 1, 0)
        (st.out.sum() + st.lse.sum()).backward()
        assert bool((k.grad == 0).all()) and bool((v.grad == 0).all())


def test_in_place_writes_are_caught_under_inference_mode_and_presets_watch_views_and_inference_tensors():
    """Under torch.inference_mode the scores keep no version counter: a score_mod's score += bias was applied
    twice again (1.59 off). A preset built from a view of a buffer (varlen(cu_buf[:3]), ids.view(1, -1)) or
    from an inference tensor was never watched, and varlen(cu) & window(w) composed after a change took the
    tensors' new values as its watch (2.3 off each, silently; a review, 2026-12-08)."""
    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    bias = torch.randn(16, 16)

    def plus_eq(score, b, h, q_idx, kv_idx):
        score += bias[q_idx, kv_idx]
        return score

    with torch.inference_mode():
        with pytest.raises(ValueError, match="in place"):
            kf.attention(q, k, v, score=plus_eq)
        nan_q = q.clone()
        nan_q[0, 0, 3] = float("nan")  # NaN scores are no write
        kf.attention(nan_q, k, v, score=lambda s, b, h, qi, ki: s + bias[qi, ki])

    cu_buf = torch.tensor([0, 8, 16, 16])
    mask = kf.varlen(cu_buf[:3], causal=True)
    kf.attention(q, k, v, mask=mask)
    cu_buf[1] = 4
    with pytest.raises(ValueError, match="changed in place"):
        kf.attention(q, k, v, mask=mask)
    cu = torch.tensor([0, 8, 16])
    mask = kf.varlen(cu, causal=True)
    cu[1] = 4
    with pytest.raises(ValueError, match="changed in place"):
        kf.attention(q, k, v, mask=mask & kf.window(3))
    with torch.inference_mode():
        ids = (torch.arange(16) >= 8).long()
        mask = kf.documents(ids)
        kf.attention(q, k, v, mask=mask)
        ids[4:] = 1
        with pytest.raises(ValueError, match="changed in place"):
            kf.attention(q, k, v, mask=mask)


@pytest.mark.parametrize("kw", [dict(mask=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) and (kv_idx >= 0)),
                                dict(mask=lambda b, h, q_idx, kv_idx: 0 <= kv_idx <= q_idx),
                                dict(score=lambda s, b, h, q_idx, kv_idx: s if q_idx > kv_idx else s * 0)])
def test_a_callable_with_python_control_flow_on_tensors_says_what_to_write(kw):
    """Python's `and`, a comparison chain or an `if` on a tensor raised torch's vmap message asking to file an
    issue at pytorch (a review, 2026-12-08); Flex refuses these too. keyfold names the operators to use."""
    q = torch.randn(1, 2, 48, 16)
    with pytest.raises(TypeError, match=r"Python control flow.*`&`, `\|`, `~`"):
        kf.attention(q, q, q, **kw)
