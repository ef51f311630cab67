"""all_to_all of token rows with per-peer counts, differentiable: the dispatch and combine of
expert parallelism (the exchange of GShard, Lepikhin et al. 2020, section 3.2).

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

__all__ = ["all_to_all_rows"]


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], mesh: DeviceMesh) -> torch.Tensor:
    width = rows.shape[1:].numel()
    flat = comm.all_to_all_counts(rows.contiguous().reshape(-1), [c * width for c in send], [c * width for c in recv],
                                  mesh, 0)  # [sum(recv) * width]
    return flat.view(sum(recv), *rows.shape[1:])


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], mesh: DeviceMesh) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.mesh = send, recv, mesh
        return _exchange(rows, send, recv, mesh)  # [sum(recv), ...] by sender

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.mesh), None, None, None


def all_to_all_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    mesh: DeviceMesh) -> torch.Tensor:
    """Rows [sum(send_splits), ...] dealt to the peers of the 1-D ``mesh``; returns what they sent
    here, [sum(recv_splits), ...] in peer order. Gradients flow back through the reverse exchange."""
    return _AllToAllRows.apply(rows, list(send_splits), list(recv_splits), mesh)
