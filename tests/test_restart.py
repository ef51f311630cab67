"""Runs that restart and resume by themselves (``--max-restarts``; docs/failures.md, "Restarts").

The oracle is the run that never failed: a job whose ranks are SIGKILLed at chosen steps and
restarted ends with a final checkpoint (weights, AdamW moments and step counts, schedule, run
values) bit-identical to the uninterrupted run's, and the losses of its last attempt equal that
run's, bit for bit (CPU, the same layout). A job that comes back on fewer processes resumes
from the latest checkpoint without ``--resume`` and trains the losses of a run that used the
new world size from that checkpoint on. Faults are injected by tests/jobs/train_chaos.py, never
by the library. Jobs that need no launch (flags refused, the root-cause logic) run in-process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import shardwise.checkpoint as dcp
from shardwise.launch import launcher
from shardwise.launch.worker import LAUNCHER_PID_ENV, REPORT_KEY, restart_count
from tests.helpers import fake_checkpoint, refusal_in_launcher, with_config

ROOT = Path(__file__).resolve().parents[1]
CHAOS = str(ROOT / "tests" / "jobs" / "train_chaos.py")
TRAIN = [sys.executable, "-m", "shardwise.train"]
STEPS = 12
TINY = ["--config", "tiny", "--global-batch", "4", "--seq-len", "16", "--warmup", "2", "--seed", "3",
        "--steps", str(STEPS), "--log-every", "1000", "--device", "cpu"]
EVERY = ["--checkpoint-every", "4"]
JOB_TIMEOUT_S = 300.0  # a loaded 2-core machine; the chaos run takes ~30 s when idle
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", LAUNCHER_PID_ENV)


# ---------------------------------------------------------------------- running jobs
def _start(argv: list[str], **env: str) -> subprocess.Popen:
    """A job in a session of its own (a fault may kill its whole process group)."""
    clean = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    return subprocess.Popen(argv, cwd=ROOT, env={**clean, "OMP_NUM_THREADS": "1", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    """(status, stdout, stderr) of a job; killed and failed if it outlives JOB_TIMEOUT_S."""
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"job still running after {JOB_TIMEOUT_S:g} s:\n{out}\n{err}")
    return proc.returncode, out, err


def _succeeded(proc: subprocess.Popen) -> tuple[str, str]:
    status, out, err = _finish(proc)
    assert status == 0, f"status {status}\n{out}\n{err}"
    assert "Traceback" not in err and "FAILED" not in err, err
    return out, err


def _checkpoint(path: Path, scratch: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of the checkpoint at ``path`` whole, and its values (one process)."""
    whole = scratch / f"{path.parent.name}-{path.name}.safetensors"
    dcp.consolidate(path, whole)
    with safe_open(str(whole), "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        values = json.loads(f.metadata()["shardwise.values"])
    return tensors, values


def _assert_same_checkpoint(got: Path, want: Path, scratch: Path) -> None:
    got_tensors, got_values = _checkpoint(got, scratch)
    want_tensors, want_values = _checkpoint(want, scratch)
    assert sorted(got_tensors) == sorted(want_tensors)
    assert any(k.startswith("optimizer.") for k in got_tensors) and any(k.startswith("model.") for k in got_tensors)
    biases = [k for k in got_tensors if k.endswith("expert_bias")]
    assert all(got_tensors[k].abs().sum() > 0 for k in biases), "the load-balancing bias never moved"
    differ = [k for k in want_tensors if not torch.equal(got_tensors[k], want_tensors[k])]
    assert not differ, f"tensors not bit-identical to the uninterrupted run's: {differ}"
    assert got_values == want_values


def _losses(path: Path) -> tuple[list[float], list[float]]:
    with open(path) as f:
        metrics = json.load(f)
    return metrics["losses"], metrics["lrs"]


# ---------------------------------------------------------------------- the chaos test
@pytest.mark.e2e
def test_ranks_killed_three_times_restart_and_end_bit_identical_to_the_uninterrupted_run(tmp_path):
    """The MoE family (its load-balancing bias is state too) on 2 ranks, FSDP with the experts
    split over them; a checkpoint every 4 of 12 steps; SIGKILL of rank 1 at step 3 (before any
    checkpoint: the restart starts at step 0), rank 0 at step 6, rank 1 at step 10."""
    layout = ["--nproc", "2", "--ep", "2", "--family", "moe"]
    os.makedirs(tmp_path / "fired")
    tiny_moe = [*layout, *with_config(TINY, "tiny_moe"), *EVERY]
    whole = _start([*TRAIN, *tiny_moe, "--checkpoint-dir", str(tmp_path / "whole"),
                    "--metrics-file", str(tmp_path / "whole.json")])
    chaos = _start([sys.executable, CHAOS, *tiny_moe, "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--max-restarts", "3", "--metrics-file", str(tmp_path / "chaos.json")],
                   CHAOS="kill:1:3,kill:0:6,kill:1:10", CHAOS_DIR=str(tmp_path / "fired"))
    _succeeded(whole)
    out, err = _succeeded(chaos)

    restarts = [line for line in err.splitlines() if line.startswith("restart ")]
    assert [re.sub(r" \(out of memory.*", "", line) for line in restarts] == [
        "restart 1 of 3: rank 1 was killed by SIGKILL", "restart 2 of 3: rank 0 was killed by SIGKILL",
        "restart 3 of 3: rank 1 was killed by SIGKILL"], err
    assert all(line.endswith("(the other ranks were stopped)") for line in restarts), err
    starts = [line for line in out.splitlines() if re.match(r"(resumed from|starting at step)", line)]
    ckpt = tmp_path / "ckpt"
    assert starts == ["starting at step 0 (restart 1 of 3): no checkpoint saved yet",
                      f"resumed from {ckpt / 'step-4'} at step 4 (restart 2 of 3)",
                      f"resumed from {ckpt / 'step-8'} at step 8 (restart 3 of 3)"], out

    _assert_same_checkpoint(ckpt / f"step-{STEPS}", tmp_path / "whole" / f"step-{STEPS}", tmp_path)
    losses, lrs = _losses(tmp_path / "chaos.json")
    whole_losses, whole_lrs = _losses(tmp_path / "whole.json")
    assert (losses, lrs) == (whole_losses[8:], whole_lrs[8:])  # bit for bit: JSON keeps every float exactly


# ---------------------------------------------------------------------- a smaller world
@pytest.mark.e2e
def test_a_job_back_on_fewer_processes_resumes_in_the_new_layout(tmp_path):
    """The whole job (4 ranks, dp_shard inferred 4) is killed at step 7, as a machine that dies;
    the same command with --nproc 2 resumes from step 4 by itself (dp_shard inferred again: 2)
    and trains the losses of a run that used 2 ranks from that checkpoint on."""
    ckpt, alone = tmp_path / "ckpt", tmp_path / "alone"
    os.makedirs(tmp_path / "fired")
    first = _start([sys.executable, CHAOS, "--nproc", "4", *TINY, *EVERY, "--checkpoint-dir", str(ckpt), "--max-restarts", "2"],
                   CHAOS="killjob:2:7", CHAOS_DIR=str(tmp_path / "fired"))
    status, out, err = _finish(first)
    assert status == -signal.SIGKILL, f"status {status}\n{out}\n{err}"
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("step-")) == ["step-4"], os.listdir(ckpt)
    shutil.copytree(ckpt / "step-4", alone / "step-4")

    again = _start([*TRAIN, "--nproc", "2", *TINY, *EVERY, "--checkpoint-dir", str(ckpt), "--max-restarts", "2",
                    "--metrics-file", str(tmp_path / "again.json")])
    oracle = _start([*TRAIN, "--nproc", "2", *TINY, *EVERY, "--checkpoint-dir", str(alone), "--resume",
                     "--metrics-file", str(tmp_path / "alone.json")])
    out, _ = _succeeded(again)
    _succeeded(oracle)
    assert "layout: FSDP dp_shard=2 (dp_shard inferred: --nproc 2" in out, out
    assert f"resumed from {ckpt / 'step-4'} at step 4\n" in out, out
    assert _losses(tmp_path / "again.json") == _losses(tmp_path / "alone.json")
    _assert_same_checkpoint(ckpt / f"step-{STEPS}", alone / f"step-{STEPS}", tmp_path)


