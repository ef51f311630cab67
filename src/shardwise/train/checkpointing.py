"""Checkpoints of a training job: what is saved, where, and how a run resumes.

The loop talks to a ``Checkpointer`` at two points: ``restore`` before the first step (it
returns the step to start from) and ``after_step`` once a step's update is applied.

A checkpoint is one ``shardwise.checkpoint`` directory per saved step, ``<dir>/step-<N>``,
saved atomically (a crash leaves the previous checkpoints intact and no ``step-<N>`` without
``metadata.json``). A ``step-<N>`` written in torch.distributed.checkpoint's format (with the
same keys, e.g. by ``shardwise.interop.save_dcp(state.state_dict(), ...)``) resumes as well.
It holds ``TrainState``:

* ``model``: ``model.state_dict()``, DTensors in the saving layout;
* ``optimizer``: the optimizer state keyed by parameter name (AdamW moments and step counts,
  hyperparameters), so it loads into any layout (``checkpoint.optimizer_state_dict``);
* ``scheduler``: the learning-rate scheduler's state dict;
* ``train``: the step, the data position, the seed, the schedule length (``--steps``) and the
  model config name.

The data position is the step: batches are a pure function of (seed, step) (``data.py``), so
a run resumed at step N with the same seed draws exactly the batches a run that never stopped
would. Loading reshards: the target is the new job's model and optimizer, in its own layout
and world size, whatever the saving job's.

One run per directory: the command line holds ``<dir>/.lock`` for the whole run
(``run_lock.py``) and refuses a second run on the directory before it trains. That is what
makes the tidying safe: each save first removes its path's leftover ``step-<N>.tmp-*`` and
``step-<N>.old-*`` directories (``shardwise.checkpoint.commit.prepare``), which, with the lock
held, can only be a dead run's, never a live run's save in progress. Nothing here deletes
anything at start-up. Code that calls ``train`` directly (tests, notebooks) takes no lock.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from shardwise.checkpoint.commit import committed_dir
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import METADATA_FILE, Metadata
from shardwise.checkpoint.source import DCP_METADATA_FILE, open_source

__all__ = ["TrainState", "Checkpointer", "NoCheckpointer", "DirectoryCheckpointer", "ResumePoint",
           "latest_checkpoint", "step_dir", "make_checkpointer"]

_STEP_DIR = re.compile(r"step-(\d+)")
_ASIDE_DIR = re.compile(r"step-(\d+)\.old-[0-9a-f]+")  # a commit cut between its two renames


def step_dir(directory: str, step: int) -> str:
    """Where the checkpoint of ``step`` goes."""
    return os.path.join(directory, f"step-{step}")


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """The latest committed checkpoint of a directory and the run values it records.

    ``train`` holds the values saved under ``train.`` (step, data_position, seed, steps,
    config), read from ``metadata.json`` without loading any tensor.
    """

    step: int
    path: str
    train: dict[str, Any]


def latest_checkpoint(directory: str) -> ResumePoint | None:
    """The committed ``step-<N>`` checkpoint of ``directory`` with the highest N, or None.

    A directory counts only if it holds ``metadata.json`` (written last, just before the
    atomic rename), so temporary ``step-<N>.tmp-*`` directories and half-written ones are
    ignored. A ``step-<N>.old-*`` directory with metadata stands for ``step-<N>`` when that is
    missing (a save replacing it was cut between its renames; ``load`` reads it there).

    Raises:
        CheckpointError: the chosen checkpoint's ``metadata.json`` is unreadable or invalid.
    """
    steps = {int(m.group(1)) for m in _committed(directory, _STEP_DIR)}
    steps |= {int(m.group(1)) for m in _committed(directory, _ASIDE_DIR)
              if not os.path.exists(os.path.join(directory, f"step-{m.group(1)}"))}
    if not steps:
        return None
    step = max(steps)
    path = step_dir(directory, step)
    train = {k.removeprefix("train."): v for k, v in _metadata(path).values.items() if k.startswith("train.")}
    if train.get("step") != step:
        raise CheckpointError(f"checkpoint {path} records train.step {train.get('step')!r}, not {step}: "
                              f"it was not saved by shardwise.train, or was renamed")
    return ResumePoint(step, path, train)


def _committed(directory: str, pattern: re.Pattern) -> list[re.Match]:
    """Names in ``directory`` fully matching ``pattern`` whose directory holds metadata.json
    (or torch.distributed.checkpoint's ``.metadata``: a DCP ``step-<N>`` resumes too)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    matches = [pattern.fullmatch(name) for name in names]
    return [m for m in matches if m and any(os.path.isfile(os.path.join(directory, m.group(0), marker))
                                            for marker in (METADATA_FILE, DCP_METADATA_FILE))]


def _metadata(path: str) -> Metadata:
    """The metadata of the checkpoint saved to ``path`` (or of its aside copy)."""
    if os.path.isfile(os.path.join(path, DCP_METADATA_FILE)):
        return open_source(path).metadata
    where = os.path.join(committed_dir(path), METADATA_FILE)
    try:
        with open(where) as f:
            return Metadata.from_json(f.read(), where)
    except OSError as err:
        raise CheckpointError(f"cannot read {where}: {err}") from None


@dataclass
class TrainState:
    """What a checkpoint of the job holds (live objects; their state is saved and loaded)."""

    model: nn.Module
    optimizer: Any
    scheduler: Any
    step: int = 0
    seed: int = 0
    schedule_steps: int = 0  # --steps: the horizon of the learning-rate schedule
    config: str = ""
    resumed_from: dict[str, Any] | None = None  # after ``load``: the path and the saved train values
    # Pipelined runs: the whole model's parameter names, in order. ``model`` holds some of them
    # (its stages'), so the optimizer's parameter group is saved under all of them: every rank
    # writes the same values, and the checkpoint loads into any layout, pipelined or not.
    param_names: list[str] | None = None

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint layout; its tensors are the live ones (``load`` fills them in place)."""
        from shardwise.checkpoint import optimizer_state_dict

        train = {"step": self.step, "data_position": self.step, "seed": self.seed,
                 "steps": self.schedule_steps, "config": self.config}
        optimizer = optimizer_state_dict(self.model, self.optimizer)
        if self.param_names is not None:
            optimizer["param_groups"] = [{**group, "params": list(self.param_names)}
                                         for group in _single_group(optimizer["param_groups"])]
        return {"model": self.model.state_dict(), "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(), "train": train}

    def save(self, path: str) -> None:
        """Save to ``path`` (collective, atomic)."""
        from shardwise.checkpoint import save

        save(self.state_dict(), path)

    def load(self, path: str) -> None:
        """Load ``path`` into the model, optimizer and scheduler in this job's layout (collective)."""
        from shardwise.checkpoint import load, load_optimizer_state_dict

        target = self.state_dict()
        load(target, path)
        train = target["train"]
        if train["data_position"] != train["step"]:
            raise CheckpointError(f"checkpoint {path}: data position {train['data_position']} differs from step "
                                  f"{train['step']}; this trainer's data position is its step")
        if self.param_names is not None:  # keep this rank's parameters of the saved group
            held = {name for name, _ in self.model.named_parameters()}
            target["optimizer"]["param_groups"] = [{**group, "params": [n for n in group["params"] if n in held]}
                                                   for group in _single_group(target["optimizer"]["param_groups"])]
        load_optimizer_state_dict(self.model, self.optimizer, target["optimizer"])
        self.scheduler.load_state_dict(target["scheduler"])
        self.step = train["step"]
        self.resumed_from = {"path": path, **train}


def _single_group(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, which a pipelined run's checkpoint requires to be one."""
    if len(groups) != 1:
        raise CheckpointError(f"a pipelined run's checkpoint needs one optimizer parameter group, got {len(groups)}")
    return groups


class Checkpointer(Protocol):
    def restore(self, state: TrainState) -> int:
        """Load the latest checkpoint into ``state`` if asked to; return the first step to run."""

    def after_step(self, state: TrainState) -> None:
        """Save ``state`` if this step is a checkpoint step."""


class NoCheckpointer:
    """Start at step 0, save nothing."""

    def restore(self, state: TrainState) -> int:
        return 0

    def after_step(self, state: TrainState) -> None:
        return None


@dataclass(frozen=True, slots=True)
class DirectoryCheckpointer:
    """Save ``<directory>/step-<N>`` every ``every`` steps (None: never) and at ``last_step``.

    With ``resume``, ``restore`` loads the latest committed checkpoint of ``directory``.
    """

    directory: str
    every: int | None
    last_step: int
    resume: bool

    def restore(self, state: TrainState) -> int:
        if not self.resume:
            return 0
        point = latest_checkpoint(self.directory)
        if point is None:
            raise CheckpointError(f"no checkpoint in {self.directory} (no step-<N> directory holds {METADATA_FILE})")
        state.load(point.path)
        return state.step

    def after_step(self, state: TrainState) -> None:
        periodic = self.every is not None and state.step % self.every == 0
        if periodic or state.step == self.last_step:
            state.save(step_dir(self.directory, state.step))


def make_checkpointer(checkpoint_dir: str | None, every: int | None, last_step: int, resume: bool) -> Checkpointer:
    """The checkpointer for the job's flags (validated already)."""
    if not checkpoint_dir:
        return NoCheckpointer()
    return DirectoryCheckpointer(checkpoint_dir, every, last_step, resume)
