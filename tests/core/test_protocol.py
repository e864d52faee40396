"""The open mask and score protocol (issue #17): a mask class defined outside keyfold plans and
runs on every backend, and the backends dispatch on the protocol, not on keyfold's classes."""

from __future__ import annotations

import pytest
import torch

import keyfold as kf
from keyfold import Backend, BlockKind, Logic, Mask, MaskKind
from keyfold.kernels._common import Problem
from keyfold.kernels.reference import attend_reference
from tests.helpers import assert_backward_by_rule, assert_forward_by_rule


class DilatedWindow(Mask):
    """A user's mask: keys 0..width positions back whose distance is a multiple of ``step``
    (a LongNet-style dilated local window), with a closed-form block classification."""

    translation_invariant = True

    def __init__(self, width: int, step: int):
        self.width, self.step = width, step

    def evaluate(self, b, h, qp, kp):
        d = qp - kp
        return (d >= 0) & (d <= self.width) & (d % self.step == 0)

    def classify(self, q0, q1, k0, k1):
        # EMPTY when every distance in the rectangle is outside [0, width]; never FULL unless
        # step == 1 and the whole rectangle lies inside the band.
        dmin, dmax = q0 - (k1 - 1), (q1 - 1) - k0
        empty = (dmax < 0) | (dmin > self.width)
        full = (dmin >= 0) & (dmax <= self.width) & (self.step == 1)
        out = torch.full(torch.broadcast_shapes(empty.shape, full.shape), int(BlockKind.PARTIAL), dtype=torch.int8)
        out[empty] = int(BlockKind.EMPTY)
        out[full] = int(BlockKind.FULL)
        return out

    def __eq__(self, other):
        return type(other) is DilatedWindow and (self.width, self.step) == (other.width, other.step)

    def __hash__(self):
        return hash(("DilatedWindow", self.width, self.step))

    def __repr__(self):
        return f"DilatedWindow({self.width}, {self.step})"


def _qkv(dtype, B=2, H=2, N=300, D=16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(3))


@pytest.mark.parametrize("backend", [Backend.CPU, Backend.TILES])
@pytest.mark.parametrize("mask", [DilatedWindow(64, 3), DilatedWindow(64, 3) | kf.sinks(2),
                                  ~DilatedWindow(100, 1) & kf.causal()])
def test_user_mask_class_runs_by_the_rule(backend, mask):
    q, k, v = _qkv(torch.float32)
    p = kf.plan(mask, 300, 300, block_size=32)
    assert p.counts()["empty"] > 0  # the planner used the class's own classification to skip work
    assert_forward_by_rule(q, k, v, mask=mask, backend=backend)
    assert_backward_by_rule(q, k, v, mask=mask, backend=backend)


def test_user_mask_plan_cache_hits_by_content():
    kf.clear_plan_cache()
    kf.plan(DilatedWindow(32, 2), 256, 256)
    hits = kf.planner.plan_cache_stats()["hits"]
    kf.plan(DilatedWindow(32, 2), 256, 256)  # another object, equal content
    assert kf.planner.plan_cache_stats()["hits"] == hits + 1


def test_presets_describe_themselves():
    assert kf.causal().spec() == (MaskKind.CAUSAL, {})
    assert kf.window(4, 1).spec() == (MaskKind.WINDOW, {"left": 4, "right": 1})
    assert (kf.causal() & kf.window(3)).operands()[0] is Logic.AND
    assert (kf.causal() | kf.sinks(3)).operands()[0] is Logic.OR
    assert (~kf.causal()).operands() == (Logic.NOT, (kf.causal(),))
    assert kf.prefix(3).operands()[0] is Logic.OR  # a preset built from others
    assert DilatedWindow(3, 2).spec() is None and DilatedWindow(3, 2).operands() is None
    assert kf.softcap(5.0).spec() == (kf.ScoreKind.SOFTCAP, {"cap": 5.0})
    chain = kf.as_score([kf.alibi(kf.alibi_slopes(2)), kf.softcap(5.0)])
    assert [m.spec()[0] for m in chain.parts()] == [kf.ScoreKind.ALIBI, kf.ScoreKind.SOFTCAP]


def test_no_backend_tests_keyfolds_private_classes():
    """The dispatch is on the protocol: no module outside masks.py / scores.py names their
    private classes (this is what lets a user's class reach every backend)."""
    import pathlib
    import re
    root = pathlib.Path(kf.__file__).parent
    private = re.compile(r"\b_(Causal|Window|Sinks|Documents|BlockSparse|Dilated|And|Or|Not|Full|Prefix|"
                         r"Alibi|Softcap|Chain)\b")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name not in ("masks.py", "scores.py") and private.search(p.read_text())]
    assert offenders == []