# ---------------------------------------------------------------------- flags
def test_a_restartable_run_takes_a_directory_with_checkpoints_without_resume(tmp_path, monkeypatch):
    from shardwise.train import cli

    for name in _LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    fake_checkpoint(str(tmp_path), 4, steps=STEPS, seed=3)
    job = cli.job_from_argv([*TINY, "--checkpoint-dir", str(tmp_path), "--max-restarts", "1"])
    assert job.resumes_by_itself and not job.resume
    empty = cli.job_from_argv([*TINY, "--checkpoint-dir", str(tmp_path / "new"), "--max-restarts", "1"])
    assert empty.resumes_by_itself


@pytest.mark.parametrize("argv, message", [
    (["--max-restarts", "2"], r"--max-restarts needs --checkpoint-dir$"),
    (["--max-restarts", "-1", "--checkpoint-dir", "{tmp}"], r"--max-restarts must be >= 0, got -1$"),
    (["--max-restarts", "1", "--checkpoint-dir", "{saved}", "--seed", "4"],
     r"--seed 4 differs from the seed 3 of checkpoint .*step-4"),
    (["--max-restarts", "1", "--checkpoint-dir", "{saved}", "--nproc", "3", "--tp", "2"],
     r"cannot infer --dp-shard: the number of processes 3 .* is not divisible by .* --tp 2 = 2$"),
], ids=["no dir", "negative", "other seed", "degrees no longer fit"])
def test_bad_restart_flags_are_one_error_line(monkeypatch, capsys, tmp_path, argv, message):
    saved = tmp_path / "saved"
    fake_checkpoint(str(saved), 4, steps=STEPS, seed=3)
    argv = [a.format(tmp=tmp_path, saved=saved) for a in argv]
    err = refusal_in_launcher(monkeypatch, capsys, [*TINY, *argv])
    assert re.search(message, err.strip()), err


