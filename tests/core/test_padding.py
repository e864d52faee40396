"""padding(): per-batch key padding (right, left, start offsets), against a dense reference."""

import pytest
import torch

import keyfold as kf
from keyfold import BlockKind
from keyfold.planner import plan
from tests.helpers import assert_backward_by_rule, assert_forward_by_rule


def dense_padding(starts, ends, B, Nq, Nk, kv_offset=0):
    kp = torch.arange(kv_offset, kv_offset + Nk).view(1, 1, 1, Nk)
    ok = kp >= starts.view(-1, 1, 1, 1)
    if ends is not None:
        ok = ok & (kp < ends.view(-1, 1, 1, 1))
    return ok.expand(B, 1, Nq, Nk)


def test_right_left_and_window_padding_match_dense():
    lengths = torch.tensor([5, 2, 7, 0])
    B, N = 4, 7
    right = kf.padding(lengths).to_dense(N, N, B=B)
    assert torch.equal(right, dense_padding(torch.zeros(4, dtype=torch.long), lengths, B, N, N))
    left = kf.padding(starts=N - lengths).to_dense(N, N, B=B)
    assert torch.equal(left, dense_padding(N - lengths, None, B, N, N))
    both = kf.padding(torch.tensor([2, 3, 1, 0]), starts=torch.tensor([1, 0, 5, 2])).to_dense(3, N, B=B)
    assert torch.equal(both, dense_padding(torch.tensor([1, 0, 5, 2]), torch.tensor([3, 3, 6, 2]), B, 3, N))
    # an int broadcasts over the batch; kv_offset shifts absolute key positions
    assert torch.equal(kf.padding(3).to_dense(2, 4, kv_offset=2), torch.tensor([[True, False, False, False]] * 2))


def test_composes_hashes_by_content_and_rejects_bad_input():
    a, b = kf.padding(torch.tensor([3, 5])), kf.padding(torch.tensor([3, 5]))
    assert a == b and hash(a) == hash(b) and a != kf.padding(torch.tensor([3, 4]))
    m = kf.causal() & kf.padding(starts=torch.tensor([2, 0]))
    dense = m.to_dense(4, 4, B=2)
    expect = kf.causal().to_dense(4, 4) & dense_padding(torch.tensor([2, 0]), None, 2, 4, 4)
    assert torch.equal(dense, expect)
    inv = (~kf.padding(torch.tensor([1, 2]))).to_dense(2, 3, B=2)
    assert torch.equal(inv, ~dense_padding(torch.zeros(2, dtype=torch.long), torch.tensor([1, 2]), 2, 2, 3))
    with pytest.raises(ValueError, match="padding"):
        kf.padding()
    with pytest.raises(ValueError, match="lengths"):
        kf.padding(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="starts"):
        kf.padding(starts=torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="batch"):
        kf.attention(*(torch.randn(3, 1, 4, 8) for _ in range(3)), mask=kf.padding(torch.tensor([1, 2])))


@pytest.mark.parametrize("block", [2, 3, 8])
def test_closed_form_classification_is_sound_and_tight(block):
    torch.manual_seed(0)
    B, N = 5, 23
    lengths = torch.randint(0, N + 1, (B,))
    cases = [(kf.padding(lengths), True), (kf.padding(starts=N - lengths), True),
             (kf.padding(lengths, starts=torch.randint(0, 5, (B,))), True),
             (kf.causal() & kf.padding(starts=N - lengths), False)]
    for m, exact in cases:
        p = plan(m, N, N, B=B, block_size=block)
        dense = m.to_dense(N, N, B=B).expand(B, 1, N, N)[:, 0]  # (B, N, N)
        for i in range(p.kinds.shape[0]):
            for j in range(p.kinds.shape[1]):
                tile = dense[:, i * block:(i + 1) * block, j * block:(j + 1) * block]
                want = BlockKind.FULL if tile.all() else BlockKind.EMPTY if not tile.any() else BlockKind.PARTIAL
                if exact:
                    assert p.kinds[i, j] == want, (m, i, j)     # padding alone is classified exactly
                elif p.kinds[i, j] != BlockKind.PARTIAL:
                    assert p.kinds[i, j] == want, (m, i, j)     # composed: never wrongly FULL or EMPTY


@pytest.mark.parametrize("backend", [kf.Backend.CPU, kf.Backend.TILES])
def test_attention_with_padding_by_rule(backend):
    torch.manual_seed(1)
    B, H, N, D = 3, 2, 300, 16
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    lengths = torch.tensor([300, 17, 0])
    for mask in (kf.padding(lengths), kf.causal() & kf.padding(starts=N - lengths),
                 kf.causal() & kf.window(40) & kf.padding(starts=N - lengths)):
        assert_forward_by_rule(q, k, v, mask=mask, backend=backend)
    assert_backward_by_rule(q[:, :, :64], k[:, :, :64], v[:, :, :64],
                            mask=kf.causal() & kf.padding(starts=torch.tensor([0, 30, 64])), backend=backend)


def test_left_padding_equals_unpadded_sequences():
    """Left-padded rows give exactly what each sequence alone gives (the HF generation layout)."""
    torch.manual_seed(2)
    H, N, D = 2, 12, 8
    lengths = torch.tensor([12, 5])
    q, k, v = (torch.randn(2, H, N, D) for _ in range(3))
    out = kf.attention(q, k, v, mask=kf.causal() & kf.padding(starts=N - lengths))
    for b, n in enumerate(lengths.tolist()):
        alone = kf.attention(q[b:b + 1, :, N - n:], k[b:b + 1, :, N - n:], v[b:b + 1, :, N - n:], mask=kf.causal())
        torch.testing.assert_close(out[b:b + 1, :, N - n:], alone, atol=1e-6, rtol=1e-6)
        assert bool((out[b, :, :N - n] == 0).all())  # padded query rows see no key


def test_keys_pattern_matches_dense_and_classifies_exactly():
    torch.manual_seed(3)
    B, N = 3, 19
    valid = torch.rand(B, N) > 0.4
    valid[2] = True
    m = kf.padding(keys=valid)
    assert torch.equal(m.to_dense(5, N, B=B), valid.view(B, 1, 1, N).expand(B, 1, 5, N))
    assert m == kf.padding(keys=valid.int()) and m != kf.padding(keys=~valid)
    p = plan(m, N, N, B=B, block_size=4)
    for j in range(p.kinds.shape[1]):
        tile = valid[:, j * 4:(j + 1) * 4]
        want = BlockKind.FULL if tile.all() else BlockKind.EMPTY if not tile.any() else BlockKind.PARTIAL
        assert bool((p.kinds[:, j] == want).all())
    q, k, v = (torch.randn(B, 2, N, 8) for _ in range(3))
    assert_forward_by_rule(q, k, v, mask=kf.causal() & m)
    with pytest.raises(ValueError, match="absolute position"):
        kf.attention(q, k, v, mask=m, kv_offset=2)
