"""Gradient-norm clipping over parameters that live on different meshes.

Composed parallelism puts parameters on several meshes: with FSDP + TP the tensor-parallel
weights are on the (tp, dp) mesh while norms and other weights TP leaves alone are on the dp
mesh, and some may be plain tensors. ``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor
norms into one tensor, which cannot mix meshes. Here the gradients are grouped by mesh, each
group's norm is computed with its own collectives and read as a plain number, and the
group norms combine exactly: the p-norm of all gradients is the p-norm of the group p-norms
(the max of the group maxima for p = inf).
"""

from __future__ import annotations

from typing import Iterable

import torch

from shardwise import comm
from shardwise.tensor.dtensor import DTensor
from shardwise.core.mesh import DeviceMesh

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def total_grad_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    across: DeviceMesh | None = None) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``grads`` together, as a plain 0-dim tensor (same on every rank).

    ``across``: a 1-D mesh whose ranks hold different parameters (pipeline stages); their
    norms combine into the norm of all of them (one all_reduce). None: every rank's ``grads``
    are (blocks of) the same parameters.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = []
    for tensors in groups.values():
        norm = torch.nn.utils.get_total_norm(tensors, norm_type, error_if_nonfinite=False, foreach=False)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms and across is None:
        return torch.tensor(0.0)
    device = norms[0].device if norms else across.device_type
    stacked = torch.stack([n.float() for n in norms]) if norms else torch.zeros(1, device=device)
    total = torch.linalg.vector_norm(stacked, norm_type)
    if across is not None:
        total = _combine_across(total, norm_type, across)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}; "
            "pass error_if_nonfinite=False to clip anyway"
        )
    return total


def _combine_across(norm: torch.Tensor, norm_type: float, mesh: DeviceMesh) -> torch.Tensor:
    """The norm of the disjoint parameter sets of ``mesh``'s ranks, from each rank's ``norm``."""
    if norm_type == float("inf"):
        return comm.all_reduce(norm.reshape(1), mesh, 0, "max").reshape(())
    summed = comm.all_reduce(norm.reshape(1) ** norm_type, mesh, 0, "sum").reshape(())
    return summed ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    across: DeviceMesh | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so their total norm is at most ``max_norm``.

    Same contract as ``torch.nn.utils.clip_grad_norm_`` (returns the total norm before
    clipping), for DTensor gradients on any mix of meshes and plain gradients. ``across``: as
    for ``total_grad_norm`` (the pipeline mesh, whose stages hold different parameters).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    total = total_grad_norm(grads, norm_type, error_if_nonfinite, across)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
    return total
