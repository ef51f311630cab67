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

``--checkpoint-async`` saves with ``shardwise.checkpoint.async_save`` (the step goes on while a
thread writes; the next save and the end of the run wait for it); ``--checkpoint-keep K`` keeps
the newest K committed checkpoints. ``--resume`` starts from the newest committed checkpoint
that loads: a damaged newer one (a truncated file, a bad checksum, unreadable metadata) is
skipped with one warning naming what is wrong with it (docs/checkpoints.md).

One run per directory: the command line holds ``<dir>/.lock`` for the whole run
(``run_lock.py``) and refuses a second run on the directory before it trains. That is what
makes the tidying safe: each save first removes its path's leftover ``step-<N>.tmp-*`` and
``step-<N>.old-*`` directories (``shardwise.checkpoint.commit.prepare``), which, with the lock
held, can only be a dead run's, never a live run's save in progress. Nothing here deletes
anything at start-up. Code that calls ``train`` directly (tests, notebooks) takes no lock.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from shardwise.checkpoint.commit import committed_dir
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import METADATA_FILE, Metadata
from shardwise.checkpoint.source import DCP_METADATA_FILE, open_source

__all__ = ["TrainState", "Checkpointer", "NoCheckpointer", "DirectoryCheckpointer", "ResumePoint",
           "latest_checkpoint", "latest_readable_checkpoint", "committed_steps", "read_point", "incomplete_after",
           "steps_to_prune", "prune_checkpoints", "step_dir", "make_checkpointer"]

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
    steps = committed_steps(directory)
    return read_point(directory, steps[0]) if steps else None


def committed_steps(directory: str) -> list[int]:
    """The steps of ``directory``'s committed checkpoints (``latest_checkpoint``'s rule), newest first."""
    steps = {int(m.group(1)) for m in _committed(directory, _STEP_DIR)}
    steps |= {int(m.group(1)) for m in _committed(directory, _ASIDE_DIR)
              if not os.path.exists(os.path.join(directory, f"step-{m.group(1)}"))}
    return sorted(steps, reverse=True)


def read_point(directory: str, step: int) -> ResumePoint:
    """The run values of the committed checkpoint of ``step`` (its metadata only).

    Raises:
        CheckpointError: its metadata is unreadable or invalid, or records another step.
    """
    path = step_dir(directory, step)
    train = {k.removeprefix("train."): v for k, v in _metadata(path).values.items() if k.startswith("train.")}
    if train.get("step") != step:
        raise CheckpointError(f"checkpoint {path} records train.step {train.get('step')!r}, not {step}: "
                              f"it was not saved by shardwise.train, or was renamed")
    return ResumePoint(step, path, train)


def latest_readable_checkpoint(directory: str) -> tuple[ResumePoint | None, list[str]]:
    """The newest committed checkpoint whose metadata reads, and what is wrong with newer ones
    (``incomplete_after``, and unreadable metadata): where ``--resume`` may start."""
    problems: list[str] = []
    for step in committed_steps(directory):
        try:
            point = read_point(directory, step)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        return point, incomplete_after(directory, step) + problems
    return None, problems


def incomplete_after(directory: str, step: int) -> list[str]:
    """``step-<N>`` directories newer than ``step`` that hold no metadata (half-written or
    half-deleted: a save never leaves one, it writes to ``step-<N>.tmp-*``)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    found = sorted((int(m.group(1)), m.group(0)) for m in map(_STEP_DIR.fullmatch, names)
                   if m and int(m.group(1)) > step and not _has_marker(os.path.join(directory, m.group(0))))
    return [f"{os.path.join(directory, name)} holds no {METADATA_FILE} (half-written or half-deleted)"
            for _, name in reversed(found)]


def steps_to_prune(steps: list[int], keep: int) -> list[int]:
    """Which of the committed ``steps`` retention removes: all but the newest ``keep`` (the
    newest, which a resume starts from, is always kept)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    return sorted(steps, reverse=True)[keep:]


