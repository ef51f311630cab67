"""Simulate a training job's step on every rank, in this one process (``--simulate``).

For each group of interchangeable ranks (``symmetry.rank_classes``) one member is simulated:
this process becomes that rank of the job's world (``simulated_world``), builds the model on
the meta device and parallelizes it exactly as the trainer does (``trainer.build_model``), and
runs the trainer's own step (``trainer.train_step``) twice on meta tensors of the batch's shape:
the first creates the optimizer state, the second, in steady state, is measured
(``measure.measure_step``: bytes per mesh axis from shardwise's collectives, peak live tensor
bytes). A real run with ``--metrics-file`` measures its second step with the same instruments.
With ``--pp`` the stages are built as the trainer builds them (``trainer.build_pipeline``) and
run by ``pipeline.SimulatedPipeline`` instead of torch's schedule (which cannot run on a
simulated group).

Assumptions, where a real step's behaviour depends on values: every embedding row lookup may
fall in any rank's block (meta tensors have no indices; boolean masks keep every element, an
upper bound on a transient of the vocabulary-parallel embedding's backward), every rank
produces a gradient for every parameter it uses, and mixture-of-experts routing (which tokens
reach which expert) is balanced, or, with ``--simulate-expert-imbalance F``, every rank sends
expert 0 F times the mean rows (``expert_parallel.dispatch.assumed_exchange``): ep rank 0,
which holds that expert, receives the most, and its figures stand for its ep peers (an upper
bound for them). Mixed precision without FSDP (torch.autocast,
which does not act on meta tensors) is simulated in fp32: an upper bound.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from shardwise.parallel.expert_parallel.dispatch import assumed_routing
from shardwise.simulate.measure import StepMeasurement, measure_step
from shardwise.simulate.process_group import simulated_world
from shardwise.simulate.symmetry import layouts_of, rank_classes

__all__ = ["SimulationReport", "simulate_job", "simulate_rank"]


@dataclass
class SimulationReport:
    """Per-rank figures of one simulated step, and how they were obtained."""

    per_rank: list[StepMeasurement]
    classes: list[list[int]]  # ranks that behave alike; the first of each was simulated
    axes: list[tuple[str, int]]  # the world mesh's axes
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"simulated": True, "per_rank": [m.as_dict() for m in self.per_rank],
                "simulated_ranks": [c[0] for c in self.classes], "mesh_axes": [list(a) for a in self.axes],
                "seconds": self.seconds}


@contextlib.contextmanager
def _on_meta() -> Iterator[None]:
    """Let the step run on meta parameters: fully_shard/replicate forward, data-dependent masks."""
    import torch.fx.experimental._config as fx_config

    from shardwise.core.meta_step import META_STEP

    token = META_STEP.set(True)
    before = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_sdpa(sdpa)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        fx_config.meta_nonzero_assume_all_nonzero = before
        META_STEP.reset(token)


def _fused_sdpa(fallback):
    """``F.scaled_dot_product_attention`` choosing the fused kernel a CPU tensor gets.

    torch picks the kernel by device: meta tensors would get the unfused math version, which
    keeps the whole attention matrix; a real run (CPU here, CUDA's flash kernel alike) keeps
    only the output and the log-sum-exp of each row.
    """
    kernel = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if kernel is None or kwargs or query.device.type != "meta" or key.shape[-3] != query.shape[-3]:
            return fallback(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, **kwargs)
        return kernel.default(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    return sdpa


def simulate_rank(job, rank: int) -> tuple[StepMeasurement, list]:
    """Simulate ``job``'s steady-state step as ``rank``; return its measurement and the model's
    parameter layouts (to group the other ranks by)."""
    from shardwise.core.mesh import DeviceMesh
    from shardwise.train.metrics import state_bytes
    from shardwise.simulate.pipeline import SimulatedPipeline, boundary_meta
    from shardwise.train.trainer import Runtime, build_model, build_optimizer, build_pipeline, loss_fn, train_step
    from shardwise.tensor import random as sw_random

    with simulated_world(rank, job.nproc), assumed_routing(job.simulate_expert_imbalance):
        dims = job.parallel_dims()
        world_mesh = dims.build_mesh("cpu")
        flat = DeviceMesh("cpu", list(range(job.nproc)), mesh_dim_names=("world",))
        # The runtime's device is the job's kind (autocast needs one); the blocks stay on meta.
        runtime = Runtime(torch.device("cpu"), rank, job.nproc, dims, world_mesh, flat)
        sw_random.manual_seed(job.seed)
        runner = None
        if runtime.pp_mesh is not None:
            model, real_runner, _ = build_pipeline(job, runtime, materialize=False)
            runner = SimulatedPipeline([s.submod for s in real_runner.stages], real_runner.indices,
                                       real_runner.num_stages, runtime.pp_mesh, job.pp_schedule, job.microbatches,
                                       loss_fn, lambda rows: boundary_meta(job, dims, rows))
        else:
            model = build_model(job, runtime, materialize=False)
        optimizer = build_optimizer(job, model)
        shape = (job.global_batch // dims.dp_degree, job.seq_len)
        kept: list[StepMeasurement] = []
        held = {}
        for index in range(2):  # the first creates the optimizer state; the second is measured
            # one storage of seq_len + 1 tokens per row, inputs and labels views of it (as ``data.batch_at``)
            tokens = torch.empty((shape[0], shape[1] + 1), dtype=torch.int64, device="meta")
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            region = (measure_step(rank, runtime.device, model, optimizer, (inputs, labels),
                                   lambda: held["state"], kept.append)
                      if index == 1 else contextlib.nullcontext())
            with region, _on_meta():
                train_step(job, runtime, model, optimizer, inputs, labels, runner)
                held["state"] = state_bytes(model, optimizer)
                optimizer.zero_grad(set_to_none=True)
        layouts = layouts_of(model.parameters(), world_mesh)
        return kept[0], layouts


def simulate_job(job) -> SimulationReport:
    """Simulate one step of ``job`` (a validated ``JobConfig``) on each distinct rank.

    Raises:
        ConfigError: a pipeline schedule the simulation does not run (``SIMULATED_SCHEDULES``).
    """
    from shardwise.simulate.pipeline import SIMULATED_SCHEDULES
    from shardwise.train.config import ConfigError

    if job.pp > 1 and job.pp_schedule not in SIMULATED_SCHEDULES:
        raise ConfigError(f"--simulate does not simulate --pp-schedule {job.pp_schedule} yet; it simulates "
                          f"{', '.join(SIMULATED_SCHEDULES)}")
    started = time.perf_counter()
    dims = job.parallel_dims()
    axes = dims.mesh_axes()
    first, layouts = simulate_rank(job, 0)
    classes = rank_classes([n for _, n in axes], [a for a, _ in axes], layouts)
    by_rank: dict[int, StepMeasurement] = {0: first}
    for members in classes:
        if members[0] not in by_rank:
            by_rank[members[0]], _ = simulate_rank(job, members[0])
    per_rank = []
    for members in classes:
        source = by_rank[members[0]]
        for r in members:
            m = StepMeasurement(**{**source.__dict__, "rank": r, "simulated_as": members[0]})
            m.comm_bytes_by_axis = dict(source.comm_bytes_by_axis)
            per_rank.append(m)
    per_rank.sort(key=lambda m: m.rank)
    return SimulationReport(per_rank, classes, axes, time.perf_counter() - started)
