"""Softmax and nll_loss over a sharded class dim (vocab-parallel cross entropy), without gathering.

When the logits are sharded on the class (vocabulary) dim, gathering them costs the whole
[tokens, vocab] tensor. These handlers instead exchange one number per row:

* ``log_softmax(x)``: the row max (all-reduce max) and the row sum of ``exp(x - max)``
  (all-reduce sum); each rank then normalizes its own columns. The output stays sharded.
* its backward ``g - exp(out) * sum(g)`` and softmax's ``out * (g - sum(g * out))``: one
  all-reduce of the row sums. These are the true gradients, whatever consumes the output:
  a log_softmax that feeds something other than the loss still gets correct gradients.
* ``nll_loss``: a rank owning classes [offset, offset + length) picks ``-x[t]`` for the
  targets in its range and 0 for the others; summing over the class axes is exact (every
  target is owned by exactly one rank). The loss is all-reduced right away (one scalar, or
  one number per sample for ``reduction="none"``) so it comes out replicated, readable with
  ``.item()`` or ``.to_local()`` as torch users expect; the mean divides by the global total
  weight.
* ``nll_loss_backward``: ``-w[t] * g`` written at the owned target positions only.

Other mesh axes may shard the samples (data parallelism on the same logits); the target is
laid out to match them. Pending reductions of the logits are settled first (nothing here is
linear in them).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise import comm

from shardwise.tensor import agreement
from shardwise.dispatch.ops._common import R, aten, bind_arguments, local_block, meta_of, wrap_local
from shardwise.dispatch.registry import register_layout_handler
from shardwise.dispatch.strategy import OpSchema
from shardwise.core.placement import Partial, Placement, Shard
from shardwise.core.spec import DTensorSpec

__all__ = ["softmax_forward", "softmax_backward", "nll_loss_forward", "nll_loss_backward"]

MEAN = 1


# ---------------------------------------------------------------------- layouts
def _dim_sharded(schema: OpSchema, spec_index: int, dim: int) -> bool:
    spec = schema.specs[spec_index] if spec_index < len(schema.specs) else None
    return isinstance(spec, DTensorSpec) and bool(spec.shard_axes(dim % max(spec.ndim, 1)))


def _class_dim(ndim: int) -> int:
    return 1 if ndim >= 2 else 0


def _nll_applies(schema: OpSchema, self_position: int) -> bool:
    spec = schema.args[self_position] if self_position < len(schema.args) else None
    return isinstance(spec, DTensorSpec) and bool(spec.shard_axes(_class_dim(spec.ndim)))


def _settled(spec: DTensorSpec) -> tuple[Placement, ...]:
    """``spec``'s placements with pending reductions made Replicate."""
    return tuple(R if p.is_partial() else p for p in spec.placements)


def _all_reduce(t: torch.Tensor, mesh, axes: list[int], op: str) -> torch.Tensor:
    agreement.settle(mesh)  # unconfirmed from_local blocks would reach gloo as mismatched sizes
    for axis in axes:
        t = comm.all_reduce(t, mesh, axis, op)
    return t


# ---------------------------------------------------------------------- softmax
def _row_max(local: torch.Tensor, dim: int, mesh, axes: list[int]) -> torch.Tensor:
    if local.shape[dim] == 0:  # an empty block: it does not raise the max
        shape = list(local.shape)
        shape[dim] = 1
        m = local.new_full(shape, float("-inf"))
    else:
        m = local.amax(dim, keepdim=True)
    m = _all_reduce(m, mesh, axes, "max")
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows of -inf stay -inf


@register_layout_handler(aten._log_softmax.default, aten._softmax.default,
                         applies=lambda schema: _dim_sharded(schema, 0, schema.arg(1, "dim")))
def softmax_forward(op: Any, args: tuple, kwargs: dict) -> Any:
    """(log_)softmax of rows cut across ranks: global max and sum of exponentials, all-reduced."""
    x, dim, half_to_float = bind_arguments(op, args, kwargs)
    spec = x._spec
    dim = dim % spec.ndim
    placements = _settled(spec)
    local = local_block(x, placements)
    if half_to_float:
        local = local.float()
    axes = spec.shard_axes(dim)
    z = local - _row_max(local, dim, spec.mesh, axes)
    total = _all_reduce(z.exp().sum(dim, keepdim=True), spec.mesh, axes, "sum")
    out = z - total.log() if op is aten._log_softmax.default else z.exp() / total
    return wrap_local(out, spec.mesh, placements, op(meta_of(x), dim, half_to_float))


@register_layout_handler(aten._log_softmax_backward_data.default, aten._softmax_backward_data.default,
                         applies=lambda schema: _dim_sharded(schema, 1, schema.arg(2, "dim")))
def softmax_backward(op: Any, args: tuple, kwargs: dict) -> Any:
    """Gradient through (log_)softmax of sharded rows: one all-reduce of the row sums."""
    grad, out, dim, input_dtype = bind_arguments(op, args, kwargs)
    spec = out._spec
    dim = dim % spec.ndim
    placements = _settled(spec)
    out_local, grad_local = local_block(out, placements), local_block(grad, placements)
    axes = spec.shard_axes(dim)
    if op is aten._log_softmax_backward_data.default:
        row = _all_reduce(grad_local.sum(dim, keepdim=True), spec.mesh, axes, "sum")
        result = grad_local - out_local.exp() * row
    else:
        row = _all_reduce((grad_local * out_local).sum(dim, keepdim=True), spec.mesh, axes, "sum")
        result = out_local * (grad_local - row)
    return wrap_local(result.to(input_dtype), spec.mesh, placements, op(meta_of(grad), meta_of(out), dim, input_dtype))


