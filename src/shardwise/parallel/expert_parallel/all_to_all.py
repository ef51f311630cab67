"""The differentiable collectives of expert parallelism: all_to_all of token rows with per-peer
counts, the dispatch and combine (the exchange of GShard, Lepikhin et al. 2020, section 3.2),
and the copy / sum pair of experts split over tp.

Forward sends ``send_splits[s]`` rows to peer s and receives ``recv_splits[s]`` from it;
backward sends the gradients the opposite way, the same collective with the counts swapped.
The counts are host lists known before the call (``dispatch.plan_dispatch``), so neither
direction reads anything from the device.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise import comm
from shardwise.core.mesh import DeviceMesh

__all__ = ["all_to_all_rows", "copy_to_axis", "sum_over_axis"]

def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], mesh: DeviceMesh, axis: int) -> torch.Tensor:
    width = rows.shape[1:].numel()
    elements = [c * width for c in send]
    flat = comm.all_to_all_counts(rows.contiguous().reshape(-1), elements, [c * width for c in recv],
                                  mesh, axis)  # [sum(recv) * width]
    return flat.view(sum(recv), *rows.shape[1:])


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], mesh: DeviceMesh,
                axis: int) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.mesh, ctx.axis = send, recv, mesh, axis
        return _exchange(rows, send, recv, mesh, axis)  # [sum(recv), ...] by sender

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.mesh, ctx.axis), None, None, None, None


def all_to_all_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    mesh: DeviceMesh, axis: int = 0) -> torch.Tensor:
    """Rows [sum(send_splits), ...] dealt to the peers along ``axis`` of ``mesh``; returns what they
    sent here, [sum(recv_splits), ...] in peer order. Gradients flow back through the reverse exchange."""
    return _AllToAllRows.apply(rows, list(send_splits), list(recv_splits), mesh, axis)


# Megatron's f and g (Shoeybi et al. 2019, section 3): a tensor every rank of an axis holds whole
# enters computations split over the axis (its gradient is the sum of the ranks' parts), and
# their partial results leave as one sum (its gradient is the same whole tensor everywhere).
class _CopyToAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
        ctx.mesh, ctx.axis = mesh, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return comm.all_reduce(grad.contiguous(), ctx.mesh, ctx.axis, "sum"), None, None


class _SumOverAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
        return comm.all_reduce(x.contiguous(), mesh, axis, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None, None


def copy_to_axis(x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """``x`` unchanged; in backward its gradient is summed over ``axis`` (one all_reduce)."""
    return _CopyToAxis.apply(x, mesh, axis)


def sum_over_axis(x: torch.Tensor, mesh: DeviceMesh, axis: int) -> torch.Tensor:
    """The sum of every ``axis`` rank's ``x`` (one all_reduce); its gradient passes unchanged."""
    return _SumOverAxis.apply(x, mesh, axis)
