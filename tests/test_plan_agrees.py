"""shardwise.plan ranks layouts by the figures ``--simulate`` prints (docs/plan.md).

The simulated peak must first be a property of the job, not of when Python collects garbage:
the instruments measuring a step (``CommDebugMode``'s module tracker) must not keep an
activation-checkpoint recompute's tensors alive in reference cycles (unit). Then the plan, run
in this process, against ``--simulate``'s parsing and simulation of each command it prints (e2e).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import re
import shlex

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from shardwise.debug import CommDebugMode
from shardwise.simulate import MemoryTracker


def _checkpointed_steps_peak(measured_comms: bool) -> int:
    """Peak live bytes of three checkpointed forward/backward steps, garbage collection off."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.SiLU(), nn.Linear(256, 64))
    x = torch.randn(32, 64, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        with CommDebugMode() if measured_comms else contextlib.nullcontext(), MemoryTracker() as mem:
            for _ in range(3):
                torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
        return mem.peak_bytes
    finally:
        gc.enable()


def test_measuring_a_checkpointed_step_keeps_no_recomputed_activation_alive():
    """Hooks on a recompute's outputs would hold them in cycles: each step adds its recomputed
    activations to the peak until a full collection (which gc.disable() withholds here)."""
    assert _checkpointed_steps_peak(measured_comms=True) == _checkpointed_steps_peak(measured_comms=False)


# ---------------------------------------------------------------------- the plan against --simulate
PLAN_LINE = re.compile(r"^(\d+)\. step ([\d.]+) s .*; peak ([\d.]+) GiB/GPU$")
ADVICE_LINE = re.compile(r"fits with .*: peak ([\d.]+) GiB/GPU \(simulated at full depth\), step ([\d.]+) s$")


def _plan(argv: list[str]) -> tuple[int, list[str]]:
    """``python -m shardwise.plan`` in this process: its exit status and printed lines."""
    from shardwise.plan.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    return status, out.getvalue().splitlines()


def _simulated(command: str, hw_name: str) -> tuple[float, float]:
    """(peak GiB, step seconds) of ``command`` as ``--simulate`` runs it: the trainer's own flag
    parsing, its simulation, the busiest rank's peak; the step priced by the cost model."""
    from shardwise.cost import load_hardware
    from shardwise.plan.search import Candidate, LayoutCost, price
    from shardwise.simulate import simulate_job
    from shardwise.train.cli import job_from_argv

    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "shardwise.train"], command
    job = job_from_argv([*argv[3:], "--simulate"])
    worst = max(simulate_job(job).per_rank, key=lambda m: m.peak_memory_bytes)
    family, args = job.model_family(), job.model_args()
    flops = family.flops_per_token(args, job.seq_len) * job.global_batch * job.seq_len
    cand = Candidate(job.dp_replicate, job.dp_shard, job.cp, job.tp, job.pp, job.ep)
    cost = LayoutCost(worst.peak_memory_bytes, worst.comm_bytes_by_axis, worst.collectives_by_axis)
    return worst.peak_memory_bytes / 2**30, price(cand, cost, load_hardware(hw_name), 8, flops, job.nproc).step_s


def _ranked(lines: list[str]) -> list[tuple[float, float, str]]:
    """(step s, peak GiB, command) of each ranked layout, in the plan's order."""
    out = []
    for i, line in enumerate(lines):
        m = PLAN_LINE.match(line)
        if m:
            assert int(m.group(1)) == len(out) + 1, lines
            out.append((float(m.group(2)), float(m.group(3)), lines[i + 1].strip()))
    return out


CASES = [  # (world, flags, layouts checked): 8 and 64 ranks, activation checkpointing and mixed precision on and off
    (8, [], 1),  # nothing fits: the suggested change is checked
    (8, ["--activation-checkpointing"], 2),
    (64, ["--mixed-precision"], 1),  # only FSDP 64 fits (69.56 GiB) of the 4 layouts without replicas
    (64, ["--activation-checkpointing", "--mixed-precision"], 2),
]


@pytest.fixture
def one_simulation_per_job(monkeypatch):
    """``simulate_job`` simulates each job once in this test: the plan's full-depth simulation of
    a layout and ``--simulate``'s of its printed command are one if, and only if, the command
    describes the very job the plan simulated (``JobConfig`` equal but for the device and the
    ``--simulate`` switch, which do not change a simulation). A command that differs in any
    other way (a flag left out) is simulated on its own. That the simulation of one job gives
    one figure is the first test's business."""
    import shardwise.simulate as simulate

    real, done = simulate.simulate_job, {}

    def once(job):
        key = dataclasses.replace(job, device="cpu", simulate=False)
        if key not in done:
            done[key] = real(job)
        return done[key]

    monkeypatch.setattr(simulate, "simulate_job", once)
    return done


# e2e: each case plays whole llama3_8b jobs (every rank's step, 32 blocks, twice) in this
# process: 3.7-9.1 CPU-seconds a case, 23 in all (2-core machine, load 8-12), too much for the
# developer tier.
@pytest.mark.e2e
@pytest.mark.parametrize("world,flags,checked", CASES, ids=[f"{w}-{'+'.join(f) or 'plain'}" for w, f, _ in CASES])
def test_plan_peaks_and_ranking_are_what_simulate_prints(world, flags, checked, one_simulation_per_job):
    """llama3_8b shapes: each layout the plan ranks (or, when none fits, the change it suggests)
    is simulated as ``--simulate`` simulates its printed command; every planned peak is within
    2% of the simulated one (the same simulation: equal to the printed 0.01 GiB), every printed
    step time is the cost model's on the simulated figures, and the plan's order is theirs."""
    status, lines = _plan(["--config", "llama3_8b", "--nproc", str(world), "--max-replicate", "1", "--top", "2",
                           "--hardware", "h100-80gb", *flags])
    ranked = _ranked(lines)
    if status == 1:  # nothing fits: the suggested command is checked instead
        assert not ranked, lines
        advice = [(i, ADVICE_LINE.search(line)) for i, line in enumerate(lines) if ADVICE_LINE.search(line)]
        assert len(advice) == 1, lines
        i, m = advice[0]
        ranked = [(float(m.group(2)), float(m.group(1)), lines[i + 1].strip())]
    assert status in (0, 1) and len(ranked) == checked, lines
    truth = [_simulated(command, "h100-80gb") for _, _, command in ranked]
    for (step, peak, command), (true_peak, true_step) in zip(ranked, truth):
        assert abs(peak - true_peak) <= min(0.02 * true_peak, 0.005 + 1e-9), (command, peak, true_peak)
        assert true_peak <= 80 and step == pytest.approx(true_step, abs=0.005), (command, step, true_step)
    assert truth == sorted(truth, key=lambda t: (t[1], t[0])), (ranked, truth)
