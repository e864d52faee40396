"""The Transformer on keyfold: MultiheadAttention vs torch's, decoding, overfitting, resuming."""

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keyfold
from keyfold import nn as knn
from tests.helpers import require_extra

require_extra("translate")  # skip, naming the pip line, where the extra is missing (before the app imports)
pytestmark = pytest.mark.usefixtures("one_thread")

from keyfold.apps.translate import train as T
from keyfold.apps.translate.data import BOS, EOS, PAD
from keyfold.apps.translate.transformer import Transformer, TransformerLM, beam_search, greedy, length_penalty
from tests.apps.translate.fixtures import ENTRIES, TINY, run_log, synthetic_pairs, write_dictd



# ------------------------------------------------------------------- MultiheadAttention


def _pair(E, H, bias=True):
    ref = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=True)
    ours = knn.MultiheadAttention(E, H, bias=bias, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _masks(draw, B, L, S, self_attn):
    """torch-style masks (True = masked out) that leave every query row at least one key."""
    kind = draw(st.sampled_from(["none", "pad_suffix", "pad_any", "bool", "float", "causal"]
                                if self_attn else ["none", "pad_suffix", "pad_any", "bool", "float"]))
    kw = {}
    if kind.startswith("pad"):
        kpm = torch.zeros(B, S, dtype=torch.bool)
        for b in range(B):
            if kind == "pad_suffix":
                kpm[b, draw(st.integers(1, S)):] = True
            else:
                kpm[b] = torch.tensor(draw(st.lists(st.booleans(), min_size=S, max_size=S)))
                kpm[b, draw(st.integers(0, S - 1))] = False
        kw["key_padding_mask"] = kpm
    elif kind == "bool":
        m = torch.rand(L, S) < 0.4
        m[torch.arange(L), torch.randint(0, S, (L,))] = False
        kw["attn_mask"] = m
    elif kind == "float":
        kw["attn_mask"] = torch.randn(L, S)
    elif kind == "causal":
        kw["is_causal"] = True
    return kind, kw


@st.composite
def mha_cases(draw):
    B, H = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    E = H * draw(st.sampled_from([4, 8]))
    L = draw(st.integers(1, 9))
    self_attn = draw(st.booleans())
    S = L if self_attn else draw(st.integers(1, 11))
    kind, kw = _masks(draw, B, L, S, self_attn)
    return B, H, E, L, S, self_attn, kind, kw


def _torch_kwargs(kw, L):
    kw = dict(kw)
    if kw.pop("is_causal", False):  # torch wants the mask too when is_causal is set
        kw["attn_mask"], kw["is_causal"] = torch.triu(torch.ones(L, L, dtype=torch.bool), 1), True
    return kw


@settings(max_examples=20)
@given(mha_cases())
def test_multihead_attention_equals_torch_with_the_same_weights(case):
    """Forward and input gradients within the correctness rule against torch's module in float64."""
    B, H, E, L, S, self_attn, kind, kw = case
    ref, ours = _pair(E, H)
    x = torch.randn(B, L, E, requires_grad=True)
    mem = x if self_attn else torch.randn(B, S, E, requires_grad=True)
    ref64 = torch.nn.MultiheadAttention(E, H, batch_first=True).double()
    ref64.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    tk = _torch_kwargs(kw, L)
    tk64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in tk.items()}
    x64 = x.detach().double().requires_grad_()
    mem64 = x64 if self_attn else mem.detach().double().requires_grad_()
    want, _ = ref64(x64, mem64, mem64, need_weights=False, **tk64)
    naive, _ = ref(x, mem, mem, need_weights=False, **tk)
    got, w = ours(x, mem, mem, need_weights=False, **tk)
    assert w is None and got.shape == want.shape
    g = torch.randn_like(want)
    err = (got.double() - want).abs().max().item()
    err_naive = (naive.double() - want).abs().max().item()
    assert err <= 2 * err_naive + 1e-6, (kind, err, err_naive)
    ins, ins64 = ([x], [x64]) if self_attn else ([x, mem], [x64, mem64])
    d_got = torch.autograd.grad(got, ins, g.float())
    d_naive = torch.autograd.grad(naive, ins, g.float())
    d_want = torch.autograd.grad(want, ins64, g)
    for a, n, r in zip(d_got, d_naive, d_want):
        e, en = (a.double() - r).abs().max().item(), (n.double() - r).abs().max().item()
        assert e <= 3 * en + 1e-6, (kind, e, en)


