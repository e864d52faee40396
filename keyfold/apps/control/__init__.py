"""The closed loop: learned predictors drive a simulated plant; a safety filter keeps the limits.

- :mod:`.plants`: a mass-spring-damper and an inverted pendulum, limits, bounded disturbances,
  excitation data.
- :mod:`.predictors`: next-state predictors (linear ARX baseline; toolbox attention, GRU, S4D).
- :mod:`.controllers`: MPC over a predictor (MPPI) and the adversaries used by the tests.
- :mod:`.safety`: the predictive safety filter (tube on a nominal linear model, a QP, an exact
  final projection, a shifted-plan fallback). Its guarantee and assumptions: ``docs/control.md``.
- :mod:`.loop`: the real-time loop with an injectable clock and deadline fallbacks.
- :mod:`.bench`: ``python -m keyfold control bench``.
"""

from keyfold._extras import require as _require

_require("control", "keyfold.apps.control")

from .controllers import (Controller, MPPIConfig, MPPIController, RandomBangBang, SlowController,
                          WorstActionController)
from .loop import Clock, FakeClock, LoopConfig, LoopResult, WallClock, run_loop, square_reference
from .plants import (Box, Disturbance, Episodes, InvertedPendulum, MassSpringDamper, Plant, Polytope,
                     excite, make_plant)
from .predictors import ARXPredictor, Predictor, SequencePredictor, TrainConfig, make_predictor, windows
from .safety import FilterConfig, FilterConfigError, Plan, QPSolver, SafetyFilter, Source

__all__ = [
    "Polytope", "Box", "Disturbance", "Plant", "MassSpringDamper", "InvertedPendulum", "Episodes",
    "excite", "make_plant",
    "Predictor", "ARXPredictor", "SequencePredictor", "TrainConfig", "make_predictor", "windows",
    "Controller", "MPPIConfig", "MPPIController", "WorstActionController", "RandomBangBang", "SlowController",
    "FilterConfig", "FilterConfigError", "Plan", "QPSolver", "SafetyFilter", "Source",
    "Clock", "WallClock", "FakeClock", "LoopConfig", "LoopResult", "run_loop", "square_reference",
]
