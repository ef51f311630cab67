"""Do the blocks the ranks hold form one layout? The checks behind ``DTensor.from_local``.

``from_local`` wraps each rank's block without copying it. The ranks must agree on the global
metadata, and each block must be the piece the layout assigns to its rank; otherwise the specs
differ from rank to rank, the next collective gets mismatched sizes, and gloo answers that by
aborting the process (SIGABRT, no Python error). Two checks keep that from happening:

* ``run_check=True`` (``check_blocks``): every rank's block metadata (shape, stride, dtype,
  device, requires_grad, a digest of the values where an axis replicates) is gathered over the
  whole mesh; the
  global shape is inferred from all blocks (uneven torch.chunk pieces included) and every
  disagreement is reported, by rank and value, in one error raised on every rank.
* without it (``note`` / ``settle``): nothing is communicated at ``from_local``; the call is
  noted, and before the next redistribute on that mesh the notes are settled: one all_reduce of
  three int64 (over the default group for a mesh spanning the world, else one per mesh axis)
  tells every rank whether all ranks agree. Only if they do not are the notes gathered, to name
  the ranks and blocks in the error that every rank raises.

The all_reduce of ``settle`` is bookkeeping, not data movement: it is issued directly (not
through ``comm``), so ``CommDebugMode`` counts stay those of the program's own collectives.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Placement, Shard
from shardwise.core.spec import DTensorSpec, TensorMeta, contiguous_stride, dtype_name, local_shape_and_offset

__all__ = [
    "BlockInfo", "describe_block", "gather_grid", "check_blocks", "even_shape", "even_stride", "stride_like",
    "global_meta", "note", "settle", "PENDING",
]

Grid = dict[tuple[int, ...], "BlockInfo"]


# ---------------------------------------------------------------------- what one rank holds
@dataclass(frozen=True)
class BlockInfo:
    """One rank's block and call, as gathered by ``run_check`` (picklable, small)."""

    rank: int
    shape: tuple[int, ...]
    dtype: str
    memory: str  # "contiguous", "strided (dims by stride 1, 0)", or "" when too small to tell
    placements: str
    declared: tuple[int, ...] | None  # shape= as passed
    digest: bytes | None  # of the values, when some axis replicates
    error: str = ""  # the placements do not fit this block (e.g. Shard(2) of a 2-D block)
    stride: tuple[int, ...] = ()
    device: str = "cpu"
    requires_grad: bool = False
    declared_stride: tuple[int, ...] | None = None  # stride= as passed


def describe_block(
    local: torch.Tensor, placements: tuple[Placement, ...], declared: Sequence[int] | None, error: str,
    declared_stride: Sequence[int] | None = None,
) -> BlockInfo:
    replicated = any(p.is_replicate() for p in placements)
    digest = _digest(local) if replicated and not local.is_meta else None
    return BlockInfo(
        dist.get_rank(), tuple(local.shape), dtype_name(local.dtype), _memory(local), str(list(placements)),
        tuple(declared) if declared is not None else None, digest, error, tuple(local.stride()),
        local.device.type, local.requires_grad, tuple(declared_stride) if declared_stride is not None else None,
    )


def _memory(t: torch.Tensor) -> str:
    """Memory-layout class of a block; blocks with a dim of size <= 1 do not tell (empty)."""
    if any(s <= 1 for s in t.shape):
        return ""
    if t.is_contiguous():
        return "contiguous"
    order = sorted(range(t.ndim), key=lambda d: (-t.stride(d), d))
    return f"strided (dims by stride {', '.join(map(str, order))})"


def _digest(t: torch.Tensor) -> bytes:
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha1(raw.numpy().tobytes()).digest()


def gather_grid(info: object, mesh: DeviceMesh) -> dict[tuple[int, ...], object]:
    """Every rank's ``info``, keyed by mesh coordinate, on every rank of the mesh.

    One all_gather_object per axis, last axis first: after axis k each rank holds the infos of
    the sub-grid spanned by axes k.., so after axis 0 it holds the whole mesh.
    """
    nested: object = info
    for axis in reversed(range(mesh.ndim)):
        nested = comm.all_gather_object(nested, mesh, axis)
    grid = {}
    for flat in range(mesh.size()):
        coordinate, item = _unravel(flat, mesh.shape), nested
        for index in coordinate:
            item = item[index]
        grid[coordinate] = item
    return grid


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


