"""Who is told about each collective: the recorders (``shardwise.debug.CommDebugMode`` is one).

A recorder sees every collective issued from this process through ``shardwise.comm`` (kind,
mesh, mesh axis, bytes this rank sends), and the point-to-point sends that other code reports
with ``record_send``. Recording is how tests count collectives as well as values (docs/concepts.md, "The names").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from shardwise.core.mesh import DeviceMesh

__all__ = ["CommRecorder", "add_recorder", "remove_recorder", "record_send", "recording"]


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
