"""Paper fidelity as options, runs as printed: averaging, output length, dropout, presets, device and
bf16, the test files sacrebleu rescores, staged data preparation, the slow-machine warning, Table 2."""

import dataclasses
import json

import pytest
import torch

from tests.helpers import require_extra

require_extra("translate")  # skip, naming the pip line, where the extra is missing (before the app imports)
pytestmark = pytest.mark.usefixtures("one_thread")

from keyfold.apps.translate import data as D
from keyfold.apps.translate import train as T
from keyfold.apps.translate import translate as TR
from keyfold.apps.translate.data import BOS, EOS, PAD
from keyfold.apps.translate.transformer import MAX_EXTRA, MODEL_CONFIGS, Transformer, beam_search, greedy
from tests.apps.translate.fixtures import ENTRIES, TINY, synthetic_pairs, write_dictd



def _random_pairs():
    """24 training and 4 validation pairs whose targets are random (nothing to learn, only to run)."""
    return synthetic_pairs(24, mapped=False), synthetic_pairs(4, 1, mapped=False)


# ------------------------------------------------------------------- checkpoint averaging


def test_last_k_checkpoints_are_kept_and_averaged(tmp_path):
    from safetensors.torch import load_file

    cfg = dataclasses.replace(T.TRAIN_CONFIGS["tiny"], steps=8, checkpoint_every=2, keep=3, eval_every=100)
    T.train(cfg, TINY, tmp_path, *_random_pairs(), progress=False)
    meta = json.loads((tmp_path / "checkpoint.json").read_text())
    assert meta["kept"] == [f"step-{s:07d}.safetensors" for s in (4, 6, 8)]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == meta["kept"]   # older ones deleted
    states = [{k[6:]: v for k, v in load_file(str(tmp_path / n)).items() if k.startswith("model.")}
              for n in meta["kept"]]
    model, m2 = TR.load_checkpoint(tmp_path, average=3)
    assert m2["averaged"] == meta["kept"]
    for k, v in model.state_dict().items():
        if k in states[0]:
            mean = (states[0][k].double() + states[1][k].double() + states[2][k].double()) / 3
            torch.testing.assert_close(v, mean.float(), rtol=0, atol=1e-7)
    last, _ = TR.load_checkpoint(tmp_path)                  # default: the last checkpoint alone
    assert all(torch.equal(v, states[2][k]) for k, v in last.state_dict().items() if k in states[2])
    assert not torch.equal(model.embed.weight, last.embed.weight)
    with pytest.raises(ValueError, match="--average 4: .* keeps only 3"):
        TR.load_checkpoint(tmp_path, average=4)
    with pytest.raises(ValueError, match="--average must be >= 1"):
        TR.load_checkpoint(tmp_path, average=0)


# ------------------------------------------------------ beam 4, penalty 0.6, input + 50


class _NeverEOS(Transformer):
    """A model that never wants to stop: only the length limit ends its outputs."""

    def decode(self, *a, **kw):
        logits = super().decode(*a, **kw)
        logits[..., EOS] = -1e4
        return logits


