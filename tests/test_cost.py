"""The one cost model (shardwise.cost) and the choices priced with it, without processes."""

import pytest

from shardwise import Partial, Replicate, Shard
from shardwise.cost import Collective, Hardware, Link, axis_links, collective_time, load_hardware, use_hardware
from shardwise.redistribute import plan_redistribute
from shardwise.units import format_bytes

R, P, S0 = Replicate(), Partial(), Shard(0)
F32 = 4
TOY = Hardware("toy", 0, 0, intra_node_bw=1e9, inter_node_bw=1e8, intra_node_latency_s=1e-6,
               inter_node_latency_s=1e-5, collective_latency_s=1e-4, gpus_per_node=4)


def test_collective_time_is_latency_plus_bytes_over_the_axis_link():
    # all_gather over 4 ranks: 3 ring steps; all_reduce: 6 (reduce_scatter then all_gather)
    assert collective_time(Collective.ALL_GATHER, 10**6, 4, Link.INTRA_NODE, TOY) == pytest.approx(1e-4 + 3e-6 + 1e-3)
    assert collective_time(Collective.ALL_REDUCE, 10**6, 4, Link.INTER_NODE, TOY) == pytest.approx(1e-4 + 6e-5 + 1e-2)
    assert collective_time(Collective.ALL_TO_ALL, 10**6, 1, Link.INTER_NODE, TOY) == 0.0  # one rank: nothing moves
    assert Collective.named("send") is Collective.SEND_RECV and Collective.named("scatter") is Collective.BROADCAST


def test_axes_inside_a_node_are_intra_node_innermost_first():
    assert axis_links((2, 2), 4) == (Link.INTRA_NODE, Link.INTRA_NODE)
    assert axis_links((2, 4), 4) == (Link.INTER_NODE, Link.INTRA_NODE)
    assert axis_links((8,), 4) == (Link.INTER_NODE,)


def test_every_shipped_profile_has_links_and_latencies():
    for name in ("cpu", "h100-80gb", "a100-80gb", "h200"):
        hw = load_hardware(name)
        assert hw.intra_node_bw >= hw.inter_node_bw > 0 and hw.collective_latency_s > 0 and hw.gpus_per_node > 0


def test_the_profile_decides_between_fewer_bytes_and_fewer_collectives():
    # (2, 2), Partial on both axes -> Replicate, no flattened group: two all_reduces, or
    # reduce_scatter + all_reduce + all_gather (a quarter fewer bytes, one more collective).
    wire = Hardware("wire", 0, 0, intra_node_bw=1e9, inter_node_bw=1e9)  # no latency at all
    slow_start = Hardware("slow", 0, 0, intra_node_bw=1e9, inter_node_bw=1e9, collective_latency_s=1.0)
    by_bytes = plan_redistribute((64, 64), F32, (2, 2), (P, P), (R, R), hardware=wire)
    by_calls = plan_redistribute((64, 64), F32, (2, 2), (P, P), (R, R), hardware=slow_start)
    assert by_bytes.collectives == ["reduce_scatter", "all_reduce", "all_gather"]
    assert by_calls.collectives == ["all_reduce", "all_reduce"]
    assert by_bytes.bytes_per_rank < by_calls.bytes_per_rank
    assert by_calls.predicted_s == pytest.approx(2.0, rel=1e-3)


def test_the_active_profile_is_settable_and_plans_are_cached_per_profile():
    before = plan_redistribute((64, 64), F32, (2, 2), (P, P), (R, R))
    try:
        use_hardware(Hardware("slow", 0, 0, intra_node_bw=1e9, inter_node_bw=1e9, collective_latency_s=1.0))
        assert plan_redistribute((64, 64), F32, (2, 2), (P, P), (R, R)).predicted_s == pytest.approx(2.0, rel=1e-3)
    finally:
        use_hardware("cpu")
    assert plan_redistribute((64, 64), F32, (2, 2), (P, P), (R, R)) is before


def test_one_byte_formatter():
    assert [format_bytes(n) for n in (0, 96, 1536, 3 * 2**20, 5 * 2**30 // 4)] == [
        "0 B", "96 B", "1.5 KiB", "3.0 MiB", "1.25 GiB"]
