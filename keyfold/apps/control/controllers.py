"""Controllers that propose actions: MPC over a learned predictor, and adversaries for the tests.

A controller sees the recent history and the reference ahead, and proposes a plan
``(H, n_u)`` whose first row is the action for this step (the rest is its own warm start, and
what a filter-off loop applies, shifted, when a step misses its deadline). Proposals may be
anything; the safety filter decides what reaches the plant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .plants import Box, Polytope
from .predictors import Predictor

__all__ = ["Controller", "MPPIConfig", "MPPIController", "WorstActionController", "RandomBangBang",
           "SlowController"]


class Controller:
    """Interface. ``window``: states of history wanted (L); ``horizon``: reference steps wanted."""

    window: int = 1
    horizon: int = 1

    def reset(self, seed: int) -> None:
        """Forget the warm start and reseed (a run is reproducible from its seed)."""

    def propose(self, x_hist: np.ndarray, u_hist: np.ndarray, reference: np.ndarray) -> np.ndarray:
        """x_hist ``(L, n_x)`` = x_{k-L+1..k}; u_hist ``(L - 1, n_u)`` = u_{k-L+1..k-1};
        reference ``(horizon, )`` the tracked state's targets for steps k+1..k+horizon.
        Returns a plan ``(H, n_u)``; row 0 is the proposed action."""
        raise NotImplementedError


@dataclass(frozen=True)
class MPPIConfig:
    """Model-predictive path integral control over a learned predictor (sampling-based MPC)."""

    horizon: int = 10         # steps predicted per candidate
    samples: int = 32         # candidate input sequences per step (one batched predictor call per step)
    sigma: float = 0.3        # exploration noise, fraction of the input half-range
    temperature: float = 0.1  # softmin temperature, fraction of the cost spread
    q_track: float = 1.0      # (tracked state - reference)^2
    q_other: float = 0.01     # other states^2
    r_input: float = 0.001    # (u / input half-range)^2
    q_limits: float = 10.0    # soft penalty on predicted limit violations (squared distance)


class MPPIController(Controller):
    """Sampling MPC (MPPI): perturb the previous plan, roll every candidate through the predictor
    in one batch, weight by ``softmin(cost)``. It knows the limits only as a soft penalty."""

    def __init__(self, predictor: Predictor, limits: Polytope, inputs: Box, tracked: int = 0,
                 config: MPPIConfig = MPPIConfig(), seed: int = 0):
        self.pred, self.limits, self.inputs, self.tracked, self.cfg = predictor, limits, inputs, tracked, config
        self.window, self.horizon = predictor.window, config.horizon
        self._H = torch.tensor(np.array(limits.H), dtype=torch.float32)
        self._h = torch.tensor(np.array(limits.h), dtype=torch.float32)
        self._half = (inputs.hi - inputs.lo) / 2
        self.reset(seed)

    def reset(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._plan = np.zeros((self.cfg.horizon, self.inputs.lo.size))

    def _cost(self, x_next: torch.Tensor, u: torch.Tensor, ref: float) -> torch.Tensor:
        """Stage cost ``(M,)`` of predicted states ``(M, n_x)`` and inputs ``(M, n_u)``."""
        c = self.cfg
        err = x_next[:, self.tracked] - ref
        other = x_next.pow(2).sum(1) - x_next[:, self.tracked].pow(2)
        over = torch.relu(x_next @ self._H.T - self._h).pow(2).sum(1)
        uu = (u / torch.as_tensor(self._half, dtype=torch.float32)).pow(2).sum(1)
        return c.q_track * err.pow(2) + c.q_other * other + c.r_input * uu + c.q_limits * over

    def propose(self, x_hist, u_hist, reference):
        c, M, Hz = self.cfg, self.cfg.samples, self.cfg.horizon
        nominal = np.vstack([self._plan[1:], self._plan[-1:]])           # shifted warm start
        noise = self._rng.standard_normal((M, Hz, nominal.shape[1])) * c.sigma * self._half
        noise[0] = 0.0                                                   # keep the warm start itself
        cand = np.clip(nominal + noise, self.inputs.lo, self.inputs.hi)  # (M, H, n_u)
        cand_t = torch.as_tensor(cand, dtype=torch.float32)
        xs = torch.as_tensor(x_hist, dtype=torch.float32).expand(M, -1, -1).clone()       # (M, L, n_x)
        us = torch.as_tensor(np.vstack([u_hist, np.zeros((1, cand.shape[2]))]),
                             dtype=torch.float32).expand(M, -1, -1).clone()               # (M, L, n_u)
        cost = torch.zeros(M)
        with torch.no_grad():
            for t in range(Hz):
                us[:, -1] = cand_t[:, t]
                x_next = self.pred.predict(xs, us)                       # (M, n_x)
                cost += self._cost(x_next, cand_t[:, t], float(reference[min(t, len(reference) - 1)]))
                xs = torch.cat([xs[:, 1:], x_next[:, None]], 1)
                us = torch.cat([us[:, 1:], torch.zeros_like(us[:, :1])], 1)
        cost = cost.double().numpy()
        spread = max(np.percentile(cost, 50) - cost.min(), 1e-12)
        w = np.exp(-(cost - cost.min()) / (c.temperature * spread))
        self._plan = np.einsum("m,mhu->hu", w / w.sum(), cand)
        return self._plan.copy()


class WorstActionController(Controller):
    """The adversary: always the input-box vertex that pushes the nominal next state furthest
    past the nearest state limit (the worst action one step ahead)."""

    def __init__(self, A, B, limits: Polytope, inputs: Box):
        self.A, self.B, self.limits, self.inputs = A, B, limits, inputs
        self._vertices = np.array(np.meshgrid(*zip(inputs.lo, inputs.hi))).reshape(len(inputs.lo), -1).T

    def propose(self, x_hist, u_hist, reference):
        x = x_hist[-1]
        nxt = (self.A @ x)[None] + self._vertices @ self.B.T                       # (V, n_x)
        reach = (nxt @ self.limits.H.T - self.limits.h) / np.linalg.norm(self.limits.H, axis=1)
        return self._vertices[int(np.argmax(reach.max(1)))][None].copy()


class RandomBangBang(Controller):
    """Random input-box vertices held for random spells: a second adversary for the tests."""

    def __init__(self, inputs: Box, hold: tuple[int, int] = (1, 20), seed: int = 0):
        self.inputs, self.hold = inputs, hold
        self.reset(seed)

    def reset(self, seed):
        self._rng = np.random.default_rng(seed)
        self._left, self._u = 0, self.inputs.lo.copy()

    def propose(self, x_hist, u_hist, reference):
        if self._left == 0:
            self._u = np.where(self._rng.random(self.inputs.lo.size) < 0.5, self.inputs.lo, self.inputs.hi)
            self._left = int(self._rng.integers(self.hold[0], self.hold[1] + 1))
        self._left -= 1
        return self._u[None].copy()


class SlowController(Controller):
    """Wraps a controller and advances an injected fake clock by ``delay`` seconds on every
    ``every``-th call (an artificially slow predictor, with no real sleep)."""

    def __init__(self, inner: Controller, clock, delay: float, every: int = 1):
        self.inner, self.clock, self.delay, self.every = inner, clock, delay, every
        self.window, self.horizon = inner.window, inner.horizon
        self._calls = 0

    def reset(self, seed):
        self._calls = 0
        self.inner.reset(seed)

    def propose(self, x_hist, u_hist, reference):
        self._calls += 1
        if self._calls % self.every == 0:
            self.clock.advance(self.delay)
        return self.inner.propose(x_hist, u_hist, reference)
