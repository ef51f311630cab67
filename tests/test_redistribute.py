"""redistribute on real gloo groups: placement pairs, values and bytes, seed examples.

On 1-D and 2-D meshes every (source, target) pair runs. A 3-D mesh has 4096 pairs (about 2
minutes per shape on two cores), so it runs the few pairs (about 450) whose plans together take
every single-axis step (layout before it, axis, collective, bytes) that the plan of any of the
4096 takes, every kind of exchange (its axes, the kinds of placement before and after), and
start from every source and end in every target
layout: each step the executor can be asked to run is run and its bytes checked. Exchange
schedules themselves are replayed on in-memory blocks for random meshes, shapes and layouts
(tests/test_plan_bound.py), and the planner is checked on every pair without processes
(tests/test_plan.py).
"""

import heapq
import itertools
import math

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.cost import Hardware, use_hardware
from shardwise.debug import CommDebugMode
from shardwise.redistribute import plan_redistribute
from shardwise.redistribute.execute import flattened_groups

ALL = [Replicate(), Shard(0), Shard(1), Partial()]


def _all_pairs(mesh_shape):
    layouts = list(itertools.product(ALL, repeat=len(mesh_shape)))
    return [(src, dst) for src in layouts for dst in layouts]


def _exchange_kind(layout, step):
    """What the executor's handling of an exchange step depends on: the axes it spans, those
    kept pending, its collective, and which axes hold shards, copies or partial values before
    and after it."""
    def kinds(placements):
        return tuple("P" if p.is_partial() else "R" if p.is_replicate() else "S" for p in placements)

    return ("exchange", step.axes, step.kept, step.collective, kinds(layout), kinds(step.target))


def _covering_pairs(dist, mesh_shape, shape):
    """Few pairs that together take every step of every pair's plan (greedy set cover).

    A pair's features: its source, its target, and each step of its plan with the layout it
    starts from (what the executor's block sizes and groups depend on), planned both without
    flattened groups and with the whole world's (merged Partial reductions). An exchange
    step's schedule is unique to its pair; the executor runs any schedule with the same code,
    and tests/test_plan_bound.py replays schedules' values, so here an exchange counts once per
    kind (``_exchange_kind``).
    """
    pairs = _all_pairs(mesh_shape)
    world = math.prod(mesh_shape)  # the pool's ranks plan a slice of the pairs each, in parallel
    features: list = [None] * len(pairs)
    for rank, found in enumerate(dist.run(world, _features, mesh_shape, shape, world, timeout=300)):
        features[rank::world] = found
    chosen, covered = [], set()
    heap = [(-len(f), i) for i, f in enumerate(features)]
    while heap:  # lazy greedy: a pair's gain only shrinks as more is covered
        _, i = heapq.heappop(heap)
        gain = len(features[i] - covered)
        if gain and heap and gain < -heap[0][0]:
            heapq.heappush(heap, (-gain, i))
        elif gain:
            chosen.append(i)
            covered |= features[i]
    assert covered == set().union(*features)
    return [pairs[i] for i in sorted(chosen)]


def _features(mesh_shape, shape, ranks):
    """``_covering_pairs``'s features of this rank's slice of the pairs (every ``ranks``-th)."""
    out = []
    for src, dst in _all_pairs(mesh_shape)[torch.distributed.get_rank()::ranks]:
        feats = {("src", src), ("dst", dst)}
        for flattened in ((), (tuple(range(len(mesh_shape))),)):
            layout = tuple(src)
            for step in plan_redistribute(shape, 8, mesh_shape, src, dst, flattened).steps:
                if step.target:
                    feats.add(_exchange_kind(layout, step))
                else:
                    feats.add((layout, step))
                layout = step.apply(layout)
        out.append(feats)
    return out


def _matrix(mesh_shape, shape, pairs):
    """Each (src, dst) pair: this rank's resulting block, offset and bytes sent per collective.

    Values are checked by the parent from every rank's blocks, so checking adds no collective.
    """
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x = _global(shape)
    results, starts = {}, {}
    for src, dst in pairs:
        if src not in starts:
            starts[src] = sw.distribute_tensor(x, mesh, src, src_data_rank=None)  # no communication
        with CommDebugMode() as comms:
            out = starts[src].redistribute(mesh, dst)
        _, offset = out._spec.local_shape_and_offset()
        kinds = [r.kind for r in comms.records]
        results[(src, dst)] = (out.placements, out.to_local().clone(), offset, mesh.get_coordinate(), kinds,
                               [r.bytes_sent for r in comms.records])
    # Which flattened groups the executor may use depends on the groups this pool created before.
    results["flattened"] = flattened_groups(mesh)
    return results


def _global(shape):
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).sin()


def _reassemble(dst, per_rank):
    """The logical tensor from every rank's block: one copy per Replicate axis, Partial summed."""
    for _, local, offset, coordinate, _, _ in per_rank:
        if any(c != 0 for c, p in zip(coordinate, dst) if p.is_replicate()):
            continue
        index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
        yield index, local