def test_fully_padded_row_gives_zero_not_nan():
    ref, ours = _pair(8, 2, bias=False)
    x = torch.randn(2, 3, 8)
    kpm = torch.tensor([[True, True, True, True], [False, False, True, True]])
    mem = torch.randn(2, 4, 8)
    out, _ = ours(x, mem, mem, key_padding_mask=kpm)
    assert torch.equal(out[0], torch.zeros(3, 8))      # every key of row 0 is padding
    assert torch.isnan(ref(x, mem, mem, key_padding_mask=kpm)[0][0]).all()  # torch gives NaN there


def test_key_padding_becomes_a_small_hashable_mask():
    suffix = torch.tensor([[False, False, True], [False, True, True]])
    m = knn.key_padding_to_mask(suffix)
    assert "sinks" in repr(m) and m == knn.key_padding_to_mask(suffix.clone())  # hashes by content
    holes = torch.tensor([[False, True, False]])
    m2 = knn.key_padding_to_mask(holes, n_queries=5)
    assert "padding" in repr(m2) and m2 == knn.key_padding_to_mask(holes.clone())
    dense = m2.to_dense(5, 3, q_offset=0, B=1)
    assert dense.reshape(5, 3).tolist() == [[True, False, True]] * 5


def test_settings_and_bad_input_errors():
    with pytest.raises(ValueError, match="dropout"):
        knn.MultiheadAttention(8, 2, dropout=1.5)
    mha = knn.MultiheadAttention(8, 2, batch_first=True, mask=keyfold.causal() & keyfold.window(1))
    x = torch.randn(1, 5, 8)
    with pytest.raises(AssertionError, match="only bool and floating"):
        mha(x, x, x, key_padding_mask=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="mask="):
        mha(x, x, x, attn_mask=keyfold.causal())
    # the mask setting is the same as passing the keyfold mask per call
    plain = knn.MultiheadAttention(8, 2, batch_first=True)
    plain.load_state_dict(mha.state_dict())
    dense = ~(keyfold.causal() & keyfold.window(1)).to_dense(5, 5)
    assert torch.allclose(mha(x, x, x)[0], plain(x, x, x, attn_mask=dense)[0], atol=1e-6)


def test_separate_kdim_vdim_match_torch():
    ref = torch.nn.MultiheadAttention(8, 2, kdim=5, vdim=3, batch_first=True)
    ours = knn.MultiheadAttention(8, 2, kdim=5, vdim=3, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 6, 5), torch.randn(2, 6, 3)
    assert torch.allclose(ours(q, k, v)[0], ref(q, k, v, need_weights=False)[0], atol=1e-6)


# ------------------------------------------------------------------------------ the model


def test_shared_embedding_scaled_and_tied():
    cfg = dataclasses.replace(TINY, vocab_size=50)
    m = Transformer(cfg).eval()
    vocab_mats = [n for n, p in m.named_parameters() if p.shape[0] == cfg.vocab_size]
    assert vocab_mats == ["embed.weight"]                # one matrix: source, target, output
    tok = torch.tensor([[5, 6]])
    x = m.embed(tok)
    assert torch.allclose(x, m.embed.weight[tok] * math.sqrt(cfg.d_model) + m.embed.pe[:2])
    h = torch.randn(1, 2, cfg.d_model)
    assert torch.equal(m.embed.logits(h), h @ m.embed.weight.t())  # output projection unscaled


