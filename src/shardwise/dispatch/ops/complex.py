"""Complex views and conjugation: what rotary embeddings in the complex formulation use.

``view_as_complex`` reads the last dim (size 2) as (real, imaginary) pairs and drops it;
``view_as_real`` adds it back. Both are views: every other dim maps to itself and keeps its
sharding, while the pair dim must be whole (a shard boundary inside a pair would split a
number). Conjugation (``_conj``, ``conj_physical``, ``resolve_conj``...) is elementwise and
additive (the conjugate of a sum is the sum of the conjugates), so any layout, Partial(sum)
included, passes through it unchanged.
"""

from __future__ import annotations

from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.ops.view import dim_map_candidates, partials
from shardwise.dispatch.registry import register_strategy
from shardwise.dispatch.strategy import AxisCandidate, OpSchema
from shardwise.core.placement import Shard

__all__ = ["view_as_complex_strategy", "view_as_real_strategy", "conj_strategy"]


@register_strategy(aten.view_as_complex.default)
def view_as_complex_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """[..., 2] real -> [...] complex: the pair dim must be whole."""
    spec = schema.specs[0]
    return _additive(dim_map_candidates(spec, [d if d < spec.ndim - 1 else None for d in range(spec.ndim)]))


@register_strategy(aten.view_as_real.default)
def view_as_real_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """[...] complex -> [..., 2] real: every dim keeps its layout; the new pair dim is whole."""
    spec = schema.specs[0]
    return _additive(dim_map_candidates(spec, list(range(spec.ndim))))


def _additive(candidates: list[AxisCandidate]) -> list[AxisCandidate]:
    """Drop Partial(max/min) pass-throughs: complex numbers have no order."""
    return [c for c in candidates if not any(p is not None and p.is_partial() and p.reduce_op not in ("sum", "avg") for p in c)]


@register_strategy(aten.conj_physical.default, aten._conj_physical.default, aten.resolve_conj.default, aten.resolve_neg.default, aten._neg_view.default)
def conj_strategy(schema: OpSchema) -> list[AxisCandidate]:
    """Elementwise and additive: the layout passes through (Partial included). (``_conj`` itself
    is computed, not a conjugate-bit view: see ``ops/fft.py``.)"""
    spec = schema.specs[0]
    candidates = [(Shard(d), Shard(d)) for d in range(spec.ndim)]
    candidates += [(p, p) for p in partials(spec) if p.reduce_op in ("sum", "avg")]
    return candidates + [(R, R)]
