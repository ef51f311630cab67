"""Tests of the multi-process harness itself (tests/harness.py), with real gloo pools."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as tdist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import harness
from tests.harness import DistributedTestError

# --------------------------------------------------------------------------------------
# Functions run on the workers (module level: pickled by reference)
# --------------------------------------------------------------------------------------


def _rank_and_env():
    return (
        tdist.get_rank(),
        tdist.get_world_size(),
        tdist.get_backend(),
        os.environ["RANK"],
        os.environ["LOCAL_RANK"],
        os.environ["WORLD_SIZE"],
        os.environ["LOCAL_WORLD_SIZE"],
        os.environ["SHARDWISE_TEST_WORKER"],
        torch.get_num_threads(),
    )


def _all_reduce_sum():
    t = torch.tensor([float(tdist.get_rank() + 1)])
    tdist.all_reduce(t)
    return t


def _echo(x, *, scale):
    return x * scale + tdist.get_rank()


def _raise_on_rank_1():
    if tdist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    return tdist.get_rank()


def _raise_on_rank_1_others_all_reduce():
    if tdist.get_rank() == 1:
        raise RuntimeError("rank 1 bails out before the all_reduce")
    t = torch.ones(3)
    tdist.all_reduce(t)  # blocks: rank 1 never joins
    return t


def _sleep_on_rank_1(seconds):
    if tdist.get_rank() == 1:
        time.sleep(seconds)
    return tdist.get_rank()


def _exit_on_rank_1():
    if tdist.get_rank() == 1:
        os._exit(7)
    return tdist.get_rank()


class _UnpicklableError(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()  # makes the exception unpicklable


def _raise_unpicklable_everywhere():
    raise _UnpicklableError(f"bad placement on rank {tdist.get_rank()}")


def _raise_value_error_everywhere(tag):
    raise ValueError(f"invalid mesh {tag} (rank {tdist.get_rank()})")


def _return_unpicklable():
    return threading.Lock()


def _all_gather_ranks():
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(tdist.get_world_size())]
    tdist.all_gather(out, torch.tensor([tdist.get_rank()]))
    return [int(t.item()) for t in out]


def _add_rank(x):
    return x + tdist.get_rank()


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(dist, world_size):
    out = dist.run(world_size, _rank_and_env)
    assert [o[0] for o in out] == list(range(world_size))
    for rank, (r, ws, backend, env_rank, env_local, env_ws, env_lws, worker, threads) in enumerate(out):
        assert (r, ws, backend) == (rank, world_size, "gloo")
        assert (env_rank, env_local, env_ws, env_lws) == (str(rank), str(rank), str(world_size), str(world_size))
        assert worker == "1"
        assert threads == 1


def test_all_reduce_four_ranks(dist):
    out = dist.run(4, _all_reduce_sum)
    assert len(out) == 4
    for t in out:
        assert isinstance(t, torch.Tensor)
        assert t.tolist() == [10.0]  # 1 + 2 + 3 + 4


def test_args_kwargs_and_tensors_round_trip(dist):
    x = torch.arange(6.0).reshape(2, 3)
    out = harness.run_distributed(2, _echo, x, scale=2.0)
    for rank, t in enumerate(out):
        torch.testing.assert_close(t, x * 2.0 + rank)


def test_pool_is_reused_between_calls(dist):
    pids = dist.pool(4).pids
    dist.run(4, _all_reduce_sum)
    assert dist.pool(4).pids == pids


def test_error_on_one_rank_names_rank_and_traceback(dist):
    with pytest.raises(DistributedTestError) as excinfo:
        dist.run(2, _raise_on_rank_1)
    msg = str(excinfo.value)
    assert "tests.test_harness._raise_on_rank_1" in msg
    assert "failed on rank(s) [1]" in msg
    assert "ranks [0] returned normally" in msg
    assert "Traceback (most recent call last)" in msg
    assert "ValueError: boom from rank 1" in msg
    assert 'in _raise_on_rank_1' in msg  # the remote frame
    assert "test_error_on_one_rank_names_rank_and_traceback" in msg  # the calling test
    assert isinstance(excinfo.value, AssertionError)
    assert excinfo.value.kind == "error"
    assert set(excinfo.value.errors) == {1}
    assert excinfo.value.errors[1].type_name == "ValueError"
    # An inconsistent outcome discards the pool; the next call gets a working one.
    assert dist.run(2, _add_rank, 5) == [5, 6]


def test_desync_fails_within_timeout_and_pool_recovers(dist):
    old_pids = dist.pool(4).pids
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as excinfo:
        dist.run(4, _raise_on_rank_1_others_all_reduce, timeout=10)
    elapsed = time.monotonic() - start
    msg = str(excinfo.value)
    assert elapsed < 10 + 5, elapsed  # grace (5 s) + kill, well within the timeout
    assert excinfo.value.kind == "desync"
    assert "desynchronized" in msg
    assert "tests.test_harness._raise_on_rank_1_others_all_reduce" in msg
    assert "rank(s) [1] raised" in msg
    assert "ranks still running" in msg and "[0, 2, 3]" in msg
    assert "rank 1 bails out before the all_reduce" in msg
    assert "stack of stuck rank 0" in msg and " in all_reduce" in msg  # where they hang
    assert not harness._POOLS[4].alive
    # A fresh pool serves the next call.
    out = dist.run(4, _all_reduce_sum)
    assert [t.item() for t in out] == [10.0] * 4
    assert set(dist.pool(4).pids).isdisjoint(old_pids)


def test_pool_works_after_desync_in_previous_test(dist):
    assert [t.item() for t in dist.run(4, _all_reduce_sum)] == [10.0] * 4


def test_timeout_names_function_and_stuck_ranks(dist):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as excinfo:
        dist.run(2, _sleep_on_rank_1, 60, timeout=3)
    elapsed = time.monotonic() - start
    assert 3 <= elapsed < 3 + 8, elapsed
    msg = str(excinfo.value)
    assert excinfo.value.kind == "timeout"
    assert re.search(
        r"distributed test tests\.test_harness\._sleep_on_rank_1 timed out after 3 s on world size 2; "
        r"ranks still running: \[1\]",
        msg,
    ), msg
    assert "ranks that returned normally: [0]" in msg
    assert "time.sleep" in msg or "_sleep_on_rank_1" in msg  # stack dump of rank 1
    assert dist.run(2, _add_rank, 1) == [1, 2]


def test_dead_worker_is_detected(dist):
    with pytest.raises(DistributedTestError) as excinfo:
        dist.run(2, _exit_on_rank_1, timeout=30)
    msg = str(excinfo.value)
    assert excinfo.value.kind == "died"
    assert "tests.test_harness._exit_on_rank_1" in msg
    assert "worker rank(s) [1] died" in msg and "exit code 7" in msg
    assert excinfo.value.dead == {1: 7}
    assert dist.run(2, _add_rank, 0) == [0, 1]


def test_run_expect_error_every_rank(dist):
    pids = dist.pool(4).pids
    msgs = dist.run_expect_error(4, _raise_value_error_everywhere, "m1", match=r"invalid mesh m1", exc_type=ValueError)
    assert msgs == [f"invalid mesh m1 (rank {r})" for r in range(4)]
    # Unpicklable exceptions travel as text.
    msgs = dist.run_expect_error(4, _raise_unpicklable_everywhere, match="bad placement", exc_type=Exception)
    assert msgs == [f"bad placement on rank {r}" for r in range(4)]
    # A consistent error on every rank keeps the pool.
    assert dist.pool(4).pids == pids


def test_run_expect_error_failures(dist):
    with pytest.raises(DistributedTestError, match=r"did not match the message of rank\(s\) \[0, 1\]"):
        dist.run_expect_error(2, _raise_value_error_everywhere, "m2", match="something else")
    with pytest.raises(DistributedTestError, match=r"expected TypeError on every rank, got rank 0: ValueError"):
        dist.run_expect_error(2, _raise_value_error_everywhere, "m3", exc_type=TypeError)
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[0\] returned normally") as excinfo:
        dist.run_expect_error(2, _raise_on_rank_1, match="boom")
    assert "boom from rank 1" in str(excinfo.value)
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[0, 1\] returned normally"):
        dist.run_expect_error(2, _add_rank, 0)


def test_unpicklable_function_or_result(dist):
    pids = dist.pool(2).pids
    with pytest.raises(TypeError, match="module-level function"):
        dist.run(2, lambda: 1)
    assert dist.pool(2).pids == pids  # parent-side rejection leaves the pool alone
    with pytest.raises(DistributedTestError, match="is not picklable"):
        dist.run(2, _return_unpicklable)


def test_world_size_eight(dist):
    out = dist.run(8, _all_gather_ranks)
    assert out == [list(range(8))] * 8


def test_invalid_world_size(dist):
    with pytest.raises(ValueError):
        dist.run(0, _add_rank, 0)
    with pytest.raises(ValueError):
        dist.run(harness.MAX_WORLD_SIZE + 1, _add_rank, 0)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=st.integers(-1000, 1000))
def test_works_under_hypothesis(dist, x):
    assert dist.run(2, _add_rank, x) == [x, x + 1]


def test_timeout_env_override(monkeypatch):
    monkeypatch.delenv(harness.TIMEOUT_ENV, raising=False)
    assert harness.resolve_timeout(None) == harness.DEFAULT_TIMEOUT
    monkeypatch.setenv(harness.TIMEOUT_ENV, "12.5")
    assert harness.resolve_timeout(None) == 12.5
    assert harness.resolve_timeout(3) == 3.0  # an explicit timeout wins
    monkeypatch.setenv(harness.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError):
        harness.resolve_timeout(None)


def test_per_task_overhead_is_small(dist):
    dist.run(4, _add_rank, 0)
    n = 50
    start = time.perf_counter()
    for _ in range(n):
        dist.run(4, _add_rank, 0)
    per_task = (time.perf_counter() - start) / n
    assert per_task < 0.05, per_task
