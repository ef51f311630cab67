"""--simulate against real runs: bytes per mesh axis equal, peak memory within 1% (debug config, 4 ranks;
FSDP, TP, FSDP+TP, HSDP, pipeline (1F1B, GPipe) with FSDP, context parallel with FSDP).

The real side runs the trainer's own loop (``trainer.train``, two steps, the second measured
with CommDebugMode and the live-storage tracker) on 4 gloo ranks; the simulated side runs
``shardwise.simulate.simulate_job`` in the test process (no workers) for the same job.
"""

from __future__ import annotations

import pytest

from shardwise.simulate.symmetry import ParamLayout, rank_classes
from shardwise.core.placement import Replicate, Shard

LAYOUTS = {
    "fsdp": dict(dp_shard=4),
    "tp": dict(tp=4),
    "fsdp_tp": dict(dp_shard=2, tp=2),
    "hsdp": dict(dp_replicate=2, dp_shard=2),
    "pp_1f1b": dict(pp=2, dp_shard=2),  # the pipeline's sends are counted on the pp axis
    "pp_gpipe": dict(pp=2, dp_shard=2, pp_schedule="gpipe"),
    "cp": dict(cp=2, dp_shard=2),
}
JOB = dict(config="debug", nproc=4, steps=2, global_batch=4, seq_len=64, device="cpu", warmup=1)


# 8 ranks: FSDP, FSDP+TP, HSDP+TP, and the 4-D layouts (every axis of a pipelined or
# context-parallel FSDP+TP job at once).
LAYOUTS_8 = {
    "fsdp": dict(dp_shard=8),
    "tp_fsdp": dict(dp_shard=4, tp=2),
    "hsdp_tp": dict(dp_replicate=2, dp_shard=2, tp=2),
    "pp_fsdp_tp": dict(pp=2, dp_shard=2, tp=2),
    "cp_fsdp_tp": dict(cp=2, dp_shard=2, tp=2),
}


def _real(layouts: dict, base: dict = JOB) -> dict:
    import torch
    import torch.distributed as dist

    from shardwise.core.mesh import DeviceMesh
    from shardwise.train.config import JobConfig
    from shardwise.train.trainer import Runtime, train

    torch.set_num_threads(1)
    out = {}
    flat = DeviceMesh("cpu", list(range(dist.get_world_size())), mesh_dim_names=("world",))
    for name, degrees in layouts.items():
        job = JobConfig(**base, **degrees, metrics_file="unused.json")
        dims = job.parallel_dims()
        runtime = Runtime(torch.device("cpu"), dist.get_rank(), dist.get_world_size(), dims, dims.build_mesh("cpu"), flat)
        out[name] = train(job, runtime).per_rank
    return out


def test_simulate_matches_real_runs(dist):
    _compare(dist.run(4, _real, LAYOUTS, timeout=300)[0], LAYOUTS, JOB)


def test_simulate_matches_real_runs_on_eight_ranks(dist):
    job = dict(JOB, nproc=8, global_batch=8)
    _compare(dist.run(8, _real, LAYOUTS_8, job, timeout=300)[0], LAYOUTS_8, job)


def _compare(real: dict, layouts: dict, job: dict) -> None:
    """Each rank's simulated figures against the real run's: bytes, counts and state exact, peak within 1%.

    1%, because 5% once hid a real gap on the last pipeline stage (1.45% at the debug config, 11%
    at tiny4: torch's schedule kept every microbatch's logits to return them, unused, and the
    simulation dropped a stage's output before its backward, which torch's stages keep; 0.72%
    each). Simulated and real peaks now agree to 4 bytes in most runs, but a real run can hold
    one activation more (131,072 B, 0.6%, seen once on fsdp_tp under the full suite). Not
    traced; Python's garbage collector plays no part (same peaks with it off or collecting
    constantly), so probably a tensor that gloo's background work holds until it finishes.
    """
    from shardwise.simulate import simulate_job
    from shardwise.train.config import JobConfig

    for name, degrees in layouts.items():
        simulated = simulate_job(JobConfig(**job, **degrees)).per_rank
        assert [m.rank for m in simulated] == list(range(job["nproc"]))
        for sim, measured in zip(simulated, real[name]):
            assert sim.comm_bytes_per_step == measured["comm_bytes_per_step"] > 0, name
            assert sim.comm_bytes_by_axis == measured["comm_bytes_by_axis"], name
            assert sim.collectives_per_step == measured["collectives_per_step"], name
            assert (sim.param_bytes, sim.grad_bytes, sim.optimizer_bytes) == (
                measured["param_bytes"], measured["grad_bytes"], measured["optimizer_bytes"]), name
            assert abs(sim.peak_memory_bytes - measured["peak_memory_bytes"]) <= 0.01 * measured["peak_memory_bytes"], (
                name, sim.peak_memory_bytes, measured["peak_memory_bytes"])


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
        simulate_job(JobConfig(**JOB, pp=2, dp_shard=2, pp_schedule="interleaved_1f1b"))
