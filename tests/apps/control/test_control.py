"""The closed loop: the safety filter's guarantee under adversaries, deadlines, reproducibility,
clear configuration errors, and the predictors' basic competence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import require_extra

require_extra("control")  # skip, naming the pip line, where the extra is missing (before the app imports)

from keyfold.apps.control import (ARXPredictor, Box, Controller, Disturbance, FakeClock, FilterConfig,
                             FilterConfigError, InvertedPendulum, LoopConfig, MPPIController, Polytope,
                             QPSolver, RandomBangBang, SafetyFilter, SlowController, Source, TrainConfig,
                             WorstActionController, excite, make_plant, make_predictor, run_loop,
                             square_reference, windows)
from keyfold.apps.control.predictors import prediction_rmse

PLANTS = ("msd", "pendulum")
_FILTERS: dict = {}


def _plant_and_filter(name: str, solver: QPSolver = QPSolver.DAQP):
    """Plants and filters are deterministic to build; build each once."""
    key = (name, solver)
    if key not in _FILTERS:
        plant = make_plant(name)
        _FILTERS[key] = (plant, SafetyFilter.from_plant(plant, FilterConfig(solver=solver)))
    return _FILTERS[key]


def _adversary(kind: str, plant, seed: int) -> Controller:
    if kind == "worst":
        return WorstActionController(plant.A, plant.B, plant.state_limits, plant.input_limits)
    return RandomBangBang(plant.input_limits, seed=seed)


def _ref(steps: int) -> np.ndarray:
    return np.zeros(steps + 2)


def _assert_safe(res):
    s = res.summary()
    assert s["violations"] == 0, f"state left the limits by {s['max_violation']}"
    assert s["input_violations"] == 0
    assert s["uncertified"] == 0
    assert s["max_disturbance_ratio"] <= 1.0       # assumption A1 held on the simulated plant
    assert np.all(res.inputs >= res.input_lo) and np.all(res.inputs <= res.input_hi)


# ------------------------------------------------------------------ the guarantee


@settings(max_examples=40)
@given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(PLANTS), adversary=st.sampled_from(["worst", "bang"]),
       noise=st.sampled_from(list(Disturbance)))
def test_filtered_loop_never_violates_under_adversaries(seed, name, adversary, noise):
    plant, sf = _plant_and_filter(name)
    steps = 150
    res = run_loop(plant, _adversary(adversary, plant, seed), _ref(steps),
                   LoopConfig(steps=steps, filter_on=True, disturbance=noise, seed=seed), sf, FakeClock())
    _assert_safe(res)
    assert res.summary()["interventions"] > 0        # the adversary was really corrected


@pytest.mark.parametrize("name", PLANTS)
def test_adversary_violates_without_filter(name):
    """The test above can fail: the same adversary breaks the limits when the filter is off."""
    plant, _ = _plant_and_filter(name)
    res = run_loop(plant, _adversary("worst", plant, 0), _ref(60),
                   LoopConfig(steps=60, filter_on=False, disturbance=Disturbance.WORST), None, FakeClock())
    assert res.summary()["violations"] > 0


def test_osqp_backend_is_safe_too():
    plant, sf = _plant_and_filter("pendulum", QPSolver.OSQP)
    res = run_loop(plant, _adversary("worst", plant, 0), _ref(50),
                   LoopConfig(steps=50, disturbance=Disturbance.WORST, seed=3), sf, FakeClock())
    _assert_safe(res)


@settings(max_examples=40)
@given(name=st.sampled_from(PLANTS), data=st.data())
def test_shifted_plan_stays_certified(name, data):
    """Recursive feasibility: a certified plan, shifted after any w in W, is certified again."""
    plant, sf = _plant_and_filter(name)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    lo, hi = plant.state_limits.bounding_box()
    x = rng.uniform(lo, hi) * data.draw(st.floats(0.0, 1.0))
    u = rng.uniform(plant.input_limits.lo, plant.input_limits.hi)
    try:
        plan = sf.initial_plan(x)
    except FilterConfigError:
        return                                        # x outside the feasible set: nothing to shift
    _, plan, _ = sf.filter(x, u, plan)
    w = rng.uniform(-1, 1, plant.n_x) * sf.w_bar
    x_next = plan.z[1] + w
    assert plant.state_limits.contains(x_next)
    shifted = sf.shift(plan, x_next)
    assert shifted.certified
    np.testing.assert_allclose(shifted.z[0], x_next)


def test_certify_projects_inputs_exactly():
    """A solver answer a hair past the input bound (as ADMM tolerances give) is clipped exactly."""
    plant, sf = _plant_and_filter("msd")
    x = np.array([0.2, 0.1])
    _, plan, _ = sf.filter(x, np.array([10.0]), sf.initial_plan(x))     # saturated: v_0 at the bound
    assert plan.v[0, 0] == plant.u_max
    leaky = plan.v.copy()
    leaky[0] = plant.input_limits.hi + 1e-7 if leaky[0, 0] > 0 else plant.input_limits.lo - 1e-7
    fixed = sf.certify(x, leaky)
    assert fixed is not None
    assert plant.input_limits.contains(fixed.v[0])
    assert abs(fixed.v[0, 0]) == plant.u_max
    u, _, _ = sf.filter(x, np.array([10.0]), sf.initial_plan(x))
    assert plant.input_limits.contains(u)


def test_feasible_proposal_passes_unchanged():
    plant, sf = _plant_and_filter("msd")
    u, _, src = sf.filter(np.zeros(2), np.array([0.3]), sf.initial_plan(np.zeros(2)))
    assert src is Source.PROPOSAL and u[0] == 0.3


@settings(max_examples=40)
@given(th=st.floats(-0.5, 0.5), w=st.floats(-1.5, 1.5), u=st.floats(-8, 8))
def test_pendulum_linearization_error_inside_bound(th, w, u):
    p = InvertedPendulum()
    x = np.array([th, w])
    r = p.f(x, np.array([u])) - p.A @ x - p.B @ np.array([u])
    assert np.all(np.abs(r) <= p.residual_bound())


def test_polytope_bounding_box_and_violation():
    plant = make_plant("msd")
    lo, hi = plant.state_limits.bounding_box()
    np.testing.assert_allclose(lo, [-1, -1], atol=1e-9)
    np.testing.assert_allclose(hi, [1, 1], atol=1e-9)
    assert plant.state_limits.violation(np.array([1.0, 0.5]))[()] > 0     # braking row: 1 + 0.25 > 1.15
    assert plant.state_limits.violation(np.array([0.5, 0.5]))[()] == 0


# ------------------------------------------------------------------ deadlines


@pytest.mark.parametrize("every", [1, 3])
def test_slow_predictor_falls_back_to_shifted_plan_safely(every):
    plant, sf = _plant_and_filter("pendulum")
    clock = FakeClock()
    slow = SlowController(_adversary("worst", plant, 0), clock, delay=2 * plant.dt, every=every)
    steps = 90
    res = run_loop(plant, slow, _ref(steps), LoopConfig(steps=steps, disturbance=Disturbance.WORST), sf, clock)
    s = res.summary()
    assert s["deadline_misses"] == steps // every
    missed = [k for k, src in enumerate(res.sources) if src is Source.DEADLINE]
    assert missed == [k for k in range(steps) if (k + 1) % every == 0]
    _assert_safe(res)
    if every == 1:           # only fallbacks: the shifted plan alone drove the plant, within the limits
        assert all(src is Source.DEADLINE for src in res.sources)


def test_fallback_input_is_the_shifted_plan():
    plant, sf = _plant_and_filter("msd")
    clock = FakeClock()
    slow = SlowController(_adversary("worst", plant, 0), clock, delay=1.0, every=2)
    res = run_loop(plant, slow, _ref(10), LoopConfig(steps=10, disturbance=Disturbance.VERTEX), sf, clock)
    # replay: the applied plans; at a miss the input must equal the previous plan shifted
    plan = sf.initial_plan(plant.x0)
    for k in range(10):
        x = res.states[k]
        fb = plan if k == 0 else sf.shift(plan, x)
        if res.sources[k] is Source.DEADLINE:
            np.testing.assert_array_equal(res.inputs[k], fb.v[0])
            plan = fb
        else:
            _, plan, _ = sf.filter(x, res.proposals[k], fb)
            np.testing.assert_array_equal(res.inputs[k], plan.v[0])


# ------------------------------------------------------------------ reproducibility


@pytest.fixture(scope="module")
def msd_arx():
    plant = make_plant("msd")
    ep = excite(plant, 8, 80, np.random.default_rng(0))
    return plant, ARXPredictor(8).fit(windows(ep, 8))


def test_run_is_reproducible_from_seed(msd_arx):
    plant, pred = msd_arx
    _, sf = _plant_and_filter("msd")
    ctrl = MPPIController(pred, plant.state_limits, plant.input_limits, plant.tracked)
    ref = square_reference(40, 0.9, 40, ctrl.horizon)
    runs = [run_loop(plant, ctrl, ref, LoopConfig(steps=40, seed=s, disturbance=Disturbance.UNIFORM), sf, FakeClock())
            for s in (5, 5, 6)]
    np.testing.assert_array_equal(runs[0].states, runs[1].states)
    np.testing.assert_array_equal(runs[0].inputs, runs[1].inputs)
    assert runs[0].sources == runs[1].sources
    assert not np.array_equal(runs[0].states, runs[2].states)
    _assert_safe(runs[0])


# ------------------------------------------------------------------ configuration errors


class _MustNotRun(Controller):
    def propose(self, x_hist, u_hist, reference):
        raise AssertionError("the loop started despite a bad configuration")


def test_initial_state_outside_limits_raises_before_loop():
    plant = make_plant("msd", x0=np.array([1.2, 0.0]))
    sf = SafetyFilter.from_plant(plant)
    with pytest.raises(FilterConfigError, match="x0"):
        run_loop(plant, _MustNotRun(), _ref(5), LoopConfig(steps=5), sf, FakeClock())
    with pytest.raises(FilterConfigError, match="x0"):     # also with the filter off
        run_loop(plant, _MustNotRun(), _ref(5), LoopConfig(steps=5, filter_on=False), None, FakeClock())


def test_initial_state_outside_feasible_set_raises_before_loop():
    # inside the box, but falling out faster than any allowed torque can stop it
    plant = make_plant("pendulum", x0=np.array([0.49, 1.45]))
    sf = SafetyFilter.from_plant(plant)
    with pytest.raises(FilterConfigError, match="feasible set"):
        run_loop(plant, _MustNotRun(), _ref(5), LoopConfig(steps=5), sf, FakeClock())


def test_infeasible_disturbance_bound_raises():
    plant = make_plant("msd")
    with pytest.raises(FilterConfigError, match="w_bar"):
        SafetyFilter.from_plant(plant, w_bar=np.array([0.2, 0.5]))
    with pytest.raises(FilterConfigError, match="w_bar"):
        SafetyFilter.from_plant(plant, w_bar=np.array([-0.1, 0.0]))


def test_bad_arguments_raise_clearly():
    with pytest.raises(ValueError, match="lo < hi"):
        Box([1.0], [-1.0])
    with pytest.raises(ValueError, match="unbounded"):
        Polytope(np.array([[1.0, 0.0]]), np.array([1.0])).bounding_box()
    plant, sf = _plant_and_filter("msd")
    with pytest.raises(ValueError, match="reference"):
        run_loop(plant, _MustNotRun(), np.zeros(3), LoopConfig(steps=5), sf, FakeClock())
    with pytest.raises(ValueError, match="SafetyFilter"):
        run_loop(plant, _MustNotRun(), _ref(5), LoopConfig(steps=5), None, FakeClock())
    with pytest.raises(ValueError, match="unknown plant"):
        make_plant("cartpole")


# ------------------------------------------------------------------ predictors


def test_arx_reaches_the_noise_floor(msd_arx):
    plant, pred = msd_arx
    test = windows(excite(plant, 4, 80, np.random.default_rng(1)), 8)
    floor = plant.noise / math.sqrt(3)                # std of the uniform disturbance
    assert np.all(prediction_rmse(pred, test) <= 1.3 * floor)


@pytest.fixture
def one_thread():
    """The suite shares 2 cores; small models train fastest on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["attention", "gru", "s4d"])