def test_pre_ln_option_and_lm_config_run():
    cfg = dataclasses.replace(TINY, norm_first=True)
    assert Transformer(cfg)(torch.tensor([[5, 3]]), torch.tensor([[2, 7, 8]])).shape == (1, 3, TINY.vocab_size)
    lm = TransformerLM(dataclasses.replace(TINY, n_encoder_layers=0)).eval()
    toks = torch.randint(4, TINY.vocab_size, (2, 7))
    full = lm(toks)
    caches = lm.new_caches()
    steps = torch.cat([lm(toks[:, t:t + 1], caches, offset=t) for t in range(7)], 1)
    assert torch.allclose(full, steps, atol=1e-5)      # incremental LM == full forward


def _handful():
    g = torch.Generator().manual_seed(1)
    pairs = []
    for n in (3, 4, 5, 3, 6, 4):
        src = torch.randint(4, TINY.vocab_size, (n,), generator=g).tolist() + [EOS]
        tgt = [BOS] + torch.randint(4, TINY.vocab_size, (n,), generator=g).tolist() + [EOS]
        pairs.append((src, tgt))
    return pairs


@pytest.fixture(scope="module")
def overfit():
    """A tiny model trained to memorise six random pairs (150 full-batch Adam steps)."""
    torch.manual_seed(0)
    pairs = _handful()
    cfg = dataclasses.replace(TINY, dropout=0.0)
    m = Transformer(cfg)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-9)
    src, tgt = T.collate(pairs, list(range(len(pairs))))
    lossf = torch.nn.CrossEntropyLoss(ignore_index=PAD)
    for _ in range(150):
        logits = m(src, tgt[:, :-1])
        loss = lossf(logits.reshape(-1, cfg.vocab_size), tgt[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval(), pairs, src


def _novel_sources(seed, B=4, S=6):
    """Sources the model never saw (its outputs branch more), with ragged padding."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, TINY.vocab_size, (B, S), generator=g)
    src[:, -1] = EOS
    src[0, 3:] = PAD
    src[0, 2] = EOS
    return src


def test_tiny_model_overfits_a_handful_of_pairs(overfit):
    m, pairs, src = overfit
    out = greedy(m, src, max_len=10)
    for row, (_, t) in zip(out.tolist(), pairs):
        assert row[:len(t) - 1] == t[1:]                 # every target reproduced, EOS included
    best = beam_search(m, src, beam=4, max_len=10)
    for row, (_, t) in zip(best.tolist(), pairs):
        assert row[:len(t) - 1] == t[1:]


@pytest.mark.parametrize("seed", [0, 1])
def test_cached_decoding_equals_full_redecoding(overfit, seed):
    m, _, train_src = overfit
    for src in (train_src, _novel_sources(seed)):
        a = greedy(m, src, max_len=9)
        assert torch.equal(a, greedy(m, src, max_len=9, use_cache=False))
        assert len(set(a.flatten().tolist())) > 3        # real, varied sequences, not one repeated token


@pytest.mark.parametrize("seed", [0, 1])
def test_beam_one_equals_greedy(overfit, seed):
    m, _, train_src = overfit
    for src in (train_src, _novel_sources(seed)):
        assert torch.equal(beam_search(m, src, beam=1, max_len=9), greedy(m, src, max_len=9))


def test_attention_cache_grows_reorders_and_decodes_like_attention():
    """The layer cache is a KVCache: it doubles when full, reorders rows for beams, and a cached
    step equals attention over the keys it holds (the model's decoding rests on all three)."""
    from keyfold.nn import AttentionCache, MultiheadAttention
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(3, 9, 16)
    cache = AttentionCache(capacity=2)
    with torch.no_grad():
        steps = [mha(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], cache=cache, need_weights=False)[0]
                 for t in range(9)]
        full = mha(x, x, x, mask=keyfold.causal(), need_weights=False)[0]
    assert cache.kv.capacity >= 9 and cache.length == 9
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5
    held_k = cache.k.clone()
    cache.reorder(torch.tensor([2, 2, 0]))
    assert torch.equal(cache.k, held_k[[2, 2, 0]]) and cache.kv.lengths == (9, 9, 9)
    with pytest.raises(ValueError, match="index"):
        cache.reorder(torch.tensor([0, 3, 1]))
    assert torch.equal(cache.k, held_k[[2, 2, 0]])  # unchanged by the bad call


def test_attention_cache_refuses_a_step_of_another_batch_and_shrinks_by_reorder():
    """A step of 1 row on a cache of 2 started a new, empty cache: the history was dropped and the step
    was off by 0.46 from causal attention (a review, 2026-12-07). Now it raises, naming reorder() and
    reset(); reorder with a shorter index keeps the rows still decoding, and the step is exact."""
    from keyfold.nn import AttentionCache, MultiheadAttention
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 6, 16)
    cache = AttentionCache(capacity=4)
    with torch.no_grad():
        for t in range(5):
            mha(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], cache=cache, need_weights=False)
        last = x[1:, 5:6]
        with pytest.raises(ValueError, match="holds 2 rows but this step has 1.*reorder.*reset"):
            mha(last, last, last, cache=cache, need_weights=False)
        assert cache.length == 5 and cache.kv.batch == 2                  # unchanged
        cache.reorder(torch.tensor([1]))                                  # request 0 finished
        step = mha(last, last, last, cache=cache, need_weights=False)[0]
        full = mha(x[1:], x[1:], x[1:], mask=keyfold.causal(), need_weights=False)[0]
    assert cache.length == 6 and cache.kv.batch == 1
    assert (step[:, 0] - full[:, -1]).abs().max() < 1e-5
    cache.reset()
    assert cache.length == 0 and cache.k is None


