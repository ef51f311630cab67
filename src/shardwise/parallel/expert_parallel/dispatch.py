"""Where the tokens of an expert-parallel layer go: pure arithmetic on counts, no process group.

A rank sorts its token-choices by expert; experts are split evenly over the ``n`` ep ranks
(rank s holds experts ``s*L .. s*L+L-1``, L = experts / n, as ``Shard(0)`` of the stacked
weights). Its tokens per expert, ``send [n*L]``, say how many rows go to each peer; the peers'
counts for this rank's experts, ``recv [n*L]`` (row s: what rank s sends for each of the L
experts), say how many come back, and in which order: by sender, then by expert. The experts
need them by expert, then by sender: ``regroup`` is that permutation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DispatchPlan", "plan_dispatch"]


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """The split sizes and orders of one layer's dispatch and combine on one rank.

    Attributes:
        send_splits: rows this rank sends to each peer (and receives back at combine).
        recv_splits: rows each peer sends this rank.
        expert_rows: rows per local expert, after regrouping (what the experts compute).
        regroup: received row i of the by-expert order is row ``regroup[i]`` of the by-sender
            order (a CPU int64 tensor).
    """

    send_splits: list[int]
    recv_splits: list[int]
    expert_rows: list[int]
    regroup: torch.Tensor


def plan_dispatch(send: list[int], recv: list[int], peers: int) -> DispatchPlan:
    """The plan from this rank's tokens per expert ``send`` and the peers' ``recv`` (see the module).

    Example:
        >>> p = plan_dispatch([1, 2, 0, 3], [1, 2, 4, 0], peers=2)  # 2 experts per rank
        >>> p.send_splits, p.recv_splits, p.expert_rows, p.regroup.tolist()
        ([3, 3], [3, 4], [5, 2], [0, 3, 4, 5, 6, 1, 2])
    """
    local = len(recv) // peers
    if len(send) != len(recv) or local * peers != len(recv):
        raise ValueError(f"counts of {len(send)} and {len(recv)} experts cannot be split over {peers} ranks")
    send_splits = [sum(send[s * local:(s + 1) * local]) for s in range(peers)]
    recv_splits = [sum(recv[s * local:(s + 1) * local]) for s in range(peers)]
    expert_rows = [sum(recv[s * local + e] for s in range(peers)) for e in range(local)]
    segment = torch.repeat_interleave(torch.arange(peers * local), torch.tensor(recv, dtype=torch.int64))
    by_expert = (segment % local) * peers + segment // local  # sort key: expert, then sender
    return DispatchPlan(send_splits, recv_splits, expert_rows, torch.argsort(by_expert, stable=True))
