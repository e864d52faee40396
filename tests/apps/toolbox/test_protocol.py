"""The toolbox's mixer protocol (a mixer defined here, outside keyfold, through SequenceModel and
the bench), its input errors (regressions: each raised a raw torch error or nothing before), a
fuzz count of bad inputs, and the bench's budget rule and claim checks."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import require_extra

require_extra("toolbox")  # skip, naming the pip line, where the extra is missing (before the app imports)

from keyfold.apps.toolbox import MixerKind, MixerProtocol, SequenceModel, check_mixer, make_mixer
from keyfold.apps.toolbox import bench as B


class DecayMixer(nn.Module):
    """A mixer written outside keyfold: a per-channel exponential moving average of a projection,
    ``h_t = a * h_{t-1} + (1 - a) * W x_t`` with learned decay ``a`` in (0, 1)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.logit = nn.Parameter(torch.zeros(dim))

    def forward(self, x):  # (B, N, dim) -> (B, N, dim), a loop is fine for a test
        a, u = torch.sigmoid(self.logit), self.proj(x)
        h, ys = torch.zeros_like(u[:, 0]), []
        for t in range(x.shape[1]):
            h = a * h + (1 - a) * u[:, t]
            ys.append(h)
        return torch.stack(ys, 1)

    def init_state(self, batch):
        return torch.zeros(batch, self.proj.out_features, dtype=self.proj.weight.dtype)

    def step(self, x_t, h):
        a = torch.sigmoid(self.logit)
        h = a * h + (1 - a) * self.proj(x_t)
        return h, h


class _LeakyMixer(DecayMixer):
    """Not causal: every position sees the sequence's last input."""

    def forward(self, x):
        return super().forward(x) + self.proj(x[:, -1:])


class _DriftingStep(DecayMixer):
    """Its streaming step does not match its forward."""

    def step(self, x_t, h):
        y, h = super().step(x_t, h)
        return y + 1e-3, h


def _stream(model, x):
    st, ys = model.init_state(x.shape[0]), []
    for t in range(x.shape[1]):
        y, st = model.step(x[:, t], st)
        ys.append(y)
    return torch.stack(ys, 1)


# --------------------------------------------------------------------------- the protocol


def test_own_mixer_through_sequence_model_tokens_and_features():
    assert isinstance(DecayMixer(4), MixerProtocol)
    torch.manual_seed(0)
    m = SequenceModel(DecayMixer, vocab=11, d_out=11, width=16, depth=2).double()
    assert m.name == "DecayMixer" and m.kind is None
    ids = torch.randint(0, 11, (3, 9))
    torch.testing.assert_close(_stream(m, ids), m(ids), atol=1e-10, rtol=1e-10)
    real = SequenceModel(DecayMixer, d_in=3, d_out=2, width=8, depth=1).double()
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    torch.testing.assert_close(_stream(real, x), real(x), atol=1e-10, rtol=1e-10)
    # a factory works too, and its `name` is what reports show
    factory = lambda dim: DecayMixer(dim)  # noqa: E731
    factory.name = "ema"
    assert SequenceModel(factory, vocab=5, d_out=5, width=8, depth=1).name == "ema"
    # its parameters train like the built-ins'
    names = {n for n, _ in m.named_parameters()}
    assert "blocks.0.mixer.logit" in names and "blocks.1.mixer.proj.weight" in names


def test_own_mixer_is_held_to_the_streaming_and_causality_checks():
    check_mixer(DecayMixer, 8)
    for k in MixerKind:  # the built-ins pass the same check
        check_mixer(k, 8)
    with pytest.raises(ValueError, match="_DriftingStep.*streaming step disagrees"):
        SequenceModel(_DriftingStep, vocab=5, d_out=5, width=8)
    with pytest.raises(ValueError, match="_LeakyMixer.*not causal"):
        SequenceModel(_LeakyMixer, d_in=2, d_out=2, width=8)
    with pytest.raises(TypeError, match="nn.Module with forward"):
        make_mixer(lambda dim: "not a mixer", 8)
    with pytest.raises(TypeError, match="built-in name.*factory"):
        SequenceModel(42, vocab=5, d_out=5)
    with pytest.raises(ValueError, match="unknown mixer 'transformer'"):
        SequenceModel("transformer", vocab=5, d_out=5)


