"""A predictive safety filter with constraint tightening (a tube on a nominal linear model).

Assumptions (checked where they can be; ``docs/control.md`` states them in full):
  A1. The state is measured exactly, and ``x+ - (A x + B u)`` lies in the box
      ``W = {|w_i| <= w_bar_i}`` whenever ``x`` is inside the state limits and ``u`` inside the
      input limits. (The loop measures it every step.)
  A2. A certified plan exists at the first step (checked before the loop; else
      :class:`FilterConfigError`).
Guarantee: every input applied is inside the input box, and every state stays inside the state
limits, at every step, whatever the proposals are, whether the solver succeeds or not, and whether
a step meets its deadline or not.

The construction (Chisci, Rossiter & Zappa 2001; Wabersich & Zeilinger 2021): a stabilizing tube
feedback ``K`` (LQR), ``A_K = A + B K`` and the reachable error sets
``R_i = W + A_K W + ... + A_K^{i-1} W``. A *plan* is nominal inputs ``v_0..v_{N-1}`` with
``z_0 = x``, ``z_{i+1} = A z_i + B v_i`` that satisfies

    H z_i <= h - s_i            (s_i = support of R_i along each row of H)
    v_i in U shrunk by K R_i
    z_N in X_f = {z : A_K^t z satisfies the rows tightened by R_{N+t}, for all t >= 0}.

If the plan held at step k and ``w_k`` is in W, the *shifted* plan
``v'_i = v_{i+1} + K (z'_i - z_{i+1})``, ``v'_{N-1} = K z'_{N-1}`` from ``x_{k+1}`` holds at
step k+1 (recursive feasibility), and ``x_{k+1} = z_1 + w_k`` is inside X. So the shifted plan is
the fallback that needs no solver: a late step, a failed solve or a QP answer that fails the exact
check all apply it. X_f is an infinite intersection; rows with ``t > T`` are dropped only once a
Lyapunov-norm bound proves them implied.

Every candidate plan is checked in float64 by rolling out the nominal model after an exact clip of
each ``v_i`` onto its (box) input set; the QP is solved with its constraints tightened a further
``solver_margin`` so the solver's tolerance cannot leak past a bound.
"""

from __future__ import annotations

import enum
import itertools
import warnings
from dataclasses import dataclass

import numpy as np
import osqp
import scipy.linalg
import scipy.sparse as sp

from .plants import Box, Plant, Polytope, lqr_gain

__all__ = ["FilterConfig", "FilterConfigError", "Plan", "QPSolver", "Source", "CERTIFIED", "SafetyFilter"]


class FilterConfigError(ValueError):
    """The filter cannot certify anything with this configuration; raised before the loop."""


class Source(enum.Enum):
    """Where an applied input came from."""

    PROPOSAL = "proposal"     # the proposal itself was certified (no intervention)
    CORRECTED = "corrected"   # the QP moved the proposal to the nearest certified input
    FALLBACK = "fallback"     # solver failed or its answer failed the check: shifted plan
    DEADLINE = "deadline"     # the step missed its deadline: shifted plan
    UNCERTIFIED = "uncertified"  # even the shifted plan failed the check (assumption A1 broken)
    UNFILTERED = "unfiltered"    # filter off: the proposal clipped to the input box
    FAULT = "fault"              # the controller raised or returned a malformed action: shifted plan


# sources whose applied input came from a plan that passed the exact check
CERTIFIED = frozenset({Source.PROPOSAL, Source.CORRECTED, Source.FALLBACK, Source.DEADLINE, Source.FAULT})


class QPSolver(enum.Enum):
    """The QP solver from PyPI behind the filter. DAQP (dual active set) solves these small dense
    QPs exactly in tens of microseconds; OSQP (ADMM) is the first-order alternative."""

    DAQP = "daqp"
    OSQP = "osqp"


@dataclass(frozen=True)
class FilterConfig:
    """Settings of the safety filter."""

    horizon: int = 20             # N, plan length (steps)
    solver: QPSolver = QPSolver.DAQP
    tube_q: float = 1.0           # tube feedback K = LQR(Q = tube_q I, R = tube_r I)
    tube_r: float = 1.0
    solver_margin: float = 1e-4   # extra tightening inside the QP, absorbs the ADMM tolerance
    check_margin: float = 1e-9    # tightening of the exact check, absorbs float64 rounding
    eps: float = 1e-6             # solver tolerance (OSQP eps_abs/eps_rel, DAQP primal_tol)
    max_iter: int = 4000          # solver iterations before it gives up (-> fallback)
    regularization: float = 1e-2  # weight on the tube corrections c_1.. (uniqueness, smooth plans)
    snap_tol: float = 1e-4        # QP answers this close to the proposal are snapped back to it
    max_terminal_steps: int = 2000