def prune_checkpoints(directory: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` committed ``step-<N>`` checkpoints; return their paths.

    Each loses its metadata first, so a removal cut short leaves a directory that is no longer
    a checkpoint rather than a damaged one that looks committed.
    """
    removed = []
    for step in steps_to_prune(sorted(int(m.group(1)) for m in _committed(directory, _STEP_DIR)), keep):
        path = step_dir(directory, step)
        for marker in (METADATA_FILE, DCP_METADATA_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, marker))
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _committed(directory: str, pattern: re.Pattern) -> list[re.Match]:
    """Names in ``directory`` fully matching ``pattern`` whose directory holds metadata.json
    (or torch.distributed.checkpoint's ``.metadata``: a DCP ``step-<N>`` resumes too)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    matches = [pattern.fullmatch(name) for name in names]
    return [m for m in matches if m and _has_marker(os.path.join(directory, m.group(0)))]


def _has_marker(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, marker)) for marker in (METADATA_FILE, DCP_METADATA_FILE))


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
    resume_warning: str | None = None  # after ``restore``: the newer checkpoints skipped, and why

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

    def finish(self) -> None:
        """Wait for a save in flight (raising its error); apply retention."""


class NoCheckpointer:
    """Start at step 0, save nothing."""

    def restore(self, state: TrainState) -> int:
        return 0

    def after_step(self, state: TrainState) -> None:
        return None

    def finish(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class DirectoryCheckpointer:
    """Save ``<directory>/step-<N>`` every ``every`` steps (None: never) and at ``last_step``.

    With ``resume``, ``restore`` loads the newest committed checkpoint of ``directory`` that
    loads, noting in ``state.resume_warning`` what was wrong with newer ones. With
    ``asynchronous``, saves return once the blocks are copied to host memory and commit on a
    thread (``shardwise.checkpoint.async_save``); the next save and ``finish`` wait for it. With
    ``keep``, rank 0 removes all but the newest ``keep`` committed checkpoints after each
    commit it has waited for (so ``keep + 1`` exist while an asynchronous save is in flight).
    """

    directory: str
    every: int | None
    last_step: int
    resume: bool
    asynchronous: bool = False
    keep: int | None = None

    def restore(self, state: TrainState) -> int:
        if not self.resume:
            return 0
        problems: list[str] = []
        for step in committed_steps(self.directory):
            try:
                state.load(read_point(self.directory, step).path)
            except CheckpointError as err:  # every rank fails the same load together
                problems.append(str(err))
                continue
            problems = incomplete_after(self.directory, step) + problems
            if problems:
                state.resume_warning = (f"skipped the newer checkpoint(s): {'; '.join(problems)}; "
                                        f"resumed from {step_dir(self.directory, step)} instead")
            return state.step
        if not problems:
            raise CheckpointError(f"no checkpoint in {self.directory} (no step-<N> directory holds {METADATA_FILE})")
        older = f" (and the {len(problems) - 1} older checkpoint(s) fail too)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + older)

    def after_step(self, state: TrainState) -> None:
        periodic = self.every is not None and state.step % self.every == 0
        if periodic or state.step == self.last_step:
            self._save(state, step_dir(self.directory, state.step))

    def _save(self, state: TrainState, path: str) -> None:
        from shardwise.checkpoint import async_save

        if not self.asynchronous:
            state.save(path)
            self._retain()
            return
        self.finish()  # the previous save commits before retention counts it
        async_save(state.state_dict(), path)

    def finish(self) -> None:
        from shardwise.checkpoint import wait_for_pending_save

        wait_for_pending_save()
        self._retain()

    def _retain(self) -> None:
        if self.keep is not None and _lead_rank():
            prune_checkpoints(self.directory, self.keep)


def _lead_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def make_checkpointer(checkpoint_dir: str | None, every: int | None, last_step: int, resume: bool, *,
                      asynchronous: bool = False, keep: int | None = None) -> Checkpointer:
    """The checkpointer for the job's flags (validated already)."""
    if not checkpoint_dir:
        return NoCheckpointer()
    return DirectoryCheckpointer(checkpoint_dir, every, last_step, resume, asynchronous, keep)
