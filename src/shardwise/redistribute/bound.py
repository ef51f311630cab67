"""The least communication a redistribute needs (pure): a reported figure, not a target.

``benchmarks/redistribute.py`` and ``benchmarks/plan_bound_census.py`` print each plan's bytes
against these bounds; the planner chooses by predicted time (``planner.py``), and docs/tools.md, "The
redistribute planner", shows why it no longer optimizes for them. Ranks are numbered by their
mesh coordinate, row-major. A rank's *source block* is the box of the tensor its source
layout gives it, its *target block* the box the target layout asks for.

Source without Partial
    Rank r lacks ``|target(r)| - |target(r) ∩ source(r)|`` elements; every schedule delivers
    each of them at least once, so all ranks together send at least ``total = sum of lacks``.
    Ranks holding the same source block form a *holder class*; in ONE round (one all_to_all)
    an element can only come from its class, so class C sends at least ``d(C)`` (what ranks
    outside C lack of its block) and its busiest member ``ceil(d(C) / |C|)``: ``busiest`` is
    the largest of those. ``exchange.plan_exchange`` meets both at once. Schedules of several
    rounds may relay (axis-by-axis plans do) down to ``busiest_any``: the larger of
    ``ceil(total / ranks)`` and, per class, ``ceil(u(C) / |C|)`` with ``u(C)`` the elements
    of C's block that some rank outside C lacks.

Partial sources
    With ``n`` contributions per element (the sizes of the source's Partial axes, multiplied)
    and T the ranks needing it, before the first rank of T knows the value the other ``n - 1``
    contributions must leave their holders (one more if no rank of T holds one), and every
    other rank of T then needs one message: ``total >= sum over elements of (n - 1) + (|T| -
    1) + [no rank of T holds it]``. An all_reduce (``2 (n - 1) numel``) meets it; a
    reduce_scatter meets it for one needer. No single round reduces and spreads, so
    ``busiest = busiest_any``: ``ceil(total / ranks)``, and per set Q of ranks holding the same
    contribution, ``ceil(q / |Q|)`` with q the elements of the block no rank of Q needs. A
    schedule meeting ``total`` need not meet ``busiest`` (two all_to_alls, reducing at a
    consumer, met the total; they were slower than the collectives they replaced).

Partial targets
    Ranks off coordinate 0 of a Partial(sum/product) target hold the identity and need no
    data (``needs_value``). An axis Partial in both layouts with the same op may keep its
    reduction pending (independent slices) or be reduced and re-partitioned: the bound is the
    smaller of the two accountings.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from shardwise.core.placement import Placement
from shardwise.core.spec import local_shape_and_offset

__all__ = ["Bound", "lower_bound", "blocks", "needs_value"]

Layout = tuple[Placement, ...]
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)


@dataclass(frozen=True, slots=True)
class Bound:
    """Lower bounds, in bytes, of one transition (see the module docstring for the proofs).

    ``lacks``: per rank (row-major mesh coordinate), what it must receive at least.
    ``total``: what all ranks together must send, under any schedule.
    ``busiest``: the least the busiest rank sends in one exchange round (met by ``plan_exchange``).
    ``busiest_any``: the least the busiest rank sends under any schedule, relaying included.
    """

    lacks: tuple[int, ...]
    total: int
    busiest: int
    busiest_any: int

    @property
    def most_lacked(self) -> int:
        return max(self.lacks, default=0)


def coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every mesh coordinate, row-major (index = rank number used here)."""
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def blocks(shape: tuple, mesh_shape: tuple, layout: Layout) -> list[Box]:
    """(offset, shape) of every rank's block under ``layout``, row-major over the mesh."""
    return [local_shape_and_offset(shape, mesh_shape, c, layout)[::-1] for c in coordinates(mesh_shape)]


