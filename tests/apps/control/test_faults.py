"""Faults and adversaries in the closed loop: the report must never show a pass its log contradicts.

Every run here is checked against :func:`recount`, written from the logged trajectory alone
(states, inputs, sources, the plant's true limits and model), not from ``LoopResult.summary``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import require_extra

require_extra("control")  # skip, naming the pip line, where the extra is missing (before the app imports)

from keyfold.apps.control import (Controller, Disturbance, FakeClock, LoopConfig, SafetyFilter, SlowController,
                                  Source, WorstActionController, make_plant, run_loop)

# inputs from a plan that passed the exact check (fault steps apply the shifted certified plan)
_CERT = {Source.PROPOSAL, Source.CORRECTED, Source.FALLBACK, Source.DEADLINE} | {s for s in Source if s.value == "fault"}


def recount(res, plant, w_assumed) -> dict:
    """The summary's safety numbers, recounted from the trajectory with the true limits."""
    X, U = res.states, res.inputs
    H, h = plant.state_limits.H, plant.state_limits.h
    finite = np.isfinite(X).all(1)
    Xf = np.where(finite[:, None], X, 0.0)
    outside = ~finite | (Xf @ H.T > h).any(1)                            # (T + 1,)
    W = X[1:] - X[:-1] @ plant.A.T - U @ plant.B.T                        # (T, n_x)
    inside = ~outside[:-1]
    wf = np.isfinite(W).all(1)
    over = (np.abs(np.where(wf[:, None], W, 0.0)) > w_assumed).any(1) | ~wf
    exceeded = inside & over
    certified = np.array([res.filter_on and s in _CERT for s in res.sources], bool)  # filter off: none
    ratios = [np.max(np.abs(W[k]) / w_assumed) if wf[k] else np.inf for k in range(len(W)) if inside[k]]
    return {
        "violations": int(outside.sum()),
        "input_violations": int(((U < plant.input_limits.lo) | (U > plant.input_limits.hi) | ~np.isfinite(U)).any(1).sum()),
        "interventions": sum(s is Source.CORRECTED for s in res.sources),
        "deadline_misses": int((np.asarray(res.latency) > res.deadline).sum()),
        "solver_fallbacks": sum(s is Source.FALLBACK for s in res.sources),
        "uncertified": sum(s is Source.UNCERTIFIED for s in res.sources),
        "max_disturbance_ratio": float(max(ratios)) if ratios else 0.0,
        "assumption_exceeded": int(exceeded.sum()),
        "certified_invalidated": int((exceeded & certified).sum()),
        "violations_after_certified": int((certified & outside[1:]).sum()),
        "steps": len(U),
    }


def _assert_report_matches(res, plant, w_assumed):
    s, r = res.summary(), recount(res, plant, w_assumed)
    for key, want in r.items():
        if key == "max_disturbance_ratio":
            assert s[key] == pytest.approx(want, rel=1e-9), (key, s[key], want)
        else:
            assert s[key] == want, (key, s[key], want)
    # a certified step followed by a violation is possible only when the assumption broke
    if r["violations_after_certified"]:
        assert r["assumption_exceeded"] > 0 and res.warnings()
    return s


def _worst(plant):
    return WorstActionController(plant.A, plant.B, plant.state_limits, plant.input_limits)


# ------------------------------------------------ 1. an understated disturbance bound is reported


def test_understated_disturbance_bound_is_reported_not_hidden():
    """The plant's noise is 5x the bound the filter assumes: violations follow certified inputs,
    and the report must say the filter's assumption broke (it used to read a ratio of 1.000)."""
    plant = make_plant("msd", noise=np.array([0.01, 0.05]))
    assumed = make_plant("msd").disturbance_bound()
    sf = SafetyFilter.from_plant(plant, w_bar=assumed)
    res = run_loop(plant, _worst(plant), np.zeros(202), LoopConfig(steps=200, disturbance=Disturbance.WORST),
                   sf, FakeClock())
    s = _assert_report_matches(res, plant, assumed)
    assert np.array_equal(res.w_bar, sf.w_bar) and np.array_equal(res.w_plant, plant.disturbance_bound())
    assert s["violations"] > 0 and s["violations_after_certified"] > 0
    assert s["max_disturbance_ratio"] > 4.0                      # against the filter's bound, not the plant's
    assert s["assumption_exceeded"] > 0 and s["certified_invalidated"] > 0
    text = " ".join(res.warnings())
    assert "safety filter assumed" in text and "do not hold" in text


