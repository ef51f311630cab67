"""Keep a reduction pending: the sub-transition over the other mesh axes (pure).

When a mesh axis is Partial in both the source and the target, with the same op, the planner
may leave it unreduced: each rank keeps its OWN contribution on that axis. For each coordinate
of the kept axes, the ranks at that coordinate hold one contribution ``c_k`` laid out by the
source's other axes, and only need it laid out by the target's other axes; the value is the
op over ``k`` of the ``c_k`` whatever their layout, so the target layout holds it (a Partial
target need not be in its canonical form, ``Partial.partition_value``: full_tensor reduces
every contribution). Those slices are independent transitions, one per coordinate, each
planned by the planner on the mesh without the kept axes, and run side by side: this is the
"keep pending" accounting of ``bound.py`` (Partial targets), bounds summed, busiest = max.

Partial axes never cut the tensor, so a rank's block has the same shape and offset on the
full mesh and on the reduced one, and the sub-plan's steps lift to the full mesh by renaming
their axes. Only one reduce op may appear in the two layouts (the order mixed ops are applied
in would change the value). A flattened group that includes a kept axis spans several slices:
it may carry the slices' all_to_alls side by side (each rank sends only within its slice),
never a reduction (``widen``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence, TypeVar

from shardwise.core.placement import Placement
from shardwise.redistribute.bound import coordinates
from shardwise.redistribute.exchange import Transfer

__all__ = ["kept_axes", "drop", "insert", "sub_groups", "widen", "rest_axes", "lift_transfers"]

T = TypeVar("T")
Layout = tuple[Placement, ...]


def kept_axes(mesh_shape: Sequence[int], src: Layout, dst: Layout) -> tuple[int, ...]:
    """Axes (of more than one rank) that may stay Partial: the same Partial in ``src`` and
    ``dst``, when every Partial of either layout has that one op. Empty when none may."""
    ops = {p.reduce_op for p in src + dst if p.is_partial()}  # type: ignore[attr-defined]
    if len(ops) != 1:
        return ()
    return tuple(a for a, (p, q) in enumerate(zip(src, dst)) if p.is_partial() and p == q and mesh_shape[a] > 1)


def rest_axes(ndim: int, kept: Sequence[int]) -> tuple[int, ...]:
    """The axes that are not kept, ascending: sub-mesh axis ``i`` is full-mesh axis ``rest[i]``."""
    return tuple(a for a in range(ndim) if a not in kept)


def drop(items: Sequence[T], kept: Sequence[int]) -> tuple[T, ...]:
    """``items`` (a layout, a mesh shape, a coordinate) without the kept axes."""
    return tuple(x for a, x in enumerate(items) if a not in kept)


def insert(items: Sequence[T], kept: Sequence[int], values: Sequence[T]) -> tuple[T, ...]:
    """The inverse of ``drop``: ``items`` with ``values[j]`` put back at axis ``kept[j]``."""
    out, it, put = [], iter(items), dict(zip(kept, values))
    for a in range(len(items) + len(kept)):
        out.append(put[a] if a in put else next(it))
    return tuple(out)


def sub_groups(flattened: Sequence[Sequence[int]], kept: Sequence[int], ndim: int) -> tuple[tuple[int, ...], ...]:
    """The flattened groups in sub-mesh axis numbers, each without its kept axes (those of two
    or more axes left). A group that spans kept axes still carries a per-slice all_to_all (no
    rank sends outside its slice), but not a reduction: ``widen`` says which to run on."""
    index = {a: i for i, a in enumerate(rest_axes(ndim, kept))}
    subs = {tuple(index[a] for a in g if a not in kept) for g in flattened}
    return tuple(sorted(g for g in subs if len(g) > 1))


def widen(axes: Sequence[int], flattened: Sequence[Sequence[int]], kept: Sequence[int],
          mesh_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The existing flattened group (full-mesh axes) that runs a per-slice all_to_all over
    ``axes`` (full-mesh axes, two or more): ``axes`` itself when it exists, else the smallest
    that adds only kept axes to it; None when there is none."""
    if tuple(axes) in {tuple(g) for g in flattened}:
        return tuple(axes)
    wide = [tuple(g) for g in flattened if set(g) - set(kept) == set(axes)]
    return min(wide, key=lambda g: (math.prod(mesh_shape[a] for a in g), g)) if wide else None


def lift_transfers(transfers: Sequence[Transfer], mesh_shape: Sequence[int], kept: Sequence[int],
                   here: Sequence[int]) -> tuple[Transfer, ...]:
    """A schedule planned on the mesh without the kept axes, as the transfers of the slice of
    ``here`` (a full-mesh coordinate): every rank index renumbered row-major on the full mesh."""
    if not kept:
        return tuple(transfers)
    sub = coordinates(drop(mesh_shape, kept))
    index = {c: i for i, c in enumerate(coordinates(mesh_shape))}
    at = tuple(here[a] for a in kept)

    def full(r: int) -> int:
        return index[insert(sub[r], kept, at)]

    return tuple(replace(t, sender=full(t.sender), receiver=full(t.receiver), source=full(t.source)) for t in transfers)
