"""The redistribute planner against the true lower bound (redistribute/bound.py), no processes.

Random meshes up to 3-D, tensors up to 3-D with even, uneven and empty blocks, random layout
pairs. Without Partial sources every plan sends exactly the total bound, what the ranks lack;
from a Partial source it sends the least a reduction needs unless every plan that does would be
slower than another candidate (``plan._choose``). Without Partial sources its busiest rank
sends no more than the one-round optimum (less only by relaying across steps, never below the
any-schedule bound); with one, never below the any-schedule bound. The exchange and
reduce-forward schedules are replayed on in-memory blocks.
"""

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise import Partial, Replicate, Shard
from shardwise.redistribute import plan_redistribute
from shardwise.redistribute.planner import plan_candidates
from shardwise.redistribute.bound import blocks, coordinates, lower_bound, needs_value, reducing_total
from shardwise.redistribute.exchange import plan_exchange
from shardwise.redistribute.pending import drop, kept_axes, sub_groups
from shardwise.redistribute.reduce_forward import forwardable, plan_reduce_forward

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
@given(_cases(partial_source=False))
def test_plans_from_values_meet_the_lower_bound(case):
    mesh_shape, plan, bound = _plan_and_bound(case)
    assert plan.total_bytes == bound.total, f"{plan}: {plan.sends} vs {bound}"
    assert bound.busiest_any <= plan.busiest_bytes <= bound.busiest, f"{plan}: {plan.sends} vs {bound}"
    assert all(sent >= 0 for sent in plan.sends) and len(plan.sends) == math.prod(mesh_shape)


def _score(plan) -> tuple[int, int, int]:
    """(bytes of all ranks, of the busiest, collectives issued), all_reduce at its exact figure."""
    return plan.exact_total_bytes, max(plan.exact_sends, default=0), len(plan.issued)


def _slower(a, b) -> bool:
    """Whether a plan scored ``a`` is slower than one scored ``b`` on every latency-bandwidth
    network: its busiest rank sends at least as much in at least as many collectives."""
    return a[1] >= b[1] and a[2] >= b[2] and a[1:] != b[1:]


@settings(max_examples=300, deadline=None)
@given(_cases(partial_source=True))
def test_plans_from_partial_sources_meet_the_total_bound_unless_it_is_slower(case):
    """At the total bound, or the plans there would be slower on every latency-bandwidth network:
    their busiest rank sends at least as much, in at least as many collectives."""
    mesh_shape, shape, src, dst = case
    _, plan, bound = _plan_and_bound(case)
    assert plan.exact_total_bytes >= bound.total, f"{plan}: {plan.exact_sends} vs {bound}"
    assert plan.busiest_bytes >= bound.busiest_any, f"{plan}: {plan.sends} vs {bound}"
    candidates = plan_candidates(shape, F32, mesh_shape, src, dst, _all_groups(mesh_shape))
    scores = [_score(c) for c in candidates]
    assert not any(_slower(_score(plan), s) for s in scores), f"{plan} is slower than another candidate"
    for candidate, score in zip(candidates, scores):  # a plan with fewer bytes in all is slower
        if score[0] < plan.exact_total_bytes:
            assert any(_slower(score, s) for s in scores), f"{plan} chosen over {candidate}"
    if plan.exact_total_bytes > bound.total:  # the reduce-forward schedule meets it (below)
        assert any(s.rounds for c in candidates for s in c.steps) or not forwardable(mesh_shape, src, dst), str(plan)
    if any(s.rounds for s in plan.steps):  # reduce-forward: the least total of a full reduction
        assert plan.total_bytes == reducing_total(shape, mesh_shape, src, dst) * F32, str(plan)
    kept = any(p.is_partial() and p == q for p, q in zip(src, dst))
    axes = kept_axes(mesh_shape, src, dst)
    if axes:  # keeping them pending is weighed: the plan is no worse than the lifted sub-plan
        sub = plan_redistribute(shape, F32, drop(mesh_shape, axes), drop(src, axes), drop(dst, axes),
                                sub_groups(_all_groups(mesh_shape), axes, len(mesh_shape)))
        copies = math.prod(mesh_shape[a] for a in axes)
        assert plan.exact_total_bytes <= copies * sub.exact_total_bytes or (
            sub.busiest_bytes >= plan.busiest_bytes and len(sub.issued) >= len(plan.issued)), f"{plan} vs kept {sub}"
        if not any(p.is_partial() and m > 1 for p, m in zip(drop(src, axes), drop(mesh_shape, axes))):
            # nothing left to reduce: the kept sub-plan meets the keep-pending total bound
            assert copies * sub.total_bytes == copies * lower_bound(
                shape, F32, drop(mesh_shape, axes), drop(src, axes), drop(dst, axes)).total, str(sub)
    if not forwardable(mesh_shape, src, dst):  # its Partial axes all have one rank
        return
    forward = plan_reduce_forward(shape, mesh_shape, src, dst)
    if not kept:  # the schedule the planner may take meets the total bound, Partial or not
        assert sum(forward.sends) * F32 == bound.total, f"{forward.sends} vs {bound}"


