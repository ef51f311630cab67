"""Placements on their own: values, predicates, validation, chunk arithmetic."""

import pytest
import torch

from shardwise import Partial, Replicate, Shard
from shardwise.core.placement import check_placements


def test_placements_are_hashable_values():
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1)
    assert len({Shard(1), Shard(1), Replicate(), Replicate(), Partial(), Partial("sum")}) == 3
    assert Partial() == Partial("sum") != Partial("max")
    with pytest.raises(Exception):
        Shard(0).dim = 1  # frozen


def test_predicates():
    assert Shard(2).is_shard() and Shard(2).is_shard(2) and not Shard(2).is_shard(1)
    assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
    assert Partial("max").is_partial() and Partial("max").is_partial("max") and not Partial("max").is_partial("sum")


def test_repr_is_readable():
    assert repr(Shard(1)) == "Shard(dim=1)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial("avg")) == "Partial(avg)"
    assert [str(p) for p in (Shard(0), Replicate(), Partial())] == ["S(0)", "R", "P(sum)"]


def test_partial_rejects_unknown_reduce_op():
    with pytest.raises(ValueError, match="reduce_op must be one of"):
        Partial("median")
    assert Partial("prod") == Partial("product") and Partial("prod").reduce_op == "product"  # torch.prod's name


def test_shard_normalizes_negative_dims():
    assert Shard(-1).normalized(3) == Shard(2)
    assert Shard(1).normalized(3) == Shard(1)
    with pytest.raises(IndexError, match="outside a tensor of rank 2"):
        Shard(2).normalized(2)
    with pytest.raises(IndexError):
        Shard(-3).normalized(2)


def test_mixed_partial_ops_raise_value_error():
    with pytest.raises(ValueError, match=r"mix Partial reduce ops \['max', 'sum'\]"):
        check_placements([Partial("sum"), Partial("max"), Shard(0)])
    assert check_placements([Partial("sum"), Partial("sum")]) == (Partial(), Partial())


def test_non_placement_entries_raise():
    with pytest.raises(TypeError, match="expected Placement"):
        check_placements([Shard(0), "R"])


@pytest.mark.parametrize("size,n", [(8, 4), (5, 4), (3, 8), (0, 2), (1, 1), (7, 3)])
def test_chunk_matches_torch_chunk(size, n):
    pieces = torch.arange(size).chunk(n) if size else ()
    for k in range(n):
        length, offset = Shard.chunk(size, n, k)
        if k < len(pieces):
            assert length == len(pieces[k]) and (length == 0 or offset == int(pieces[k][0]))
        else:
            assert length == 0
    assert sum(Shard.chunk(size, n, k)[0] for k in range(n)) == size


@pytest.mark.parametrize("op,expected", [("sum", 5.0), ("avg", 5.0), ("max", 5.0), ("min", 5.0)])
def test_partition_value_reduces_back(op, expected):
    value = torch.tensor([5.0])
    parts = torch.stack([Partial(op).partition_value(value, r) for r in range(4)])
    reduce = {"sum": parts.sum(0), "avg": parts.mean(0), "max": parts.amax(0), "min": parts.amin(0)}[op]
    assert reduce.item() == expected
