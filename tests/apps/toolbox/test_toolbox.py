"""The toolbox: every mixer's streaming step equals its full form; tasks match their papers'
layouts on hand-made examples; the real-data loaders and baselines; the tiny benchmark."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import require_extra

require_extra("toolbox")  # skip, naming the pip line, where the extra is missing (before the app imports)

from keyfold.apps.toolbox import MixerKind, SequenceModel, make_mixer, state_nbytes
from keyfold.apps.toolbox import data as D
from keyfold.apps.toolbox import tasks as T
from keyfold.apps.toolbox.mixers import AttentionMixer, LinearAttentionMixer, S4DMixer

# every mixer and the variants that change its code path
VARIANTS = [
    ("attention", {}), ("attention", {"window": 3}), ("gru", {}), ("lstm", {}),
    ("tcn", {"levels": 2}), ("tcn", {"kernel_size": 2, "levels": 3}),
    ("linear_attention", {"chunk": 4}), ("s4d", {}), ("s4d", {"complex_diag": False}), ("mlp", {}),
]


def _stream(m, x):
    st_ = m.init_state(x.shape[0])
    ys = []
    for t in range(x.shape[1]):
        y, st_ = m.step(x[:, t], st_)
        ys.append(y)
    return torch.stack(ys, 1), st_


# ---------------------------------------------------------------------------------- mixers


@pytest.mark.parametrize("kind,kw", VARIANTS, ids=[f"{k}-{kw}" for k, kw in VARIANTS])
@settings(max_examples=6)
@given(B=st.integers(1, 3), N=st.integers(1, 13))
def test_step_equals_full_sequence(kind, kw, B, N):
    torch.manual_seed(N)
    m = make_mixer(kind, 16, **kw).double()
    x = torch.randn(B, N, 16, dtype=torch.float64)
    full = m(x)
    stepped, _ = _stream(m, x)
    assert full.shape == (B, N, 16)
    torch.testing.assert_close(stepped, full, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind,kw", VARIANTS, ids=[f"{k}-{kw}" for k, kw in VARIANTS])
@settings(max_examples=5)
@given(t=st.integers(0, 11))
def test_causal(kind, kw, t):
    """Changing position t changes no output before t (S4D's FFT convolution leaves rounding
    noise, hence float64 and a 1e-12 tolerance rather than exact equality)."""
    torch.manual_seed(0)
    m = make_mixer(kind, 8, **kw).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    x2 = x.clone()
    x2[:, t] += 1.0
    torch.testing.assert_close(m(x)[:, :t], m(x2)[:, :t], atol=1e-12, rtol=0)
    if t + 1 < 12 and kind != "mlp":
        assert not torch.allclose(m(x)[:, t + 1], m(x2)[:, t + 1])  # and the future does see it


def test_attention_matches_float64_reference_and_window():
    """The attention mixer = softmax(q k^T / sqrt(d)) v with the causal window, computed densely."""
    torch.manual_seed(0)
    W = 4
    m = AttentionMixer(16, heads=2, window=W).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    q, k, v = m._qkv(x, torch.arange(11))
    i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
    visible = (j <= i) & (j > i - W)  # the current token and the W - 1 before it
    s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    ref = torch.softmax(s.masked_fill(~visible, -math.inf), -1) @ v  # (B, H, N, Dh)
    ref = m.out(ref.transpose(1, 2).reshape(2, 11, 16))
    torch.testing.assert_close(m(x), ref, atol=1e-10, rtol=1e-10)
    _, st_ = _stream(m, x)
    assert st_["k"].shape[2] == W  # the window buffer never grows past W


def test_linear_attention_chunk_size_does_not_change_the_result():
    torch.manual_seed(0)
    a = LinearAttentionMixer(16, chunk=3).double()
    b = LinearAttentionMixer(16, chunk=64).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    torch.testing.assert_close(a(x), b(x), atol=1e-12, rtol=1e-12)


def test_s4d_real_kernel_is_the_zoh_closed_form():
    """One real mode: K_l = C (exp(dt A) - 1) / A * exp(dt A)^l."""
    m = S4DMixer(1, state=1, complex_diag=False).double()
    with torch.no_grad():
        m.log_dt.fill_(math.log(0.1))
        m.log_a_re.fill_(math.log(2.0))  # A = -2
        m.c.fill_(3.0)
    abar = math.exp(-0.2)
    want = torch.tensor([3.0 * (abar - 1) / -2.0 * abar ** l for l in range(5)], dtype=torch.float64)
    torch.testing.assert_close(m.kernel(5)[0], want)


def test_tcn_receptive_field_and_state_size():
    torch.manual_seed(0)
    m = make_mixer("tcn", 4, seq_len=30)  # kernel 3: levels chosen so 1 + 2 (2^L - 1) >= 30
    assert m.receptive_field >= 30 and 1 + 2 * (2 ** (m.levels - 1) - 1) < 30
    x = torch.randn(1, 40, 4)
    x2 = x.clone()
    x2[:, 0] += 1
    far = m.receptive_field  # position `far` no longer sees position 0
    torch.testing.assert_close(m(x)[:, far:], m(x2)[:, far:], atol=0, rtol=0)
    assert not torch.equal(m(x)[:, far - 1], m(x2)[:, far - 1])
    assert state_nbytes(m.init_state(1)) == 4 * 4 * sum(2 * 2 ** l for l in range(m.levels))


def test_state_memory_shapes():
    """Attention's state grows with the sequence; recurrent states do not; MLP keeps nothing."""
    x = torch.randn(1, 20, 16)
    sizes = {}
    for kind in MixerKind:
        m = make_mixer(kind, 16)
        _, s10 = _stream(m, x[:, :10])
        _, s20 = _stream(m, x)
        sizes[kind] = (state_nbytes(s10), state_nbytes(s20))
    assert sizes[MixerKind.ATTENTION] == (2 * 10 * 16 * 4, 2 * 20 * 16 * 4)  # k and v, fp32
    for kind in (MixerKind.GRU, MixerKind.LSTM, MixerKind.TCN, MixerKind.LINEAR_ATTENTION, MixerKind.S4D):
        assert sizes[kind][0] == sizes[kind][1] > 0
    assert sizes[MixerKind.MLP] == (0, 0)


