"""How a worker of a distributed job ends: promptly, once, with one line naming its rank.

A rank that stops while its peers wait in a collective leaves them waiting until the
collective timeout; one that waits on its way out (a barrier in a ``finally``, a process-group
teardown) hangs with them. So a worker never waits on the way out of a failure:

* its own exception (a bug, out of memory): the traceback once, each line prefixed with the
  rank (the first rank to fail prints it; ranks failing after it print one line), a report for
  the launcher, exit status 1 at once (``os._exit``: no barrier, no teardown that can block);
* a collective that timed out (``comm.CollectiveTimeout``): its one-line diagnosis, status 1;
* a collective cut short because a peer went away (``comm.PeerLost``): a consequence, not a
  cause, so it prints nothing and waits to be stopped by the launcher (which reports the
  peer's failure); without a launcher it says so in one line after a few seconds, status 1;
* SIGINT (Ctrl-C, forwarded by shardwise's launcher or torchrun): rank 0 prints one line
  (``interrupted at step 5``; the job says where it is through ``interrupt_context``), every
  rank exits with status 130 within milliseconds, even while blocked inside a collective;
* SIGTERM (a launcher stopping the survivors of a failure, or forwarding a termination):
  status 143; rank 0 prints one line unless a failure was reported (then it is noise).

Signals are handled by a watcher thread woken through ``signal.set_wakeup_fd``: Python runs
signal handlers only between bytecodes of the main thread, which never happens while that
thread waits inside a gloo collective.

Reports: a failing rank writes the torchelastic error file (``$TORCHELASTIC_ERROR_FILE``, read
by ``shardwise.launch.launcher`` and by torchrun) with its line, kind and time, and posts the line to the
job's store (``shardwise/failed``) so that peers stopped afterwards know a failure, not a user,
stopped them.

``under_launcher`` and ``close_process_group`` live here, the worker's side of the job; the
launcher imports this module (never the other way round).
"""

from __future__ import annotations

import enum
import json
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator, NoReturn

__all__ = ["Ending", "run_worker", "exit_status", "under_launcher", "close_process_group", "end_with_failure", "interrupt_context",
           "handle_signals", "restart_count", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "REPORT_KEY", "FAILED_KEY"]

EXIT_FAILED = 1
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: what a shell reports for Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
PEER_LOST_WAIT_S = 5.0  # a launcher stops the survivors of a failure well within this
REPORT_KEY = "shardwise"  # our part of the torchelastic error file
LAUNCHER_PID_ENV = "SHARDWISE_LAUNCHER_PID"  # set by shardwise.launch for its workers
RESTART_COUNT_ENV = "SHARDWISE_RESTART_COUNT"  # shardwise.launch: which restart the workers are (0: the first start)
MAX_RESTARTS_ENV = "SHARDWISE_MAX_RESTARTS"  # shardwise.launch: restarts allowed in all
# What init_process_group's env:// rendezvous needs; torchrun, torch's elastic agent and
# shardwise.launch.launcher set them all (and more: LOCAL_RANK, TORCHELASTIC_RUN_ID).
_WORKER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FAILED_KEY = "shardwise/failed"  # in the job's store: the first failure's line


class Ending(enum.Enum):
    """Why a worker ends early (the ``kind`` of its report)."""

    ERROR = "error"  # its own exception: the root cause
    TIMEOUT = "timeout"  # a collective timed out: names who did not arrive
    INTERRUPTED = "interrupted"  # SIGINT
    TERMINATED = "terminated"  # SIGTERM
    VERDICT = "verdict"  # the program returned a non-zero status, having said why
    PEER_LOST = "peer_lost"  # a consequence of another rank's end


