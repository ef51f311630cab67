"""Run a redistribute plan on this rank's block, one step at a time, through ``comm``."""

from __future__ import annotations

import torch

from shardwise import blocks, comm
from shardwise.placement import Placement, Replicate, Shard
from shardwise.redistribute.cross_mesh import plan_cross_mesh
from shardwise.redistribute.plan import Plan, Step, plan_redistribute
from shardwise.spec import DTensorSpec, local_shape_and_offset

__all__ = ["plan_for", "redistribute_local"]


def plan_for(src: DTensorSpec, dst: DTensorSpec) -> Plan:
    """The (cached) plan taking a tensor laid out as ``src`` to ``dst``."""
    meta = src.tensor_meta
    itemsize = torch.empty((), dtype=meta.dtype).element_size()
    return plan_redistribute(meta.shape, itemsize, src.mesh.shape, src.placements, dst.placements)


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """This rank's block of the tensor laid out as ``dst``, given its block under ``src``.

    Every rank of the mesh must call this with the same specs: it enters the plan's collectives.
    A rank outside the mesh holds nothing and returns its (empty) block unchanged. ``dst`` may
    be on another mesh over the same ranks (``cross_mesh``).
    """
    if blocks.PENDING:  # from_local calls not yet confirmed across ranks (see shardwise.blocks)
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
        layout[step.axis] = step.dst
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