@settings(max_examples=100, deadline=None)
@given(_cases(partial_source=True), st.sampled_from(["sum", "avg", "max", "min"]))
def test_reduce_forward_schedule_builds_every_target_block(case, op):
    """Replays both rounds on in-memory blocks: every needer ends with the reduced value."""
    mesh_shape, shape, src, dst = case
    src = tuple(Partial(op) if p.is_partial() else p for p in src)
    dst = tuple(Partial(op) if p.is_partial() else p for p in dst)
    coords = coordinates(mesh_shape)
    partial_axes = [a for a, p in enumerate(src) if p.is_partial()]
    gen = torch.Generator().manual_seed(0)
    contributions = {k: torch.randint(-9, 9, shape, generator=gen).double()
                     for k in itertools.product(*(range(mesh_shape[a]) for a in partial_axes))}
    stacked = torch.stack(list(contributions.values()))
    x = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
    if not forwardable(mesh_shape, src, dst):  # its Partial axes all have one rank
        return
    rf = plan_reduce_forward(shape, mesh_shape, src, dst)
    src_b, dst_b = blocks(shape, mesh_shape, src), blocks(shape, mesh_shape, dst)
    held = [_cut(contributions[tuple(c[a] for a in partial_axes)], src_b[r]) for r, c in enumerate(coords)]
    runs: dict = {}  # (receiver, box, start) -> contributions
    for t in rf.first:
        assert t.sender != t.receiver and _inside(t.box, src_b[t.sender])
        runs.setdefault((t.receiver, t.box, t.start), []).append(
            _cut_block(held[t.sender], src_b[t.sender], t.box).reshape(-1)[t.start:t.stop])
    value = {}
    for (f, box, start), got in runs.items():
        if len(got) < rf.n:  # the first owner adds its own contribution
            got.append(_cut_block(held[f], src_b[f], box).reshape(-1)[start:start + got[0].numel()])
        assert len(got) == rf.n
        value[(f, box, start)] = torch.stack(got)
    value = {k: {"sum": v.sum(0), "avg": v.mean(0), "max": v.amax(0), "min": v.amin(0)}[op] for k, v in value.items()}
    known = dict(value)
    for t in rf.second:
        known[(t.receiver, t.box, t.start)] = value[(t.sender, t.box, t.start)]
    for r, c in enumerate(coords):
        if not needs_value(dst, c):
            continue
        block = torch.full(dst_b[r][1], float("nan"), dtype=x.dtype)
        for (who, box, start), run in known.items():
            if who == r and _inside(box, dst_b[r]):
                flat = _cut_block(block, dst_b[r], box).reshape(-1).clone()
                flat[start:start + run.numel()] = run
                _cut_block(block, dst_b[r], box).copy_(flat.view(box[1]))
        assert torch.allclose(block, _cut(x, dst_b[r])), f"rank {c}: {src}->{dst}"


def test_reductions_meet_the_partial_bound():
    # all_reduce = 2(n-1) messages per element, reduce_scatter n-1 (n divides the blocks).
    for mesh_shape, src, dst in [((4,), (P,), (R,)), ((4,), (P,), (S0,)), ((2, 2), (P, P), (R, R)),
                                 ((2, 2), (P, R), (S0, S1)), ((2, 2), (P, P), (S0, S1))]:
        plan = plan_redistribute((8, 8), F32, mesh_shape, src, dst, _all_groups(mesh_shape))
        bound = lower_bound((8, 8), F32, mesh_shape, src, dst)
        assert (plan.total_bytes, plan.busiest_bytes) == (bound.total, bound.busiest), f"{src}->{dst}: {plan}"


