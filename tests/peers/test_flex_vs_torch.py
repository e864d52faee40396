"""keyfold against torch's own FlexAttention, not keyfold's reference.

The other ports (test_flex_ports.py) judge keyfold by its float64 reference and naive attention,
which evaluate the callables through keyfold's own machinery: a mistake there would pass on both
sides (a review, 2026-12-08). Here the yardstick is torch's ``flex_attention`` (eager, on the CPU):
float64 Flex is the reference, float32 Flex the same-dtype implementation, and keyfold float32 must
stay within 2x its error (+1e-6), forward and lse, rows that see no key 0. The masks and score mods
are attention-gym's (facts only: the patterns, written here), at Flex's test sizes scaled to the CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import keyfold

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, L, S, D = 2, 4, 200, 256, 32
_g = torch.Generator().manual_seed(0)
_DOC = torch.repeat_interleave(torch.tensor([0, 1, 2, 3]), torch.tensor([60, 90, 50, 56]))  # over S keys
_QDOC = _DOC[S - L:]
_TABLE = torch.randn(H, 2 * S, generator=_g)  # a per-head relative-position bias table (learned in T5-style models)
_SLOPES = torch.tensor([2.0 ** -(i + 1) for i in range(H)])
_OFF = S - L  # queries are the last L positions (bottom-right), written into the mods as Flex users do


def _causal(b, h, q, k):
    return q + _OFF >= k


def _sliding(b, h, q, k):
    return (q + _OFF >= k) & (q + _OFF - k < 48)


def _prefix_lm(b, h, q, k):
    return (k < 40) | (q + _OFF >= k)


def _document(b, h, q, k):
    return (_QDOC[q] == _DOC[k]) & (q + _OFF >= k)


def _dilated(b, h, q, k):
    return (q + _OFF >= k) & ((q + _OFF - k) % 3 == 0) & (q + _OFF - k < 96)


def _global_and_local(b, h, q, k):  # attention-gym's "global sliding window": a few global keys and a band
    return ((k % 64) == 0) | ((q + _OFF - k).abs() < 16)


def _per_batch_length(b, h, q, k):  # padding: batch 0 holds 256 keys, batch 1 holds 170
    return k < torch.tensor([256, 170])[b]


def _late_start(b, h, q, k):  # the first 10 query rows see no key: out 0, lse -inf, as Flex gives them
    return (q >= 10) & (q + _OFF >= k)


def _alibi(score, b, h, q, k):
    return score - _SLOPES[h] * (q + _OFF - k).abs()


def _softcap(score, b, h, q, k):
    return 20.0 * torch.tanh(score / 20.0)


def _relative_table(score, b, h, q, k):
    return score + _TABLE[h, q + _OFF - k + S]


def _head_scaled(score, b, h, q, k):
    return score * (1.0 + 0.25 * h)


CASES = {
    "causal": (_causal, None), "sliding": (_sliding, None), "prefix_lm": (_prefix_lm, None),
    "document": (_document, None), "dilated": (_dilated, None), "global_local": (_global_and_local, None),
    "per_batch_length": (_per_batch_length, None), "late_start": (_late_start, _softcap), "alibi": (_causal, _alibi), "softcap": (None, _softcap),
    "softcap_sliding": (_sliding, _softcap), "relative_table": (_document, _relative_table),
    "head_scaled": (_prefix_lm, _head_scaled),
}


def _flex(q, k, v, mask_mod, score_mod):
    bm = None if mask_mod is None else flex.create_block_mask(mask_mod, B, H, L, S, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager Flex warns that it is not compiled
        out, lse = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
    return out, lse


@pytest.mark.parametrize("name", sorted(CASES))
def test_keyfold_holds_the_rule_against_torch_flex(name):
    mask_mod, score_mod = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    q, k, v = (torch.randn(B, H, n, D, generator=g) * (2.0 if i < 2 else 1.0) for i, n in enumerate((L, S, S)))
    ref, ref_lse = _flex(q.double(), k.double(), v.double(), mask_mod, score_mod)
    peer, peer_lse = _flex(q, k, v, mask_mod, score_mod)
    out, lse = keyfold.attention(q, k, v, mask=mask_mod, score=score_mod, q_offset=0, return_lse=True)
    seen = torch.isfinite(ref_lse)
    assert bool((out[~seen] == 0).all()) and torch.isneginf(lse[~seen]).all()
    for got, want, same in ((out, ref, peer), (lse.unsqueeze(-1), ref_lse.unsqueeze(-1), peer_lse.unsqueeze(-1))):
        err = ((got.double() - want) * seen.unsqueeze(-1)).abs().nan_to_num(0).max()
        allowed = 2 * ((same.double() - want) * seen.unsqueeze(-1)).abs().nan_to_num(0).max() + 1e-6
        assert err <= allowed, f"{name}: keyfold {err:.3e} > 2x torch Flex's float32 error ({allowed:.3e})"
