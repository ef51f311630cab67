"""Who is told about each collective: the recorders (``shardwise.debug.CommDebugMode`` is one).

A recorder sees every collective issued from this process through ``shardwise.comm`` (kind,
mesh, mesh axis, bytes this rank sends), and the point-to-point sends that other code reports
with ``record_send``. Recording is how tests count collectives as well as values (docs/concepts.md, "The names").
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Iterator, Protocol

if TYPE_CHECKING:
    from shardwise.core.mesh import DeviceMesh

__all__ = ["CommRecorder", "add_recorder", "remove_recorder", "record_send", "recording", "per_peer_bytes",
           "sending_per_peer"]


class CommRecorder(Protocol):
    def record(self, kind: str, mesh: "DeviceMesh", axis: int, bytes_sent: int) -> None: ...


# The issuing path (``shardwise.comm.issue``) iterates this very list on every collective.
_RECORDERS: list[CommRecorder] = []


def add_recorder(recorder: CommRecorder) -> None:
    """Start telling ``recorder`` about every collective issued from this process."""
    _RECORDERS.append(recorder)


def remove_recorder(recorder: CommRecorder) -> None:
    _RECORDERS.remove(recorder)


def recording() -> bool:
    """Whether any recorder is listening (code that only feeds recorders can skip its work)."""
    return bool(_RECORDERS)


def record_send(kind: str, mesh: "DeviceMesh", axis: int, nbytes: int) -> None:
    """Tell the recorders about a point-to-point send issued outside ``shardwise.comm`` (a
    pipeline stage's activations or gradients, which torch.distributed.pipelining sends itself)."""
    for recorder in _RECORDERS:
        recorder.record(kind, mesh, axis, nbytes)


# The bytes this rank sends each peer in the collective being issued, when they differ per peer.
_PER_PEER: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("shardwise_per_peer", default=None)


def per_peer_bytes() -> list[int] | None:
    """Inside a recorder's ``record`` for an all_to_all with counts per peer (``all_to_all_counts``:
    expert-parallel dispatch and combine, redistribute exchanges): the bytes this rank sends each
    peer of the axis, its own entry 0; else None."""
    return _PER_PEER.get()


@contextlib.contextmanager
def sending_per_peer(per_peer: list[int]) -> Iterator[None]:
    """Mark the collective issued inside as sending ``per_peer[s]`` bytes to axis rank s."""
    token = _PER_PEER.set(per_peer)
    try:
        yield
    finally:
        _PER_PEER.reset(token)
