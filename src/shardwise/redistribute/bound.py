"""The least communication a redistribute needs (pure): what each rank lacks, and proofs.

Ranks are numbered by their mesh coordinate, row-major. A rank's *source block* is the box of
the tensor its source layout gives it, its *target block* the box the target layout asks for.

Source and target without Partial
    Rank r lacks ``|target(r)| - |target(r) ∩ source(r)|`` elements: the part of its target
    block it does not hold. Every schedule delivers each of those elements to r at least once,
    so the bytes sent by all ranks together are at least ``total = sum of what the ranks lack``.
    The ranks that hold the same source block (they differ only on Replicate axes) form a
    *holder class*; the classes tile the tensor, each element is held by exactly one class.
    In ONE exchange round (one all_to_all: no rank forwards what it received) an element a
    rank lacks can only come from its holder class, so class C sends at least ``d(C)``, the
    sum over ranks outside C of ``|target(r) ∩ source(C)|``, and its busiest member at least
    ``ceil(d(C) / |C|)``. ``busiest`` is the largest of those over the classes. Both bounds are
    met at once by one all_to_all in which each class splits its outgoing elements evenly
    among its members (``exchange.plan_exchange``), so they are the exact optimum of a
    one-round schedule. ``busiest`` is not ``max lacks``: with 5 rows on 4 ranks Shard(0) ->
    Replicate, rank 0 holds 2 rows nobody else has and 3 ranks lack them (6 rows), while no
    rank lacks more than 5. Schedules of several rounds may relay (the axis-by-axis plans do),
    which can lower the busiest rank below ``busiest`` but never below ``busiest_any``: the
    larger of ``ceil(total / ranks)`` and, per class C, ``ceil(u(C) / |C|)`` with ``u(C)`` the
    elements of C's block that some rank outside C lacks (each must leave C at least once).
    A relay need not raise the total: in two rounds a holder sends each element once to one
    rank that lacks it, which forwards it to the others that lack it; every rank still receives
    only what it lacks, and the sending spreads over the receivers, down to ``busiest_any`` in
    many transitions. The planner does not relay a value source: the second collective costs
    more time than the busiest rank's bytes save. Tried (reduce-forward with one contribution,
    weighed wherever the busiest rank was above ``busiest_any``), ``benchmarks/redistribute.py
    --meshes 4,2x2 --reps 3`` changed the plan of 97 of 1,008 transitions and ran them at a
    median 1.53x the time of the one-collective plans, slower in 76, 1024x1024 included (there
    the busiest rank sent 25-50% less). For a value source the planner's busiest rank is held
    to ``busiest``, the one-round optimum.

Partial sources (pending reductions)
    Let ``n`` be the number of contributions of each element (the product of the sizes of the
    source's Partial axes the target does not keep). A rank holds one contribution of its
    source block; the value of an element needs all ``n``. Count messages that each carry one
    value of one element (a contribution or a partial reduction of it; no coding across
    elements). For an element needed by the ranks T (nonempty): before the first rank learns
    the reduced value, each of the other ``n - 1`` contributions must have left its holders at
    least once (one more if that first rank holds no contribution of the element, as it then
    lacks all ``n``); after it, each other rank of T becomes an owner of the value only by
    receiving a message, one per rank, and those messages are later than the first ones. So
    ``total >= sum over elements of (n - 1) + (|T| - 1) + [no rank of T holds it]``. With T
    all ``n`` ranks that is ``2(n-1)`` per element, what reduce_scatter + all_gather moves; with
    one rank of T that is ``n - 1``, what reduce_scatter moves. Per rank, ``lacks`` counts one
    value per element of its target block (it holds at most its own contribution), so here
    ``total`` exceeds ``sum(lacks)``: the first owner of each value receives ``n - 1``.
    No single round reduces and spreads, so ``busiest`` and ``busiest_any`` are the same
    bound: ``ceil(total / ranks)`` and, per set Q of ranks holding the same contribution of
    the same block, ``ceil(q / |Q|)`` where q counts the elements of the block no rank of Q
    needs (Q must send something about each of them: its contribution or the reduced value).
    An all_reduce sends ``numel + (n-2) * its reduce_scatter piece`` per rank
    (``collective_bytes.all_reduce_sent``), ``2 (n-1) numel`` in all: it meets ``total``.
    ``total`` is tight for every Partial source: pick for each element a first owner ``f`` in
    T holding one of its contributions (when no rank of T holds one: any rank of T, or a holder
    that then sends the value to all of T, the same count); in round one one holder of each
    other contribution sends it to ``f``, which reduces them; in round two ``f`` sends the
    value to the rest of T. That is exactly the count above, and both rounds are all_to_alls
    with per-peer counts over the flattened group: the planner's reduce-forward step
    (``reduce_forward.py``), which meets ``total`` on every transition it applies to (one
    reduce op in the source, at most one in the target; tests/test_plan_bound.py).

    ``busiest`` (= ``busiest_any``) is a lower bound for any schedule, but no schedule meets it
    together with ``total`` in general. A schedule that sends exactly ``total`` sends no message
    beyond the counts above, with equality: per element, the first departure of each
    contribution the first owner lacks, and one message that completes the value of each other
    rank of T (for a rank of T holding no contribution that message carries the whole value, so
    its sender already knew it). Example: (2, 2), 7x5 float32, ``(Partial, Shard(1)) ->
    (Shard(0), Replicate)``: rows 0-3 of columns 0-2 (12 elements) are held by (0, 0) and
    (1, 0) and needed by (0, 0) and (0, 1), which holds none of them; two messages per element
    are allowed, (0, 0) must receive the other contribution and (0, 1) the value, so the value's
    sender is (0, 0), the only rank that can know it after one message; rows 4-6 (9 elements)
    likewise make (0, 0) send its contribution to (1, 0). Rank (0, 0) sends at least 21
    elements (84 B) in any schedule that meets ``total`` (70 elements), while ``busiest`` is
    ceil(70 / 4) = 18 (72 B). In two rounds, rounding can force it too: (2, 2, 2), 7x5,
    ``(Partial, Partial, Replicate) -> (Replicate, Partial, Replicate)`` reduced at once (840 B,
    the bound): the four ranks at coordinate 0 of axis 1 need every element and hold two
    contribution classes A and B of two ranks each; after round one only the first owner knows
    a value, so per element it sends 3 values and one rank of the other class 1; if X of the 35
    elements have their first owner in A, A's ranks send 3X + (35 - X) elements, which must be
    70 for each of the four to send 35 (140 B): X = 17.5. So some rank sends 36 (144 B) in
    every two-round schedule meeting ``total`` (a third round relaying values could spread it),
    while one all_reduce over axis 0 (1,120 B in all) has every rank send 140 B. The least
    busiest rank among the schedules that meet ``total`` is the optimum of an integer program
    (which ranks reduce each element, which holder sends each contribution, who relays); it is
    not computed here, so for Partial sources the busiest rank is held only to ``busiest_any``
    and reported against ``busiest``. ``reduce_forward`` chooses greedily and then improves by
    local search, without a proof of optimality.

    The planner puts the total first, except where that would be slower on every
    latency-bandwidth network (``plan.py`` says why). Figures, every flattened group available,
    Partial(sum) sources, every target over {R, S0, S1, P} other than the source
    (``python benchmarks/plan_bound_census.py``): the plan's total, each all_reduce at every
    rank's own share (``Plan.exact_total_bytes``), is above ``total`` on (2, 2) in 0 of 105
    transitions, 8x8 and 7x5, and on (2, 2, 2) in 111 and 138 of 2331 (before reduce-forward:
    8, 9, 758, 783). In each of those, every candidate plan with fewer bytes in all has a busiest
    rank that sends at least as much as some other candidate's, in at least as many collectives,
    one of the two strictly more (tests/test_plan_bound.py checks it against every candidate,
    ``plan.plan_candidates``); with the total first and no such filter all four were 0. The
    busiest rank is above ``busiest`` on (2, 2) 8x8 in 0 (before reduce-forward: 10), (2, 2) 7x5 in 12 (31), (2, 2, 2) 8x8 in 462 (834), 7x5 in 720 (1423);
    some of these, like the examples, are forced. Within its own family (one first owner per
    element, two rounds), reduce-forward's busiest rank is at the family's least (a linear
    program: ``plan_bound_census.py --family``) in 1426 and 1526 of the 1647 (2, 2, 2)
    transitions it applies to, 8x8 and 7x5, and at most 1.06x and 1.10x above it in the
    others: the rest of the gap to ``busiest`` is the family's, not the search's.

Partial targets
    A Partial target holds the value on the ranks at coordinate 0 of its Partial axes and the
    reduction's identity elsewhere (``Partial.partition_value``): for sum and product only the
    coordinate-0 ranks need data; for avg, max and min every rank holds the value. Other
    decompositions exist (Shard(0) -> Partial(sum) by zero-padding needs no communication at
    all); the bound is stated for this canonical one, which is what the executor produces.
    An axis Partial in both layouts with the same op may keep its reduction pending (the slices
    at each coordinate of it are then independent transitions of one contribution each: their
    bounds summed, the maximum for the busiest rank) or reduce it and re-partition (counted as
    above, the target canonical): a schedule that reduces fewer elements can move less data
    than one that reduces them all, and the reverse (a reduced value is needed only at
    coordinate 0). The bound is the smaller of the two accountings, each figure separately;
    a schedule mixing them element by element is not proven to stay above it. The planner's
    kept plans (``pending.py``) follow the first accounting: the sub-plan over the other axes,
    run in every slice; where the other axes hold no Partial source they meet its total.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from shardwise.core.placement import Placement
from shardwise.core.spec import local_shape_and_offset

__all__ = ["Bound", "lower_bound", "reducing_total", "blocks", "needs_value"]

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


@lru_cache(maxsize=4096)
def reducing_total(shape: tuple, mesh_shape: tuple, src: Layout, dst: Layout) -> int:
    """Elements all ranks must send when every Partial axis of the source is reduced (no
    reduction kept pending): what ``reduce_forward`` sends."""
    return _count(tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst)).total


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
