"""The ``torch.distributed.checkpoint`` (DCP) format: read by ``shardwise.checkpoint.load``, and
written for torch by ``save_dcp``.

Reading goes through shardwise's own loader: a DCP directory (recognized by its ``.metadata``
file) is presented as a checkpoint source whose tensors are the chunks DCP recorded (each
rank's shard as torch saved it), so ``shardwise.checkpoint.load`` reshards it into any mesh,
placements and world size with its usual validation and all-or-nothing semantics. Each rank
reads only the chunks that overlap its blocks. Non-tensor entries (DCP pickles them with
``torch.save``) are read with ``torch.load(weights_only=True)``; containers (an optimizer's
``param_groups``) are flattened into shardwise's dotted keys. ``.metadata`` itself is a pickle,
read with torch's own reader: load checkpoints you trust, as with torch.

Writing converts every shardwise DTensor to torch's (zero-copy, ``to_torch``) and calls
``torch.distributed.checkpoint.save``, so the result is exactly what torch writes and loads
into torch's fully_shard / tensor-parallel models (``dcp.load`` reshards on torch's side).
"""

from __future__ import annotations

import io
import os
from typing import Any, Mapping

import torch

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.flatten import flatten
from shardwise.checkpoint.format import Chunk, Metadata, TensorEntry, dtype_to_name
from shardwise.checkpoint.readable import Source
from shardwise.tensor.dtensor import DTensor

__all__ = ["dcp_source", "save_dcp"]


def dcp_source(path: str) -> Source:
    """The DCP checkpoint directory ``path`` as a shardwise checkpoint source."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - unpickling reports anything
        raise CheckpointError(f"cannot read the torch.distributed.checkpoint metadata of {path}: {err}") from None
    tensors: dict[str, TensorEntry] = {}
    values: dict[str, Any] = {}
    for fqn, item in meta.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            info = meta.storage_data[MetadataIndex(fqn)]
            value = _read_value(path, fqn, info)
            values.update(_flat_values(fqn, value))
            continue
        dtype = dtype_to_name(item.properties.dtype, fqn)
        chunks = tuple(_chunk(path, fqn, c, meta.storage_data[MetadataIndex(fqn, c.offsets)]) for c in item.chunks
                       if all(c.sizes))
        tensors[fqn] = TensorEntry(dtype, tuple(item.size), chunks)
    return Source(Metadata(tensors, values), path, path, opener=_DcpFile)


def _chunk(path: str, fqn: str, chunk: Any, info: Any) -> Chunk:
    if info.transform_descriptors:
        raise CheckpointError(f"{path}: tensor {fqn!r} is stored with transforms {list(info.transform_descriptors)}, "
                              f"which shardwise does not read")
    name = info.relative_path
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        raise CheckpointError(f"{path}: tensor {fqn!r} names file {name!r} outside the checkpoint directory")
    return Chunk(tuple(chunk.offsets), tuple(chunk.sizes), name, f"{info.offset}:{info.length}", None)


_UNREADABLE = object()


def _read_value(path: str, fqn: str, info: Any) -> Any:
    """A non-tensor entry, or ``_UNREADABLE`` if it is not plain data (then it cannot be loaded)."""
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - an arbitrary pickled object: not data shardwise loads
        return _UNREADABLE


def _flat_values(fqn: str, value: Any) -> dict[str, Any]:
    """A value under shardwise's dotted keys (a container is flattened; odd leaves are skipped)."""
    if value is _UNREADABLE:
        return {}
    if not isinstance(value, (dict, list, tuple)):
        return {fqn: value}
    try:
        return flatten({fqn: value})
    except CheckpointError:
        return {}


class _DcpFile:
    """One ``.distcp`` file, answering ``get_tensor`` / ``get_slice`` for chunk keys ``offset:length``."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._file = None

    def __enter__(self) -> "_DcpFile":
        try:
            self._file = open(self._path, "rb")
        except OSError as err:
            raise CheckpointError(f"checkpoint file {self._path} cannot be opened: {err}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def get_tensor(self, key: str) -> torch.Tensor:
        offset, length = (int(v) for v in key.split(":"))
        self._file.seek(offset)
        data = self._file.read(length)
        if len(data) != length:
            raise CheckpointError(f"checkpoint file {self._path} is truncated (chunk at byte {offset})")
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    get_slice = get_tensor  # the whole chunk; the loader slices it


def save_dcp(state_dict: Mapping, path: str | os.PathLike) -> None:
    """Write ``state_dict`` as a ``torch.distributed.checkpoint`` directory; collective.

    DTensors are handed to torch as its own DTensors over the same storage (no copy); plain
    tensors and other values go as they are. Partial DTensors are refused (reduce them first).
    torch's writer is not atomic as ``shardwise.checkpoint.save`` is: write to a fresh path.

    Example:
        >>> save_dcp({"model": model.state_dict()}, "ckpt/dcp")
        >>> torch.distributed.checkpoint.load({"model": torch_model_sd}, checkpoint_id="ckpt/dcp")
    """
    import torch.distributed.checkpoint as torch_dcp

    from shardwise.interop.dtensor import to_torch

    partial = [k for k, v in flatten(state_dict).items() if isinstance(v, DTensor) and v._spec.has_partial]
    if partial:
        raise CheckpointError(f"save_dcp: {partial[0]!r} has pending reductions {list(flatten(state_dict)[partial[0]].placements)}; "
                              f"reduce it first (redistribute to Replicate or Shard)")
    converted = _map_tensors(state_dict, lambda t: to_torch(t.detach()) if isinstance(t, DTensor) else t)
    torch_dcp.save(converted, checkpoint_id=os.fspath(path))


def _map_tensors(tree: Any, fn) -> Any:
    if isinstance(tree, Mapping):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_map_tensors(v, fn) for v in tree)
    return fn(tree) if isinstance(tree, torch.Tensor) else tree