def test_correct_bound_reports_no_exceedance():
    plant = make_plant("msd")
    res = run_loop(plant, _worst(plant), np.zeros(152), LoopConfig(steps=150, disturbance=Disturbance.WORST),
                   SafetyFilter.from_plant(plant), FakeClock())
    s = _assert_report_matches(res, plant, plant.disturbance_bound())
    assert s["violations"] == 0 and s["assumption_exceeded"] == 0 and s["max_disturbance_ratio"] <= 1.0
    assert res.warnings() == []


# ------------------------------------------------------- 2. a NaN plant state is never a pass


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_state_is_a_violation_and_ends_the_run(bad):
    plant = make_plant("msd")
    inner, calls = plant.f, []

    def f(x, u):
        calls.append(1)
        y = inner(x, u)
        return y * bad if len(calls) == 30 else y
    plant.f = f
    res = run_loop(plant, _worst(plant), np.zeros(102), LoopConfig(steps=100, filter_on=False), None, FakeClock())
    s = _assert_report_matches(res, plant, plant.disturbance_bound())
    assert s["steps"] == 30 and s["stopped"] is not None and "not finite" in s["stopped"]
    assert s["violations"] >= 1 and s["max_violation"] == np.inf
    assert res.violation[-1] == np.inf and "not finite" in res.warnings()[0]


# ------------------------------------- 5. a controller that raises or misbehaves is replaced, not fatal


class _Faulty(Controller):
    """Wraps a controller; on chosen calls raises or returns a malformed action."""

    def __init__(self, inner, plan: dict):
        self.inner, self.plan, self.calls = inner, plan, 0
        self.window, self.horizon = inner.window, inner.horizon

    def reset(self, seed):
        self.calls = 0
        self.inner.reset(seed)

    def propose(self, x_hist, u_hist, reference):
        k, self.calls = self.calls, self.calls + 1
        what = self.plan.get(k)
        good = self.inner.propose(x_hist, u_hist, reference)
        if what == "raise":
            raise RuntimeError("predictor exploded")
        if what == "shape":
            return np.zeros((1, 3))
        if what == "nan":
            return np.full_like(good, np.nan)
        if what == "inf":
            return np.full_like(good, np.inf)
        if what == "out":
            return good * 0 + 10.0                               # the input box is +-1.5
        if what == "text":
            return "up"
        return good


_PLAN = {3: "raise", 7: "shape", 11: "nan", 12: "nan", 20: "out", 25: "inf", 31: "text", 40: "raise"}


@pytest.mark.parametrize("filter_on", [True, False])
def test_faulty_controller_is_replaced_by_the_fallback_every_step(filter_on):
    plant = make_plant("msd")
    sf = SafetyFilter.from_plant(plant)
    ctrl = _Faulty(_worst(plant), _PLAN)
    res = run_loop(plant, ctrl, np.zeros(62), LoopConfig(steps=60, filter_on=filter_on), sf if filter_on else None,
                   FakeClock())
    s = _assert_report_matches(res, plant, plant.disturbance_bound())
    assert s["steps"] == 60 and s["stopped"] is None
    assert sorted(res.faults) == sorted(_PLAN) and s["controller_faults"] == len(_PLAN)
    assert [k for k, src in enumerate(res.sources) if src is Source.FAULT] == sorted(_PLAN)
    assert "predictor exploded" in res.faults[3] and "shape" in res.faults[7] and "input box" in res.faults[20]
    assert np.isfinite(res.inputs).all() and s["input_violations"] == 0
    if filter_on:
        assert s["violations"] == 0 and s["uncertified"] == 0
    else:  # the previous plan, shifted: the worst-action controller plans one step, so its last action
        for k in _PLAN:
            prev = max(j for j in range(k) if j not in _PLAN) if any(j not in _PLAN for j in range(k)) else None
            want = np.zeros(1) if prev is None else res.proposals[prev]
            np.testing.assert_array_equal(res.inputs[k], want)


