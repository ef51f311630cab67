"""CommDebugMode: count the collectives shardwise issues, with the bytes this rank sends."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from shardwise import comm
from shardwise.mesh import DeviceMesh

__all__ = ["CommDebugMode", "CommRecord"]


@dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective: its kind, the mesh axis it ran on, and the bytes this rank sent."""

    kind: str
    mesh: DeviceMesh
    axis: int
    bytes_sent: int

    def __str__(self) -> str:
        return f"{self.kind} on {self.mesh.axis_name(self.axis)} ({self.bytes_sent} B)"


class CommDebugMode:
    """Context manager recording every collective issued inside it, on this rank.

    Example:
        >>> with CommDebugMode() as comms:
        ...     dt.redistribute(mesh, [Replicate()])
        >>> comms.get_comm_counts()
        {'all_gather': 1}
        >>> comms.bytes_sent
        96
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def record(self, kind: str, mesh: DeviceMesh, axis: int, bytes_sent: int) -> None:
        self.records.append(CommRecord(kind, mesh, axis, bytes_sent))

    def __enter__(self) -> "CommDebugMode":
        self.records.clear()
        comm.add_recorder(self)
        return self

    def __exit__(self, *exc) -> None:
        comm.remove_recorder(self)

    def get_comm_counts(self) -> dict[str, int]:
        """Number of collectives of each kind."""
        return dict(Counter(r.kind for r in self.records))

    def get_total_counts(self) -> int:
        return len(self.records)

    @property
    def bytes_sent(self) -> int:
        """Total bytes this rank sent."""
        return sum(r.bytes_sent for r in self.records)

    def summary(self) -> str:
        """One line per collective, in issue order."""
        return "\n".join(map(str, self.records)) or "no collectives"
