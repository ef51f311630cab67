"""Shared pytest fixtures: the ``dist`` fixture runs functions on gloo worker pools.

    def _body(n):                 # module-level, runs on every rank
        return torch.distributed.get_rank() * n

    def test_x(dist):
        assert dist.run(4, _body, 10) == [0, 10, 20, 30]
        dist.run_expect_error(4, _bad, match="placement")

See tests/harness.py for details. The fixture is session-scoped, so it also works
inside hypothesis ``@given`` tests. Pools start lazily; set
``SHARDWISE_TEST_PRESTART=1,2,4,8`` to start those pools concurrently when the
fixture is first requested.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests import harness

# The suite starts ~150 Python processes (launchers, jobs, benchmark workers, pool workers).
# Where the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE, as on some CI
# images), each of them would compile shardwise's and the tests' sources again: ~0.2 s of CPU
# per process for shardwise alone. Compiled once, into the tree's ignored __pycache__
# directories, they are read by every later process; installed packages (torch) ship theirs.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture(scope="session")
def dist():
    runner = harness.DistRunner()
    prestart = os.environ.get("SHARDWISE_TEST_PRESTART", "").strip()
    if prestart:
        harness.prestart(*(int(w) for w in prestart.split(",") if w.strip()))
    yield runner
    harness.shutdown_all()


@pytest.fixture(scope="session")
def reference() -> list[float]:
    """Losses of the one-process run of the trainer parity tests' base job (``tests/test_train.py``'s
    ``BASE``), shared by the parity tests of every layout."""
    from tests.test_train import BASE, one_process_losses

    return list(one_process_losses(tuple(BASE)))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip cleanly where no GPU is visible (torch is imported only then)."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)")
        for item in marked:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    # Also covers pools started through harness.run_distributed() without the fixture.
    harness.shutdown_all()