def test_output_length_is_input_plus_50_per_row_in_greedy_and_beam():
    torch.manual_seed(0)
    m = _NeverEOS(dataclasses.replace(TINY, max_len=64)).eval()
    src = torch.tensor([[5, 6, EOS, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
                        [5, 6, 7, 8, 9, 10, 11, 12, 13, EOS]])
    lengths = (src != PAD).sum(1)                                              # 3 and 10
    for out in (greedy(m, src), beam_search(m, src, beam=4, alpha=0.6)):
        for row, n in zip(out.tolist(), lengths.tolist()):
            body = row[:row.index(EOS) + 1] if EOS in row else row
            assert len(body) == n + MAX_EXTRA and body[-1] == EOS            # forced EOS at input + 50
    out = greedy(m, src, max_len=7)                                            # an explicit limit
    assert out.shape[1] == 7 and (out[:, -1] == EOS).all()
    long_src = torch.full((1, 30), 5)
    assert greedy(m, long_src).shape[1] == 64                                  # capped by the model's positions
    import inspect
    sig = inspect.signature(TR.translate).parameters
    assert sig["beam"].default == 4 and sig["alpha"].default == 0.6            # the paper's decoding defaults


# --------------------------------------------------------------- dropout, presets


def test_dropout_on_embeddings_and_residuals_only_while_training():
    cfg = dataclasses.replace(TINY, dropout=0.3)
    m = Transformer(cfg)
    assert m.embed.drop.p == 0.3
    seen = []
    m.embed.drop.register_forward_hook(lambda mod, i, o: seen.append(bool((o == 0).any())))
    src, tgt = torch.tensor([[5, 6, 7, EOS]]), torch.tensor([[BOS, 8, 9]])
    torch.manual_seed(0)
    a, b = m(src, tgt), m(src, tgt)
    assert not torch.equal(a, b) and any(seen)          # dropout on (embedding+position) sums in training
    m.eval()
    assert torch.equal(m(src, tgt), m(src, tgt))
    n_drop = sum(isinstance(x, torch.nn.Dropout) and x.p == 0.3 for x in m.modules())
    # the embedding, 2 residual branches per encoder layer, 3 per decoder layer (+ torch's inside the FFN)
    assert n_drop >= 1 + 2 * cfg.n_encoder_layers + 3 * cfg.n_decoder_layers
    still = Transformer(dataclasses.replace(TINY, dropout=0.0))
    assert torch.equal(still(src, tgt), still(src, tgt))


def test_base_and_big_presets_have_the_papers_sizes():
    """Table 3 of the paper (37k shared vocabulary): base 65 M parameters, big 213 M."""
    base, big = MODEL_CONFIGS["base"], MODEL_CONFIGS["big"]
    assert (base.d_model, base.d_ff, base.n_heads, base.n_encoder_layers, base.n_decoder_layers, base.dropout) == \
        (512, 2048, 8, 6, 6, 0.1)
    assert (big.d_model, big.d_ff, big.n_heads, big.n_encoder_layers, big.n_decoder_layers, big.dropout) == \
        (1024, 4096, 16, 6, 6, 0.3)
    for cfg, paper in ((base, 65e6), (big, 213e6)):
        with torch.device("meta"):
            m = Transformer(dataclasses.replace(cfg, vocab_size=37000))
        n = sum(p.numel() for p in m.parameters())
        assert abs(n - paper) / paper < 0.04, (cfg, n)
    assert T.TRAIN_CONFIGS["base"].warmup == 4000 and T.TRAIN_CONFIGS["base"].label_smoothing == 0.1
    assert T.TRAIN_CONFIGS["big"].model == "big"


# ------------------------------------------------------------------------ device, bf16


def test_bf16_training_and_decoding_on_cpu(tmp_path):
    cfg = dataclasses.replace(T.TRAIN_CONFIGS["tiny"], steps=4, checkpoint_every=2, eval_every=2)
    tr = T.train(cfg, TINY, tmp_path, *_random_pairs(), progress=False, dtype="bf16")
    recs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())          # weights stay float32
    seen = []
    tr.model.embed.register_forward_hook(lambda mod, i, o: None)
    lin = next(x for x in tr.model.modules() if isinstance(x, torch.nn.Linear))
    lin.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
    src = torch.tensor([[5, 6, EOS], [7, EOS, PAD]])
    with T.autocast(torch.device("cpu"), torch.bfloat16):
        out = greedy(tr.model.eval(), src, max_len=6)
        beam = beam_search(tr.model, src, beam=2, max_len=6)
    assert torch.bfloat16 in seen                                                 # autocast engaged
    assert out.shape[0] == beam.shape[0] == 2 and out.dtype == torch.long


def test_device_and_dtype_arguments_are_checked():
    with pytest.raises(ValueError, match="--dtype must be one of"):
        T.resolve_dtype("fp8")
    assert T.resolve_dtype("bf16") is torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            T.resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_training_and_decoding(tmp_path):
    cfg = dataclasses.replace(T.TRAIN_CONFIGS["tiny"], steps=3, checkpoint_every=3, eval_every=3)
    tr = T.train(cfg, TINY, tmp_path, *_random_pairs(), progress=False, device="cuda", dtype="bf16")
    assert next(tr.model.parameters()).is_cuda
    src = torch.tensor([[5, 6, EOS]], device="cuda")
    assert beam_search(tr.model.eval(), src, beam=2, max_len=5).is_cuda
    model, _ = TR.load_checkpoint(tmp_path)   # saved on the CPU
    assert not next(model.parameters()).is_cuda


