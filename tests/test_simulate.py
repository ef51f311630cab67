"""--simulate against real runs: bytes per mesh axis equal, peak memory within 1% (debug config, 4
ranks: FSDP, TP, FSDP+TP, HSDP, pipeline (1F1B, GPipe) with FSDP, context parallel with FSDP; 8
ranks for the three-axis layouts only: HSDP+TP and the pipelined and context-parallel FSDP+TP jobs).

The real side runs the trainer's own loop (``trainer.train``, two steps, the second measured with
CommDebugMode and the live-storage tracker as ``--metrics-file`` measures it) on the gloo pools;
the simulated side runs ``shardwise.simulate.simulate_job`` in the test process (no workers) for
the same job. Not the parity job's runs (tests/helpers.py, tiny config): at 1% a peak check needs
activations that are a small part of the peak. At tiny one activation is 1-2% of a rank's peak
(16,384 B on GPipe's stage 0, 1.16%, which the simulation does not predict: an open gap); at the
debug config 0.3-0.6%.
"""

from __future__ import annotations

import pytest

from shardwise.core.placement import Replicate, Shard
from shardwise.simulate.symmetry import ParamLayout, rank_classes
from tests.helpers import layout_id, train_run

JOB = ["--config", "debug", "--steps", "2", "--global-batch", "4", "--seq-len", "64", "--warmup", "1",
       "--device", "cpu"]
LAYOUTS = [
    (4, ["--dp-shard", "4"]),
    (4, ["--tp", "4"]),
    (4, ["--tp", "2", "--dp-shard", "2"]),
    (4, ["--dp-replicate", "2", "--dp-shard", "2"]),
    (4, ["--pp", "2", "--dp-shard", "2"]),  # the pipeline's sends are counted on the pp axis
    (4, ["--pp", "2", "--dp-shard", "2", "--pp-schedule", "gpipe"]),
    (4, ["--cp", "2", "--dp-shard", "2"]),
    (8, ["--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"]),
    (8, ["--pp", "2", "--dp-shard", "2", "--tp", "2"]),
    (8, ["--cp", "2", "--dp-shard", "2", "--tp", "2"]),
]


@pytest.mark.e2e
@pytest.mark.parametrize("nproc,flags", LAYOUTS, ids=layout_id)
def test_simulate_matches_the_real_run(dist, nproc, flags):
    argv = JOB + ["--nproc", str(nproc), *flags]
    per_rank = dist.run(nproc, train_run, argv, True, timeout=300)  # measured
    _compare(per_rank[0]["per_rank"], argv)


EP_JOB = ["--family", "moe", "--config", "debug_moe", "--nproc", "4", "--ep", "2", "--dp-shard", "4"]


def _train_recording_routing(argv: list[str]) -> dict:
    """On every rank: ``train_run`` measured, with this rank's dispatch counts in call order."""
    from shardwise.parallel.expert_parallel.dispatch import recorded_routing

    with recorded_routing() as exchanges:
        run = train_run(argv, True)
    return {**run, "exchanges": exchanges}


@pytest.mark.e2e
def test_simulate_matches_a_real_expert_parallel_run(dist):
    """Expert parallelism: the token exchange's bytes follow the routing, which a meta step cannot
    see. Fed each rank's real counts (``replayed_routing``), the simulation matches the real run
    as the dense layouts do: every axis's bytes exact, peak within 1%. Under its own assumption
    (balanced routing) it matches every figure but the exchange: the bytes of every axis but ep,
    every collective count per axis and kind, the state exact; the peak within 1% (0.75% on rank
    3, whose real routing differs most from balanced)."""
    from shardwise.parallel.expert_parallel.dispatch import replayed_routing
    from shardwise.simulate import simulate_job
    from shardwise.simulate.run import simulate_rank
    from shardwise.train import cli

    argv = JOB + EP_JOB
    runs = dist.run(4, _train_recording_routing, argv, timeout=300)
    real, job = runs[0]["per_rank"], cli.job_from_argv(argv)
    assert all(run["exchanges"] for run in runs)  # every rank dispatched, each step and layer
    replayed = []
    for rank, run in enumerate(runs):
        with replayed_routing(run["exchanges"]):
            replayed.append(simulate_rank(job, rank)[0])
    _compare_ranks(replayed, real, job.layout())
    for sim, measured in zip(simulate_job(job).per_rank, real):
        assumed = {k: v for k, v in sim.comm_bytes_by_axis.items() if k != "ep"}
        assert assumed == {k: v for k, v in measured["comm_bytes_by_axis"].items() if k != "ep"}
        assert sim.collectives_by_axis == measured["collectives_by_axis"]
        _compare_state_and_peak(sim, measured, job.layout())


