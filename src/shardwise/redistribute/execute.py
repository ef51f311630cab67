"""Run a redistribute plan on this rank's block, one step at a time, through ``comm``.

A step that reduces several Partial axes at once runs over their flattened group. That group
is used only where it exists already on every rank (``flattened_groups``): creating a process
group is a collective over the whole world, which ranks busy elsewhere (another pipeline
stage) would never join.
"""

from __future__ import annotations

import itertools
import math

import torch

from shardwise.compile import tracing
from shardwise import blocks, comm
from shardwise import mesh as mesh_module
from shardwise.mesh import DeviceMesh
from shardwise.placement import Placement, Replicate, Shard
from shardwise.redistribute.cross_mesh import plan_cross_mesh
from shardwise.redistribute.plan import Plan, Step, plan_redistribute
from shardwise.spec import DTensorSpec, local_shape_and_offset

__all__ = ["plan_for", "redistribute_local"]


def plan_for(src: DTensorSpec, dst: DTensorSpec) -> Plan:
    """The (cached) plan taking a tensor laid out as ``src`` to ``dst``."""
    meta = src.tensor_meta
    itemsize = torch.empty((), dtype=meta.dtype).element_size()
    flattened = flattened_groups(src.mesh) if _partial_axes(src) > 1 else ()
    return plan_redistribute(meta.shape, itemsize, src.mesh.shape, src.placements, dst.placements, flattened)


def _partial_axes(spec: DTensorSpec) -> int:
    return sum(p.is_partial() for p in spec.placements)


# (mesh, number of process groups known) -> axis sets whose flattened group exists.
_FLATTENED: dict = {}
_FLAT_MESHES: dict = {}