class _State:
    """This process's ending (set once) and the installed signal handling."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: a signal handler may run inside _claim
        self.stopping = threading.Lock()  # held by the thread acting on a signal
        self.ending: Ending | None = None
        self.where: Callable[[], str] = lambda: ""
        self.depth = 0
        self.saved: tuple | None = None  # previous handlers, wakeup fd, our pipe and thread


_STATE = _State()


# ---------------------------------------------------------------------- who and where
def under_launcher() -> bool:
    """True in a worker started by torchrun, torch's elastic agent or ``shardwise.launch.launcher``.

    Decided from the whole set of variables ``init_process_group``'s env:// rendezvous needs
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which every launcher sets together: a stray
    ``LOCAL_RANK`` or ``RANK`` left in a user's shell does not make a process a worker.
    """
    return all(os.environ.get(name) for name in _WORKER_ENV)


def restart_count() -> tuple[int, int]:
    """(which restart this worker's job is, restarts allowed): (0, 0) without a launcher.

    shardwise's launcher restarts by launching again (``$SHARDWISE_RESTART_COUNT``, its
    ``LAUNCHER_PID_ENV`` set); torchrun's agent restarts its worker group itself and says so in
    ``$TORCHELASTIC_RESTART_COUNT`` / ``$TORCHELASTIC_MAX_RESTARTS``.
    """
    if not under_launcher():
        return 0, 0
    ours = os.environ.get(LAUNCHER_PID_ENV) and RESTART_COUNT_ENV in os.environ
    names = (RESTART_COUNT_ENV, MAX_RESTARTS_ENV) if ours else ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
    count, most = (int(os.environ.get(name) or 0) for name in names)
    return count, most


def _rank() -> int:
    """This process's global rank (0 for a process that is not a launched worker)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ["RANK"]) if under_launcher() else 0


def _claim(ending: Ending) -> bool:
    """Make ``ending`` this process's ending unless another one got there first."""
    with _STATE.lock:
        if _STATE.ending is not None:
            return False
        _STATE.ending = ending
        return True


def _flush() -> None:
    """Flush what the program printed (``os._exit`` does not)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
            pass


def _say(text: str) -> None:
    """Write ``text`` to stderr at once, after what the program printed (raw fd: the main
    thread may hold the Python-level lock of sys.stderr)."""
    _flush()
    os.write(2, (text.rstrip("\n") + "\n").encode("utf-8", "replace"))


# ---------------------------------------------------------------------- reports
def _write_report(ending: Ending, line: str, details: str = "", first: bool = False) -> None:
    """The torchelastic error file (when a launcher asked for one) with our line and kind;
    ``first``: this rank's failure was the job's first (it won the post in the store)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {
        "message": {"message": line, "extraInfo": {"py_callstack": details or line, "timestamp": str(int(now))}},
        REPORT_KEY: {"kind": ending.value, "line": line, "rank": _rank(), "time": now, "first": first},
    }
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:  # atomically: the agent parses whatever it finds once the process is gone
        with open(partial, "w") as f:
            json.dump(data, f)
        os.replace(partial, path)
    except OSError:
        pass  # the launcher then reports the exit status instead


def _post_failure(line: str) -> bool:
    """Post ``line`` as the job's failure; True if it is the first one (or nobody can tell)."""
    from shardwise.comm.stall import job_store

    store = job_store()
    if store is None:
        return True
    try:
        return store.compare_set(FAILED_KEY, "", line).decode("utf-8", "replace") == line
    except Exception:  # noqa: BLE001 - store gone: its host ended
        return True


def _failure_posted() -> bool:
    """Whether some rank reported a failure (unknown counts as yes: stay quiet)."""
    from shardwise.comm.stall import job_store

    store = job_store()
    try:
        return store is None or store.check([FAILED_KEY])
    except Exception:  # noqa: BLE001
        return True


# ---------------------------------------------------------------------- failures
def end_with_failure(exc: BaseException) -> NoReturn:
    """End this process for ``exc`` as the module docstring says; never returns."""
    from shardwise.comm import CollectiveTimeout, PeerLost

    cause = _find(exc, (CollectiveTimeout, PeerLost))
    if isinstance(cause, PeerLost):
        _await_stop(cause)
    lost = _peer_gone(exc)  # a collective issued outside shardwise.comm (torch's, a user's)
    if cause is None and lost is not None:
        _await_stop(lost)
    if isinstance(exc, KeyboardInterrupt):
        _stop_for_signal(signal.SIGINT)
    if isinstance(cause, CollectiveTimeout):
        _claim(Ending.TIMEOUT)
        line = str(cause)
        _write_report(Ending.TIMEOUT, line, _format(exc), first=_post_failure(line))
        _say(f"[rank {_rank()}] {line}")
        os._exit(EXIT_FAILED)
    _claim(Ending.ERROR)
    rank = _rank()
    line = f"rank {rank}: {_one_line(exc)}"
    first = _post_failure(line)
    _write_report(Ending.ERROR, line, _format(exc), first=first)
    if first:
        _say("".join(f"[rank {rank}] {row}\n" for row in _format(exc).splitlines()))
    else:
        _say(f"[rank {rank}] {_one_line(exc)} (after another rank failed)")
    os._exit(EXIT_FAILED)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then the exceptions it was raised from / during, each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        yield exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__


