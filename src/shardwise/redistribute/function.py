"""Differentiable layout changes: redistribute, from_local and to_local as autograd Functions.

The backward of each moves the gradient back to the input's layout, so the forward placement
logic alone decides the backward communication: the gradient of an all_gather is a local chunk
or a reduce_scatter, the gradient of a reduce_scatter is an all_gather.

The one rule that is not "the same layout as the input": the gradient of a Partial value is
Replicate. The logical value is the reduction of the per-rank contributions, so the gradient
of every contribution is the whole gradient of the value; reading a Replicate gradient as
Partial would reduce it once more (world-size times too large). Where the incoming gradient is
itself Partial on such an axis (a redistribute from one Partial to another, in backward), it
may stay Partial: a Partial gradient of the logical value is as good as a Replicate one, and
reducing it is left to whoever needs it. This matches torch.distributed.tensor.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shardwise.core.meta_step import META_STEP
from shardwise.core.placement import Partial, Placement, Replicate
from shardwise.redistribute.execute import redistribute_local
from shardwise.core.spec import DTensorSpec

__all__ = ["Redistribute", "FromLocal", "ToLocal", "grad_layout", "bind_tensor_class"]


def grad_layout(
    placements: tuple[Placement, ...], incoming: tuple[Placement, ...] | None = None
) -> tuple[Placement, ...]:
    """The placements a gradient takes to flow back into a tensor laid out as ``placements``.

    Partial axes take Replicate, unless the ``incoming`` gradient is Partial on that axis too,
    in which case it keeps its own Partial (no reduction needed to stay correct).
    """
    out = []
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            now = incoming[axis] if incoming is not None else None
            out.append(now if isinstance(now, Partial) else Replicate())
        else:
            out.append(p)
    return tuple(out)


_DTENSOR: list[type] = []  # [DTensor]: bound by shardwise.tensor.dtensor, which imports this module


def bind_tensor_class(cls: type) -> None:
    """Make ``cls`` the class these Functions build (``shardwise.tensor.dtensor`` binds DTensor)."""
    _DTENSOR[:] = [cls]


def _dtensor_cls() -> type:
    return _DTENSOR[0]


def _with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    return DTensorSpec(spec.mesh, spec.placements, replace(spec.tensor_meta, dtype=dtype))


def _meta_block(spec: DTensorSpec) -> torch.Tensor:
    """A meta tensor of this rank's block under ``spec``: redistributing meta data moves nothing."""
    return torch.empty(spec.local_shape(), dtype=spec.dtype, device="meta")


class Redistribute(torch.autograd.Function):
    """``DTensor -> DTensor`` with another layout (on the same mesh, or another over the same ranks).

    ``dst`` may carry another dtype than the input (``redistribute(forward_dtype=)``): the block
    is cast first, so the communication runs in that dtype. The gradient is redistributed in
    ``backward_dtype`` (default: the input's dtype) and handed back in the input's dtype.
    """

    @staticmethod
    def forward(ctx, input, dst: DTensorSpec, backward_dtype: torch.dtype | None = None):  # type: ignore[override]
        src = input._spec
        ctx.src = src
        ctx.backward_dtype = backward_dtype or src.dtype
        ctx.set_materialize_grads(False)
        local = input._local_tensor
        if dst.dtype != src.dtype:
            local, src = local.to(dst.dtype), _with_dtype(src, dst.dtype)
        if local.is_meta and dst.mesh.get_coordinate() is not None and not META_STEP.get():
            local = _meta_block(dst)  # building on meta: shapes only (a simulated step communicates)
        else:
            local = redistribute_local(local, src, dst)
        return _dtensor_cls()(local, dst, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None, None
        src: DTensorSpec = ctx.src
        if grad.dtype != ctx.backward_dtype:
            grad = grad.to(ctx.backward_dtype)
        # Back to the input's mesh too, when the forward changed meshes (axes do not line up
        # there: Partial axes simply take Replicate).
        incoming = grad.placements if grad._spec.mesh == src.mesh else None
        target = DTensorSpec(src.mesh, grad_layout(src.placements, incoming), grad._spec.tensor_meta)
        if target != grad._spec:
            grad = Redistribute.apply(grad, target)
        if grad.dtype != src.dtype:
            grad = grad.to(src.dtype)
        return grad, None, None


class FromLocal(torch.autograd.Function):
    """``local tensor -> DTensor`` without moving data (a view of the local tensor).

    The local gradient is read in ``grad_placements`` (default: the forward placements with
    Partial taken as Replicate), so a Partial incoming gradient is reduced here.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, grad_placements=None):  # type: ignore[override]
        ctx.grad_placements = tuple(grad_placements) if grad_placements else grad_layout(spec.placements)
        ctx.set_materialize_grads(False)
        return _dtensor_cls()(local.view_as(local), spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is None:
            return None, None, None
        if grad.placements != ctx.grad_placements:
            grad = Redistribute.apply(grad, grad._spec.with_placements(ctx.grad_placements))
        return grad.to_local(), None, None


class ToLocal(torch.autograd.Function):
    """``DTensor -> this rank's block`` (a view); the gradient is read in ``grad_placements``.

    Without ``grad_placements`` the gradient takes the forward placements, Partial read as
    Replicate: every rank's local gradient is then the gradient of the whole logical value.
    """

    @staticmethod
    def forward(ctx, input, grad_placements: tuple[Placement, ...] | None):  # type: ignore[override]
        ctx.spec = input._spec
        ctx.grad_placements = grad_placements
        ctx.set_materialize_grads(False)
        return input._local_tensor.view_as(input._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if grad is None:
            return None, None
        spec: DTensorSpec = ctx.spec
        placements = ctx.grad_placements or grad_layout(spec.placements)
        meta = spec.tensor_meta if grad.dtype == spec.dtype else replace(spec.tensor_meta, dtype=grad.dtype)
        return FromLocal.apply(grad, DTensorSpec(spec.mesh, tuple(placements), meta)), None
