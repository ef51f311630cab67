"""Which blocks each rank writes and reads: pure functions of shapes, layouts and chunk lists.

Saving: every rank proposes the block it holds of each tensor (``proposed_block``) unless a
rank with a lower coordinate on the tensor's replicated mesh axes holds the same block; the
proposals of all ranks are then deduplicated (``assign_writers``: a block held by several
ranks, e.g. a plain tensor or a DTensor on a sub-mesh, goes to the lowest global rank), and
each written block is cut along dim 0 into slabs of at most ``max_bytes`` (``split_rows``),
the chunks of the format.

Loading: a rank's target block is intersected with the stored chunks (``read_plan``); chunks
that carry a checksum are read whole (a checksum covers whole chunks), so a rank reads the
chunks that overlap its block and nothing else. No process group is needed anywhere here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import Chunk
from shardwise.core.placement import Placement, Shard
from shardwise.core.spec import local_shape_and_offset

__all__ = [
    "Block", "Proposal", "Read", "proposed_block", "assign_writers", "merged_declarations", "split_rows",
    "read_plan", "full_block",
]


@dataclass(frozen=True, slots=True)
class Block:
    """A box of a global tensor: ``sizes`` elements from ``offsets`` along each dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: "Block") -> "Block | None":
        """The common box, or None when they do not overlap (or one is empty)."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= l for l, h in zip(lo, hi)) or self.numel == 0 or other.numel == 0:
            return None
        return Block(lo, tuple(h - l for l, h in zip(lo, hi)))

    def slices_in(self, outer: "Block") -> tuple[slice, ...]:
        """Index of this box inside ``outer``'s local tensor."""
        return tuple(slice(o - p, o - p + s) for o, s, p in zip(self.offsets, self.sizes, outer.offsets))


def full_block(shape: Sequence[int]) -> Block:
    """The whole tensor as one block."""
    return Block((0,) * len(shape), tuple(shape))


@dataclass(frozen=True, slots=True)
class Proposal:
    """A rank offers to write ``block`` of tensor ``fqn`` (global ``shape``, dtype name ``dtype``)."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    block: Block


def proposed_block(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
) -> Block | None:
    """The block the rank at ``coordinate`` offers to write, or None.

    None when the rank is outside the mesh, holds an empty block, or is not the first replica
    (coordinate 0) along every non-Shard axis: replicated data is written once.
    """
    if coordinate is None:
        return None
    if any(c != 0 for c, p in zip(coordinate, placements) if not isinstance(p, Shard)):
        return None
    sizes, offsets = local_shape_and_offset(shape, mesh_shape, coordinate, placements)
    block = Block(tuple(offsets), tuple(sizes))
    return block if block.numel > 0 else None


def assign_writers(
    declared: Sequence[dict[str, tuple[str, tuple[int, ...]]]],
    proposals: Sequence[Sequence[Proposal]],
) -> list[list[Proposal]]:
    """Per rank, the blocks it writes: each distinct block once, by the lowest rank offering it.

    Args:
        declared: per rank, every tensor key it saves -> (dtype name, global shape). Ranks may
            save different keys (pipeline stages hold different modules); a key saved by
            several ranks must have the same dtype and shape on all of them.
        proposals: per rank, the blocks it offers.

    Raises:
        CheckpointError: ranks disagree on a tensor's dtype or shape, or the blocks offered
            overlap without being equal or leave part of a tensor unwritten.
    """
    merged = merged_declarations(declared)
    taken: dict[tuple[str, Block], int] = {}
    out: list[list[Proposal]] = [[] for _ in proposals]
    for rank, offered in enumerate(proposals):
        for p in offered:
            if (p.fqn, p.block) not in taken:
                taken[(p.fqn, p.block)] = rank
                out[rank].append(p)
    _check_tiling(merged, [p for per_rank in out for p in per_rank])
    return out


def merged_declarations(
    declared: Sequence[dict[str, tuple[str, tuple[int, ...]]]],
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every key any rank saves -> (dtype, shape), checking that the ranks saving a key agree on it."""
    merged: dict[str, tuple[str, tuple[int, ...]]] = {}
    first: dict[str, int] = {}
    for rank, mine in enumerate(declared):
        for key, entry in mine.items():
            if key not in merged:
                merged[key], first[key] = entry, rank
            elif merged[key] != entry:
                raise CheckpointError(
                    f"ranks disagree on tensor {key!r}: rank {first[key]} has {_describe(merged[key])}, "
                    f"rank {rank} has {_describe(entry)}; ranks saving the same key must agree"
                )
    return merged


def _describe(entry: tuple[str, tuple[int, ...]] | None) -> str:
    return "no such tensor" if entry is None else f"dtype {entry[0]} shape {list(entry[1])}"


def _check_tiling(declared: dict[str, tuple[str, tuple[int, ...]]], written: list[Proposal]) -> None:
    """Each tensor's written blocks must add up to the tensor: no hole, no partial overlap."""
    volume = {key: 0 for key in declared}
    for p in written:
        volume[p.fqn] += p.block.numel
    for key, (_, shape) in declared.items():
        if volume[key] != math.prod(shape):
            raise CheckpointError(
                f"the blocks held by the ranks of tensor {key!r} (shape {list(shape)}) add up to "
                f"{volume[key]} elements instead of {math.prod(shape)}: overlapping or missing shards"
            )


def split_rows(block: Block, itemsize: int, max_bytes: int) -> list[Block]:
    """``block`` cut along dim 0 into slabs of at most ``max_bytes`` (at least one row each).

    A slab is contiguous in the row-major local tensor, so each one is one stored chunk.
    """
    if len(block.sizes) == 0 or block.numel == 0:
        return [block]
    row_bytes = math.prod(block.sizes[1:]) * itemsize
    rows = max(1, max_bytes // max(row_bytes, 1))
    slabs = []
    for start in range(0, block.sizes[0], rows):
        n = min(rows, block.sizes[0] - start)
        slabs.append(Block((block.offsets[0] + start, *block.offsets[1:]), (n, *block.sizes[1:])))
    return slabs


@dataclass(frozen=True, slots=True)
class Read:
    """Read ``chunk`` (whole, or just ``part`` when it has no checksum) for ``part`` of a target."""

    chunk: Chunk
    part: Block

    @property
    def chunk_block(self) -> Block:
        return Block(self.chunk.offsets, self.chunk.sizes)


def read_plan(target: Block, chunks: Sequence[Chunk]) -> list[Read]:
    """The chunks overlapping ``target`` and the overlap of each.

    Raises:
        CheckpointError: the overlaps do not cover the target exactly (a damaged chunk list).
    """
    reads = []
    for chunk in chunks:
        part = target.intersect(Block(chunk.offsets, chunk.sizes))
        if part is not None:
            reads.append(Read(chunk, part))
    if sum(r.part.numel for r in reads) != target.numel:
        raise CheckpointError(
            f"the stored chunks cover {sum(r.part.numel for r in reads)} of the {target.numel} "
            f"elements of block at {list(target.offsets)} size {list(target.sizes)}"
        )
    return reads
