"""Losses: nll_loss (what ``F.cross_entropy`` reaches after log_softmax), nll_loss2d, mse_loss.

nll_loss over samples sharded on the batch (or, for nll_loss2d, a spatial) dim:

* ``reduction="none"``: each rank's losses are its samples' losses: sharded like the target;
* ``reduction="sum"``: each rank holds the sum over its samples: ``Partial(sum)``;
* ``reduction="mean"``: the mean divides by the GLOBAL total weight (the count of non-ignored
  targets, weighted by the class weights). A rank's local mean would divide by its own count —
  wrong, and NaN for a rank whose shard is empty or fully ignored. So each rank computes its
  local *sum*, the scalar total weight is all-reduced, and the loss is
  ``Partial(sum)`` of ``local_sum / global_total_weight``; the total weight (which the
  backward divides by) comes out replicated. This needs a collective inside the op, hence a
  custom handler rather than a strategy.

The class dim is whole here: the target indexes into it. Logits sharded on the class dim
(vocab-parallel cross entropy) are taken by the layout handlers of ``vocab_parallel.py``
before this module's handlers are consulted.

mse_loss and its backward shard elementwise; their mean divides by the GLOBAL element count,
which is static, so each rank computes its local sum and divides by it (no communication).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from shardwise.dispatch.ops._common import (
    R, aten, bind_arguments, broadcast_dim, cached_choice, localize, make_spec, meta_of, num_tensor_outputs,
    wrap_local,
)
from shardwise.dispatch.ops.norm import linear_partial_ops, spec_arguments
from shardwise.dispatch.registry import register_custom_handler, register_strategy
from shardwise.dispatch.strategy import AxisCandidate, Candidate, OpSchema, expand
from shardwise.core.placement import Partial, Placement, Shard
from shardwise.redistribute.execute import redistribute_local
from shardwise.core.spec import DTensorSpec
from shardwise.dispatch import tensor_class

__all__ = ["nll_loss_forward", "nll_loss_backward", "mse_loss_forward", "mse_loss_backward"]

NONE, MEAN, SUM = 0, 1, 2


def _plan(op: Any, specs: tuple[DTensorSpec, ...], reduction: int,
          axis_candidates: Callable[[tuple[DTensorSpec, ...], int], list[AxisCandidate]]) -> Candidate:
    """The cheapest layout among the per-axis ``axis_candidates`` of a loss op."""
    make = lambda: expand(axis_candidates(specs, reduction), num_tensor_outputs(op), specs[0].mesh.ndim)  # noqa: E731
    return cached_choice((op, specs, reduction), OpSchema(op, specs, (), specs), make)


def _dtensors(name: str, values: list[Any]) -> list[Any]:
    """The tensor arguments, which the dispatcher guarantees are DTensors (or None)."""
    DTensor = tensor_class.DTensor
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not all(isinstance(t, DTensor) for t in tensors):
        raise ValueError(f"{name}: mix of DTensors and plain tensors; make every tensor argument a DTensor")
    return tensors


# ---------------------------------------------------------------------- nll_loss forward
def _sample_dims(input_ndim: int) -> list[tuple[int, int]]:
    """(input dim, target dim) pairs of the per-sample dims: every dim but the class dim."""
    class_dim = 1 if input_ndim >= 2 else 0
    return [(d, d if d < class_dim else d - 1) for d in range(input_ndim) if d != class_dim]


def _nll_axis_candidates(specs: tuple[DTensorSpec, ...], reduction: int) -> list[AxisCandidate]:
    """(loss, total_weight, input, target[, weight]) on one mesh axis, before the mean fix-up."""
    weight = (R,) * (len(specs) - 2)
    candidates: list[AxisCandidate] = []
    for d, t in _sample_dims(specs[0].ndim):
        loss = Shard(t) if reduction == NONE else Partial()
        total = R if reduction == NONE else Partial()
        candidates.append((loss, total, Shard(d), Shard(t)) + weight)
    candidates.append((R, R, R, R) + weight)
    return candidates


@register_custom_handler(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(op: Any, args: tuple, kwargs: dict) -> tuple:
    """nll_loss on DTensors: local sums, global total weight for the mean (module docstring)."""
    inp, target, weight, reduction, ignore_index = bind_arguments(op, args, kwargs)
    dtensors = _dtensors("nll_loss", [inp, target, weight])
    specs = tuple(t._spec for t in dtensors)
    plan = _plan(op, specs, reduction, _nll_axis_candidates)
    blocks = localize(dtensors, plan)
    local_weight = blocks[2] if weight is not None else None
    loss, total = op(blocks[0], blocks[1], local_weight, SUM if reduction == MEAN else reduction, ignore_index)
    meta_loss, meta_total = op(meta_of(specs[0]), meta_of(specs[1]), None if weight is None else meta_of(specs[2]), reduction, ignore_index)
    mesh = specs[0].mesh
    loss_pl, total_pl = plan.outputs
    if reduction == MEAN:
        replicated = (R,) * mesh.ndim
        if total_pl != replicated:
            total_spec = make_spec(mesh, total_pl, meta_total)
            total = redistribute_local(total, total_spec, total_spec.with_placements(replicated))
        loss, total_pl = loss / total, replicated
    return wrap_local(loss, mesh, loss_pl, meta_loss), wrap_local(total, mesh, total_pl, meta_total)


# ---------------------------------------------------------------------- backward
@register_strategy(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(schema: OpSchema) -> list[AxisCandidate]:
    """grad_input from (grad_output, input, target, weight?, total_weight).

    The gradient of sample i is ``-w[t_i] * grad_output[i] (/ total_weight for mean)``: local
    to the sample, so it shards like the samples. The mean's total weight is the global one
    (replicated by the forward); for none/sum it is unused and left as it is.
    """
    names = spec_arguments(schema)
    reduction = schema.arg(4, "reduction")
    inp = schema.specs[names.index("self")]
    total = R if reduction == MEAN else None

    def row(grad: Placement, sample: Placement | None, d: int = 0, t: int = 0) -> tuple:
        layout = {"grad_output": grad, "self": Shard(d) if sample else R, "target": Shard(t) if sample else R,
                  "weight": R, "total_weight": total}
        return tuple(layout[n] for n in names)

    candidates: list[AxisCandidate] = []
    for d, t in _sample_dims(inp.ndim):
        grad = Shard(t) if reduction == NONE else R
        candidates.append((Shard(d),) + row(grad, True, d, t))
    candidates.append((R,) + row(R, None))
    for op in linear_partial_ops(schema.specs[names.index("grad_output")]):
        candidates.insert(0, (Partial(op),) + row(Partial(op), None))
    return candidates


# ---------------------------------------------------------------------- mse_loss
def _mse_axis_candidates(specs: tuple[DTensorSpec, ...], reduction: int) -> list[AxisCandidate]:
    """(loss, self, target): elementwise sharding; a reduced sharded dim gives Partial(sum)."""
    shape = tuple(torch.broadcast_shapes(*(s.shape for s in specs)))
    candidates: list[AxisCandidate] = []
    for d in range(len(shape)):
        if shape[d] > 1:
            out = Shard(d) if reduction == NONE else Partial()
            candidates.append((out,) + tuple(broadcast_dim(s, shape, d) for s in specs))
    candidates.append((R,) * (1 + len(specs)))
    return candidates


@register_custom_handler(aten.mse_loss.default)
def mse_loss_forward(op: Any, args: tuple, kwargs: dict) -> Any:
    """Local sum divided by the global element count for the mean; else local as is."""
    inp, target, reduction = bind_arguments(op, args, kwargs)
    dtensors = _dtensors("mse_loss", [inp, target])
    specs = tuple(t._spec for t in dtensors)
    plan = _plan(op, specs, reduction, _mse_axis_candidates)
    blocks = localize(dtensors, plan)
    loss = op(*blocks, SUM if reduction == MEAN else reduction)
    if reduction == MEAN:
        loss = loss / math.prod(torch.broadcast_shapes(*(s.shape for s in specs)))
    return wrap_local(loss, specs[0].mesh, plan.outputs[0], op(*map(meta_of, specs), reduction))


def _mse_backward_axis_candidates(specs: tuple[DTensorSpec, ...], reduction: int) -> list[AxisCandidate]:
    """(grad_input, grad_output, self, target): elementwise; a Partial upstream gradient passes."""
    grad, inp, target = specs
    shape = tuple(inp.shape)
    candidates: list[AxisCandidate] = []
    for d in range(len(shape)):
        if shape[d] > 1:
            g = broadcast_dim(grad, shape, d) if reduction == NONE else R
            candidates.append((Shard(d), g, Shard(d), broadcast_dim(target, shape, d)))
    candidates.append((R,) * 4)
    for op in linear_partial_ops(grad):
        candidates.insert(0, (Partial(op), Partial(op), R, R))
    return candidates


@register_custom_handler(aten.mse_loss_backward.default)
def mse_loss_backward(op: Any, args: tuple, kwargs: dict) -> Any:
    """Local gradient; the mean's 1/numel uses the global element count."""
    grad, inp, target, reduction = bind_arguments(op, args, kwargs)
    dtensors = _dtensors("mse_loss_backward", [grad, inp, target])
    specs = tuple(t._spec for t in dtensors)
    plan = _plan(op, specs, reduction, _mse_backward_axis_candidates)
    blocks = localize(dtensors, plan)
    out = op(*blocks, SUM if reduction == MEAN else reduction)
    if reduction == MEAN:
        out = out / math.prod(specs[1].shape)
    return wrap_local(out, specs[0].mesh, plan.outputs[0], op(*map(meta_of, specs), reduction))
