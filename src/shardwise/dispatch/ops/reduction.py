"""Reductions: a sharded dim that survives stays sharded; a reduced sharded dim becomes Partial.

Reducing over a sharded dim leaves each rank with the reduction of its block; that is exactly
``Partial(op)`` when the reduction is associative with a matching collective (sum -> sum,
amax -> max, amin -> min), so no communication happens until the value is needed. Reductions
without such a collective need the reduced dims whole (replicated) on every axis.
"""

from __future__ import annotations

from typing import Sequence

from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import AxisCandidate, OpSchema
from shardwise.placement import Partial, Placement, Shard

__all__ = ["reduction_axis_candidates", "reduced_dims"]


def reduced_dims(ndim: int, dims: int | Sequence[int] | None) -> tuple[int, ...]:
    """Non-negative reduced dims; None or [] means all dims (as aten's reductions do)."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return tuple(sorted({d % max(ndim, 1) for d in dims}))


def _out_dim(d: int, reduced: tuple[int, ...], keepdim: bool) -> int:
    return d if keepdim else d - sum(r < d for r in reduced)


def reduction_axis_candidates(
    schema: OpSchema, reduced: tuple[int, ...], keepdim: bool, partial_op: str | None, n_out: int = 1
) -> list[AxisCandidate]:
    """Per-axis layouts of a reduction of input 0 over ``reduced``.

    ``partial_op`` is the pending reduction a reduced sharded dim turns into (None: the
    reduced dims must be whole). A Partial input of the same kind passes through.
    """
    spec = schema.specs[0]
    others = (None,) * (len(schema.specs) - 1)
    candidates: list[AxisCandidate] = []
    for d in range(spec.ndim):
        if d in reduced:
            if partial_op is not None:
                candidates.append((Partial(partial_op),) * n_out + (Shard(d),) + others)
        else:
            candidates.append((Shard(_out_dim(d, reduced, keepdim)),) * n_out + (Shard(d),) + others)
    if partial_op is not None:
        for p in _partials_passing(spec.placements, partial_op):
            candidates.append((p,) * n_out + (p,) + others)
    candidates.append((R,) * n_out + (R,) + others)
    return candidates


def _partials_passing(placements: Sequence[Placement], partial_op: str) -> list[Placement]:
    """Pending reductions that commute with this reduction (sum of a sum, max of a max)."""
    ok = {"sum": ("sum",), "max": ("max",), "min": ("min",)}[partial_op]
    return [p for p in dict.fromkeys(placements) if isinstance(p, Partial) and p.reduce_op in ok]


@register_strategy(aten.sum.default, aten.sum.dim_IntList)
def sum_candidates(schema: OpSchema) -> list[AxisCandidate]:
    reduced = reduced_dims(schema.specs[0].ndim, schema.arg(1, "dim"))
    return reduction_axis_candidates(schema, reduced, bool(schema.arg(2, "keepdim", False)), "sum")


@register_strategy(aten.amax.default, aten.amin.default)
def amax_candidates(schema: OpSchema) -> list[AxisCandidate]:
    reduced = reduced_dims(schema.specs[0].ndim, schema.arg(1, "dim"))
    op = "max" if schema.op is aten.amax.default else "min"
    return reduction_axis_candidates(schema, reduced, bool(schema.arg(2, "keepdim", False)), op)
