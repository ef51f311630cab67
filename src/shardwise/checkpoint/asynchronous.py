"""``async_save``: save a checkpoint while training goes on.

The call does, on the calling thread, what needs every rank in step or the live tensors:
waiting for the previous save, validating the state dict, rank 0 preparing the tmp directory,
the one exchange that assigns writers, and copying this rank's blocks to host buffers
(``staging``). It returns an ``AsyncSave``; a thread then writes this rank's file, exchanges
the chunk records, and rank 0 commits, exactly as ``save`` does (``writer``). The thread's
exchanges go over a gloo group of the checkpoint's own (``group.checkpoint_world``), created
up front by the first call, so they never interleave with the training thread's collectives.

At most one save is in flight per process: the next ``async_save`` or ``save`` (and
``wait_for_pending_save``) waits for it first. A save that fails in the thread fails on
every rank (the same ``agree`` as ``save``), rank 0 removes its tmp directory, and the
previous checkpoint is intact; the error is raised by ``result()``, or else by that next call.
See docs/checkpoints.md, "Asynchronous saves, retention and bad storage".
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from shardwise.checkpoint import commit as commit_
from shardwise.checkpoint.assignment import Proposal
from shardwise.checkpoint.group import World, checkpoint_world
from shardwise.checkpoint.pending import PENDING, AsyncSave, wait_for_pending_save
from shardwise.checkpoint.staging import HostBuffers, Staged
from shardwise.checkpoint.writer import (
    DEFAULT_MAX_CHUNK_BYTES, Declared, LocalState, create_tmp, local_state, plan_writers, write_and_commit,
)
from shardwise.tensor.dtensor import DTensor

__all__ = ["AsyncSave", "async_save", "wait_for_pending_save"]

_BUFFERS = HostBuffers()


def async_save(
    state_dict: Mapping, path: str | os.PathLike, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> AsyncSave:
    """Save ``state_dict`` to ``path`` like ``save``, returning once this rank's blocks are copied.

    Collective over all ranks, like ``save``; the file writing and the atomic commit run on a
    thread. The state dict's tensors may change as soon as this returns.

    Args:
        state_dict: as for ``save`` (DTensors, plain tensors, JSON scalars).
        path: the checkpoint directory; an existing checkpoint there is replaced at the commit.
        max_chunk_bytes: as for ``save``.

    Returns:
        An ``AsyncSave``; ``result()`` waits for the commit and raises the save's error.

    Raises:
        CheckpointError: bad input (before any collective), or the previous asynchronous save
            failed and its error was not raised yet (on every rank).

    Example:
        >>> pending = async_save({"model": model.state_dict(), "step": 100}, "ckpt/step-100")
        >>> ...                       # train on
        >>> pending.result()          # or the next save waits for it
    """
    wait_for_pending_save()
    path = os.fspath(path)
    local = local_state(state_dict)
    world = checkpoint_world()
    token, error = create_tmp(path) if world.rank == 0 else (None, None)
    try:
        shared, written, merged = plan_writers(world, token, error, local)
    except BaseException:
        if token is not None:
            commit_.discard(path, token)
        raise
    staged, failed = _stage(local, written)
    copy = LocalState(dict(staged.blocks), local.values, local.declared, local.proposals)
    pending = AsyncSave(path, lambda: _write(world, path, shared, copy, staged, written, merged, max_chunk_bytes,
                                             failed),
                        lambda: commit_.discard(path, shared) if world.rank == 0 else None)
    PENDING.append(pending)
    return pending


def _stage(local: LocalState, written: list[Proposal]) -> tuple[Staged, str | None]:
    """This rank's blocks in host buffers, or why they could not be copied (out of memory):
    the thread reports that to every rank at its first exchange (``_write``)."""
    try:
        return _BUFFERS.stage({p.fqn: _block(local, p.fqn) for p in written}), None
    except Exception as err:  # noqa: BLE001 - must reach the other ranks, not hang them
        return Staged({}, None), f"copying the blocks to host memory failed: {type(err).__name__}: {err}"


def _block(local: LocalState, fqn: str) -> torch.Tensor:
    tensor = local.tensors[fqn]
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _write(world: World, path: str, token: str, local: LocalState, staged: Staged, written: list[Proposal],
           merged: Declared, max_chunk_bytes: int, failed: str | None) -> None:
    """On the thread: wait for the host copies, then steps 3-4 of ``save``.

    The ranks first agree that every one has its copies: a rank that could not copy fails the
    save everywhere, and no rank starts writing (crc32, file writes: CPU and memory bandwidth)
    while a peer on the same machine is still copying, which would prolong that peer's stall,
    the one every rank waits for at the next collective of training."""
    staged.wait()
    world.agree(failed)
    write_and_commit(world, path, token, local, written, merged, max_chunk_bytes)
