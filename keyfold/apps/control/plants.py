"""Plants for the closed loop, written here (no physics engine), with their limits.

Every plant is a discrete-time map ``x+ = f(x, u) + w_add`` with a fixed control period ``dt``,
a nominal linear model ``(A, B)`` and a box bound ``w_bar`` such that, while ``x`` is inside the
state limits and ``u`` inside the input limits,

    x+ - (A x + B u)  lies in  W = {w : |w_i| <= w_bar_i}.

For the linear plant ``w_bar`` is the additive disturbance bound; for the pendulum it also covers
the linearization error, in closed form. The safety filter (:mod:`keyfold.apps.control.safety`) relies
on exactly this statement; the loop measures ``x+ - (A x + B u)`` every step to check it.
The math and the assumptions: ``docs/control.md``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg
from scipy.optimize import linprog

__all__ = ["Polytope", "Box", "Disturbance", "Plant", "MassSpringDamper", "InvertedPendulum",
           "Episodes", "excite", "lqr_gain", "PLANTS", "make_plant"]


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True, eq=False)
class Polytope:
    """State limits ``{x : H x <= h}``; H ``(m, n)`` and h ``(m,)`` float64. Must be bounded."""

    H: np.ndarray
    h: np.ndarray

    def __post_init__(self):
        H = np.atleast_2d(np.asarray(self.H, dtype=np.float64))
        h = np.asarray(self.h, dtype=np.float64).reshape(-1)
        if H.shape[0] != h.shape[0]:
            raise ValueError(f"Polytope: H has {H.shape[0]} rows but h has {h.shape[0]} entries; give one bound per row")
        if not (np.isfinite(H).all() and np.isfinite(h).all()):
            raise ValueError("Polytope: H and h must be finite; drop a row instead of using an infinite bound")
        zero = np.flatnonzero(~H.any(axis=1))
        if zero.size:  # its violation distance was 0/0 = NaN, which counted as none: a state at 4.9 against a
            # limit of 1 read "violations 0" (a review, 2026-12-08)
            raise ValueError(f"Polytope: row {int(zero[0])} of H is zero (0 . x <= {h[zero[0]]} bounds no state); "
                             f"drop it")
        H.setflags(write=False)
        h.setflags(write=False)
        object.__setattr__(self, "H", H)
        object.__setattr__(self, "h", h)

    @staticmethod
    def box(lo, hi) -> "Polytope":
        """``lo <= x <= hi`` as ``H x <= h``."""
        lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
        if lo.shape != hi.shape or np.any(lo >= hi):
            raise ValueError(f"Polytope.box: need lo < hi elementwise with equal shapes, got lo={lo}, hi={hi}")
        n = lo.size
        return Polytope(np.vstack([np.eye(n), -np.eye(n)]), np.concatenate([hi, -lo]))

    def __and__(self, other: "Polytope") -> "Polytope":
        return Polytope(np.vstack([self.H, other.H]), np.concatenate([self.h, other.h]))

    @property
    def dim(self) -> int:
        return self.H.shape[1]

    def margins(self, x) -> np.ndarray:
        """``h - H x`` for each row (negative = violated); x ``(n,)`` or ``(T, n)``."""
        return self.h - np.asarray(x) @ self.H.T

    def contains(self, x, tol: float = 0.0) -> bool:
        return bool(np.all(self.margins(x) >= -tol))

    def violation(self, x) -> np.ndarray:
        """Largest violation distance per point (0 inside): ``max_i (H_i x - h_i)_+ / |H_i|``."""
        d = -self.margins(x) / np.linalg.norm(self.H, axis=1)
        return np.maximum(d.max(axis=-1), 0.0)

    def bounding_box(self) -> tuple[np.ndarray, np.ndarray]:
        """Smallest box holding the polytope (one LP per face); raises if it is empty or unbounded."""
        n = self.dim
        lo, hi = np.empty(n), np.empty(n)
        for i in range(n):
            for sign, out in ((1.0, lo), (-1.0, hi)):
                c = np.zeros(n)
                c[i] = sign
                r = linprog(c, A_ub=self.H, b_ub=self.h, bounds=[(None, None)] * n, method="highs")
                if r.status == 2:
                    raise ValueError("state limits are empty (no x satisfies H x <= h); check the signs of h")
                if r.status == 3:
                    raise ValueError(f"state limits are unbounded along x[{i}]; add a bound on every state")
                out[i] = sign * r.fun
        return lo, hi

    def __repr__(self) -> str:
        return f"Polytope({self.H.shape[0]} rows in R^{self.dim})"


@dataclass(frozen=True, eq=False)
class Box:
    """Input limits ``lo <= u <= hi``: a box, so the final projection is an exact clip."""

    lo: np.ndarray
    hi: np.ndarray

    def __post_init__(self):
        lo = np.asarray(self.lo, dtype=np.float64).reshape(-1)
        hi = np.asarray(self.hi, dtype=np.float64).reshape(-1)
        if lo.shape != hi.shape or np.any(lo >= hi) or not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise ValueError(f"Box: need finite lo < hi elementwise with equal shapes, got lo={lo}, hi={hi}")
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "hi", hi)

    def project(self, u) -> np.ndarray:
        """Exact Euclidean projection onto the box (a clip; no solver tolerance)."""
        return np.clip(np.asarray(u, dtype=np.float64), self.lo, self.hi)

    def contains(self, u) -> bool:
        u = np.asarray(u)
        return bool(np.all(u >= self.lo) and np.all(u <= self.hi))


# --------------------------------------------------------------------------- plants


class Disturbance(enum.Enum):
    """How the additive disturbance ``w_add`` is drawn inside its bound."""

    UNIFORM = "uniform"   # uniform in the box
    VERTEX = "vertex"     # a random vertex of the box each step (always at the bound)
    WORST = "worst"       # the vertex pushing hardest against the nearest state limit


def lqr_gain(A, B, Q, R) -> np.ndarray:
    """Discrete LQR gain K with ``u = K x`` (sign included) for ``x+ = A x + B u``."""
    P = scipy.linalg.solve_discrete_are(A, B, Q, R)
    return -np.linalg.solve(R + B.T @ P @ B, B.T @ P @ A)


class Plant:
    """A simulated plant. Subclasses set the fields below and implement :meth:`f`.

    name, dt (control period, seconds), A ``(n, n)``, B ``(n, m)``, state_limits (:class:`Polytope`),
    input_limits (:class:`Box`), noise ``(n,)`` the additive disturbance bound, x0 ``(n,)``,
    tracked (index of the state the reference is for), labels (state names).
    """

    name: str
    dt: float
    A: np.ndarray
    B: np.ndarray
    state_limits: Polytope
    input_limits: Box
    noise: np.ndarray
    x0: np.ndarray
    tracked: int = 0
    labels: tuple[str, ...] = ()

    @property
    def n_x(self) -> int:
        return self.A.shape[0]

    @property
    def n_u(self) -> int:
        return self.B.shape[1]

    def f(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def residual_bound(self) -> np.ndarray:
        """Bound on ``|f(x, u) - A x - B u|`` over the state and input limits (0 if linear)."""
        return np.zeros(self.n_x)

    def disturbance_bound(self) -> np.ndarray:
        """``w_bar``: the box W the safety filter assumes (additive noise + linearization error),
        rounded outward so that ``x+ - (A x + B u)`` computed in float64 still measures inside it."""
        return (self.noise + self.residual_bound()) * (1 + 1e-9) + 1e-12

    def step(self, x: np.ndarray, u: np.ndarray, w_add: np.ndarray) -> np.ndarray:
        return self.f(x, u) + w_add

    def sample_noise(self, rng: np.random.Generator, kind: Disturbance, x: np.ndarray) -> np.ndarray:
        """One draw of the additive disturbance, inside ``|w| <= noise``."""
        if kind is Disturbance.UNIFORM:
            return rng.uniform(-self.noise, self.noise)
        if kind is Disturbance.VERTEX:
            return self.noise * rng.choice([-1.0, 1.0], size=self.n_x)
        # WORST: the vertex that most reduces the smallest normalized margin of the state limits
        lim = self.state_limits
        margins = lim.margins(x) / np.linalg.norm(lim.H, axis=1)
        row = lim.H[int(np.argmin(margins))]
        return self.noise * np.sign(row + (row == 0))


@dataclass
class MassSpringDamper(Plant):
    """A mass on a spring with a damper, position and velocity state, force input.

    ``m p'' = -k p - c p' + u``, discretized exactly (zero-order hold), so the plant *is* its
    nominal model and ``w_bar`` is just the additive disturbance bound. Limits: a box on
    position and velocity, plus a braking-distance row ``|p + tau v| <= p_brake`` (a polytope).
    """

    mass: float = 1.0
    spring: float = 0.5
    damping: float = 0.2
    dt: float = 0.1
    p_max: float = 1.0
    v_max: float = 1.0
    tau: float = 0.5
    p_brake: float = 1.15
    u_max: float = 1.5
    noise: np.ndarray = field(default_factory=lambda: np.array([0.002, 0.01]))
    x0: np.ndarray = field(default_factory=lambda: np.zeros(2))
    name: str = "mass-spring-damper"
    labels: tuple[str, ...] = ("position", "velocity")

    def __post_init__(self):
        Ac = np.array([[0.0, 1.0], [-self.spring / self.mass, -self.damping / self.mass]])
        Bc = np.array([[0.0], [1.0 / self.mass]])
        M = scipy.linalg.expm(np.block([[Ac, Bc], [np.zeros((1, 3))]]) * self.dt)  # ZOH
        self.A, self.B = M[:2, :2], M[:2, 2:]
        brake = Polytope(np.array([[1.0, self.tau], [-1.0, -self.tau]]), np.array([self.p_brake] * 2))
        self.state_limits = Polytope.box([-self.p_max, -self.v_max], [self.p_max, self.v_max]) & brake
        self.input_limits = Box([-self.u_max], [self.u_max])
        self.noise = np.asarray(self.noise, dtype=np.float64)
        self.x0 = np.asarray(self.x0, dtype=np.float64)

    def f(self, x, u):
        return self.A @ x + self.B @ np.atleast_1d(u)


@dataclass
class InvertedPendulum(Plant):
    """A pendulum balanced upright; angle and angular rate, torque input (per unit inertia).

    ``theta'' = a sin(theta) - b theta' + u`` with ``a = g / l``, stepped by semi-implicit Euler:
    ``w+ = w + dt (a sin(theta) - b w + u)``, ``theta+ = theta + dt w+``. Linearizing
    ``sin(theta) ~ theta`` leaves the residual ``a (sin(theta) - theta) (dt^2, dt)``; on
    ``|theta| <= th`` its size is at most ``a (th - sin th)`` (``theta - sin theta`` is odd and
    increasing), which :meth:`residual_bound` returns, rounded outward.
    """

    a: float = 9.81
    b: float = 0.1
    dt: float = 0.05
    theta_max: float = 0.5
    rate_max: float = 1.5
    u_max: float = 8.0
    noise: np.ndarray = field(default_factory=lambda: np.array([0.0005, 0.005]))
    x0: np.ndarray = field(default_factory=lambda: np.zeros(2))
    name: str = "inverted-pendulum"
    labels: tuple[str, ...] = ("angle", "rate")

    def __post_init__(self):
        dt, a, b = self.dt, self.a, self.b
        self.A = np.array([[1.0 + dt * dt * a, dt * (1.0 - dt * b)], [dt * a, 1.0 - dt * b]])
        self.B = np.array([[dt * dt], [dt]])
        self.state_limits = Polytope.box([-self.theta_max, -self.rate_max], [self.theta_max, self.rate_max])
        self.input_limits = Box([-self.u_max], [self.u_max])
        self.noise = np.asarray(self.noise, dtype=np.float64)
        self.x0 = np.asarray(self.x0, dtype=np.float64)

    def f(self, x, u):
        th, w = x
        w1 = w + self.dt * (self.a * math.sin(th) - self.b * w + float(np.atleast_1d(u)[0]))
        return np.array([th + self.dt * w1, w1])

    def residual_bound(self):
        lo, hi = self.state_limits.bounding_box()
        th = max(abs(lo[0]), abs(hi[0]))
        gap = self.a * (th - math.sin(th)) * (1.0 + 1e-9) + 1e-15  # outward rounding
        return np.array([self.dt * self.dt * gap, self.dt * gap])


PLANTS = {"msd": MassSpringDamper, "pendulum": InvertedPendulum}


def make_plant(name: str, **overrides) -> Plant:
    """A plant by short name (``msd`` or ``pendulum``) with field overrides.

    >>> p = make_plant("pendulum", theta_max=0.4)
    >>> p.n_x, p.n_u, p.dt, bool(p.state_limits.contains(p.x0))
    (2, 1, 0.05, True)
    """
    if name not in PLANTS:
        raise ValueError(f"unknown plant {name!r}; choose one of {sorted(PLANTS)}")
    return PLANTS[name](**overrides)


# --------------------------------------------------------------------------- data


@dataclass(frozen=True, eq=False)
class Episodes:
    """Logged excitation data: states ``(E, T + 1, n_x)``, inputs ``(E, T, n_u)``, float64."""

    states: np.ndarray
    inputs: np.ndarray


def excite(plant: Plant, episodes: int, steps: int, rng: np.random.Generator,
           amplitude: float = 0.6, hold: tuple[int, int] = (1, 6)) -> Episodes:
    """Excite the plant with random inputs and log it.

    The input is a random piecewise-constant signal (levels uniform over ``amplitude`` of the
    input range, each held a random ``hold`` steps) added to a weak stabilizing LQR feedback
    (the pendulum falls without it), clipped to the input limits. Each episode starts at a
    random state inside half the state limits' bounding box; the disturbance is uniform.
    """
    lo, hi = plant.state_limits.bounding_box()
    K = lqr_gain(plant.A, plant.B, np.eye(plant.n_x), np.eye(plant.n_u) * 10.0)
    span = (plant.input_limits.hi - plant.input_limits.lo) / 2
    X = np.empty((episodes, steps + 1, plant.n_x))
    U = np.empty((episodes, steps, plant.n_u))
    for e in range(episodes):
        x = rng.uniform(lo / 2, hi / 2)
        X[e, 0] = x
        level, left = np.zeros(plant.n_u), 0
        for t in range(steps):
            if left == 0:
                level = rng.uniform(-amplitude, amplitude, plant.n_u) * span
                left = int(rng.integers(hold[0], hold[1] + 1))
            left -= 1
            u = plant.input_limits.project(K @ x + level)
            x = plant.step(x, u, plant.sample_noise(rng, Disturbance.UNIFORM, x))
            X[e, t + 1], U[e, t] = x, u
    return Episodes(X, U)

