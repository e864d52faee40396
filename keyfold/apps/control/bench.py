"""``python -m keyfold control bench``: every predictor in the safe real-time loop, filter on and off.

For each plant: log excitation data, train each predictor on it (ARX by least squares, the
toolbox models with the same number of Adam steps and a swept learning rate), then run MPC over
each predictor for several seeds with the safety filter on and off, on the wall clock. Writes
``control.md`` (tables), ``control.json`` (every number) and ``control.png`` (trajectories with
the limits drawn) under ``--out`` (``control-quick.*`` for the quick preset). Ratios are against the ARX baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .controllers import MPPIConfig, MPPIController, WorstActionController
from .loop import LoopConfig, LoopResult, WallClock, run_loop, square_reference
from .plants import Disturbance, Plant, excite, make_plant
from .predictors import PREDICTORS, Predictor, TrainConfig, make_predictor, prediction_rmse, windows
from .safety import FilterConfig, SafetyFilter, Source

__all__ = ["BenchConfig", "PRESETS", "run_bench", "main"]


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run."""

    plants: tuple[str, ...] = ("msd", "pendulum")
    predictors: tuple[str, ...] = PREDICTORS + ("adversary",)
    seeds: int = 2
    steps: int = 150
    window: int = 8
    episodes: int = 40               # excitation episodes for training (and a quarter as many for test)
    episode_steps: int = 200
    train: TrainConfig = TrainConfig(steps=300, lrs=(3e-3,))
    mpc: MPPIConfig = MPPIConfig()
    filter: FilterConfig = FilterConfig()
    threads: int = 1                 # torch threads (the machine is shared; 1 is the fair setting)
    preset: str = "quick"


PRESETS = {
    "quick": BenchConfig(),
    "full": BenchConfig(seeds=6, steps=300, episodes=100, episode_steps=300,
                        train=TrainConfig(steps=1000, lrs=(1e-3, 3e-3, 1e-2)), preset="full"),
}

# the reference each plant tracks: a square wave (amplitude, period in steps), near the limits
REFERENCES = {"msd": (0.9, 80), "pendulum": (0.45, 60)}
# a row with no model: the worst action every step, to show what the filter holds back
ADVERSARY = "adversary"
# disturbance drawn in seed i: cycles through the kinds (the bound is the same for all)
KINDS = (Disturbance.UNIFORM, Disturbance.VERTEX, Disturbance.WORST)


def _closed_loop_error(pred: Predictor, runs: list[LoopResult]) -> float:
    """One-step RMSE of the predictor on the windows the closed loop visited (all states, pooled)."""
    xs, us, ys = [], [], []
    L = pred.window
    for r in runs:
        X = torch.as_tensor(r.states, dtype=torch.float32)
        U = torch.as_tensor(r.inputs, dtype=torch.float32)
        for k in range(L - 1, len(U)):
            xs.append(X[k - L + 1:k + 1])
            us.append(U[k - L + 1:k + 1])
            ys.append(X[k + 1])
    if not xs:
        return float("nan")
    from .predictors import Windows  # noqa: PLC0415
    w = Windows(torch.stack(xs), torch.stack(us), torch.stack(ys))
    return float(np.sqrt(np.mean(prediction_rmse(pred, w) ** 2)))


