"""Helpers shared by test modules: the trainer's parity job, its runs (each layout trained once
per session, see ``TrainerRuns``), and the trainer's command line run as the launching process
or from a shell.

Test modules import shared code from here (or from the other helper modules: harness,
op_check, llama_block, toy_net, declared_deps), never from each other: importing a test module
collects its tests' globals a second time and couples files that change for different reasons.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------- the parity job
# Every trainer test that trains (parity, simulate, state bytes, resume) runs this job, so a
# layout trained once serves them all. Six steps: two of warmup, then four that must keep
# matching the one-process losses to RTOL.
STEPS = 6
BASE = ["--config", "tiny", "--steps", str(STEPS), "--global-batch", "8", "--seq-len", "32",
        "--lr", "3e-3", "--warmup", "2", "--seed", "7", "--log-every", "1000", "--device", "cpu"]
RTOL = 1e-5


def with_config(argv: list[str], config: str) -> list[str]:
    """``argv`` with its ``--config`` value replaced."""
    out = list(argv)
    out[out.index("--config") + 1] = config
    return out


def train_losses(argv: list[str]) -> list[float]:
    """On every rank of a pool: train the job; the globally averaged losses."""
    return train_run(argv)["losses"]


def train_run(argv: list[str], measure: bool = False) -> dict[str, Any]:
    """On every rank of a pool (or alone): train the job. Its losses and learning rates, the
    training state this rank held (``StateBytes``), and with ``measure`` the second step measured
    on every rank as ``--metrics-file`` measures it (``per_rank``: the figures --simulate predicts;
    the file itself is not written, ``train`` leaves that to the command line)."""
    from shardwise.train import cli
    from shardwise.train.trainer import Runtime, train

    job = cli.job_from_argv(argv)
    if measure:
        job = dataclasses.replace(job, metrics_file="unused.json")
    metrics = train(job, Runtime.create(job))
    return {"losses": metrics.losses, "lrs": metrics.lrs, "state": metrics.state, "per_rank": metrics.per_rank,
            "first_step": metrics.first_step}


@functools.cache
def one_process_run(argv: tuple[str, ...]) -> dict[str, Any]:
    """``train_run`` of ``argv`` in this process (no process group); once per session."""
    from shardwise.train import cli
    from shardwise.train.trainer import Runtime

    assert Runtime.create(cli.job_from_argv(list(argv))).world_mesh is None
    return train_run(list(argv))


def one_process_losses(argv: tuple[str, ...]) -> tuple[float, ...]:
    """Losses of the one-process run of ``argv``, computed once per session."""
    return tuple(one_process_run(argv)["losses"])


def assert_parity(got: list[float], want: list[float], layout: str, steps: int = STEPS) -> None:
    """``got`` matches the one-process losses ``want`` step by step, to ``RTOL``."""
    assert len(got) == len(want) == steps, (layout, got)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst < RTOL, f"{layout}: losses {got} differ from one process {want} (max rel {worst:.2e})"


def layout_id(value: Any) -> str:
    """Test id of a parametrized flag list (``--tp 2 --dp-shard 2``) or world size."""
    return " ".join(value) if isinstance(value, list) else str(value)


class TrainerRuns:
    """The parity job's runs on the worker pools, one per (world size, flags, config), shared by
    every test that asks for the same one in this session (``trainer_runs`` fixture).

    A run returns each rank's losses, learning rates and state bytes, so the parity tests
    (losses) and the state tests (bytes each rank holds) check one training of a layout. The
    simulation tests train their own runs (tests/test_simulate.py says why).
    """

    def __init__(self, dist) -> None:
        self._dist = dist
        self._runs: dict[tuple, list[dict]] = {}
        self._failed: dict[tuple, str] = {}

    def get(self, nproc: int, flags: list[str], config: str = "tiny") -> list[dict]:
        """Every rank's ``train_run`` result (rank order) for ``BASE`` at ``config`` on ``nproc`` ranks."""
        key = (nproc, tuple(flags), config)
        if key in self._failed:  # a second test of the same run fails too, without training again
            pytest.fail(f"this run failed in an earlier test: {self._failed[key]}")
        if key not in self._runs:
            argv = with_config(BASE, config) + ["--nproc", str(nproc), *flags]
            try:
                self._runs[key] = self._dist.run(nproc, train_run, argv, timeout=300)
            except AssertionError as err:
                self._failed[key] = str(err).splitlines()[0]
                raise
        return self._runs[key]

    def losses(self, nproc: int, flags: list[str], config: str = "tiny") -> list[float]:
        """The run's losses, after checking every rank reports the same global losses."""
        per_rank = self.get(nproc, flags, config)
        assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank), "ranks disagree on the global loss"
        return per_rank[0]["losses"]


# ---------------------------------------------------------------------- optional dependencies
EXTRAS_ENV = "SHARDWISE_TEST_EXTRAS"


def require_extra(module: str):
    """``module`` (an optional dependency the library uses when installed), imported; the test
    skips without it, except where ``$SHARDWISE_TEST_EXTRAS=1`` (.ci/run's extras step installed
    every extra: a missing one fails there instead of skipping)."""
    import importlib

    if os.environ.get(EXTRAS_ENV) == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"the optional {module} path (.ci/run installs {module} to run it)")


# ---------------------------------------------------------------------- the command line
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def refusal_in_launcher(monkeypatch, capsys, argv: list[str]) -> str:
    """Run the CLI here as the launching process (launching fails the test); return its
    one-line error after checking it exited with status 2."""
    from shardwise.train import cli

    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["shardwise.train", *argv])
    monkeypatch.setattr(cli, "main_or_launch", _must_not_launch)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardwise.train: error: "), err
    return err


def _must_not_launch(*args, **kwargs):
    raise AssertionError("workers were launched for a bad job")


def search(pattern: str, text: str) -> re.Match | None:
    """``re.search``, for messages given as patterns."""
    return re.search(pattern, text)


def cli_run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python -m shardwise.train argv`` from a shell outside any launcher, to its end."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "shardwise.train", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cli_job(argv: list[str]) -> subprocess.Popen:
    """``python -m shardwise.train argv`` started from a shell outside any launcher, still running."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    return subprocess.Popen([sys.executable, "-m", "shardwise.train", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def fake_checkpoint(directory: str, step: int, steps: int = STEPS, **train) -> None:
    """A committed checkpoint holding only the run values (one process, no tensors)."""
    import shardwise.checkpoint as dcp

    values = {"step": step, "data_position": step, "seed": 7, "steps": steps, "config": "tiny", **train}
    dcp.save({"train": values}, os.path.join(directory, f"step-{step}"))
