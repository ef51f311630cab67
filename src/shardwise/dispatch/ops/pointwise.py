"""Pointwise ops: every aten op tagged ``torch.Tag.pointwise`` (not listed by hand).

On each mesh axis the output may be sharded on any dim, with each input sharded on the
matching dim (or replicated where it broadcasts), or everything replicated. A Partial input
stays Partial only through ops that commute with its pending reduction:

* sum/avg (linear): neg; add/sub of two such Partials; mul/div by a scalar or a replicated
  factor; avg also through adding a scalar or a replicated tensor (the mean of x_i + c is
  mean(x_i) + c, whereas a sum would count c once per rank);
* max/min (order): adding a scalar or a replicated tensor, multiplying by a scalar >= 0, and
  negation or a negative scalar factor, which turn max into min and back.

Everything else reduces first; the cost model picks reduce_scatter over all_reduce when it can.
Random ops (tagged nondeterministic_seeded) are excluded: see ``ops/random.py``.
"""

from __future__ import annotations

from numbers import Number
from typing import Any

import torch

from shardwise.dispatch.ops._common import R, aten, aten_ops_tagged, broadcast_dim, num_tensor_outputs, tensor_shapes
from shardwise.dispatch.registry import register_custom_handler, register_strategy, scalars_matter_by_sign_only
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema
from shardwise.placement import Partial, Placement, Shard
from shardwise.spec import DTensorSpec, TensorMeta

_FLIP = {"max": "min", "min": "max"}


def pointwise_axis_candidates(schema: OpSchema) -> list[AxisCandidate]:
    """Per-axis layouts of a pointwise op (outputs first, then DTensor inputs)."""
    specs = schema.specs
    out_shape = tuple(torch.broadcast_shapes(*tensor_shapes(schema.args + tuple(v for _, v in schema.kwargs))))
    n_out = max(num_tensor_outputs(schema.op), 1)
    candidates = []
    for d in range(len(out_shape)):
        if out_shape[d] > 1:
            candidates.append((Shard(d),) * n_out + tuple(broadcast_dim(s, out_shape, d) for s in specs))
    candidates.append((R,) * (n_out + len(specs)))
    partial = _partial_candidate(schema, n_out)
    if partial is not None:
        candidates.insert(0, partial)
    return candidates


def _partial_candidate(schema: OpSchema, n_out: int) -> AxisCandidate | None:
    """The layout keeping a pending reduction, if this op commutes with it (see module doc)."""
    ops = {p.reduce_op for s in schema.specs for p in s.placements if isinstance(p, Partial)}
    if len(ops) != 1:
        return None
    reduce_op = ops.pop()
    out = _partial_output(schema, reduce_op)
    if out is None:
        return None
    inputs = tuple(Partial(reduce_op) if s.has_partial else R for s in schema.specs)
    return (Partial(out),) * n_out + inputs


def _partial_output(schema: OpSchema, reduce_op: str) -> str | None:
    """The reduce op of the output if the op commutes with ``reduce_op``, else None."""
    name = schema.op._schema.name.split("::")[-1].rstrip("_")
    partial_args = [a for a in schema.args if isinstance(a, DTensorSpec) and a.has_partial]
    others = [a for a in schema.args[1:] if a not in partial_args] if schema.args else []
    first_is_partial = bool(schema.args) and isinstance(schema.args[0], DTensorSpec) and schema.args[0].has_partial
    linear = reduce_op in ("sum", "avg")
    if name in ("clone", "detach", "alias", "contiguous", "positive"):
        return reduce_op
    if name == "neg":
        return reduce_op if linear else _FLIP[reduce_op]
    if name in ("add", "sub"):
        alpha = schema.kwarg("alpha", 1)
        if len(partial_args) == 2 and linear and first_is_partial:
            return reduce_op
        if len(partial_args) == 1 and first_is_partial and _replicated(others):
            if reduce_op == "avg" or (not linear and (name == "add" or alpha == 1)):
                return reduce_op
        return None
    if name in ("mul", "div") and len(partial_args) == 1 and (first_is_partial or name == "mul"):
        factor = others[0] if others else schema.args[0]
        if linear and _replicated([factor]):
            return reduce_op
        if not linear and isinstance(factor, Number) and not isinstance(factor, bool):
            return reduce_op if factor >= 0 else _FLIP[reduce_op]
    return None