def _check(out, mesh_shape, shape):
    """Right placements and values; the busiest rank sent exactly what the plan promised."""
    x = _global(shape)
    flattened = out[0]["flattened"]
    for (src, dst) in (pair for pair in out[0] if pair != "flattened"):
        per_rank = [o[(src, dst)] for o in out]
        logical = torch.zeros_like(x)
        for index, local in _reassemble(dst, per_rank):
            logical[index] += local
        assert torch.allclose(logical, x), f"{src}->{dst}: wrong values"
        assert all(p[0] == dst for p in per_rank), f"{src}->{dst}: wrong placements"
        plan = plan_redistribute(shape, 8, mesh_shape, src, dst, flattened)
        steps = plan.issued  # (collective, busiest rank's bytes)
        for rank, (_, _, _, _, kinds, sent) in enumerate(per_rank):
            # A group whose blocks are all empty skips a step, together; no rank sends more.
            planned = iter(steps)
            assert all(any(k == c and b <= limit for c, limit in planned) for k, b in zip(kinds, sent)), (
                f"{src}->{dst}: rank {rank} ran {list(zip(kinds, sent))}, plan {plan}")
        # Every rank sent what the plan counts for it (exchanges whose group has nothing to
        # move skip, like the empty groups above), and the busiest rank of each step its figure.
        sent_by = {tuple(p[3]): sum(p[5]) for p in per_rank}
        want = dict(zip(itertools.product(*(range(n) for n in mesh_shape)), plan.sends))
        assert sent_by == want, f"{src}->{dst}: ranks sent {sent_by}, plan {plan} counts {want}"
        if all(len(p[5]) == len(steps) for p in per_rank):
            busiest = [max(s) for s in zip(*(p[5] for p in per_rank))]
            assert not busiest or busiest == [b for _, b in steps], (
                f"{src}->{dst}: busiest rank sent {busiest}, plan {plan}")


@pytest.mark.parametrize(
    "mesh_shape,shape",
    [((4,), (8, 12)), ((4,), (5, 7)), ((2, 2), (8, 12)), ((2, 2), (5, 7)), ((2, 2, 2), (8, 12)), ((2, 2, 2), (5, 3))],
)
def test_every_placement_pair(dist, mesh_shape, shape):
    world = math.prod(mesh_shape)
    pairs = _all_pairs(mesh_shape) if len(mesh_shape) < 3 else _covering_pairs(dist, mesh_shape, shape)
    out = dist.run(world, _matrix, mesh_shape, shape, pairs, timeout=300)
    assert [pair for pair in out[0] if pair != "flattened"] == pairs
    _check(out, mesh_shape, shape)


def test_empty_shards_through_every_transition(dist):
    # (3, 5) over 8 ranks: five ranks hold no rows; nobody may skip a collective.
    _check(dist.run(8, _matrix, (8,), (3, 5), _all_pairs((8,)), timeout=120), (8,), (3, 5))


def _seed_shard_examples():
    mesh = sw.init_device_mesh("cpu", (2,))
    a, b, c, d = 1.0, 2.0, 3.0, 4.0
    rep = sw.DTensor.from_local(torch.tensor([a, b, c, d]), mesh, [Replicate()])
    shard = rep.redistribute(mesh, [Shard(0)])
    with CommDebugMode() as gather:
        back = shard.redistribute(mesh, [Replicate()])
    rows = sw.DTensor.from_local(torch.tensor([[a, b], [c, d]]).narrow(0, dist.get_rank(), 1), mesh, [Shard(0)])
    with CommDebugMode() as a2a:
        cols = rows.redistribute(mesh, [Shard(1)])
    return shard.to_local().tolist(), back.to_local().tolist(), gather.get_comm_counts(), cols.to_local().tolist(), a2a.get_comm_counts()


def test_seed_examples_shard_replicate_all_to_all(dist):
    out = dist.run(2, _seed_shard_examples)
    assert out[0][0] == [1.0, 2.0] and out[1][0] == [3.0, 4.0]  # [a,b] | [c,d]
    assert out[0][1] == out[1][1] == [1.0, 2.0, 3.0, 4.0] and out[0][2] == {"all_gather": 1}
    assert out[0][3] == [[1.0], [3.0]] and out[1][3] == [[2.0], [4.0]]  # [a,c] | [b,d]
    assert out[0][4] == {"all_to_all": 1}


def _seed_partial_examples():
    mesh = sw.init_device_mesh("cpu", (2,))
    local = torch.tensor([1.0, 2.0, 3.0, 4.0]) if dist.get_rank() == 0 else torch.tensor([5.0, 6.0, 7.0, 8.0])
    partial = sw.DTensor.from_local(local, mesh, [Partial()])
    with CommDebugMode() as ar:
        rep = partial.redistribute(mesh, [Replicate()])
    with CommDebugMode() as rs:
        shard = partial.redistribute(mesh, [Shard(0)])
    return rep.to_local().tolist(), ar.get_comm_counts(), shard.to_local().tolist(), rs.get_comm_counts()