@dataclass(frozen=True, eq=False)
class Plan:
    """A plan: nominal inputs v ``(N, n_u)``, nominal states z ``(N + 1, n_x)``, and whether it
    passed the exact check (only a shift after a broken assumption A1 is uncertified)."""

    v: np.ndarray
    z: np.ndarray
    certified: bool = True


def _support_rows(C: np.ndarray, w_bar: np.ndarray) -> np.ndarray:
    """Support of the box ``|w| <= w_bar`` along each row of C: ``|C| @ w_bar``."""
    return np.abs(C) @ w_bar


class _QP:
    """``min 0.5 c' diag(p) c + q' c  s.t.  l <= G c <= u`` with fixed p and G; q, l, u per call."""

    def __init__(self, solver: QPSolver, p: np.ndarray, G: np.ndarray, l: np.ndarray, u: np.ndarray,
                 cfg: "FilterConfig"):
        if solver is QPSolver.DAQP:
            try:
                import daqp  # noqa: PLC0415  (optional solver, imported where used)
                self._daqp = daqp
            except ImportError:
                warnings.warn("daqp is not installed; the safety filter uses OSQP instead "
                              "(pip install daqp for the exact active-set solver)", stacklevel=3)
                solver = QPSolver.OSQP
        self.solver, self.cfg = solver, cfg
        if solver is QPSolver.OSQP:
            self._osqp = osqp.OSQP()
            self._osqp.setup(sp.diags(p).tocsc(), np.zeros(len(p)), sp.csc_matrix(G), l, u,
                             eps_abs=cfg.eps, eps_rel=cfg.eps, max_iter=cfg.max_iter, polishing=False,
                             verbose=False, warm_starting=True)
        else:
            self._H = np.ascontiguousarray(np.diag(p))
            self._G = np.ascontiguousarray(G)
            self._big = 1e30            # DAQP wants finite bounds; 1e30 is its "no bound"

    def solve(self, q, l, u, start) -> np.ndarray | None:
        if self.solver is QPSolver.OSQP:
            self._osqp.update(q=q, l=l, u=u)
            if start is not None:
                self._osqp.warm_start(x=start)
            res = self._osqp.solve(raise_error=False)
            return None if res.info.status_val not in (1, 2) else res.x   # solved / solved inaccurate
        x, _, flag, _ = self._daqp.solve(self._H, np.ascontiguousarray(q), self._G,
                                         np.minimum(u, self._big), np.maximum(l, -self._big),
                                         np.zeros(len(u), dtype=np.intc), primal_tol=self.cfg.eps,
                                         iter_limit=self.cfg.max_iter)
        return x if flag >= 1 else None