def test_sequence_model_streams_tokens_and_features():
    torch.manual_seed(0)
    for kind in MixerKind:
        tok = SequenceModel(kind, vocab=11, d_out=11, width=16, depth=2).double()
        ids = torch.randint(0, 11, (2, 9))
        stepped = torch.stack(_stream_model(tok, ids), 1)
        torch.testing.assert_close(stepped, tok(ids), atol=1e-10, rtol=1e-10)
        real = SequenceModel(kind, d_in=3, d_out=2, width=16, depth=1).double()
        x = torch.randn(2, 7, 3, dtype=torch.float64)
        torch.testing.assert_close(torch.stack(_stream_model(real, x), 1), real(x), atol=1e-10, rtol=1e-10)


def _stream_model(model, x):
    st_, ys = model.init_state(x.shape[0]), []
    for t in range(x.shape[1]):
        y, st_ = model.step(x[:, t], st_)
        ys.append(y)
    return ys


def test_freeze_body_trains_only_embedding_and_readout():
    m = SequenceModel("gru", vocab=10, d_out=10, width=8, depth=2).freeze_body()
    names = {n for n, p in m.named_parameters() if p.requires_grad}
    assert names == {"embed.weight", "readout.weight", "readout.bias"}
    assert m.n_params(trainable_only=True) == 10 * 8 + 8 * 10 + 10


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="unknown mixer 'transformer'.*attention"):
        make_mixer("transformer", 8)
    with pytest.raises(ValueError, match="exactly one of d_in"):
        SequenceModel("gru", d_out=2, d_in=3, vocab=4)
    with pytest.raises(ValueError, match=r"\(batch, seq, dim\) with dim=8"):
        make_mixer("gru", 8)(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="even head size"):
        AttentionMixer(12, heads=4)
    with pytest.raises(ValueError, match="window"):
        AttentionMixer(16, window=0)


# ----------------------------------------------------------------------------------- tasks


def test_mqar_layout_hand_made():
    # pairs (1 -> 5), (2 -> 6); key 1 queried at gap 1 (position 4 + 2), key 2 at gap 0 (position 4)
    x, y = T.mqar_layout([1, 2], [5, 6], [1, 0], seq_len=8)
    assert x.tolist() == [1, 5, 2, 6, 2, 0, 1, 0]
    assert y.tolist() == [-100, -100, -100, -100, 6, -100, 5, -100]
    x, _ = T.mqar_layout([1, 2], [5, 6], [1, 0], seq_len=8, filler=np.full(8, 9))
    assert x.tolist() == [1, 5, 2, 6, 2, 9, 1, 9]  # filler only where neither pair nor query


