"""Choosing a layout by what comes after the op: a Partial output is charged its reduction.

``strategy.pending_reduction`` (pure) and, on 4 ranks, a Partial activation scaled by a
sharded per-row factor (RMSNorm's ``x * rsqrt(mean(x^2))`` on a pending sum): reducing the
activation now (one reduce_scatter) beats gathering the factor and handing the sum on, which
every later consumer that needs the value would reduce again on its own.
"""

import torch

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.cost import Collective, Link, active_hardware, collective_time
from shardwise.dispatch.strategy import Candidate, pending_reduction

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)


def _reduce_scatter(nbytes: float, ranks: int) -> float:
    """The predicted seconds of a reduce_scatter whose busiest rank sends ``nbytes`` (one node)."""
    return collective_time(Collective.REDUCE_SCATTER, int(nbytes), ranks, Link.INTRA_NODE, active_hardware())


def test_pending_reduction_charges_a_reduce_scatter_of_the_partial_outputs():
    """Priced by the one cost model: each rank sends (n - 1) / n of its block over the Partial axes."""
    out = torch.empty(8, 16, device="meta")  # 512 B of float32
    assert pending_reduction(Candidate((), ((R,),)), [out], (4,)) == 0
    assert pending_reduction(Candidate((), ((P,),)), [out], (4,)) == _reduce_scatter(512 * 3 / 4, 4)
    # (2, 2): Partial on one axis, the block already halved by a Shard on the other.
    assert pending_reduction(Candidate((), ((S0, P),)), [out], (2, 2)) == _reduce_scatter(256 / 2, 2)
    assert pending_reduction(Candidate((), ((P, P),)), [out], (2, 2)) == _reduce_scatter(512 * 3 / 4, 4)
    # Outputs that are not tensors (None) or have no layout cost nothing.
    assert pending_reduction(Candidate((), (None, (P,))), [None, out], (4,)) == _reduce_scatter(512 * 3 / 4, 4)
    # Only axes where an input was already Partial: a Partial the op makes itself is free.
    assert pending_reduction(Candidate((), ((P, P),)), [out], (2, 2), owed=(False, True)) == _reduce_scatter(512 / 2, 2)
    assert pending_reduction(Candidate((), ((P,),)), [out], (4,), owed=(False,)) == 0
    # More bytes cost more: the charge grows with the block.
    assert pending_reduction(Candidate((), ((P,),)), [torch.empty(64, 16, device="meta")], (4,)) > \
        pending_reduction(Candidate((), ((P,),)), [out], (4,))


def _scaled_partial():
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = torch.distributed.get_rank()
    parts = [torch.randn(8, 16, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    scale = torch.rand(8, 1, generator=torch.Generator().manual_seed(9)) + 0.5
    h = DTensor.from_local(parts[rank].clone(), mesh, [P])
    s = sw.distribute_tensor(scale, mesh, [S0])
    with CommDebugMode() as comms:
        y = h * s
        used = (y.exp() + y.tanh()).full_tensor()
    want = sum(parts) * scale
    return y.placements, dict(comms.get_comm_counts()), used, want.exp() + want.tanh()


def test_partial_times_sharded_factor_reduces_once(dist):
    for placements, counts, got, want in dist.run(4, _scaled_partial):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert placements == (S0,)  # reduced where it was made, not handed on as a pending sum
        # one reduce_scatter for y, one all_gather for the final full_tensor
        assert counts == {"reduce_scatter": 1, "all_gather": 1}, counts
