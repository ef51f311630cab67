"""What a load or consolidate reads from: a committed checkpoint directory or one safetensors file.

``open_source`` gives the metadata (parsed and validated) and the directory its file names are
relative to (a ``Source``, ``checkpoint/readable.py``: the readers of torch's and Hugging Face's
formats in ``shardwise.interop`` build one too, and import that module, not this one, so the
arrow from here to them is the only one). A plain safetensors file (say ``model.state_dict()`` saved by
``safetensors.torch.save_file``) is seen as a checkpoint whose every tensor is one chunk
without a checksum. ``ChunkReader`` fetches chunks: a chunk with a checksum is read whole and
verified; one without is read only where needed (``safe_open(...).get_slice``).
"""

from __future__ import annotations

import contextlib
import os

import torch

from shardwise.checkpoint.commit import committed_dir
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import METADATA_FILE, Chunk, Metadata, TensorEntry, crc32_of, name_to_dtype
from shardwise.checkpoint.assignment import Block
from shardwise.checkpoint.readable import DCP_METADATA_FILE, HF_INDEX_FILE, HF_SINGLE_FILE, Source
from shardwise.checkpoint.safetensors_io import open_file

__all__ = ["Source", "open_source", "ChunkReader", "DCP_METADATA_FILE", "HF_INDEX_FILE"]

def open_source(path: str) -> Source:
    """The checkpoint at ``path``: a directory saved by ``save``, or a ``.safetensors`` file.

    Raises:
        CheckpointError: nothing committed there, or unreadable / invalid metadata.
    """
    if path.endswith(".safetensors") and not os.path.isdir(path):
        return Source(_file_metadata(path), os.path.dirname(os.path.abspath(path)), path)
    if os.path.isfile(os.path.join(path, DCP_METADATA_FILE)):  # written by torch.distributed.checkpoint
        from shardwise.interop.dcp import dcp_source  # imports torch's checkpoint stack only when needed

        return dcp_source(path)
    if os.path.basename(path) == HF_INDEX_FILE or os.path.isfile(os.path.join(path, HF_INDEX_FILE)):
        from shardwise.interop.huggingface import hf_source

        return hf_source(path)
    single = os.path.join(path, HF_SINGLE_FILE)  # a Hugging Face directory small enough for one file
    if os.path.isfile(single) and not os.path.exists(os.path.join(path, METADATA_FILE)):
        return Source(_file_metadata(single), path, single)
    directory = committed_dir(path)
    meta_path = os.path.join(directory, METADATA_FILE)
    try:
        with open(meta_path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot read {meta_path}: {err}") from None
    return Source(Metadata.from_json(text, meta_path), directory, path)


def _file_metadata(path: str) -> Metadata:
    """A plain safetensors file as metadata: one whole-tensor chunk per key, no checksums."""
    tensors = {}
    with open_file(path) as handle:
        for key in handle.keys():
            view = handle.get_slice(key)
            shape = tuple(view.get_shape())
            dtype = view.get_dtype()
            name_to_dtype(dtype, f"{path}: tensor {key!r}")
            chunk = Chunk((0,) * len(shape), shape, os.path.basename(path), key, None)
            tensors[key] = TensorEntry(dtype, shape, (chunk,) if all(shape) else ())
    return Metadata(tensors, {})


class ChunkReader:
    """Reads chunks of one source, opening each file once; use as a context manager."""

    def __init__(self, source: Source) -> None:
        self._source = source
        self._handles: dict[str, object] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _handle(self, file: str):
        if file not in self._handles:
            path = os.path.join(self._source.directory, file)
            self._handles[file] = self._stack.enter_context(self._source.opener(path))
        return self._handles[file]

    def read(self, fqn: str, entry: TensorEntry, chunk: Chunk, part: Block) -> torch.Tensor:
        """``part`` (a box inside ``chunk``) of tensor ``fqn``, verified when the chunk has a checksum."""
        if chunk.crc32 is None:
            return self._read_part(fqn, entry, chunk, part)
        data = self._read_whole(fqn, entry, chunk)
        return data[part.slices_in(Block(chunk.offsets, chunk.sizes))]

    def _read_whole(self, fqn: str, entry: TensorEntry, chunk: Chunk) -> torch.Tensor:
        try:
            data = self._handle(chunk.file).get_tensor(chunk.key)
        except CheckpointError:
            raise
        except Exception as err:  # a missing key or a short file, as safetensors reports it
            raise CheckpointError(f"{self._where(fqn, chunk)}: cannot read the chunk ({err})") from None
        self._check(fqn, entry, chunk, data)
        return data

    def _read_part(self, fqn: str, entry: TensorEntry, chunk: Chunk, part: Block) -> torch.Tensor:
        try:
            if not part.sizes:  # a 0-d tensor: nothing to slice
                return self._handle(chunk.file).get_tensor(chunk.key)
            view = self._handle(chunk.file).get_slice(chunk.key)
            return view[part.slices_in(Block(chunk.offsets, chunk.sizes))]
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{self._where(fqn, chunk)}: cannot read the chunk ({err})") from None

    def _check(self, fqn: str, entry: TensorEntry, chunk: Chunk, data: torch.Tensor) -> None:
        dtype = name_to_dtype(entry.dtype, fqn)
        if tuple(data.shape) != chunk.sizes or data.dtype != dtype:
            raise CheckpointError(
                f"{self._where(fqn, chunk)}: the file holds {data.dtype}{list(data.shape)} where the metadata "
                f"says {dtype}{list(chunk.sizes)}"
            )
        crc = crc32_of(data)
        if crc != chunk.crc32:
            raise CheckpointError(
                f"{self._where(fqn, chunk)}: checksum mismatch (crc32 {crc:#010x}, metadata says "
                f"{chunk.crc32:#010x}): the file is corrupted"
            )

    def _where(self, fqn: str, chunk: Chunk) -> str:
        path = os.path.join(self._source.directory, chunk.file)
        return f"tensor {fqn!r}, chunk {chunk.key!r} in {path}"
