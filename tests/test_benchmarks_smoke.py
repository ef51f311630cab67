"""Smoke tests of the benchmark scripts: they run, finish, and report their summaries.

Each script starts its own local gloo processes, so it runs as a subprocess. op_coverage's quick
subset is also a correctness gate: shardwise must give no wrong result and no rank desync on it,
and fully pass at least as many of its ops as torch's DTensor does in the same run. train_step's
context-parallel modes take over 10 s even quick, so only their flag checks run here (no process);
of its MoE modes one runs (ep_tp: experts over ep and tp, sequence parallel, the MoE layer's TP
boundary, FSDP), one timed step per library, and its agreement with torch and with one process
is checked.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240


def _run(script: str, *args: str) -> str:
    env = dict(os.environ)
    env.pop("RANK", None)  # never mistaken for a worker of an enclosing launcher
    env.pop("LOCAL_RANK", None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{out[-6000:]}"
    return proc.stdout


def _result(out: str, lib: str) -> dict[str, int]:
    line = re.search(rf"^RESULT {lib}: (.*)$", out, re.M)
    assert line, f"no RESULT line for {lib}:\n{out[-4000:]}"
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line.group(1))}


def _names(out: str, lib: str, kind: str) -> str:
    line = re.search(rf"^  {lib} {kind} ops \(\d+\): (.*)$", out, re.M)
    return line.group(1) if line else "?"


@pytest.mark.e2e
def test_op_coverage_quick_has_no_wrong_or_desynced_shardwise_op():
    pytest.importorskip("numpy", reason="torch's OpInfo database imports numpy")
    out = _run("op_coverage.py", "--quick")
    sw, torch_ = _result(out, "shardwise"), _result(out, "torch")
    assert sw["ops_tried"] >= 30 and torch_["ops_tried"] == sw["ops_tried"], (sw, torch_)
    assert sw["cases_pass"] > 0
    assert sw["cases_wrong"] == 0, f"shardwise wrong on: {_names(out, 'shardwise', 'wrong')}\n{out[-6000:]}"
    assert sw["cases_desync"] == 0 and sw["desync_ops"] == 0, f"shardwise desynced on: {_names(out, 'shardwise', 'desync')}\n{out[-6000:]}"
    assert sw["crash_ops"] == 0, f"shardwise crashed a rank on: {_names(out, 'shardwise', 'crash')}\n{out[-6000:]}"
    # The common ops: shardwise runs at least every one torch's DTensor runs in the same run.
    assert sw["ops_passing"] >= torch_["ops_passing"], (
        f"shardwise fully passes {sw['ops_passing']} ops, torch {torch_['ops_passing']}; shardwise errors on: "
        f"{_names(out, 'shardwise', 'error-only')}")


@pytest.mark.e2e
def test_dispatch_overhead_quick_reports_medians():
    """Worlds 1 and 2: the launched multi-rank path with two ranks fewer than the script's
    default 4 (each imports torch and torch.distributed.tensor: seconds of CPU for no new check)."""
    out = _run("dispatch_overhead.py", "--quick", "--worlds", "1,2")
    for world in (1, 2):
        line = re.search(rf"^world {world}: median overhead over (\d+)/(\d+) ops: torch ([\d.]+) µs, "
                         rf"shardwise ([\d.]+) µs, ratio of medians shardwise/torch ([\d.]+)", out, re.M)
        assert line, f"no summary for world {world}:\n{out[-4000:]}"
        assert int(line.group(1)) > 0
    assert "=== summary" in out


def test_train_step_cp_modes_are_known_and_check_the_sequence_split(monkeypatch, capsys):
    from shardwise.parallel import ParallelDims

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    train_step = importlib.import_module("train_step")
    args = train_step.parse_args(["--quick", "--modes", "cp,cp_fsdp"])
    assert args.modes == ["cp", "cp_fsdp"]
    for mode in args.modes:  # the layouts the trainer's --cp runs: FSDP over dp_shard_cp
        dims = ParallelDims(world_size=train_step.NPROC, **train_step.MODES[mode][0])
        assert dims.cp_enabled and dims.fsdp_enabled and "dp_shard_cp" in dims.flattened_axes()
    with pytest.raises(SystemExit):  # the largest cp (4) needs 2 x 4 sequence chunks
        train_step.parse_args(["--modes", "cp_fsdp,cp", "--seq-len", "36"])
    assert "--seq-len 36 must divide into 2 x cp = 8 chunks" in capsys.readouterr().err
    train_step.parse_args(["--modes", "cp_fsdp", "--seq-len", "36"])  # cp=2: 4 chunks of 9


def _train_step_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("train_step")


def test_train_step_tensor_peak_measure_is_exact_on_a_known_pattern(monkeypatch):
    train_step = _train_step_module(monkeypatch)
    train_step.tensor_peak_self_check()  # raises, naming both figures, when the measure is off
    import torch

    with train_step.TensorPeak() as peak:
        kept = torch.empty(3 << 20, dtype=torch.uint8)
    assert peak.peak == 3 << 20 and kept.numel() == 3 << 20


def test_train_step_moe_modes_check_their_config(monkeypatch, capsys):
    train_step = _train_step_module(monkeypatch)
    args = train_step.parse_args(["--quick", "--modes", "ep,ep_tp"])
    assert args.moe_config == "tiny_moe" and args.config == "tiny"
    assert train_step.parse_args(["--modes", "ep"]).moe_config == "debug_moe"
    with pytest.raises(SystemExit):
        train_step.parse_args(["--modes", "ep", "--moe-config", "tiny"])
    assert "unknown --moe-config 'tiny'" in capsys.readouterr().err


@pytest.mark.e2e
def test_train_step_quick_moe_mode_agrees_with_torch_and_one_process():
    out = _run("train_step.py", "--quick", "--modes", "ep_tp", "--reps", "1", "--warmup", "1")
    line = re.search(r"^ep_tp .*$", out, re.M)
    assert line, f"no ep_tp row:\n{out[-4000:]}"
    columns = line.group(0).split()  # mode, 2 times, ratio, 2 tokens/s, 4 memory lists, then the agreement
    agreement = re.fullmatch(r"([\d.e+-]+), grads ([\d.e+-]+) \(vs 1 process ([\d.e+-]+)\)", " ".join(columns[10:]))
    assert agreement, line.group(0)
    loss_diff, grad_diff, vs_single = (float(x) for x in agreement.groups())
    assert loss_diff <= 1e-4 and grad_diff <= 1e-4 and vs_single <= 1e-5, line.group(0)
    for memory in columns[6:10]:  # tensor peak and RSS rise, shardwise and torch: one figure per rank
        assert len(memory.split("/")) == 4, line.group(0)
