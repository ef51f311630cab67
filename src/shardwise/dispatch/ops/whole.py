"""Ops that read their inputs as a whole: every input Replicate, every output Replicate.

Each has a known output shape but no structure that a block could be computed from without
the rest: where a scattered source element lands depends on the mask before it
(``masked_scatter``), a flat index addresses the whole tensor (``take``, ``put``), pairwise
distances or segments span every row (``pdist``, ``segment_reduce``), a loss aligns whole
sequences (``ctc_loss``), a hash or ``allclose`` answers for all elements. Gathering is the
layout that is right for them; it is chosen only when the op is called, so sharded code that
never calls them pays nothing.
"""

from __future__ import annotations

from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import AxisCandidate, OpSchema

_WHOLE = [
    aten.masked_scatter.default, aten.masked_scatter_.default, aten.nonzero_static.default,
    aten.take.default, aten.put.default, aten.put_.default, aten.index_reduce.default, aten.index_reduce_.default,
    aten._pdist_forward.default, aten._pdist_backward.default,
    aten.segment_reduce.default, aten._segment_reduce_backward.default,
    aten._ctc_loss.default, aten._ctc_loss_backward.default,
    aten.grid_sampler_3d.default, aten.grid_sampler_3d_backward.default,
    aten._trilinear.default, aten.hash_tensor.default, aten.allclose.default,
]


@register_strategy(*_WHOLE)
def whole_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """Every input and output Replicate (one output per schema return: none is a list)."""
    return [(R,) * (len(schema.op._schema.returns) + len(schema.specs))]
