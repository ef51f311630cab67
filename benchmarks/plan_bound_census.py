#!/usr/bin/env python
"""How far the redistribute planner is from the true lower bound for Partial sources (pure, no processes).

    python benchmarks/plan_bound_census.py
    python benchmarks/plan_bound_census.py --family   # also reduce-forward against its family's optimum (scipy)

Every Partial(sum) source and every target over {Replicate, Shard(0), Shard(1), Partial} on the
(2, 2) and (2, 2, 2) meshes (source == target left out), every flattened group available, for
an even (8x8) and an uneven (7x5) float32 tensor. Per mesh and shape it prints how many plans send
more bytes in all than ``bound.lower_bound(...).total``, how many of those are transitions
where keeping the reduction pending is cheaper than reducing it, and how many plans have a
busiest rank above ``busiest`` (which ``redistribute/bound.py`` shows is not always reachable
together with the total for Partial sources). The total is compared at each all_reduce's exact
figure (``Plan.exact_total_bytes``); how many plans are above it as ``comm`` counts an
all_reduce is printed too.

With ``--family`` it also weighs reduce-forward's busiest rank against the least its own family
of two-round schedules allows (a linear program, solved with scipy, which shardwise does not
need): how much a better choice of first owners and senders could still gain.
"""

from __future__ import annotations

import itertools
import math
import sys

from shardwise import Partial, Replicate, Shard
from shardwise.redistribute import plan_redistribute
from shardwise.redistribute.bound import lower_bound, reducing_total
from shardwise.redistribute.reduce_forward import cell_choices, forwardable, plan_reduce_forward

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


def family_optimum(shape: tuple, mesh: tuple, src: tuple, dst: tuple) -> float:
    """The least busiest rank, in elements, over reduce-forward's own family of schedules, with
    elements divisible (a linear program, so a lower bound for that family): per element one
    first owner among the ranks that need it and hold a contribution, one sender per other
    contribution class, the owner sending the value to the rest."""
    import numpy as np
    from scipy.optimize import linprog

    ranks = math.prod(mesh)
    loads: list[tuple[int, int, int]] = []  # (variable, rank, elements sent per unit)
    equalities: list[tuple[dict[int, int], int]] = []
    n_vars = 0
    for _, v, wanting, owners, classes in cell_choices(shape, mesh, src, dst):
        firsts = []
        for f in owners:
            x, n_vars = n_vars, n_vars + 1
            firsts.append(x)
            loads.append((x, f, len(wanting) - (f in wanting)))
            for members in classes:
                if f not in members:
                    senders = list(range(n_vars, n_vars + len(members)))
                    n_vars += len(members)
                    loads += [(y, s, 1) for y, s in zip(senders, members)]
                    equalities.append(({**{y: 1 for y in senders}, x: -1}, 0))
        equalities.append(({x: 1 for x in firsts}, v))
    busiest = n_vars
    a_eq = np.zeros((len(equalities), n_vars + 1))
    b_eq = np.array([b for _, b in equalities], dtype=float)
    for i, (row, _) in enumerate(equalities):
        for col, coef in row.items():
            a_eq[i, col] += coef
    a_ub = np.zeros((ranks, n_vars + 1))
    for col, r, coef in loads:
        a_ub[r, col] += coef
    a_ub[:, busiest] = -1
    cost = np.zeros(n_vars + 1)
    cost[busiest] = 1
    return float(linprog(cost, A_ub=a_ub, b_ub=np.zeros(ranks), A_eq=a_eq, b_eq=b_eq, method="highs").fun)


def family_census(mesh: tuple, shape: tuple) -> str:
    """How far reduce-forward's local search is from its family's optimum (``family_optimum``)."""
    layouts = list(itertools.product([R, S0, S1, P], repeat=len(mesh)))
    at, gaps = 0, []
    for src, dst in itertools.product(layouts, layouts):
        if src == dst or not forwardable(mesh, src, dst) or any(p.is_partial() and p == q for p, q in zip(src, dst)):
            continue
        best = math.ceil(family_optimum(shape, mesh, src, dst) - 1e-6)
        got = max(plan_reduce_forward(shape, mesh, src, dst).sends)
        if got <= best:
            at += 1
        else:
            gaps.append(got / best)
    return (f"mesh {mesh} shape {shape}: reduce-forward's busiest rank at its family's optimum in {at} of "
            f"{at + len(gaps)} transitions; above it in {len(gaps)}, by at most {max(gaps, default=1.0):.2f}x")


def main() -> None:
    family = "--family" in sys.argv[1:]
    for mesh in [(2, 2), (2, 2, 2)]:
        for shape in [(8, 8), (7, 5)]:
            print(census(mesh, shape), flush=True)
            if family:
                print("  " + family_census(mesh, shape), flush=True)


if __name__ == "__main__":
    main()
