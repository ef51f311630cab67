"""``save``: every rank writes the blocks it owns into its own safetensors file, then rank 0
writes ``metadata.json`` and commits the directory atomically.

Steps (all ranks; three small object exchanges, no tensor ever travels):

1. flatten and validate the state dict locally (bad input raises here, before any collective);
2. rank 0 prepares the tmp directory; ranks exchange their block proposals; the writers are
   assigned (pure, ``plan.assign_writers``);
3. each writing rank streams its blocks, cut into row slabs, into ``__<rank>.safetensors``,
   computing each chunk's crc32, and fsyncs the file; ranks exchange the chunk records;
4. rank 0 writes ``metadata.json`` (fsync'ed) and commits; ranks exchange the outcome.

Any failure on any rank (disk full, permission) becomes one error on every rank, naming the
file and the cause (``cannot write checkpoint file <path>: No space left on device (ENOSPC)``).
``async_save`` (``asynchronous``) runs the same steps, 3 and 4 on a thread. Whatever
ends a save early on rank 0 (such an error, a collective failing because a peer died,
KeyboardInterrupt) removes the tmp directory; the previous checkpoint at ``path`` is never
touched before the commit. Only a killed rank 0 leaves a tmp directory, which the next save
removes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from shardwise.checkpoint import commit as commit_
from shardwise.checkpoint.errors import CheckpointError, storage_error
from shardwise.checkpoint.flatten import flatten
from shardwise.checkpoint.format import (
    METADATA_FILE, Chunk, Metadata, TensorEntry, chunk_key, crc32_of, dtype_to_name,
)
from shardwise.checkpoint.group import World, current_world
from shardwise.checkpoint.pending import wait_for_pending_save
from shardwise.checkpoint.assignment import Block, Proposal, assign_writers, full_block, merged_declarations, proposed_block, split_rows
from shardwise.checkpoint.safetensors_io import TensorSlot, write_file
from shardwise.tensor.dtensor import DTensor

__all__ = ["save", "DEFAULT_MAX_CHUNK_BYTES"]
# Shared with ``asynchronous`` (which runs the same steps, the writing ones on a thread):
# LocalState, local_state, create_tmp, plan_writers, write_and_commit.

DEFAULT_MAX_CHUNK_BYTES = 4 << 20  # a chunk (row slab) is the unit of checksum and of reading


@dataclass(frozen=True)
class LocalState:
    """What this rank saves: tensors with their local blocks, values, and its proposals."""

    tensors: dict[str, torch.Tensor]
    values: dict[str, Any]
    declared: dict[str, tuple[str, tuple[int, ...]]]
    proposals: list[Proposal]


def save(
    state_dict: Mapping, path: str | os.PathLike, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    format: str = "shardwise",
) -> None:
    """Save ``state_dict`` to the directory ``path``, atomically; collective over all ranks.

    Args:
        state_dict: nested dicts/lists of DTensors, plain tensors (taken as replicated: rank
            0 writes them) and JSON scalars (taken from rank 0). Partial DTensors are
            rejected: reduce them first (``redistribute`` to Replicate or Shard).
        path: the checkpoint directory. An existing checkpoint there is replaced only once
            the new one is complete.
        max_chunk_bytes: blocks are stored as row slabs of at most this many bytes (the unit
            of checksum and of reading on load).
        format: "shardwise" (this format), or "dcp": a torch.distributed.checkpoint directory
            written by torch's own writer (``shardwise.interop.save_dcp``; not atomic).

    Raises:
        CheckpointError: on every rank, naming the key, file or rank at fault.

    Example:
        >>> save({"model": model.state_dict(), "step": 100}, "ckpt/step-100")
    """
    if format == "dcp":
        from shardwise.interop.dcp import save_dcp

        return save_dcp(state_dict, path)
    if format != "shardwise":
        raise ValueError(f"save: format must be 'shardwise' or 'dcp', got {format!r}")
    wait_for_pending_save()  # at most one save in flight: an asynchronous one finishes first
    path = os.fspath(path)
    local = local_state(state_dict)
    world = current_world()
    token, error = create_tmp(path) if world.rank == 0 else (None, None)
    try:
        shared, written, merged = plan_writers(world, token, error, local)  # rank 0's token, on every rank
        write_and_commit(world, path, shared, local, written, merged, max_chunk_bytes)
    except BaseException:
        # Whatever stops the save (an error reported by any rank, a collective failing because
        # a peer died, Ctrl-C), rank 0 removes the tmp directory it created; after a commit
        # it no longer exists, and the previous checkpoint was never touched before it.
        if token is not None:
            commit_.discard(path, token)
        raise


Declared = dict[str, tuple[str, tuple[int, ...]]]


def plan_writers(world: World, token: str | None, error: str | None,
                 local: LocalState) -> tuple[str, list[Proposal], Declared]:
    """Step 2, after rank 0 tried to create the tmp directory: (the save's token, the blocks this
    rank writes, every rank's tensors merged). One exchange."""
    token, declared, proposals = _exchange_proposals(world, token, error, local)
    written = assign_writers(declared, proposals)[world.rank]
    return token, written, merged_declarations(declared)  # ranks may save different keys (pipeline stages)


def write_and_commit(world: World, path: str, token: str, local: LocalState, written: list[Proposal],
                     merged: Declared, max_chunk_bytes: int) -> None:
    """Steps 3-4: write this rank's file, exchange the chunk records, rank 0 commits. Two exchanges."""
    chunks = _exchange_chunks(world, path, token, local, written, max_chunk_bytes)
    error = _guarded(lambda: _finish(path, token, local, merged, chunks)) if world.rank == 0 else None
    world.agree(error)


def local_state(state_dict: Mapping) -> LocalState:
    """Flatten and validate; this rank's proposals. Raises before any collective."""
    tensors, values, declared, proposals = {}, {}, {}, []
    for key, leaf in flatten(state_dict).items():
        if not isinstance(leaf, torch.Tensor):
            values[key] = leaf
            continue
        dtype = dtype_to_name(leaf.dtype, key)
        block = _proposal_block(key, leaf)
        tensors[key] = leaf
        declared[key] = (dtype, tuple(leaf.shape))
        if block is not None:
            proposals.append(Proposal(key, dtype, tuple(leaf.shape), block))
    return LocalState(tensors, values, declared, proposals)


def _proposal_block(key: str, tensor: torch.Tensor) -> Block | None:
    if not isinstance(tensor, DTensor):
        block = full_block(tuple(tensor.shape))
        return block if block.numel > 0 else None
    spec = tensor._spec
    if spec.has_partial:
        raise CheckpointError(
            f"state dict entry {key!r} is a DTensor with pending reductions {list(spec.placements)} "
            f"on {spec.mesh}; reduce it first (redistribute to Replicate or Shard) before saving"
        )
    return proposed_block(tuple(tensor.shape), spec.mesh.shape, spec.mesh.get_coordinate(), spec.placements)


def _guarded(fn) -> Any:
    """Run ``fn``; return None on success or the error message (to share with the others)."""
    try:
        fn()
    except CheckpointError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
        return f"saving the checkpoint failed: {type(err).__name__}: {err}"
    return None


def create_tmp(path: str) -> tuple[str | None, str | None]:
    """Rank 0: (token of the new tmp directory, None), or (None, why it could not be created)."""
    try:
        return commit_.prepare(path), None
    except CheckpointError as err:
        return None, str(err)
    except OSError as err:  # reported to every rank by the next exchange
        return None, storage_error("prepare for saving", path, err)
    except Exception as err:  # noqa: BLE001 - reported to every rank by the next exchange
        return None, f"cannot prepare {path} for saving: {type(err).__name__}: {err}"


def _exchange_proposals(world: World, token: str | None, error: str | None,
                        local: LocalState) -> tuple[str, list, list]:
    """Every rank learns rank 0's token (or its error) and all ranks' proposals."""
    gathered = world.exchange((token, error, local.declared, local.proposals))
    if gathered[0][1] is not None:
        raise CheckpointError(gathered[0][1])
    return gathered[0][0], [g[2] for g in gathered], [g[3] for g in gathered]


def _exchange_chunks(
    world: World, path: str, token: str, local: LocalState, written: list[Proposal], max_chunk_bytes: int
) -> list[tuple[str, Chunk]]:
    """Write this rank's file; return every rank's chunk records (raising everywhere on error)."""
    records: list[tuple[str, Chunk]] = []
    file = f"__{world.rank}.safetensors"
    error = _guarded(lambda: records.extend(
        _write_rank_file(commit_.tmp_dir(path, token), file, local, written, max_chunk_bytes, world.rank)))
    gathered = world.exchange((error, records))
    failed = [(rank, e) for rank, (e, _) in enumerate(gathered) if e is not None]
    if failed:
        where = f" (on rank {failed[0][0]})" if world.size > 1 else ""
        raise CheckpointError(f"{failed[0][1]}{where}")
    return [r for _, per_rank in gathered for r in per_rank]


def _write_rank_file(
    directory: str, file: str, local: LocalState, written: list[Proposal], max_chunk_bytes: int, rank: int
) -> list[tuple[str, Chunk]]:
    """Stream this rank's slabs into ``directory/file``; return (key, chunk record) pairs."""
    slabs = [(p, slab) for p in written for slab in split_rows(p.block, _itemsize(local, p.fqn), max_chunk_bytes)]
    if not slabs:
        return []
    slots = [TensorSlot(chunk_key(p.fqn, s.offsets), p.dtype, s.sizes) for p, s in slabs]
    crcs: list[int] = []
    target = os.path.join(directory, file)
    try:
        write_file(target, slots, _slab_tensors(local, slabs, crcs, rank))
    except OSError as err:
        raise CheckpointError(storage_error("write checkpoint file", target, err)) from None
    commit_.fault_point("after_write", rank)
    return [(p.fqn, Chunk(s.offsets, s.sizes, file, slot.key, crc))
            for (p, s), slot, crc in zip(slabs, slots, crcs)]


def _itemsize(local: LocalState, fqn: str) -> int:
    return local.tensors[fqn].element_size()


def _slab_tensors(
    local: LocalState, slabs: list[tuple[Proposal, Block]], crcs: list[int], rank: int
) -> Iterator[torch.Tensor]:
    """Each slab as a contiguous CPU tensor (a view when possible), recording its crc32."""
    for p, slab in slabs:
        block = _local_block(local.tensors[p.fqn])
        if block.dim() > 0:
            block = block.narrow(0, slab.offsets[0] - p.block.offsets[0], slab.sizes[0])
        block = block.detach().cpu().contiguous()
        crcs.append(crc32_of(block))
        yield block
        commit_.fault_point("mid_write", rank)


def _local_block(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _finish(path: str, token: str, local: LocalState, declared: dict[str, tuple[str, tuple[int, ...]]],
            chunks: list[tuple[str, Chunk]]) -> None:
    """Rank 0: write metadata.json last (fsync'ed), then commit the directory.

    ``declared``: the tensors of all ranks; the scalar values are rank 0's.
    """
    by_key: dict[str, list[Chunk]] = {key: [] for key in declared}
    for key, chunk in chunks:
        by_key[key].append(chunk)
    tensors = {
        key: TensorEntry(dtype, shape, tuple(sorted(by_key[key], key=lambda c: c.offsets)))
        for key, (dtype, shape) in declared.items()
    }
    text = Metadata(tensors, local.values).to_json()
    tmp = commit_.tmp_dir(path, token)
    commit_.fault_point("before_metadata", 0)
    target = os.path.join(tmp, METADATA_FILE)
    try:
        with open(target, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise CheckpointError(storage_error("write", target, err)) from None
    try:
        commit_.commit(path, token, 0)
    except OSError as err:
        raise CheckpointError(storage_error("commit checkpoint", path, err)) from None
