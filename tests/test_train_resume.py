"""Trainer checkpoints: a run stopped and resumed in another layout continues the same losses.

The oracle is one uninterrupted one-process run of the whole schedule (in the test process: the
parity job's reference, tests/helpers.py). The stopped run trains on a worker pool under FSDP
(dp_shard=4), saving checkpoints; the
resumed run loads the latest one on a pool under FSDP+TP (tp=2, dp_shard=2), so the model and
the AdamW moments are resharded on load, and trains the remaining steps. Bad checkpoint flags
are refused in the launching process with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

import shardwise.checkpoint as dcp
from shardwise.train import cli
from shardwise.train.checkpointing import latest_checkpoint
from tests.helpers import BASE, RTOL, STEPS, fake_checkpoint, one_process_run, refusal_in_launcher, train_run

STOP = 3  # the resumed run's 3 steps start after the 2 warmup steps


def _max_rel(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want), (got, want)
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


@pytest.mark.e2e
def test_run_stopped_under_fsdp_resumes_under_fsdp_tp_with_the_same_losses(dist, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    whole = one_process_run(tuple(BASE))  # one process, no checkpoint: the oracle
    first = dist.run(4, train_run, BASE + ["--nproc", "4", "--dp-shard", "4", "--stop-after", str(STOP),
                                           "--checkpoint-dir", ckpt, "--checkpoint-every", "2"], timeout=240)
    assert sorted(os.listdir(ckpt)) == ["step-2", "step-3"]  # every 2 steps and at the stop
    assert _max_rel(first[0]["losses"], whole["losses"][:STOP]) < RTOL

    second = dist.run(4, train_run, BASE + ["--nproc", "4", "--tp", "2", "--dp-shard", "2",
                                         "--checkpoint-dir", ckpt, "--resume"], timeout=240)
    assert all(r == second[0] for r in second), "ranks disagree on the resumed losses"
    worst = _max_rel(second[0]["losses"], whole["losses"][STOP:])
    assert worst < RTOL, f"steps {STOP + 1}-{STEPS} after resuming: {second[0]['losses']} vs {whole['losses'][STOP:]}"
    assert second[0]["lrs"] == pytest.approx(whole["lrs"][STOP:], rel=1e-12)  # the schedule resumed too
    assert (first[0]["first_step"], second[0]["first_step"]) == (1, STOP + 1)  # --plot's x axis starts there
    assert latest_checkpoint(ckpt).step == STEPS  # saved at the end of the run


def test_latest_checkpoint_is_the_highest_committed_step(tmp_path):
    d = str(tmp_path)
    assert latest_checkpoint(d) is None and latest_checkpoint(str(tmp_path / "absent")) is None
    for step in (2, 10):
        fake_checkpoint(d, step)
    os.makedirs(tmp_path / "step-30")  # uncommitted: no metadata.json
    os.makedirs(tmp_path / "step-40.tmp-0123456789ab")  # a save cut before its commit
    (tmp_path / "step-40.tmp-0123456789ab" / dcp.METADATA_FILE).write_text("{}")
    os.makedirs(tmp_path / "step-50x")
    point = latest_checkpoint(d)
    assert (point.step, point.path, point.train["seed"]) == (10, os.path.join(d, "step-10"), 7)
    # a commit cut between its renames leaves step-12 aside: still the latest, and loadable by its name
    fake_checkpoint(d, 12)
    os.rename(tmp_path / "step-12", tmp_path / "step-12.old-abcdef012345")
    point = latest_checkpoint(d)
    assert (point.step, point.path) == (12, os.path.join(d, "step-12"))
    state = {"train": {"step": 0}}
    dcp.load(state, point.path)
    assert state["train"]["step"] == 12


def _bad_setups(tmp_path) -> dict:
    """Name -> (argv after BASE, expected message); directories prepared under tmp_path."""
    empty, temps, saved = (str(tmp_path / n) for n in ("empty", "temps", "saved"))
    os.makedirs(empty)
    os.makedirs(os.path.join(temps, "step-10.tmp-0123456789ab"))
    os.makedirs(os.path.join(temps, "step-5"))
    fake_checkpoint(saved, 4)
    return {
        "empty dir": (["--checkpoint-dir", empty, "--resume"],
                      rf"--resume: --checkpoint-dir '{empty}' holds no checkpoint \(no step-<N> directory with metadata.json\)"),
        "only temporary dirs": (["--checkpoint-dir", temps, "--resume"], rf"'{temps}' holds no checkpoint"),
        "missing dir": (["--checkpoint-dir", empty + "-x", "--resume"], r"--resume: --checkpoint-dir '.*-x' does not exist"),
        "no dir": (["--resume"], r"--resume needs --checkpoint-dir$"),
        "every 0": (["--checkpoint-dir", empty, "--checkpoint-every", "0"], r"--checkpoint-every must be > 0, got 0"),
        "stop after steps": (["--stop-after", str(STEPS + 1)],
                             rf"--stop-after must be between 1 and --steps {STEPS}, got {STEPS + 1}"),
        "other seed": (["--checkpoint-dir", saved, "--resume", "--seed", "3"],
                       r"--seed 3 differs from the seed 7 of checkpoint .*step-4: .* pass --seed 7"),
        "other config": (["--checkpoint-dir", saved, "--resume", "--config", "debug"],
                         r"--config 'debug' differs from the config 'tiny' of checkpoint .*step-4"),
        "fresh run over checkpoints": (["--checkpoint-dir", saved],
                                       r"already holds checkpoints \(latest .*step-4\): pass --resume"),
    }


BAD = ["empty dir", "only temporary dirs", "missing dir", "no dir", "every 0", "stop after steps", "other seed",
       "other config", "fresh run over checkpoints"]


@pytest.mark.parametrize("name", BAD)
def test_bad_checkpoint_flags_are_refused_before_launch(monkeypatch, capsys, tmp_path, name):
    argv, message = _bad_setups(tmp_path)[name]
    err = refusal_in_launcher(monkeypatch, capsys, [*BASE, "--nproc", "4", "--dp-shard", "4", *argv])
    assert re.search(message, err.strip()), err


def test_checkpoint_that_does_not_fit_the_model_is_refused_with_one_line(monkeypatch, capsys, tmp_path):
    """Past the launcher's checks (same config and seed), the load itself finds no model: exit 2."""
    saved = str(tmp_path / "saved")
    fake_checkpoint(saved, 4)
    for var in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["shardwise.train", *BASE, "--checkpoint-dir", saved, "--resume"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()  # one process: trains here
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardwise.train: error: --resume: checkpoint "), err
    assert "does not match the target state dict" in err and "'model." in err, err


def test_help_says_when_checkpoints_are_saved():
    text = " ".join(cli.build_parser().format_help().split())
    assert "every --checkpoint-every steps and at the end of the run" in text
    assert "--resume continue from the latest committed checkpoint" in text and "--stop-after N" in text

