"""The protocol torch's distributed checkpoint calls on a tensor that describes its own blocks.

``torch.distributed.checkpoint.save`` and ``load`` ask a state dict's tensors three questions
when the tensor answers them: which items to write (``__create_write_items__``), which chunk of
the global tensor this rank holds (``__create_chunk_list__``), and the local tensor behind a
chunk (``__get_tensor_shard__``). A shardwise DTensor answers with its block: its global offset
and shape, from the spec. So a training script that saves or loads shardwise tensors with
torch's checkpoint keeps working after switching imports; torch deduplicates the blocks that
replicated axes repeat and reshards on load as for its own DTensors (docs/checkpoints.md).

A Partial tensor is refused, naming the key: its blocks are addends, not pieces of the value,
and writing them would store a wrong tensor. torch's checkpoint is imported only when it calls,
so ``import shardwise`` does not load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardwise.core.placement import Partial

if TYPE_CHECKING:
    from shardwise.tensor.dtensor import DTensor

__all__ = ["write_items", "chunk_list", "tensor_shard"]


def write_items(dtensor: "DTensor", fqn: str) -> list:
    """One shard write item for this rank's block of ``dtensor`` saved under ``fqn``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    chunk = _chunk(dtensor, fqn)
    return [WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=chunk,
            properties=TensorProperties.create_from_tensor(dtensor._local_tensor),
            size=dtensor.shape,
        ),
    )]


def chunk_list(dtensor: "DTensor") -> list:
    """The one chunk of the global tensor this rank holds (where a load writes into)."""
    return [_chunk(dtensor, "")]


def tensor_shard(dtensor: "DTensor", index: Any) -> torch.Tensor:
    """This rank's block, the tensor torch's checkpoint reads from or copies into in place."""
    _refuse_partial(dtensor, getattr(index, "fqn", ""))
    return dtensor._local_tensor


def _chunk(dtensor: "DTensor", fqn: str):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _refuse_partial(dtensor, fqn)
    shape, offset = dtensor._spec.local_shape_and_offset()
    return ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))


def _refuse_partial(dtensor: "DTensor", fqn: str) -> None:
    if any(isinstance(p, Partial) for p in dtensor.placements):
        where = f" {fqn!r}" if fqn else ""
        raise ValueError(
            f"torch.distributed.checkpoint cannot save the Partial DTensor{where} ({list(dtensor.placements)}): "
            "its blocks are unreduced addends; redistribute it to Replicate() or Shard() first"
        )
