"""Partial tensors without needless communication: each case counted with CommDebugMode and
checked against the single-device value (and gradient, for the masked gather).

Every rank's contribution is computed the same way on every rank (``_contribution(k)``), so the
single-device oracle is the reduction of all of them, built locally with no collective.
"""

import math

import torch

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.redistribute import plan_redistribute

R, P = Replicate(), Partial()
F32 = 4
_REDUCE = {"sum": lambda ts: sum(ts), "max": lambda ts: torch.stack(ts).amax(0),
           "min": lambda ts: torch.stack(ts).amin(0), "product": lambda ts: math.prod(ts)}


def _contribution(k: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * salt + k)
    return torch.rand(3, 4, generator=g) + 0.5 - (k % 2)


def _partial(mesh, op: str = "sum", salt: int = 0):
    """A Partial(op) DTensor over the 1-D mesh, and its single-device value."""
    n, rank = mesh.size(0), mesh.get_local_rank(0)
    parts = [_contribution(k, salt) for k in range(n)]
    return DTensor.from_local(parts[rank].clone(), mesh, [Partial(op)]), _REDUCE[op](parts)


def _counted(fn):
    with CommDebugMode() as comms:
        y = fn()
    return y, comms


def _cases_1d() -> dict:
    mesh = sw.init_device_mesh("cpu", (4,))
    out = {}

    def check(name, fn, expected):
        y, comms = _counted(fn)
        value = y.full_tensor()  # outside the counted region
        out[name] = (dict(comms.get_comm_counts()), tuple(y.placements), torch.allclose(value, expected, atol=1e-5))

    rt = torch.linspace(-1, 1, 12).reshape(3, 4)
    r = sw.distribute_tensor(rt, mesh, [R], src_data_rank=None)
    cond = sw.distribute_tensor(rt > 0, mesh, [R], src_data_rank=None)
    p, pv = _partial(mesh)
    q, qv = _partial(mesh, salt=1)
    check("P+R", lambda: p + r, pv + rt)
    check("R-P", lambda: r - p, rt - pv)
    check("P-2R", lambda: torch.sub(p, r, alpha=2), pv - 2 * rt)
    check("P+scalar", lambda: p + 1.5, pv + 1.5)
    check("P+0-dim", lambda: p + torch.tensor(2.0), pv + 2.0)
    check("where(R,P,R)", lambda: torch.where(cond, p, r), torch.where(rt > 0, pv, rt))
    check("(P+R)*R", lambda: (p + r) * r, (pv + rt) * rt)
    check("P.masked_fill(R, 2)", lambda: p.masked_fill(cond, 2.0), pv.masked_fill(rt > 0, 2.0))
    check("P.masked_fill(R, 0-dim)", lambda: p.masked_fill(cond, torch.tensor(-3.0)), pv.masked_fill(rt > 0, -3.0))
    check("P*P", lambda: p * q, pv * qv)
    check("P/P", lambda: p / (q + 10), pv / (qv + 10))
    p2, _ = _partial(mesh)
    check("P.add_(R)", lambda: p2.add_(r), pv + rt)

    mx, mxv = _partial(mesh, "max")
    my, myv = _partial(mesh, "max", salt=1)
    mn, mnv = _partial(mesh, "min")
    mo, mov = _partial(mesh, "min", salt=1)
    check("maximum(Pmax,Pmax)", lambda: torch.maximum(mx, my), torch.maximum(mxv, myv))
    check("minimum(Pmin,Pmin)", lambda: torch.minimum(mn, mo), torch.minimum(mnv, mov))
    check("minimum(Pmax,R)", lambda: torch.minimum(mx, r), torch.minimum(mxv, rt))
    check("maximum(R,Pmin)", lambda: torch.maximum(r, mn), torch.maximum(rt, mnv))
    check("clamp(Pmax)", lambda: mx.clamp(min=0.2, max=0.9), mxv.clamp(min=0.2, max=0.9))

    a, av = _partial(mesh, "product")
    b, bv = _partial(mesh, "product", salt=1)
    check("product clone", lambda: a.clone(), av)  # full_tensor reduces by product
    check("Pprod*Pprod", lambda: a * b, av * bv)
    check("Pprod/Pprod", lambda: a / b, av / bv)
    check("Pprod*R", lambda: a * r, av * rt)
    check("Pprod*scalar", lambda: a * 3.0, av * 3.0)
    check("Pprod.abs()**2", lambda: a.abs() ** 2, av.abs() ** 2)
    check("Pprod->R", lambda: a.redistribute(mesh, [R]), av)

    # gather along the sharded class dim with one index per row: a masked local lookup.
    logits_full = torch.randn(5, 10, generator=torch.Generator().manual_seed(3))
    labels_full = torch.tensor([[9], [0], [3], [7], [2]])
    logits = sw.distribute_tensor(logits_full, mesh, [Shard(1)], src_data_rank=None).requires_grad_()
    labels = sw.distribute_tensor(labels_full, mesh, [R], src_data_rank=None)
    check("gather size-1 index", lambda: logits.gather(1, labels), logits_full.gather(1, labels_full))
    picked = logits.gather(1, labels)
    weights = sw.distribute_tensor(torch.arange(1.0, 6.0).reshape(5, 1), mesh, [R], src_data_rank=None)
    (picked * weights).sum().backward()
    oracle = logits_full.clone().requires_grad_()
    (oracle.gather(1, labels_full) * torch.arange(1.0, 6.0).reshape(5, 1)).sum().backward()
    out["gather grad"] = torch.allclose(logits.grad.full_tensor(), oracle.grad)
    return out


