"""Next-state predictors for the closed loop: the linear ARX baseline and the toolbox models.

Every predictor maps a window of the last ``L`` states and inputs to the next state:

    xs ``(B, L, n_x)`` = x_{k-L+1..k},  us ``(B, L, n_u)`` = u_{k-L+1..k}  ->  x_{k+1} ``(B, n_x)``

(float32 tensors, physical units). The toolbox predictors are a
:class:`keyfold.apps.toolbox.SequenceModel` over the tokens ``[x_t, u_t]`` (normalized) whose last
output is the normalized step ``x_{k+1} - x_k``. The safety filter never uses these models; they
only have to be useful to the controller.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from .plants import Episodes

__all__ = ["Windows", "windows", "Predictor", "ARXPredictor", "SequencePredictor", "TrainConfig",
           "make_predictor", "PREDICTORS", "prediction_rmse"]

PREDICTORS = ("arx", "attention", "gru", "s4d")

@dataclass(frozen=True, eq=False)
class Windows:
    """Training windows: xs ``(S, L, n_x)``, us ``(S, L, n_u)``, target ``(S, n_x)`` float32."""

    xs: torch.Tensor
    us: torch.Tensor
    target: torch.Tensor

    def __len__(self) -> int:
        return self.xs.shape[0]

    def take(self, idx) -> "Windows":
        return Windows(self.xs[idx], self.us[idx], self.target[idx])

def windows(ep: Episodes, length: int) -> Windows:
    """Every window of ``length`` steps inside each episode (none crosses an episode)."""
    X = torch.as_tensor(ep.states, dtype=torch.float32)   # (E, T + 1, n_x)
    U = torch.as_tensor(ep.inputs, dtype=torch.float32)   # (E, T, n_u)
    T = U.shape[1]
    if T < length:
        raise ValueError(f"episodes have {T} steps, fewer than the window length {length}; log longer episodes")
    xs = X[:, :T].unfold(1, length, 1).permute(0, 1, 3, 2)   # (E, T - L + 1, L, n_x)
    us = U.unfold(1, length, 1).permute(0, 1, 3, 2)          # (E, T - L + 1, L, n_u)
    target = X[:, length:T + 1]                              # (E, T - L + 1, n_x)
    return Windows(xs.reshape(-1, length, X.shape[-1]), us.reshape(-1, length, U.shape[-1]),
                   target.reshape(-1, X.shape[-1]))

@dataclass(frozen=True)
class TrainConfig:
    """Training of the learned predictors (every model gets the same number of steps)."""

    steps: int = 400
    batch: int = 256
    lrs: tuple[float, ...] = (3e-3,)   # swept; the best on the validation windows is kept
    width: int = 32
    depth: int = 1
    weight_decay: float = 0.0
    val_fraction: float = 0.2
    seed: int = 0

class Predictor:
    """Interface: ``window`` (L), :meth:`predict`, :meth:`fit`; ``info`` holds training facts."""

    name: str = "predictor"
    window: int = 8

    def __init__(self):
        self.info: dict = {}

    def predict(self, xs: torch.Tensor, us: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fit(self, data: Windows, config: TrainConfig) -> "Predictor":
        raise NotImplementedError

def _split(data: Windows, config: TrainConfig) -> tuple[Windows, Windows]:
    g = torch.Generator().manual_seed(config.seed)
    perm = torch.randperm(len(data), generator=g)
    n_val = max(1, int(len(data) * config.val_fraction))
    return data.take(perm[n_val:]), data.take(perm[:n_val])

def prediction_rmse(pred: Predictor, data: Windows) -> np.ndarray:
    """Root-mean-square one-step error per state ``(n_x,)``."""
    with torch.no_grad():
        err = pred.predict(data.xs, data.us) - data.target
    return err.pow(2).mean(0).sqrt().numpy().astype(np.float64)

class ARXPredictor(Predictor):
    """Linear ARX: ``x_{k+1} = x_k + Theta [vec(xs); vec(us); 1]``, ridge least squares.

    >>> import numpy as np
    >>> from keyfold.apps.control import excite, make_plant
    >>> plant = make_plant("msd")
    >>> data = windows(excite(plant, 4, 50, np.random.default_rng(0)), 8)
    >>> pred = ARXPredictor(8).fit(data)
    >>> pred.predict(data.xs[:3], data.us[:3]).shape
    torch.Size([3, 2])
    """

    name = "arx"

    def __init__(self, window: int = 8, ridge: float = 1e-6):
        super().__init__()
        self.window, self.ridge = window, ridge
        self.theta: torch.Tensor | None = None

    @staticmethod
    def _features(xs, us):
        B = xs.shape[0]
        return torch.cat([xs.reshape(B, -1), us.reshape(B, -1), torch.ones(B, 1, dtype=xs.dtype)], 1)

    def fit(self, data: Windows, config: TrainConfig = TrainConfig()) -> "ARXPredictor":
        t0 = time.perf_counter()
        train, val = _split(data, config)
        Phi = self._features(train.xs, train.us).double()
        Y = (train.target - train.xs[:, -1]).double()
        A = Phi.T @ Phi + self.ridge * torch.eye(Phi.shape[1], dtype=torch.float64)
        self.theta = torch.linalg.solve(A, Phi.T @ Y).float()     # (F, n_x)
        self.info = {"train_s": time.perf_counter() - t0, "val_rmse": prediction_rmse(self, val).tolist(),
                     "params": int(self.theta.numel()), "lr": None}
        return self

    def predict(self, xs, us):
        if self.theta is None:
            raise RuntimeError("ARXPredictor.predict before fit(); train it on logged windows first")
        return xs[:, -1] + self._features(xs, us) @ self.theta

class SequencePredictor(Predictor):
    """A toolbox :class:`~keyfold.apps.toolbox.SequenceModel` (attention, GRU, S4D, ...) as a predictor."""

    def __init__(self, kind: str, window: int = 8):
        super().__init__()
        self.name, self.window = kind, window
        self.model = None
        self._norm: dict[str, torch.Tensor] = {}

    def _tokens(self, xs, us):
        n = self._norm
        return torch.cat([(xs - n["x_mu"]) / n["x_sd"], (us - n["u_mu"]) / n["u_sd"]], -1)  # (B, L, n_x + n_u)

    def _build(self, n_x, n_u, config):
        from keyfold.apps.toolbox import SequenceModel   # noqa: PLC0415  (layering: control sits above toolbox)
        return SequenceModel(self.name, d_in=n_x + n_u, d_out=n_x, width=config.width, depth=config.depth,
                             seq_len=self.window)

    def fit(self, data: Windows, config: TrainConfig = TrainConfig()) -> "SequencePredictor":
        t0 = time.perf_counter()
        train, val = _split(data, config)
        flat_x = train.xs.reshape(-1, train.xs.shape[-1])
        flat_u = train.us.reshape(-1, train.us.shape[-1])
        step = train.target - train.xs[:, -1]
        self._norm = {"x_mu": flat_x.mean(0), "x_sd": flat_x.std(0) + 1e-6, "u_mu": flat_u.mean(0),
                      "u_sd": flat_u.std(0) + 1e-6, "d_sd": step.std(0) + 1e-9}
        n_x, n_u = train.xs.shape[-1], train.us.shape[-1]
        best = (math.inf, None, None)
        for lr in config.lrs:
            torch.manual_seed(config.seed)
            self.model = self._build(n_x, n_u, config)
            opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=config.weight_decay)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, config.steps)
            g = torch.Generator().manual_seed(config.seed)
            self.model.train()
            for _ in range(config.steps):
                idx = torch.randint(0, len(train), (config.batch,), generator=g)
                b = train.take(idx)
                out = self.model(self._tokens(b.xs, b.us))[:, -1]                # (B, n_x)
                loss = (out - (b.target - b.xs[:, -1]) / self._norm["d_sd"]).pow(2).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            self.model.eval()
            err = float(np.sqrt(np.mean(prediction_rmse(self, val) ** 2)))
            if err < best[0]:
                best = (err, lr, copy.deepcopy(self.model.state_dict()))
        self.model.load_state_dict(best[2])
        self.info = {"train_s": time.perf_counter() - t0, "val_rmse": prediction_rmse(self, val).tolist(),
                     "params": sum(p.numel() for p in self.model.parameters()), "lr": best[1]}
        return self

    def predict(self, xs, us):
        if self.model is None:
            raise RuntimeError(f"{self.name} predictor: predict before fit(); train it on logged windows first")
        with torch.no_grad():
            return xs[:, -1] + self.model(self._tokens(xs, us))[:, -1] * self._norm["d_sd"]

def make_predictor(name: str, window: int = 8) -> Predictor:
    """``arx`` or a toolbox mixer name (``attention``, ``gru``, ``s4d``, ``lstm``, ``tcn``, ...)."""
    if name == "arx":
        return ARXPredictor(window)
    return SequencePredictor(name, window)