def test_fault_fallback_is_the_shifted_certified_plan():
    """The input applied at a fault step is row 0 of the previous plan shifted from the measured state."""
    plant = make_plant("msd")
    sf = SafetyFilter.from_plant(plant)
    probe = []

    class Spy(SafetyFilter):
        def shift(self, plan, x):
            out = super().shift(plan, x)
            probe.append(out.v[0].copy())
            return out
    spy = Spy(plant.A, plant.B, plant.state_limits, plant.input_limits, sf.w_bar)
    res = run_loop(plant, _Faulty(_worst(plant), {5: "raise", 9: "nan"}), np.zeros(22), LoopConfig(steps=20),
                   spy, FakeClock())
    for k in (5, 9):
        assert res.sources[k] is Source.FAULT
        np.testing.assert_array_equal(res.inputs[k], probe[k - 1])   # shift() runs from step 1


def test_a_filter_that_raises_falls_back_and_is_reported():
    plant = make_plant("msd")
    sf = SafetyFilter.from_plant(plant)
    calls = []
    real = sf.filter

    def flaky(x, u, fallback):
        calls.append(1)
        if len(calls) in (4, 5):
            raise ArithmeticError("solver blew up")
        return real(x, u, fallback)
    sf.filter = flaky
    res = run_loop(plant, _worst(plant), np.zeros(32), LoopConfig(steps=30), sf, FakeClock())
    s = _assert_report_matches(res, plant, plant.disturbance_bound())
    assert sorted(res.faults) == [3, 4] and "solver blew up" in res.faults[3]
    assert res.sources[3] is Source.FALLBACK and s["violations"] == 0


# ------------------------------------------------------------------ adversarial closed loops


@pytest.mark.parametrize("seed", range(4))
def test_worst_action_with_tight_limits_recount(seed):
    """The worst admissible action every step, limits tightened to where the filter barely fits."""
    plant = make_plant("msd", p_max=0.3, v_max=0.4, p_brake=0.35)
    sf = SafetyFilter.from_plant(plant)
    ctrl = _Faulty(_worst(plant), {k: "raise" for k in range(seed, 80, 9)})
    res = run_loop(plant, ctrl, np.zeros(82), LoopConfig(steps=80, disturbance=Disturbance.WORST, seed=seed),
                   sf, FakeClock())
    s = _assert_report_matches(res, plant, sf.w_bar)
    assert s["violations"] == 0 and s["interventions"] > 0 and s["controller_faults"] > 0


@pytest.mark.parametrize("scale", [1.5, 3.0, 10.0])
def test_disturbance_above_its_bound_is_never_reported_as_a_pass(scale):
    """Pendulum: the real noise is ``scale`` times what the filter assumes."""
    base = make_plant("pendulum")
    plant = make_plant("pendulum", noise=base.noise * scale)
    sf = SafetyFilter.from_plant(plant, w_bar=base.disturbance_bound())
    res = run_loop(plant, _worst(plant), np.zeros(122), LoopConfig(steps=120, disturbance=Disturbance.WORST),
                   sf, FakeClock())
    s = _assert_report_matches(res, plant, sf.w_bar)
    assert s["max_disturbance_ratio"] > 1.0 and s["assumption_exceeded"] > 0 and res.warnings()
    if s["violations"]:
        assert s["certified_invalidated"] > 0


def test_filter_off_adversary_recount():
    plant = make_plant("pendulum")
    res = run_loop(plant, _worst(plant), np.zeros(62), LoopConfig(steps=60, filter_on=False,
                                                                   disturbance=Disturbance.WORST), None, FakeClock())
    s = _assert_report_matches(res, plant, plant.disturbance_bound())
    assert s["violations"] > 0


