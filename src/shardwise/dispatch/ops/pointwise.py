"""Pointwise ops: every aten op tagged ``torch.Tag.pointwise`` (not listed by hand).

On each mesh axis the output may be sharded on any dim, with each input sharded on the
matching dim (or replicated where it broadcasts), or everything replicated. A Partial input
stays Partial only through ops that commute with its pending reduction:

* sum (linear): neg; add/sub/where of Partials with anything: a replicated operand (or a
  scalar) contributes from mesh coordinate 0 only, 0 elsewhere (its ``partition`` into
  Partial(sum), free); mul/div by a replicated factor; of two Partials multiplied, one is
  reduced, not both;
* avg: the same, except that replicated addends stay as they are (the mean of x_i + c is
  mean(x_i) + c);
* product (multiplicative): mul/div of Partials with anything (a replicated factor or scalar
  counts on coordinate 0 only, 1 elsewhere), abs, integer powers, where;
* any: masked_fill with a replicated mask and value (for sum and product the value is written
  on coordinate 0 only, the identity elsewhere);
* max/min (order): adding a scalar or a replicated tensor, multiplying by a scalar >= 0, and
  negation or a negative scalar factor, which turn max into min and back; maximum/minimum of
  Partials of the same kind, clamping and maximum/minimum with replicated bounds (monotone
  maps commute with max and min), where.

Everything else reduces first; the cost model picks reduce_scatter over all_reduce when it can.
Random ops (tagged nondeterministic_seeded) are excluded: see ``ops/random.py``.
"""

from __future__ import annotations

from dataclasses import replace
from numbers import Number
from typing import Any, Callable

import torch

from shardwise.dispatch.ops._common import R, aten, aten_ops_tagged, broadcast_dim, num_tensor_outputs, tensor_shapes
from shardwise.dispatch.registry import register_custom_handler, register_strategy, scalars_matter_by_sign_only
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, expand
from shardwise.core.placement import Partial, Placement, Shard
from shardwise.core.spec import DTensorSpec, TensorMeta
from shardwise.dispatch import tensor_class

_FLIP = {"max": "min", "min": "max"}
# Ops whose value is the same kind of reduction of the inputs' contributions, with each
# non-Partial operand partitioned (coordinate 0 holds it, the others the identity).
_ADDITIVE = ("add", "sub", "rsub", "where", "masked_fill")
_MULTIPLICATIVE = ("mul", "div", "where", "masked_fill")


def pointwise_axis_candidates(schema: OpSchema) -> list[AxisCandidate]:
    """Per-axis layouts of a pointwise op (outputs first, then DTensor inputs)."""
    specs = schema.specs
    out_shape = tuple(torch.broadcast_shapes(*tensor_shapes(schema.args + tuple(v for _, v in schema.kwargs))))
    n_out = max(num_tensor_outputs(schema.op), 1)
    candidates = []
    for d in range(len(out_shape)):
        singleton = out_shape[d] == 1 and _sharded_singleton(specs, len(out_shape), d)
        if out_shape[d] > 1 or singleton:
            candidates.append((Shard(d),) * n_out + tuple(broadcast_dim(s, out_shape, d, singleton) for s in specs))
    candidates.append((R,) * (n_out + len(specs)))
    return _partial_candidates(schema, n_out) + candidates


def _sharded_singleton(specs: list, out_ndim: int, d: int) -> bool:
    """Whether output dim ``d`` has size 1 and an input is already sharded on it (one row over
    several ranks: trailing ranks hold none, e.g. a [1, n] parameter under fully_shard). Keeping
    that layout needs no communication, and in-place ops and views of it must keep it; a size-1
    dim no input shards stays replicated (sharding it would be a choice, not a given)."""
    for spec in specs:
        in_dim = d - (out_ndim - spec.ndim)
        if in_dim >= 0 and spec.shape[in_dim] == 1 and any(p == Shard(in_dim) for p in spec.placements):
            return True
    return False


