"""Reduce at a consumer, then forward: two all_to_alls that resolve a Partial source (pure).

A reduce_scatter reduces each element at a rank chosen by its position on the axis, not by who
needs it, so the axis-by-axis plans of a Partial source may move an element's value again after
reducing it. This schedule (``bound.py`` proves it meets the least total a Partial source needs)
reduces every element where it is needed:

* round 1: for each element a *first owner* ``f`` is chosen among the ranks ``T`` that need it
  (one that holds a contribution if some rank of ``T`` does). One holder of each other
  contribution sends it to ``f``, which reduces them with its own;
* round 2: ``f`` sends the reduced value to the rest of ``T``.

Elements are cut into runs (row-major within a cell of ``bound``'s grid); the first owner of
each run and the holder that sends each contribution are chosen run by run, greedily, to keep
the busiest rank low (``plan_reduce_forward``): runs shrink geometrically, so the last choices
are of single elements. Both rounds are all_to_alls with per-peer counts over the flattened
group of the axes the transfers cross. Every Partial axis of the source (of more than one rank)
is reduced, with one op; a Partial target (one op) gets the value where it needs one
(``bound.needs_value``) and the reduction's identity elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from shardwise.core.placement import Placement
from shardwise.redistribute.bound import Box, blocks, cells, contains, coordinates, needs_value, volume
from shardwise.redistribute.exchange import Transfer

__all__ = ["ReduceForward", "plan_reduce_forward", "forwardable"]

Layout = tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class ReduceForward:
    """The two rounds. ``first``: contributions to first owners (``source`` names the sender's
    contribution class by its first rank); ``second``: reduced values from first owners (``source``
    is the sender). ``op`` reduces the ``n`` contributions of an element. ``sends``: elements each
    rank sends over both rounds; ``round_sends`` per round; ``axes``: every mesh axis crossed."""

    first: tuple[Transfer, ...]
    second: tuple[Transfer, ...]
    op: str
    n: int
    sends: tuple[int, ...]
    round_sends: tuple[tuple[int, ...], tuple[int, ...]]
    axes: tuple[int, ...]


def _partial_ops(layout: Layout, mesh_shape: tuple) -> set[str]:
    return {p.reduce_op for p, m in zip(layout, mesh_shape) if p.is_partial() and m > 1}  # type: ignore[attr-defined]


def forwardable(mesh_shape: tuple, src: Layout, dst: Layout) -> bool:
    """Whether the schedule applies: a Partial source of one op, a target of at most one op."""
    return len(_partial_ops(src, mesh_shape)) == 1 and len(_partial_ops(dst, mesh_shape)) <= 1


class CellChoices(NamedTuple):
    """One cell of the tensor (a box no block edge crosses) and the choices the family of
    reduce-forward schedules has for its elements: a first owner among ``owners``, a sender
    per contribution class not holding it (``classes``: the ranks holding each contribution),
    and the owner sends the value to the rest of ``wanting``."""

    cell: Box
    size: int
    wanting: list[int]
    owners: list[int]
    classes: list[list[int]]


def cell_choices(shape: tuple, mesh_shape: tuple, src: Layout, dst: Layout) -> list[CellChoices]:
    """Every cell some rank needs, with its choices (``CellChoices``), in tensor order."""
    coords = coordinates(mesh_shape)
    src_blocks, dst_blocks = blocks(shape, mesh_shape, src), blocks(shape, mesh_shape, dst)
    cutting = [a for a, p in enumerate(src) if not p.is_replicate() and mesh_shape[a] > 1]
    klass = [tuple(c[a] for a in cutting) for c in coords]
    needers = [r for r, c in enumerate(coords) if needs_value(dst, c)]
    out = []
    for cell in cells(shape, src_blocks + dst_blocks):
        v = volume(cell)
        wanting = [r for r in needers if contains(dst_blocks[r], cell)]
        if not v or not wanting:
            continue
        classes: dict = {}
        for r in range(len(coords)):
            if contains(src_blocks[r], cell):
                classes.setdefault(klass[r], []).append(r)
        holding = sorted(r for m in classes.values() for r in m)
        # With no holder of the element among T, the sum may as well form at a holder that then
        # sends it to all of T: n - 1 + |T| messages either way.
        owners = [r for r in wanting if r in holding] or sorted(set(wanting) | set(holding))
        out.append(CellChoices(cell, v, wanting, owners, list(classes.values())))
    return out


@lru_cache(maxsize=1024)
def plan_reduce_forward(shape: tuple, mesh_shape: tuple, src: Layout, dst: Layout) -> ReduceForward:
    """The schedule from ``src`` to ``dst`` (module docstring); ValueError when not ``forwardable``."""
    if not forwardable(mesh_shape, src, dst):
        raise ValueError(f"no reduce-forward schedule from {list(src)} to {list(dst)}: the source needs Partial "
                         "axes of one reduce op and the target at most one op")
    coords = coordinates(mesh_shape)
    ranks = len(coords)
    op = next(iter(_partial_ops(src, mesh_shape)))
    n = math.prod(m for p, m in zip(src, mesh_shape) if p.is_partial() and m > 1)
    loads = [0] * ranks
    per_round: tuple[list[int], list[int]] = ([0] * ranks, [0] * ranks)
    first: list[Transfer] = []
    second: list[Transfer] = []
    # The most constrained cells first: their loads are forced.
    work = sorted(cell_choices(shape, mesh_shape, src, dst), key=lambda c: len(c.owners))
    pieces: list[_Piece] = []
    for cell, v, wanting, owners, classes in work:
        start = 0
        while start < v:
            size = max(1, (v - start) // (8 * len(owners)))
            piece = _Piece(cell, start, start + size, wanting, owners, classes)
            piece.assign(loads, *_choose(loads, owners, classes, wanting, size))
            pieces.append(piece)
            start += size
    _local_search(pieces, loads, rounds=4)
    _local_search(pieces, loads, rounds=8, even=True)
    _local_search(pieces, loads, rounds=4)
    for piece in _merged(pieces):
        for s, members in piece.senders:
            first.append(Transfer(s, piece.f, piece.cell, piece.start, piece.stop, members[0]))
            per_round[0][s] += piece.stop - piece.start
        for g in piece.wanting:
            if g != piece.f:
                second.append(Transfer(piece.f, g, piece.cell, piece.start, piece.stop, piece.f))
                per_round[1][piece.f] += piece.stop - piece.start
    axes = sorted({a for t in first + second for a in range(len(mesh_shape)) if coords[t.sender][a] != coords[t.receiver][a]})
    return ReduceForward(tuple(first), tuple(second), op, n, tuple(loads),
                         (tuple(per_round[0]), tuple(per_round[1])), tuple(axes))


class _Piece:
    """A run of one cell with its choice: first owner ``f`` and the ``senders`` of the other
    contributions (each with its class's members)."""

    def __init__(self, cell, start: int, stop: int, wanting: list[int], owners: list[int], classes: list) -> None:
        self.cell, self.start, self.stop = cell, start, stop
        self.wanting, self.owners, self.classes = wanting, owners, classes
        self.f = -1
        self.senders: list[tuple[int, list[int]]] = []
        self.loads: dict[int, int] = {}
        # One owner and one holder per class: no other choice, the local search skips it.
        self.fixed = len(owners) == 1 and all(len(m) == 1 for m in classes)

    def load(self) -> dict[int, int]:
        """Elements each rank sends for this piece under its current choice."""
        return self.loads

    def _load(self) -> dict[int, int]:
        size, out = self.stop - self.start, {}
        for s, _ in self.senders:
            out[s] = out.get(s, 0) + size
        fan_out = len(self.wanting) - (self.f in self.wanting)
        out[self.f] = out.get(self.f, 0) + fan_out * size
        return out

    def assign(self, loads: list[int], f: int, senders: list[tuple[int, list[int]]], sign: int = 1) -> None:
        if f != self.f or senders != self.senders:  # the same choice: the same loads
            self.f, self.senders = f, senders
            self.loads = self._load()
        for r, e in self.loads.items():
            loads[r] += sign * e


def _local_search(pieces: list[_Piece], loads: list[int], rounds: int, even: bool = False) -> None:
    """Local search after the greedy pass, which chose before later cells' loads were known:
    each piece is chosen again (``_move``), large pieces first, for a few sweeps. Lowering the
    busiest rank (``even`` False) only pieces on it are tried; making the loads even (a smaller
    sum of squares) every piece is, so a chain of moves can carry load from the busiest rank to
    the idlest when no single move off the busiest rank lowers it."""
    order = sorted((p for p in pieces if not p.fixed), key=lambda p: p.start - p.stop)
    for _ in range(rounds):
        moved = False
        top = max(loads)  # a move that is not kept leaves the loads as they were
        for piece in order:
            if not even and max(loads[r] for r in piece.load()) < top:
                continue
            if _move(piece, loads, even):
                moved, top = True, max(loads)
        if not moved:
            return


def _move(piece: _Piece, loads: list[int], even: bool) -> bool:
    """Choose again for ``piece``; the new choice stays when the loads of the ranks it touches
    become better (``even``: a smaller sum of squares; else smaller, largest first)."""
    old, touched = (piece.f, piece.senders), piece.load()
    piece.assign(loads, *old, sign=-1)
    new = _choose(loads, piece.owners, piece.classes, piece.wanting, piece.stop - piece.start, even=even)
    piece.assign(loads, *new)
    if new == old:
        return False
    union = set(piece.load()) | set(touched)
    after = [loads[r] for r in union]
    before = [loads[r] - piece.load().get(r, 0) + touched.get(r, 0) for r in union]
    if even:
        better = sum(x * x for x in after) < sum(x * x for x in before)
    else:
        better = sorted(after, reverse=True) < sorted(before, reverse=True)
    if not better:
        piece.assign(loads, *new, sign=-1)
        piece.assign(loads, *old)
    return better


def _merged(pieces: list[_Piece]) -> list[_Piece]:
    """The runs of each cell regrouped by their choice, one run per choice: the loads depend on
    how many elements take each choice, not on which, and fewer, longer runs move faster."""
    by_cell: dict = {}
    for piece in pieces:
        by_cell.setdefault(piece.cell, {}).setdefault((piece.f, tuple(s for s, _ in piece.senders)), []).append(piece)
    out: list[_Piece] = []
    for cell, choices in by_cell.items():
        start = 0
        for _, group in sorted(choices.items()):
            first, size = group[0], sum(p.stop - p.start for p in group)
            run = _Piece(cell, start, start + size, first.wanting, first.owners, first.classes)
            run.f, run.senders = first.f, first.senders
            run.loads = run._load()
            out.append(run)
            start += size
    return out


def _choose(loads: list[int], owners: list[int], classes: list[list[int]], wanting: list[int],
            size: int, even: bool = False) -> tuple[int, list[tuple[int, list[int]]]]:
    """The first owner of a run of ``size`` elements and, per other contribution class, its
    sender: the choice whose busiest rank after it is least (``even``: whose loads after it have
    the least sum of squares), then the least loaded owner, then the lowest rank; senders the
    least loaded member of their class."""
    best = None
    least = [min(m, key=loads.__getitem__) for m in classes]  # members ascend: ties to the lowest
    for f in owners:
        senders = [(s, m) for s, m in zip(least, classes) if f not in m]
        fan_out = len(wanting) - (f in wanting)
        after = [loads[f] + fan_out * size] + [loads[s] + size for s, _ in senders]
        spread = sum(x * x - (x - size) ** 2 for x in after[1:]) + after[0] ** 2 - loads[f] ** 2 if even else 0
        key = (spread, max(after), loads[f], f)
        if best is None or key < best[0]:
            best = (key, f, senders)
    assert best is not None
    return best[1], best[2]