class _PeeksAhead(DecayMixer):
    """Output t also reads input t + 8 (a dilated convolution padded on both sides, say): its
    step cannot see that far, so it streams as a causal mixer would only where t + 8 is past the end."""

    def forward(self, x):
        ahead = torch.nn.functional.pad(x[:, 8:], (0, 0, 0, min(8, x.shape[1])))
        return super().forward(x) + ahead @ self.proj.weight.T


def test_a_mixer_that_reads_ahead_is_caught_at_the_length_it_runs_at():
    """The check had run at N = 7 whatever the model's length: a mixer reading 8 steps ahead passed
    it, and SequenceModel(seq_len=48) trained on the future (an input 8 ahead moved outputs by 0.25)."""
    with pytest.raises(ValueError, match="_PeeksAhead.*not causal: changing position"):
        check_mixer(_PeeksAhead, 8)
    with pytest.raises(ValueError, match="_PeeksAhead.*not causal"):
        SequenceModel(_PeeksAhead, d_in=2, d_out=2, width=8, seq_len=48)
    tiny = dataclasses.replace(B.PRESETS["tiny"], mixers=(_PeeksAhead,), forecast_sets=(), ucr_sets=(),
                               probe_widths=(), induction_factors=())
    with pytest.raises(ValueError, match="_PeeksAhead.*not causal"):
        B.run(tiny, progress=False, groups=("mqar",))
    check_mixer(_PeeksAhead, 8, seq_len=8)  # what a shorter check cannot see (why the length matters)
    nothing = B.run(tiny, progress=False, groups=("no such task",))  # no task left: nothing to check at
    assert nothing["rows"] == []


def test_bench_mixers_named_by_string_are_the_built_in_kinds():
    """Preset(mixers=("tcn",)) ran the selective-copy row with a TCN that sees the whole sequence
    (field 253) under the label of the fixed field 29, and names skipped Preset.scale_mixers."""
    by_name = dataclasses.replace(B.PRESETS["quick"], mixers=("tcn", "mlp"), scale_mixers=("gru",))
    assert by_name.mixers == (MixerKind.TCN, MixerKind.MLP) and by_name.scale_mixers == (MixerKind.GRU,)
    copy = next(p for p in B._problems(by_name) if p.name.startswith("selective"))
    model = copy.make(copy.kinds[0], 0)
    assert [blk.mixer.levels for blk in model.blocks] == [by_name.copy_tcn_levels] * by_name.depth


def test_check_mixer_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    want = torch.rand(3)
    torch.manual_seed(3)
    check_mixer(DecayMixer, 8)
    assert torch.equal(torch.rand(3), want)


def test_own_mixer_through_the_bench(tmp_path):
    tiny = dataclasses.replace(B.PRESETS["tiny"], mixers=(MixerKind.ATTENTION, DecayMixer), forecast_sets=(),
                               ucr_sets=(), probe_widths=(), induction_factors=())
    result = B.run(tiny, progress=False, groups=("mqar", "recall"))
    mixers = {r["mixer"] for r in result["rows"]}
    assert mixers == {"attention", "DecayMixer"}
    ours = [r for r in result["rows"] if r["mixer"] == "DecayMixer"]
    assert len(ours) == 3 and all(len(r["values"]) == 2 and r["state_bytes"] > 0 for r in ours)
    assert "| DecayMixer |" in B.markdown(result)
    # and a mixer that fails the check is refused before anything trains
    with pytest.raises(ValueError, match="streaming step disagrees"):
        B.run(dataclasses.replace(tiny, mixers=(_DriftingStep,)), progress=False)


def test_bench_cli_imports_a_mixer_by_path(tmp_path, capsys):
    spec = B.parse_mixer(f"{__name__}:DecayMixer")
    assert spec is DecayMixer
    with pytest.raises(ValueError, match="cannot import"):
        B.parse_mixer("no_such_module_here:Mixer")
    with pytest.raises(SystemExit):
        B.main(["--tiny", "--out", str(tmp_path), "--mixers", "attention,transformer"])
    assert "unknown mixer 'transformer'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        B.main(["--tiny", "--out", str(tmp_path), "--seeds", "0"])
    assert "seeds must be a positive int" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        B.main(["--tiny", "--out", str(tmp_path), "--tasks", "mqar,weather"])
    assert "--tasks: unknown group(s) ['weather']" in capsys.readouterr().err


# ------------------------------------------------------------------- errors (regressions)