def test_length_penalty_and_beam_output():
    assert length_penalty(torch.tensor(1), 0.6).item() == pytest.approx((6 / 6) ** 0.6)
    assert length_penalty(torch.tensor(7), 0.6).item() == pytest.approx((12 / 6) ** 0.6)



@pytest.mark.parametrize("seed", range(4))
def test_a_beam_wider_than_every_hypothesis_finds_the_best_score_at_the_limit(seed):
    """With a beam wider than every hypothesis up to the limit, beam search is exhaustive: it must
    return the argmax of log P(Y|X) / lp(|Y|) over every Y ending in EOS, the EOS forced at the
    limit counted at its real log-probability (it had cost 0, so a cut hypothesis outranked a
    finished one with a higher score)."""
    torch.manual_seed(seed)
    cfg = dataclasses.replace(TINY, vocab_size=8, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                              n_decoder_layers=1, dropout=0.0)
    m = Transformer(cfg).eval()
    src, limit, alpha = torch.tensor([[5, 6, 7, EOS]]), 3, 0.6
    words = [t for t in range(cfg.vocab_size) if t not in (PAD, BOS, EOS)]
    hyps = [[EOS]] + [[a, EOS] for a in words] + [[a, b, EOS] for a in words for b in words]
    with torch.no_grad():
        mem, sm = m.encode(src)

        def score(y):
            lp = torch.log_softmax(m.decode(torch.tensor([[BOS] + y[:-1]]), mem, sm)[0].double(), -1)
            return float(lp[torch.arange(len(y)), torch.tensor(y)].sum()) / ((5 + len(y)) / 6) ** alpha

        want = max(hyps, key=score)
        got = beam_search(m, src, beam=len(hyps), alpha=alpha, max_len=limit)[0].tolist()
    assert got[:got.index(EOS) + 1] == want

# ---------------------------------------------------------------------------- training