def test_toolbox_predictors_learn(kind, one_thread):
    plant = make_plant("pendulum")
    data = windows(excite(plant, 6, 60, np.random.default_rng(0)), 6)
    test = windows(excite(plant, 3, 60, np.random.default_rng(1)), 6)
    pred = make_predictor(kind, 6).fit(data, TrainConfig(steps=50, batch=32, width=16))
    still = (test.target - test.xs[:, -1]).pow(2).mean(0).sqrt().numpy()   # "nothing moves" predictor
    assert np.all(prediction_rmse(pred, test) < 0.5 * still)


def test_bench_smoke_writes_reports(tmp_path, one_thread):
    from keyfold.apps.control.bench import main
    assert main(["--predictors", "arx", "--plants", "msd", "--seeds", "1", "--steps", "20",
                 "--out", str(tmp_path)]) == 0
    import json
    out = json.loads((tmp_path / "control-quick.json").read_text())
    on = out["plants"]["msd"]["predictors"]["arx"]["filter_on"]
    assert on["violation_steps"] == 0 and on["steps"] == 20
    assert (tmp_path / "control-quick.png").stat().st_size > 10_000
    assert "| arx | on |" in (tmp_path / "control-quick.md").read_text()


def test_docstring_examples_run():
    import doctest

    from keyfold.apps.control import loop, plants, predictors, safety
    for mod in (loop, plants, predictors, safety):
        result = doctest.testmod(mod)
        assert result.attempted > 0 and result.failed == 0, mod.__name__
