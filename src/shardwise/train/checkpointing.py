"""Where checkpointing plugs into the training loop.

The loop talks to a ``Checkpointer`` at two points: ``restore`` before the first step (it
returns the step to start from; the data position is that step, see ``data.py``) and
``after_step`` once a step's update is applied. The state to save is ``TrainState``: the model,
the optimizer, the learning-rate schedule and the step, as state dicts.

This version of the trainer ships ``NoCheckpointer`` only; ``--checkpoint-dir`` is refused
up front (``checkpoint_support_error``) rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

__all__ = ["TrainState", "Checkpointer", "NoCheckpointer", "checkpoint_support_error", "make_checkpointer"]


@dataclass
class TrainState:
    """What a checkpoint of the job holds (live objects; their state dicts are saved)."""

    model: nn.Module
    optimizer: Any
    scheduler: Any
    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step}


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


def checkpoint_support_error(checkpoint_dir: str | None) -> str | None:
    """Why the checkpoint flags cannot be honoured by this trainer, or None when they are unused."""
    if not checkpoint_dir:
        return None
    return (f"--checkpoint-dir {checkpoint_dir!r}: saving and resuming checkpoints is not available in this "
            f"version of shardwise.train; run without --checkpoint-dir/--checkpoint-every/--resume")


def make_checkpointer(checkpoint_dir: str | None, every: int, resume: bool) -> Checkpointer:
    """The checkpointer for the job's flags (validated already)."""
    return NoCheckpointer()