def pointwise_candidates(schema: OpSchema) -> list[Candidate]:
    """Every N-D layout; those keeping a pending sum or product through an op with scalar
    operands get a rewrite that gives the scalar to coordinate 0 only (see ``_scalar_rewrite``)."""
    n_out = max(num_tensor_outputs(schema.op), 1)
    candidates = expand(pointwise_axis_candidates(schema), n_out, schema.mesh.ndim)
    positions = _partitioned_scalars(schema)
    if not positions:
        return candidates
    return [
        replace(c, rewrite=_scalar_rewrite(positions)) if _keeps_identity_partial(c) else c
        for c in candidates
    ]


def _keeps_identity_partial(candidate: Candidate) -> bool:
    out = candidate.outputs[0] if candidate.outputs else None
    return out is not None and any(p.is_partial() and p.identity() is not None for p in out)


def _partitioned_scalars(schema: OpSchema) -> tuple[int, ...]:
    """Positions of scalar operands that a kept sum or product must count once, not per rank."""
    name = _name(schema)
    ops = _partial_ops(schema)
    if len(ops) != 1:
        return ()
    reduce_op = next(iter(ops))
    if not (reduce_op == "sum" and name in _ADDITIVE or reduce_op == "product" and name in _MULTIPLICATIVE):
        return ()
    # where(cond, a, b); masked_fill(self, mask, value); add(self, other, alpha)
    operands = {"where": (1, 2), "masked_fill": (2,)}.get(name, (1,))
    return tuple(i for i in operands if i < len(schema.args) and _is_scalar(schema.args[i]))


def _is_scalar(value: Any) -> bool:
    return (isinstance(value, Number) and not isinstance(value, bool)) or (
        isinstance(value, torch.Tensor) and value.ndim == 0
    )


def _scalar_rewrite(positions: tuple[int, ...]) -> Callable:
    """Replace the scalars at ``positions`` by the reduction's identity on every rank whose
    coordinate is not 0 along some axis where the output keeps a pending sum or product."""

    def rewrite(args: list, kwargs: dict, output_specs: tuple) -> tuple[list, dict]:
        spec = output_specs[0]
        mesh = spec.mesh
        identity = None
        for axis, p in enumerate(spec.placements):
            if p.is_partial() and p.identity() is not None and mesh.get_local_rank(axis) != 0:
                identity = p.identity()
        if identity is None:
            return args, kwargs
        args = list(args)
        for i in positions:
            value = args[i]
            args[i] = torch.full_like(value, identity) if isinstance(value, torch.Tensor) else type(value)(identity)
        return args, kwargs

    return rewrite


def _name(schema: OpSchema) -> str:
    return schema.op._schema.name.split("::")[-1].rstrip("_")


def _partial_ops(schema: OpSchema) -> set[str]:
    return {p.reduce_op for s in schema.specs for p in s.placements if isinstance(p, Partial)}


def _partial_candidates(schema: OpSchema, n_out: int) -> list[AxisCandidate]:
    """The layouts keeping a pending reduction, if this op commutes with it (see module doc)."""
    ops = _partial_ops(schema)
    if len(ops) != 1:
        return []
    reduce_op = ops.pop()
    return [(Partial(out),) * n_out + inputs for out, inputs in _partial_rules(schema, reduce_op)]


