import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# One profile for CI and local runs: no deadline (2 shared cores make timings noisy),
# a bounded number of examples so the suite stays inside its time budget.
settings.register_profile("keyfold", deadline=None, max_examples=40, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "keyfold"))

# Triton decorates its own library functions when it is first imported, and any torch.compile
# (tests/nn/test_compile.py, the transformers tests) imports it: without a GPU, set the
# interpreter before that, or tests/kernels/test_triton.py's interpreted kernels later fail with
# "Cannot call @triton.jit'd outside of the scope of a kernel" in a whole-suite run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs one worker per core), each worker gets its share of the
# cores: torch's default of one thread per core in every worker would run 2x as many threads as cores.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny matrices: on 2 shared cores, two threads only add
    contention (they ran such ops up to 6x slower). Request it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
