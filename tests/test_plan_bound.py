"""The redistribute planner against the true lower bound (redistribute/bound.py), no processes.

Random meshes up to 3-D, tensors up to 3-D with even, uneven and empty blocks, random layout
pairs. The bound is a reported figure, not the planner's target (it chooses by predicted
time): every plan sends at least the bound, the chosen plan is the fastest predicted candidate,
and on a profile where only bandwidth counts a plan from values meets the total bound. The
exchange schedules are replayed on in-memory blocks; kept-pending plans run on real ranks.
"""

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise import Partial, Replicate, Shard
from shardwise.redistribute import plan_redistribute
from shardwise.cost import Hardware
from shardwise.redistribute.planner import plan_candidates
from shardwise.redistribute.bound import blocks, coordinates, lower_bound, needs_value
from shardwise.redistribute.exchange import plan_exchange

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
F32 = 4


def _all_groups(mesh_shape):
    """Every set of two or more axes: as if each flattened group existed."""
    axes = range(len(mesh_shape))
    return tuple(c for k in range(2, len(mesh_shape) + 1) for c in itertools.combinations(axes, k))


@st.composite
def _cases(draw, partial_source: bool):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    values = [R, *(Shard(d) for d in range(len(shape)))]
    src = tuple(draw(st.sampled_from(values + [P] if partial_source else values)) for _ in mesh_shape)
    dst = tuple(draw(st.sampled_from(values + [P])) for _ in mesh_shape)
    if partial_source and not any(p.is_partial() for p in src):
        src = (P,) + src[1:]
    return mesh_shape, shape, src, dst


def _plan_and_bound(case: tuple) -> tuple:
    """(mesh shape, the plan with every flattened group available, the true lower bound)."""
    mesh_shape, shape, src, dst = case
    plan = plan_redistribute(shape, F32, mesh_shape, src, dst, _all_groups(mesh_shape))
    return mesh_shape, plan, lower_bound(shape, F32, mesh_shape, src, dst)


@settings(max_examples=300, deadline=None)
@given(_cases(partial_source=False) | _cases(partial_source=True))
def test_plans_send_at_least_the_bound_and_are_the_fastest_candidate(case):
    mesh_shape, shape, src, dst = case
    _, plan, bound = _plan_and_bound(case)
    assert plan.total_bytes >= bound.total and plan.busiest_bytes >= bound.busiest_any, f"{plan}: {plan.sends} vs {bound}"
    assert all(sent >= 0 for sent in plan.sends) and len(plan.sends) == math.prod(mesh_shape)
    others = plan_candidates(shape, F32, mesh_shape, src, dst, _all_groups(mesh_shape))
    assert plan.predicted_s <= min(c.predicted_s for c in others), f"{plan} slower than another candidate"


# Bandwidth only, one link: time is the busiest ranks' bytes, step by step.
WIRE = Hardware("wire", 0, 0, intra_node_bw=1.0, inter_node_bw=1.0, gpus_per_node=1 << 20)


@settings(max_examples=300, deadline=None)
@given(_cases(partial_source=False))
def test_plans_from_values_meet_the_total_bound_where_bandwidth_is_all(case):
    """Without latency, the time of a plan from values is at least its one-round busiest bound,
    which the exchange meets while sending exactly what the ranks lack."""
    mesh_shape, shape, src, dst = case
    plan = plan_redistribute(shape, F32, mesh_shape, src, dst, _all_groups(mesh_shape), hardware=WIRE)
    bound = lower_bound(shape, F32, mesh_shape, src, dst)
    assert plan.predicted_s <= bound.busiest, f"{plan} vs {bound}"
    if len(plan.steps) == 1 and plan.steps[0].target:
        assert plan.total_bytes == bound.total, f"{plan} vs {bound}"




