"""Embedding lookups and their gradient: column-, batch- and vocab-parallel (row-sharded) tables.

``aten.embedding(weight[V, D], indices)`` on each mesh axis (output, weight, indices):

    batch       R         x S(d) -> S(d)        each rank looks up its own indices
    columns     S(1)      x R    -> S(last)     each rank holds some of the D features
    vocab       S(0)      x R    -> Partial     each rank holds a range of rows (see below)
    linear      P         x R    -> P           a lookup selects rows, so any pending
                                                elementwise reduction passes through
    replicated  R         x R    -> R

Vocab-parallel: a rank owning rows [offset, offset + length) looks up only the indices in
that range (shifted by ``offset``) and writes zeros for the others; the sum over ranks is the
lookup. That is not "run the op on the local blocks", so both ops here are custom handlers that
plan like a strategy (candidates scored by ``strategy.choose``, cached per layout), then run
their own local kernel. A rank's range may be empty with uneven splits (vocab 10 over 4 ranks).

``aten.embedding_dense_backward(grad[..., D], indices, V, padding_idx, scale_grad_by_freq)``
(output, grad, indices):

    columns     S(1)   <- S(last) x R
    batch       P      <- S(d)    x S(d)        (not with scale_grad_by_freq: the counts
                                                 would only see local indices)
    vocab       S(0)   <- R       x R           each rank accumulates only its rows
    linear      P(op)  <- P(op)   x R           (sum, avg)
    replicated  R      <- R       x R

With replicated inputs the vocab layout wins ties over replicated (same cost, listed first):
the gradient of a row-sharded table then lands in its rows (Shard(0)) without communication,
and any rank computes only 1/n of the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from shardwise.dispatch.ops._common import R, aten
from shardwise.dispatch.tensor_class import block_wrapper, dtensor_cls, new_dtensor
from shardwise.dispatch.registry import register_custom_handler
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, choose, expand
from shardwise.core.placement import Partial, Placement, Shard
from shardwise.redistribute.execute import redistribute_local
from shardwise.core.spec import DTensorSpec, TensorMeta, contiguous_stride

__all__ = ["embedding_axis_candidates", "dense_backward_axis_candidates", "masked_lookup", "masked_dense_backward"]


# ---------------------------------------------------------------------- candidates (data)
def embedding_axis_candidates(weight: DTensorSpec, indices: DTensorSpec) -> list[AxisCandidate]:
    """Per-axis layouts of ``embedding``: (output, weight, indices)."""
    last = indices.ndim
    candidates: list[AxisCandidate] = [(Shard(d), R, Shard(d)) for d in range(indices.ndim)]
    candidates.append((Shard(last), Shard(1), R))
    candidates.append((Partial(), Shard(0), R))
    for p in dict.fromkeys(weight.placements):
        if isinstance(p, Partial):
            candidates.append((p, p, R))
    candidates.append((R, R, R))
    return candidates


def dense_backward_axis_candidates(grad: DTensorSpec, indices: DTensorSpec, scale_by_freq: bool) -> list[AxisCandidate]:
    """Per-axis layouts of ``embedding_dense_backward``: (grad weight, grad output, indices)."""
    candidates: list[AxisCandidate] = [(Shard(1), Shard(grad.ndim - 1), R)]
    if not scale_by_freq:
        candidates += [(Partial(), Shard(d), Shard(d)) for d in range(indices.ndim)]
    candidates.append((Shard(0), R, R))
    for p in dict.fromkeys(grad.placements):
        if isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            candidates.append((p, p, R))
    candidates.append((R, R, R))
    return candidates


# ---------------------------------------------------------------------- local kernels
def masked_lookup(weight: torch.Tensor, indices: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """Rows of the global table for ``indices``, given the block of rows [offset, offset+length).

    Indices outside the block give zero rows (another rank contributes them).
    """
    shifted = indices - offset
    outside = (shifted < 0) | (shifted >= length)
    if length == 0:
        return weight.new_zeros((*indices.shape, weight.shape[1]))
    out = aten.embedding.default(weight, shifted.masked_fill(outside, 0))
    return out.masked_fill_(outside.unsqueeze(-1), 0)


def masked_dense_backward(
    grad: torch.Tensor, indices: torch.Tensor, offset: int, length: int, padding_idx: int, scale_by_freq: bool
) -> torch.Tensor:
    """Gradient of the rows [offset, offset+length) only: positions looking up other rows are
    dropped (dropping them leaves the frequency counts of the kept rows unchanged)."""
    shifted = indices - offset
    inside = ((shifted >= 0) & (shifted < length)).reshape(-1)
    kept_grad = grad.reshape(-1, grad.shape[-1])[inside]
    kept_indices = shifted.reshape(-1)[inside]
    local_padding = padding_idx - offset if 0 <= padding_idx - offset < length and padding_idx >= 0 else -1
    return aten.embedding_dense_backward.default(kept_grad, kept_indices, length, local_padding, scale_by_freq)


# ---------------------------------------------------------------------- planning
@dataclass(frozen=True, slots=True)
class _Plan:
    """Input targets (None: as is), the output spec, and this rank's vocab rows if masked."""

    inputs: tuple[DTensorSpec | None, ...]
    output: DTensorSpec
    rows: tuple[int, int] | None


def _choose(op: Any, specs: tuple[DTensorSpec, ...], axis_candidates: list[AxisCandidate]) -> Candidate:
    schema = OpSchema(op, specs, (), specs)
    best = choose(schema, expand(axis_candidates, 1, specs[0].mesh.ndim))
    assert best is not None, "the replicated candidate is always valid"
    return best