def test_under_torchrun_the_trainers_max_restarts_must_be_torchruns(monkeypatch, tmp_path):
    from shardwise.train import cli
    from shardwise.train.config import ConfigError

    for name in _LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    assert restart_count() == (2, 3)
    with pytest.raises(ConfigError, match=r"--max-restarts 1 differs from the launcher's --max-restarts 3: under torchrun"):
        cli.job_from_argv([*TINY, "--checkpoint-dir", str(tmp_path), "--max-restarts", "1"])
    fake_checkpoint(str(tmp_path), 4, steps=STEPS, seed=3)  # torchrun's restart resumes without --resume
    assert cli.job_from_argv([*TINY, "--checkpoint-dir", str(tmp_path)]).resumes_by_itself


# ---------------------------------------------------------------------- which failures restart
class _Failure:
    """What the launcher reads of a failed worker (torch's ``ProcessFailure``): status, error file."""

    def __init__(self, exitcode: int, kind: str | None = None, line: str = "") -> None:
        self.exitcode = exitcode
        self.error_file_data = {REPORT_KEY: {"kind": kind, "line": line, "time": 1.0, "first": True}} if kind else {}


def test_a_verdict_or_an_interruption_is_not_restarted():
    killed = launcher.diagnose({0: _Failure(-signal.SIGTERM), 1: _Failure(-signal.SIGKILL)})
    assert (killed.status, killed.restartable) == (137, True)
    assert killed.line.startswith("rank 1 was killed by SIGKILL")
    raised = launcher.diagnose({0: _Failure(1, "peer_lost", "lost"), 1: _Failure(1, "error", "rank 1: RuntimeError: x")})
    assert (raised.line, raised.restartable) == ("rank 1: RuntimeError: x", True)
    bad_job = launcher.diagnose({0: _Failure(2, "verdict", "rank 0: exited with status 2"), 1: _Failure(2)}, (2,))
    assert (bad_job.status, bad_job.line, bad_job.restartable) == (2, None, False)
    ctrl_c = launcher.diagnose({1: _Failure(130, "interrupted", "rank 1: interrupted at step 3")})
    assert (ctrl_c.status, ctrl_c.restartable) == (130, False)


# ---------------------------------------------------------------------- torchrun restarts
@pytest.mark.e2e
def test_torchruns_restarts_resume_by_themselves(tmp_path):
    """torchrun --max-restarts 1 restarts the workers after rank 0 is killed at step 6 (the
    trainer is given no restart flag): the restart resumes from step 4 by itself, in a store of its own (torchrun keeps one store for every
    restart, where the attempt before left gloo's addresses of its dead ranks)."""
    tiny = [*TINY, "--checkpoint-every", "4"]
    tiny[tiny.index("--steps") + 1] = "8"
    os.makedirs(tmp_path / "fired")
    whole = _start([*TRAIN, "--nproc", "2", *tiny, "--checkpoint-dir", str(tmp_path / "whole")])
    torchrun = _start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "--max-restarts", "1", CHAOS, *tiny, "--checkpoint-dir", str(tmp_path / "ckpt")],
                      CHAOS="kill:0:6", CHAOS_DIR=str(tmp_path / "fired"))
    _succeeded(whole)
    status, out, err = _finish(torchrun)
    assert status == 0, f"status {status}\n{out}\n{err}"
    starts = [line for line in out.splitlines() if re.match(r"(resumed from|starting at step)", line)]
    assert starts == [f"resumed from {tmp_path / 'ckpt' / 'step-4'} at step 4 (restart 1 of 1)"], out
    _assert_same_checkpoint(tmp_path / "ckpt" / "step-8", tmp_path / "whole" / "step-8", tmp_path)


@pytest.mark.e2e
def test_a_failure_that_comes_back_uses_the_restarts_up_and_fails_with_one_line(tmp_path):
    """One process whose step 2 raises on every start (tests/jobs/train_fault.py counts the
    steps of each start): one restart line, then the job's FAILED line, status 1."""
    fault = str(ROOT / "tests" / "jobs" / "train_fault.py")
    job = _start([sys.executable, fault, *TINY, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--max-restarts", "1"],
                 FAULT="raise:0:2")
    status, out, err = _finish(job)
    assert status == 1, f"status {status}\n{out}\n{err}"
    lines = [line for line in err.splitlines() if line.startswith(("restart ", "FAILED"))]
    assert lines == ["restart 1 of 1: rank 0: RuntimeError: injected out of memory",
                     "FAILED: rank 0: RuntimeError: injected out of memory (its one restart used)"], err
    assert err.count("[rank 0] Traceback") == 2, err  # the failing rank's own, once per start