# ---------------------------------------------------------------------- run_check=True
def check_blocks(
    grid: Grid, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[torch.Size, tuple[int, ...], list[str]]:
    """The global shape and stride the blocks form, and every problem found (empty: they agree).

    The stride is the one the blocks' memory layout gives the global tensor (see
    ``even_stride`` and ``stride_like``); a declared ``stride=`` is the caller's to use.
    Pure and deterministic: every rank computes it from the same grid, so every rank reaches
    the same verdict and raises the same error.
    """
    infos = list(grid.values())
    problems = [f"rank {i.rank}: {i.error}" for i in infos if i.error]
    problems += _differing("ranks passed different placements", {c: i.placements for c, i in grid.items()}, grid)
    problems += _differing("ranks passed different shape=", {c: i.declared for c, i in grid.items()}, grid)
    problems += _differing("ranks passed different stride=", {c: i.declared_stride for c, i in grid.items()}, grid)
    problems += _differing("ranks hold blocks of different ranks (number of dims)",
                           {c: len(i.shape) for c, i in grid.items()}, grid)
    if problems:
        return torch.Size(()), (), problems
    problems += _differing("dtypes differ", {c: i.dtype for c, i in grid.items()}, grid)
    problems += _differing("devices differ", {c: i.device for c, i in grid.items()}, grid)
    problems += _differing("requires_grad differs", {c: i.requires_grad for c, i in grid.items()}, grid)
    shape, shape_problems = _global_shape(grid, mesh, placements, infos[0].declared)
    problems += shape_problems
    memory_problems = _memory_problems(grid)
    problems += memory_problems
    stride: tuple[int, ...] = ()
    if not shape_problems and not memory_problems:
        stride, stride_problems = _global_stride(grid, mesh, placements, shape)
        problems += stride_problems
    if not problems:
        problems += _replica_problems(grid, mesh, placements)
    return shape, stride, problems


def _differing(what: str, values: dict[tuple[int, ...], object], grid: Grid) -> list[str]:
    """``what: 5 on rank 0; 4 on ranks 1, 2, 3`` when the values are not all equal."""
    groups: dict[object, list[int]] = {}
    for coordinate, value in values.items():
        groups.setdefault(value, []).append(grid[coordinate].rank)
    if len(groups) <= 1:
        return []
    return [f"{what}: " + "; ".join(f"{_value(v)} on {_ranks(r)}" for v, r in groups.items())]


def _value(value: object) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _shard_axes(placements: tuple[Placement, ...], dim: int) -> list[int]:
    return [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]


def _global_shape(
    grid: Grid, mesh: DeviceMesh, placements: tuple[Placement, ...], declared: tuple[int, ...] | None
) -> tuple[torch.Size, list[str]]:
    """Each dim: declared, or the common size (unsharded), or the blocks' total (sharded)."""
    ndim = len(next(iter(grid.values())).shape)
    if declared is not None:
        if len(declared) != ndim:
            return torch.Size(()), [f"shape={list(declared)} has {len(declared)} dims but the blocks have {ndim}"]
        return torch.Size(declared), _block_problems(grid, mesh, placements, torch.Size(declared))
    sizes, problems = [], []
    for dim in range(ndim):
        axes = _shard_axes(placements, dim)
        size, problem = _sharded_total(grid, mesh, axes, dim) if axes else _unsharded_size(grid, dim)
        problems += problem
        sizes.append(size)
    if problems:
        return torch.Size(()), problems
    shape = torch.Size(sizes)
    return shape, _block_problems(grid, mesh, placements, shape)


def _unsharded_size(grid: Grid, dim: int) -> tuple[int, list[str]]:
    values = {c: i.shape[dim] for c, i in grid.items()}
    problem = _differing(f"dim {dim} (not sharded) differs", values, grid)
    return next(iter(values.values())), problem


def _sharded_total(grid: Grid, mesh: DeviceMesh, axes: list[int], dim: int) -> tuple[int, list[str]]:
    """The sum of the blocks over each slice spanned by ``axes``: it must be the same everywhere."""
    totals: dict[tuple, int] = {}
    for coordinate, info in grid.items():
        others = tuple(c for a, c in enumerate(coordinate) if a not in axes)
        totals[others] = totals.get(others, 0) + info.shape[dim]
    if len(set(totals.values())) <= 1:
        return next(iter(totals.values())), []
    names = "/".join(mesh.axis_name(a) for a in axes)
    by_total: dict[int, list[int]] = {}
    for coordinate, info in grid.items():
        others = tuple(c for a, c in enumerate(coordinate) if a not in axes)
        by_total.setdefault(totals[others], []).append(info.rank)
    return 0, [f"dim {dim} (sharded over {names}) adds up to different totals: "
               + "; ".join(f"{t} on {_ranks(r)}" for t, r in by_total.items())]


def _block_problems(grid: Grid, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: torch.Size) -> list[str]:
    """Blocks that are not the torch.chunk piece the layout assigns to their rank."""
    wrong = []
    for coordinate, info in grid.items():
        want = local_shape_and_offset(shape, mesh.shape, coordinate, placements)[0]
        if tuple(info.shape) != tuple(want):
            axes = sorted({mesh.axis_name(a) for d in range(len(shape)) if info.shape[d] != want[d]
                           for a in _shard_axes(placements, d)}) or ["-"]
            wrong.append(f"rank {info.rank} along axis {'/'.join(axes)} holds a {list(info.shape)} block "
                         f"where the layout needs {list(want)}")
    return wrong


def _global_stride(
    grid: Grid, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: torch.Size
) -> tuple[tuple[int, ...], list[str]]:
    """The global stride every rank's block implies; ranks whose blocks imply another are named.

    Blocks with a dim of size <= 1 do not tell their layout and follow the others.
    """
    derived = {}
    for coordinate, info in grid.items():
        if info.memory:
            if even_shape(info.shape, mesh, placements) == shape:
                derived[coordinate] = even_stride(info.stride, mesh, placements)
            else:
                derived[coordinate] = stride_like(info.shape, info.stride, shape)
    if not derived:
        return contiguous_stride(shape), []
    problems = _differing("the blocks imply different global strides", derived, grid)
    if problems:
        problems[0] += " (pass blocks with one memory layout, or stride=)"
    return derived[min(derived)], problems


def _memory_problems(grid: Grid) -> list[str]:
    values = {c: i.memory for c, i in grid.items() if i.memory}
    problems = _differing("blocks have different memory layouts", values, grid)
    if problems:
        problems[0] += (" (an op that views the block, such as view, would fail on some ranks only: "
                        "pass .contiguous() blocks)")
    return problems


def _replica_problems(grid: Grid, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> list[str]:
    """Ranks along a Replicate axis must hold equal values."""
    problems = []
    for axis, placement in enumerate(placements):
        if not placement.is_replicate():
            continue
        lines: dict[tuple, dict[bytes, list[int]]] = {}
        for coordinate, info in grid.items():
            line = coordinate[:axis] + coordinate[axis + 1:]
            lines.setdefault(line, {}).setdefault(info.digest, []).append(info.rank)
        split = [groups for groups in lines.values() if len(groups) > 1]
        if split:
            shown = " vs ".join(_ranks(r) for r in split[0].values())
            problems.append(f"replicas differ along axis {mesh.axis_name(axis)}: {shown} hold different values")
    return problems


# ---------------------------------------------------------------------- run_check=False
def even_shape(block: Sequence[int], mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Size:
    """The global shape of even blocks: each sharded dim is this block's size times the ranks
    of every axis that shards it (what from_local infers without run_check or shape=)."""
    shape = list(block)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] *= mesh.size(axis)
    return torch.Size(shape)


def even_stride(block_stride: Sequence[int], mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, ...]:
    """The global stride of even blocks laid out like this one (torch's rule, for equal strides).

    For each mesh axis that shards dim d, every other dim whose stride is at least d's grows
    by the axis size: the global tensor keeps the block's dim order in memory, a permuted
    block giving a permuted global tensor.
    """
    stride = list(block_stride)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            n = mesh.size(axis)
            for d in range(len(stride)):
                if d != p.dim and stride[d] >= stride[p.dim]:
                    stride[d] *= n
    return tuple(stride)


def stride_like(block_shape: Sequence[int], block_stride: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for ``shape`` with the block's dim order in memory (for uneven blocks)."""
    order = sorted(range(len(shape)), key=lambda d: (block_stride[d], block_shape[d], d))  # innermost first
    stride, acc = [0] * len(shape), 1
    for d in order:
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)


@dataclass
class _Notes:
    """from_local calls on one mesh since its last settle.

    ``note`` only appends (from_local stays cheap); ``_fold`` digests the calls at settle time,
    or every ``FOLD_EVERY`` calls so that a mesh that is never redistributed stays bounded.
    """

    raw: list = field(default_factory=list)  # (spec, block shape, how) not yet digested
    count: int = 0
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha1)
    misfit: bool = False
    calls: list = field(default_factory=list)  # details of the first MAX_DETAILS calls


MAX_DETAILS = 64
FOLD_EVERY = 256
# Mesh -> notes. Read (a dict truthiness test) on every redistribute: keep it a plain dict.
PENDING: dict[DeviceMesh, _Notes] = {}


def note(spec: DTensorSpec, block: tuple[int, ...], how: str) -> None:
    """Remember an unchecked from_local: ``spec`` is what this rank inferred (or was given)."""
    mesh = spec.mesh
    if math.prod(mesh.shape) == 1 or mesh.get_coordinate() is None:
        return
    notes = PENDING.get(mesh)
    if notes is None:
        notes = PENDING[mesh] = _Notes()
    notes.raw.append((spec, block, how))
    if len(notes.raw) >= FOLD_EVERY:
        _fold(notes)


def _fold(notes: _Notes) -> None:
    """Digest the raw calls: what every rank must agree on (global layout), and misfit blocks."""
    for spec, block, how in notes.raw:
        notes.count += 1
        layout, stride = spec.render(), _addressing(spec.shape, spec.tensor_meta.stride)
        if stride != _addressing(spec.shape, contiguous_stride(spec.shape)):  # named if the ranks differ
            layout += f" (stride {list(spec.tensor_meta.stride)})"
        notes.digest.update(f"{layout}|{spec.placements}|{stride}|".encode())
        want = spec.local_shape()
        notes.misfit |= tuple(block) != want
        if len(notes.calls) < MAX_DETAILS:
            notes.calls.append((layout, list(block), list(want), how))
    notes.raw.clear()


def _addressing(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """The strides that address memory: a dim of size <= 1 has none that matters."""
    return tuple(st if size > 1 else 0 for size, st in zip(shape, stride))


def settle(mesh: DeviceMesh) -> None:
    """Before a collective on ``mesh``: raise on every rank if earlier from_local calls left the
    ranks with different layouts, or a block that is not its rank's piece."""
    notes = PENDING.pop(mesh, None)
    if notes is None:
        return
    _fold(notes)
    value = int.from_bytes(notes.digest.digest()[:7], "little")
    flags = torch.tensor([value, -value, int(notes.misfit)], dtype=torch.int64)
    for group in _settle_groups(mesh):  # the max over the whole mesh
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if flags[0] == -flags[1] and not flags[2]:
        return
    grid = gather_grid((dist.get_rank(), notes.count, notes.calls), mesh)
    raise ValueError(_settle_message(mesh, grid))


def _settle_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    """Groups whose max, taken in turn, is the max over the whole mesh: the default group alone
    when the mesh spans the world (one all_reduce, whatever its number of axes), else each axis's.

    Only groups that exist on every rank of the mesh: creating one here would be a collective
    that a rank not settling (nothing noted) never joins."""
    if mesh.ndim > 1 and mesh.size() == dist.get_world_size():
        return [dist.group.WORLD]
    return [mesh.get_group(axis) for axis in range(mesh.ndim)]


def _settle_message(mesh: DeviceMesh, grid: dict) -> str:
    """Which from_local call the ranks disagree on, and what each rank made of it."""
    entries = sorted(grid.values())
    counts = {rank: count for rank, count, _ in entries}
    head = f"DTensor.from_local without run_check left the ranks of {mesh} with inconsistent blocks: "
    for index in range(max(len(calls) for _, _, calls in entries)):
        calls = {rank: calls[index] if index < len(calls) else None for rank, _, calls in entries}
        layouts = {rank: c[0] if c else "no call" for rank, c in calls.items()}
        misfits = [f"rank {r} holds a {c[1]} block where {c[0]} needs {c[2]}"
                   for r, c in calls.items() if c and c[1] != c[2]]
        if len(set(layouts.values())) > 1 or misfits:
            how = next(c[3] for c in calls.values() if c)
            return head + f"in call {index + 1} since the last check ({how}), " + _call_detail(calls, layouts, misfits)
    if len(set(counts.values())) > 1:
        return head + "the ranks made different numbers of calls: " + "; ".join(
            f"{c} on {_ranks([r for r in counts if counts[r] == c])}" for c in sorted(set(counts.values())))
    return head + f"they disagree in a call after the first {MAX_DETAILS} since the last check"


def _call_detail(calls: dict, layouts: dict, misfits: list[str]) -> str:
    if len(set(layouts.values())) > 1:
        groups: dict[str, list[int]] = {}
        for rank, layout in layouts.items():
            groups.setdefault(layout, []).append(rank)
        shapes: dict[str, list[int]] = {}
        for rank, c in calls.items():
            shapes.setdefault(str(c[1]) if c else "none", []).append(rank)
        blocks = "; ".join(f"{b} on {_ranks(r)}" for b, r in shapes.items())
        return ("the ranks read their blocks as different global tensors: "
                + "; ".join(f"{layout} on {_ranks(r)}" for layout, r in groups.items())
                + f" (blocks {blocks}). Without shape=, from_local assumes even blocks (the global size of a "
                "sharded dim is this rank's size times the ranks sharding it): pass shape= (and stride=) for "
                "uneven blocks, or run_check=True to infer the shape from every rank's block")
    return "; ".join(misfits) + ". Each rank must hold the torch.chunk piece of shape= that the layout gives it"


def global_meta(block: torch.Tensor, shape: Sequence[int] | None, stride: Sequence[int] | None) -> TensorMeta:
    """Metadata for a given global ``shape`` (contiguous ``stride`` unless given)."""
    shape = torch.Size(shape)
    stride = tuple(stride) if stride is not None else contiguous_stride(shape)
    return TensorMeta(shape, stride, block.dtype)
