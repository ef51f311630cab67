"""Run a redistribute plan on this rank's block, one step at a time, through ``comm``."""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.placement import Placement, Replicate, Shard
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
    A rank outside the mesh holds nothing and returns its (empty) block unchanged.
    """
    if src.mesh.get_coordinate() is None:
        return local
    layout = list(src.placements)
    for step in plan_for(src, dst).steps:
        local = _run_step(local, step, src, tuple(layout))
        layout[step.axis] = step.dst
    return local


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