def flattened_groups(mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """Sets of two or more axes (each of size > 1) of ``mesh`` whose flattened process group
    exists on every rank, so one all_reduce over it may replace one per axis.

    The answer is the same on every rank: groups are created by all ranks together, and a
    group over the whole world always exists. Cached until new groups appear.
    """
    key = (mesh, mesh_module.num_cached_groups())
    found = _FLATTENED.get(key)
    if found is None:
        axes = [a for a in range(mesh.ndim) if mesh.size(a) > 1]
        found = tuple(
            combo
            for k in range(2, len(axes) + 1)
            for combo in itertools.combinations(axes, k)
            if all(_group_exists(ranks) for ranks in _flat_slices(mesh, combo))
        )
        if len(_FLATTENED) > 256:
            _FLATTENED.clear()
        _FLATTENED[key] = found
    return found


def _root_dims(mesh: DeviceMesh, axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for a in axes for d in mesh._axis_dims[a])


def _flat_slices(mesh: DeviceMesh, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every copy of the flattened axes in the root grid (row-major walk of each)."""
    root, dims = mesh._root, _root_dims(mesh, axes)
    rest = [d for d in range(root.ndim) if d not in dims]
    width = math.prod(root.mesh.shape[d] for d in dims)
    rows = root.mesh.permute(rest + list(dims)).reshape(-1, width)
    return [tuple(int(r) for r in row) for row in rows]


def _group_exists(ranks: tuple[int, ...]) -> bool:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 0
    return ranks in mesh_module._GROUPS or ranks == tuple(range(world))


def _flat_mesh(mesh: DeviceMesh, axes: tuple[int, ...]) -> DeviceMesh:
    """A 1-D mesh over this rank's flattened slice of ``axes`` (its groups exist: see above)."""
    key = (mesh, axes)
    flat = _FLAT_MESHES.get(key)
    if flat is None:
        name = "+".join(mesh.axis_name(a) for a in axes)
        flat = _FLAT_MESHES[key] = mesh._root._submesh((name,), [_root_dims(mesh, axes)])
    return flat


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """This rank's block of the tensor laid out as ``dst``, given its block under ``src``.

    Every rank of the mesh must call this with the same specs: it enters the plan's collectives.
    A rank outside the mesh holds nothing and returns its (empty) block unchanged. ``dst`` may
    be on another mesh over the same ranks (``cross_mesh``).
    """
    if blocks.PENDING and not tracing():  # from_local calls not yet confirmed (see shardwise.blocks)
        blocks.settle(src.mesh)
        blocks.settle(dst.mesh)
    if src.mesh.get_coordinate() is None:
        return local
    if src.mesh != dst.mesh:
        return _to_other_mesh(local, src, dst)
    plan = plan_for(src, dst)
    if plan.collectives:
        _check_block(local, src, plan)
    layout = list(src.placements)
    for step in plan.steps:
        local = _run_step(local, step, src, tuple(layout))
        layout = list(step.apply(tuple(layout)))
    return local


def _to_other_mesh(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """Redistribute on the source mesh so that each rank holds its target block, then relabel
    (see ``cross_mesh``); what is left on the target mesh is free (local chunks, partitions)."""
    plan = plan_cross_mesh(src, dst)
    local = redistribute_local(local, src, src.with_placements(plan.via))
    landed = DTensorSpec(dst.mesh, plan.landing, dst.tensor_meta)
    return redistribute_local(local, landed, dst)


def _check_block(local: torch.Tensor, spec: DTensorSpec, plan: Plan) -> None:
    """Refuse to enter a collective with a block that is not this rank's piece of ``spec``: the
    sizes every rank derives from the spec would not match, and gloo aborts the process."""
    want = spec.local_shape()
    if tuple(local.shape) != want:
        raise ValueError(
            f"rank {spec.mesh.get_rank()} holds a {list(local.shape)} block of {spec.render()} on {spec.mesh}, "
            f"where the layout puts a {list(want)} block; not entering {plan.collectives[0]} with it (the ranks "
            "would disagree on sizes). The block came from DTensor.from_local, a custom op, or a change to "
            "_local_tensor"
        )


def _lengths(spec: DTensorSpec, layout: tuple[Placement, ...], axis: int, dim: int) -> list[int]:
    """Sizes along ``dim`` of every rank's piece on ``axis``, cut from this rank's parent block."""
    mesh = spec.mesh
    parent_layout = layout[:axis] + (Replicate(),) + layout[axis + 1 :]
    parent = local_shape_and_offset(spec.shape, mesh.shape, mesh.get_coordinate(), parent_layout)[0]
    n = mesh.size(axis)
    return [Shard.chunk(parent[dim], n, k)[0] for k in range(n)]


def _run_step(local: torch.Tensor, step: Step, spec: DTensorSpec, layout: tuple) -> torch.Tensor:
    mesh, axis, cur, new = spec.mesh, step.axis, step.src, step.dst
    kind = step.collective
    if kind == "relabel":
        return local
    if kind == "local_chunk":
        lengths = _lengths(spec, layout, axis, new.dim)
        me = mesh.get_local_rank(axis)
        return local.narrow(new.dim, sum(lengths[:me]), lengths[me])
    if kind == "partition":
        return new.partition_value(local, mesh.get_local_rank(axis))
    if kind == "all_gather":
        return comm.all_gather(local, mesh, axis, cur.dim, _lengths(spec, layout, axis, cur.dim))
    if kind == "all_reduce" and step.flattened:
        return comm.all_reduce(local, _flat_mesh(mesh, step.flattened), 0, cur.reduce_op)
    if kind == "all_reduce":
        return comm.all_reduce(local, mesh, axis, cur.reduce_op)
    if kind == "reduce_scatter":
        lengths = _lengths(spec, layout, axis, new.dim)
        return comm.reduce_scatter(local, mesh, axis, new.dim, cur.reduce_op, lengths)
    if kind == "all_to_all":
        split = _lengths(spec, layout, axis, new.dim)
        cat = _lengths(spec, layout, axis, cur.dim)
        return comm.all_to_all(local, mesh, axis, new.dim, split, cur.dim, cat)
    raise AssertionError(f"unknown redistribute step {step}")