# --------------------------------------------------- the test files sacrebleu rescores


def test_cli_writes_every_hypothesis_and_sacrebleu_reproduces_the_scores(tmp_path, capsys):
    import sacrebleu

    dict_dir = tmp_path / "dictd"
    dict_dir.mkdir()
    write_dictd(dict_dir, ENTRIES + [(f"wort{i}", f"Wort{i} /v/ <n>\nword{i} <n>, term{i}\n")
                                           for i in range(400)])
    data_dir, run = tmp_path / "data", tmp_path / "run"
    assert T.main(["--prepare", "--dict-dir", str(dict_dir), "--data", str(data_dir), "--vocab-size", "90"]) == 0
    cfg = ["--config", "tiny", "--data", str(data_dir), "--run-dir", str(run), "--steps", "6"]
    assert T.main(cfg) == 0
    assert TR.main(["--checkpoint", str(run), "--data", str(data_dir), "--test", "--beam", "2", "--average", "1"]) == 0
    out = run / "test"                                           # beside the run, never benchmarks/results
    test = D.load_split(data_dir, "test")
    hyp = (out / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    src = (out / "src.txt").read_text(encoding="utf-8").split("\n")[:-1]
    ref = [r.split("\t") for r in (out / "ref.txt").read_text(encoding="utf-8").split("\n")[:-1]]
    assert len(hyp) == len(src) == len(ref) == len(test) > 0
    assert src == [ex.german for ex in test] and ref == [list(ex.english) for ex in test]
    scores = json.loads((out / "scores.json").read_text())
    # sacrebleu itself, from the files alone
    n = max(map(len, ref))
    streams = [[r[i] if i < len(r) else None for r in ref] for i in range(n)]
    bleu = sacrebleu.metrics.BLEU().corpus_score(hyp, streams)
    chrf = sacrebleu.metrics.CHRF().corpus_score(hyp, streams)
    assert round(bleu.score, 2) == scores["bleu"] and round(chrf.score, 2) == scores["chrf"]
    assert scores["bleu_signature"].startswith("nrefs:") and scores["empty"] == sum(not h for h in hyp)
    assert TR.rescore(out)["chrf"] == scores["chrf"]
    res = json.loads((out / "translate.json").read_text())
    assert res["systems"]["transformer"]["chrf"] == scores["chrf"]
    capsys.readouterr()
    assert TR.main(["--rescore", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["bleu"] == scores["bleu"]


# ------------------------------------------------------------- staged data preparation


def test_prepare_runs_once_and_recovers_from_a_kill(tmp_path, monkeypatch, capsys):
    dict_dir = tmp_path / "dictd"
    dict_dir.mkdir()
    write_dictd(dict_dir, ENTRIES + [(f"wort{i}", f"Wort{i} /v/ <n>\nword{i} <n>\n") for i in range(60)])
    out = tmp_path / "out"
    real = D.train_tokenizer

    def killed(*a, **kw):
        raise KeyboardInterrupt  # the user pressed Ctrl-C while the tokenizer trained

    monkeypatch.setattr(D, "train_tokenizer", killed)
    with pytest.raises(KeyboardInterrupt):
        D.prepare(out, dict_dir=dict_dir, vocab_size=60, install=False)
    assert (out / D.PAIRS_STAMP).exists() and not D.is_prepared(out)
    monkeypatch.setattr(D, "train_tokenizer", real)
    monkeypatch.setattr(D, "read_index", lambda *a: pytest.fail("the finished pair stage ran again"))
    stats = D.prepare(out, dict_dir=dict_dir, vocab_size=60, install=False)
    assert "reusing" in capsys.readouterr().out and D.is_prepared(out, 60) and stats["examples"] == 66
    monkeypatch.setattr(D, "train_tokenizer", killed)             # done: nothing runs again
    assert D.prepare(out, dict_dir=dict_dir, vocab_size=60, install=False) == stats
    assert "nothing to do" in capsys.readouterr().out
    assert not list(out.glob("*.tmp"))


# --------------------------------------------------------------- slow machine warning


def test_speed_watch_warns_with_eta_only_when_slow():
    said = []
    w = T.SpeedWatch(1000.0, write=said.append, every_s=60, warmup_s=10)
    assert not w.check(5.0, 100.0, 50, 2.0)                  # too early to judge
    assert not w.check(30.0, 900.0, 50, 2.0)                 # fast enough
    assert w.check(40.0, 200.0, 50, 2.0)
    assert "20% of the ~1,000" in said[0] and "remaining 50 steps take 2 min" in said[0] and "ETA" in said[0]
    assert not w.check(50.0, 200.0, 50, 2.0)                 # at most once a minute here
    assert w.check(101.0, 200.0, 50, 2.0)
    assert not T.SpeedWatch(None, write=said.append).check(100.0, 1.0, 5, 1.0)


# ---------------------------------------------------------------------------- Table 2


def test_compare_models_share_sizes_and_decoding_rule():
    from keyfold.apps.translate import compare as C

    cfg = dataclasses.replace(TINY, dropout=0.0, norm_first=True)
    torch.manual_seed(0)
    models = {n: f(cfg).eval() for n, f in C.SYSTEMS.items()}
    src, tgt = torch.tensor([[5, 6, 7, EOS], [8, EOS, PAD, PAD]]), torch.tensor([[BOS, 9, 10], [BOS, 11, 12]])
    for m in models.values():
        assert m(src, tgt).shape == (2, 3, cfg.vocab_size)
    kf, tn = models["keyfold"], models["torch"]
    n_kf = sum(p.numel() for p in kf.parameters())
    assert n_kf == sum(p.numel() for p in tn.parameters())          # same sizes, same parameter count
    # padding does not leak in any of the three: a padded row equals the row alone
    for m in models.values():
        alone = m(src[1:, :2], tgt[1:])
        torch.testing.assert_close(m(src, tgt)[1:], alone, atol=1e-5, rtol=1e-5)
    assert torch.equal(C.greedy_recompute(kf, src, max_len=6), greedy(kf, src, max_len=6))


def test_compare_command_with_a_tiny_budget(tmp_path, monkeypatch):
    from keyfold.apps.translate import compare as C

    dict_dir = tmp_path / "dictd"
    dict_dir.mkdir()
    by_split = {s: [i for i in range(3000) if D.split_of(f"Wort{i}") == s] for s in D.Split.ALL}
    words = by_split["train"][:200] + by_split["valid"][:6] + by_split["test"][:6]
    write_dictd(dict_dir, ENTRIES + [(f"wort{i}", f"Wort{i} /v/ <n>\nword{i} <n>\n") for i in words])
    data_dir, out = tmp_path / "data", tmp_path / "cmp"
    D.prepare(data_dir, dict_dir=dict_dir, vocab_size=80, install=False, progress=False)
    assert C.main(["--config", "tiny", "--data", str(data_dir), "--minutes", "0.03", "--eval-minutes", "0.01",
                   "--valid-phrases", "20", "--out", str(out)]) == 0
    res = json.loads((out / "compare.json").read_text())
    assert set(res["systems"]) == {"keyfold", "torch", "gru"} and res["clock"] == "wall"
    assert "(wall time)" in (out / "compare.md").read_text()
    for s in res["systems"].values():
        assert s["steps"] > 0 and s["params"] > 0 and s["tokens_per_s"] > 0 and s["valid_curve"]
        assert 0 <= s["chrf"] <= 100
    table = (out / "compare.md").read_text()
    assert "| keyfold |" in table or "| **keyfold** |" in table
    assert (out / "compare.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        C.main(["--systems", "lstm", "--data", str(data_dir)])
    with pytest.raises(SystemExit):
        C.main(["--clock", "gpu", "--data", str(data_dir)])
    # --clock cpu: the budget counts the clock it names. A fake CPU clock that advances 10 s per
    # reading gives each training step 10 s, so a 0.5-minute budget is exactly 3 steps per system.
    ticks = iter(range(0, 10**6, 10))
    monkeypatch.setitem(C.CLOCKS, "cpu", lambda: next(ticks))
    assert C.main(["--config", "tiny", "--data", str(data_dir), "--minutes", "0.5", "--clock", "cpu",
                   "--valid-phrases", "4", "--test-limit", "4", "--systems", "keyfold,gru",
                   "--out", str(tmp_path / "cpu")]) == 0
    res = json.loads((tmp_path / "cpu" / "compare.json").read_text())
    assert res["clock"] == "cpu" and [s["steps"] for s in res["systems"].values()] == [3, 3]