def test_a_late_step_with_an_uncertified_fallback_is_still_a_deadline_miss():
    """After the filter's disturbance assumption broke, a late step whose shifted fallback failed its check
    is logged UNCERTIFIED, and the summary counted deadline misses from DEADLINE steps only: 98 of 100 late
    steps (a review, 2026-12-07). A miss is every step past its deadline."""
    plant = make_plant("msd")
    sf = SafetyFilter.from_plant(plant, w_bar=plant.disturbance_bound() * 0.1)
    clock = FakeClock()
    adv = WorstActionController(plant.A, plant.B, plant.state_limits, plant.input_limits)
    slow = SlowController(adv, clock, delay=2 * plant.dt, every=2)
    res = run_loop(plant, slow, np.zeros(210), LoopConfig(steps=200, disturbance=Disturbance.WORST, seed=0), sf, clock)
    late = np.asarray(res.latency) > res.deadline
    assert any(s is Source.UNCERTIFIED for s, x in zip(res.sources, late) if x)  # the case the count missed
    assert res.summary()["deadline_misses"] == int(late.sum()) == 100


class _Scripted:
    """A controller returning ``plans[k]`` at step k (raising where it is an exception)."""
    window, horizon = 1, 2

    def __init__(self, plans):
        self.plans = plans

    def reset(self, seed):
        self.k = 0

    def propose(self, x_hist, u_hist, ref):
        p = self.plans[min(self.k, len(self.plans) - 1)]
        self.k += 1
        if isinstance(p, Exception):
            raise p
        return p


def test_a_watchdog_fallback_never_applies_an_unchecked_row_and_a_grad_tensor_is_one_fault():
    """Filter off: the fallback (the previous plan shifted) applied its row 1, never checked: a NaN there
    reached the plant and the run stopped as if the plant had failed. A controller returning a torch tensor
    that requires grad raised RuntimeError out of run_loop (reviews, 2026-12-08)."""
    import torch
    plant = make_plant("msd")
    plans = [np.array([[0.1], [np.nan]])] * 4 + [RuntimeError("once")] + [np.array([[0.1], [0.1]])] * 30
    res = run_loop(plant, _Scripted(plans), np.zeros(40), LoopConfig(steps=30, filter_on=False), None, FakeClock())
    assert res.stopped is None and np.isfinite(res.inputs).all() and res.inputs[4][0] == 0.1
    assert list(res.faults) == [4]
    grad = torch.full((2, 1), 0.1, requires_grad=True)
    res = run_loop(plant, _Scripted([grad]), np.zeros(13), LoopConfig(steps=10), SafetyFilter.from_plant(plant),
                   FakeClock())
    assert len(res.faults) == 10 and res.summary()["violations"] == 0


def test_a_filter_on_another_model_reports_its_own_assumption_broken():
    """The loop measured the disturbance against the plant's model, not the filter's: a filter on a model
    with a spring 4x too stiff broke its assumption by up to 16.7x while the log said ratio 1.0, 0 steps
    exceeded and no warning (a review, 2026-12-08)."""
    plant = make_plant("msd")
    model = make_plant("msd", spring=2.0)
    sf = SafetyFilter(model.A, model.B, plant.state_limits, plant.input_limits, plant.disturbance_bound())
    adv = WorstActionController(plant.A, plant.B, plant.state_limits, plant.input_limits)
    res = run_loop(plant, adv, np.zeros(320), LoopConfig(steps=300, seed=0, disturbance=Disturbance.WORST), sf,
                   FakeClock())
    resid = res.states[1:] - res.states[:-1] @ model.A.T - res.inputs @ model.B.T
    np.testing.assert_allclose(res.disturbance, resid, atol=1e-12)
    assert res.summary()["assumption_exceeded"] > 0 and res.warnings()


def test_the_filter_refuses_a_non_finite_proposal_and_limits_refuse_a_zero_row():
    """A NaN proposal passed to SafetyFilter.filter left OSQP unable to solve again (every later step took
    the fallback); a zero row of state limits made every violation distance NaN, counted as none."""
    from keyfold.apps.control import Polytope
    plant = make_plant("msd")
    sf = SafetyFilter.from_plant(plant)
    plan = sf.initial_plan(plant.x0)
    with pytest.raises(ValueError, match="must be finite"):
        sf.filter(plant.x0, np.array([np.nan]), plan)
    u, _, _ = sf.filter(plant.x0, np.array([0.0]), plan)
    assert np.isfinite(u).all()
    with pytest.raises(ValueError, match="row 2 of H is zero"):
        Polytope(np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]), np.array([1.0, 1.0, 0.0]))