@pytest.mark.parametrize("kind", list(MixerKind), ids=lambda k: k.value)
def test_mixer_errors_name_the_argument(kind):
    m = make_mixer(kind, 8)
    with pytest.raises(ValueError, match=r"x is an empty sequence \(N=0"):
        m(torch.randn(2, 0, 8))
    with pytest.raises(ValueError, match="x has an empty batch"):
        m(torch.randn(0, 3, 8))
    with pytest.raises(TypeError, match="x has dtype torch.float64 but the mixer's parameters are torch.float32"):
        m(torch.randn(2, 3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="x has dtype torch.int64.*token ids go through SequenceModel"):
        m(torch.zeros(2, 3, 8, dtype=torch.int64))
    st = m.init_state(2)
    with pytest.raises(ValueError, match=r"x_t has batch 3 but state was made by init_state\(2\)"):
        m.step(torch.randn(3, 8), st)
    with pytest.raises(TypeError, match="state must be the dict init_state"):
        m.step(torch.randn(2, 8), None)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        m.init_state(0)


@pytest.mark.parametrize("kind", ["attention", "gru", DecayMixer], ids=["attention", "gru", "own"])
def test_sequence_model_errors_name_the_argument(kind):
    tok = SequenceModel(kind, vocab=10, d_out=10, width=8, depth=1)
    with pytest.raises(ValueError, match=r"x holds token id 10, outside \[0, vocab=10\)"):
        tok(torch.tensor([[1, 2, 10]]))  # an IndexError deep in nn.Embedding before
    with pytest.raises(ValueError, match="x holds token id -1"):
        tok(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match=r"x is an empty sequence \(N=0"):
        tok(torch.zeros(2, 0, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must hold int64 token ids"):
        tok(torch.zeros(2, 3))
    st = tok.init_state(2)
    with pytest.raises(ValueError, match=r"x_t has batch 1 but state was made by init_state\(2\)"):
        tok.step(torch.tensor([1]), st)
    with pytest.raises(ValueError, match="x_t holds token id 12"):
        tok.step(torch.tensor([1, 12]), st)
    with pytest.raises(TypeError, match="state must be what init_state"):
        tok.step(torch.tensor([1, 2]), [])
    real = SequenceModel(kind, d_in=3, d_out=2, width=8, depth=1)
    with pytest.raises(TypeError, match="x has dtype torch.float64 but the model's parameters are torch.float32"):
        real(torch.randn(2, 4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x is an empty sequence"):
        real(torch.randn(2, 0, 3))
    with pytest.raises(ValueError, match=r"x must be real inputs shaped \(B, N, d_in\) with d_in=3"):
        real(torch.randn(2, 4, 5))


def test_fuzz_bad_inputs_raise_and_good_inputs_stream_right():
    """Random inputs for every mixer and SequenceModel, a fraction of them broken in one way;
    every broken input must raise ValueError/TypeError naming its argument, and every good one
    must give streaming == full sequence. Counts: inputs tried / errors raised / wrong answers."""
    rng = np.random.default_rng(0)
    kinds = list(MixerKind) + [DecayMixer]
    torch.manual_seed(0)
    models = {k: SequenceModel(k, vocab=7, d_out=7, width=8, depth=1).double() for k in kinds}
    mixers = {k: make_mixer(k, 8).double() for k in MixerKind}
    tried = raised = wrong = bad = 0
    for _ in range(240):
        corrupt = rng.choice(["none", "empty", "id_high", "id_low", "float_ids", "step_batch", "mixer_dtype",
                              "mixer_empty", "mixer_batch"])
        k = kinds[rng.integers(len(kinds))]
        Bn, N = int(rng.integers(1, 4)), int(rng.integers(1, 7))
        ids = torch.from_numpy(rng.integers(0, 7, size=(Bn, N)))
        tried += 1
        bad += corrupt != "none"
        try:
            if corrupt == "none":
                if not torch.allclose(_stream(models[k], ids), models[k](ids), atol=1e-9, rtol=1e-9):
                    wrong += 1
                continue
            if corrupt == "empty":
                models[k](ids[:, :0])
            elif corrupt == "id_high":
                ids[rng.integers(Bn), rng.integers(N)] = 7 + int(rng.integers(0, 5))
                models[k](ids)
            elif corrupt == "id_low":
                ids[rng.integers(Bn), rng.integers(N)] = -1 - int(rng.integers(0, 5))
                models[k](ids)
            elif corrupt == "float_ids":
                models[k](ids.double())
            elif corrupt == "step_batch":
                models[k].step(ids[:, 0], models[k].init_state(Bn + 1))
            else:
                mk = list(MixerKind)[rng.integers(len(MixerKind))]
                x = torch.randn(Bn, N, 8, dtype=torch.float64)
                if corrupt == "mixer_dtype":
                    mixers[mk](x.float())
                elif corrupt == "mixer_empty":
                    mixers[mk](x[:, :0])
                else:
                    mixers[mk].step(x[:, 0], mixers[mk].init_state(Bn + 2))
            wrong += 1  # a broken input that ran through is a silent wrong answer
        except (ValueError, TypeError) as e:
            assert corrupt != "none" and any(a in str(e) for a in ("x ", "x_t ", "state", "token id")), str(e)
            raised += 1
    assert tried == 240 and bad > 150
    assert (tried, raised, wrong) == (tried, bad, 0)


def test_preset_errors_name_the_field():
    base = B.PRESETS["tiny"]
    for field, value in [("seeds", 0), ("cap", -1), ("lrs", ()), ("lrs", (2.0,)), ("patience", 1.5),
                         ("mqar", (8, 4, 16)), ("copy", (6, 4)), ("induction_length", 15),
                         ("mixers", ()), ("mixers", ("transformer",)), ("forecast_sets", ("weather",)),
                         ("probe_widths", (0,))]:
        with pytest.raises(ValueError, match=rf"Preset.{field}|unknown mixer"):
            dataclasses.replace(base, **{field: value})


# ------------------------------------------------------------------------ the budget rule


def _fake_problem(vals, metric="accuracy", cap=100):
    it = iter(vals)
    model = nn.Linear(2, 1)
    prob = B._Problem("recall", "fake", metric, 4, make=None, batch=lambda seed, step: (torch.randn(4, 2),),
                      loss=lambda m, xy: m(xy[0]).pow(2).mean(), score=lambda m, part: next(it),
                      stream_input=torch.zeros(4), cap=cap)
    return model, prob


def test_training_stops_on_plateau_on_solve_and_at_the_cap():
    preset = dataclasses.replace(B.PRESETS["tiny"], eval_every=10, patience=3)
    model, prob = _fake_problem([0.1, 0.3, 0.5, 0.502, 0.5, 0.49] + [0.0] * 20)
    info = B._train(model, prob, preset, 1e-3, 0)
    # gains 0.2, 0.2, then three evaluations below min_delta: stop after 6 evaluations
    assert info["stop"] == "plateau" and info["steps"] == 50 and len(info["curve"]) == 6
    assert [c[0] for c in info["curve"]] == [0, 10, 20, 30, 40, 50]
    model, prob = _fake_problem([0.1, 0.6, 0.999, 0.0])
    info = B._train(model, prob, preset, 1e-3, 0)
    assert info["stop"] == "solved" and info["steps"] == 20
    model, prob = _fake_problem([1.0 - 0.1 * i for i in range(20)], metric="mse", cap=35)
    info = B._train(model, prob, preset, 1e-3, 0)
    assert info["stop"] == "cap" and info["steps"] == 35 and info["curve"][-1][0] == 35


def test_training_keeps_the_best_checkpoint():
    preset = dataclasses.replace(B.PRESETS["tiny"], eval_every=5, patience=2)
    model = nn.Linear(2, 1)
    seen = []

    def score(m, part):  # best at the second evaluation, then worse
        seen.append(m.weight.detach().clone())
        return [0.1, 0.2, 0.9, 0.3, 0.2, 0.1][len(seen) - 1]

    prob = B._Problem("recall", "fake", "accuracy", 4, None, lambda s, t: (torch.randn(4, 2),),
                      lambda m, xy: (m(xy[0]) - 3).pow(2).mean(), score, torch.zeros(4), cap=100)
    B._train(model, prob, preset, 0.05, 0)
    assert torch.equal(model.weight, seen[2]) and not torch.equal(model.weight, seen[-1])


# --------------------------------------------------------------------------- claim checks


def _row(task, mixer, mean, ci=0.01, group="mqar", N=48, d=48, metric="accuracy", **kw):
    return {"task": task, "mixer": mixer, "mean": mean, "ci95": ci, "group": group, "N": N, "d": d,
            "metric": metric, **kw}


def test_claims_say_reproduces_only_when_the_rows_show_it():
    t, t2, t3 = "mqar N=48 d=48 kv=6", "mqar N=96 d=48 kv=6", "mqar N=48 d=96 kv=6"
    rows = [_row(t, "attention", 0.999), _row(t, "gru", 0.17), _row(t, "tcn", 0.06),
            _row(t2, "attention", 0.99, N=96), _row(t2, "gru", 0.08, N=96), _row(t2, "tcn", 0.04, N=96),
            _row(t3, "attention", 0.999, d=96), _row(t3, "gru", 0.5, d=96), _row(t3, "tcn", 0.2, d=96)]
    text = "\n".join(B._claims(rows))
    assert "MQAR gap**" in text and text.count("**reproduces**") == 2
    rows[0] = _row(t, "attention", 0.6)  # attention no longer solves it
    text = "\n".join(B._claims(rows))
    assert "**does not reproduce** (attention does not reach 90 %" in text
    rows = [_row("sunspots (L=44)", "dlinear", 1.1, group="forecast", metric="mse"),
            _row("sunspots (L=44)", "attention", 2.1, group="forecast", metric="mse"),
            _row("nile (L=20)", "dlinear", 0.7, group="forecast", metric="mse"),
            _row("nile (L=20)", "attention", 0.6, ci=0.2, group="forecast", metric="mse")]
    text = "\n".join(B._claims(rows))
    assert "lower test MSE on 1 of 2 sets, with the 95 % intervals apart on 1" in text
    assert "(tie)" in text and "**does not reproduce**" in text
    rows[3] = _row("nile (L=20)", "attention", 0.75, ci=0.2, group="forecast", metric="mse")
    text = "\n".join(B._claims(rows))  # lower on both, but a tie on nile: one clear win of two
    assert "lower test MSE on 2 of 2 sets, with the 95 % intervals apart on 1" in text
    assert "**does not reproduce**" in text


def test_workers_give_the_rows_one_process_gives():
    """Two worker processes train the same rows as one process: the same test metrics, steps
    and curves, in the problems' order (not the order the workers finish), and each row reaches
    on_row once."""
    tiny = dataclasses.replace(B.PRESETS["tiny"], mixers=(MixerKind.ATTENTION, MixerKind.GRU), forecast_sets=(),
                               ucr_sets=(), probe_widths=(), induction_factors=())
    one = B.run(tiny, progress=False, groups=("mqar", "selective"))
    seen = []
    two = B.run(tiny, progress=False, groups=("mqar", "selective"), workers=2, on_row=seen.append)
    key = lambda r: (r["task"], r["mixer"])  # noqa: E731
    assert [key(r) for r in two["rows"]] == [key(r) for r in one["rows"]]
    assert sorted(map(key, seen)) == sorted(map(key, one["rows"]))
    for a, b in zip(one["rows"], two["rows"]):
        assert a["values"] == b["values"] and a["steps"] == b["steps"]
        assert [c[2] for c in a["curve"]] == [c[2] for c in b["curve"]]
    assert two["machine"]["workers"] == 2
    with pytest.raises(ValueError, match="workers"):
        B.run(tiny, progress=False, workers=0)


def test_selective_copy_claim_names_reach_and_time_invariance():
    t = "selective copy N=64 k=4 (TCN field 29)"
    kw = dict(group="recall", N=64, d=32, tcn_field=29)
    rows = [_row(t, "attention", 0.99, **kw), _row(t, "gru", 0.9, **kw), _row(t, "tcn", 0.6, **kw),
            _row(t, "s4d", 0.5, **kw)]
    text = "\n".join(B._claims(rows))
    assert "selective copying**" in text and "**reproduces**" in text
    assert "S4D, whose kernel spans the whole sequence (the direct test of time invariance), fails" in text
    assert "receptive field (29 positions) is shorter than the sequence (64)" in text
    rows[3] = _row(t, "s4d", 0.98, **kw)  # S4D solves it: the claim does not hold
    text = "\n".join(B._claims(rows))
    assert "**does not reproduce**" in text and "S4D, whose kernel spans the whole sequence" in text
    assert "does not fail" in text


def test_selective_copy_tcn_field_is_shorter_than_the_sequence():
    """The selective-copying row's TCN keeps its fixed field (the preset's levels), shorter than
    the sequence, and the row's name states it; other tasks' TCNs still cover their sequence."""
    quick = B.PRESETS["quick"]
    probs = {p.name.split()[0]: p for p in B._problems(dataclasses.replace(
        quick, forecast_sets=(), probe_widths=(), mixers=(MixerKind.TCN,)))}
    copy_ = probs["selective"]
    field = copy_.extra["tcn_field"]
    assert field < copy_.seq_len and f"TCN field {field})" in copy_.name
    tcn = copy_.make(MixerKind.TCN, 0).blocks[0].mixer
    assert 1 + quick.depth * (tcn.receptive_field - 1) == field
    mq = probs["mqar"].make(MixerKind.TCN, 0).blocks[0].mixer
    assert mq.receptive_field >= probs["mqar"].seq_len


def test_report_lists_rows_stopped_at_the_cap():
    rows = [dict(_row("t", "gru", 0.5), stops=["cap", "plateau", "cap"]), dict(_row("t", "attention", 1.0),
                                                                              stops=["solved"] * 3)]
    text = "\n".join(B._capped(rows))
    assert "t / gru (2 of 3)" in text and "attention" not in text
    assert "none at the step cap" in "\n".join(B._capped(rows[1:]))


class _PeekBehindZeroGain(nn.Module):
    """Reads x[t + 1] (a 'same'-padded conv) behind a gain initialised to zero, with a wrong step."""

    def __init__(self, dim):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)
        self.gain = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return self.gain * self.conv(x.transpose(1, 2)).transpose(1, 2)

    def init_state(self, batch):
        return None

    def step(self, x_t, state):
        return torch.zeros_like(x_t), state


class _Deaf(_PeekBehindZeroGain):
    def forward(self, x):
        return torch.zeros_like(x)


def test_a_mixer_silent_at_init_is_checked_with_its_zero_parameters_drawn():
    """A zero-initialised gain made every output 0 at init, so the causality and streaming checks could not
    fail: a mixer reading the next input passed check_mixer (and SequenceModel's guard), trained, and scored
    100% on induction by reading the answer ahead (a review, 2026-12-08). Its all-zero parameters are now
    drawn afresh for a second check; a mixer no input can move raises."""
    with pytest.raises(ValueError, match="not causal"):
        check_mixer(_PeekBehindZeroGain(8), 8, seq_len=16)
    with pytest.raises(ValueError, match="not causal"):
        SequenceModel(_PeekBehindZeroGain, vocab=16, d_out=16, width=8, depth=1, seq_len=16)
    with pytest.raises(ValueError, match="no output depends on any input"):
        check_mixer(_Deaf(8), 8, seq_len=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_s4d_runs_and_streams_in_16_bits(dtype):
    """S4D in bfloat16 / float16 raised from inside torch (no half-precision complex exp or FFT on the CPU; a
    review, 2026-12-08): its recurrence and FFT run in float32, out in the dtype; step follows forward."""
    m = SequenceModel("s4d", vocab=16, d_out=16, width=16, depth=1).to(dtype).eval()
    mix = m.blocks[0].mixer
    x = torch.randn(2, 9, 16).to(dtype)
    with torch.no_grad():
        full = mix(x)
        st, ys = mix.init_state(2), []
        for t in range(9):
            y, st = mix.step(x[:, t], st)
            ys.append(y)
    assert full.dtype == dtype and torch.isfinite(full).all()
    torch.testing.assert_close(torch.stack(ys, 1).float(), full.float(), atol=3e-2, rtol=3e-2)


class _Delay(_PeekBehindZeroGain):
    """Output t = x[t - 1] (a valid causal mixer: a one-step delay)."""

    def forward(self, x):
        return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)

    def init_state(self, batch):
        return None

    def step(self, x_t, state):
        return (torch.zeros_like(x_t) if state is None else state), x_t


@pytest.mark.parametrize("seq_len", [1, 2, 3])
def test_short_checks_do_not_call_a_mixer_deaf(seq_len):
    """The "no output depends on any input" check refused every mixer at seq_len 1 and a one-step delay at 2
    (only positions from 1 were changed; a review, 2026-12-08): position 0 counts, and short checks never
    call a mixer deaf (a delay still fails a causality check it breaks: its peeking twin raises)."""
    assert check_mixer(_Delay(8), 8, seq_len=seq_len) is None
    assert check_mixer("attention", 8, seq_len=seq_len) is None
    if seq_len >= 2:
        with pytest.raises(ValueError, match="not causal"):
            check_mixer(_PeekBehindZeroGain(8), 8, seq_len=seq_len)
    with pytest.raises(ValueError, match="no output depends on any input"):
        check_mixer(_Deaf(8), 8, seq_len=8)
