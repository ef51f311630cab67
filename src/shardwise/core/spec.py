"""DTensorSpec: a DTensor's identity (mesh + placements + global metadata) and its shard math.

Everything here is pure: given a global shape, a mesh shape, a rank's coordinate and the
placements, it says which block of the global tensor that rank holds. Mesh axes apply in order:
axis 0 cuts the global tensor, axis 1 cuts axis 0's piece, and so on, each cut following
``torch.chunk`` (ceil-sized pieces, trailing pieces shorter or empty). The shards of all ranks
tile the global tensor exactly once (a property test checks it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Placement, Shard, as_placements, check_placements, show_placements

__all__ = ["TensorMeta", "DTensorSpec", "local_shape_and_offset", "contiguous_stride", "dtype_name"]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global (logical) shape, stride and dtype of a DTensor."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(tensor: torch.Tensor) -> "TensorMeta":
        """The metadata of a plain tensor taken as the global tensor."""
        return TensorMeta(tensor.shape, tuple(tensor.stride()), tensor.dtype)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (as ``torch.empty(shape).stride()``)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of the block held by the rank at ``coordinate``.

    Shard dims must already be non-negative. Replicate and Partial axes do not cut.

    Example:
        >>> local_shape_and_offset((5, 4), (2, 2), (1, 1), [Shard(0), Shard(0)])
        ((1, 4), (4, 0))
    """
    shape = list(global_shape)
    offset = [0] * len(shape)
    for axis_size, index, placement in zip(mesh_shape, coordinate, placements):
        if isinstance(placement, Shard):
            length, start = Shard.chunk(shape[placement.dim], axis_size, index)
            shape[placement.dim] = length
            offset[placement.dim] += start
    return tuple(shape), tuple(offset)


