"""Moving a DTensor to another mesh over the same ranks: a relabelling plus a redistribute.

Two meshes over the same set of ranks (a reshaped mesh, a flattened one, other axis names,
another order of the ranks) are the same processes arranged differently; what changes is which
block each rank is said to hold. The move is planned (pure: no process group) as:

1. on the SOURCE mesh, redistribute to a layout ``via`` whose block on every rank is exactly
   the block the target layout gives that rank on the target mesh;
2. relabel: the same local tensor, now read with the target mesh's spec (no data moves).

Among the layouts that qualify the fastest is chosen (the planner's predicted time). All-Replicate
always qualifies in a weaker sense: every rank holds everything and takes its target block by a
local chunk, so it is the fallback (one all_gather / all_reduce per sharded / partial axis). A
target Partial is reached from its Replicate version by a free local partition.

Example: a (2, 2) mesh [[0, 1], [2, 3]] with [Shard(0), Shard(0)] and its flattened (4,) mesh
with [Shard(0)] give every rank the same rows: the move costs nothing. The mesh [[0, 2], [1, 3]]
orders the ranks differently, so the rows must travel.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import torch

from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Placement, Replicate, Shard
from shardwise.redistribute.planner import plan_redistribute
from shardwise.core.spec import DTensorSpec, local_shape_and_offset

__all__ = ["CrossMeshPlan", "plan_cross_mesh", "check_same_ranks", "mesh_ranks"]

Layout = tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class CrossMeshPlan:
    """Redistribute to ``via`` on the source mesh, then read the block as ``landing`` on the
    target mesh, then (free, local) to the target placements."""

    via: Layout
    landing: Layout
    predicted_s: float


def mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """The ranks of a mesh, sorted."""
    return sorted(mesh.flat_ranks())


def check_same_ranks(spec: DTensorSpec, target: DeviceMesh) -> None:
    """Raise (pure: the same on every rank) unless ``target`` holds exactly the ranks of ``spec``'s mesh."""
    source = spec.mesh
    if source.device_type != target.device_type:
        raise ValueError(
            f"redistribute cannot move {spec.render()} from {source} ({source.device_type}) to {target} "
            f"({target.device_type}): the meshes are on different device types"
        )
    if mesh_ranks(source) != mesh_ranks(target):
        raise ValueError(
            f"redistribute cannot move {spec.render()} from {source} (ranks {mesh_ranks(source)}) to {target} "
            f"(ranks {mesh_ranks(target)}): a redistribute keeps the data on the same ranks, only their "
            "arrangement (reshaped, flattened, renamed axes) and the layout may change. To hand the tensor to "
            "other ranks, gather it on the ranks of the first mesh (full = x.full_tensor()) and lay it out on "
            "the second with distribute_tensor(full, other_mesh, placements, src_data_rank=None) where its ranks "
            "hold `full` (e.g. a sub-mesh of the first)"
        )


@lru_cache(maxsize=1024)
def plan_cross_mesh(src: DTensorSpec, dst: DTensorSpec) -> CrossMeshPlan:
    """The cheapest way from ``src`` to ``dst`` on another mesh over the same ranks."""
    target = tuple(Replicate() if p.is_partial() else p for p in dst.placements)
    want = _blocks(dst.shape, dst.mesh, target)
    replicated = (Replicate(),) * src.mesh.ndim
    best = CrossMeshPlan(replicated, (Replicate(),) * dst.mesh.ndim, _cost(src, replicated))
    for via in _layouts(src.mesh.ndim, len(dst.shape)):
        if _blocks(src.shape, src.mesh, via) == want:
            cost = _cost(src, via)
            if cost <= best.predicted_s:  # equal cost: the relabel needs no local chunk after
                best = CrossMeshPlan(via, target, cost)
    return best


def _layouts(mesh_ndim: int, tensor_ndim: int):
    """Every layout without pending reductions on a mesh of ``mesh_ndim`` axes, in a fixed order."""
    choices = [Replicate()] + [Shard(d) for d in range(tensor_ndim)]
    return itertools.product(choices, repeat=mesh_ndim)


def _blocks(shape: torch.Size, mesh: DeviceMesh, placements: Layout) -> dict[int, tuple]:
    """Rank -> (block shape, block offset) of ``placements`` on ``mesh``."""
    coordinates = itertools.product(*(range(n) for n in mesh.shape))  # row-major, as the ranks
    return {rank: local_shape_and_offset(shape, mesh.shape, coordinate, placements)
            for rank, coordinate in zip(mesh.flat_ranks(), coordinates)}


def _cost(src: DTensorSpec, via: Layout) -> float:
    meta = src.tensor_meta
    itemsize = torch.empty((), dtype=meta.dtype).element_size()
    try:
        return plan_redistribute(meta.shape, itemsize, src.mesh.shape, src.placements, via).predicted_s
    except ValueError:
        return float("inf")
