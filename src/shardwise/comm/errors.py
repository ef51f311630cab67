"""What a failed collective raises, and how gloo's messages are read.

Every collective shardwise issues is named by a ``CollectiveCall`` (kind, #seq on its group,
mesh axis, group ranks, bytes). A collective that does not complete in time raises
``CollectiveTimeout`` (with the ranks that did not arrive, ``shardwise.comm.stall``); one cut
short because a peer process went away raises ``PeerLost``; any other backend error is
re-raised as it came (docs/failures.md, "When something goes wrong"). Pure: no process group is touched here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from shardwise.units import format_bytes

__all__ = ["CollectiveCall", "CollectiveError", "CollectiveTimeout", "PeerLost", "classify"]


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One collective as this rank issued it: what the failure messages name."""

    kind: str
    seq: int  # 1 for the first collective this rank issued on the group, 2 for the next...
    group_ranks: tuple[int, ...]
    axis: str | None  # the mesh axis name; None for the whole world (barrier)
    nbytes: int

    def describe(self) -> str:
        """E.g. ``all_reduce #12 over mesh axis 'dp' (ranks [0, 1], 16 B)``."""
        where = f"mesh axis {self.axis!r}" if self.axis is not None else "all ranks"
        return f"{self.kind} #{self.seq} over {where} (ranks {list(self.group_ranks)}, {format_bytes(self.nbytes)})"

    def key(self) -> tuple:
        """What two ranks must agree on to be in the same collective."""
        return (self.kind, self.seq, self.group_ranks)


class CollectiveError(RuntimeError):
    """A collective issued by shardwise failed; ``call`` says which."""

    def __init__(self, message: str, call: CollectiveCall, rank: int) -> None:
        super().__init__(message)
        self.call = call
        self.rank = rank


class CollectiveTimeout(CollectiveError):
    """The collective did not complete in time; ``missing`` are the ranks that did not arrive
    (None when they could not be determined)."""

    def __init__(self, message: str, call: CollectiveCall, rank: int, missing: tuple[int, ...] | None) -> None:
        super().__init__(message, call, rank)
        self.missing = missing


class PeerLost(CollectiveError):
    """A peer's connection closed mid-collective: it exited or crashed (its own report names why)."""


# gloo's wording (torch 2.6-2.13): "Timed out waiting 5000ms for recv operation to complete", or,
# when the timeout closed the connection first, "Application timeout caused pair closure"; a peer
# that exits: "Connection closed by peer", or a reset / broken pipe on the socket.
_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms|timed out after|Timeout waiting|timeout caused pair closure",
                        re.IGNORECASE)
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket closed",
                        re.IGNORECASE)


def classify(message: str) -> Literal["timeout", "peer"] | None:
    """What a backend error message says happened: a timeout, a lost peer, or neither (None)."""
    if _PEER_GONE.search(message):
        return "peer"
    if _TIMED_OUT.search(message):
        return "timeout"
    return None
