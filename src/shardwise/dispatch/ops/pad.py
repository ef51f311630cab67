"""Padding: ``F.pad`` in every mode (``constant_pad_nd``, ``reflection_pad*d``,
``replication_pad*d``; circular padding is slices and ``cat``) and the backward ops.

A padded dim changes size and its edge values come from (or go to) its ends, so it must be
whole; every dim that is not padded keeps its sharding, and the result is a DTensor laid out
like the input (``F.pad(x, (1, 1))`` of a row-sharded ``x`` pads each rank's rows locally). A
padded dim that is sharded is gathered first: a padded block would not be the block its rank
owns of the padded tensor.

Partial: reflection and replication only copy values, so any pending reduction passes. A
constant fill writes the same value on every rank, which an average, max or min leaves
unchanged, and a sum only when the value is 0 (else it would be counted once per rank).
"""

from __future__ import annotations

from typing import Any, Sequence

from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.ops.core_dims import batch_axis_candidates, without_empty_blocks
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, expand
from shardwise.core.placement import Placement, Shard
from shardwise.core.spec import DTensorSpec

__all__ = ["padded_dims"]


def padded_dims(ndim: int, pad: Sequence[int]) -> set[int]:
    """Dims that ``pad`` (pairs for the last dim first, as ``F.pad`` takes them) changes."""
    return {ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}


def _pending(spec: DTensorSpec, value: Any) -> list[Placement]:
    """The input's pending reductions a constant fill of ``value`` keeps."""
    keep = []
    for p in dict.fromkeys(spec.placements):
        if p.is_partial() and (p.reduce_op != "sum" or value == 0):
            keep.append(p)
    return keep


@register_strategy(aten.constant_pad_nd.default)
def constant_pad_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """Padded (or cropped, for negative pads) dims whole; the others keep their sharding."""
    spec = schema.specs[0]
    padded = padded_dims(spec.ndim, list(schema.arg(1, "pad")))
    candidates: list[AxisCandidate] = [
        (Shard(d), Shard(d)) for d in range(spec.ndim) if d not in padded and spec.shape[d] > 1
    ]
    candidates += [(p, p) for p in _pending(spec, schema.arg(2, "value", 0))]
    return candidates + [(R, R)]


def _register(spatial: int, *ops: Any) -> None:
    """Reflection / replication over the last ``spatial`` dims: the leading dims are free, but
    the kernels reject an empty channel dim (only a batch dim may be empty on a rank)."""

    def strategy(schema: OpSchema) -> list[Candidate]:
        spec = schema.specs[0]
        pending = [(p,) * (1 + len(schema.specs)) for p in dict.fromkeys(spec.placements) if p.is_partial()]
        linear = 0 if schema.op._schema.name.endswith("_backward") else None
        axis = (pending if linear is None else []) + batch_axis_candidates(
            schema, [spatial] * len(schema.specs), linear_in=linear)
        allowed = {0} if spec.ndim == spatial + 2 else set()
        return without_empty_blocks(schema, expand(axis, 1, spec.mesh.ndim), allowed)

    strategy.__name__ = strategy.__qualname__ = f"pad{spatial}d_strategy"
    register_strategy(*ops, per_axis=False)(strategy)


_register(1, aten.reflection_pad1d.default, aten.replication_pad1d.default,
          aten.reflection_pad1d_backward.default, aten.replication_pad1d_backward.default)
_register(2, aten.reflection_pad2d.default, aten.replication_pad2d.default,
          aten.reflection_pad2d_backward.default, aten.replication_pad2d_backward.default)
_register(3, aten.reflection_pad3d.default, aten.replication_pad3d.default,
          aten.reflection_pad3d_backward.default, aten.replication_pad3d_backward.default)