def needs_value(layout: Layout, coordinate: Sequence[int]) -> bool:
    """Whether the rank at ``coordinate`` holds values of its block under ``layout`` (False: it
    holds the identity of a Partial target, which needs no data)."""
    return not any(p.is_partial() and p.identity() is not None and c != 0 for p, c in zip(layout, coordinate))


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of two boxes, or None when they share no element."""
    offset, shape = [], []
    for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(oa, ob), min(oa + na, ob + nb)
        if hi <= lo:
            return None
        offset.append(lo)
        shape.append(hi - lo)
    return tuple(offset), tuple(shape)


def volume(box: Box | None) -> int:
    return 0 if box is None else math.prod(box[1])


def lower_bound(
    global_shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
) -> Bound:
    """The lower bounds of taking a tensor laid out as ``src`` to ``dst`` (module docstring).

    Example: a (2, 2) mesh, 4x4 float32, (Replicate, Shard(0)) -> (Shard(0), Replicate): two
    ranks already hold their rows, two lack 2 rows of 4 (32 B each); each holder class has two
    members to share the sending.

        >>> from shardwise import Replicate, Shard
        >>> b = lower_bound((4, 4), 4, (2, 2), (Replicate(), Shard(0)), (Shard(0), Replicate()))
        >>> b.lacks, b.total, b.busiest
        ((0, 32, 32, 0), 64, 16)
    """
    return _bound(tuple(global_shape), itemsize, tuple(mesh_shape), tuple(src), tuple(dst))


@lru_cache(maxsize=4096)
def _bound(shape: tuple, itemsize: int, mesh_shape: tuple, src: Layout, dst: Layout) -> Bound:
    kept = [a for a, (s, d) in enumerate(zip(src, dst)) if s.is_partial() and s == d and mesh_shape[a] > 1]
    if kept:  # independent slices, one per coordinate of the kept axes
        rest = [a for a in range(len(mesh_shape)) if a not in kept]
        sub = _bound(shape, itemsize, tuple(mesh_shape[a] for a in rest),
                     tuple(src[a] for a in rest), tuple(dst[a] for a in rest))
        copies = math.prod(mesh_shape[a] for a in kept)
        index = {c: i for i, c in enumerate(coordinates([mesh_shape[a] for a in rest]))}
        lacks = tuple(sub.lacks[index[tuple(c[a] for a in rest)]] for c in coordinates(mesh_shape))
        keep = Bound(lacks, copies * sub.total, sub.busiest, sub.busiest_any)
        reduce = _from_counts(_count(shape, mesh_shape, src, dst), itemsize)
        return Bound(tuple(map(min, keep.lacks, reduce.lacks)), min(keep.total, reduce.total),
                     min(keep.busiest, reduce.busiest), min(keep.busiest_any, reduce.busiest_any))
    return _from_counts(_count(shape, mesh_shape, src, dst), itemsize)


def _from_counts(counts: "_Counts", itemsize: int) -> Bound:
    return Bound(tuple(x * itemsize for x in counts.lacks), counts.total * itemsize,
                 counts.busiest * itemsize, counts.busiest_any * itemsize)


@dataclass
class _Counts:
    lacks: list[int]
    total: int = 0
    busiest: int = 0
    busiest_any: int = 0


def _count(shape: tuple, mesh_shape: tuple, src: Layout, dst: Layout) -> _Counts:
    """Element counts of the bounds, by cells: boxes no block edge crosses."""
    coords = coordinates(mesh_shape)
    ranks = len(coords)
    partial_axes = [a for a, p in enumerate(src) if p.is_partial() and mesh_shape[a] > 1]
    n = math.prod(mesh_shape[a] for a in partial_axes)
    src_blocks, dst_blocks = blocks(shape, mesh_shape, src), blocks(shape, mesh_shape, dst)
    needers = [r for r, c in enumerate(coords) if needs_value(dst, c)]
    # Ranks holding the same data: same coordinate on every source axis that cuts or is Partial.
    cutting = [a for a, p in enumerate(src) if not p.is_replicate()]
    klass = [tuple(c[a] for a in cutting) for c in coords]
    out = _Counts([0] * ranks)
    demand: dict = {}  # holder class -> elements to send (one round) / to let out at least once
    leave: dict = {}
    members: dict = {}
    for r, k in enumerate(klass):
        members.setdefault(k, []).append(r)
    for cell in cells(shape, src_blocks + dst_blocks):
        v = volume(cell)
        holders = {r for r in range(ranks) if contains(src_blocks[r], cell)}
        wanting = [r for r in needers if contains(dst_blocks[r], cell)]
        if not wanting:
            continue
        if n == 1:
            lacking = [r for r in wanting if r not in holders]
            for r in lacking:
                out.lacks[r] += v
            out.total += v * len(lacking)
            if lacking:
                k = klass[min(holders)]
                demand[k] = demand.get(k, 0) + v * len(lacking)
                leave[k] = leave.get(k, 0) + v
            continue
        for r in wanting:
            out.lacks[r] += v
        first_lacks = not any(r in holders for r in wanting)
        out.total += v * (n - 1 + len(wanting) - 1 + first_lacks)
        for k in {klass[r] for r in holders}:
            if not any(klass[r] == k for r in wanting):
                leave[k] = leave.get(k, 0) + v
    spread = -(-out.total // ranks)
    out.busiest_any = max([spread] + [-(-e // len(members[k])) for k, e in leave.items()])
    if n == 1:
        out.busiest = max([0] + [-(-e // len(members[k])) for k, e in demand.items()])
    else:
        out.busiest = out.busiest_any
    return out


def contains(block: Box, cell: Box) -> bool:
    return all(o <= c and c + m <= o + n for o, n, c, m in zip(block[0], block[1], cell[0], cell[1]))


def cells(shape: tuple, boxes: list[Box]) -> list[Box]:
    """The tensor cut at every edge of every box: each cell lies wholly inside or outside each box."""
    cuts = []
    for d, size in enumerate(shape):
        edges = {0, size}
        for offset, extent in boxes:
            edges.update((offset[d], offset[d] + extent[d]))
        edges = sorted(e for e in edges if 0 <= e <= size)
        cuts.append([(lo, hi - lo) for lo, hi in zip(edges, edges[1:]) if hi > lo])
    return [(tuple(o for o, _ in combo), tuple(m for _, m in combo)) for combo in itertools.product(*cuts)]