def _compare(real: list[dict], argv: list[str]) -> None:
    """Each rank's simulated figures against the real run's: bytes, counts and state exact, peak within 1%.

    1%, because 5% once hid a real gap on the last pipeline stage (1.45% at the debug config, 11%
    at tiny4: torch's schedule kept every microbatch's logits to return them, unused, and the
    simulation dropped a stage's output before its backward, which torch's stages keep; 0.72%
    each). A real run could also hold a buffer more (131,072 B on fsdp_tp, 262,144 B on tp 4: 1.2%)
    at random, for two reasons now handled: gloo's worker thread released a finished collective's
    tensors just after waking the caller (measurements wait for that release:
    ``comm.awaiting_release``, tested below), and a step that missed the dispatcher's bounded cache
    (full of earlier tests' entries) counted the meta tensors it decided layouts with (no longer
    counted: ``dispatch.dispatcher.deciding``).
    """
    from shardwise.simulate import simulate_job
    from shardwise.train import cli

    job = cli.job_from_argv(argv)
    _compare_ranks(simulate_job(job).per_rank, real, job.layout())


def _compare_ranks(simulated: list, real: list[dict], name: str) -> None:
    assert [m.rank for m in simulated] == list(range(len(real)))
    for sim, measured in zip(simulated, real):
        assert sim.comm_bytes_per_step == measured["comm_bytes_per_step"] > 0, name
        assert sim.comm_bytes_by_axis == measured["comm_bytes_by_axis"], name
        assert sim.collectives_per_step == measured["collectives_per_step"], name
        _compare_state_and_peak(sim, measured, name)


def _compare_state_and_peak(sim, measured: dict, name: str) -> None:
    """Parameter, gradient and optimizer bytes exact; peak memory within 1%."""
    assert (sim.param_bytes, sim.grad_bytes, sim.optimizer_bytes) == (
        measured["param_bytes"], measured["grad_bytes"], measured["optimizer_bytes"]), name
    assert abs(sim.peak_memory_bytes - measured["peak_memory_bytes"]) <= 0.01 * measured["peak_memory_bytes"], (
        name, sim.rank, sim.peak_memory_bytes, measured["peak_memory_bytes"])


def test_rank_classes_split_uneven_shards_only():
    even = [ParamLayout((8, 4), (Shard(0),), ((0,),))]
    assert rank_classes((4,), ("dp_shard",), even) == [[0, 1, 2, 3]]
    uneven = [ParamLayout((10, 4), (Shard(0),), ((0,),))]  # rows 3, 3, 3, 1
    assert rank_classes((4,), ("dp_shard",), uneven) == [[0, 1, 2], [3]]
    # a 2-D (dp_shard, tp) world: the tp-sharded dim 7 -> 4, 3; dp_shard replicates it
    tp_only = [ParamLayout((7, 2), (Replicate(), Shard(0)), ((0,), (1,)))]
    assert rank_classes((2, 2), ("dp_shard", "tp"), tp_only) == [[0, 2], [1, 3]]
    # a pipeline axis always separates ranks
    assert rank_classes((2, 2), ("pp", "dp_shard"), even[:0]) == [[0, 1], [2, 3]]


def test_simulated_world_refuses_a_bad_rank():
    from shardwise.simulate import simulated_world

    with pytest.raises(ValueError, match="rank 4"):
        with simulated_world(4, 4):
            pass


