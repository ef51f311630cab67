"""One training run per checkpoint directory: an exclusive lock held for the whole run.

Two runs saving to one ``--checkpoint-dir`` would overwrite each other's ``step-<N>``
checkpoints, and every save first removes the leftover ``step-<N>.tmp-*`` directories of its
path (``shardwise.checkpoint.commit.prepare``), which could be another run's save in progress.
So a run holds ``<dir>/.lock`` from before its first step to its end, and a second run is
refused before it trains, with the holder named.

The lock is ``flock(2)``: the kernel drops it when the holding process ends, however it ends
(an exception, SIGKILL, a power cut on a local disk), so a crashed run never leaves a lock that
blocks the next one; the file itself stays and is reused. Its content (pid, host, start time,
the launcher's run id) only names the holder in the refusal.

Who holds it: the process that validated the job (``shardwise.train`` without torchrun: the
launching process, or the only process), else rank 0 of a torchrun job. A job's own workers
recognise their holder (their parent process, or a rank of the same launcher run) and neither
refuse nor take the lock again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from shardwise.launch.worker import LAUNCHER_PID_ENV

__all__ = ["LOCK_FILE", "Holder", "RunLockError", "DirectoryInUse", "RunLock", "live_holder", "check_not_in_use", "hold_for_run"]

LOCK_FILE = ".lock"
_RETRIES = 5  # a probe (``live_holder``) holds a shared lock for microseconds: retry past it
_RETRY_WAIT_S = 0.02


class RunLockError(RuntimeError):
    """The lock cannot be taken or probed (permissions, a file system without flock)."""


class DirectoryInUse(RunLockError):
    """Another live run holds the directory's lock; the message names it."""


@dataclass(frozen=True, slots=True)
class Holder:
    """The process holding a directory's lock, as its lock file records it (pid 0: unknown)."""

    pid: int
    host: str
    since: float
    run_id: str | None = None

    def describe(self) -> str:
        if not self.pid:
            return "a process that has not recorded itself yet"
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host}, since {started}"

    def is_this_job(self) -> bool:
        """This process, its launching process, or a rank of the same launcher run."""
        launcher = int(os.environ.get(LAUNCHER_PID_ENV) or -1)
        here = self.host == socket.gethostname() and self.pid in (os.getpid(), os.getppid(), launcher)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        return here or (self.run_id is not None and self.run_id == run_id)


def _lock_path(directory: str) -> str:
    return os.path.join(directory, LOCK_FILE)


def _read_holder(path: str) -> Holder:
    """The holder recorded in ``path``; an unknown one if it is being written or unreadable."""
    try:
        with open(path) as f:
            record = json.load(f)
        return Holder(int(record["pid"]), str(record["host"]), float(record["since"]), record.get("run_id"))
    except (OSError, ValueError, KeyError, TypeError):
        return Holder(0, "?", 0.0)


def _try_flock(fd: int, mode: int) -> bool:
    """Take ``mode`` without waiting; False if another open file holds a conflicting lock."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def live_holder(directory: str) -> Holder | None:
    """The live process holding ``directory``'s lock, or None (no lock file, or a stale one).

    Takes nothing: a shared lock for an instant, to learn whether an exclusive one is held.
    """
    path = _lock_path(directory)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise _cannot(directory, err) from None
    try:
        if _try_flock(fd, fcntl.LOCK_SH):
            return None
    except OSError as err:
        raise _cannot(directory, err) from None
    finally:
        os.close(fd)  # closing drops the probe's shared lock
    return _read_holder(path)


def _cannot(directory: str, err: OSError) -> RunLockError:
    return RunLockError(f"--checkpoint-dir {directory!r}: cannot use the run lock {_lock_path(directory)}: "
                        f"{type(err).__name__}: {err}")


def _in_use(directory: str, holder: Holder) -> DirectoryInUse:
    return DirectoryInUse(
        f"--checkpoint-dir {directory!r} is in use by another run ({holder.describe()}; lock file "
        f"{_lock_path(directory)}): two runs in one directory overwrite each other's checkpoints; wait for "
        f"that run to end, or use another directory"
    )


class RunLock:
    """The exclusive lock on ``directory`` (created if missing) while the ``with`` block runs."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and record this process in it; ``DirectoryInUse`` if a live run holds it."""
        try:
            self._fd = self._take()
        except OSError as err:
            raise _cannot(self.directory, err) from None

    def _take(self) -> int:
        os.makedirs(self.directory, exist_ok=True)
        path = _lock_path(self.directory)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for _ in range(_RETRIES):
                if _try_flock(fd, fcntl.LOCK_EX):
                    break
                time.sleep(_RETRY_WAIT_S)
            else:
                raise _in_use(self.directory, _read_holder(path))
            record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                      "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a process opening it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_not_in_use(directory: str) -> None:
    """Raise ``DirectoryInUse`` if a live run other than this job holds ``directory``."""
    holder = live_holder(directory)
    if holder is not None and not holder.is_this_job():
        raise _in_use(directory, holder)


@contextmanager
def hold_for_run(directory: str) -> Iterator[None]:
    """Hold ``directory``'s lock for the block, unless this job's launching process holds it already."""
    holder = live_holder(directory)
    if holder is not None and holder.is_this_job():
        yield
        return
    with RunLock(directory):
        yield