def _aggregate(runs: list[LoopResult]) -> dict:
    s = [r.summary() for r in runs]
    lat = np.concatenate([r.latency for r in runs])
    filt = np.concatenate([r.filter_latency for r in runs])
    corr = np.concatenate([np.abs(r.inputs - r.proposals).max(1) for r in runs])
    inter = np.concatenate([[src is Source.CORRECTED for src in r.sources] for r in runs]).astype(bool)
    return {
        "tracking_mse": float(np.mean([x["tracking_mse"] for x in s])),
        "tracking_mse_std": float(np.std([x["tracking_mse"] for x in s])),
        "violation_steps": int(sum(x["violations"] for x in s)),
        "runs_with_violation": int(sum(x["violations"] > 0 for x in s)),
        "max_violation": float(max(x["max_violation"] for x in s)),
        "input_violations": int(sum(x["input_violations"] for x in s)),
        "interventions": int(sum(x["interventions"] for x in s)),
        "mean_correction": float(corr[inter].mean()) if inter.any() else 0.0,
        "max_correction": float(corr[inter].max()) if inter.any() else 0.0,
        "deadline_misses": int(sum(x["deadline_misses"] for x in s)),
        "solver_fallbacks": int(sum(x["solver_fallbacks"] for x in s)),
        "uncertified": int(sum(x["uncertified"] for x in s)),
        "controller_faults": int(sum(x["controller_faults"] for x in s)),
        "assumption_exceeded": int(sum(x["assumption_exceeded"] for x in s)),
        "certified_invalidated": int(sum(x["certified_invalidated"] for x in s)),
        "violations_after_certified": int(sum(x["violations_after_certified"] for x in s)),
        "runs_stopped": int(sum(x["stopped"] is not None for x in s)),
        "warnings": [w for r in runs for w in r.warnings()],
        "latency_p50_ms": float(np.percentile(lat, 50) * 1e3),
        "latency_p99_ms": float(np.percentile(lat, 99) * 1e3),
        "latency_max_ms": float(lat.max() * 1e3),
        "filter_p50_ms": float(np.percentile(filt, 50) * 1e3),
        "filter_p99_ms": float(np.percentile(filt, 99) * 1e3),
        "max_disturbance_ratio": float(max(x["max_disturbance_ratio"] for x in s)),
        "steps": int(sum(x["steps"] for x in s)),
    }


def run_bench(cfg: BenchConfig, progress: bool = True) -> tuple[dict, dict]:
    """Run everything; returns (results as JSON-able dict, trajectories for the plot)."""
    torch.set_num_threads(cfg.threads)
    out = {"config": _jsonable(asdict(cfg)), "machine": _machine(), "plants": {}}
    traj: dict = {}
    total = len(cfg.plants) * len(cfg.predictors) * 2 * cfg.seeds
    bar = tqdm(total=total, desc="control bench", disable=not progress)
    for pname in cfg.plants:
        plant = make_plant(pname)
        sf = SafetyFilter.from_plant(plant, cfg.filter)
        train = windows(excite(plant, cfg.episodes, cfg.episode_steps, np.random.default_rng(0)), cfg.window)
        test = windows(excite(plant, max(cfg.episodes // 4, 1), cfg.episode_steps, np.random.default_rng(1)),
                       cfg.window)
        amp, period = REFERENCES[pname]
        ref = square_reference(cfg.steps, amp, period, cfg.mpc.horizon)
        entry = {"plant": _describe(plant, sf), "predictors": {}}
        traj[pname] = {"plant": plant, "ref": ref, "runs": {}}
        for name in cfg.predictors:
            if name == ADVERSARY:
                pred = None
                ctrl = WorstActionController(plant.A, plant.B, plant.state_limits, plant.input_limits)
                res = {"params": 0, "train_s": 0.0, "lr": None, "test_rmse": None}
            else:
                pred = make_predictor(name, cfg.window).fit(train, cfg.train)
                ctrl = MPPIController(pred, plant.state_limits, plant.input_limits, plant.tracked, cfg.mpc)
                res = {"params": pred.info["params"], "train_s": pred.info["train_s"], "lr": pred.info["lr"],
                       "test_rmse": prediction_rmse(pred, test).tolist()}
            for on in (True, False):
                runs = []
                for seed in range(cfg.seeds):
                    lc = LoopConfig(steps=cfg.steps, filter_on=on, seed=seed, disturbance=KINDS[seed % len(KINDS)])
                    runs.append(run_loop(plant, ctrl, ref, lc, sf, WallClock()))
                    bar.update()
                agg = _aggregate(runs)
                agg["closed_loop_rmse"] = None if pred is None else _closed_loop_error(pred, runs)
                res["filter_on" if on else "filter_off"] = agg
                traj[pname]["runs"][(name, on)] = runs[0]
            entry["predictors"][name] = res
        _ratios(entry["predictors"])
        out["plants"][pname] = entry
    bar.close()
    return out, traj


def _ratios(preds: dict) -> None:
    """Tracking cost and latency relative to ARX in the same run (the peer)."""
    if "arx" not in preds:
        return
    for side in ("filter_on", "filter_off"):
        base = preds["arx"][side]
        for r in preds.values():
            r[side]["tracking_vs_arx"] = r[side]["tracking_mse"] / max(base["tracking_mse"], 1e-300)
            r[side]["latency_p50_vs_arx"] = r[side]["latency_p50_ms"] / max(base["latency_p50_ms"], 1e-300)


def _describe(plant: Plant, sf: SafetyFilter) -> dict:
    lo, hi = plant.state_limits.bounding_box()
    return {"name": plant.name, "dt": plant.dt, "state_box": [lo.tolist(), hi.tolist()],
            "state_rows": int(plant.state_limits.H.shape[0]),
            "input_box": [plant.input_limits.lo.tolist(), plant.input_limits.hi.tolist()],
            "w_bar": plant.disturbance_bound().tolist(), "noise": plant.noise.tolist(),
            "linearization_bound": plant.residual_bound().tolist(), "horizon": sf.N,
            "terminal_steps": sf.terminal_steps, "tube_K": sf.K.tolist(), "qp_rows": int(sf._G.shape[0]),
            "solver": sf.config.solver.value}


def _machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or
            platform.machine(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                         time.gmtime())}


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "value") and not isinstance(x, (int, float, str)):
        return x.value
    return x


