"""One all_to_all that takes every rank straight to its target block (pure schedule).

Axis-by-axis steps move data only along one mesh axis at a time, so a block that sits on a
rank of another axis travels twice, and ranks that already hold their target block still
take part. The exchange sends each rank exactly what it lacks, once, from a rank that holds
it: the ranks holding the same source block (a holder class) share what the class must send
evenly, element by element, so the busiest rank sends the one-round lower bound
(``bound.lower_bound``). It runs as one all_to_all with per-peer counts over the flattened
group of the mesh axes along which senders and receivers differ.

The source layout must hold values (no Partial axis: a reduction is not one round); the
target may be Partial, its ranks off coordinate 0 then hold the reduction's identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwise.placement import Placement
from shardwise.redistribute.bound import Box, blocks, coordinates, intersect, needs_value, volume

__all__ = ["Transfer", "Exchange", "plan_exchange"]

Layout = tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class Transfer:
    """``sender`` gives ``receiver`` elements ``[start, stop)`` of ``box`` (row-major within the
    box); ranks are row-major mesh indices."""

    sender: int
    receiver: int
    box: Box
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Exchange:
    """Every transfer of the exchange, in the order receivers concatenate them; ``sends`` are
    the elements each rank sends; ``axes`` the mesh axes along which some transfer crosses."""

    transfers: tuple[Transfer, ...]
    sends: tuple[int, ...]
    axes: tuple[int, ...]


@lru_cache(maxsize=4096)
def plan_exchange(shape: tuple, mesh_shape: tuple, src: Layout, dst: Layout) -> Exchange:
    """The exchange from ``src`` (no Partial) to ``dst``; see the module docstring."""
    if any(p.is_partial() for p in src):
        raise ValueError(f"an exchange starts from values, not from the Partial layout {list(src)}")
    coords = coordinates(mesh_shape)
    src_blocks, dst_blocks = blocks(shape, mesh_shape, src), blocks(shape, mesh_shape, dst)
    cutting = [a for a, p in enumerate(src) if p.is_shard()]
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
                    transfers.append(Transfer(sender, r, box, lo - at, hi - at))
                    sends[sender] += hi - lo
            at = end
    axes = sorted({a for t in transfers for a in range(len(mesh_shape)) if coords[t.sender][a] != coords[t.receiver][a]})
    return Exchange(tuple(transfers), tuple(sends), tuple(axes))
