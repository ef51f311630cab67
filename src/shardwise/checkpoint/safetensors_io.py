"""safetensors files: a streaming writer, and lazy reads through ``safetensors.safe_open``.

The safetensors layout is: 8 bytes little-endian header length N, N bytes of JSON header
(``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
padded with spaces to a multiple of 8), then the data buffer, each tensor row-major and
little-endian at its offsets. The writer computes the header from shapes and dtypes alone,
then streams tensors one by one straight from their memory: a file of any size is written
holding one tensor at a time, with no extra copy. Reads map the file and copy out only the
keys (or the slices of a key) asked for.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import name_to_dtype, raw_bytes

__all__ = ["TensorSlot", "write_file", "open_file", "fsync_file"]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """What the header says of one tensor before its bytes exist: key, dtype name, shape."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * name_to_dtype(self.dtype, self.key).itemsize


def header_bytes(slots: Sequence[TensorSlot], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and padded JSON header for tensors stored in ``slots`` order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    begin = 0
    for slot in slots:
        end = begin + slot.nbytes
        header[slot.key] = {"dtype": slot.dtype, "shape": list(slot.shape), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(
    path: str,
    slots: Sequence[TensorSlot],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file, pulling ``tensors`` (one per slot, in order) one at a time.

    The file is fsync'ed before returning. Each tensor must match its slot's shape and dtype.
    """
    produced = iter(tensors)
    with open(path, "wb") as f:
        f.write(header_bytes(slots, metadata))
        for slot in slots:
            tensor = next(produced, None)
            if tensor is None:
                raise CheckpointError(f"{path}: no tensor for header entry {slot.key!r}")
            f.write(raw_bytes(_checked(slot, tensor)))
            del tensor  # hold one tensor at a time, even while the next one is produced
        f.flush()
        os.fsync(f.fileno())


def _checked(slot: TensorSlot, tensor: torch.Tensor) -> torch.Tensor:
    if tuple(tensor.shape) != slot.shape or tensor.dtype != name_to_dtype(slot.dtype, slot.key):
        raise CheckpointError(
            f"tensor {slot.key!r} is {tensor.dtype}{list(tensor.shape)} but its header entry says "
            f"{slot.dtype}{list(slot.shape)}"
        )
    return tensor.detach().cpu().contiguous()


def fsync_file(path: str) -> None:
    """Flush a file or directory entry to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_file(path: str):
    """A lazy reader of ``path`` (``safetensors.safe_open``), with a clear error if unreadable."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist") from None
    except Exception as err:  # safetensors raises its own error types for a bad header/size
        raise CheckpointError(f"checkpoint file {path} is damaged or truncated: {err}") from None