def _replicated(values: list[Any]) -> bool:
    """Scalars, 0-dim tensors, or DTensors replicated on every axis."""
    return all(
        isinstance(v, Number)
        or (isinstance(v, torch.Tensor) and v.ndim == 0)
        or (isinstance(v, DTensorSpec) and v.is_replicated)
        for v in values
    )


_POINTWISE = list(aten_ops_tagged(torch.Tag.pointwise, without=(torch.Tag.nondeterministic_seeded,)))


def _in_place_twins(ops: list) -> list:
    """``abs_`` for ``abs``...: some in-place variants lack the pointwise tag their twin has."""
    twins = []
    for op in ops:
        packet = getattr(aten, op._schema.name.split("::")[-1] + "_", None)
        twin = getattr(packet, op._overloadname, None) if packet is not None else None
        if twin is not None and twin not in ops:
            twins.append(twin)
    return twins


_POINTWISE += _in_place_twins(_POINTWISE)
_SAME_LAYOUT = [aten.clone.default, aten.detach.default, aten.alias.default, aten.contiguous.default,
                aten.positive.default, aten.copy_.default, aten.lift_fresh.default,
                torch.ops.prims.where.default, torch.ops.prims.copy_to.default]  # prims reached by decompositions
register_strategy(*_POINTWISE, *_SAME_LAYOUT, replace=True)(pointwise_axis_candidates)
scalars_matter_by_sign_only(*_POINTWISE)


def _unpartial(p: Placement) -> Placement:
    return R if p.is_partial() else p


@register_strategy(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, per_axis=False)
def like_candidates(schema: OpSchema) -> list[Candidate]:
    """``*_like`` factories read no values: keep the layout, Partial becomes Replicate."""
    spec = schema.specs[0]
    return [Candidate((None,), (tuple(_unpartial(p) for p in spec.placements),))]


@register_custom_handler(aten.empty_like.default)
def empty_like(op: Any, args: tuple, kwargs: dict) -> Any:
    """Uninitialized blocks of the same layout; with ``device=`` (what ``module.to_empty`` passes) exactly.

    Without ``device`` it acts like the other ``*_like`` factories (Partial becomes Replicate:
    code that fills the result expects a plain value). With ``device`` it is a move of storage:
    undefined values lose nothing by staying pending, so the placements are kept exactly and a
    buffer that was Partial before ``to_empty`` is Partial after it. ``device`` may be the
    mesh's device type or "meta"; any other raises before anything is allocated (every rank
    calls it alike, so every rank raises).
    """
    from shardwise.dtensor import DTensor

    x = args[0]
    spec = x._spec
    device = kwargs.get("device")
    if device is not None and torch.device(device).type not in ("meta", spec.mesh.device_type):
        raise ValueError(
            f"empty_like / to_empty: device={str(device)!r} is not covered by {spec.mesh}: its ranks hold "
            f"{spec.mesh.device_type} blocks of {spec.render()}; use device={spec.mesh.device_type!r} (or 'meta')"
        )
    options = {k: v for k, v in kwargs.items() if k != "device"}
    whole = torch.empty_like(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta"), **options)
    local = torch.empty_like(x._local_tensor, **kwargs)
    placements = spec.placements if device is not None else tuple(_unpartial(p) for p in spec.placements)
    out = DTensorSpec(spec.mesh, placements, TensorMeta(whole.shape, whole.stride(), whole.dtype))
    return DTensor(local, out, requires_grad=False)