def test_learning_rate_is_warmup_then_inverse_sqrt():
    cfg = T.TrainConfig(warmup=100)
    lrs = [T.learning_rate(s, 512, cfg) for s in (1, 50, 100, 400)]
    assert lrs[0] < lrs[1] < lrs[2] and lrs[3] == pytest.approx(lrs[2] / 2)
    assert lrs[2] == pytest.approx(512 ** -0.5 * 100 ** -0.5)


def test_resume_continues_the_same_loss_curve(tmp_path):
    from safetensors.torch import load_file

    cfg = dataclasses.replace(T.TRAIN_CONFIGS["tiny"], steps=12, checkpoint_every=5, eval_every=4)
    pairs, valid = synthetic_pairs(), synthetic_pairs(8, seed=1)
    whole = T.train(cfg, TINY, tmp_path / "a", pairs, valid, progress=False)
    # a run that dies after step 7: its last checkpoint is step 5, steps 6-7 were logged and are lost
    T.train(cfg, TINY, tmp_path / "b", pairs, valid, stop_after=5, progress=False)
    with open(tmp_path / "b" / "log.jsonl", "a") as f:
        for step in (6, 7):
            f.write(json.dumps({"step": step, "loss": -1.0, "tokens": 0, "time": 0.0}) + "\n")
    meta = json.loads((tmp_path / "b" / "checkpoint.json").read_text())
    assert meta["step"] == 5 and meta["model_config"] == dataclasses.asdict(TINY)
    tensors = load_file(str(tmp_path / "b" / meta["weights"]))
    assert "rng.torch" in tensors and any(k.endswith(".exp_avg_sq") for k in tensors)
    resumed = T.train(cfg, TINY, tmp_path / "b", pairs, valid, progress=False)
    curve = lambda run: [(r["step"], r["loss"], r.get("valid_loss")) for r in run_log(tmp_path / run)]  # noqa: E731
    assert curve("b") == curve("a") and len(curve("a")) == 12   # bit-identical, no lost or repeated step
    for (n, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), n
    assert not list((tmp_path / "b").glob("*.tmp"))             # atomic writes leave no temp files


class _CharTok:
    """A stand-in tokenizer: one id per character."""

    def encode(self, texts):
        return [[4 + (ord(c) % 50) for c in t] for t in texts]


def test_encode_pairs_and_batches_are_deterministic():
    from keyfold.apps.translate.data import Example

    exs = [Example("Bank", ("bank", "bench")), Example("Haus", ("house",))]
    every = T.encode_pairs(exs, _CharTok(), 64)
    first = T.encode_pairs(exs, _CharTok(), 64, translations=1)
    assert len(every) == 3 and len(first) == 2
    src, tgt = every[1]
    assert src[-1] == EOS and tgt[0] == BOS and tgt[-1] == EOS and len(tgt) == len("bench") + 2
    pairs = synthetic_pairs(200)
    a = T.make_batches(pairs, 40, seed=3, epoch=1)
    assert a == T.make_batches(pairs, 40, seed=3, epoch=1) != T.make_batches(pairs, 40, seed=3, epoch=2)
    assert sorted(i for b in a for i in b) == list(range(200))           # every pair once per epoch
    assert all(len(b) * max(max(map(len, pairs[i])) for i in b) <= 40 for b in a if len(b) > 1)