def test_seed_examples_partial(dist):
    out = dist.run(2, _seed_partial_examples)
    assert out[0][0] == out[1][0] == [6.0, 8.0, 10.0, 12.0] and out[0][1] == {"all_reduce": 1}
    assert out[0][2] == [6.0, 8.0] and out[1][2] == [10.0, 12.0] and out[0][3] == {"reduce_scatter": 1}


def _partial_ops(op):
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    local = torch.arange(6.0).reshape(3, 2) * (rank + 1) - rank
    partial = sw.DTensor.from_local(local, mesh, [Partial(op)])
    return partial.full_tensor(), partial.redistribute(mesh, [Shard(0)]).to_local(), local


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_partial_reduce_ops(dist, op):
    out = dist.run(4, _partial_ops, op)
    stacked = torch.stack([o[2] for o in out])
    want = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
    for rank, (full, shard, _) in enumerate(out):
        assert torch.allclose(full, want)
        assert torch.allclose(shard, want.chunk(4)[rank] if rank < 3 else want[3:])


# Latency free: the planner takes an exchange wherever its busiest rank sends less.
BANDWIDTH_ONLY = Hardware("bandwidth-only", 0, 0, intra_node_bw=1e9, inter_node_bw=1e9)


def _exchanges(cases):
    """Per (mesh, shape): every placement pair whose plan here takes an exchange step (one
    all_to_all over several axes at once, or a local relayout), run; this rank's block, offset,
    coordinate, the bytes it sent and the bytes the plan says it sends."""
    import random

    from shardwise.redistribute.bound import coordinates

    before = use_hardware(BANDWIDTH_ONLY)  # exchanges even for these small shapes (the executor is under test)
    try:
        results = {}
        for mesh_shape, shape, limit in cases:
            mesh = sw.init_device_mesh("cpu", mesh_shape)
            flattened = flattened_groups(mesh)
            me = coordinates(mesh_shape).index(tuple(mesh.get_coordinate()))
            shuffled = _all_pairs(mesh_shape)
            random.Random(0).shuffle(shuffled)
            pairs = itertools.islice(((s, d) for s, d in shuffled
                                      if any(st.target for st in plan_redistribute(shape, 8, mesh_shape, s, d, flattened).steps)),
                                     limit)
            x = _global(shape)
            for src, dst in pairs:
                start = sw.distribute_tensor(x, mesh, src, src_data_rank=None)
                with CommDebugMode() as comms:
                    out = start.redistribute(mesh, dst)
                plan = plan_redistribute(shape, 8, mesh_shape, src, dst, flattened)
                _, offset = out._spec.local_shape_and_offset()
                results[(mesh_shape, shape, src, dst)] = (
                    out.placements, out.to_local().clone(), offset, mesh.get_coordinate(),
                    sum(r.bytes_sent for r in comms.records), plan.sends[me], str(plan))
    finally:
        use_hardware(before)  # the pool's workers run other tests next
    return results


def _check_exchanges(out):
    assert out[0], "no exchange step was planned"
    for key in out[0]:
        mesh_shape, shape, src, dst = key
        per_rank = [o[key] for o in out]
        x = _global(shape)
        logical = torch.zeros_like(x)
        for _, local, offset, coordinate, *_ in per_rank:
            if any(c != 0 for c, p in zip(coordinate, dst) if p.is_replicate()):
                continue
            logical[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))] += local
        assert torch.allclose(logical, x), f"{key}: wrong values ({per_rank[0][6]})"
        assert all(p[0] == dst for p in per_rank), f"{key}: wrong placements"
        assert [p[4] for p in per_rank] == [p[5] for p in per_rank], (
            f"{key}: ranks sent {[p[4] for p in per_rank]} B, plan {per_rank[0][6]} says {[p[5] for p in per_rank]}")


def test_exchange_steps_on_four_ranks(dist):
    # The (2, 2) cases are among them: (S0,S0)->(S1,S1), (R,S0)->(S0,R).
    cases = [((2, 2), (7, 5), 200), ((2, 2), (8, 4), 200), ((4,), (7, 5), 50), ((2, 2), (1, 3), 50)]
    out = dist.run(4, _exchanges, cases, timeout=120)
    keys = {k[:2] + k[2:] for k in out[0]}
    assert ((2, 2), (8, 4), (Shard(0), Shard(0)), (Shard(1), Shard(1))) in keys
    assert ((2, 2), (7, 5), (Replicate(), Shard(0)), (Shard(0), Replicate())) in keys
    _check_exchanges(out)


def test_exchange_steps_on_eight_ranks(dist):
    out = dist.run(8, _exchanges, [((2, 2, 2), (7, 5), 60), ((2, 2, 2), (4, 2), 40)], timeout=180)
    _check_exchanges(out)
