"""``python -m keyfold bench toolbox``: every mixer on every task, reported without flattery.

Protocol (DESIGN.md section 7): every mixer gets the same number of optimiser steps on the same
batches; its learning rate is swept on seed 0 and chosen on the validation part; then every seed
trains at that rate and is scored on the test part. Reported per (task, mixer): the test metric as
mean ± 95 % t-interval over seeds, parameter count, training seconds for the fixed budget (and the
ratio to attention measured in the same run), streaming step latency p50 / p99 at batch 1 over a
whole sequence, and the streaming state each sequence keeps at its last token.

Presets: ``--tiny`` (the test suite, seconds), ``--quick`` (minutes), ``--full`` (about half an
hour on 2 cores). Output: ``toolbox[.PRESET].md``, ``.json`` and ``.png`` under
``benchmarks/results/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import data as _data
from . import tasks as _tasks
from .mixers import MixerKind
from .model import SequenceModel

__all__ = ["Preset", "PRESETS", "Baseline", "run", "main", "markdown", "plot"]

ALL_MIXERS = tuple(MixerKind)


class Baseline(enum.Enum):
    """Forecasting baselines that run beside the mixers (no sequence model inside)."""

    SEASONAL_NAIVE = "seasonal_naive"  # repeat the last season; nothing to train
    DLINEAR = "dlinear"                # Zeng et al. 2023, trained like the mixers


@dataclass(frozen=True)
class Preset:
    """One benchmark size. Every mixer gets ``steps`` Adam steps of ``batch`` sequences."""

    name: str
    seeds: int                      # seeds per (task, mixer), >= 3 for an interval
    lrs: tuple[float, ...]          # learning rates swept on seed 0, synthetic tasks
    small_lrs: tuple[float, ...]    # learning rates swept on seed 0, small real data sets
    steps: int                      # optimiser steps on synthetic tasks, the same for every mixer
    small_steps: int                # steps on the small real data sets (forecast, classify)
    batch: int
    width: int                      # model width (the recall sweep adds recall_widths)
    depth: int
    recall_lengths: tuple[int, ...]  # MQAR sequence lengths at ``width`` (the first one runs first)
    recall_widths: tuple[int, ...]   # MQAR widths at recall_lengths[0]
    kv_pairs: int                   # MQAR key-value pairs
    copy_length: int                # selective copying sequence length
    copy_tokens: int                # tokens to copy
    induction_length: int           # repeated random tokens (Olsson et al.), length 2M
    eval_examples: int              # validation / test examples per synthetic task
    forecast_sets: tuple[str, ...]
    ucr_sets: tuple[str, ...]
    probe: bool                     # random-init probe (frozen mixers) on the recall tasks
    mixers: tuple[MixerKind, ...] = ALL_MIXERS


PRESETS = {
    "tiny": Preset("tiny", seeds=2, lrs=(3e-3,), small_lrs=(3e-3,), steps=4, small_steps=4, batch=8, width=16, depth=1,
                   recall_lengths=(16,), recall_widths=(), kv_pairs=2, copy_length=16, copy_tokens=4,
                   induction_length=16, eval_examples=16, forecast_sets=("nile",),
                   ucr_sets=("ItalyPowerDemand",), probe=True),
    "quick": Preset("quick", seeds=3, lrs=(3e-3, 1e-2), small_lrs=(2e-3, 6e-3), steps=150, small_steps=80,
                    batch=32, width=32, depth=2, recall_lengths=(32, 64), recall_widths=(), kv_pairs=4, copy_length=48,
                    copy_tokens=8, induction_length=48, eval_examples=256, forecast_sets=("nile", "sunspots"),
                    ucr_sets=("ItalyPowerDemand",), probe=True),
    # 18 min on 2 lightly loaded cores (one thread), 42 min under a load of 10
    "full": Preset("full", seeds=3, lrs=(2e-3, 6e-3, 1.8e-2), small_lrs=(2e-3, 6e-3), steps=300, small_steps=100,
                   batch=32, width=32, depth=2, recall_lengths=(32, 16, 64), recall_widths=(64,), kv_pairs=4,
                   copy_length=32, copy_tokens=6, induction_length=32, eval_examples=512,
                   forecast_sets=_data.FORECAST_SETS, ucr_sets=("ItalyPowerDemand",), probe=True),
}


# ------------------------------------------------------------------------------ problems


@dataclass
class _Problem:
    """One task configuration, seen the same way by every mixer."""

    group: str                      # "recall", "probe", "forecast", "classify"
    name: str                       # row label, e.g. "mqar N=128 d=64"
    metric: str                     # "accuracy" (higher is better) or "mse"
    seq_len: int
    make: Callable[[object, int], nn.Module]       # (kind, seed) -> model
    batch: Callable[[int, int], tuple]             # (seed, step) -> (x, y)
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    score: Callable[[nn.Module, str], float]       # (model, "val" | "test") -> metric
    stream_input: torch.Tensor      # one sequence for the latency probe, (N,) or (N, d_in)
    steps: int = 0                  # optimiser steps, the same for every kind
    lrs: tuple = ()                 # learning rates swept, the same grid for every kind
    kinds: tuple = ()               # what runs: MixerKinds and baseline names
    extra: dict = field(default_factory=dict)

    @property
    def higher_better(self) -> bool:
        return self.metric == "accuracy"


def _token_problem(group, name, gen: Callable[[int, int], _tasks.TokenTask], preset: Preset, width: int,
                   seq_len: int, frozen: bool) -> _Problem:
    """A synthetic task: fresh training batches every step (data is unlimited, as in Zoology)."""
    n_train = preset.steps * preset.batch  # every training batch is fresh data
    cache: dict = {}

    def train_set(seed):  # a few MB per seed; every kind reuses them
        if seed not in cache:
            cache[seed] = gen(n_train, 1000 + seed)
        return cache[seed]

    val, test = gen(preset.eval_examples, 1), gen(preset.eval_examples, 2)
    vocab = val.vocab

    def make(kind, seed):
        torch.manual_seed(seed)
        m = SequenceModel(kind, vocab=vocab, d_out=vocab, width=width, depth=preset.depth, seq_len=seq_len)
        return m.freeze_body() if frozen else m

    def batch(seed, step):
        t = train_set(seed)[step * preset.batch:(step + 1) * preset.batch]
        return t.inputs, t.targets

    def loss(model, xy):
        logits = model(xy[0])
        return F.cross_entropy(logits.flatten(0, 1), xy[1].flatten(), ignore_index=_tasks.IGNORE)

    @torch.no_grad()
    def score(model, part):
        t = val if part == "val" else test
        return _tasks.accuracy(torch.cat([model(t.inputs[i:i + 128]) for i in range(0, len(t), 128)]), t.targets)

    return _Problem(group, name, "accuracy", seq_len, make, batch, loss, score, test.inputs[0],
                    steps=preset.steps, lrs=preset.lrs, kinds=preset.mixers)


class _Forecaster(nn.Module):
    """Window -> horizon forecast. Every learned forecaster sees the window minus its last value
    and adds it back (NLinear's normalisation), so only the sequence model differs."""

    def __init__(self, core: nn.Module, horizon: int, channels: int, sequence: bool):
        super().__init__()
        self.core, self.horizon, self.channels, self.sequence = core, horizon, channels, sequence

    def forward(self, x):  # (B, L, C) -> (B, H, C)
        last = x[:, -1:]
        z = x - last
        if self.sequence:
            y = self.core(z)[:, -1].view(-1, self.horizon, self.channels)  # read out at the last step
        else:
            y = self.core(z)
        return y + last


def _forecast_problem(name: str, preset: Preset) -> _Problem:
    fs = _data.load_forecast(name)
    parts = {p: _data.forecast_windows(fs, p) for p in ("train", "val", "test")}
    C, H, L = fs.values.shape[1], fs.horizon, fs.lookback
    n = len(parts["train"][0])

    def make(kind, seed):
        torch.manual_seed(seed)
        if kind is Baseline.DLINEAR:
            return _Forecaster(_data.DLinear(L, H), H, C, sequence=False)
        if kind is Baseline.SEASONAL_NAIVE:
            return _SeasonalNaive(H, fs.period)
        core = SequenceModel(kind, d_in=C, d_out=H * C, width=preset.width, depth=preset.depth, seq_len=L)
        return _Forecaster(core, H, C, sequence=True)

    def batch(seed, step):
        g = torch.Generator().manual_seed(seed * 100003 + step)
        idx = torch.randint(0, n, (min(preset.batch, n),), generator=g)
        return parts["train"][0][idx], parts["train"][1][idx]

    def loss(model, xy):
        return F.mse_loss(model(xy[0]), xy[1])

    @torch.no_grad()
    def score(model, part):
        x, y = parts[part]
        return float(F.mse_loss(model(x), y))

    return _Problem("forecast", f"{name} (L={L}, H={H}, C={C})", "mse", L, make, batch, loss, score,
                    parts["test"][0][0], steps=preset.small_steps, lrs=preset.small_lrs,
                    kinds=(Baseline.SEASONAL_NAIVE, Baseline.DLINEAR) + preset.mixers,
                    extra={"period": fs.period, "train_windows": n})


class _SeasonalNaive(nn.Module):
    def __init__(self, horizon, period):
        super().__init__()
        self.horizon, self.period = horizon, period

    def forward(self, x):
        return _data.seasonal_naive(x, self.horizon, self.period)


def _classify_problem(name: str, preset: Preset) -> _Problem:
    xtr, ytr, xte, yte = _data.load_ucr(name)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(xtr), generator=g)
    n_val = max(1, len(xtr) // 4)  # a quarter of the training set picks the learning rate
    val_idx, tr_idx = perm[:n_val], perm[n_val:]
    parts = {"train": (xtr[tr_idx], ytr[tr_idx]), "val": (xtr[val_idx], ytr[val_idx]), "test": (xte, yte)}
    classes, L = int(torch.cat([ytr, yte]).max()) + 1, xtr.shape[1]

    def make(kind, seed):
        torch.manual_seed(seed)
        return _Classifier(SequenceModel(kind, d_in=1, d_out=classes, width=preset.width,
                                         depth=preset.depth, seq_len=L))

    def batch(seed, step):
        gg = torch.Generator().manual_seed(seed * 100003 + step)
        n = len(parts["train"][0])
        idx = torch.randint(0, n, (min(preset.batch, n),), generator=gg)
        return parts["train"][0][idx], parts["train"][1][idx]

    def loss(model, xy):
        return F.cross_entropy(model(xy[0]), xy[1])

    @torch.no_grad()
    def score(model, part):
        x, y = parts[part]
        return float((model(x).argmax(-1) == y).float().mean())

    return _Problem("classify", f"{name} (L={L}, {classes} classes, {len(tr_idx)} train)", "accuracy", L,
                    make, batch, loss, score, xte[0], steps=preset.small_steps, lrs=preset.small_lrs,
                    kinds=preset.mixers)


class _Classifier(nn.Module):
    """Mean of the per-position logits: a running mean, so it streams too."""

    def __init__(self, core: SequenceModel):
        super().__init__()
        self.core = core

    def forward(self, x):
        return self.core(x).mean(1)


def _problems(preset: Preset) -> list[_Problem]:
    """Every problem, cheapest and most diverse first, so an interrupted run (``--resume``,
    ``--from-partial``) still covers every kind of task."""
    P, d = preset.kv_pairs, preset.width
    N0 = preset.recall_lengths[0]

    def mqar(n_len):
        return lambda n, seed: _tasks.mqar(n, n_len, vocab=max(64, 8 * P), num_kv_pairs=P, seed=seed)

    Nc, K, Ni = preset.copy_length, preset.copy_tokens, preset.induction_length
    induction = lambda n, seed: _tasks.repeated_tokens(n, Ni, vocab=max(64, Ni), seed=seed)  # noqa: E731
    probs = [_token_problem("recall", f"mqar N={N0} d={d} kv={P}", mqar(N0), preset, d, N0, False)]
    probs += [_forecast_problem(n, preset) for n in preset.forecast_sets]
    for n in preset.ucr_sets:
        try:
            probs.append(_classify_problem(n, preset))
        except FileNotFoundError as e:  # the UCR files ship inside sktime / aeon, an optional extra
            warnings.warn(f"skipping {n}: {e}")
    probs.append(_token_problem("recall", f"induction N={Ni}", induction, preset, d, Ni, False))
    probs.append(_token_problem(
        "recall", f"selective copy N={Nc} k={K}",
        lambda n, seed: _tasks.selective_copying(n, Nc, num_tokens=K, num_data=16, seed=seed), preset, d, Nc, False))
    if preset.probe:
        probs.append(_token_problem("probe", f"frozen mqar N={N0} d={d}", mqar(N0), preset, d, N0, True))
        probs.append(_token_problem("probe", f"frozen induction N={Ni}", induction, preset, d, Ni, True))
    for N in preset.recall_lengths[1:]:
        probs.append(_token_problem("recall", f"mqar N={N} d={d} kv={P}", mqar(N), preset, d, N, False))
    for w in preset.recall_widths:
        probs.append(_token_problem("recall", f"mqar N={N0} d={w} kv={P}", mqar(N0), preset, w, N0, False))
    return probs


# ------------------------------------------------------------------------------ running


def _train(model: nn.Module, prob: _Problem, preset: Preset, lr: float, seed: int) -> float:
    """``prob.steps`` AdamW steps, warm-up then cosine decay, grad-norm clip 1; returns seconds."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    steps = prob.steps
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        loss = prob.loss(model, prob.batch(seed, step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
    model.eval()
    return time.perf_counter() - t0


def _sequence_model(model: nn.Module) -> SequenceModel | None:
    if isinstance(model, SequenceModel):
        return model
    core = getattr(model, "core", None)
    return core if isinstance(core, SequenceModel) else None


@torch.no_grad()
def _streaming(model: nn.Module, prob: _Problem) -> dict:
    """Step latency p50 / p99 (microseconds, batch 1, every position of one sequence after a
    short warm-up) and the state bytes one sequence holds at its last position."""
    seq = _sequence_model(model)
    if seq is None:
        return {"p50_us": None, "p99_us": None, "state_bytes": None}
    x = prob.stream_input
    for t in range(min(4, len(x))):  # warm-up: allocator, first-call paths
        seq.step(x[t:t + 1], seq.init_state(1))
    st, times = seq.init_state(1), []
    for t in range(len(x)):
        t0 = time.perf_counter()
        _, st = seq.step(x[t:t + 1], st)
        times.append(time.perf_counter() - t0)
    us = np.array(times) * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "state_bytes": seq.state_nbytes(st)}


def _interval(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % Student-t interval (0 for fewer than 2 values)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, 0.0
    from scipy import stats

    return m, float(stats.t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)))


def _kind_name(kind) -> str:
    return kind.value


def _run_kind(prob: _Problem, kind, preset: Preset, bar) -> dict:
    """LR sweep on seed 0 (chosen on validation), then every seed at the chosen LR."""
    learned = kind is not Baseline.SEASONAL_NAIVE
    lrs = prob.lrs if learned else (0.0,)
    sweep, first = {}, None
    for lr in lrs:
        model = prob.make(kind, 0)
        secs = _train(model, prob, preset, lr, 0) if learned else 0.0
        sweep[lr] = (prob.score(model, "val"), model, secs)
        bar.update(1)
    best = (max if prob.higher_better else min)(sweep, key=lambda lr: sweep[lr][0])
    val, first, secs0 = sweep[best]
    tests, secs = [prob.score(first, "test")], [secs0]
    for seed in range(1, preset.seeds if learned else 1):
        model = prob.make(kind, seed)
        secs.append(_train(model, prob, preset, best, seed))
        tests.append(prob.score(model, "test"))
        bar.update(1)
    mean, half = _interval(tests)
    n_params = sum(p.numel() for p in first.parameters())
    n_train = sum(p.numel() for p in first.parameters() if p.requires_grad)
    return {"task": prob.name, "group": prob.group, "mixer": _kind_name(kind), "metric": prob.metric,
            "mean": mean, "ci95": half, "values": tests, "lr": best if learned else None,
            "val_by_lr": {str(k): v[0] for k, v in sweep.items()}, "params": n_params,
            "trainable": n_train, "train_s": statistics.fmean(secs), **_streaming(first, prob)}


def run(preset: Preset, *, progress: bool = True, on_row: Callable[[dict], None] | None = None,
        done: list[dict] = ()) -> dict:
    """Run every problem of ``preset``; returns the JSON-ready result. ``on_row`` sees each
    finished (task, kind) row (the CLI appends it to a ``.partial.jsonl`` file); rows in ``done``
    (from an interrupted run of the same preset) are kept and not run again. Every run seeds its
    own data and initialisation, so a resumed run gives the same rows as an uninterrupted one."""
    finished = {(r["task"], r["mixer"]): r for r in done}
    from tqdm import tqdm

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    # one thread: these models are small, and on a shared 2-core machine a second OpenMP thread
    # mostly spins; every mixer runs under the same setting
    torch.set_num_threads(1)
    load0 = _loadavg()
    try:
        probs = _problems(preset)
        total = sum(len(p.lrs) + preset.seeds - 1 if k is not Baseline.SEASONAL_NAIVE else 1
                    for p in probs for k in p.kinds if (p.name, _kind_name(k)) not in finished)
        rows = []
        t0 = time.perf_counter()
        with tqdm(total=total, desc=f"toolbox {preset.name}", unit="run", disable=not progress) as bar:
            for prob in probs:
                for kind in prob.kinds:
                    if (prob.name, _kind_name(kind)) in finished:
                        rows.append(finished[(prob.name, _kind_name(kind))])
                        continue
                    bar.set_postfix_str(f"{prob.name} / {_kind_name(kind)}")
                    rows.append(_run_kind(prob, kind, preset, bar))
                    if on_row is not None:
                        on_row(rows[-1])
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    _add_ratios(rows)
    return {"preset": dataclasses.asdict(preset) | {"mixers": [k.value for k in preset.mixers]},
            "machine": _machine(load0), "seconds": seconds, "rows": rows}


def _machine(load_before) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(), "threads": 1,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_before": load_before, "load_after": _loadavg()}


def _loadavg() -> float | None:
    """1-minute load average (other processes share these cores; timings depend on it)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _add_ratios(rows: list[dict]) -> None:
    """Train time and p50 latency relative to attention on the same task, in the same run."""
    attn = {r["task"]: r for r in rows if r["mixer"] == MixerKind.ATTENTION.value}
    for r in rows:
        a = attn.get(r["task"])
        r["train_vs_attention"] = r["train_s"] / a["train_s"] if a and a["train_s"] and r["train_s"] else None
        r["p50_vs_attention"] = (r["p50_us"] / a["p50_us"]) if a and r["p50_us"] and a["p50_us"] else None


# ------------------------------------------------------------------------------ reporting


def _fmt_metric(r: dict) -> str:
    if r["metric"] == "accuracy":
        return f"{100 * r['mean']:.1f} ± {100 * r['ci95']:.1f}"
    return f"{r['mean']:.3f} ± {r['ci95']:.3f}"


def _opt(x, fmt):
    return "—" if x is None else format(x, fmt)


def markdown(result: dict) -> str:
    """The result as markdown tables, one per task group."""
    p = result["preset"]
    lines = [f"# Toolbox benchmark: preset `{p['name']}`", "",
             f"`python -m keyfold bench toolbox --{p['name']}` on {result['machine']['cpu']}, "
             f"torch {result['machine']['torch']}, {result['machine']['threads']} thread on "
             f"{result['machine']['cores']} shared cores (1-min load average {result['machine']['load_before']} "
             f"before, {result['machine']['load_after']} after: timings carry that noise), "
             f"{result['seconds'] / 60:.1f} min in all.", "",
             *(["**Incomplete run**: the report was written from the rows saved before it stopped.", ""]
               if result.get("incomplete") else []),
             f"Every model: width {p['width']} (unless the task says d=...), depth {p['depth']}, the same "
             f"AdamW steps for every kind ({p['steps']} on synthetic tasks with fresh batches of {p['batch']}, "
             f"{p['small_steps']} on the small real sets), "
             f"learning rate swept over {p['lrs']} (synthetic) and {p['small_lrs']} (real sets) on seed 0 "
             f"(validation), then {p['seeds']} seeds at the chosen rate; metric on the test part, "
             f"mean ± 95 % t-interval over seeds. Accuracy in %, MSE on "
             f"standardised values. Train s: seconds for the fixed budget (× attention: the same run's "
             f"attention time). Step: streaming latency at batch 1 over one sequence. State: bytes one "
             f"sequence keeps at its last token.", ""]
    lines += _summary(result["rows"])
    titles = {"recall": "Synthetic recall tasks (trained end to end)",
              "probe": "Random-initialisation probe (mixers frozen at init; embeddings and readout trained)",
              "forecast": "Forecasting, statsmodels data sets (test MSE; lower is better)",
              "classify": "Sequence classification, UCR sets shipped in sktime (test accuracy)"}
    for group, title in titles.items():
        rows = [r for r in result["rows"] if r["group"] == group]
        if not rows:
            continue
        lines += [f"## {title}", "",
                  "| task | mixer | metric | lr | params (trainable) | train s (× attn) "
                  "| step p50 / p99 µs | state KiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ratio = f" ({r['train_vs_attention']:.2f}×)" if r["train_vs_attention"] else ""
            params = f"{r['params']:,}" + (f" ({r['trainable']:,})" if r["trainable"] != r["params"] else "")
            lat = "—" if r["p50_us"] is None else f"{r['p50_us']:.0f} / {r['p99_us']:.0f}"
            state = "—" if r["state_bytes"] is None else f"{r['state_bytes'] / 1024:.1f}"
            lines.append(f"| {r['task']} | {r['mixer']} | {_fmt_metric(r)} | {_opt(r['lr'], 'g')} | {params} | "
                         f"{r['train_s']:.1f}{ratio} | {lat} | {state} |")
        lines.append("")
    lines += ["## Where attention wins and loses (computed from the rows above)", ""] + _verdicts(result["rows"])
    return "\n".join(lines) + "\n"


def _summary(rows: list[dict]) -> list[str]:
    """One line per task, one column per kind: the test metric's mean (best in bold)."""
    kinds = list(dict.fromkeys(r["mixer"] for r in rows))
    out = ["## Summary (test metric, mean over seeds; best per task in bold; details below)", "",
           "| task | metric | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
    for task in dict.fromkeys(r["task"] for r in rows):
        rs = {r["mixer"]: r for r in rows if r["task"] == task}
        any_r = next(iter(rs.values()))
        hib = any_r["metric"] == "accuracy"
        best = (max if hib else min)(r["mean"] for r in rs.values())
        cells = []
        for k in kinds:
            if k not in rs:
                cells.append("")
                continue
            v = f"{100 * rs[k]['mean']:.1f}" if hib else f"{rs[k]['mean']:.3f}"
            cells.append(f"**{v}**" if rs[k]["mean"] == best else v)
        metric = "acc %" if hib else "MSE"
        out.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    return out + [""]


def _verdicts(rows: list[dict]) -> list[str]:
    """For each task: the best mixer, and attention's place against it (overlapping intervals = tie)."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        rs = [r for r in rows if r["task"] == task]
        attn = next((r for r in rs if r["mixer"] == "attention"), None)
        if attn is None:
            continue
        hib = rs[0]["metric"] == "accuracy"
        ranked = sorted(rs, key=lambda r: -r["mean"] if hib else r["mean"])
        best = ranked[0]
        if best is attn:
            second = ranked[1] if len(ranked) > 1 else None
            tied = second is not None and abs(second["mean"] - attn["mean"]) <= second["ci95"] + attn["ci95"]
            word = f"is best, tied with {second['mixer']} (intervals overlap)" if tied else "wins"
        else:
            overlap = abs(best["mean"] - attn["mean"]) <= best["ci95"] + attn["ci95"]
            word = f"ties with {best['mixer']} (intervals overlap)" if overlap else f"loses to {best['mixer']}"
        out.append(f"- {task}: attention {_fmt_metric(attn)}, best {best['mixer']} {_fmt_metric(best)}: "
                   f"attention {word}.")
    return out


def plot(result: dict, path: Path) -> None:
    """One PNG: recall accuracy vs length, probe, forecasting vs seasonal naive, cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    mixers = list(dict.fromkeys(r["mixer"] for r in rows if r["group"] == "recall"))
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    # recall tasks: grouped bars with intervals
    ax = axes[0, 0]
    tasks = list(dict.fromkeys(r["task"] for r in rows if r["group"] == "recall"))
    _bars(ax, rows, tasks, mixers, scale=100)
    ax.set_ylabel("test accuracy %")
    ax.set_ylim(0, 105)
    ax.set_title("Synthetic recall, trained end to end")
    ax = axes[0, 1]
    tasks = list(dict.fromkeys(r["task"] for r in rows if r["group"] == "probe"))
    _bars(ax, rows, tasks, mixers, scale=100)
    ax.set_ylabel("test accuracy %")
    ax.set_ylim(0, 105)
    ax.set_title("Random-init probe: mixers frozen")
    ax = axes[1, 0]
    tasks = list(dict.fromkeys(r["task"] for r in rows if r["group"] in ("forecast",)))
    fmixers = list(dict.fromkeys(r["mixer"] for r in rows
                                 if r["group"] == "forecast" and r["mixer"] != Baseline.SEASONAL_NAIVE.value))
    base = {r["task"]: r["mean"] for r in rows if r["mixer"] == Baseline.SEASONAL_NAIVE.value}
    rel = [dict(r, mean=r["mean"] / base[r["task"]], ci95=r["ci95"] / base[r["task"]])
           for r in rows if r["task"] in base]
    _bars(ax, rel, tasks, fmixers, scale=1)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylim(0, 3)  # the stateless MLP, which only sees the last value, runs off the top
    ax.set_ylabel("test MSE / seasonal-naive MSE")
    ax.set_title("Forecasting (below the line beats seasonal naive)")
    ax = axes[1, 1]
    longest = [r for r in rows if r["group"] == "recall" and r["p50_us"] is not None]
    if longest:
        n_max = max(_length(r["task"]) for r in longest)
        for r in (r for r in longest if _length(r["task"]) == n_max and r["task"].startswith("mqar")):
            ax.scatter(max(r["state_bytes"], 1) / 1024, r["p50_us"], s=40, color=_COLORS.get(r["mixer"]))
            ax.annotate(r["mixer"], (max(r["state_bytes"], 1) / 1024, r["p50_us"]), fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"streaming state per sequence at N={n_max}, KiB (a stateless MLP drawn at 1 byte)")
        ax.set_ylabel("step latency p50, µs (batch 1)")
        ax.set_title("Streaming cost")
    fig.suptitle(f"keyfold toolbox, preset {result['preset']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _length(task: str) -> int:
    for tok in task.replace("(", " ").split():
        if tok.startswith("N="):
            return int(tok[2:])
    return 0


_COLORS = {k.value: f"C{i}" for i, k in enumerate(list(MixerKind) + [Baseline.DLINEAR, Baseline.SEASONAL_NAIVE])}


def _bars(ax, rows, tasks, mixers, scale):
    if not tasks:
        ax.set_visible(False)
        return
    w = 0.8 / max(1, len(mixers))
    for i, m in enumerate(mixers):
        means, errs = [], []
        for t in tasks:
            r = next((r for r in rows if r["task"] == t and r["mixer"] == m), None)
            means.append(scale * r["mean"] if r else np.nan)
            errs.append(scale * r["ci95"] if r else 0)
        ax.bar(np.arange(len(tasks)) + i * w, means, w, yerr=errs, label=m, capsize=2, color=_COLORS.get(m))
    ax.set_xticks(np.arange(len(tasks)) + 0.4 - w / 2)
    ax.set_xticklabels(tasks, rotation=15, fontsize=7)
    ax.legend(fontsize=7, ncol=2)


# ---------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m keyfold bench toolbox", description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="preset", action="store_const", const="quick", help="minutes (default)")
    size.add_argument("--full", dest="preset", action="store_const", const="full", help="about 30 min on 2 cores")
    size.add_argument("--tiny", dest="preset", action="store_const", const="tiny", help="seconds (tests)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    ap.add_argument("--mixers", default=None, help="comma-separated subset, e.g. attention,gru")
    ap.add_argument("--seeds", type=int, default=None, help="override the preset's seed count (>= 1)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows an interrupted run saved (.partial.jsonl) and run the rest")
    ap.add_argument("--from-partial", action="store_true",
                    help="only write the report from the rows an interrupted run saved (.partial.jsonl)")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset or "quick"]
    if args.mixers:
        preset = dataclasses.replace(preset, mixers=tuple(MixerKind.parse(m.strip()) for m in args.mixers.split(",")))
    if args.seeds is not None:
        if args.seeds < 1:
            ap.error("--seeds must be >= 1")
        preset = dataclasses.replace(preset, seeds=args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "toolbox" if preset.name == "full" else f"toolbox.{preset.name}"
    partial = args.out / f"{stem}.partial.jsonl"
    if args.from_partial:
        if not partial.is_file():
            ap.error(f"--from-partial: {partial} does not exist; run the preset first")
        rows = [json.loads(line) for line in partial.read_text().splitlines() if line.strip()]
        _add_ratios(rows)
        result = {"preset": dataclasses.asdict(preset) | {"mixers": [k.value for k in preset.mixers]},
                  "machine": _machine(None), "seconds": float("nan"), "rows": rows, "incomplete": True}
        return _write(result, args.out, stem)
    done = []
    if args.resume and partial.is_file():
        done = [json.loads(line) for line in partial.read_text().splitlines() if line.strip()]
    else:
        partial.write_text("")

    def save(row):
        with partial.open("a") as f:
            f.write(json.dumps(row) + "\n")

    result = run(preset, progress=not args.no_progress, on_row=save, done=done)
    partial.unlink()
    return _write(result, args.out, stem)


def _write(result: dict, out: Path, stem: str) -> int:
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / f"{stem}.md").write_text(md)
    plot(result, out / f"{stem}.png")
    print(md)
    print(f"wrote {out / stem}.md, .json, .png")
    return 0
