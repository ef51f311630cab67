"""Hugging Face safetensors checkpoints: a sharded one loads straight into a sharded model, and
a sharded model exports as a consolidated one.

Loading: a directory holding ``model.safetensors.index.json`` (or that file itself) is a
checkpoint source for ``shardwise.checkpoint.load``: the index's ``weight_map`` says which shard
file holds each key, each file's header gives shapes and dtypes, and every rank reads only
the slices its blocks need (``safe_open(...).get_slice``), never a whole tensor it does not
hold. Safetensors files carry no checksums; shapes and dtypes are still checked against the
target.

Exporting (``save_hf``): the files Hugging Face writes, with full tensors under the same keys
and dtypes; rank 0 writes, one shard file's tensors gathered at a time. Given the
``weight_map`` of a checkpoint (``read_weight_map``) the same keys go to the same files, so a
checkpoint loaded and exported unchanged comes back byte for byte.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import torch
import torch.distributed as dist

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.flatten import flatten
from shardwise.checkpoint.format import Chunk, Metadata, TensorEntry, name_to_dtype
from shardwise.checkpoint.safetensors_io import open_file
from shardwise.checkpoint.readable import HF_INDEX_FILE, Source
from shardwise.tensor.dtensor import DTensor

__all__ = ["hf_source", "read_weight_map", "save_hf", "HF_INDEX_FILE"]

SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # Hugging Face's default shard size


def _index_path(path: str) -> str:
    return path if os.path.basename(path) == HF_INDEX_FILE else os.path.join(path, HF_INDEX_FILE)


def read_weight_map(path: str) -> dict[str, str]:
    """The ``weight_map`` (key -> shard file) of the index at ``path`` (a directory or the file)."""
    where = _index_path(path)
    try:
        with open(where) as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read the Hugging Face index {where}: {err}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{where}: no 'weight_map' object of key -> file name")
    bad = sorted({f for f in weight_map.values() if f in ("", ".", "..") or "/" in f or "\\" in f})
    if bad:
        raise CheckpointError(f"{where}: weight_map names files outside the directory: {bad}")
    return weight_map


def hf_source(path: str) -> Source:
    """The sharded safetensors checkpoint at ``path`` as a shardwise checkpoint source."""
    weight_map = read_weight_map(path)
    directory = os.path.dirname(os.path.abspath(_index_path(path)))
    tensors: dict[str, TensorEntry] = {}
    by_file: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in sorted(by_file.items()):
        with open_file(os.path.join(directory, file)) as handle:
            present = set(handle.keys())
            for key in keys:
                if key not in present:
                    raise CheckpointError(f"{_index_path(path)}: key {key!r} is mapped to {file}, which does not hold it")
                view = handle.get_slice(key)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                name_to_dtype(dtype, f"{file}: tensor {key!r}")
                chunk = Chunk((0,) * len(shape), shape, file, key, None)
                tensors[key] = TensorEntry(dtype, shape, (chunk,) if all(shape) else ())
    return Source(Metadata(tensors, {}), directory, path)


def save_hf(
    state_dict: Mapping,
    directory: str | os.PathLike,
    *,
    weight_map: Mapping[str, str] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Export the tensors of ``state_dict`` as a Hugging Face safetensors checkpoint; collective.

    Args:
        state_dict: a model's state dict (DTensors in any layout, plain tensors); its dotted
            keys are the checkpoint's keys, dtypes kept.
        directory: created if needed; gets ``model.safetensors``, or shard files plus
            ``model.safetensors.index.json``.
        weight_map: which file each key goes to (e.g. ``read_weight_map`` of the checkpoint
            the model was loaded from); default: files of at most ``max_shard_bytes`` named
            ``model-0000i-of-0000n.safetensors`` in key order, one ``model.safetensors`` if all fit.

    Example:
        >>> shardwise.checkpoint.load(model.state_dict(), "hf_dir")       # any layout
        >>> save_hf(model.state_dict(), "out", weight_map=read_weight_map("hf_dir"))
    """
    from safetensors.torch import save_file

    tensors = {k: v for k, v in flatten(state_dict).items() if isinstance(v, torch.Tensor)}
    partial = [k for k, v in tensors.items() if isinstance(v, DTensor) and v._spec.has_partial]
    if partial:  # before any gather, on every rank alike
        raise CheckpointError(f"save_hf: {partial[0]!r} has pending reductions "
                              f"{list(tensors[partial[0]].placements)}; reduce it first")
    files = _assign_files(tensors, weight_map, max_shard_bytes)
    rank = dist.get_rank() if dist.is_initialized() else 0
    directory = os.fspath(directory)
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
    for file, keys in files.items():
        full = {k: _gathered(tensors[k]) for k in keys}  # collective: every rank, same order
        if rank == 0:
            save_file(full, os.path.join(directory, file), metadata={"format": "pt"})
        del full
    if rank == 0 and (len(files) > 1 or weight_map is not None):
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: f for f, keys in files.items() for k in sorted(keys)}}
        with open(os.path.join(directory, HF_INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
    if dist.is_initialized():
        dist.barrier()


def _assign_files(tensors: Mapping[str, torch.Tensor], weight_map: Mapping[str, str] | None,
                  max_shard_bytes: int) -> dict[str, list[str]]:
    if weight_map is not None:
        missing = sorted(set(tensors) - set(weight_map))
        if missing:
            raise CheckpointError(f"save_hf: weight_map has no file for keys {missing[:5]}")
        files: dict[str, list[str]] = {}
        for key in tensors:
            files.setdefault(weight_map[key], []).append(key)
        return files
    groups, size = [[]], 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": keys for i, keys in enumerate(groups)}


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, contiguous and on the CPU (a DTensor's gathered on every rank)."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return tensor.detach().cpu().contiguous().clone()
