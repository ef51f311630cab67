"""Accounting of the parameter bytes fully_shard materializes beyond the sharded storage.

Two kinds are counted, in bytes of allocated storage:

* ``unsharded``: storage of gathered (unsharded) parameters, from all-gather until reshard;
* ``staging``: the flat send/receive buffers of the all-gather, alive only around it.

The counters are process-wide and always kept (two integer additions per event); a
``UnshardedMemory`` context records their peaks while it is open.
"""

from __future__ import annotations

__all__ = ["UnshardedMemory", "note_alloc", "note_free", "live_bytes"]

_LIVE = {"unsharded": 0, "staging": 0}
_TRACKERS: list["UnshardedMemory"] = []


def live_bytes(kind: str = "unsharded") -> int:
    """Bytes of ``kind`` allocated right now in this process."""
    return _LIVE[kind]


def note_alloc(kind: str, nbytes: int) -> None:
    """Record that ``nbytes`` of ``kind`` storage were just allocated."""
    _LIVE[kind] += nbytes
    for tracker in _TRACKERS:
        tracker._observe()


def note_free(kind: str, nbytes: int) -> None:
    """Record that ``nbytes`` of ``kind`` storage were just released."""
    _LIVE[kind] -= nbytes


class UnshardedMemory:
    """Peak gathered-parameter bytes on this rank while the context is open.

    Example:
        >>> with UnshardedMemory() as mem:
        ...     model(x).sum().backward()
        >>> mem.peak_bytes              # gathered parameter storage at its highest
        >>> mem.peak_bytes_with_staging # the same plus the all-gather buffers alive then
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.peak_bytes_with_staging = 0

    def _observe(self) -> None:
        self.peak_bytes = max(self.peak_bytes, _LIVE["unsharded"])
        self.peak_bytes_with_staging = max(self.peak_bytes_with_staging, _LIVE["unsharded"] + _LIVE["staging"])

    def __enter__(self) -> "UnshardedMemory":
        _TRACKERS.append(self)
        self._observe()
        return self

    def __exit__(self, *exc) -> None:
        _TRACKERS.remove(self)
