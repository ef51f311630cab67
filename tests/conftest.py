"""Shared pytest fixtures and the test tiers.

Tiers (markers registered in pyproject.toml; every collected test carries exactly one):

* ``unit``: pure logic in this process: no worker pool, no launched process;
* ``dist``: runs functions on the session's pools of gloo workers (the ``dist`` fixture);
* ``e2e``: whole jobs: trainer runs (shared per session, ``trainer_runs``), launched
  processes (launchers, jobs, README blocks, benchmark scripts).

A test without a tier marker is ``dist`` if it uses the ``dist`` fixture, ``e2e`` if it uses a
trainer run fixture (``E2E_FIXTURES``), else ``unit``; modules that launch processes say
``e2e`` themselves. A ``unit`` or ``dist`` test that starts a Python process fails, naming the
tier to give it.

The developer tier, ``pytest -m dev``: every ``unit`` test and every ``dist`` test not marked
``slow`` (``SLOW_TESTS``: sweeps that cost several CPU-seconds, such as every op or placement
pair on a 2-D or 3-D mesh, or compiling with inductor). conftest gives those tests ``dev``.

The ``dist`` fixture runs functions on gloo worker pools:

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

import contextlib
import os
import subprocess
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
    """Losses of the one-process run of the parity job (``tests/helpers.py``'s ``BASE``), shared by
    the parity tests of every layout."""
    from tests.helpers import BASE, one_process_losses

    return list(one_process_losses(tuple(BASE)))


@pytest.fixture(scope="session")
def trainer_runs(dist):
    """The parity job's multi-rank runs, each layout trained once per session (``helpers.TrainerRuns``)."""
    from tests.helpers import TrainerRuns

    return TrainerRuns(dist)


# ---------------------------------------------------------------------- tiers
TIERS = ("unit", "dist", "e2e")
E2E_FIXTURES = {"reference", "trainer_runs"}  # trainer runs: whole jobs, if on the pools


# Dist tests kept out of the developer tier (marked ``slow`` here, in one place, so the test files
# need no edit): each cost over 4.5 CPU-seconds, workers included, in a full run on 2026-12-03
# (``--cpu-durations``; 2 cores, load 25-45: read them as relative). A node id names a test and
# all its parameters, or one parameter set.
SLOW_TESTS = (
    "tests/test_compile.py::test_tp_sp_block_compiles_with_every_compiling_backend",  # 15 s on 2 ranks: inductor
    "tests/test_compile.py::test_fsdp_tp_model_compiled_per_block_matches_eager_and_one_device",  # 29 s
    "tests/test_compile.py::test_tp_mlp_compiles_with_every_backend",  # 15 s on 2 ranks: inductor
    "tests/test_compile.py::test_tp_sp_block_compiles_to_one_graph_with_its_collectives",  # 8 s on 2 ranks
    "tests/test_compile.py::test_graph_breaks_no_more_than_torch_dtensor",  # 6 s
    "tests/test_redistribute.py::test_every_placement_pair[mesh_shape4-shape4]",  # 24 s: (2, 2, 2)
    "tests/test_redistribute.py::test_every_placement_pair[mesh_shape5-shape5]",  # 17 s: (2, 2, 2)
    "tests/test_redistribute.py::test_exchange_steps_on_eight_ranks",  # 5 s
    "tests/test_ops_view.py::test_view_ops_match_single_device_on_a_2d_mesh",  # 21 s
    "tests/test_ops_view.py::test_view_ops_match_single_device_on_a_1d_mesh",  # 5.5 s
    "tests/test_ops_reduction.py::test_reductions_values_and_gradients",  # 13 s
    "tests/test_ops_matmul.py::test_matmul_linear_einsum",  # 12 s
    "tests/test_ops_matmul.py::test_mm_family_gradients",  # 11 s
    "tests/test_ops_matmul.py::test_mm_family_values",  # 5 s
    "tests/test_ops_embedding_conv.py::test_conv2d_values_and_gradients",  # 11 s
    "tests/test_ops_embedding_conv.py::test_embedding_values_and_gradients",  # 7.5 s
    "tests/test_ops_attention.py::test_scaled_dot_product_attention[mesh_shape1]",  # 8 s: (2, 2)
    "tests/test_ops_tensor.py::test_indexing_matches_single_device_on_a_2d_mesh",  # 7 s
    "tests/test_ops_tensor.py::test_gather_scatter_and_fills_match_single_device",  # 6 s
    "tests/test_interop_checkpoint.py::test_dcp_checkpoints_resume_across_libraries_and_layouts",  # 6.5 s
    "tests/test_autograd.py::test_partial_gradients_and_gradient_placements",  # 6.4 s
    "tests/test_inplace.py::test_in_place_ops_keep_self_layout_or_fail_like_torch",  # 5 s
    # From the developer tier's own run (``pytest -m dev --cpu-durations``), over 3.5 s each:
    "tests/test_autograd.py::test_random_chains_give_single_device_gradients",  # 6 s (hypothesis)
    "tests/test_compile.py::test_redistribute_onto_another_mesh_compiles_to_one_graph_with_eager_values",  # 4.6 s
    "tests/test_inplace.py::test_out_argument_that_cannot_keep_its_layout_raises_on_every_rank",  # 3.8 s
    # transformers imported in 4 workers and here, once per session: 12-14 CPU-s for the first of these
    "tests/test_expert_parallel_hf.py::test_hf_moe_model_under_a_module_plan_equals_one_process",
    "tests/test_expert_parallel_hf.py::test_experts_the_plan_cannot_split_are_refused_on_every_rank_before_any_collective",
)


COLLECTED = pytest.StashKey[list]()  # node ids of every collected test, selected or not


def _listed_slow(item) -> bool:
    return any(item.nodeid == entry or item.nodeid.startswith(entry + "[") for entry in SLOW_TESTS)


def tier_markers(item) -> list[str]:
    """The tier markers ``item`` carries (exactly one after collection)."""
    return [m.name for m in item.iter_markers() if m.name in TIERS]


def _default_tier(item) -> str:
    """The tier of a test that names none: ``e2e`` if its module lists it in ``E2E_TESTS`` (modules
    that also run as scripts without pytest), else by the fixtures it uses."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if getattr(item, "originalname", None) in getattr(getattr(item, "module", None), "E2E_TESTS", ()):
        return "e2e"
    if fixtures & E2E_FIXTURES:
        return "e2e"
    return "dist" if "dist" in fixtures else "unit"


def _assign_tiers(items) -> None:
    """Give each unmarked test its default tier, and the developer tier's tests ``dev``; refuse a
    test marked with two tiers."""
    doubled = []
    for item in items:
        marked = tier_markers(item)
        if not marked:
            item.add_marker(getattr(pytest.mark, _default_tier(item)))
        elif len(set(marked)) > 1:
            doubled.append(f"{item.nodeid}: {sorted(set(marked))}")
        if _listed_slow(item):
            item.add_marker(pytest.mark.slow)
        tier = tier_markers(item)[0]
        if tier == "unit" or tier == "dist" and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.dev)
    if doubled:
        raise pytest.UsageError("tests with more than one tier marker (give each one of unit, dist, e2e):\n  "
                                + "\n  ".join(doubled))


@contextlib.contextmanager
def _no_python_processes(item):
    """While a ``unit`` or ``dist`` test sets up and runs, starting a Python process fails it: such
    a test belongs to ``e2e`` (the developer tier, ``-m dev``, promises no launched jobs).
    Pools are forked by the harness's forkserver, not through ``subprocess``."""
    tier = (tier_markers(item) or ["e2e"])[0]
    if tier == "e2e":
        yield
        return
    original = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        program = str(args if isinstance(args, (str, bytes)) else (list(args)[:1] or [""])[0])
        if program == sys.executable or os.path.basename(program).startswith("python"):
            raise AssertionError(f"a {tier!r} test started a Python process ({args!r}): mark it "
                                 "@pytest.mark.e2e (tests/conftest.py: tiers)")
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_python_processes(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_python_processes(item):
        yield


@pytest.hookimpl(tryfirst=True)  # before -m selects by tier
def pytest_collection_modifyitems(config, items):
    """Every test gets its tier (see the module docstring); tests marked ``cuda`` skip cleanly
    where no GPU is visible (torch is imported only then)."""
    _assign_tiers(items)
    config.stash[COLLECTED] = [item.nodeid for item in items]  # before -m / -k deselect any
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


# ---------------------------------------------------------------------- CPU time per test
def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests that cost the most CPU seconds, workers and launched jobs "
                          "included (0: all), and the CPU seconds of each tier (tests/cpu_time.py)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``--cpu-durations``: note the CPU seconds of the test's setup, call and teardown."""
    if item.config.getoption("cpu_durations") is None:
        yield
        return
    from tests.cpu_time import cpu_seconds

    before = cpu_seconds()
    yield
    item.config.stash.setdefault(_CPU_KEY, []).append(
        (cpu_seconds() - before, (tier_markers(item) or ["?"])[0], item.nodeid))


_CPU_KEY = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    shown = config.getoption("cpu_durations")
    costs = sorted(config.stash.get(_CPU_KEY, []), reverse=True)
    if shown is None or not costs:
        return
    write = terminalreporter.write_line
    terminalreporter.section(f"CPU seconds per test (workers and launched jobs included), top {shown or 'all'}")
    for seconds, tier, nodeid in costs[:shown or None]:
        write(f"{seconds:8.2f}s {tier:5} {nodeid}")
    by_tier: dict[str, float] = {}
    for seconds, tier, _ in costs:
        by_tier[tier] = by_tier.get(tier, 0.0) + seconds
    write("CPU seconds by tier: " + ", ".join(f"{t} {s:.1f}" for t, s in sorted(by_tier.items()))
          + f"; all {sum(by_tier.values()):.1f}")
    write("worker pools launched (world size: times): "
          + (", ".join(f"{w}: {n}" for w, n in sorted(harness.LAUNCHES.items())) or "none"))
