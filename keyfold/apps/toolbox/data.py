"""Real sequences that ship inside PyPI packages, and the plain baselines they are judged by.

Forecasting (``statsmodels.datasets``, installed with statsmodels; nothing is downloaded):

============  ==========================================================  ======  ========  =======
name          series                                                      period  lookback  horizon
============  ==========================================================  ======  ========  =======
sunspots      yearly sunspot activity 1700-2008                           11      44        11
co2           Mauna Loa CO2, weekly -> monthly means, gaps interpolated   12      48        12
elnino        monthly sea surface temperature 1950-2010 (rows flattened)  12      48        12
nile          yearly Nile flow at Aswan 1871-1970                         1       20        5
macrodata     US quarterly: growth of real GDP / consumption / investment,
              inflation, unemployment (5 channels)                        4       16        4
============  ==========================================================  ======  ========  =======

Splits are chronological (70 % train, 10 % validation, 20 % test, each window's targets inside
its part); values are standardised with the training part's mean and standard deviation.

Classification: UCR sets shipped as ``.ts`` files inside ``sktime`` (or ``aeon``), found on disk
and parsed here without importing either package (:func:`load_ucr`).

Baselines: :func:`seasonal_naive` (repeat the last season) and :class:`DLinear` (Zeng et al.
2023: moving-average trend + remainder, one linear map over time for each).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FORECAST_SETS", "ForecastSet", "load_forecast", "forecast_windows", "UCR_SETS", "load_ucr",
           "seasonal_naive", "DLinear"]

FORECAST_SETS = ("sunspots", "co2", "elnino", "nile", "macrodata")
UCR_SETS = ("ItalyPowerDemand", "GunPoint", "ArrowHead")


@dataclass(frozen=True)
class ForecastSet:
    """A standardised multichannel series and its forecasting setup.

    values: ``(T, C)`` float32, standardised by the training part; period: season length (1 =
    none); lookback / horizon: window lengths; splits: ``(train_end, val_end)`` indices into T.
    mean, std: ``(C,)`` to undo the standardisation.
    """

    name: str
    values: np.ndarray
    period: int
    lookback: int
    horizon: int
    splits: tuple[int, int]
    mean: np.ndarray
    std: np.ndarray


_SETUP = {"sunspots": (11, 44, 11), "co2": (12, 48, 12), "elnino": (12, 48, 12), "nile": (1, 20, 5),
          "macrodata": (4, 16, 4)}


def _raw_series(name: str) -> np.ndarray:
    """The raw series ``(T, C)`` float64 for one statsmodels data set."""
    import statsmodels.api as sm  # heavy import, only when real data is asked for

    if name == "sunspots":
        return sm.datasets.sunspots.load_pandas().data[["SUNACTIVITY"]].to_numpy(float)
    if name == "co2":
        s = sm.datasets.co2.load_pandas().data["co2"]
        # weekly readings with 59 missing weeks: monthly means skip them; a month with no reading
        # at all is linearly interpolated in time
        m = s.resample("MS").mean().interpolate(method="time")
        return m.to_numpy(float)[:, None]
    if name == "elnino":
        d = sm.datasets.elnino.load_pandas().data
        return d.drop(columns="YEAR").to_numpy(float).reshape(-1, 1)  # rows are years of 12 months
    if name == "nile":
        return sm.datasets.nile.load_pandas().data[["volume"]].to_numpy(float)
    if name == "macrodata":
        d = sm.datasets.macrodata.load_pandas().data
        growth = 100 * np.diff(np.log(d[["realgdp", "realcons", "realinv"]].to_numpy(float)), axis=0)
        return np.concatenate([growth, d[["infl", "unemp"]].to_numpy(float)[1:]], axis=1)
    raise ValueError(f"unknown forecasting set {name!r}; choose one of {', '.join(FORECAST_SETS)}")


def load_forecast(name: str) -> ForecastSet:
    """Load one of :data:`FORECAST_SETS`, standardised, with its split and window lengths.

    >>> fs = load_forecast("nile")
    >>> fs.values.shape, fs.period, fs.horizon
    ((100, 1), 1, 5)
    """
    raw = _raw_series(name)
    if not np.isfinite(raw).all():
        raise RuntimeError(f"{name}: non-finite values left after cleaning; this is a loader bug")
    period, lookback, horizon = _SETUP[name]
    T = len(raw)
    train_end, val_end = int(0.7 * T), int(0.8 * T)
    mean, std = raw[:train_end].mean(0), raw[:train_end].std(0) + 1e-8
    values = ((raw - mean) / std).astype(np.float32)
    return ForecastSet(name, values, period, lookback, horizon, (train_end, val_end),
                       mean.astype(np.float32), std.astype(np.float32))


def forecast_windows(fs: ForecastSet, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All sliding windows whose targets lie in ``part`` ("train", "val" or "test").

    Returns ``(x, y)``: x ``(W, lookback, C)`` and y ``(W, horizon, C)`` float32. The lookback of
    a val/test window may reach back into earlier parts (it is the past, known at forecast time).
    """
    train_end, val_end = fs.splits
    lo, hi = {"train": (0, train_end), "val": (train_end, val_end), "test": (val_end, len(fs.values))}[part]
    L, H = fs.lookback, fs.horizon
    starts = [t for t in range(max(lo, L), hi - H + 1)]  # t: first target index
    if not starts:
        raise ValueError(f"{fs.name}: no {part} window of lookback {L} + horizon {H} fits")
    v = torch.from_numpy(fs.values)
    x = torch.stack([v[t - L:t] for t in starts])
    y = torch.stack([v[t:t + H] for t in starts])
    return x, y