def _cases_2d() -> dict:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    coordinate = mesh.get_coordinate()
    parts = {(i, j): _contribution(2 * i + j) for i in range(2) for j in range(2)}
    x = DTensor.from_local(parts[coordinate].clone(), mesh, [P, P])
    expected = sum(parts.values())
    out = {}
    with CommDebugMode() as comms:
        y = x.redistribute(mesh, [R, R])
    out["P,P->R,R"] = (dict(comms.get_comm_counts()), [r.bytes_sent for r in comms.records],
                       torch.allclose(y.to_local(), expected, atol=1e-5))
    # One axis Partial, one sharded: adding a replicated-on-that-axis operand stays local.
    rt = torch.linspace(-1, 1, 12).reshape(3, 4)
    rows = [slice(0, 2), slice(2, 3)][coordinate[1]]
    ps = DTensor.from_local(parts[coordinate][rows].clone(), mesh, [P, Shard(0)], shape=(3, 4), stride=(4, 1))
    rs = sw.distribute_tensor(rt, mesh, [R, Shard(0)], src_data_rank=None)
    with CommDebugMode() as comms:
        z = ps + rs
    part_sum = parts[(0, coordinate[1])] + parts[(1, coordinate[1])]  # only this column's contributions
    local_rows = z.redistribute(mesh, [R, Shard(0)]).to_local()
    out["[P,S0]+[R,S0]"] = (comms.get_total_counts(), tuple(z.placements),
                            torch.allclose(local_rows, (part_sum + rt)[rows], atol=1e-5))
    return out


def test_partial_ops_keep_their_pending_reduction_without_collectives(dist):
    reductions = {"Pprod->R"}  # one reduction; P*P and P/P below; everything else none
    for result in dist.run(4, _cases_1d):
        assert result.pop("gather grad")
        for name, (counts, placements, ok) in result.items():
            assert ok, f"{name}: wrong value"
            if name in reductions:
                assert counts == {"all_reduce": 1}, f"{name}: {counts}"
            elif name not in ("P*P", "P/P"):
                assert counts == {}, f"{name}: communicated {counts}"
        # P*P, P/P: both operands reduce_scatter (3/4 + 3/4 of the block) into a sharded
        # result, rather than one all_reduce (2 x 3/4) leaving a Partial result that still owes
        # its own reduction (strategy.pending_reduction).
        for name in ("P*P", "P/P"):
            counts, placements, _ = result[name]
            assert counts == {"reduce_scatter": 2} and placements[0].is_shard(), (name, counts, placements)
        assert result["P+R"][1] == (P,) and result["R-P"][1] == (P,)
        assert result["maximum(Pmax,Pmax)"][1] == (Partial("max"),)
        assert result["minimum(Pmin,Pmin)"][1] == (Partial("min"),)
        assert result["Pprod*Pprod"][1] == (Partial("product"),)
        assert result["gather size-1 index"][1] == (P,)


def test_reducing_several_partial_axes_is_one_all_reduce_over_the_flattened_group(dist):
    plan = plan_redistribute((3, 4), F32, (2, 2), (P, P), (R, R), [(0, 1)])
    for result in dist.run(4, _cases_2d):
        counts, sent, ok = result["P,P->R,R"]
        assert ok and counts == {"all_reduce": 1} and sent == [s.bytes_per_rank for s in plan.steps]
        total, placements, ok = result["[P,S0]+[R,S0]"]
        assert ok and total == 0 and placements == (P, Shard(0))


# ---------------------------------------------------------------------- pure planner
def test_planner_merges_partial_axes_only_over_an_existing_flattened_group():
    merged = plan_redistribute((8, 8), F32, (2, 2), (P, P), (R, R), [(0, 1)])
    assert len(merged.steps) == 1 and merged.steps[0].axes == (0, 1)
    assert merged.collectives == ["all_reduce"]
    assert merged.bytes_per_rank == (64 + 2 * 16) * F32  # one all_reduce over 4 ranks
    separate = plan_redistribute((8, 8), F32, (2, 2), (P, P), (R, R))
    assert len(separate.collectives) > 1 and separate.bytes_per_rank >= merged.bytes_per_rank
    # Only the axes of the group merge; the sharded axis in between is left alone.
    plan = plan_redistribute((8, 8), F32, (2, 2, 2), (P, Shard(0), P), (R, Shard(0), R), [(0, 2)])
    assert [s.axes for s in plan.steps] == [(0, 2)]
    assert plan.bytes_per_rank == (32 + 2 * 8) * F32  # the [4, 8] block over 4 ranks
    # Three Partial axes, a group over two of them: one merged step and one single-axis step.
    plan = plan_redistribute((8, 8), F32, (2, 2, 2), (P, P, P), (R, R, R), [(0, 1)])
    layout = (P, P, P)
    for step in plan.steps:
        layout = step.apply(layout)
    assert layout == (R, R, R) and any(s.axes == (0, 1) for s in plan.steps)


def test_partial_product_partitions_with_ones():
    value = torch.tensor([2.0, -3.0])
    prod = Partial("product")
    assert torch.equal(prod.partition_value(value, 0), value)
    assert torch.equal(prod.partition_value(value, 3), torch.ones(2))
    assert prod.identity() == 1 and P.identity() == 0 and Partial("max").identity() is None