def test_reference_is_the_oracle_for_the_user_mask():
    """The reference backend evaluates the class directly: every row's visible keys are exactly
    those of the definition (a row that sees none is exactly zero)."""
    q, k, v = _qkv(torch.float64, B=1, H=1, N=40)
    m = DilatedWindow(5, 7)
    st = attend_reference(q, k, v, Problem(m, None, 0.25, 0, 0))
    i = torch.arange(40)
    vis = m.evaluate(None, None, i.view(-1, 1), i.view(1, -1))
    s = (q[0, 0] @ k[0, 0].T * 0.25).masked_fill(~vis, float("-inf"))
    torch.testing.assert_close(st.out[0, 0], torch.softmax(s, -1) @ v[0, 0])


def test_plan_compares_by_identity_and_exposes_only_public_settings():
    """Plan holds tensors, so field equality was elementwise (and its hash broken); it compares by
    identity now, and plan() takes only what a user sets (issue #17)."""
    import inspect
    kf.clear_plan_cache()
    a = kf.plan(kf.causal() & kf.window(8), 64, 64, block_size=16)
    assert a is kf.plan(kf.causal() & kf.window(8), 64, 64, block_size=16)  # a cache hit is the same object
    kf.clear_plan_cache()
    b = kf.plan(kf.causal() & kf.window(8), 64, 64, block_size=16)
    assert a != b and a == a and hash(a) == hash(a) and len({a, b}) == 2
    params = set(inspect.signature(kf.plan).parameters)
    assert params == {"mask", "Nq", "Nk", "q_offset", "kv_offset", "B", "H", "block_size"}


class Lookback(Mask):
    """A user's mask that reads the head and the batch entry: query i sees key i - 300 h - 7 b
    only, and nothing else (the protocol's minimum: evaluate, ==, hash; no depends_on_batch_head)."""

    def evaluate(self, b, h, qp, kp):
        return qp - kp == 300 * h + 7 * b

    def __eq__(self, other):
        return type(other) is Lookback

    def __hash__(self):
        return hash("Lookback")


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.CPU, Backend.TILES])
@pytest.mark.parametrize("block_size", [None, 3, 7, 64])
def test_user_mask_that_reads_the_head_is_planned_per_head(backend, block_size):
    """Planned from batch 0, head 0 only (the default said the mask read neither), the other heads'
    rows that see a key came back 0: error 4.1 (fuzzing, 2026-12-05). The default now asks evaluate."""
    assert Lookback().depends_on_batch_head(2, 2) == (True, True)
    q, k, v = _qkv(torch.float32, B=2, H=2, N=400)
    assert_forward_by_rule(q, k, v, mask=Lookback(), q_offset=0, backend=backend, block_size=block_size)


def test_a_probe_the_mask_cannot_answer_counts_as_reading_both():
    lengths = torch.tensor([5])

    class Short(Mask):  # lengths[b] for b = 1 raises: planned per entry and head, always right
        def evaluate(self, b, h, qp, kp):
            return kp < lengths[b]
    assert Short().depends_on_batch_head(2, 2) == (True, True)
    assert Short().depends_on_batch_head(1, 1) == (False, False)


class TensorEq(Mask):
    """A user's mask whose __eq__ returns a tensor (as a dataclass of tensors would): keyfold must
    never ask it (review, 2026-12-05: the batch/head probe's cache called it and raised)."""

    def __init__(self, ids):
        self.ids = ids

    def evaluate(self, b, h, qp, kp):
        return self.ids[qp] == self.ids[kp]

    def __eq__(self, other):
        return self.ids == other.ids  # a tensor, not a bool

    def __hash__(self):
        return id(self)


def test_a_mask_whose_eq_returns_a_tensor_runs():
    ids = torch.arange(300) // 50
    q, k, v = _qkv(torch.float32, B=1, H=2)
    m = TensorEq(ids)
    assert m.depends_on_batch_head(1, 2) == (False, False)
    assert_forward_by_rule(q, k, v, mask=m, q_offset=0, backend=Backend.CPU)


class InPlaceBias(kf.ScoreMod):
    """An additive modifier whose apply works in place on the scores it is given, which
    docs/masks.md promises are (B, H, L, S)-broadcastable tiles, never a 0-d scalar."""

    additive = True

    def bias(self, b, h, qp, kp):
        return 0.01 * (qp - kp).abs().to(torch.float32) * (h + 1)

    def apply(self, s, b, h, qp, kp):
        out = s.clone()
        out += self.bias(b, h, qp, kp).to(s.dtype)
        return out


@pytest.mark.parametrize("backend", [Backend.CPU, Backend.TILES])
def test_float64_additive_user_modifier_with_an_in_place_apply(backend):
    """float64 inputs take the modifier's bias through apply (in float64, review of 2026-12-05):
    on a tile of zeros of the tile's shape, not a 0-d tensor, which an in-place apply cannot take."""
    q, k, v = _qkv(torch.float64, B=1, H=2, N=64)
    assert_forward_by_rule(q, k, v, score=InPlaceBias(), mask=kf.causal(), backend=backend)