def _targets(specs: tuple[DTensorSpec, ...], candidate: Candidate) -> tuple[DTensorSpec | None, ...]:
    return tuple(
        None if target is None or target == spec.placements else spec.with_placements(target)
        for spec, target in zip(specs, candidate.inputs)
    )


def _rows(spec: DTensorSpec) -> tuple[int, int] | None:
    """(offset, length) of this rank's rows when ``spec`` cuts dim 0, else None."""
    if not spec.shard_axes(0):
        return None
    shape, offset = spec.local_shape_and_offset()
    return offset[0], shape[0]


def _out_spec(spec: DTensorSpec, placements: tuple[Placement, ...], shape: tuple[int, ...], dtype) -> DTensorSpec:
    meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), dtype)
    return DTensorSpec(spec.mesh, placements, meta)


@lru_cache(maxsize=1024)
def _embedding_plan(weight: DTensorSpec, indices: DTensorSpec) -> _Plan:
    best = _choose(aten.embedding.default, (weight, indices), embedding_axis_candidates(weight, indices))
    w_target = weight.with_placements(best.inputs[0])
    shape = (*indices.shape, weight.shape[1])
    return _Plan(_targets((weight, indices), best), _out_spec(weight, best.outputs[0], shape, weight.dtype), _rows(w_target))


@lru_cache(maxsize=1024)
def _backward_plan(grad: DTensorSpec, indices: DTensorSpec, num_weights: int, scale_by_freq: bool) -> _Plan:
    best = _choose(aten.embedding_dense_backward.default, (grad, indices),
                   dense_backward_axis_candidates(grad, indices, scale_by_freq))
    out = _out_spec(grad, best.outputs[0], (num_weights, grad.shape[-1]), grad.dtype)
    return _Plan(_targets((grad, indices), best), out, _rows(out))


def _locals(dtensors: tuple, targets: tuple[DTensorSpec | None, ...]) -> list[torch.Tensor]:
    """Each DTensor's block, redistributed to its target where it has one."""
    return [
        dt._local_tensor if target is None else redistribute_local(dt._local_tensor, dt._spec, target)
        for dt, target in zip(dtensors, targets)
    ]


def _as_dtensors(first: Any, second: Any) -> tuple[Any, Any]:
    """Both arguments as DTensors: a plain tensor the dispatcher let through (a 0-dim index)
    is replicated on the other argument's mesh."""
    DTensor = dtensor_cls()
    if type(first) is DTensor and type(second) is DTensor:
        return first, second
    mesh = first._spec.mesh if isinstance(first, DTensor) else second._spec.mesh

    def wrap(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value
        spec = DTensorSpec(mesh, (R,) * mesh.ndim, TensorMeta.of(value))
        return DTensor(value, spec, requires_grad=False)

    return wrap(first), wrap(second)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if index < len(args) else kwargs.get(name, default)


# ---------------------------------------------------------------------- handlers
def _lookup_in_place(op: Any, args: tuple, kwargs: dict) -> Any:
    """For a call signature whose plan moves nothing and looks each rank's indices up in its
    own block (batch, column or replicated layouts: the usual ones): the op on the two blocks,
    wrapped, with no planning per call. None for the other signatures."""
    DTensor = dtensor_cls()
    if kwargs or len(args) < 2 or type(args[0]) is not DTensor or type(args[1]) is not DTensor:
        return None
    plan = _embedding_plan(args[0]._spec, args[1]._spec)
    if plan.inputs != (None, None) or plan.rows is not None:
        return None
    call = op._op if isinstance(op, torch._ops.OpOverload) else op  # skips the overload's Python __call__
    spec, wrap = plan.output, block_wrapper()

    def run(op: Any, args: tuple, kwargs: dict, dtensors: list) -> Any:
        return wrap(call(args[0]._local_tensor, args[1]._local_tensor, *args[2:]), spec)

    return run


@register_custom_handler(aten.embedding.default, specialize=_lookup_in_place)
def embedding_handler(op: Any, args: tuple, kwargs: dict) -> Any:
    """``embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)`` on DTensors."""
    if kwargs:
        weight, indices = _arg(args, kwargs, 0, "weight", None), _arg(args, kwargs, 1, "indices", None)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("weight", "indices")}
    else:  # the usual call: all positional
        weight, indices = args[0], args[1]
    weight, indices = _as_dtensors(weight, indices)
    plan = _embedding_plan(weight._spec, indices._spec)
    if plan.inputs == (None, None):
        w, idx = weight._local_tensor, indices._local_tensor
    else:
        w, idx = _locals((weight, indices), plan.inputs)
    if plan.rows is None:
        out = op(w, idx, *args[2:], **kwargs)
    else:
        out = masked_lookup(w, idx, *plan.rows)
    return new_dtensor(out, plan.output)


@register_custom_handler(aten.embedding_dense_backward.default)
def embedding_dense_backward_handler(op: Any, args: tuple, kwargs: dict) -> Any:
    """``embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)``."""
    grad, indices = _as_dtensors(_arg(args, kwargs, 0, "grad_output", None), _arg(args, kwargs, 1, "indices", None))
    num_weights = _arg(args, kwargs, 2, "num_weights", None)
    padding_idx = _arg(args, kwargs, 3, "padding_idx", -1)
    scale = bool(_arg(args, kwargs, 4, "scale_grad_by_freq", False))
    plan = _backward_plan(grad._spec, indices._spec, num_weights, scale)
    g, idx = _locals((grad, indices), plan.inputs)
    if plan.rows is None:
        out = op(g, idx, num_weights, padding_idx, scale)
    else:
        out = masked_dense_backward(g, idx, *plan.rows, padding_idx, scale)
    return new_dtensor(out, plan.output)
