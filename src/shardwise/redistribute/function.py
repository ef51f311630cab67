"""Differentiable layout changes: redistribute, from_local and to_local as autograd Functions.

The backward of each moves the gradient back to the input's layout, so the forward placement
logic alone decides the backward communication (seed 5.4): the gradient of an all_gather is a
local chunk or a reduce_scatter, the gradient of a reduce_scatter is an all_gather.

A gradient never stays Partial where the input was Partial: the logical input is the reduction
of the per-rank contributions, so each contribution's gradient is the whole gradient, i.e. the
gradient is Replicate on that axis.
"""

from __future__ import annotations

import torch

from shardwise.placement import Partial, Placement, Replicate
from shardwise.redistribute.execute import redistribute_local
from shardwise.spec import DTensorSpec

__all__ = ["Redistribute", "FromLocal", "ToLocal", "grad_layout"]


def grad_layout(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The placements a gradient takes to flow back into a tensor laid out as ``placements``."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _dtensor_cls():
    from shardwise.dtensor import DTensor

    return DTensor


class Redistribute(torch.autograd.Function):
    """``DTensor -> DTensor`` with another layout (on the same mesh, or another over the same ranks)."""

    @staticmethod
    def forward(ctx, input, dst: DTensorSpec):  # type: ignore[override]
        src = input._spec
        ctx.src_placements = src.placements
        ctx.src_mesh = src.mesh
        local = redistribute_local(input._local_tensor, src, dst)
        return _dtensor_cls()(local, dst, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # Back to the input's mesh too, when the forward changed meshes.
        target = DTensorSpec(ctx.src_mesh, grad_layout(ctx.src_placements), grad._spec.tensor_meta)
        if target == grad._spec:
            return grad, None
        return Redistribute.apply(grad, target), None


class FromLocal(torch.autograd.Function):
    """``local tensor -> DTensor`` without moving data (a view of the local tensor)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec):  # type: ignore[override]
        ctx.placements = spec.placements
        return _dtensor_cls()(local.view_as(local), spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # A gradient already in the forward layout (a from_local -> to_local round trip) is the
        # per-rank gradient as is; anything else is moved to the layout of the local blocks.
        if grad._spec.placements != ctx.placements:
            grad = Redistribute.apply(grad, grad._spec.with_placements(grad_layout(ctx.placements)))
        return grad._local_tensor, None


class ToLocal(torch.autograd.Function):
    """``DTensor -> this rank's block`` (a view); the gradient is read in ``grad_placements``."""

    @staticmethod
    def forward(ctx, input, grad_placements: tuple[Placement, ...] | None):  # type: ignore[override]
        ctx.spec = input._spec
        ctx.grad_placements = grad_placements
        return input._local_tensor.view_as(input._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        spec: DTensorSpec = ctx.spec
        placements = ctx.grad_placements or spec.placements
        grad_spec = DTensorSpec(spec.mesh, tuple(placements), spec.tensor_meta)
        return _dtensor_cls()(grad, grad_spec, requires_grad=False), None