def test_command_line_prepare_train_resume_translate(tmp_path, capsys):
    """The three commands end to end on a small dictionary written here (no Debian package)."""
    from keyfold.apps.translate import translate as TR

    dict_dir = tmp_path / "dictd"
    dict_dir.mkdir()
    entries = ENTRIES + [(f"wort{i}", f"Wort{i} /v/ <n>\nword{i} <n>\n") for i in range(200)]
    write_dictd(dict_dir, entries)
    data_dir, run = tmp_path / "data", tmp_path / "run"
    assert T.main(["--prepare", "--dict-dir", str(dict_dir), "--data", str(data_dir), "--vocab-size", "80"]) == 0
    common = ["--config", "tiny", "--data", str(data_dir), "--run-dir", str(run)]
    assert T.main(common + ["--steps", "6", "--stop-after", "3"]) == 0
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 3
    assert T.main(common + ["--steps", "6"]) == 0            # resumes at step 3
    assert "resumed" in capsys.readouterr().out
    assert [r["step"] for r in run_log(run)] == [1, 2, 3, 4, 5, 6]
    out = tmp_path / "results"
    assert TR.main(["--checkpoint", str(run), "--data", str(data_dir), "--test", "--out", str(out),
                    "--beam", "2", "--alpha", "1.5", "Wort3"]) == 0
    res = json.loads((out / "translate.json").read_text())
    # the printed command reproduces the scores: every setting they depend on (it left out --alpha, --data)
    assert "--alpha 1.5" in res["command"] and f"--data {data_dir}" in res["command"]
    assert set(res["systems"]) == {"transformer", "copy source", "word by word"}
    assert res["cache_check"]["identical"] and (out / "translate.png").stat().st_size > 0
    with pytest.raises(FileNotFoundError, match="pass the run folder"):
        TR.load_checkpoint(tmp_path / "nothing")


class _CharTokenizer:
    """One id per character (4..63): a stand-in that needs no sentencepiece model."""

    def encode(self, texts):
        return [[4 + (ord(c) % 60) for c in t] for t in texts]

    def decode(self, ids):
        return [" ".join(str(i) for i in seq if i > EOS) for seq in ids]


def test_translate_gives_the_model_the_whole_input_and_warns_where_it_must_cut(monkeypatch):
    """``translate()`` cut every input to ``max_len // 2 - 1`` tokens (31 for ``tiny``, 127 for ``cpu`` and
    ``base``) and translated only that prefix, silently (a review, 2026-12-07). Now the model gets all
    of an input its positions hold, and a longer one is cut there with a warning."""
    from keyfold.apps.translate import translate as TR
    seen = []
    monkeypatch.setattr(TR, "beam_search", lambda model, src, **kw: seen.append(src.ne(PAD).sum(1).tolist())
                        or beam_search(model, src, **kw))
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(TINY, dropout=0.0)).eval()
    text = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOP"  # 42 tokens
    TR.translate(model, _CharTokenizer(), [text], beam=2, max_len=4)
    assert seen[-1] == [len(text) + 1]
    long = "x" * (model.cfg.max_len + 10)
    with pytest.warns(UserWarning, match="1 of 1 input"):
        TR.translate(model, _CharTokenizer(), [long], beam=2, max_len=4)
    assert seen[-1] == [model.cfg.max_len]


def test_a_source_padded_on_the_left_takes_targets_longer_than_itself():
    """A source padded anywhere but at its end becomes ``documents`` ids whose queries covered the S
    source positions only: teacher forcing and uncached greedy with a longer target raised (a review,
    2026-12-07). The logits equal the same layers given torch's ``key_padding_mask``."""
    from keyfold.masks import causal
    torch.manual_seed(0)
    m = Transformer(dataclasses.replace(TINY, dropout=0.0)).eval()
    src = torch.tensor([[PAD, PAD, 6, EOS], [7, 8, 9, EOS]])
    tgt = torch.tensor([[BOS, 9, 10, 11, 12, 13], [BOS, 11, 12, 13, 14, 15]])
    with torch.no_grad():
        kpm = src.eq(PAD)
        x = m.embed(src)
        for layer in m.encoder:
            x = layer(x, src_key_padding_mask=kpm)
        y = m.embed(tgt)
        for layer in m.decoder:
            y = layer(y, m.enc_norm(x), memory_key_padding_mask=kpm, mask=causal())
        want = m.embed.logits(m.dec_norm(y))
        torch.testing.assert_close(m(src, tgt), want, atol=1e-5, rtol=1e-5)
        assert torch.equal(greedy(m, src, max_len=8, use_cache=False), greedy(m, src, max_len=8))