@pytest.mark.e2e
def test_simulate_cli_writes_per_rank_metrics(tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "sim.json"
    run = subprocess.run([sys.executable, "-m", "shardwise.train", "--simulate", "--nproc", "4", "--dp-shard", "2",
                          "--tp", "2", "--config", "tiny", "--device", "cpu", "--metrics-file", str(out)],
                         capture_output=True, text=True, timeout=240, env=os.environ)
    assert run.returncode == 0, run.stderr
    assert "0-3" in run.stdout and "dp_shard" in run.stdout and "tp" in run.stdout
    per_rank = json.loads(out.read_text())["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1, 2, 3]
    assert all(r["comm_bytes_per_step"] > 0 and r["peak_memory_bytes"] > r["param_bytes"] > 0 for r in per_rank)
    assert set(per_rank[0]["comm_bytes_by_axis"]) == {"dp_shard", "tp"}


def test_pipeline_schedule_order_in_flight():
    from shardwise.simulate.pipeline import schedule_order

    def in_flight(order):  # most forwards awaiting their backward at once
        live, peak = 0, 0
        for action, _ in order:
            live += 1 if action == "F" else -1
            peak = max(peak, live)
        return peak

    for schedule in ("gpipe", "1f1b"):
        for pp, stage, m in ((2, 0, 2), (2, 1, 2), (4, 1, 8), (4, 3, 8)):
            order = schedule_order(schedule, m, pp, stage)
            assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
            assert in_flight(order) == (m if schedule == "gpipe" else min(m, pp - stage)), (schedule, pp, stage)
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        schedule_order("interleaved_1f1b", 4, 2, 0)
    from shardwise.simulate import simulate_job
    from shardwise.train.config import ConfigError, JobConfig

    with pytest.raises(ConfigError, match="--pp-schedule interleaved_1f1b"):  # refused before any rank is played
        simulate_job(JobConfig(config="debug", nproc=4, pp=2, dp_shard=2, pp_schedule="interleaved_1f1b"))


def test_simulate_runs_sequence_parallel_whose_input_check_needs_data():
    """SequenceParallel checks its plain inputs' data on the first call; on meta tensors it
    issues the same all_gather and judges nothing (it used to call ``.item()`` on meta)."""
    from shardwise.simulate import simulate_job
    from shardwise.train import cli

    job = cli.job_from_argv(["--config", "tiny", "--nproc", "4", "--tp", "4", "--sequence-parallel",
                             "--global-batch", "4", "--seq-len", "32", "--device", "cpu"])
    report = simulate_job(job)
    assert [m.rank for m in report.per_rank] == [0, 1, 2, 3]
    assert all(m.comm_bytes_by_axis.get("tp", 0) > 0 for m in report.per_rank)


def _references_after_all_gather(awaiting: bool, calls: int = 200) -> int:
    """How many of ``calls`` all_gathers returned while gloo still referenced their buffers."""
    import torch

    import shardwise
    from shardwise import comm

    mesh = shardwise.init_device_mesh("cpu", (4,))
    use_count = torch._C._storage_Use_Count
    held = 0
    for _ in range(calls):
        rows = torch.randn(4, 64, 256)
        with comm.awaiting_release() if awaiting else _nothing():
            out = comm.all_gather(rows, mesh, 0, 0, [4] * 4)
        storages = (rows.untyped_storage(), out.untyped_storage())
        held += any(use_count(s._cdata) > 2 for s in storages)  # the tensor and this wrapper
        del rows, out, storages
    return held


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_measured_collectives_return_after_gloo_released_their_buffers(dist):
    """Why a real step's peak could exceed the simulated one by a buffer at random: gloo's worker
    thread releases a finished collective's tensors just after waking the caller. Inside
    ``comm.awaiting_release`` (which ``MemoryTracker`` enters) no buffer is still held."""
    assert dist.run(4, _references_after_all_gather, True) == [0, 0, 0, 0]
