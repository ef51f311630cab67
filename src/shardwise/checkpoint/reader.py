"""``load``: fill a target state dict in place from a checkpoint, resharding as the target says.

The target decides everything: its keys are looked up, its DTensors' meshes and placements say
which block each rank needs, whatever layout the checkpoint was saved from. Steps:

1. match the target against the metadata (missing key, tensor vs value, shape, dtype); every
   problem is collected into one message;
2. read the chunks that overlap each target block into temporary tensors, verifying each
   chunk's crc32;
3. all ranks agree on success (one exchange of error messages): on any failure every rank
   raises the same error and no target tensor or value has been touched;
4. copy the verified pieces into the targets' local tensors and write back the scalar values.

Keys of the checkpoint absent from the target are ignored, so a subset (the model alone out
of model + optimizer) loads. Without a process group, plain-tensor targets load in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.flatten import flatten, replace_values
from shardwise.checkpoint.format import Metadata, TensorEntry, dtype_to_name
from shardwise.checkpoint.group import current_world
from shardwise.checkpoint.assignment import Block, full_block, read_plan
from shardwise.checkpoint.source import ChunkReader, Source, open_source
from shardwise.tensor.dtensor import DTensor
from shardwise.core.spec import local_shape_and_offset

__all__ = ["load"]

_MAX_LISTED = 5
Pieces = list[tuple[tuple[slice, ...], torch.Tensor]]  # (where in the local block, verified data)


@dataclass(frozen=True)
class _Target:
    """A tensor of the target: its key, the block this rank holds, and that block's tensor."""

    key: str
    entry: TensorEntry
    block: Block
    local: torch.Tensor


def load(state_dict: dict, path: str | os.PathLike) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place; collective over all ranks.

    Args:
        state_dict: the target, shaped like the saved one (nested dicts/lists). DTensors are
            filled block by block in their own layout (any mesh and placements); plain
            tensors are filled whole; scalars are replaced by the saved values. Keys the
            checkpoint has beyond the target's are ignored.
        path: a directory written by ``save``, or a ``.safetensors`` file (e.g. a plain
            ``model.state_dict()`` saved with ``safetensors.torch.save_file``; its keys must be
            the target's keys, so pass the model state dict itself), a
            ``torch.distributed.checkpoint`` directory (it has ``.metadata``), or a Hugging Face
            directory (``model.safetensors.index.json`` and its shards, or one ``model.safetensors``).

    Raises:
        CheckpointError: on every rank, before anything in ``state_dict`` changes: the
            checkpoint is missing, damaged (checksum, truncation) or does not match the target
            (missing key, shape, dtype); the message names the key and file.

    Example:
        >>> state = {"model": model.state_dict(), "step": 0}
        >>> load(state, "ckpt/step-100")   # state["step"] is now 100
    """
    path = os.fspath(path)
    leaves = flatten(state_dict)
    world = current_world()
    pieces: dict[str, Pieces] = {}
    targets: list[_Target] = []
    values: dict[str, Any] = {}
    error = None
    try:
        source = open_source(path)
        targets, values = _match(leaves, source)
        pieces = _read(source, targets)
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks, not hang them
        error = f"loading checkpoint {path} failed: {type(err).__name__}: {err}"
    world.agree(error)
    _apply(state_dict, targets, pieces, values)


def _match(leaves: Mapping[str, Any], source: Source) -> tuple[list[_Target], dict[str, Any]]:
    """Target tensors with their blocks, and the loaded scalars; all mismatches in one error."""
    meta = source.metadata
    targets, values, problems = [], {}, []
    for key, leaf in leaves.items():
        try:
            if isinstance(leaf, torch.Tensor):
                targets.append(_target(key, leaf, meta))
            else:
                values[key] = _value(key, leaf, meta)
        except CheckpointError as err:
            problems.append(str(err))
    if problems:
        listed = "; ".join(problems[:_MAX_LISTED])
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError(
            f"checkpoint {source.label} does not match the target state dict "
            f"({len(problems)} problem{'s' if len(problems) > 1 else ''}): {listed}{more}"
        )
    return targets, values


def _value(key: str, leaf: Any, meta: Metadata) -> Any:
    if key in meta.values:
        return meta.values[key]
    if key in meta.tensors:
        raise CheckpointError(f"key {key!r} is a tensor in the checkpoint but a {type(leaf).__name__} in the target")
    raise CheckpointError(f"key {key!r} of the target is missing from the checkpoint")


def _target(key: str, tensor: torch.Tensor, meta: Metadata) -> _Target:
    entry = meta.tensors.get(key)
    if entry is None:
        kind = "a non-tensor value" if key in meta.values else "missing"
        raise CheckpointError(f"key {key!r} of the target is {kind} in the checkpoint")
    if tuple(tensor.shape) != entry.shape or dtype_to_name(tensor.dtype, key) != entry.dtype:
        raise CheckpointError(
            f"key {key!r}: the checkpoint holds {entry.dtype}{list(entry.shape)}, the target is "
            f"{dtype_to_name(tensor.dtype, key)}{list(tensor.shape)}"
        )
    block, local = _target_block(key, tensor)
    return _Target(key, entry, block, local)


def _target_block(key: str, tensor: torch.Tensor) -> tuple[Block, torch.Tensor]:
    """The global block this rank holds of a target tensor, and its local tensor."""
    if not isinstance(tensor, DTensor):
        return full_block(tuple(tensor.shape)), tensor
    spec = tensor._spec
    if spec.has_partial:
        raise CheckpointError(f"key {key!r}: cannot load into a DTensor with pending reductions {list(spec.placements)}")
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return Block((0,) * tensor.dim(), (0,) * tensor.dim()), tensor._local_tensor
    sizes, offsets = local_shape_and_offset(tuple(tensor.shape), spec.mesh.shape, coordinate, spec.placements)
    if tuple(tensor._local_tensor.shape) != tuple(sizes):
        raise CheckpointError(f"key {key!r}: local block {list(tensor._local_tensor.shape)} does not fit {spec.render()}")
    return Block(tuple(offsets), tuple(sizes)), tensor._local_tensor


def _read(source: Source, targets: list[_Target]) -> dict[str, Pieces]:
    """Each target block read into temporary pieces (checksums verified), not yet copied."""
    pieces = {}
    with ChunkReader(source) as reader:
        for t in targets:
            pieces[t.key] = _read_block(reader, t)
    return pieces


def _read_block(reader: ChunkReader, t: _Target) -> Pieces:
    if t.block.numel == 0:
        return []
    try:
        reads = read_plan(t.block, t.entry.chunks)
    except CheckpointError as err:
        raise CheckpointError(f"key {t.key!r}: {err}") from None
    return [(r.part.slices_in(t.block), reader.read(t.key, t.entry, r.chunk, r.part)) for r in reads]


def _apply(state_dict: dict, targets: list[_Target], pieces: dict[str, Pieces], values: dict[str, Any]) -> None:
    """Copy the verified pieces into the targets and write back the values (cannot fail)."""
    with torch.no_grad():
        for t in targets:
            for where, data in pieces[t.key]:
                t.local[where].copy_(data)
    replace_values(state_dict, lambda key, old: values.get(key, old) if not isinstance(old, torch.Tensor) else old)
