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

from shardwise.compile.opaque import tracing
from shardwise import comm
from shardwise.tensor import agreement
from shardwise.core import mesh as mesh_module
from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Placement, Replicate, Shard
from shardwise.redistribute.bound import coordinates, intersect, needs_value
from shardwise.redistribute.cross_mesh import plan_cross_mesh
from shardwise.redistribute.exchange import plan_exchange
from shardwise.redistribute.pending import drop, lift_transfers
from shardwise.redistribute.planner import Plan, Step, StepKind, plan_redistribute
from shardwise.core.spec import DTensorSpec, local_shape_and_offset

__all__ = ["plan_for", "redistribute_local"]


def plan_for(src: DTensorSpec, dst: DTensorSpec) -> Plan:
    """The (cached) plan taking a tensor laid out as ``src`` to ``dst``."""
    meta = src.tensor_meta
    itemsize = meta.dtype.itemsize
    flattened = flattened_groups(src.mesh) if src.mesh.ndim > 1 else ()
    return plan_redistribute(meta.shape, itemsize, src.mesh.shape, src.placements, dst.placements, flattened)


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
    return mesh_module.group_cached(ranks) or ranks == tuple(range(world))


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
    if agreement.PENDING and not tracing():  # from_local calls not yet confirmed (see shardwise.tensor.agreement)
        agreement.settle(src.mesh)
        agreement.settle(dst.mesh)
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
    if step.target:  # an exchange (or a relayout: one that moves nothing)
        return _run_exchange(local, step, spec, layout)
    if kind is StepKind.RELABEL:
        return local
    if kind is StepKind.LOCAL_CHUNK:
        lengths = _lengths(spec, layout, axis, new.dim)
        me = mesh.get_local_rank(axis)
        return local.narrow(new.dim, sum(lengths[:me]), lengths[me])
    if kind is StepKind.PARTITION:
        return new.partition_value(local, mesh.get_local_rank(axis))
    if kind is StepKind.ALL_GATHER:
        return comm.all_gather(local, mesh, axis, cur.dim, _lengths(spec, layout, axis, cur.dim))
    if kind is StepKind.ALL_REDUCE and step.flattened:
        return comm.all_reduce(local, _flat_mesh(mesh, step.flattened), 0, cur.reduce_op)
    if kind is StepKind.ALL_REDUCE:
        return comm.all_reduce(local, mesh, axis, cur.reduce_op)
    if kind is StepKind.REDUCE_SCATTER:
        lengths = _lengths(spec, layout, axis, new.dim)
        return comm.reduce_scatter(local, mesh, axis, new.dim, cur.reduce_op, lengths)
    if kind is StepKind.ALL_TO_ALL:
        split = _lengths(spec, layout, axis, new.dim)
        cat = _lengths(spec, layout, axis, cur.dim)
        return comm.all_to_all(local, mesh, axis, new.dim, split, cur.dim, cat)
    raise AssertionError(f"unknown redistribute step {step}")


