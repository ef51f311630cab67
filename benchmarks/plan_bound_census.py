#!/usr/bin/env python
"""How far the redistribute planner is from the true lower bound for Partial sources (pure, no processes).

    python benchmarks/plan_bound_census.py

Every Partial(sum) source and every target over {Replicate, Shard(0), Shard(1), Partial} on the
(2, 2) and (2, 2, 2) meshes (source == target left out), every flattened group available, for
an even (8x8) and an uneven (7x5) float32 tensor. Per mesh and shape it prints how many plans send
more bytes in all than ``bound.lower_bound(...).total``, how many of those are transitions
where keeping the reduction pending is cheaper than reducing it, and how many plans have a
busiest rank above ``busiest`` (which ``redistribute/bound.py`` shows is not always reachable
together with the total for Partial sources).
"""

from __future__ import annotations

import itertools
import math

from shardwise import Partial, Replicate, Shard
from shardwise.redistribute import plan_redistribute
from shardwise.redistribute.bound import lower_bound, reducing_total

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
ITEMSIZE = 4


def flattened_groups(mesh: tuple) -> tuple:
    axes = range(len(mesh))
    return tuple(c for k in range(2, len(mesh) + 1) for c in itertools.combinations(axes, k))


def keep_total(shape: tuple, mesh: tuple, src: tuple, dst: tuple) -> int | None:
    """Elements sent in all when the axes Partial on both sides keep their reduction pending."""
    kept = [a for a in range(len(mesh)) if src[a].is_partial() and src[a] == dst[a] and mesh[a] > 1]
    if not kept:
        return None
    rest = [a for a in range(len(mesh)) if a not in kept]
    sub = lower_bound(shape, ITEMSIZE, tuple(mesh[a] for a in rest), tuple(src[a] for a in rest),
                      tuple(dst[a] for a in rest))
    return math.prod(mesh[a] for a in kept) * sub.total


def census(mesh: tuple, shape: tuple) -> str:
    layouts = list(itertools.product([R, S0, S1, P], repeat=len(mesh)))
    count = above = keeping_cheaper = busiest_above = grain = 0
    for src in layouts:
        if not any(p.is_partial() for p in src):
            continue
        for dst in layouts:
            if src == dst:
                continue
            count += 1
            plan = plan_redistribute(shape, ITEMSIZE, mesh, src, dst, flattened_groups(mesh))
            bound = lower_bound(shape, ITEMSIZE, mesh, src, dst)
            grain += plan.total_bytes > bound.total
            if plan.exact_total_bytes > bound.total:
                above += 1
                kept = keep_total(shape, mesh, src, dst)
                keeping_cheaper += kept is not None and kept < reducing_total(shape, mesh, src, dst) * ITEMSIZE
            busiest_above += plan.busiest_bytes > bound.busiest
    return (f"mesh {mesh} shape {shape}: {count} transitions; total above the bound {above} "
            f"(keeping pending cheaper: {keeping_cheaper}; as comm counts all_reduces: {grain}); "
            f"busiest rank above its bound {busiest_above}")


def main() -> None:
    for mesh in [(2, 2), (2, 2, 2)]:
        for shape in [(8, 8), (7, 5)]:
            print(census(mesh, shape), flush=True)


if __name__ == "__main__":
    main()
