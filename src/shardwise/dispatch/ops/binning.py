"""Ops that put values into bins: ``histc``, ``bucketize``, ``searchsorted``.

Counting is a sum over the input: with the bin edges fixed in advance (an explicit range, or
edges given as a tensor), each rank counts its own block and the histogram is
``Partial(sum)`` of the local counts, without gathering the input. Edges taken from the data's
own min / max (``histc``'s default range) need the whole input; so does a density, which
divides by the global total.

``bucketize`` / ``searchsorted`` look each value up in a replicated sorted sequence, so the
values keep their sharding (a batched ``searchsorted`` also keeps its leading dims sharded
alike on the sequences and the values).

``histogram`` / ``histogramdd`` have no meta kernel: they gather and run (``data_dependent.py``).
"""

from __future__ import annotations

from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.ops.norm import spec_arguments
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import AxisCandidate, OpSchema
from shardwise.core.placement import Partial, Shard
from shardwise.core.spec import DTensorSpec

_SUM = Partial("sum")


@register_strategy(aten.histc.default)
def histc_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """Local counts summed when the range is explicit (``min != max``); else the whole input."""
    spec = schema.specs[0]
    low, high = schema.arg(2, "min", 0), schema.arg(3, "max", 0)
    candidates: list[AxisCandidate] = []
    if low != high:
        candidates += [(_SUM, Shard(d)) for d in range(spec.ndim) if spec.shape[d] > 1]
    return candidates + [(R, R)]


@register_strategy(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """(out; self?, boundaries): each value looks itself up in the whole boundaries."""
    values = schema.arg(0, "self")
    if not isinstance(values, DTensorSpec):
        return [(R, R)]
    candidates: list[AxisCandidate] = [(Shard(d), Shard(d), R) for d in range(values.ndim) if values.shape[d] > 1]
    return candidates + [(R, R, R)]


@register_strategy(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """(out; sorted_sequence, self?, sorter?): the sequence's last dim is whole; values keep
    their sharding; leading (batch) dims are sharded alike on sequences and values."""
    names = spec_arguments(schema)
    seq, values = schema.arg(0, "sorted_sequence"), schema.arg(1, "self")
    if not isinstance(values, DTensorSpec):
        return [(R,) * (1 + len(names))]
    candidates: list[AxisCandidate] = []
    for d in range(values.ndim):
        if values.shape[d] <= 1:
            continue
        batch = seq.ndim > 1 and d < values.ndim - 1
        if seq.ndim > 1 and not batch and d != values.ndim - 1:
            continue
        along = {"self": Shard(d), "sorted_sequence": Shard(d) if batch else R, "sorter": Shard(d) if batch else R}
        candidates.append((Shard(d),) + tuple(along[n] for n in names))
    return candidates + [(R,) * (1 + len(names))]
