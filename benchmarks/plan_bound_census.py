#!/usr/bin/env python
"""How far the redistribute planner's plans are from the true byte lower bound (pure, no processes).

    python benchmarks/plan_bound_census.py                   # priced on the cpu profile
    python benchmarks/plan_bound_census.py --hardware h100-80gb

Every source and target over {Replicate, Shard(0), Shard(1), Partial(sum)} on the (2, 2) and
(2, 2, 2) meshes (source == target left out), every flattened group available, for a small
(8x8), an uneven (7x5) and a large (1024x1024) float32 tensor. The planner chooses by predicted
time (``shardwise.cost``), not bytes: the bound (``redistribute/bound.py``) is a reported
figure. Per mesh and shape it prints how many plans send more bytes in all than the bound's
total, how many have a busiest rank above the one-round bound, and how many of either are
plans that trade bytes for fewer collectives (at least one other candidate sends fewer bytes
in all but is predicted slower).
"""

from __future__ import annotations

import argparse
import itertools

from shardwise import Partial, Replicate, Shard
from shardwise.cost import load_hardware
from shardwise.redistribute.bound import lower_bound
from shardwise.redistribute.planner import plan_candidates, plan_redistribute

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
ITEMSIZE = 4


def flattened_groups(mesh: tuple) -> tuple:
    axes = range(len(mesh))
    return tuple(c for k in range(2, len(mesh) + 1) for c in itertools.combinations(axes, k))


def census(mesh: tuple, shape: tuple, hardware) -> str:
    layouts = list(itertools.product([R, S0, S1, P], repeat=len(mesh)))
    count = total_above = busiest_above = traded = 0
    for src, dst in itertools.product(layouts, layouts):
        if src == dst:
            continue
        count += 1
        groups = flattened_groups(mesh)
        plan = plan_redistribute(shape, ITEMSIZE, mesh, src, dst, groups, hardware)
        bound = lower_bound(shape, ITEMSIZE, mesh, src, dst)
        above = plan.total_bytes > bound.total
        total_above += above
        busiest_above += plan.busiest_bytes > bound.busiest
        if above or plan.busiest_bytes > bound.busiest:
            others = plan_candidates(shape, ITEMSIZE, mesh, src, dst, groups, hardware)
            traded += any(c.total_bytes < plan.total_bytes for c in others)
    return (f"mesh {mesh} shape {shape}: {count} transitions; total above the bound {total_above}, "
            f"busiest rank above its one-round bound {busiest_above}; of these, a candidate with fewer "
            f"bytes in all was predicted slower in {traded}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="cpu", help="profile in shardwise/plan/hardware.json")
    hardware = load_hardware(parser.parse_args().hardware)
    for mesh in [(2, 2), (2, 2, 2)]:
        for shape in [(8, 8), (7, 5), (1024, 1024)]:
            print(census(mesh, shape, hardware), flush=True)


if __name__ == "__main__":
    main()
