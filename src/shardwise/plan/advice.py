"""When no layout fits: the changes that shrink a layout's memory, in the order the plan tries
them on the closest layout (docs/plan.md, "When nothing fits"). Pure: the plan simulates them.

Each change keeps what the user asked for and adds one saving: activation checkpointing,
mixed precision, both, a smaller batch (one sequence per data-parallel rank), shorter
sequences, then more GPUs (the layout's dp_shard and the global batch scaled together, so every
rank keeps its batch and holds a smaller shard of the training state). The later ones keep the
first three's savings: a user short of memory wants the least disruptive change that fits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.train.config import JobConfig

__all__ = ["Change", "changes", "MIN_SEQ_LEN", "MAX_GPU_FACTOR"]

MIN_SEQ_LEN = 1024  # shorter sequences than this are not suggested: a different training job
MAX_GPU_FACTOR = 8  # more GPUs: up to this many times the world asked for


@dataclass(frozen=True, slots=True)
class Change:
    """One change to a job: ``flags`` what it adds or replaces on the command line, ``job`` the
    job with it."""

    flags: str
    job: JobConfig


def _savers(job: JobConfig) -> list[Change]:
    """Activation checkpointing, mixed precision and both, each that the job does not use yet."""
    out = []
    if not job.activation_checkpointing:
        out.append(Change("--activation-checkpointing", dataclasses.replace(job, activation_checkpointing=True)))
    if not job.mixed_precision:
        out.append(Change("--mixed-precision", dataclasses.replace(job, mixed_precision=True)))
    if len(out) == 2:
        both = dataclasses.replace(job, activation_checkpointing=True, mixed_precision=True)
        out.append(Change("--activation-checkpointing --mixed-precision", both))
    return out


def changes(job: JobConfig) -> list[Change]:
    """Every change the plan tries on ``job`` (the closest layout), in order (module docstring)."""
    out = _savers(job)
    base = out[-1] if out else Change("", job)
    saved = base.job
    least = saved.dp_replicate * saved.dp_shard * saved.pp  # a sequence per pipeline microbatch
    if saved.global_batch > least:
        out.append(Change(f"{base.flags} --global-batch {least}".strip(), dataclasses.replace(saved, global_batch=least)))
    seq = saved.seq_len // 2
    while seq >= MIN_SEQ_LEN and seq % (2 * saved.cp) == 0:
        out.append(Change(f"{base.flags} --seq-len {seq}".strip(), dataclasses.replace(saved, seq_len=seq)))
        seq //= 2
    factor = 2
    while factor <= MAX_GPU_FACTOR:
        bigger = dataclasses.replace(saved, nproc=saved.nproc * factor, dp_shard=saved.dp_shard * factor,
                                     global_batch=saved.global_batch * factor)
        out.append(Change(f"{base.flags} --nproc {bigger.nproc}".strip(), bigger))
        factor *= 2
    return out
