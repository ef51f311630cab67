"""One all_to_all that takes every rank straight to its target block (pure schedule).

Axis-by-axis steps move data only along one mesh axis at a time, so a block that sits on a
rank of another axis travels twice, and ranks that already hold their target block still
take part. The exchange sends each rank exactly what it lacks, once, from a rank that holds
it: the ranks holding the same source block (a holder class) share what the class must send
evenly, element by element, so the busiest rank sends the one-round lower bound
(``bound.lower_bound``). It runs as one all_to_all with per-peer counts over the flattened
group of the mesh axes along which senders and receivers differ.

The target may be Partial: its ranks off coordinate 0 then hold the reduction's identity.
The source may be Partial(sum) when the target is not Partial or Partial(sum) (a *reducing*
exchange; a Partial target then gets the whole sum at coordinate 0, zeros elsewhere): every
holder of a contribution sends it to the ranks whose target block needs it, and they add
what they receive to their own contribution. Where each element is needed by one rank (a
fully sharded target) that is the least a reduction can send, n - 1 values per element;
otherwise the planner reduces into a fully sharded layout first and exchanges values after.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwise.core.placement import Placement
from shardwise.redistribute.bound import Box, blocks, coordinates, intersect, needs_value, volume

__all__ = ["Transfer", "Exchange", "plan_exchange", "reducible"]

Layout = tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class Transfer:
    """``sender`` gives ``receiver`` elements ``[start, stop)`` of ``box`` (row-major within the
    box); ranks are row-major mesh indices. ``source`` names the holder class (its first rank):
    in a reducing exchange a box arrives once per contribution."""

    sender: int
    receiver: int
    box: Box
    start: int
    stop: int
    source: int


@dataclass(frozen=True, slots=True)
class Exchange:
    """Every transfer of the exchange, in the order receivers concatenate them; ``sends`` are
    the elements each rank sends; ``axes`` the mesh axes along which some transfer crosses."""

    transfers: tuple[Transfer, ...]
    sends: tuple[int, ...]
    axes: tuple[int, ...]


def reducible(src: Layout, dst: Layout) -> bool:
    """Whether an exchange can go from ``src`` to ``dst`` (see the module docstring)."""
    partial = [p for p in src if p.is_partial()]
    return not partial or all(p.is_partial("sum") for p in partial + [q for q in dst if q.is_partial()])


@lru_cache(maxsize=4096)
def plan_exchange(shape: tuple, mesh_shape: tuple, src: Layout, dst: Layout) -> Exchange:
    """The exchange from ``src`` to ``dst``; see the module docstring."""
    if not reducible(src, dst):
        raise ValueError(f"no exchange from {list(src)} to {list(dst)}: a Partial source must be Partial(sum) "
                         "and so must a Partial target")
    coords = coordinates(mesh_shape)
    src_blocks, dst_blocks = blocks(shape, mesh_shape, src), blocks(shape, mesh_shape, dst)
    cutting = [a for a, p in enumerate(src) if not p.is_replicate()]  # and Partial: one class per contribution
    classes: dict = {}
    for r, c in enumerate(coords):
        classes.setdefault(tuple(c[a] for a in cutting), []).append(r)
    transfers: list[Transfer] = []
    sends = [0] * len(coords)
    for members in classes.values():
        wants = []  # (receiver, box) this class must serve, in receiver order
        for r, c in enumerate(coords):
            if r in members or not needs_value(dst, c):
                continue
            box = intersect(src_blocks[members[0]], dst_blocks[r])
            if volume(box):
                wants.append((r, box))
        total = sum(volume(b) for _, b in wants)
        share = -(-total // len(members)) if total else 0
        at = 0
        for r, box in wants:
            end = at + volume(box)
            for k, sender in enumerate(members):
                lo, hi = max(at, k * share), min(end, (k + 1) * share)
                if hi > lo:
                    transfers.append(Transfer(sender, r, box, lo - at, hi - at, members[0]))
                    sends[sender] += hi - lo
            at = end
    axes = sorted({a for t in transfers for a in range(len(mesh_shape)) if coords[t.sender][a] != coords[t.receiver][a]})
    return Exchange(tuple(transfers), tuple(sends), tuple(axes))
