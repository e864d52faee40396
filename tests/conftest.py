import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# One profile for CI and local runs: no deadline (2 shared cores make timings noisy),
# a bounded number of examples so the suite stays inside its time budget.
settings.register_profile("keyfold", deadline=None, max_examples=40, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "keyfold"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
