"""Where the tokens of an expert-parallel layer go: pure arithmetic on counts, no process group.

A rank sorts its token-choices by expert; experts are split evenly over the ``n`` ep ranks
(rank s holds experts ``s*L .. s*L+L-1``, L = experts / n, as ``Shard(0)`` of the stacked
weights). Its tokens per expert, ``send [n*L]``, say how many rows go to each peer; the peers'
counts for this rank's experts, ``recv [n*L]`` (row s: what rank s sends for each of the L
experts), say how many come back, and in which order: by sender, then by expert. The experts
need them by expert, then by sender: ``regroup`` is that permutation.

A simulated step (``--simulate``, meta tensors) has no routing to read: ``assumed_exchange``
gives the counts from the shapes alone, every rank routing alike, with balanced experts or the
busiest expert at a given factor of the mean (``assumed_routing``; docs/tools.md, "Expert parallelism
in the simulation").
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["DispatchPlan", "plan_dispatch", "assumed_counts", "assumed_exchange", "assumed_routing",
           "simulated_exchange", "recorded_routing", "replayed_routing", "note_exchange"]

Exchange = tuple[list[int], list[int]]  # (send, recv) counts of one dispatch on one rank

# The busiest expert's rows over the mean that a simulated step assumes (1.0: balanced).
_IMBALANCE: contextvars.ContextVar[float] = contextvars.ContextVar("shardwise_expert_imbalance", default=1.0)
# A real run's exchanges, in call order, replayed by a simulated step instead of the assumption.
_REPLAY: contextvars.ContextVar[Iterator[Exchange] | None] = contextvars.ContextVar("shardwise_replay", default=None)
# Where a real run's exchanges are noted (``recorded_routing``).
_RECORD: contextvars.ContextVar[list[Exchange] | None] = contextvars.ContextVar("shardwise_record", default=None)


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


def assumed_counts(rows: int, experts: int, imbalance: float = 1.0) -> list[int]:
    """Rows per expert of ``rows`` token-choices when routing is not known (a meta step).

    Expert 0 is the busiest, with ``round(imbalance * rows / experts)`` rows (at most ``rows``);
    the others share the rest as evenly as possible (the first ones one row more). ``imbalance``
    1.0 is balanced routing.

    Example:
        >>> assumed_counts(16, 4), assumed_counts(16, 4, imbalance=2.0)
        ([4, 4, 4, 4], [8, 3, 3, 2])
    """
    if experts < 1 or rows < 0 or not imbalance >= 1.0:
        raise ValueError(f"assumed_counts: need experts >= 1, rows >= 0, imbalance >= 1; got {experts}, {rows}, "
                         f"{imbalance}")
    if experts == 1:
        return [rows]
    busiest = min(rows, max(-(-rows // experts), round(imbalance * rows / experts)))
    rest, others = rows - busiest, experts - 1
    return [busiest] + [rest // others + (e < rest % others) for e in range(others)]


def assumed_exchange(rows: int, experts: int, peers: int, me: int, imbalance: float = 1.0) -> Exchange:
    """``(send, recv)`` counts for ``plan_dispatch`` on ep rank ``me`` when every rank routes its
    ``rows`` token-choices as ``assumed_counts`` does: each peer sends this rank what it sends
    itself for the experts here. Rank 0 holds the busiest expert, so it receives the most."""
    send = assumed_counts(rows, experts, imbalance)
    local = experts // peers
    mine = send[me * local:(me + 1) * local]
    return send, mine * peers


def simulated_exchange(rows: int, experts: int, peers: int, me: int) -> Exchange:
    """The counts a simulated dispatch of ``rows`` token-choices uses: the next replayed real
    exchange inside ``replayed_routing``, else ``assumed_exchange`` at the ``assumed_routing``
    imbalance."""
    replay = _REPLAY.get()
    if replay is None:
        return assumed_exchange(rows, experts, peers, me, _IMBALANCE.get())
    send, recv = next(replay, ([], []))
    if sum(send) != rows or len(send) != experts:
        raise ValueError(f"replayed_routing: the next recorded exchange routes {sum(send)} rows over {len(send)} "
                         f"experts; this dispatch has {rows} rows and {experts} experts")
    return send, recv


def note_exchange(send: list[int], recv: list[int]) -> None:
    """Called by a real dispatch with its counts: kept inside ``recorded_routing``."""
    log = _RECORD.get()
    if log is not None:
        log.append((list(send), list(recv)))


@contextlib.contextmanager
def recorded_routing() -> Iterator[list[Exchange]]:
    """Collect this rank's real dispatch counts, in call order, into the list yielded (to replay
    them in a simulation: ``replayed_routing``)."""
    log: list[Exchange] = []
    token = _RECORD.set(log)
    try:
        yield log
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def replayed_routing(exchanges: list[Exchange]) -> Iterator[None]:
    """Inside the block, simulated dispatches take a recorded run's counts, one per call, in order."""
    token = _REPLAY.set(iter(exchanges))
    try:
        yield
    finally:
        _REPLAY.reset(token)


@contextlib.contextmanager
def assumed_routing(imbalance: float) -> Iterator[None]:
    """Inside the block, simulated dispatches assume the busiest expert gets ``imbalance`` x the mean."""
    if not imbalance >= 1.0:
        raise ValueError(f"assumed_routing: the imbalance is the busiest expert's rows over the mean, >= 1; "
                         f"got {imbalance}")
    token = _IMBALANCE.set(imbalance)
    try:
        yield
    finally:
        _IMBALANCE.reset(token)