# ---------------------------------------------------------------------- classification


def _ucr_file(name: str, split: str) -> Path:
    for pkg in ("sktime", "aeon"):
        spec = importlib.util.find_spec(pkg)  # finds the package on disk without importing it
        if spec is None or not spec.submodule_search_locations:
            continue
        path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / name / f"{name}_{split}.ts"
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"UCR set {name!r} not found: it ships inside the sktime or aeon wheel "
        f"(`pip install --no-deps sktime` is enough, only its data files are read)")


def _parse_ts(path: Path) -> tuple[np.ndarray, list[str]]:
    """A univariate, equal-length ``.ts`` file: lines ``v1,v2,...,vL:label`` after ``@data``."""
    rows, labels, in_data = [], [], False
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not in_data:
            in_data = line.lower() == "@data"
            continue
        *dims, label = line.split(":")
        if len(dims) != 1:
            raise ValueError(f"{path.name}: only univariate series are supported, got {len(dims)} dimensions")
        rows.append([float(v) for v in dims[0].split(",")])
        labels.append(label)
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"{path.name}: series of unequal length are not supported")
    return np.asarray(rows, dtype=np.float32), labels


def load_ucr(name: str):
    """A UCR classification set: ``(x_train, y_train, x_test, y_test)``.

    x: ``(n, L, 1)`` float32, each series z-normalised; y: ``(n,)`` int64 in ``[0, classes)``.

    >>> xtr, ytr, xte, yte = load_ucr("ItalyPowerDemand")
    >>> xtr.shape, xte.shape, int(ytr.max()) + 1
    (torch.Size([67, 24, 1]), torch.Size([1029, 24, 1]), 2)
    """
    xtr, ltr = _parse_ts(_ucr_file(name, "TRAIN"))
    xte, lte = _parse_ts(_ucr_file(name, "TEST"))
    classes = sorted(set(ltr) | set(lte))
    index = {c: i for i, c in enumerate(classes)}

    def prep(x, labels):
        x = (x - x.mean(1, keepdims=True)) / (x.std(1, keepdims=True) + 1e-8)
        return torch.from_numpy(x)[:, :, None], torch.tensor([index[c] for c in labels])

    return (*prep(xtr, ltr), *prep(xte, lte))


# --------------------------------------------------------------------------- baselines


def seasonal_naive(x: torch.Tensor, horizon: int, period: int) -> torch.Tensor:
    """Repeat the last season: ``y[h] = x[L - period + (h mod period)]``.

    x ``(B, L, C)`` with ``L >= period``; returns ``(B, horizon, C)``. ``period=1`` is the naive
    forecast (the last value).
    """
    if period < 1 or x.shape[1] < period:
        raise ValueError(f"seasonal_naive: need 1 <= period <= lookback, got period={period}, lookback={x.shape[1]}")
    idx = x.shape[1] - period + torch.arange(horizon) % period
    return x[:, idx]


class DLinear(nn.Module):
    """DLinear (Zeng et al. 2023, "Are Transformers Effective for Time Series Forecasting?").

    trend = moving average of the window (kernel ``k``, edges replicated), remainder = x - trend;
    forecast = ``W_s remainder + W_t trend`` along time, one map shared by all channels.
    ``(B, L, C) -> (B, H, C)``.
    """

    def __init__(self, lookback: int, horizon: int, kernel: int = 25):
        super().__init__()
        kernel = min(kernel, lookback if lookback % 2 else lookback - 1)
        self.kernel = max(kernel, 1)
        self.seasonal = nn.Linear(lookback, horizon)
        self.trend = nn.Linear(lookback, horizon)

    def forward(self, x):
        pad = (self.kernel - 1) // 2
        xt = x.transpose(1, 2)  # (B, C, L)
        trend = F.avg_pool1d(F.pad(xt, (pad, pad), mode="replicate"), self.kernel, stride=1)
        y = self.seasonal(xt - trend) + self.trend(trend)  # (B, C, H)
        return y.transpose(1, 2)
