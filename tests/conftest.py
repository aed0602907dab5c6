import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Importing them registers faulty backends: only test_conformance.py's tests may (--doctest-modules imports every
# module); the blind set is scored by its own script (tests/conformance_blind/score.py), never in the suite.
collect_ignore = ["conformance_faults.py", "conformance_blind"]

# Tests run on CPU; keep each process to few threads so 2-rank DDP tests share 2 cores well.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No metrics.png at the end of every test run (it costs a fraction of a second each); tests of it set plot_metrics=True.
os.environ.setdefault("FRAMEWORK_PLOT_METRICS", "0")


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture
def framework_log():
    """Messages of the ``framework`` logger (which does not propagate to pytest's caplog)."""
    from logs import captured_log

    with captured_log("framework") as messages:
        yield messages
