"""SequenceParallel's inputs: a plain tensor is this rank's sequence shard, a DTensor keeps its
values, and a replicated plain tensor mistaken for a shard is refused on every rank (issue 10,
item 7: the README's TP plan fed the norms the unsharded embedding output, which silently made
the global sequence tp times as long)."""

import torch
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.parallel import SequenceParallel, parallelize_module

TP = 2
BATCH, SEQ, DIM = 2, 6, 8


def _full_input() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(BATCH, SEQ, DIM)


def _reference() -> torch.Tensor:
    torch.manual_seed(0)
    norm = nn.RMSNorm(DIM)
    nn.init.normal_(norm.weight)
    return norm(_full_input()).detach()


def _sp_norm(**style) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.RMSNorm(DIM)
    nn.init.normal_(norm.weight)
    mesh = sw.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    return parallelize_module(norm, mesh, SequenceParallel(**style)), mesh


def _plain_shards():
    """Each rank its own slice of the sequence: the documented plain input."""
    norm, _ = _sp_norm()
    rank = torch.distributed.get_rank()
    piece = _full_input()[:, rank * SEQ // TP:(rank + 1) * SEQ // TP]
    with CommDebugMode() as first:
        out = norm(piece)
    with CommDebugMode() as second:
        again = norm(piece)
    return (out.placements, tuple(out.shape), out.full_tensor(), torch.equal(again.to_local(), out.to_local()),
            first.get_comm_counts(), second.get_comm_counts())


def test_plain_input_is_this_ranks_sequence_shard(dist):
    for placements, shape, full, same, first, second in dist.run(TP, _plain_shards):
        assert placements == (Shard(1),) and shape == (BATCH, SEQ, DIM)
        torch.testing.assert_close(full, _reference())
        assert same
        assert first == {"all_gather": 1}  # the one-time check of the plain input
        assert second == {}  # afterwards no communication at all


def _replicated_dtensor():
    norm, mesh = _sp_norm()
    x = sw.distribute_tensor(_full_input(), mesh, [Replicate()])
    out = norm(x)
    return out.placements, tuple(out.shape), out.full_tensor()


def test_replicated_dtensor_input_keeps_the_global_sequence(dist):
    for placements, shape, full in dist.run(TP, _replicated_dtensor):
        assert placements == (Shard(1),) and shape == (BATCH, SEQ, DIM)  # not TP * SEQ
        torch.testing.assert_close(full, _reference())


def _replicated_plain(**style):
    norm, _ = _sp_norm(**style)
    out = norm(_full_input())  # the whole sequence on every rank, not a shard
    return tuple(out.shape)


def test_replicated_plain_input_is_refused_on_every_rank(dist):
    dist.run_expect_error(TP, _replicated_plain, exc_type=ValueError,
                          match=r"RMSNorm.*plain input 0 \(float32\[2, 6, 8\]\) is the same tensor on all 2 ranks"
                                r".*global sequence 12 instead of 6.*output_layouts=Shard\(1\)")


def test_identical_shards_pass_when_the_check_is_off(dist):
    assert dist.run(TP, _replicated_plain, check_plain_inputs=False) == [(BATCH, TP * SEQ, DIM)] * TP


def _constant_plain():
    norm, _ = _sp_norm()
    return tuple(norm(torch.zeros(BATCH, SEQ // TP, DIM)).shape)


def test_constant_identical_shards_are_not_refused(dist):
    """All-zero shards are equal on every rank without being a replicated mistake."""
    assert dist.run(TP, _constant_plain) == [(BATCH, SEQ, DIM)] * TP