# ------------------------------------------------------------------ reports


def markdown(out: dict, command: str) -> str:
    cfg = out["config"]
    lines = [f"# Closed loop: predictors under a safety filter ({cfg['preset']} preset)", "",
             f"Command: `{command}`  ",
             f"Machine: {out['machine']['cpu']}, torch {out['machine']['torch']}, {cfg['threads']} torch thread(s), "
             f"{out['machine']['date']}. {cfg['seeds']} seeds x {cfg['steps']} steps per cell; disturbances cycle "
             f"uniform / vertex / worst-case by seed. MPC: MPPI, {cfg['mpc']['samples']} samples x "
             f"{cfg['mpc']['horizon']} steps. Latency is the whole step (fallback shift + MPC + filter QP) on "
             f"the wall clock; the deadline is the control period.", ""]
    for pname, entry in out["plants"].items():
        p = entry["plant"]
        lines += [f"## {p['name']} (period {p['dt'] * 1e3:.0f} ms, w_bar {np.round(p['w_bar'], 5).tolist()}, "
                  f"horizon {p['horizon']}, {p['qp_rows']} QP rows, solver {p['solver']})", "",
                  "| predictor | filter | tracking MSE | vs ARX | violations (steps / runs) | interventions | "
                  "mean / max correction | test RMSE | closed-loop RMSE | step p50 / p99 / max ms | filter p50 / p99 ms | "
                  "deadline misses | faults | max \\|w\\|/w_bar (filter's bound) | w_bar exceeded / certified steps broken |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        notes = []
        for name, r in entry["predictors"].items():
            for side in ("filter_on", "filter_off"):
                a = r[side]
                lines.append(
                    f"| {name} | {'on' if side == 'filter_on' else 'off'} | {a['tracking_mse']:.4f} "
                    f"± {a['tracking_mse_std']:.4f} | {a.get('tracking_vs_arx', float('nan')):.2f}x | "
                    f"{a['violation_steps']} / {a['runs_with_violation']} | {a['interventions']} | "
                    f"{a['mean_correction']:.3f} / {a['max_correction']:.3f} | "
                    f"{_num(r['test_rmse'])} | {_num(a['closed_loop_rmse'])} | "
                    f"{a['latency_p50_ms']:.1f} / {a['latency_p99_ms']:.1f} / {a['latency_max_ms']:.1f} | "
                    f"{a['filter_p50_ms']:.2f} / {a['filter_p99_ms']:.2f} | "
                    f"{a['deadline_misses']} | {a['controller_faults']} | {a['max_disturbance_ratio']:.3f} | "
                    f"{a['assumption_exceeded']} / {a['certified_invalidated']} |")
                notes += [f"- **{name}, filter {'on' if side == 'filter_on' else 'off'}**: {w}" for w in a["warnings"]]
        if notes:
            lines += ["", "Warnings (the guarantee does not cover these runs where it says so):", ""] + notes
        lines += ["", "| predictor | parameters | train s | lr | p50 latency vs ARX |", "|---|---|---|---|---|"]
        for name, r in entry["predictors"].items():
            lines.append(f"| {name} | {r['params']} | {r['train_s']:.1f} | {r['lr']} | "
                         f"{r['filter_on'].get('latency_p50_vs_arx', float('nan')):.1f}x |")
        lines.append("")
    return "\n".join(lines)


def _num(x) -> str:
    """An RMSE (pooled over states if a list) or a dash where there is no model."""
    if x is None:
        return "—"
    return f"{float(np.sqrt(np.mean(np.square(x)))):.5f}"


def plot(traj: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(len(traj), 2, figsize=(14, 4.2 * len(traj)), squeeze=False)
    for row, (pname, t) in enumerate(traj.items()):
        plant, ref = t["plant"], t["ref"]
        lo, hi = plant.state_limits.bounding_box()
        ax = axes[row, 0]
        steps = None
        for (name, on), r in t["runs"].items():
            if name not in ("arx", "attention"):
                continue
            tt = np.arange(len(r.states)) * plant.dt
            steps = len(r.states)
            ax.plot(tt, r.states[:, plant.tracked], ls="-" if on else "--",
                    label=f"{name}, filter {'on' if on else 'off'}", lw=1.2)
        tt = np.arange(steps) * plant.dt
        ax.plot(tt, ref[:steps], color="k", lw=0.8, label="reference")
        for y in (lo[plant.tracked], hi[plant.tracked]):
            ax.axhline(y, color="r", lw=1.5)
        ax.set_xlabel("time (s)")
        ax.set_ylabel(plant.labels[plant.tracked])
        ax.set_title(f"{plant.name}: tracked state, limits in red (seed 0)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax = axes[row, 1]
        _draw_polytope(ax, plant.state_limits, lo, hi)
        for (name, on), r in t["runs"].items():
            if name in ("arx", "attention"):
                ax.plot(r.states[:, 0], r.states[:, 1], ls="-" if on else "--", lw=0.9,
                        label=f"{name}, filter {'on' if on else 'off'}")
        ax.set_xlabel(plant.labels[0])
        ax.set_ylabel(plant.labels[1])
        ax.set_title(f"{plant.name}: state plane, limits in red")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_polytope(ax, poly, lo, hi) -> None:
    """Edges of a 2-D polytope: each row's line segment clipped to the others."""
    pad = 0.25 * (hi - lo)
    xs = np.linspace(lo[0] - pad[0], hi[0] + pad[0], 400)
    ys = np.linspace(lo[1] - pad[1], hi[1] + pad[1], 400)
    XX, YY = np.meshgrid(xs, ys)
    pts = np.stack([XX.ravel(), YY.ravel()], 1)
    inside = (poly.margins(pts) >= 0).all(1).reshape(XX.shape)
    ax.contour(XX, YY, inside.astype(float), levels=[0.5], colors="r", linewidths=1.5)


# ------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m keyfold control bench", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="2 seeds x 150 steps, short training (default)")
    g.add_argument("--full", action="store_true", help="6 seeds x 300 steps, longer training with a swept lr")
    ap.add_argument("--predictors", help=f"comma list from {','.join(PREDICTORS)},{ADVERSARY} "
                    "(other toolbox mixer names work too)")
    ap.add_argument("--plants", help="comma list from msd,pendulum")
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--train-steps", type=int)
    ap.add_argument("--out", default="benchmarks/results", help="folder for control.md/json/png")
    ap.add_argument("--name", help="file stem of the outputs (default control-quick / control for --full)")
    args = ap.parse_args(argv)
    cfg = PRESETS["full" if args.full else "quick"]
    if args.predictors:
        cfg = replace(cfg, predictors=tuple(args.predictors.split(",")))
    if args.plants:
        cfg = replace(cfg, plants=tuple(args.plants.split(",")))
    if args.seeds:
        cfg = replace(cfg, seeds=args.seeds)
    if args.steps:
        cfg = replace(cfg, steps=args.steps)
    if args.train_steps:
        cfg = replace(cfg, train=replace(cfg.train, steps=args.train_steps))
    name = args.name or ("control" if args.full else "control-quick")
    out, traj = run_bench(cfg)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    command = "python -m keyfold control bench " + " ".join(argv or [])
    (folder / f"{name}.json").write_text(json.dumps(out, indent=1))
    (folder / f"{name}.md").write_text(markdown(out, command.strip()))
    plot(traj, folder / f"{name}.png")
    print(markdown(out, command.strip()))
    return 0
