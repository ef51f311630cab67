"""The data-parallel mesh of fully_shard / replicate, and how it composes with a TP mesh.

fully_shard takes a 1-D mesh (every rank holds a shard) or a 2-D (replicate, shard) mesh
(HSDP: shards within the last axis, whole replicas along the first). A parameter that is
already a DTensor on another mesh of the same root (tensor parallel, say ``mesh2d["tp"]``)
keeps that layout and gains the data-parallel placements on the combined mesh.

Combined layout. shardwise applies mesh axes in order: the first axis cuts the global tensor,
the next cuts that piece, and so on. FSDP shards the block TP already gave each rank, so the
combined mesh lists the parameter's own axes FIRST and the data-parallel axes after them:
``root["tp", "dp"]`` with placements ``[<TP placement>, Shard(0)]``. This is exactly the data
each rank holds, also when TP itself cuts dim 0 (colwise ``Shard(0)``: rank (tp=t, dp=d) holds
chunk d of TP chunk t), so ``full_tensor()``, redistribution and checkpoints see the true
global tensor. (Listing "dp" first would describe chunk t of chunk d, a different block.)
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.core.mesh import DeviceMesh, check_mesh
from shardwise.core.placement import Placement, Replicate, Shard
from shardwise.core.spec import DTensorSpec

__all__ = ["DataParallelMesh"]


@dataclass(frozen=True, slots=True)
class DataParallelMesh:
    """A 1-D (shard) or 2-D (replicate, shard) data-parallel mesh with its axis roles."""

    mesh: DeviceMesh

    @staticmethod
    def of(mesh: DeviceMesh, where: str) -> "DataParallelMesh":
        """Validate ``mesh`` for ``where`` (an API call naming the module) and wrap it."""
        check_mesh(mesh, where)
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"{where}: the mesh must be 1-D (shard) or 2-D (replicate, shard) for HSDP; "
                f"got {mesh} with {mesh.ndim} axes"
            )
        if mesh.get_coordinate() is None:
            raise ValueError(f"{where}: rank {mesh.get_rank()} is not in {mesh.describe()}")
        return DataParallelMesh(mesh)

    @property
    def shard_axis(self) -> int:
        """Axis the parameters are sharded over (the last)."""
        return self.mesh.ndim - 1

    @property
    def replicate_axis(self) -> int | None:
        """Axis holding whole replicas (HSDP), or None on a 1-D mesh."""
        return 0 if self.mesh.ndim == 2 else None

    @property
    def world(self) -> int:
        """Ranks sharing one replica's shards."""
        return self.mesh.size(self.shard_axis)

    @property
    def rank(self) -> int:
        """This rank's index along the shard axis."""
        return self.mesh.get_local_rank(self.shard_axis)

    @property
    def placements(self) -> tuple[Placement, ...]:
        """Data-parallel placements of a sharded parameter on this mesh."""
        return (Shard(0),) if self.mesh.ndim == 1 else (Replicate(), Shard(0))

    def composed(self, inner: DTensorSpec | None) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """Mesh and placements of a sharded parameter whose own layout is ``inner`` (or plain)."""
        if inner is None:
            return self.mesh, self.placements
        names = tuple(inner.mesh.mesh_dim_names) + tuple(self.mesh.mesh_dim_names)
        return self.mesh._root[names], tuple(inner.placements) + self.placements

    def composition_problem(self, inner: DTensorSpec) -> str | None:
        """Why a parameter laid out as ``inner`` cannot gain this mesh's placements, or None."""
        if any(p.is_partial() for p in inner.placements):
            return f"has a pending reduction ({inner.render()} on {inner.mesh}); parameters cannot be Partial"
        if not inner.mesh.mesh_dim_names or not self.mesh.mesh_dim_names:
            return f"lives on {inner.mesh}; composing with {self.mesh} needs named sub-meshes of one root mesh"
        unrelated = f"lives on {inner.mesh}, which is not a sub-mesh of the same root mesh as {self.mesh}"
        try:
            # By layout, not object identity: equal meshes may come from different root objects.
            if self.mesh._root[tuple(inner.mesh.mesh_dim_names)] != inner.mesh:
                return unrelated
        except KeyError:
            return unrelated
        if set(inner.mesh.mesh_dim_names) & set(self.mesh.mesh_dim_names):
            return f"lives on {inner.mesh}, which shares axes with the data-parallel mesh {self.mesh}"
        try:
            self.composed(inner)
        except (KeyError, ValueError) as err:
            return f"lives on {inner.mesh}, which cannot be combined with {self.mesh}: {err}"
        return None