class SafetyFilter:
    """The filter for ``x+ = A x + B u + w``, ``w`` in the box ``w_bar``, with state limits
    ``H x <= h`` (a bounded polytope) and box input limits.

    >>> from keyfold.apps.control.plants import make_plant
    >>> plant = make_plant("msd")
    >>> sf = SafetyFilter.from_plant(plant)
    >>> plan = sf.initial_plan(plant.x0)           # raises FilterConfigError if none exists
    >>> u, plan, source = sf.filter(plant.x0, np.array([1.5]), plan)   # step 0: fallback = initial plan
    >>> bool(plant.input_limits.contains(u))
    True
    """

    def __init__(self, A, B, state_limits: Polytope, input_limits: Box, w_bar, config: FilterConfig = FilterConfig()):
        A, B = np.asarray(A, np.float64), np.asarray(B, np.float64)
        n, m = B.shape
        w_bar = np.asarray(w_bar, np.float64).reshape(-1)
        if A.shape != (n, n):
            raise FilterConfigError(f"A must be (n_x, n_x) = ({n}, {n}) to match B {B.shape}, got {A.shape}")
        if state_limits.dim != n or input_limits.lo.size != m:
            raise FilterConfigError(f"limits do not match the model: state limits in R^{state_limits.dim}, "
                                    f"input limits in R^{input_limits.lo.size}, model has n_x={n}, n_u={m}")
        if w_bar.shape != (n,) or np.any(w_bar < 0) or not np.isfinite(w_bar).all():
            raise FilterConfigError(f"w_bar must be {n} finite non-negative numbers (the disturbance box), got {w_bar}")
        if config.horizon < 1:
            raise FilterConfigError(f"horizon must be >= 1, got {config.horizon}")
        self.A, self.B, self.w_bar, self.config = A, B, w_bar, config
        self.X, self.U = state_limits, input_limits
        self.n_x, self.n_u, self.N = n, m, config.horizon
        self.K = lqr_gain(A, B, np.eye(n) * config.tube_q, np.eye(m) * config.tube_r)
        self.AK = A + B @ self.K
        self._tighten()
        self._terminal()
        self._setup_qp()

    @classmethod
    def from_plant(cls, plant: Plant, config: FilterConfig = FilterConfig(), w_bar=None) -> "SafetyFilter":
        """The filter on the plant's nominal model and disturbance bound (or a given ``w_bar``)."""
        w = plant.disturbance_bound() if w_bar is None else w_bar
        return cls(plant.A, plant.B, plant.state_limits, plant.input_limits, w, config)

    # ------------------------------------------------------------------ set computations

    def _rows(self) -> np.ndarray:
        """All constraint rows on the closed loop ``(H; K; -K)``: ``C x <= c``."""
        return np.vstack([self.X.H, self.K, -self.K])

    def _tighten(self):
        """s_j (support of R_j along every row) for j = 0..J, and a bound on s_inf."""
        C = self._rows()
        c = np.concatenate([self.X.h, self.U.hi, -self.U.lo])
        # Lyapunov norm: |A_K z|_P <= lam |z|_P
        P = scipy.linalg.solve_discrete_lyapunov(self.AK.T, np.eye(self.n_x))
        lam2 = scipy.linalg.eigh(self.AK.T @ P @ self.AK, P, eigvals_only=True).max()
        lam = float(np.sqrt(max(lam2, 0.0))) * (1 + 1e-9)
        if lam >= 1.0:
            raise FilterConfigError("the tube feedback does not contract; the nominal model (A, B) "
                                    "must be stabilizable. Check A and B.")
        Pinv = np.linalg.inv(P)
        dual = np.sqrt(np.einsum("ij,jk,ik->i", C, Pinv, C))         # |c_i|_{P^-1}
        lo_x, hi_x = self.X.bounding_box()
        rho_x = max(np.sqrt(v @ P @ v) for v in itertools.product(*zip(lo_x, hi_x)))
        rho_w = max(np.sqrt(np.asarray(v) @ P @ np.asarray(v))
                    for v in itertools.product(*zip(-self.w_bar, self.w_bar)))
        s = [np.zeros(len(C))]
        CA = C.copy()                                                # C A_K^j
        while True:
            s.append(s[-1] + _support_rows(CA, self.w_bar))
            CA = CA @ self.AK
            j = len(s) - 1
            tail = dual * rho_w * lam ** j / (1 - lam)
            if (j >= self.N + 1 and np.all(tail <= 1e-12 * (1 + np.abs(c)))) or j > 100000:
                break
        self._s = np.array(s)                                        # (J + 1, rows)
        self._s_inf = s[-1] + tail * (1 + 1e-6) + 1e-15
        self._C, self._c, self._lam, self._dual, self._rho_x = C, c, lam, dual, rho_x
        margin = self.config.check_margin + self.config.solver_margin
        room = c - self._s_inf - margin
        if np.any(room <= 0):
            i = int(np.argmin(room))
            what = (f"state limit row {i}" if i < self.X.H.shape[0]
                    else f"input limit {'upper' if i < self.X.H.shape[0] + self.n_u else 'lower'}")
            raise FilterConfigError(
                f"infeasible disturbance bound: the disturbances' reachable set under the tube feedback "
                f"needs {self._s_inf[i]:.4g} along {what}, but the limit leaves only {c[i]:.4g}. Reduce "
                f"w_bar (now {self.w_bar}), widen the limits, or change the tube feedback weights.")

    def _tight(self, j: int) -> np.ndarray:
        """Tightened bounds c - s_j - check_margin for rows (H; K; -K), j may exceed the table."""
        s = self._s[j] if j < len(self._s) else self._s_inf
        return self._c - s - self.config.check_margin

    def _terminal(self):
        """X_f rows ``C A_K^t z <= c - s_{N+t}`` for t = 0..T, T proven sufficient."""
        rows, rhs = [], []
        CA = self._C.copy()
        room = self._c - self._s_inf - self.config.check_margin
        for t in range(self.config.max_terminal_steps + 1):
            rows.append(CA)
            rhs.append(self._tight(self.N + t))
            CA = CA @ self.AK
            # rows t+1, t+2, ... are implied once |C A_K^s z| <= |c|_{P^-1} lam^s rho_x fits in the room
            if np.all(self._dual * self._lam ** (t + 1) * self._rho_x <= room):
                break
        else:
            raise FilterConfigError("terminal set did not converge within max_terminal_steps; the tube "
                                    "feedback contracts too slowly. Raise tube_q or max_terminal_steps.")
        self._Hf, self._hf = np.vstack(rows), np.concatenate(rhs)
        self.terminal_steps = len(rows)

    # ------------------------------------------------------------------ the QP

    def _setup_qp(self):
        """Condensed QP over the tube corrections c_i, with ``v_i = K z_i + c_i``.

        Pre-stabilizing by K keeps the condensed matrices well conditioned even for an unstable
        A (the pendulum). Rows: state i = 1..N-1, terminal, inputs i = 0..N-1; each is
        ``G c <= b - F x`` (lower bounds likewise), so a step only updates l, u and q."""
        n, m, N, cfg = self.n_x, self.n_u, self.N, self.config
        nh = self.X.H.shape[0]
        # free response Phi_i = A_K^i (n, n); forced Gam_i (n, N m): z_i = Phi_i x + Gam_i c
        Phi = [np.eye(n)]
        Gam = [np.zeros((n, N * m))]
        for i in range(N):
            Phi.append(self.AK @ Phi[-1])
            g = self.AK @ Gam[-1]
            g[:, i * m:(i + 1) * m] += self.B
            Gam.append(g)
        G, F, lo, hi = [], [], [], []
        for i in range(1, N):                                                    # state rows
            G.append(self.X.H @ Gam[i])
            F.append(self.X.H @ Phi[i])
            hi.append(self._tight(i)[:nh] - cfg.solver_margin)
            lo.append(np.full(nh, -np.inf))
        G.append(self._Hf @ Gam[N])                                              # terminal
        F.append(self._Hf @ Phi[N])
        hi.append(self._hf - cfg.solver_margin)
        lo.append(np.full(len(self._hf), -np.inf))
        for i in range(N):                                                       # inputs
            E = np.zeros((m, N * m))
            E[:, i * m:(i + 1) * m] = np.eye(m)
            G.append(self.K @ Gam[i] + E)
            F.append(self.K @ Phi[i])
            lo_i, hi_i = self._input_bounds(i)
            pad = cfg.solver_margin if i > 0 else 0.0
            lo.append(lo_i + pad)
            hi.append(hi_i - pad)
        self._G, self._F = np.vstack(G), np.vstack(F)
        self._l0, self._u0 = np.concatenate(lo), np.concatenate(hi)
        diag = np.full(N * m, cfg.regularization)
        diag[:m] = 1.0                          # (v_0 - u_target)^2 is the filter's objective
        self._qp = _QP(cfg.solver, diag, self._G, self._l0, self._u0, cfg)
        # the exact check's bounds: inputs (N, n_u) and state rows (N, rows of H), i = 0..N-1
        self._vlo = np.array([self._input_bounds(i)[0] for i in range(N)])
        self._vhi = np.array([self._input_bounds(i)[1] for i in range(N)])
        self._xt = np.array([self._tight(i)[:nh] for i in range(N)])

    def _input_bounds(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Box for v_i: U shrunk by K R_i (and the check margin for i >= 1)."""
        if i == 0:
            return self.U.lo.copy(), self.U.hi.copy()
        t = self._tight(i)
        nh, m = self.X.H.shape[0], self.n_u
        return -t[nh + m:nh + 2 * m], t[nh:nh + m]

    # ------------------------------------------------------------------ plans

    def rollout(self, x: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Nominal states z ``(N + 1, n_x)`` from x under inputs v ``(N, n_u)``."""
        z = np.empty((self.N + 1, self.n_x))
        z[0] = x
        for i in range(self.N):
            z[i + 1] = self.A @ z[i] + self.B @ v[i]
        return z

    def certify(self, x: np.ndarray, v: np.ndarray) -> Plan | None:
        """Clip each v_i exactly onto its input box, roll out, check every tightened row.

        Returns the certified :class:`Plan`, or None if a row fails."""
        v = np.array(v, dtype=np.float64).reshape(self.N, self.n_u)
        if not np.isfinite(v).all():
            return None
        v = np.clip(v, self._vlo, self._vhi)                                   # (N, n_u), exact
        z = self.rollout(np.asarray(x, np.float64), v)                         # (N + 1, n_x)
        if np.any(z[1:self.N] @ self.X.H.T > self._xt[1:]):                    # rows i = 1..N-1
            return None
        if np.any(self._Hf @ z[self.N] > self._hf):
            return None
        return Plan(v, z)

    def shift(self, plan: Plan, x: np.ndarray) -> Plan:
        """The previous plan shifted one step and corrected for the measured disturbance.

        Certified whenever ``x - plan.z[1]`` is in W (assumption A1). If the check fails anyway
        (A1 broken), the shift clipped to the input box comes back with ``certified=False``."""
        v = np.empty_like(plan.v)
        zp = np.asarray(x, np.float64)
        for i in range(self.N - 1):
            v[i] = plan.v[i + 1] + self.K @ (zp - plan.z[i + 1])
            zp = self.A @ zp + self.B @ v[i]
        v[-1] = self.K @ zp
        checked = self.certify(x, v)
        if checked is not None:
            return checked
        v = np.clip(v, self.U.lo, self.U.hi)
        return Plan(v, self.rollout(x, v), certified=False)

    def solve(self, x: np.ndarray, u_target: np.ndarray, warm: Plan | None = None) -> Plan | None:
        """The certified plan whose first input is nearest to ``u_target`` (None if none is found)."""
        x = np.asarray(x, np.float64)
        m = self.n_u
        fx = self._F @ x
        q = np.zeros(self.N * m)
        q[:m] = -(u_target - self.K @ x)
        start = None if warm is None else (warm.v - warm.z[:-1] @ self.K.T).ravel()
        y = self._qp.solve(q, self._l0 - fx, self._u0 - fx, start)
        if y is None or not np.all(np.isfinite(y)):
            return None
        c = y.reshape(self.N, m)
        v, z = np.empty((self.N, m)), x
        for i in range(self.N):                 # v_i = K z_i + c_i on the nominal rollout
            v[i] = self.K @ z + c[i]
            z = self.A @ z + self.B @ v[i]
        plan = self.certify(x, v)
        if plan is not None and np.max(np.abs(plan.v[0] - u_target)) <= self.config.snap_tol:
            snapped = plan.v.copy()
            snapped[0] = u_target
            plan = self.certify(x, snapped) or plan
        return plan

    def initial_plan(self, x0: np.ndarray) -> Plan:
        """A certified plan from the initial state, or :class:`FilterConfigError` (assumption A2)."""
        x0 = np.asarray(x0, np.float64)
        if x0.shape != (self.n_x,) or not np.isfinite(x0).all():
            raise FilterConfigError(f"x0 must be {self.n_x} finite numbers, got {x0}")
        if not self.X.contains(x0):
            rows = np.nonzero(self.X.margins(x0) < 0)[0].tolist()
            raise FilterConfigError(f"the initial state x0={x0} violates the state limits (rows {rows}); "
                                    f"start inside the limits or widen them")
        plan = self.solve(x0, self.K @ x0)
        if plan is None:
            raise FilterConfigError(
                f"no certified plan from x0={x0}: it is inside the limits but outside the filter's feasible "
                f"set (limits tightened by the disturbance bound over {self.N} steps). Start closer to the "
                f"origin, lengthen the horizon, or reduce the disturbance bound.")
        return plan

    def filter(self, x: np.ndarray, u_prop: np.ndarray, fallback: Plan) -> tuple[np.ndarray, Plan, Source]:
        """One filter step: the applied input ``(n_u,)``, the new plan and where it came from.

        ``fallback`` is :meth:`initial_plan` at step 0 and ``shift(previous_plan, x)`` after.
        The proposal is first projected onto the input box (saturation is not an intervention).
        If the QP finds no certified plan, the fallback is applied. A non-finite state or proposal raises
        ``ValueError`` before the solver sees it (a NaN proposal left OSQP's workspace unable to solve
        again: every later step took the fallback, silently; a review, 2026-12-08)."""
        x = np.asarray(x, np.float64)
        u_prop = np.asarray(u_prop, np.float64).reshape(self.n_u)
        if not (np.isfinite(x).all() and np.isfinite(u_prop).all()):
            raise ValueError(f"SafetyFilter.filter: the state {x} and the proposal {u_prop} must be finite; apply "
                             f"the fallback plan for a step whose controller gave no usable action (run_loop does)")
        u_target = self.U.project(u_prop)
        plan = self.solve(x, u_target, warm=fallback)
        if plan is not None:
            same = np.array_equal(plan.v[0], u_target)
            return plan.v[0].copy(), plan, Source.PROPOSAL if same else Source.CORRECTED
        return fallback.v[0].copy(), fallback, Source.FALLBACK if fallback.certified else Source.UNCERTIFIED