def test_reductions_meet_the_partial_bound():
    # all_reduce = 2(n-1) messages per element, reduce_scatter n-1 (n divides the blocks); a
    # large tensor, where bytes outweigh the latency of a second collective.
    for mesh_shape, src, dst in [((4,), (P,), (R,)), ((4,), (P,), (S0,)), ((2, 2), (P, P), (R, R)),
                                 ((2, 2), (P, R), (S0, S1)), ((2, 2), (P, P), (S0, S1))]:
        plan = plan_redistribute((1024, 1024), F32, mesh_shape, src, dst, _all_groups(mesh_shape))
        bound = lower_bound((1024, 1024), F32, mesh_shape, src, dst)
        assert (plan.total_bytes, plan.busiest_bytes) == (bound.total, bound.busiest), f"{src}->{dst}: {plan}"


def test_issue_examples_use_one_exchange_at_the_bound():
    # (2, 2) mesh, 4 MiB: axis by axis these moved 2-4x what the ranks lack.
    for src, dst in [((S0, S0), (S1, S1)), ((R, S0), (S0, R)), ((S0, S1), (S1, S0))]:
        axis_by_axis = plan_redistribute((1024, 1024), F32, (2, 2), src, dst)  # no flattened group
        plan = plan_redistribute((1024, 1024), F32, (2, 2), src, dst, ((0, 1),))
        bound = lower_bound((1024, 1024), F32, (2, 2), src, dst)
        assert plan.collectives == ["all_to_all"] and plan.steps[0].target == dst, str(plan)
        assert (plan.total_bytes, plan.busiest_bytes) == (bound.total, bound.busiest)
        assert axis_by_axis.total_bytes >= 2 * bound.total, str(axis_by_axis)
    # A small tensor: one exchange costs about two collectives' latency on the host (it packs
    # runs), and two collectives of a few bytes are faster.
    assert plan_redistribute((8, 8), F32, (2, 2), (S0, S0), (S1, S1), ((0, 1),)).collectives == ["all_gather", "all_to_all"]
    # (R, S0) -> (S0, R): two ranks already hold their rows; the other two lack half the tensor
    # and each holder class shares the sending.
    bound = lower_bound((8, 8), F32, (2, 2), (R, S0), (S0, R))
    assert bound.lacks == (0, 128, 128, 0) and bound.total == 256 and bound.busiest == 64


def test_bound_counts_what_is_lacked_not_what_is_largest():
    # 5 rows on 4 ranks (2, 2, 1, 0), Shard(0) -> Replicate: rank 0's 2 rows go to 3 ranks in
    # one round (6 rows), although no rank lacks more than 5.
    bound = lower_bound((5, 1), F32, (4,), (S0,), (R,))
    assert bound.lacks == tuple(F32 * n for n in (3, 3, 4, 5))
    assert bound.total == F32 * 15 and bound.busiest == F32 * 6 and bound.most_lacked == F32 * 5
    assert bound.busiest_any == F32 * 4  # relaying could spread it: ceil(15 / 4)
    # A Partial target needs values only at coordinate 0 (the others hold zeros).
    assert lower_bound((4, 4), F32, (2,), (S0,), (P,)).lacks == (F32 * 8, 0)


def _replay(shape, mesh_shape, src, dst):
    """Every rank's target block after the exchange, built from in-memory source blocks."""
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) + 1
    coords = coordinates(mesh_shape)
    src_b, dst_b = blocks(shape, mesh_shape, src), blocks(shape, mesh_shape, dst)
    ex = plan_exchange(shape, mesh_shape, src, dst)
    out = []
    for r, c in enumerate(coords):
        block = torch.zeros(dst_b[r][1], dtype=x.dtype)
        if needs_value(dst, c):
            own = _overlap(src_b[r], dst_b[r])  # what it holds, then every run it receives
            if own is not None:
                _cut_block(block, dst_b[r], own).copy_(_cut(x, own))
            got = {}
            for t in ex.transfers:
                if t.receiver == r:
                    assert t.sender != r and _inside(t.box, src_b[t.sender])
                    got.setdefault(t.box, []).append((t.start, _cut(x, t.box).reshape(-1)[t.start:t.stop]))
            for box, runs in got.items():
                _cut_block(block, dst_b[r], box).copy_(torch.cat([v for _, v in sorted(runs, key=lambda y: y[0])]).view(box[1]))
        out.append(block)
    return x, out, ex