def test_issue_examples_use_one_exchange_at_the_bound():
    # (2, 2) mesh: axis by axis these moved 2-4x what the ranks lack.
    for src, dst in [((S0, S0), (S1, S1)), ((R, S0), (S0, R)), ((S0, S1), (S1, S0))]:
        axis_by_axis = plan_redistribute((8, 8), F32, (2, 2), src, dst)  # no flattened group
        plan = plan_redistribute((8, 8), F32, (2, 2), src, dst, ((0, 1),))
        bound = lower_bound((8, 8), F32, (2, 2), src, dst)
        assert plan.collectives == ["all_to_all"] and plan.steps[0].target == dst, str(plan)
        assert (plan.total_bytes, plan.busiest_bytes) == (bound.total, bound.busiest)
        assert axis_by_axis.total_bytes >= 2 * bound.total, str(axis_by_axis)
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


def _forwarded(cases):
    """Run, on this rank, Partial-source transitions whose plan is a reduce-forward step, from
    random contributions (seeded: every rank builds the same ones). Returns per transition the
    full tensor after it, the value it should be, the bytes this rank sent and the plan's."""
    import random

    import shardwise as sw
    from shardwise.redistribute.execute import flattened_groups

    results = {}
    for mesh_shape, shape, ops, limit in cases:
        mesh = sw.init_device_mesh("cpu", mesh_shape)
        flattened = flattened_groups(mesh)
        coordinate = tuple(mesh.get_coordinate())
        me = coordinates(mesh_shape).index(coordinate)
        pairs = []
        for op in ops:
            values = [R, Partial(op), *(Shard(d) for d in range(len(shape)))]
            layouts = list(itertools.product(values, repeat=len(mesh_shape)))
            pairs += [(s, d) for s in layouts for d in layouts if any(p.is_partial() for p in s)]
        random.Random(0).shuffle(pairs)
        forwarded = (pair for pair in pairs
                     if any(st.rounds for st in plan_redistribute(shape, F32, mesh_shape, *pair, flattened).steps))
        for src, dst in itertools.islice(forwarded, limit):
            contributions, out, sent, plan = _redistribute_contributions(mesh, shape, src, dst, seed=1)
            stacked = torch.stack(list(contributions.values()))
            op = next(p.reduce_op for p in src if p.is_partial())
            want = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
            results[(mesh_shape, shape, src, dst)] = (
                out.placements == dst, out.full_tensor(), want, sent, plan.sends[me], str(plan))
    return results


def test_reduce_forward_steps_on_real_ranks(dist):
    # Every op of a Partial source; uneven blocks; a target that is itself Partial.
    cases = [((2, 2), (7, 5), ("sum", "max"), 6), ((2, 2), (8, 4), ("avg", "min"), 4)]
    out = dist.run(4, _forwarded, cases, timeout=120)
    assert len(out[0]) >= 8, sorted(out[0])
    for key in out[0]:
        placed, full, want, _, _, plan = out[0][key]
        assert placed and torch.allclose(full, want), f"{key}: wrong values ({plan})"
        assert [o[key][3] for o in out] == [o[key][4] for o in out], f"{key}: bytes differ from the plan ({plan})"


def _kept(cases):
    """Run, on this rank, transitions whose plan keeps a Partial axis pending, from seeded
    contributions. Returns per transition: placements right, the full tensor, the value, the
    bytes this rank sent and the plan's figure for it, the plan."""
    import shardwise as sw

    results = {}
    for mesh_shape, shape, src, dst in cases:
        mesh = sw.init_device_mesh("cpu", mesh_shape)
        me = coordinates(mesh_shape).index(tuple(mesh.get_coordinate()))
        contributions, out, sent, plan = _redistribute_contributions(mesh, shape, src, dst, seed=2)
        results[(shape, src, dst)] = (out.placements == dst, out.full_tensor(), sum(contributions.values()),
                                      sent, plan.sends[me], plan)
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