def _run_exchange(local: torch.Tensor, step: Step, spec: DTensorSpec, layout: tuple) -> torch.Tensor:
    """One all_to_all over the step's (flattened) group: send each peer the runs of the boxes
    the schedule gives it, build this rank's target block from what it keeps and receives."""
    mesh = spec.mesh
    shape, mesh_shape = tuple(spec.shape), tuple(mesh.shape)
    kept = step.kept  # axes whose reduction stays pending: the schedule runs in each slice
    sub_layout, sub_target = drop(layout, kept), drop(step.target, kept)
    ex = plan_exchange(shape, drop(mesh_shape, kept), sub_layout, sub_target)
    group = _Group(mesh, step.axes)
    me, coords, size, peer = group.me, group.coords, group.size, group.peer
    in_group = group.mine(lift_transfers(ex.transfers, mesh_shape, kept, coords[me]))
    src_offset = local_shape_and_offset(shape, mesh_shape, coords[me], layout)[1]
    dst_shape, dst_offset = local_shape_and_offset(shape, mesh_shape, coords[me], step.target)
    out = local.new_empty(dst_shape)
    own = intersect((src_offset, tuple(local.shape)), (dst_offset, dst_shape))
    reducing = any(p.is_partial() for p in sub_layout)  # Partial(sum): add every contribution
    if not needs_value(sub_target, drop(coords[me], kept)):  # it still sends what it holds
        out, own = _identity(out, step.target), None
    if reducing:
        out.zero_()
    if own is not None:
        _region(out, dst_offset, own).copy_(_region(local, src_offset, own))
    send_counts, recv_counts = [0] * size, [0] * size
    pieces: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for t in in_group:
        if t.sender == me:
            pieces[peer(t.receiver)].append(_region(local, src_offset, t.box).reshape(-1)[t.start:t.stop])
            send_counts[peer(t.receiver)] += t.stop - t.start
        if t.receiver == me:
            recv_counts[peer(t.sender)] += t.stop - t.start
    if sum(t.stop - t.start for t in in_group) == 0:
        return out
    send = torch.cat([p for ps in pieces for p in ps]) if any(send_counts) else local.new_empty(0)
    recv = comm.all_to_all_counts(send, send_counts, recv_counts, group.mesh, group.axis)
    _place(out, dst_offset, recv, [t for t in in_group if t.receiver == me], peer, recv_counts, reducing)
    return out


class _Group:
    """The (flattened) group of a step's ``axes`` seen from this rank: its 1-D mesh and axis,
    this rank's row-major mesh index ``me``, and each rank's index in the group (``peer``)."""

    def __init__(self, mesh: DeviceMesh, axes: tuple[int, ...]) -> None:
        self.mesh_shape = tuple(mesh.shape)
        self.coords = coordinates(self.mesh_shape)
        self.me = self.coords.index(tuple(mesh.get_coordinate()))
        self.axes = axes
        if len(axes) > 1:
            self.mesh, self.axis = _flat_mesh(mesh, axes), 0
        else:
            self.mesh, self.axis = mesh, axes[0]
        self.size = math.prod(self.mesh_shape[a] for a in axes)
        self.others = [a for a in range(len(self.mesh_shape)) if a not in axes]

    def peer(self, r: int) -> int:
        """Index of rank ``r`` in its (flattened) group, row-major over ``axes``."""
        index = 0
        for a in self.axes:
            index = index * self.mesh_shape[a] + self.coords[r][a]
        return index

    def mine(self, transfers) -> list:
        """The transfers within this rank's copy of the group (same coordinate off ``axes``)."""
        here = self.coords[self.me]
        return [t for t in transfers if all(self.coords[t.sender][a] == here[a] for a in self.others)]


def _place(out, dst_offset, recv, incoming, peer, recv_counts, add: bool) -> None:
    """Cut ``recv`` (peers in group order, each peer's transfers in schedule order) into runs and
    write (``add``: add) every box they complete into ``out``. In a reducing exchange one box
    arrives once per contribution: runs are grouped by their sender's contribution."""
    starts = [sum(recv_counts[:p]) for p in range(len(recv_counts))]
    runs: dict = {}
    for t in incoming:  # schedule order within a sender = the order it packed them
        p = peer(t.sender)
        n = t.stop - t.start
        runs.setdefault((t.box, t.source), []).append((t.start, recv[starts[p]:starts[p] + n]))
        starts[p] += n
    for (box, _), parts in runs.items():
        flat = torch.cat([run for _, run in sorted(parts, key=lambda x: x[0])]).view(box[1])
        region = _region(out, dst_offset, box)
        region.add_(flat) if add else region.copy_(flat)


def _region(block: torch.Tensor, offset, box) -> torch.Tensor:
    """The view of ``block`` (at global ``offset``) covering the global ``box``."""
    view = block
    for d, (o, b, n) in enumerate(zip(offset, box[0], box[1])):
        view = view.narrow(d, b - o, n)
    return view


def _identity(out: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The block of a rank off coordinate 0 of a Partial target: the reduction's identity."""
    op = next(p for p in layout if p.is_partial() and p.identity() is not None)
    return out.fill_(op.identity())