def _find(exc: BaseException, types: tuple) -> BaseException | None:
    """``exc`` or the first exception it was raised from / during that is one of ``types``."""
    return next((e for e in _chain(exc) if isinstance(e, types)), None)


def _peer_gone(exc: BaseException) -> BaseException | None:
    """``exc`` or one it was raised from / during whose message says a peer's connection went
    away (gloo's "Connection reset by peer"...): a consequence of another rank's end."""
    from shardwise.comm.errors import classify

    return next((e for e in _chain(exc) if classify(str(e)) == "peer"), None)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# Frames of the machinery that runs a worker's program, left out of its traceback.
_MACHINERY = (__file__, os.path.join(os.path.dirname(__file__), "launcher.py"), "<frozen runpy>")


def _format(exc: BaseException) -> str:
    """The traceback, starting at the program's own frames."""
    report = traceback.TracebackException.from_exception(exc)
    frames = list(report.stack)
    while len(frames) > 1 and frames[0].filename in _MACHINERY:
        frames.pop(0)
    report.stack = traceback.StackSummary.from_list(frames)
    return "".join(report.format())


def _await_stop(cause: BaseException) -> NoReturn:
    """A peer went away: stay silent until the launcher stops this rank (SIGTERM); if none does,
    say what happened in one line."""
    _claim(Ending.PEER_LOST)
    deadline = time.monotonic() + PEER_LOST_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
    line = str(cause)
    _write_report(Ending.PEER_LOST, line)
    _say(f"[rank {_rank()}] {line} (no launcher stopped this rank)")
    os._exit(EXIT_FAILED)


# ---------------------------------------------------------------------- signals
def _stop_for_signal(signum: int) -> None:
    """SIGINT/SIGTERM: end now (one line from rank 0), unless this process is already ending.

    Runs in the watcher thread and, when the main thread runs bytecode, in the Python-level
    handler too: the first to arrive acts, the other returns.
    """
    if not _STATE.stopping.acquire(blocking=False):
        return
    interrupt = signum == signal.SIGINT
    status = EXIT_INTERRUPTED if interrupt else EXIT_TERMINATED
    with _STATE.lock:
        ending = _STATE.ending
        if ending is None:
            _STATE.ending = Ending.INTERRUPTED if interrupt else Ending.TERMINATED
    if ending is not None and ending is not Ending.PEER_LOST:
        _STATE.stopping.release()
        return  # a failure report is under way in the main thread; it exits right after
    if ending is Ending.PEER_LOST:  # the launcher stops the survivors of a failure it reports
        _write_report(Ending.PEER_LOST, f"rank {_rank()}: stopped after a peer was lost")
        os._exit(status)
    rank, where = _rank(), _where()
    line = ("interrupted" if interrupt else "terminated (SIGTERM)") + (f" {where}" if where else "")
    _write_report(Ending.INTERRUPTED if interrupt else Ending.TERMINATED, f"rank {rank}: {line}")
    if interrupt:
        _post_failure(f"rank {rank}: {line}")
    if rank == 0 and (interrupt or not _failure_posted()):
        _say(line)
    _flush()
    os._exit(status)


def _where() -> str:
    try:
        return _STATE.where()
    except Exception as err:  # noqa: BLE001 - the line must still come out
        return f"(position unknown: {type(err).__name__})"


def _on_signal(signum: int, frame) -> None:
    """Python-level handler (main thread, when it runs bytecode): same as the watcher."""
    _stop_for_signal(signum)