_DTYPE_NAMES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def dtype_name(dtype: torch.dtype) -> str:
    """Short dtype name as used in renderings (f32, bf16, i64, ...)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True, slots=True, eq=False)
class DTensorSpec:
    """Mesh, one placement per mesh axis, and the global tensor metadata.

    Frozen and hashable: it is the key of the dispatch and redistribute caches. Construction
    validates the placements against the mesh and (when known) the tensor's rank, and
    normalizes negative Shard dims.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta | None = None
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    # This rank's (block shape, offset), computed on first use: view rewrites ask on every call.
    _here: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        placements = _validated(self.mesh, self.placements, self.tensor_meta)
        object.__setattr__(self, "placements", placements)
        # Hashed on every dispatch as part of the cache key: compute it once.
        object.__setattr__(self, "_hash", hash((self.mesh, placements, self.tensor_meta)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        # Rebuilt, not restored: the cached hash depends on the process (string hashing).
        return DTensorSpec, (self.mesh, self.placements, self.tensor_meta)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, DTensorSpec)
            and self._hash == other._hash
            and self.placements == other.placements
            and self.tensor_meta == other.tensor_meta
            and self.mesh == other.mesh
        )

    # ------------------------------------------------------------------ shape
    @property
    def shape(self) -> torch.Size:
        return self._meta().shape

    @property
    def ndim(self) -> int:
        return len(self._meta().shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._meta().dtype

    def _meta(self) -> TensorMeta:
        if self.tensor_meta is None:
            raise RuntimeError(f"spec {self.placements} on {self.mesh} has no tensor metadata")
        return self.tensor_meta

    def local_shape(self, coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
        """Shape of the block held at ``coordinate`` (this rank's by default)."""
        return self.local_shape_and_offset(coordinate)[0]

    def local_shape_and_offset(
        self, coordinate: Sequence[int] | None = None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shape and global offset of the block held at ``coordinate`` (this rank's by default).

        A rank outside the mesh holds an empty block.
        """
        if coordinate is None:
            here = self._here
            if here is None:
                here = self._block_here()
                object.__setattr__(self, "_here", here)
            return here
        return local_shape_and_offset(self.shape, self.mesh.shape, coordinate, self.placements)

    def _block_here(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        coordinate = self.mesh.get_coordinate()
        if coordinate is None:
            return (0,) * self.ndim, (0,) * self.ndim
        return local_shape_and_offset(self.shape, self.mesh.shape, coordinate, self.placements)

    # ------------------------------------------------------------------ placements
    def shard_axes(self, dim: int) -> list[int]:
        """Mesh axes that shard tensor dim ``dim``, in order."""
        return [i for i, p in enumerate(self.placements) if p.is_shard(dim)]

    def is_replicated(self) -> bool:
        """True if every mesh axis holds the whole value (a method, as torch's)."""
        return all(p.is_replicate() for p in self.placements)

    def is_sharded(self) -> bool:
        """True if some mesh axis cuts the tensor."""
        return any(p.is_shard() for p in self.placements)

    @property
    def has_partial(self) -> bool:
        return any(p.is_partial() for p in self.placements)

    # ------------------------------------------------------------------ torch's spec fields
    # The derived views torch's DTensorSpec documents, for code written against it
    # (docs/api.md): per tensor dim, per mesh axis, or one count.
    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh

    @property
    def stride(self) -> tuple[int, ...]:
        return self._meta().stride

    @property
    def num_shards(self) -> int:
        """How many blocks the tensor is cut into: the product of the sizes of the Shard axes."""
        return math.prod(self.mesh.size(i) for i, p in enumerate(self.placements) if p.is_shard())

    @property
    def num_shards_map(self) -> list[int]:
        """Per tensor dim, how many pieces the Shard axes cut it into (1: whole)."""
        pieces = [1] * self.ndim
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard):
                pieces[p.dim] *= self.mesh.size(i)
        return pieces

    @property
    def dim_map(self) -> list[int]:
        """Per tensor dim, the mesh axis that shards it, -1 where none does.

        Raises:
            ValueError: a tensor dim is sharded by two mesh axes (``[Shard(0), Shard(0)]``),
                which one axis per dim cannot say; ``placements`` can.
        """
        axes = [-1] * self.ndim
        for i, p in enumerate(self.placements):
            if isinstance(p, Shard) and axes[p.dim] >= 0:
                raise ValueError(f"Tensor dim {p.dim} is already sharded on mesh dim {axes[p.dim]}, and dim_map "
                                 f"has one mesh axis per tensor dim: read placements instead ({self.render()} on {self.mesh})")
            if isinstance(p, Shard):
                axes[p.dim] = i
        return axes

    @property
    def sums(self) -> list[int]:
        """The mesh axes holding a pending reduction (Partial)."""
        return [i for i, p in enumerate(self.placements) if p.is_partial()]

    def with_placements(self, placements: Sequence[Placement]) -> "DTensorSpec":
        """The same tensor on the same mesh, laid out by ``placements``."""
        return DTensorSpec(self.mesh, as_placements(placements), self.tensor_meta)

    # ------------------------------------------------------------------ rendering
    def render(self) -> str:
        """Compact form used in every message: ``f32[2048@dp_shard,256]`` (Partial as ``{P(sum)@tp}``)."""
        return render_layout(self.mesh, self.placements, self.tensor_meta)

    def __repr__(self) -> str:
        return f"DTensorSpec({self.render()} on {self.mesh})"


def render_layout(
    mesh: DeviceMesh, placements: Sequence[Placement], meta: TensorMeta | None
) -> str:
    """Render a layout as ``dtype[dim@axes,...]`` plus pending reductions."""
    if meta is None:
        return "[" + ", ".join(map(str, placements)) + "]"
    dims = []
    for d, size in enumerate(meta.shape):
        axes = [mesh.axis_name(i) for i, p in enumerate(placements) if p.is_shard(d)]
        dims.append(f"{size}@{'@'.join(axes)}" if axes else str(size))
    partial = [f"{p}@{mesh.axis_name(i)}" for i, p in enumerate(placements) if p.is_partial()]
    suffix = "{" + ",".join(partial) + "}" if partial else ""
    return f"{dtype_name(meta.dtype)}[{','.join(dims)}]{suffix}"


def _validated(
    mesh: DeviceMesh, placements: Sequence[Placement], meta: TensorMeta | None
) -> tuple[Placement, ...]:
    """Placements checked against the mesh and tensor rank, with Shard dims made non-negative."""
    shape = tuple(meta.shape) if meta is not None else None

    def where(shown: object) -> str:
        return f"tensor of shape {list(shape) if shape is not None else '?'} on {mesh} with placements {shown}"

    try:
        placements = check_placements(placements)
    except TypeError as err:
        raise TypeError(f"{err} ({where(show_placements(placements))})") from None
    except ValueError as err:
        raise ValueError(f"{err} ({where(list(placements))})") from None
    if len(placements) != mesh.ndim:
        raise ValueError(
            "`placements` must have the same length as `device_mesh.ndim`! Found placements length: "
            f"{len(placements)}, and device_mesh.ndim: {mesh.ndim}. Need one placement per mesh axis "
            f"({where(list(placements))})"
        )
    if shape is None:
        return placements
    out = []
    for p in placements:
        if isinstance(p, Shard):
            if not -len(shape) <= p.dim < len(shape):
                raise ValueError(f"Shard({p.dim}) is outside the tensor's {len(shape)} dims ({where(list(placements))})")
            p = p.normalized(len(shape))
        out.append(p)
    return tuple(out)