def _partial_rules(schema: OpSchema, reduce_op: str) -> list[tuple[str, tuple[Placement, ...]]]:
    """(output reduce op, input placements) pairs under which the op commutes with ``reduce_op``."""
    name = _name(schema)
    specs = schema.specs
    P = Partial(reduce_op)
    kept = tuple(P if s.has_partial else R for s in specs)  # Partials pass, the rest replicated
    everything = (P,) * len(specs)  # the rest partitioned: counted on coordinate 0 only
    partial_args = [a for a in schema.args if isinstance(a, DTensorSpec) and a.has_partial]
    first_is_partial = bool(schema.args) and isinstance(schema.args[0], DTensorSpec) and schema.args[0].has_partial
    others = [a for a in schema.args[1:] if not (isinstance(a, DTensorSpec) and a.has_partial)]
    linear = reduce_op in ("sum", "avg")
    order = reduce_op in ("max", "min")
    if name in ("clone", "detach", "alias", "contiguous", "positive"):
        return [(reduce_op, kept)]
    if name == "neg":
        return [(reduce_op if linear else _FLIP[reduce_op], kept)] if reduce_op != "product" else []
    if name == "where":
        return _where_rules(schema, reduce_op, everything, kept)
    if name == "masked_fill" and first_is_partial and len(partial_args) == 1 and _replicated(others):
        # where(mask, value, x): the value is counted on coordinate 0 only for sum and product.
        inputs = list(everything if reduce_op in ("sum", "product") else kept)
        if len(schema.args) > 1 and isinstance(schema.args[1], DTensorSpec):
            inputs[1] = R  # the mask
        return [(reduce_op, tuple(inputs))]
    if name in ("add", "sub", "rsub"):
        if reduce_op == "sum":
            return [("sum", everything)]
        if reduce_op == "avg":
            return [("avg", kept)]
        if order and len(partial_args) == 1 and first_is_partial and name != "rsub" and _replicated(others):
            return [(reduce_op, kept)]
        return []
    if name in ("mul", "div"):
        return _product_rules(schema, reduce_op, name, kept, everything, partial_args, first_is_partial, others)
    if order and name in ("maximum", "minimum", "max", "min", "clamp", "clamp_min", "clamp_max"):
        # maximum of Partial(max)s (minimum of Partial(min)s) is the max of the pairwise maxima;
        # any monotone map of one Partial (clamping, max/min with a replicated bound) commutes.
        if name.startswith("clamp"):
            return [(reduce_op, kept)] if first_is_partial and len(partial_args) == 1 and _replicated(others) else []
        same = name[:3] == reduce_op
        if len(partial_args) == 1 or same:
            return [(reduce_op, kept)]
        return []
    if reduce_op == "product":
        if name == "abs":
            return [("product", kept)]
        if name == "pow" and schema.op is aten.pow.Tensor_Scalar and type(schema.arg(1, "exponent")) is int:
            return [("product", kept)]
    return []


def _replicated(values: list[Any]) -> bool:
    """Scalars, 0-dim tensors, None (an absent bound), or DTensors replicated on every axis."""
    return all(
        v is None
        or isinstance(v, Number)
        or (isinstance(v, torch.Tensor) and v.ndim == 0)
        or (isinstance(v, DTensorSpec) and v.is_replicated())
        for v in values
    )


def _product_rules(schema: OpSchema, reduce_op: str, name: str, kept: tuple, everything: tuple,
                   partial_args: list, first_is_partial: bool, others: list) -> list[tuple[str, tuple]]:
    """mul / div: linear in each factor, multiplicative in all of them."""
    if name == "div" and schema.kwarg("rounding_mode") is not None:
        return []
    if reduce_op == "product":
        return [("product", everything)]
    if reduce_op in ("sum", "avg"):
        if len(partial_args) == 1 and (first_is_partial or name == "mul"):
            return [(reduce_op, kept)]
        if len(partial_args) == 2 and len(schema.specs) == 2:
            # Keep one factor's pending reduction, reduce the other (never both).
            first = (kept[0], R)
            return [(reduce_op, first)] + ([(reduce_op, (R, kept[1]))] if name == "mul" else [])
        return []
    if len(partial_args) == 1 and (first_is_partial or name == "mul"):
        factor = others[0] if others else schema.args[0]
        if isinstance(factor, Number) and not isinstance(factor, bool):
            if name == "div" and factor == 0:
                return []
            return [(reduce_op if factor >= 0 else _FLIP[reduce_op], kept)]
    return []


def _where_rules(schema: OpSchema, reduce_op: str, everything: tuple, kept: tuple) -> list[tuple[str, tuple]]:
    """``where(cond, a, b)`` picks values elementwise: a replicated condition keeps any pending
    reduction of the picked values (for sum and product the other operand is partitioned)."""
    cond = schema.arg(0, "condition")
    if isinstance(cond, DTensorSpec) and cond.has_partial:
        return []
    inputs = everything if reduce_op in ("sum", "product") else kept
    if isinstance(cond, DTensorSpec):
        inputs = (R,) + inputs[1:]
    return [(reduce_op, inputs)]


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
                aten.positive.default, aten.lift_fresh.default,
                torch.ops.prims.where.default, torch.ops.prims.copy_to.default]  # prims reached by decompositions
register_strategy(*_POINTWISE, *_SAME_LAYOUT, per_axis=False, replace=True)(pointwise_candidates)
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
    DTensor = tensor_class.DTensor
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
