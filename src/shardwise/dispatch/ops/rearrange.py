"""Ops that move values within some dims: ``roll`` (and through it ``fftshift``), ``rot90``,
``pixel_shuffle`` / ``pixel_unshuffle`` and ``channel_shuffle``.

The dims whose values move must be whole (a roll of a sharded dim would move values across
ranks); every other dim keeps its sharding. They only move values, so any pending reduction
passes through (the reduction of moved values is the moved reduction).
"""

from __future__ import annotations

from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.ops.core_dims import batch_axis_candidates, output_shapes, without_empty_blocks
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, expand
from shardwise.core.placement import Shard


def _moving_candidates(schema: OpSchema, moved: set[int]) -> list[AxisCandidate]:
    spec = schema.specs[0]
    (out,) = output_shapes(schema)
    candidates: list[AxisCandidate] = [
        (Shard(d), Shard(d)) for d in range(spec.ndim) if d not in moved and spec.shape[d] > 1 and out[d] == spec.shape[d]
    ]
    candidates += [(p, p) for p in dict.fromkeys(spec.placements) if p.is_partial()]
    return candidates + [(R, R)]


@register_strategy(aten.roll.default)
def roll_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """Rolled dims whole (no dims: the flattened tensor rolls, so every dim is whole)."""
    ndim = max(schema.specs[0].ndim, 1)
    dims = list(schema.arg(2, "dims", []))
    moved = {d % ndim for d in dims} if dims else set(range(ndim))
    return _moving_candidates(schema, moved)


@register_strategy(aten.rot90.default)
def rot90_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """The two rotated dims whole."""
    ndim = max(schema.specs[0].ndim, 1)
    return _moving_candidates(schema, {d % ndim for d in schema.arg(2, "dims", [0, 1])})


@register_strategy(aten.pixel_shuffle.default, aten.pixel_unshuffle.default, per_axis=False)
def pixel_shuffle_strategy(schema: OpSchema) -> list[Candidate]:
    """``(*, C * r * r, H, W) <-> (*, C, H * r, W * r)``: the leading dims keep their sharding,
    unless some rank's block would be empty (the kernel returns an empty input unchanged, with
    the input's shape, not the output's)."""
    axis = _with_partials(schema, batch_axis_candidates(schema, [3]))
    return without_empty_blocks(schema, expand(axis, 1, schema.mesh.ndim), allowed=set())


@register_strategy(aten.channel_shuffle.default, aten.native_channel_shuffle.default)
def channel_shuffle_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """``(N, C, *)``: the channels are permuted, so C is whole; N and the spatial dims are free."""
    spec = schema.specs[0]
    return _moving_candidates(schema, {1 % max(spec.ndim, 1)})


def _with_partials(schema: OpSchema, candidates: list[AxisCandidate]) -> list[AxisCandidate]:
    pending = [(p, p) for p in dict.fromkeys(schema.specs[0].placements) if p.is_partial()]
    return pending + candidates