@settings(max_examples=15)
@given(P=st.integers(1, 6), extra=st.integers(0, 20), seed=st.integers(0, 10 ** 6), rnq=st.booleans())
def test_mqar_matches_zoology_definition(P, extra, seed, rnq):
    N, V = 4 * P + extra, 64
    t = T.mqar(5, N, vocab=V, num_kv_pairs=P, seed=seed, random_non_queries=rnq)
    for x, y in zip(t.inputs.tolist(), t.targets.tolist()):
        keys, values = x[0:2 * P:2], x[1:2 * P:2]
        assert all(1 <= k < V // 2 for k in keys) and len(set(keys)) == P
        assert all(V // 2 <= v < V for v in values) and len(set(values)) == P
        pairs = dict(zip(keys, values))
        scored = [i for i, yi in enumerate(y) if yi != T.IGNORE]
        assert len(scored) == P and all(i >= 2 * P and (i - 2 * P) % 2 == 0 for i in scored)
        assert sorted(x[i] for i in scored) == sorted(keys)  # every key queried once
        assert all(y[i] == pairs[x[i]] for i in scored)  # the answer is the key's value
        if not rnq:
            assert all(x[i] == 0 for i in range(2 * P, N) if i not in scored)


def test_mqar_gaps_follow_a_power_law():
    from scipy import stats

    t = T.mqar(4000, 64, vocab=64, num_kv_pairs=1, seed=0)
    gaps = ((t.targets != T.IGNORE).int().argmax(1) - 2) // 2  # query at 2P + 2 g
    counts = torch.bincount(gaps, minlength=31).numpy()
    p = np.arange(1, 32) ** (0.01 - 1.0)  # p(g) ∝ (g + 1)^(a - 1), a = 0.01
    expected = 4000 * p / p.sum()
    assert stats.chisquare(counts, expected).pvalue > 1e-3
    assert counts[0] > 1.8 * counts[1] > 0  # about 2x, then a long tail
    # and a uniform draw would be rejected by the same test
    assert stats.chisquare(counts, np.full(31, 4000 / 31)).pvalue < 1e-6


def test_selective_copying_hand_made_and_generated():
    x, y = T.selective_copying_layout([5, 7], [1, 3], context=4)
    assert x.tolist() == [0, 5, 0, 7, 1, 1] and y.tolist() == [-100, -100, -100, -100, 5, 7]
    t = T.selective_copying(20, 40, num_tokens=6, num_data=10, seed=3)
    assert t.vocab == 12
    for x, y in zip(t.inputs.tolist(), t.targets.tolist()):
        data = [v for v in x[:34] if v != T.NOISE]
        assert len(data) == 6 and all(2 <= v < 12 for v in data)
        assert x[34:] == [T.MARKER] * 6 and y[34:] == data and set(y[:34]) == {T.IGNORE}


def test_induction_hand_made_and_generated():
    x, y = T.induction_layout([3, 4, 5, 6, 7, 8], trigger_at=1)
    assert x.tolist() == [3, 0, 5, 6, 7, 0] and y.tolist() == [-100] * 5 + [5]
    t = T.induction_heads(50, 20, vocab=8, seed=1)
    for x, y in zip(t.inputs.tolist(), t.targets.tolist()):
        trig = [i for i, v in enumerate(x) if v == T.TRIGGER]
        assert len(trig) == 2 and trig[1] == 19 and trig[0] <= 17
        assert y[19] == x[trig[0] + 1] and set(y[:19]) == {T.IGNORE}


def test_repeated_tokens_hand_made_and_generated():
    x, y = T.repeated_layout([4, 2, 7])
    assert x.tolist() == [4, 2, 7, 4, 2, 7] and y.tolist() == [-100, -100, -100, 2, 7, -100]
    t = T.repeated_tokens(30, 16, vocab=10, seed=2)
    for x, y in zip(t.inputs.tolist(), t.targets.tolist()):
        assert x[:8] == x[8:] and len(set(x[:8])) == 8 and max(x) < 10
        # the induction rule answers every scored position: the successor of the earlier copy
        for i in range(8, 15):
            assert y[i] == x[x.index(x[i]) + 1]
        assert set(y[:8]) == {T.IGNORE} and y[15] == T.IGNORE


def test_task_errors_say_what_to_do():
    with pytest.raises(ValueError, match="vocab >= 8"):
        T.repeated_tokens(2, 16, vocab=5)
    with pytest.raises(ValueError, match="seq_len >= 16"):
        T.mqar(2, 10, num_kv_pairs=4)
    with pytest.raises(ValueError, match="raise vocab"):
        T.mqar(2, 64, vocab=8, num_kv_pairs=4)
    with pytest.raises(ValueError, match="num_examples must be a positive int"):
        T.induction_heads(0, 8)
    with pytest.raises(ValueError, match="seq_len >= 8"):
        T.selective_copying(2, 6, num_tokens=4)


def test_accuracy_counts_scored_positions_only():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = logits[0, 2, 1] = 1
    assert T.accuracy(logits, torch.tensor([[2, -100, 3]])) == 0.5


# ------------------------------------------------------------------------------- real data


@pytest.mark.parametrize("name", D.FORECAST_SETS)
def test_forecast_sets_load_clean_and_standardised(name):
    fs = D.load_forecast(name)
    assert np.isfinite(fs.values).all()
    train = fs.values[:fs.splits[0]]
    np.testing.assert_allclose(train.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(train.std(0), 1, atol=1e-3)
    x, y = D.forecast_windows(fs, "test")
    assert x.shape[1:] == (fs.lookback, fs.values.shape[1]) and y.shape[1] == fs.horizon
    # the last test window ends at the end of the series, its targets follow its lookback
    np.testing.assert_array_equal(y[-1].numpy(), fs.values[-fs.horizon:])
    np.testing.assert_array_equal(x[-1].numpy(), fs.values[-fs.horizon - fs.lookback:-fs.horizon])


def test_co2_missing_weeks_are_handled():
    import statsmodels.api as sm

    raw = sm.datasets.co2.load_pandas().data["co2"]
    assert raw.isna().sum() > 0  # the shipped weekly series has gaps
    fs = D.load_forecast("co2")
    assert len(fs.values) == len(raw.resample("MS").mean()) and np.isfinite(fs.values).all()


def test_seasonal_naive_and_dlinear_hand_made():
    x = torch.tensor([[1.0, 2, 3, 4, 5, 6]])[..., None]  # (1, 6, 1)
    assert D.seasonal_naive(x, 5, 3)[0, :, 0].tolist() == [4, 5, 6, 4, 5]
    assert D.seasonal_naive(x, 2, 1)[0, :, 0].tolist() == [6, 6]
    m = D.DLinear(6, 2, kernel=3)
    with torch.no_grad():  # trend map picks the last step: a constant series forecasts itself
        m.trend.weight.zero_()
        m.trend.weight[:, -1] = 1
        m.trend.bias.zero_()
        m.seasonal.bias.zero_()  # a constant series has no remainder: the seasonal map sees 0
    torch.testing.assert_close(m(torch.full((1, 6, 2), 7.0)), torch.full((1, 2, 2), 7.0))
    with pytest.raises(ValueError, match="period"):
        D.seasonal_naive(x, 2, 7)


def test_ucr_loader():
    try:
        xtr, ytr, xte, yte = D.load_ucr("ItalyPowerDemand")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert xtr.shape == (67, 24, 1) and xte.shape == (1029, 24, 1)
    assert set(ytr.tolist()) == {0, 1}
    torch.testing.assert_close(xtr.mean(1), torch.zeros(67, 1), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- benchmark


def test_bench_tiny_preset_writes_honest_tables(tmp_path):
    """The one end-to-end run of the bench in the suite (the tiny preset): tables, plots, the
    budget rule's record (steps, why each run stopped, the curve) and the claim checks."""
    from keyfold.apps.toolbox import bench

    assert bench.main(["--tiny", "--out", str(tmp_path), "--no-progress"]) == 0
    result = json.loads((tmp_path / "toolbox.tiny.json").read_text())
    md = (tmp_path / "toolbox.tiny.md").read_text()
    assert md.count("| attention |") >= 5
    assert "## The cited papers' results, checked" in md and "Zoology" in md and "LTSF-Linear" in md
    assert (tmp_path / "toolbox.tiny.png").stat().st_size > 10_000
    assert (tmp_path / "toolbox.tiny.curves.png").stat().st_size > 10_000
    rows = result["rows"]
    groups = {r["group"] for r in rows}
    assert {"mqar", "recall", "probe", "forecast"} <= groups
    for r in rows:
        assert len(r["values"]) == (1 if r["mixer"] == "seasonal_naive" else 2)
        assert r["ci95"] >= 0 and math.isfinite(r["mean"])
        if r["metric"] == "accuracy":
            assert 0 <= r["mean"] <= 1
        if r["mixer"] != "seasonal_naive":  # the budget rule's record
            assert len(r["steps"]) == len(r["values"]) and all(1 <= s <= r["cap"] for s in r["steps"])
            assert set(r["stops"]) <= {"plateau", "solved", "cap"}
            assert r["curve"][0][0] == 0 and [c[0] for c in r["curve"]] == sorted(c[0] for c in r["curve"])
    by = {(r["task"], r["mixer"]): r for r in rows}
    for task in {r["task"] for r in rows if r["group"] in ("mqar", "recall")}:
        assert set(m.value for m in MixerKind) <= {m for (t, m) in by if t == task}
        # streaming memory at the sequence's end: attention's k/v buffer vs a GRU's one vector
        assert by[(task, "attention")]["state_bytes"] > by[(task, "gru")]["state_bytes"]
        assert by[(task, "mlp")]["state_bytes"] == 0
    probe = [r for r in rows if r["group"] == "probe"]
    assert probe and all(r["trainable"] < r["params"] for r in probe)
    ind = [r for r in rows if r["extra_tests"]]  # induction tested beyond its training length
    assert {r["mixer"] for r in ind} == {m.value for m in MixerKind}
    assert all(0 <= v["mean"] <= 1 for r in ind for v in r["extra_tests"].values())


def test_interval_is_student_t():
    from keyfold.apps.toolbox.bench import _interval

    mean, half = _interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)


def test_one_seed_gives_no_interval_and_no_verdict_of_apart():
    """With ``--seeds 1`` every row read ``± 0.000`` and the verdicts called 0.738 against 0.739 MSE a win
    (a review, 2026-12-07): one value has no interval (``n/a``), and no two such rows are apart."""
    from keyfold.apps.toolbox.bench import _apart, _fmt_metric, _interval, _verdicts
    mean, half = _interval([0.738])
    assert mean == 0.738 and math.isnan(half)
    a = {"task": "t", "mixer": "attention", "metric": "mse", "mean": 0.738, "ci95": half}
    g = {"task": "t", "mixer": "gru", "metric": "mse", "mean": 0.739, "ci95": _interval([0.739])[1]}
    assert not _apart(a, g) and _fmt_metric(a) == "0.738 ± n/a"
    text = " ".join(_verdicts([a, g]))
    assert "tied with gru" in text and "wins" not in text


def test_repeated_tokens_vary_rules_out_the_fixed_offset_shortcut():
    """With one repeat length every answer sits M - 1 positions back, so a model that learned
    that offset "solves" induction and scores exactly 0 at twice the length (seen in the bench:
    attention 100 % at N=24, 0.0 % at N=48). vary=True: the offset differs between examples,
    and every scored answer is still the successor of the current token's earlier occurrence."""
    fixed = T.repeated_tokens(50, 24, vocab=64, seed=0)
    offsets_fixed = {int(i) for i in (fixed.targets[0] != T.IGNORE).nonzero()[:, 0]}
    assert min(offsets_fixed) == 12
    t = T.repeated_tokens(200, 24, vocab=64, vary=True, seed=0)
    starts = set()
    for x, y in zip(t.inputs.tolist(), t.targets.tolist()):
        assert len(set(x)) == len(x) - sum(yi != T.IGNORE for yi in y) - 1  # prefix and one copy distinct
        scored = [i for i, yi in enumerate(y) if yi != T.IGNORE]
        starts.add(scored[0])
        for i in scored:
            assert y[i] == x[x.index(x[i]) + 1]  # the induction rule, through the first occurrence
    assert len(starts) >= 5  # the shortcut's offset is not one number any more
    with pytest.raises(ValueError, match="vocab >= 18"):
        T.repeated_tokens(2, 24, vocab=10, vary=True)


def _mqar_row(mixer, N, d, mean, ci):
    return {"task": f"mqar N={N} d={d} kv=6", "group": "mqar", "mixer": mixer, "N": N, "d": d,
            "mean": mean, "ci95": ci, "metric": "accuracy"}


@pytest.mark.parametrize("gru_long,tcn_wide,verdict", [
    ((0.40, 0.02), (0.80, 0.02), "**reproduces**"),              # falls with length, recovers with width
    ((0.60, 0.02), (0.55, 0.02), "**partly reproduces**"),       # floor-level: no move beyond the intervals
    ((0.90, 0.02), (0.80, 0.02), "**does not reproduce**"),      # gru rises with length, intervals apart
])
def test_zoology_scaling_verdict_counts_only_moves_beyond_both_intervals(gru_long, tcn_wide, verdict):
    """A mixer sitting near its floor at every size is not evidence for the trend (the old check
    called that 'reproduces' or, from one interval, 'does not reproduce')."""
    from keyfold.apps.toolbox import bench as tb
    rows = [_mqar_row("attention", 48, 48, 0.99, 0.01), _mqar_row("gru", 48, 48, 0.6, 0.02),
            _mqar_row("tcn", 48, 48, 0.5, 0.02),
            _mqar_row("attention", 96, 48, 0.99, 0.01), _mqar_row("gru", 96, 48, *gru_long),
            _mqar_row("tcn", 96, 48, 0.5, 0.02),
            _mqar_row("attention", 48, 96, 0.99, 0.01), _mqar_row("gru", 48, 96, 0.6, 0.02),
            _mqar_row("tcn", 48, 96, *tcn_wide)]
    line = next(x for x in tb._claims(rows) if "Zoology, scaling" in x)
    assert verdict in line, line


def test_resume_keeps_only_rows_made_under_the_same_settings(tmp_path, monkeypatch):
    """``--resume`` kept every saved row by (task, mixer): rows of a ``--seeds 1`` run went into a 2-seed
    report, one value each under "mean ± 95 % t-interval" (a review, 2026-12-07). Rows now carry the
    settings they were made under, and the others run again."""
    from keyfold.apps.toolbox import bench
    seen = {}

    class Stop(Exception):
        pass

    def fake_run(preset, *, done, on_row, **kw):
        seen["done"] = done
        on_row({"task": "t", "mixer": "gru"})
        raise Stop
    monkeypatch.setattr(bench, "run", fake_run)
    with pytest.raises(Stop):  # a first run saves its row with its settings
        bench.main(["--tiny", "--seeds", "1", "--out", str(tmp_path), "--no-progress", "--workers", "1"])
    partial = next(tmp_path.glob("*.partial.jsonl"))
    assert json.loads(partial.read_text())["made_under"]
    with pytest.raises(Stop):  # the same settings: kept, without the bookkeeping key
        bench.main(["--tiny", "--seeds", "1", "--resume", "--out", str(tmp_path), "--no-progress", "--workers", "1"])
    assert seen["done"] == [{"task": "t", "mixer": "gru"}]
    partial.write_text(partial.read_text().splitlines()[0] + "\n")
    with pytest.raises(Stop):  # two seeds now: the one-seed row runs again
        bench.main(["--tiny", "--seeds", "2", "--resume", "--out", str(tmp_path), "--no-progress", "--workers", "1"])
    assert seen["done"] == []


def test_claims_say_not_tested_where_nothing_learned_the_task():
    """With attention at chance on induction (1 %), the verdict explained that "RoPE attention keeps the copy
    rule at longer lengths"; with every mixer at chance on selective copying, S4D "does not fail" for a reason
    (a review, 2026-12-08). A verdict whose premise no mixer met says "not tested"."""
    from keyfold.apps.toolbox import bench as tb

    def ind(m, mean, far):
        return {"task": "induction N=16", "group": "recall", "mixer": m, "metric": "accuracy", "mean": mean,
                "ci95": 0.01, "extra_tests": {"N=32": {"mean": far, "ci95": 0.01}}}

    def copy(m, mean):
        return {"task": "selective copy N=64", "group": "recall", "mixer": m, "metric": "accuracy", "mean": mean,
                "ci95": 0.01, "N": 64, "tcn_field": 128}

    text = "\n".join(tb._claims([ind("attention", 0.012, 0.009), ind("gru", 0.04, 0.009),
                                 copy("attention", 0.117), copy("gru", 0.10), copy("s4d", 0.094)]))
    assert "keeps the copy rule" not in text and "can still place the tokens" not in text
    assert text.count("not tested") == 2, text