def _watch(read_fd: int) -> None:
    """Wake on every signal Python sees (the wakeup fd gets its number); act on ours."""
    while True:
        try:
            data = os.read(read_fd, 1)
        except OSError:
            return
        if not data or data == b"\0":
            return
        if data[0] in (signal.SIGINT, signal.SIGTERM):
            _stop_for_signal(data[0])


def _install() -> tuple:
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    watcher = threading.Thread(target=_watch, args=(read_fd,), daemon=True, name="shardwise-signals")
    watcher.start()
    return old, old_fd, read_fd, write_fd, watcher


def _uninstall(saved: tuple) -> None:
    old, old_fd, read_fd, write_fd, watcher = saved
    for s, handler in old.items():
        signal.signal(s, handler)
    signal.set_wakeup_fd(old_fd)
    os.write(write_fd, b"\0")
    watcher.join(timeout=1.0)
    os.close(write_fd)
    os.close(read_fd)


@contextmanager
def handle_signals() -> Iterator[None]:
    """While inside, SIGINT/SIGTERM end this process at once (see the module docstring).

    Only the main thread can install signal handling; elsewhere this does nothing. Nested uses
    share one installation; the previous handlers come back when the outermost one exits.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _STATE.depth == 0:
        _STATE.saved = _install()
    _STATE.depth += 1
    try:
        yield
    finally:
        _STATE.depth -= 1
        if _STATE.depth == 0:
            _uninstall(_STATE.saved)
            _STATE.saved = None


@contextmanager
def interrupt_context(where: Callable[[], str]) -> Iterator[None]:
    """Handle signals; an interruption's line is ``interrupted <where()>``.

    ``where`` runs in the watcher thread when the signal arrives: it should read state the
    job keeps up to date (e.g. ``at step 5``), not compute or communicate.

    Example:
        >>> with interrupt_context(lambda: f"at step {progress.step}"):
        ...     train()
    """
    previous = _STATE.where
    _STATE.where = where
    try:
        with handle_signals():
            yield
    finally:
        _STATE.where = previous


# ---------------------------------------------------------------------- a worker's life
def close_process_group() -> None:
    """Tear the default process group down once every rank is done with it.

    The barrier first matters: a rank that destroys its gloo connections (or exits) while a
    peer is still finishing its last collective can abort the peer at exit ("terminate called
    without an active exception"). Call it on the success path only: after an error, a rank
    waiting here for a peer that will never come would hang the job (the launcher stops the
    other workers instead).
    """
    import torch.distributed as dist

    from shardwise import comm

    if dist.is_initialized():
        comm.barrier()
        dist.destroy_process_group()


def run_worker(main: Callable[[], int | None]) -> NoReturn:
    """Run a launched worker's ``main`` and end the process.

    Success (``main`` returns 0 or None): the process group, if still open, is closed (barrier,
    then teardown) and the process exits 0. A non-zero status is a verdict the program already
    printed: reported as such (the launcher stays quiet) and exited at once. An exception or a
    signal ends it as the module docstring says.
    """
    with handle_signals():
        try:
            status = _status_of(main)
        except BaseException as exc:  # noqa: BLE001 - every way out is reported once
            end_with_failure(exc)
        if status != 0:
            _claim(Ending.VERDICT)
            _write_report(Ending.VERDICT, f"rank {_rank()}: exited with status {status}")
            _flush()
            os._exit(status)
        try:
            close_process_group()
        except BaseException as exc:  # noqa: BLE001
            end_with_failure(exc)
    # Out without interpreter teardown: gloo objects still referenced at shutdown (cached
    # groups) are destroyed in an order that can abort a finished, successful worker with
    # "terminate called without an active exception" (seen in CI: exit status 134).
    _flush()
    os._exit(0)


def _status_of(main: Callable[[], int | None]) -> int:
    """``main()``'s exit status, ``sys.exit`` included."""
    try:
        return int(main() or 0)
    except SystemExit as stop:
        return exit_status(stop)


def exit_status(stop: SystemExit) -> int:
    """The status ``sys.exit(code)`` ends a process with: an int as is, None as 0, anything else
    printed to stderr and status 1, as Python does."""
    if stop.code is None or isinstance(stop.code, int):
        return int(stop.code or 0)
    print(stop.code, file=sys.stderr, flush=True)
    return EXIT_FAILED
