"""``consolidate``: a sharded checkpoint as one plain safetensors file, in a single process.

Tensors are assembled and written one at a time (memory: the largest tensor), each chunk's
checksum verified on the way. The result loads with ``safetensors.torch.load_file`` into a
single-device model. No process group is used.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import TensorEntry, name_to_dtype
from shardwise.checkpoint.assignment import Block, full_block
from shardwise.checkpoint.safetensors_io import TensorSlot, fsync_file, write_file
from shardwise.checkpoint.source import ChunkReader, open_source

__all__ = ["consolidate", "read_full_tensor"]


def consolidate(path: str | os.PathLike, out_file: str | os.PathLike, *, prefix: str = "") -> list[str]:
    """Write every tensor of the checkpoint at ``path`` whole into the safetensors ``out_file``.

    Args:
        path: a checkpoint directory written by ``save``.
        out_file: the file to write (replaced atomically: written aside, fsync'ed, renamed).
        prefix: keep only the tensors whose key starts with ``prefix``, stored without it:
            ``prefix="model."`` turns ``{"model": ..., "optim": ...}`` into a model state dict.
            Non-tensor values under the prefix go to the file's ``__metadata__`` as JSON
            (``"shardwise.values"``).

    Returns:
        The keys written, in file order.

    Example:
        >>> consolidate("ckpt/step-100", "model.safetensors", prefix="model.")
        >>> model.load_state_dict(safetensors.torch.load_file("model.safetensors"))
    """
    source = open_source(os.fspath(path))
    out_file = os.fspath(out_file)
    entries = {k[len(prefix):]: (k, e) for k, e in sorted(source.metadata.tensors.items()) if k.startswith(prefix)}
    if not entries:
        raise CheckpointError(f"checkpoint {path} has no tensor whose key starts with {prefix!r}")
    slots = [TensorSlot(name, entry.dtype, entry.shape) for name, (_, entry) in entries.items()]
    values = {k[len(prefix):]: v for k, v in source.metadata.values.items() if k.startswith(prefix)}
    metadata = {"format": "pt", "shardwise.values": json.dumps(values, sort_keys=True)}
    partial = f"{out_file}.tmp-{os.getpid()}"
    try:
        with ChunkReader(source) as reader:
            write_file(partial, slots, _tensors(reader, [(k, e) for k, e in entries.values()]), metadata)
        os.replace(partial, out_file)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    fsync_file(os.path.dirname(os.path.abspath(out_file)))
    return list(entries)


def _tensors(reader: ChunkReader, entries: list[tuple[str, TensorEntry]]) -> Iterator[torch.Tensor]:
    for key, entry in entries:
        yield read_full_tensor(reader, key, entry)


def read_full_tensor(reader: ChunkReader, key: str, entry: TensorEntry) -> torch.Tensor:
    """One whole tensor assembled from its chunks."""
    whole = full_block(entry.shape)
    out = torch.empty(entry.shape, dtype=name_to_dtype(entry.dtype, key))
    for chunk in entry.chunks:
        part = Block(chunk.offsets, chunk.sizes)  # validated to lie inside the tensor
        out[part.slices_in(whole)] = reader.read(key, entry, chunk, part)
    return out
