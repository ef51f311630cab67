"""The redistribute planner, without processes: chosen collectives, bytes, legality."""

import itertools

import pytest

from shardwise import Partial, Replicate, Shard
from shardwise.redistribute import plan_redistribute
from shardwise.cost import load_hardware
from shardwise.redistribute.planner import _Context

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
F32 = 4


@pytest.mark.parametrize(
    "src,dst,collectives,bytes_",
    [
        # 16x8 f32 = 512 B over 4 ranks: a shard is 128 B.
        (S0, R, ["all_gather"], 3 * 128),  # send own shard to 3 peers
        (R, S0, [], 0),  # local chunk
        (P, R, ["all_reduce"], 2 * 3 * 128),  # reduce_scatter + all_gather
        (P, S0, ["reduce_scatter"], 3 * 128),  # everything but the kept piece
        (S0, S1, ["all_to_all"], 3 * 32),  # 3/4 of the 128 B shard
        (R, P, [], 0),  # partition
    ],
)
def test_single_axis_transitions_use_one_optimal_collective(src, dst, collectives, bytes_):
    plan = plan_redistribute((16, 8), F32, (4,), (src,), (dst,))
    assert plan.collectives == collectives
    assert plan.bytes_per_rank == bytes_


def test_seed_example_counts_on_two_ranks():
    assert plan_redistribute((4,), F32, (2,), (P,), (S0,)).collectives == ["reduce_scatter"]
    assert plan_redistribute((2, 2), F32, (2,), (S0,), (S1,)).collectives == ["all_to_all"]


def test_partial_everywhere_to_replicate_weighs_bytes_against_collectives():
    # Without a flattened group: two all_reduces, or reduce_scatter + all_reduce + all_gather
    # (fewer bytes, one more collective). Bandwidth decides on a large tensor, latency on a small one.
    big = plan_redistribute((1024, 1024), F32, (2, 2), (P, P), (R, R))
    naive = 2 * plan_redistribute((1024, 1024), F32, (2,), (P,), (R,)).bytes_per_rank
    assert big.collectives == ["reduce_scatter", "all_reduce", "all_gather"] and big.bytes_per_rank < naive
    assert plan_redistribute((8, 8), F32, (2, 2), (P, P), (R, R)).collectives == ["all_reduce", "all_reduce"]


def test_nested_sharding_respects_axis_order():
    # [R, S0] -> [S0, S0] cannot cut axis 0 first while axis 1 already cuts dim 0 locally.
    plan = plan_redistribute((8, 8), F32, (2, 2), (R, S0), (S0, S0))
    layout = [R, S0]
    for step in plan.steps:
        later = layout[step.axis + 1 :]
        dims = {p.dim for p in (step.src, step.dst) if p.is_shard()}
        assert not any(p.is_shard() and p.dim in dims for p in later), str(plan)
        layout[step.axis] = step.dst
    assert layout == [S0, S0]


ALL = [R, S0, S1, P]


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 2, 2)])
@pytest.mark.parametrize("shape", [(16, 8), (5, 7)])
def test_every_pair_is_reachable_and_no_slower_than_gathering_everything(mesh_shape, shape):
    for src in itertools.product(ALL, repeat=len(mesh_shape)):
        for dst in itertools.product(ALL, repeat=len(mesh_shape)):
            plan = plan_redistribute(shape, F32, mesh_shape, src, dst)
            layout = tuple(src)
            for step in plan.steps:
                assert layout[step.axis] == step.src
                layout = step.apply(layout)  # an exchange re-lays several axes at once
            assert layout == dst
            via_replicate = (
                plan_redistribute(shape, F32, mesh_shape, src, (R,) * len(mesh_shape)).predicted_s
                + plan_redistribute(shape, F32, mesh_shape, (R,) * len(mesh_shape), dst).predicted_s
            )
            assert plan.predicted_s <= via_replicate


def test_never_all_reduce_then_chunk_nor_gather_then_chunk():
    for src, dst in [((P,), (S0,)), ((S0,), (S1,)), ((P, R), (S0, R)), ((S0, S1), (S1, S0))]:
        plan = plan_redistribute((16, 16), F32, (2,) * len(src), src, dst)
        kinds = [s.collective for s in plan.steps]
        for a, b in zip(kinds, kinds[1:]):
            assert (a, b) not in {("all_reduce", "local_chunk"), ("all_gather", "local_chunk")}, str(plan)


def test_mixed_partial_ops_reduce_before_partitioning():
    plan = plan_redistribute((4, 4), F32, (2, 2), (P, R), (R, Partial("max")))
    assert [s.collective for s in plan.steps] == ["all_reduce", "partition"]


def test_size_one_axes_are_free():
    plan = plan_redistribute((4, 4), F32, (1, 4), (S0, R), (P, R))
    assert plan.bytes_per_rank == 0


def test_plans_are_deterministic_and_cached():
    a = plan_redistribute((6, 6), F32, (2, 2), (S0, S1), (S1, S0))
    b = plan_redistribute([6, 6], F32, [2, 2], [S0, S1], [S1, S0])
    assert a is b


def test_uneven_bytes_count_the_largest_block():
    # 5 rows over 4 ranks: blocks 2,2,1,0 -> rank 0 sends its 2 rows to 3 peers.
    plan = plan_redistribute((5, 1), F32, (4,), (S0,), (R,))
    assert plan.bytes_per_rank == 3 * 2 * F32
    ctx = _Context((5, 1), F32, (4,), (), (), load_hardware("cpu"))
    assert ctx._local_shape((S0,)) == (2, 1)


@pytest.mark.parametrize("src,dst", [((R, S0), (S0, S0)), ((P, S0), (S0, S0)), ((P, S0), (R, S0))])
def test_large_meshes_plan_axis_by_axis(src, dst):
    """Above ``EXCHANGE_MAX_RANKS`` no exchange is weighed: its schedule compares every holder
    class with every receiver (minutes on a 64 x 8 mesh, and every fully_shard of a 1,024-rank
    job plans some). Each plan here is for a fresh shape, so none comes from a cache."""
    plan = plan_redistribute((128_257, 4_095), F32, (64, 8), src, dst, [(0, 1)])
    assert plan.steps or src == (R, S0)
    assert not any(s.target for s in plan.steps), str(plan)
    small = plan_redistribute((128_259, 4_095), F32, (4, 8), (S0, S1), (S1, S0), [(0, 1)])
    assert any(s.target for s in small.steps), str(small)  # 32 ranks: exchanges are weighed
