"""The one exception type of shardwise.checkpoint.

Every failure of ``save``, ``load`` and ``consolidate`` (bad input, a missing or damaged
checkpoint, a mismatch with the target) is a ``CheckpointError`` whose message names what is
wrong: the key, the file, the rank. In a distributed run every rank raises the same message.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, loaded or consolidated; the message says why."""
