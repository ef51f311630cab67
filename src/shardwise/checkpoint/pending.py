"""The save in flight: ``AsyncSave`` (the future ``async_save`` returns) and the wait for it.

Apart from ``asynchronous`` so that ``save`` can wait for an asynchronous save without
importing the module that builds on ``save``'s steps. One save is in flight per process;
only the thread that calls the saves touches ``PENDING``.
See docs/checkpoints.md, "Asynchronous saves, retention and bad storage".
"""

from __future__ import annotations

import threading
from typing import Callable

from shardwise.checkpoint.errors import CheckpointError

__all__ = ["AsyncSave", "PENDING", "wait_for_pending_save"]


class AsyncSave:
    """The future of one ``async_save``: ``done()``, and ``result()`` to wait and see its error."""

    def __init__(self, path: str, work: Callable[[], None], cleanup: Callable[[], None]) -> None:
        self.path = path
        self._work, self._cleanup = work, cleanup
        self._error: CheckpointError | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._run, name="shardwise-checkpoint-writer")
        self._thread.start()

    def _run(self) -> None:
        try:
            self._work()
        except Exception as err:  # noqa: BLE001 - kept for result(); the thread must not die loudly
            self._cleanup()
            message = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
            self._error = CheckpointError(f"asynchronous save to {self.path} failed: {message}")

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the save; raise its ``CheckpointError`` if it failed (on every rank).

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            CheckpointError: the save failed; the previous checkpoint at ``path`` is intact.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the asynchronous save to {self.path} is still running after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise CheckpointError(str(self._error))

    def _settle(self) -> None:
        """Wait; raise the error unless ``result()`` already raised it to the caller."""
        self._thread.join()
        if self._error is not None and not self._reported:
            self.result()


PENDING: list[AsyncSave] = []  # the save in flight, if any


def wait_for_pending_save() -> None:
    """Wait for this process's save in flight, if any; raise its error if none was raised yet.

    Raises:
        CheckpointError: the save in flight failed (on every rank, as the save itself would).
    """
    if PENDING:
        PENDING.pop()._settle()
