"""keyfold.views: one mask view and one score view for every remap the walls need (striped
positions, head slices, a slice of the batch, cascade's folded rows), held to the inner mask
or score evaluated at the true indices."""

from __future__ import annotations

import pytest
import torch

import keyfold as kf
from keyfold import Backend, BlockKind
from keyfold.masks import grid_positions
from keyfold.views import MaskView, Remap, RowTable, ScoreView, heads_slice, span_kinds
from tests.helpers import assert_backward_by_rule, assert_forward_by_rule

N, P = 40, 4


def _striped(mask, a, b):
    """Rank a's queries against rank b's keys of a STRIPED split of N over P, and their positions."""
    qidx, kidx = torch.arange(a, N, P), torch.arange(b, N, P)
    return MaskView(mask, Remap(q=(a, P), k=(b, P))), qidx, kidx


MASKS = [kf.causal(), kf.causal() & kf.window(7), kf.window(5, 3) | kf.sinks(2), kf.dilated(3),
         kf.documents(torch.arange(N) // 13) & kf.causal(), lambda b, h, q, k: (q - k) % 5 < 2]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("a,b", [(1, 0), (0, 3), (2, 2)])
def test_striped_view_is_the_inner_mask_at_true_positions(mask, a, b):
    inner = kf.as_mask(mask)
    view, qidx, kidx = _striped(inner, a, b)
    want = inner.to_dense(N, N, q_offset=0)[qidx][:, kidx]
    assert torch.equal(view.to_dense(len(qidx), len(kidx), q_offset=0), want)
    # classification is sound on every tile: EMPTY / FULL only where the dense view says so
    edges = torch.arange(0, len(qidx) + 1, 3).clamp(max=len(qidx))
    kinds = view.classify(edges[:-1].view(-1, 1), edges[1:].view(-1, 1), edges[:-1].view(1, -1), edges[1:].view(1, -1))
    if kinds is None:
        return
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            tile = want[edges[i]:edges[i + 1], edges[j]:edges[j + 1]]
            if int(kinds[i, j]) == int(BlockKind.EMPTY):
                assert not tile.any()
            elif int(kinds[i, j]) == int(BlockKind.FULL):
                assert tile.all()


def test_head_and_batch_remaps():
    layout = torch.rand(4, 5, 5, generator=torch.Generator().manual_seed(1)) < 0.5  # per head
    inner = kf.block_sparse(layout, 8) & kf.sinks(torch.tensor([3, 9, 20]))      # per head and batch
    whole = inner.to_dense(N, N, q_offset=0, B=3, H=4)                              # (3, 4, N, N)
    view = MaskView(inner, Remap(h0=2, batch=(3, 1)), n_batch=2)
    got = view.to_dense(N, N, q_offset=0, B=2, H=2)
    assert torch.equal(got, whole[1:3, 2:4])
    with pytest.raises(ValueError, match="n_batch"):
        MaskView(inner, Remap(batch=(3, 1)))


def test_row_table_keeps_each_row_its_request():
    inner = kf.sinks(torch.tensor([2, 6])) | kf.causal()
    pos, req = torch.tensor([10, 11, 4, 5]), torch.tensor([0, 0, 1, 1])
    view = MaskView(inner, Remap(rows=RowTable(pos, req, 2)))
    got = view.to_dense(4, 16, q_offset=0)
    whole = inner.to_dense(16, 16, q_offset=0, B=2)                                 # (2, 1, 16, 16)
    want = torch.stack([whole[r, 0, p] for p, r in zip(pos.tolist(), req.tolist())])
    assert torch.equal(got, want)
    assert view.depends_on_batch_head(2, 1) == (False, False)
    with pytest.raises(ValueError, match="row table"):
        Remap(q=(1, 2), rows=RowTable(pos, req, 2))


def test_score_view_shifts_positions_heads_batch_and_rows():
    slopes = torch.rand(3, 4) + 0.1                                                 # per batch and head
    inner = kf.alibi(slopes)
    b, h, qp, kp = grid_positions(3, 4, 0, N, 0, N, None)
    whole = inner.bias(b, h, qp, kp)                                                # (3, 4, N, N)
    qidx, kidx = torch.arange(1, N, P), torch.arange(3, N, P)
    sv = ScoreView(inner, Remap(q=(1, P), k=(3, P), batch=(3, 1)))
    lb, lh, lq, lk = grid_positions(2, 4, 0, len(qidx), 0, len(kidx), None)
    assert torch.equal(sv.bias(lb, lh, lq, lk), whole[1:3][:, :, qidx][:, :, :, kidx])
    assert sv.additive
    # a head slice: ALiBi keeps its heads' slopes, a callable sees shifted head indices
    fn = kf.score_fn(lambda s, b, h, q, k: s + h.float())
    sliced = ScoreView(heads_slice(fn, 2, 4), Remap(h0=2))
    s = torch.zeros(1, 2, 1, 1)
    assert sliced.apply(s, *grid_positions(1, 2, 0, 1, 0, 1, None)).view(-1).tolist() == [2.0, 3.0]
    assert heads_slice(kf.alibi(slopes[0]), 1, 3) == kf.alibi(slopes[0, 1:3])
    # folded rows: b is each row's request, qp its true position
    rows = ScoreView(kf.score_fn(lambda s, b, h, q, k: s + 100 * b + q), Remap(rows=RowTable(
        torch.tensor([7, 3]), torch.tensor([0, 1]), 2)))
    out = rows.apply(torch.zeros(1, 1, 2, 1), *grid_positions(1, 1, 0, 2, 0, 1, None))
    assert out.view(-1).tolist() == [7.0, 103.0]


def test_views_are_values():
    a = MaskView(kf.causal(), Remap(q=(1, 4), k=(0, 4)))
    assert a == MaskView(kf.causal(), Remap(q=(1, 4), k=(0, 4)))
    assert hash(a) == hash(MaskView(kf.causal(), Remap(q=(1, 4), k=(0, 4))))
    assert a != MaskView(kf.causal(), Remap(q=(2, 4), k=(0, 4)))
    r = Remap(rows=RowTable(torch.tensor([1, 2]), torch.tensor([0, 0]), 1))
    assert MaskView(kf.causal(), r) == MaskView(kf.causal(), Remap(rows=RowTable(
        torch.tensor([1, 2]), torch.tensor([0, 0]), 1)))
    assert a.spec() is None and a.operands() is None                  # compilers evaluate a view
    assert ScoreView(kf.softcap(5.0), Remap(h0=1)).spec() is None
    assert "q=1+4i" in repr(a)


def test_span_kinds():
    kinds = span_kinds(kf.causal(), 10, 20, [(0, 5), (5, 15), (25, 30)])
    assert kinds == [BlockKind.FULL, BlockKind.PARTIAL, BlockKind.EMPTY]
    assert span_kinds(kf.as_mask(lambda b, h, q, k: q >= k), 0, 4, [(0, 4)]) == [None]
    assert span_kinds(kf.causal(), 0, 4, []) == []


@pytest.mark.parametrize("backend", [Backend.CPU, Backend.TILES])
def test_attention_through_a_view_by_the_rule(backend):
    """A striped piece with a head slice, run through the engine, by the rule; the reference is
    the inner mask's dense bool matrix at the true positions (not the view)."""
    inner = kf.causal() & kf.window(9) | kf.sinks(1)
    view, qidx, kidx = _striped(inner, 3, 1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, len(qidx), 16, generator=g) for _ in range(3))
    dense = inner.to_dense(N, N, q_offset=0)[qidx][:, kidx]
    got = kf.attention(q, k, v, mask=view, q_offset=0, backend=backend)
    want = kf.attention(q.double(), k.double(), v.double(), mask=dense, backend=Backend.REFERENCE)
    assert (got.double() - want).abs().max() < 1e-5
    assert_forward_by_rule(q, k, v, mask=view, q_offset=0, backend=backend)
    assert_backward_by_rule(q, k, v, mask=view, q_offset=0, backend=backend)
