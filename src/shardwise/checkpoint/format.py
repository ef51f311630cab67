"""The on-disk metadata of a checkpoint: ``metadata.json``, and its validation.

A checkpoint is a directory of safetensors files (one per writing rank) plus ``metadata.json``,
which says, for every tensor, its global shape and dtype and where each chunk of it lives
(file, safetensors key, offsets, sizes, crc32 of the chunk's bytes), and holds the non-tensor
values. ``metadata.json`` is written last: its presence marks a committed checkpoint.

Reading never runs pickle: the metadata is JSON and the tensors are raw little-endian bytes.
Everything read from disk is validated here before it is trusted (file names stay inside the
checkpoint directory, chunks lie inside their tensor and tile it).
"""

from __future__ import annotations

import ctypes
import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from shardwise.checkpoint.errors import CheckpointError

__all__ = [
    "FORMAT", "VERSION", "METADATA_FILE", "Chunk", "TensorEntry", "Metadata",
    "dtype_to_name", "name_to_dtype", "raw_bytes", "crc32_of", "chunk_key",
]

FORMAT = "shardwise-checkpoint"
VERSION = 1
METADATA_FILE = "metadata.json"

# torch dtype <-> safetensors dtype name (the names safetensors headers use).
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _attr, _name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _attr):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name
_NAME_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def dtype_to_name(dtype: torch.dtype, key: str) -> str:
    """The safetensors name of ``dtype``; ``key`` names the tensor in the error."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise CheckpointError(
            f"tensor {key!r} has dtype {dtype}, which safetensors cannot store; "
            f"supported: {sorted(str(d) for d in _DTYPE_NAMES)}"
        )
    return name


def name_to_dtype(name: str, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; ``where`` names the source in the error."""
    dtype = _NAME_DTYPES.get(name)
    if dtype is None:
        raise CheckpointError(f"{where}: unknown dtype {name!r}; known: {sorted(_NAME_DTYPES)}")
    return dtype


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (valid while ``tensor`` lives)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("raw_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buffer = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    buffer._owner = tensor  # the view keeps the buffer alive, and the buffer the tensor
    return memoryview(buffer).cast("B")


def crc32_of(tensor: torch.Tensor) -> int:
    """crc32 (zlib) of a contiguous CPU tensor's bytes: the per-chunk checksum."""
    return zlib.crc32(raw_bytes(tensor))


def chunk_key(fqn: str, offsets: tuple[int, ...]) -> str:
    """The safetensors key of the chunk of ``fqn`` starting at ``offsets`` (unique per tensor)."""
    return f"{fqn}@{','.join(map(str, offsets))}"


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored block of a tensor: ``sizes`` elements from ``offsets``, in ``file`` under ``key``.

    ``crc32`` is the zlib crc32 of the block's bytes as stored (row-major); None only for
    tensors read from a plain safetensors file, which carries no checksums.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    key: str
    crc32: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "offsets": list(self.offsets),
                "sizes": list(self.sizes), "crc32": self.crc32}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor of the checkpoint: dtype name, global shape and the chunks that tile it."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape),
                "chunks": [c.to_json() for c in self.chunks]}


@dataclass(frozen=True)
class Metadata:
    """Everything ``metadata.json`` says: tensors by key, and non-tensor values by key."""

    tensors: Mapping[str, TensorEntry]
    values: Mapping[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": self.version,
            "checksum": "crc32",
            "tensors": {k: e.to_json() for k, e in sorted(self.tensors.items())},
            "values": dict(sorted(self.values.items())),
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False)

    @staticmethod
    def from_json(text: str, where: str) -> "Metadata":
        """Parse and validate ``metadata.json`` text; ``where`` (the file) prefixes errors."""
        try:
            doc = json.loads(text)
        except ValueError as err:
            raise CheckpointError(f"{where} is not valid JSON ({err})") from None
        _check_header(doc, where)
        tensors = {k: _parse_entry(k, v, where) for k, v in _mapping(doc, "tensors", where).items()}
        return Metadata(tensors, dict(_mapping(doc, "values", where)), doc["version"])


def _check_header(doc: Any, where: str) -> None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a {FORMAT} metadata file (no 'format': {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{where} has format version {doc.get('version')!r}; this shardwise reads {VERSION}")


def _mapping(doc: dict, name: str, where: str) -> dict:
    value = doc.get(name)
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: {name!r} must be an object, got {type(value).__name__}")
    return value


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise CheckpointError(f"{what} must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _parse_entry(key: str, raw: Any, where: str) -> TensorEntry:
    """One tensor's entry, checked: known dtype, chunks inside the tensor, chunks tile it."""
    what = f"{where}: tensor {key!r}"
    if not isinstance(raw, dict) or not isinstance(raw.get("chunks"), list):
        raise CheckpointError(f"{what}: entry must be an object with 'dtype', 'shape', 'chunks'")
    name_to_dtype(raw.get("dtype"), what)
    shape = _ints(raw.get("shape"), f"{what}: shape")
    chunks = tuple(_parse_chunk(c, shape, what) for c in raw["chunks"])
    covered = sum(c.numel for c in chunks)
    if covered != math.prod(shape):
        raise CheckpointError(
            f"{what}: chunks hold {covered} elements but shape {list(shape)} has {math.prod(shape)}"
        )
    return TensorEntry(raw["dtype"], shape, chunks)


def _parse_chunk(raw: Any, shape: tuple[int, ...], what: str) -> Chunk:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{what}: chunk entries must be objects, got {raw!r}")
    offsets = _ints(raw.get("offsets"), f"{what}: chunk offsets")
    sizes = _ints(raw.get("sizes"), f"{what}: chunk sizes")
    file, key, crc = raw.get("file"), raw.get("key"), raw.get("crc32")
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise CheckpointError(f"{what}: chunk {raw!r} does not have one offset and size per dim of {list(shape)}")
    if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
        raise CheckpointError(f"{what}: chunk at {list(offsets)} of size {list(sizes)} lies outside shape {list(shape)}")
    if not _plain_file_name(file) or not isinstance(key, str):
        raise CheckpointError(f"{what}: chunk file {file!r} / key {key!r} must be a plain file name and a string")
    if crc is not None and (type(crc) is not int or not 0 <= crc < 2**32):
        raise CheckpointError(f"{what}: chunk crc32 {crc!r} is not a 32-bit unsigned integer")
    return Chunk(offsets, sizes, file, key, crc)


def _plain_file_name(name: Any) -> bool:
    """A file directly inside the checkpoint directory: never a path that escapes it."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
