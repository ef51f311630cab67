"""The gated linear unit: ``glu(x, dim) = a * sigmoid(b)`` with ``a, b = x.chunk(2, dim)``.

Each output element reads two inputs half the dim apart, so ``dim`` must be whole; every other
dim keeps its sharding (``glu`` over the hidden dim of a batch-sharded activation needs no
communication). Its backward and forward-mode derivatives follow the same rule.
"""

from __future__ import annotations

from shardwise.dispatch.ops._common import aten
from shardwise.dispatch.ops.core_dims import aligned_axis_candidates
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import AxisCandidate, OpSchema

_DIM_POSITION = {aten.glu.default: 1, aten.glu_backward.default: 2, aten.glu_jvp.default: 3,
                 aten.glu_backward_jvp.default: 5}


@register_strategy(*_DIM_POSITION)
def glu_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """The gated dim whole; other dims sharded alike on every tensor."""
    dim = schema.arg(_DIM_POSITION[schema.op], "dim", -1)
    return aligned_axis_candidates(schema, [dim])