# ---------------------------------------------------------------------- nll_loss
def _target_layout(self_placements: tuple[Placement, ...], class_dim: int) -> tuple[Placement, ...]:
    """The target's placements matching the logits': class axes replicate it, sample axes cut it alike."""
    out = []
    for p in self_placements:
        if p.is_shard() and p.dim != class_dim:
            out.append(Shard(p.dim if p.dim < class_dim else p.dim - 1))
        else:
            out.append(R)
    return tuple(out)


class _Owned:
    """The targets this rank's block of classes owns, and where they sit in the block."""

    def __init__(self, self_spec: DTensorSpec, placements, target: torch.Tensor, ignore_index: int):
        c = _class_dim(self_spec.ndim)
        shape, offset = self_spec.with_placements(placements).local_shape_and_offset()
        start, length = offset[c], shape[c]
        self.valid = target != ignore_index
        self.owned = self.valid & (target >= start) & (target < start + length)
        self.index = (target - start).clamp(0, max(length - 1, 0)).unsqueeze(c)
        self.safe_target = torch.where(self.valid, target, torch.zeros_like(target))
        self.class_dim, self.length = c, length


def _sample_axes(placements: tuple[Placement, ...], class_dim: int) -> list[int]:
    return [i for i, p in enumerate(placements) if p.is_shard() and p.dim != class_dim]


def _class_axes(placements: tuple[Placement, ...], class_dim: int) -> list[int]:
    return [i for i, p in enumerate(placements) if p.is_shard(class_dim)]


def _weights(weight: Any, owned: _Owned, like: torch.Tensor) -> torch.Tensor:
    """The class weight of every sample (0 for ignored ones)."""
    if weight is None:
        w = torch.ones_like(owned.safe_target, dtype=like.dtype)
    else:
        w = local_block(weight, (R,) * weight._spec.mesh.ndim)[owned.safe_target].to(like.dtype)
    return torch.where(owned.valid, w, torch.zeros_like(w))


@register_layout_handler(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default,
                         applies=lambda schema: _nll_applies(schema, 0))
def nll_loss_forward(op: Any, args: tuple, kwargs: dict) -> tuple:
    """Each rank scores the targets its classes own; the sum over the class axes is all-reduced."""
    x, target, weight, reduction, ignore_index = bind_arguments(op, args, kwargs)
    spec, mesh = x._spec, x._spec.mesh
    c = _class_dim(spec.ndim)
    placements = _settled(spec)
    local = local_block(x, placements)
    target_local = local_block(target, _target_layout(placements, c))
    owned = _Owned(spec, placements, target_local, ignore_index)
    w = _weights(weight, owned, local)
    if owned.length:
        picked = local.gather(c, owned.index).squeeze(c)
    else:
        picked = local.new_zeros(target_local.shape)
    losses = torch.where(owned.owned, -picked * w, torch.zeros_like(w))
    total = w.sum()
    sample_axes, class_axes = _sample_axes(placements, c), _class_axes(placements, c)
    total_placements = tuple(Partial() if i in sample_axes else R for i in range(mesh.ndim))
    if reduction == 0:  # per-sample losses: each one is owned by one rank of the class axes
        loss = _all_reduce(losses, mesh, class_axes, "sum")
        loss_placements = _target_layout(placements, c)
    else:  # reduced to a replicated scalar, as a loss is read (.item(), .to_local(), logging)
        loss = _all_reduce(losses.sum(), mesh, class_axes + sample_axes, "sum")
        if reduction == MEAN:
            total = _all_reduce(total, mesh, sample_axes, "sum")
            total_placements = (R,) * mesh.ndim
            loss = loss / total
        loss_placements = (R,) * mesh.ndim
    meta_loss, meta_total = op(meta_of(x), meta_of(target), meta_of(weight), reduction, ignore_index)
    return wrap_local(loss, mesh, loss_placements, meta_loss), wrap_local(total, mesh, total_placements, meta_total)


@register_layout_handler(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default,
                         applies=lambda schema: _nll_applies(schema, 1))
def nll_loss_backward(op: Any, args: tuple, kwargs: dict) -> Any:
    """``-w[t] * grad`` at the owned target positions of this rank's classes, zero elsewhere."""
    grad, x, target, weight, reduction, ignore_index, total_weight = bind_arguments(op, args, kwargs)
    spec, mesh = x._spec, x._spec.mesh
    c = _class_dim(spec.ndim)
    placements = _settled(spec)
    local = local_block(x, placements)
    target_layout = _target_layout(placements, c)
    target_local = local_block(target, target_layout)
    owned = _Owned(spec, placements, target_local, ignore_index)
    g = local_block(grad, target_layout if reduction == 0 else (R,) * mesh.ndim).to(local.dtype)
    scale = -_weights(weight, owned, local) * g
    if reduction == MEAN:
        scale = scale / local_block(total_weight, (R,) * mesh.ndim)
    out = torch.zeros_like(local)
    if owned.length:
        values = torch.where(owned.owned, scale, torch.zeros_like(scale)).unsqueeze(c)
        out.scatter_(c, owned.index, values)
    meta = op(meta_of(grad), meta_of(x), meta_of(target), meta_of(weight), reduction, ignore_index, meta_of(total_weight))
    return wrap_local(out, mesh, placements, meta)
