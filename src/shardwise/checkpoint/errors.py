"""The one exception type of shardwise.checkpoint.

Every failure of ``save``, ``load`` and ``consolidate`` (bad input, a missing or damaged
checkpoint, a mismatch with the target) is a ``CheckpointError`` whose message names what is
wrong: the key, the file, the rank. In a distributed run every rank raises the same message.
"""

from __future__ import annotations

import errno

__all__ = ["CheckpointError", "storage_error"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, loaded or consolidated; the message says why."""


def storage_error(action: str, path: str, err: OSError) -> str:
    """``cannot write checkpoint file ckpt/__1.safetensors: No space left on device (ENOSPC)``:
    the path and the cause of a failed file operation, without Python's exception noise."""
    cause = err.strerror or str(err) or type(err).__name__
    code = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
    return f"cannot {action} {path}: {cause}" + (f" ({code})" if code else "")