def _cut(x, box):
    return x[tuple(slice(o, o + n) for o, n in zip(*box))]


def _cut_block(block, where, box):
    return block[tuple(slice(o - w, o - w + n) for o, n, w in zip(box[0], box[1], where[0]))]


def _inside(box, block):
    return all(b <= o and o + n <= b + m for o, n, b, m in zip(box[0], box[1], block[0], block[1]))


@settings(max_examples=150, deadline=None)
@given(_cases(partial_source=False))
def test_exchange_schedule_builds_every_target_block(case):
    mesh_shape, shape, src, dst = case
    x, out, ex = _replay(shape, mesh_shape, src, dst)
    for r, (c, (offset, size)) in enumerate(zip(coordinates(mesh_shape), blocks(shape, mesh_shape, dst))):
        if needs_value(dst, c):
            assert torch.equal(out[r], _cut(x, (offset, size))), f"rank {c}: {src}->{dst}"
    bound = lower_bound(shape, F32, mesh_shape, src, dst)
    assert sum(ex.sends) * F32 == bound.total and max(ex.sends, default=0) * F32 == bound.busiest


@settings(max_examples=100, deadline=None)
@given(_cases(partial_source=True))
def test_reducing_exchange_adds_every_contribution_once(case):
    mesh_shape, shape, src, dst = case
    dst = tuple(p if not p.is_partial() else R for p in dst)  # values, so every needer checks
    coords = coordinates(mesh_shape)
    partial_axes = [a for a, p in enumerate(src) if p.is_partial()]
    gen = torch.Generator().manual_seed(0)
    contributions = {k: torch.randint(-9, 9, shape, generator=gen).double()
                     for k in itertools.product(*(range(mesh_shape[a]) for a in partial_axes))}
    x = sum(contributions.values())
    src_b, dst_b = blocks(shape, mesh_shape, src), blocks(shape, mesh_shape, dst)
    ex = plan_exchange(shape, mesh_shape, src, dst)
    held = [_cut(contributions[tuple(c[a] for a in partial_axes)], src_b[r]) for r, c in enumerate(coords)]
    for r in range(len(coords)):
        block = torch.zeros(dst_b[r][1], dtype=x.dtype)
        own = _overlap(src_b[r], dst_b[r])
        if own is not None:
            _cut_block(block, dst_b[r], own).copy_(_cut_block(held[r], src_b[r], own))
        got = {}
        for t in ex.transfers:
            if t.receiver == r:
                piece = _cut_block(held[t.sender], src_b[t.sender], t.box).reshape(-1)[t.start:t.stop]
                got.setdefault((t.box, t.source), []).append((t.start, piece))
        for (box, _), runs in got.items():
            _cut_block(block, dst_b[r], box).add_(torch.cat([v for _, v in sorted(runs, key=lambda y: y[0])]).view(box[1]))
        assert torch.equal(block, _cut(x, dst_b[r])), f"rank {coords[r]}: {src}->{dst}"


def _overlap(a, b):
    lo = [max(p, q) for p, q in zip(a[0], b[0])]
    hi = [min(p + m, q + n) for p, m, q, n in zip(a[0], a[1], b[0], b[1])]
    if all(h > l for l, h in zip(lo, hi)):
        return tuple(lo), tuple(h - l for l, h in zip(lo, hi))
    return None


# Bandwidth only, shared by the node's ranks: time is the bytes of every rank.
SHARED_WIRE = Hardware("shared-wire", 0, 0, intra_node_bw=1.0, inter_node_bw=1.0, shared_bandwidth=True)


def test_kept_plans_are_chosen_where_predicted_faster_and_meet_the_keep_bound():
    # (2, 2, 2), 4 MiB on the cpu profile: axis 2 stays pending while axes 0 and 1 re-lay by one
    # exchange per slice; without the kept axis it would be reduced first.
    src, dst = (R, S0, P), (S0, R, P)
    plan = plan_redistribute((1024, 1024), F32, (2, 2, 2), src, dst, ((0, 1, 2),))
    assert [s.kept for s in plan.steps] == [(2,)] and plan.collectives == ["all_to_all"], str(plan)
    others = plan_candidates((1024, 1024), F32, (2, 2, 2), src, dst, ((0, 1, 2),))
    assert plan.predicted_s < min(c.predicted_s for c in others if not any(s.kept for s in c.steps))
    keep_bound = 2 * lower_bound((1024, 1024), F32, (2, 2), src[:2], dst[:2]).total  # one slice per coordinate
    assert plan.total_bytes == keep_bound == lower_bound((1024, 1024), F32, (2, 2, 2), src, dst).total


