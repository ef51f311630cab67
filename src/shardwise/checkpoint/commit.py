"""Atomic commit of a checkpoint directory, and finding the committed one to read.

A save writes everything under ``<path>.tmp-<token>`` (same parent, so renames stay on one
file system), fsyncs the files, writes ``metadata.json`` last, fsyncs it and the directory,
then commits with renames on rank 0:

1. if ``<path>`` holds a previous checkpoint, rename it to ``<path>.old-<token>``;
2. rename ``<path>.tmp-<token>`` to ``<path>`` and fsync the parent directory;
3. remove ``<path>.old-<token>``.

A crash before step 2 leaves ``<path>`` untouched (the tmp directory is garbage that the next
save removes). Between steps 1 and 2 ``<path>`` is briefly missing: ``committed_dir`` then
returns the previous checkpoint from ``<path>.old-<token>``, and the next save moves it back
first. A directory is a checkpoint only if it holds ``metadata.json``, so a half-written one is
never read.

Crash tests kill a process at named points of this sequence: set
``SHARDWISE_CHECKPOINT_KILL_AT=<point>`` (or ``<point>@<rank>``) and the process that reaches it
SIGKILLs itself; ``<point>[@<rank>]:INT`` sends SIGINT instead (a Ctrl-C: KeyboardInterrupt
raised there). Unset, the check costs one environment lookup.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import uuid

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import METADATA_FILE
from shardwise.checkpoint.safetensors_io import fsync_file

__all__ = [
    "KILL_ENV", "fault_point", "new_token", "tmp_dir", "prepare", "commit", "committed_dir", "discard",
]

KILL_ENV = "SHARDWISE_CHECKPOINT_KILL_AT"


def fault_point(name: str, rank: int) -> None:
    """SIGKILL (or SIGINT) this process if ``$SHARDWISE_CHECKPOINT_KILL_AT`` names this point (crash tests)."""
    wanted = os.environ.get(KILL_ENV)
    if not wanted:
        return
    where, _, how = wanted.partition(":")
    if where in (name, f"{name}@{rank}"):
        # raise_signal, not kill(getpid()): a process-directed signal may be taken by another
        # thread (gloo's) and reach the interpreter only after the save has gone on.
        signal.raise_signal(signal.SIGINT if how == "INT" else signal.SIGKILL)


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def tmp_dir(path: str, token: str) -> str:
    return f"{path}.tmp-{token}"


def _aside_dir(path: str, token: str) -> str:
    return f"{path}.old-{token}"


def _is_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, METADATA_FILE))


def _asides(path: str) -> list[str]:
    return sorted(d for d in glob.glob(glob.escape(path) + ".old-*") if _is_checkpoint(d))


def prepare(path: str) -> str:
    """Rank 0, before a save: check ``path`` may be replaced, tidy up, create the tmp dir.

    Returns the token naming this save's tmp directory.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"cannot save a checkpoint to {path}: it exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path) and not _is_checkpoint(path):
        raise CheckpointError(
            f"cannot save a checkpoint to {path}: the directory is not empty and holds no "
            f"{METADATA_FILE}, so it is not a checkpoint; refusing to replace it"
        )
    _restore_aside(path)
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    token = new_token()
    os.makedirs(tmp_dir(path, token))
    return token


def _restore_aside(path: str) -> None:
    """Undo a commit cut between its two renames: put the previous checkpoint back."""
    asides = _asides(path)
    if asides and not os.path.exists(path):
        os.rename(asides[-1], path)
        fsync_file(os.path.dirname(os.path.abspath(path)))


def commit(path: str, token: str, rank: int) -> None:
    """Make the complete ``<path>.tmp-<token>`` the checkpoint at ``path`` (rank 0)."""
    tmp, aside = tmp_dir(path, token), _aside_dir(path, token)
    parent = os.path.dirname(os.path.abspath(path))
    fsync_file(tmp)
    fault_point("before_commit", rank)
    if os.path.exists(path):
        os.rename(path, aside)
        fault_point("between_renames", rank)
    os.rename(tmp, path)
    fsync_file(parent)
    fault_point("after_commit", rank)
    shutil.rmtree(aside, ignore_errors=True)


def discard(path: str, token: str) -> None:
    """Remove the tmp directory of a failed save."""
    shutil.rmtree(tmp_dir(path, token), ignore_errors=True)


def committed_dir(path: str) -> str:
    """The directory holding the committed checkpoint saved to ``path``.

    Raises:
        CheckpointError: nothing was ever committed there.
    """
    if _is_checkpoint(path):
        return path
    if not os.path.exists(path):
        asides = _asides(path)
        if asides:
            return asides[-1]
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}: it is a file (safetensors files must end in .safetensors)")
    raise CheckpointError(f"no checkpoint at {path}: the directory has no {METADATA_FILE} (not a committed checkpoint)")