def _redistribute_contributions(mesh, shape, src, dst, seed):
    """On this rank: a DTensor of layout ``src`` built from seeded contributions (every rank
    builds the same ones; one per coordinate of the Partial axes), redistributed to ``dst``.
    Returns the contributions, the result, the bytes this rank sent and the plan."""
    import shardwise as sw
    from shardwise.debug import CommDebugMode
    from shardwise.redistribute.execute import flattened_groups
    from shardwise.core.spec import local_shape_and_offset

    mesh_shape = tuple(mesh.shape)
    coordinate = tuple(mesh.get_coordinate())
    partial_axes = [a for a, p in enumerate(src) if p.is_partial()]
    gen = torch.Generator().manual_seed(seed)
    contributions = {k: torch.randint(-9, 9, shape, generator=gen).float()
                     for k in itertools.product(*(range(mesh_shape[a]) for a in partial_axes))}
    size, offset = local_shape_and_offset(shape, mesh_shape, coordinate, src)
    mine = contributions[tuple(coordinate[a] for a in partial_axes)]
    local = mine[tuple(slice(o, o + n) for o, n in zip(offset, size))].contiguous()
    start = sw.DTensor.from_local(local, mesh, src, shape=shape, stride=torch.empty(shape).stride())
    with CommDebugMode() as comms:
        out = start.redistribute(mesh, dst)
    plan = plan_redistribute(shape, F32, mesh_shape, src, dst, flattened_groups(mesh))
    return contributions, out, sum(r.bytes_sent for r in comms.records), plan



def _kept(cases):
    """Run, on this rank, transitions whose plan keeps a Partial axis pending, from seeded
    contributions. Returns per transition: placements right, the full tensor, the value, the
    bytes this rank sent and the plan's figure for it, the plan."""
    import shardwise as sw
    from shardwise.cost import use_hardware

    before = use_hardware(SHARED_WIRE)  # kept plans even on these small shapes (the executor is under test)
    try:
        results = {}
        for mesh_shape, shape, src, dst in cases:
            mesh = sw.init_device_mesh("cpu", mesh_shape)
            me = coordinates(mesh_shape).index(tuple(mesh.get_coordinate()))
            contributions, out, sent, plan = _redistribute_contributions(mesh, shape, src, dst, seed=2)
            results[(shape, src, dst)] = (out.placements == dst, out.full_tensor(), sum(contributions.values()),
                                          sent, plan.sends[me], plan)
    finally:
        use_hardware(before)  # the pool's workers run other tests next
    return results


def test_kept_pending_steps_on_real_ranks(dist):
    # Each rank keeps its own contribution on the kept axis; the other axis is re-laid by one
    # all_to_all per slice (a Partial target off coordinate 0 of its axis sends, holds zeros).
    cases = [((2, 2), (8, 8), (S0, P), (P, P)), ((2, 2), (7, 5), (S1, P), (P, P)),
             ((2, 2), (7, 5), (P, S0), (P, P))]
    out = dist.run(4, _kept, cases, timeout=120)
    for key in out[0]:
        placed, full, want, _, _, plan = out[0][key]
        assert any(s.kept for s in plan.steps), f"{key}: not kept pending ({plan})"
        bound = lower_bound(key[0], F32, (2, 2), key[1], key[2])
        assert (plan.total_bytes, plan.busiest_bytes) == (bound.total, bound.busiest), f"{key}: {plan}"
        assert placed and torch.equal(full, want), f"{key}: wrong values ({plan})"
        assert [o[key][3] for o in out] == [o[key][4] for o in out], f"{key}: bytes differ from the plan ({plan})"
