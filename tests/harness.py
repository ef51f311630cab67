"""Multi-process test harness: pools of real worker processes with real gloo process groups.

A pool of world size W is W processes. Each one initializes the default
``torch.distributed`` process group with the gloo backend and then waits for tasks.
Pools are started lazily the first time a test asks for a world size, kept for the
whole pytest session and shut down at the end.

Workers come from a multiprocessing "forkserver" that has imported torch once, so a
pool costs a fork per rank instead of a fresh interpreter importing torch: a 4-rank
pool took ~7 CPU-seconds to start, now ~1 (plus one torch import for the server).
The server also imports shardwise and the trainer (``_FORKSERVER_PRELOAD``), CPU-seconds
that every worker of every pool (re)started in a session would otherwise pay on its first
task; then, after shardwise, Dynamo, Inductor and torch.distributed.tensor, which the compile,
trainer ``--compile`` and interop tests import in each worker of the 2- and 4-rank pools
(about 1.5, 2.3 and 1.2 CPU-seconds per worker, paid once in the server instead). Dynamo
loads after shardwise there, so shardwise's lazy Dynamo markings apply through their import
hook as in a user's process; ``import shardwise`` itself leaving Dynamo unloaded is checked in
a fresh interpreter (tests/test_compile.py, e2e).
``SHARDWISE_TEST_START_METHOD=spawn`` gives every worker a fresh interpreter instead.

Usage from a test (``dist`` is the session-scoped fixture from ``tests/conftest.py``)::

    def _body(shape):                       # module level: pickled by reference
        rank = torch.distributed.get_rank()
        ...
        return local_tensor                 # must be picklable

    def test_something(dist):
        per_rank = dist.run(4, _body, (8, 4))                  # list, rank order
        msgs = dist.run_expect_error(4, _bad, match="mesh")    # every rank must raise

or directly: ``run_distributed(4, _body, (8, 4), timeout=30)``.

Failure handling:

* some rank raises and every rank answers -> ``DistributedTestError`` (an
  ``AssertionError``) naming the function, the failing ranks and their remote
  tracebacks. If only *some* ranks raised, the pool is discarded (it may hold
  unmatched point-to-point traffic) and the next test gets a fresh one.
* some ranks raise and the others do not answer within a grace period
  (``SHARDWISE_TEST_DESYNC_GRACE``, default 5 s): desynchronization; the pool is
  killed and the failure names both the error and the stuck ranks.
* no answer within ``timeout``: the pool is killed, the failure lists the ranks
  still running and their Python stacks (dumped with faulthandler).
* a worker process dies: detected while waiting, the pool is killed and the
  failure reports the exit code / signal.

No hidden collectives are run between tasks. Nothing here imports torch in the
parent process; each worker pins torch's thread counts to 1 before any work.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as _wait_for
from typing import Any, Callable

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedTestError",
    "DistRunner",
    "RemoteError",
    "WorkerPool",
    "get_pool",
    "prestart",
    "resolve_timeout",
    "run_distributed",
    "run_expect_error",
    "shutdown_all",
]

DEFAULT_TIMEOUT = 90.0
TIMEOUT_ENV = "SHARDWISE_TEST_TIMEOUT"
DESYNC_GRACE_ENV = "SHARDWISE_TEST_DESYNC_GRACE"
STARTUP_TIMEOUT_ENV = "SHARDWISE_TEST_STARTUP_TIMEOUT"
START_METHOD_ENV = "SHARDWISE_TEST_START_METHOD"
# Pool launches per world size in this session (first starts, replacements after a failed or
# hung test, startup retries): ``--cpu-durations`` prints them, since each costs a fork and a
# process group per rank, plus every lazy import the new workers make again.
LAUNCHES: dict[int, int] = {}
# Imported once by the forkserver, inherited by every worker it forks (see the module docstring).
_FORKSERVER_PRELOAD = ("torch", "torch.distributed", "shardwise", "shardwise.train.trainer",
                       "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.tensor")
DEFAULT_DESYNC_GRACE = 5.0
DEFAULT_STARTUP_TIMEOUT = 180.0
MAX_WORLD_SIZE = 8
PG_TIMEOUT_S = 60.0  # init_process_group timeout (also the gloo collective timeout)
_STARTUP_ATTEMPTS = 3
_STACK_DUMP_CHARS = 4000

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


# ----------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteError:
    """An exception raised inside a worker, transported as text."""

    rank: int
    type_name: str  # qualified name, e.g. "ValueError"
    type_mro: tuple[str, ...]  # "module.qualname" of every class in the exception's MRO
    message: str  # str(exc)
    traceback: str  # fully formatted remote traceback (including chained exceptions)

    def is_instance_of(self, exc_type: type | tuple[type, ...]) -> bool:
        types = exc_type if isinstance(exc_type, tuple) else (exc_type,)
        return any(f"{t.__module__}.{t.__qualname__}" in self.type_mro for t in types)


class DistributedTestError(AssertionError):
    """A distributed task failed: remote exception(s), hang, desync or dead worker.

    Attributes: ``kind`` ("error", "timeout", "desync", "died", "expectation"),
    ``fn_name``, ``world_size``, ``errors`` (rank -> RemoteError), ``stuck`` (ranks
    that never answered), ``dead`` (rank -> exit code).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        fn_name: str,
        world_size: int,
        errors: dict[int, RemoteError] | None = None,
        stuck: list[int] | None = None,
        dead: dict[int, int | None] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.fn_name = fn_name
        self.world_size = world_size
        self.errors = dict(errors or {})
        self.stuck = list(stuck or [])
        self.dead = dict(dead or {})


class PoolStartupError(RuntimeError):
    """A worker pool could not be started."""


# ----------------------------------------------------------------------------------------
# Configuration helpers
# ----------------------------------------------------------------------------------------


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"environment variable {name}={raw!r} must be > 0")
    return value


def resolve_timeout(timeout: float | None) -> float:
    """``timeout`` if given, else ``$SHARDWISE_TEST_TIMEOUT``, else ``DEFAULT_TIMEOUT``."""
    if timeout is None:
        return _env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    timeout = float(timeout)
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    return timeout


def _desync_grace() -> float:
    return _env_float(DESYNC_GRACE_ENV, DEFAULT_DESYNC_GRACE)


def _startup_timeout() -> float:
    return _env_float(STARTUP_TIMEOUT_ENV, DEFAULT_STARTUP_TIMEOUT)


def _check_world_size(world_size: int) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
    return world_size


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fn_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"functools.partial({_fn_name(fn.func)})"
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def _current_test() -> str | None:
    current = os.environ.get("PYTEST_CURRENT_TEST")
    if not current:
        return None
    return current.rsplit(" (", 1)[0]


def _exit_description(code: int | None) -> str:
    if code is None:
        return "unknown exit status"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ----------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------

_worker_keepalive: list[Any] = []  # objects that must live as long as the worker


def in_worker() -> bool:
    """True inside a harness worker process."""
    return os.environ.get("SHARDWISE_TEST_WORKER") == "1"


def _describe_exception(exc: BaseException, rank: int) -> dict:
    tb_obj = exc.__traceback__
    if tb_obj is not None and tb_obj.tb_frame.f_code is _worker_main.__code__ and tb_obj.tb_next is not None:
        tb_obj = tb_obj.tb_next  # hide the harness's own frame
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, tb_obj))
    except BaseException:  # noqa: BLE001 - a broken __str__ must not kill the worker
        tb = f"<could not format the traceback of a {type(exc).__qualname__}>\n"
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001
        message = f"<str() of a {type(exc).__qualname__} failed>"
    mro = tuple(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__)
    return {
        "rank": rank,
        "type_name": type(exc).__qualname__,
        "type_mro": mro,
        "message": message,
        "traceback": tb,
    }


def _watch_parent() -> None:
    # If the parent disappears while this worker is blocked in a collective, exit instead
    # of lingering until the gloo timeout. The parent is pytest (spawn) or the forkserver,
    # which exits as soon as pytest does; either way the worker is then re-parented.
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def _worker_main(rank: int, world_size: int, port: int, conn, stack_file: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        SHARDWISE_TEST_WORKER="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"

    faulthandler.enable(all_threads=True)  # Python stack on stderr if a worker crashes
    if hasattr(signal, "SIGUSR1"):
        stack_fh = open(stack_file, "w")  # noqa: SIM115 - must stay open for faulthandler
        _worker_keepalive.append(stack_fh)
        faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)
    threading.Thread(target=_watch_parent, daemon=True, name="parent-watch").start()

    def send(obj) -> bool:
        try:
            conn.send_bytes(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))
            return True
        except (OSError, EOFError):
            return False

    try:
        import torch
        import torch.distributed as tdist

        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        tdist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S)
        )
    except BaseException as exc:  # noqa: BLE001
        _flush_std_streams()
        send(("startup_error", _describe_exception(exc, rank)))
        return

    if not send(("ready", os.getpid())):
        return

    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            break  # parent went away
        msg = pickle.loads(raw)
        if msg[0] == "shutdown":
            break
        _, seq, payload = msg
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            try:
                data = pickle.dumps(result, protocol=_PICKLE_PROTOCOL)
            except BaseException as exc:  # noqa: BLE001
                raise TypeError(
                    f"the result of {_fn_name(fn)} on rank {rank} is not picklable "
                    f"({type(result).__qualname__}): {exc}"
                ) from exc
            reply = ("ok", seq, data)
        except BaseException as exc:  # noqa: BLE001 - report everything, incl. SystemExit
            reply = ("error", seq, _describe_exception(exc, rank))
            del exc
        _flush_std_streams()
        if not send(reply):
            break

    try:
        tdist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    _flush_std_streams()
    # Skip interpreter teardown (torch's takes ~0.3 s per process); nothing is left to
    # clean up in a worker.
    os._exit(0)


# ----------------------------------------------------------------------------------------
# Parent side
# ----------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    results: dict[int, Any]
    errors: dict[int, RemoteError]


def _format_errors(errors: dict[int, RemoteError]) -> str:
    """Remote tracebacks, ranks with identical text grouped together."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(errors):
        groups.setdefault(errors[rank].traceback, []).append(rank)
    parts = []
    for tb, ranks in groups.items():
        err = errors[ranks[0]]
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        first_line = err.message.splitlines()[0] if err.message else ""
        parts.append(f"===== {label}: {err.type_name}: {first_line} =====\n{tb.rstrip()}")
    return "\n\n".join(parts)


def _looks_like_comm_failure(err: RemoteError) -> bool:
    if any(name.rsplit(".", 1)[-1] in ("DistError", "DistBackendError", "DistNetworkError") for name in err.type_mro):
        return True
    text = f"{err.message}\n{err.traceback}".lower()
    return "gloo" in text or "connection reset" in text or "connection closed by peer" in text


def _clean_stack_dump(text: str) -> str:
    """Drop the harness's watchdog thread and multiprocessing bootstrap frames."""
    blocks = [b for b in re.split(r"\n\s*\n", text.strip()) if b.strip()]
    kept = []
    for block in blocks:
        if " in _watch_parent" in block:
            continue
        lines = [
            ln
            for ln in block.splitlines()
            if not (f"multiprocessing{os.sep}" in ln or '"<string>"' in ln or " in _worker_main" in ln)
        ]
        kept.append("\n".join(lines))
    text = "\n\n".join(kept)
    if len(text) > _STACK_DUMP_CHARS:
        text = "...\n" + text[-_STACK_DUMP_CHARS:]
    return text


def _start_context() -> multiprocessing.context.BaseContext:
    """The forkserver with torch preloaded (see the module docstring), else spawn."""
    method = os.environ.get(START_METHOD_ENV, "").strip()
    if not method:
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_FORKSERVER_PRELOAD))  # used when the server starts
    return ctx


class WorkerPool:
    """W worker processes sharing one gloo process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = _check_world_size(world_size)
        self._ctx = _start_context()
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._stack_files: list[str] = []
        self._tmpdir: str | None = None
        self._seq = 0
        self.port: int | None = None
        self.state = "new"  # new -> launched -> ready -> dead

    def __repr__(self) -> str:
        return f"WorkerPool(world_size={self.world_size}, state={self.state!r}, pids={self.pids})"

    # -- lifecycle -------------------------------------------------------------------

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        return self.state == "ready" and all(p.is_alive() for p in self._procs)

    def launch(self) -> None:
        """Spawn the W processes without waiting for them (lets pools start in parallel)."""
        if self.state not in ("new", "dead"):
            raise RuntimeError(f"cannot launch {self!r}")
        self._reset()
        self.port = _free_port()
        LAUNCHES[self.world_size] = LAUNCHES.get(self.world_size, 0) + 1
        self._tmpdir = tempfile.mkdtemp(prefix=f"shardwise-pool{self.world_size}-")
        try:
            for rank in range(self.world_size):
                parent_end, child_end = self._ctx.Pipe(duplex=True)
                stack_file = os.path.join(self._tmpdir, f"rank{rank}.stack")
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, self.port, child_end, stack_file),
                    name=f"shardwise-w{self.world_size}-r{rank}",
                    daemon=True,
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
                self._stack_files.append(stack_file)
        except BaseException:
            self.kill()
            raise
        self.state = "launched"

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every rank has initialized its process group."""
        if self.state != "launched":
            raise RuntimeError(f"wait_ready() on {self!r}")
        timeout = _startup_timeout() if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        problems: dict[int, str] = {}
        try:
            while pending and not problems:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                _wait_for(self._wait_objects(pending), timeout=remaining)
                for rank in sorted(pending):
                    conn = self._conns[rank]
                    if conn.poll():
                        try:
                            msg = pickle.loads(conn.recv_bytes())
                        except (EOFError, OSError):
                            problems[rank] = f"died during startup ({self._exitcode_text(rank)})"
                            continue
                        if msg[0] == "ready":
                            pending.discard(rank)
                        else:
                            err = RemoteError(**msg[1])
                            problems[rank] = f"failed during startup:\n{err.traceback.rstrip()}"
                    elif not self._procs[rank].is_alive():
                        problems[rank] = f"died during startup ({self._exitcode_text(rank)})"
        except BaseException:
            self.kill()
            raise
        if problems or pending:
            self.kill()
            lines = [f"worker pool of world size {self.world_size} (port {self.port}) did not start:"]
            lines += [f"  rank {r} {problems[r]}" for r in sorted(problems)]
            if pending and not problems:
                lines.append(f"  ranks {sorted(pending)} not ready after {timeout:g} s")
            raise PoolStartupError("\n".join(lines))
        self.state = "ready"

    def start(self) -> None:
        """Launch and wait; retries with a new port if startup fails (e.g. port race)."""
        last: PoolStartupError | None = None
        for _ in range(_STARTUP_ATTEMPTS):
            self.launch()
            try:
                self.wait_ready()
                return
            except PoolStartupError as exc:
                last = exc
        raise PoolStartupError(f"giving up after {_STARTUP_ATTEMPTS} attempts; last error:\n{last}")

    def request_shutdown(self) -> None:
        """Ask the workers to exit (non-blocking); see shutdown()."""
        if self.state in ("ready", "launched"):
            for conn in self._conns:
                try:
                    conn.send_bytes(pickle.dumps(("shutdown",)))
                except (OSError, EOFError, ValueError):
                    pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the workers to exit; kill whatever is still alive after ``timeout``."""
        self.request_shutdown()
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Terminate (then kill) every process of the pool and mark it dead."""
        for proc in self._procs:
            if proc.is_alive():
                try:
                    proc.terminate()
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                try:
                    proc.kill()
                except (OSError, ValueError):
                    pass
                proc.join(5.0)
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        self._conns = []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if self.state != "new" or self._procs:
            self.state = "dead"

    def _reset(self) -> None:
        for proc in self._procs:
            try:
                proc.close()
            except (ValueError, AttributeError):
                pass
        self._procs, self._conns, self._stack_files = [], [], []

    # -- running tasks ----------------------------------------------------------------

    def _wait_objects(self, ranks) -> list:
        ranks = sorted(ranks)
        return [self._conns[r] for r in ranks] + [self._procs[r].sentinel for r in ranks]

    def _exitcode_text(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(1.0)
        return _exit_description(proc.exitcode)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Python stacks of (alive) ``ranks`` via faulthandler; best effort, ~<1 s."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        targets = [r for r in ranks if self._procs[r].is_alive()]
        for r in targets:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + 1.0
        while True:
            for r in targets:
                try:
                    with open(self._stack_files[r]) as fh:
                        text = fh.read()
                except OSError:
                    text = ""
                if text.strip():
                    stacks[r] = text
            if len(stacks) == len(targets) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        time.sleep(0.05)  # let partially written dumps finish
        for r in list(stacks):
            try:
                with open(self._stack_files[r]) as fh:
                    stacks[r] = fh.read()
            except OSError:
                pass
        return stacks

    def execute(self, payload: bytes, *, timeout: float, fn_name: str) -> _Outcome:
        """Send a pickled ``(fn, args, kwargs)`` to every rank and collect the replies.

        Returns when every rank answered (results and/or remote errors). Raises
        DistributedTestError, after killing the pool, on timeout, desync or a dead
        worker. Discards the pool after an inconsistent outcome (some ranks raised,
        others returned) or a communication-level error.
        """
        __tracebackhide__ = True
        if not self.alive:
            raise RuntimeError(f"execute() on a pool that is not running: {self!r}")
        self._seq += 1
        seq = self._seq
        message = pickle.dumps(("task", seq, payload), protocol=_PICKLE_PROTOCOL)
        try:
            dead_at_send: dict[int, int | None] = {}
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(message)
                except (OSError, EOFError):
                    dead_at_send[rank] = None
            return self._collect(seq, timeout=timeout, fn_name=fn_name, dead=dead_at_send)
        except DistributedTestError:
            raise
        except BaseException:
            self.kill()  # e.g. KeyboardInterrupt while workers are mid-task
            raise

    def _collect(self, seq: int, *, timeout: float, fn_name: str, dead: dict[int, int | None]) -> _Outcome:
        __tracebackhide__ = True
        W = self.world_size
        results: dict[int, Any] = {}
        errors: dict[int, RemoteError] = {}
        pending = set(range(W)) - set(dead)
        start = time.monotonic()
        deadline = start + timeout
        grace = _desync_grace()
        grace_deadline: float | None = None

        while pending and not dead:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            _wait_for(self._wait_objects(pending), timeout=remaining)
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn.poll():
                    try:
                        raw = conn.recv_bytes()
                    except (EOFError, OSError):
                        dead[rank] = None
                        pending.discard(rank)
                        continue
                    kind, got_seq, body = pickle.loads(raw)
                    if got_seq != seq:
                        self.kill()
                        raise RuntimeError(
                            f"harness protocol error: rank {rank} answered task {got_seq}, expected {seq}"
                        )
                    pending.discard(rank)
                    if kind == "ok":
                        try:
                            results[rank] = pickle.loads(body)
                        except Exception as exc:  # noqa: BLE001
                            errors[rank] = RemoteError(
                                rank=rank,
                                type_name="UnpicklingError",
                                type_mro=("pickle.UnpicklingError",),
                                message=f"could not unpickle the result of rank {rank} in the parent: {exc!r}",
                                traceback=traceback.format_exc(),
                            )
                    else:
                        errors[rank] = RemoteError(**body)
                        if grace_deadline is None:
                            grace_deadline = time.monotonic() + grace
                elif not self._procs[rank].is_alive():
                    dead[rank] = None
                    pending.discard(rank)

        elapsed = time.monotonic() - start
        where = f"on world size {W}"
        test = _current_test()
        called_from = f"\n(called from {test})" if test else ""

        if dead or pending:
            stuck = sorted(pending)
            stacks = self._dump_stacks(stuck)
            for rank in dead:
                dead[rank] = self._procs[rank].exitcode if not self._procs[rank].is_alive() else None
            self.kill()
            for rank in dead:
                if dead[rank] is None:
                    dead[rank] = self._procs[rank].exitcode
            if dead:
                kind = "died"
                head = (
                    f"distributed test {fn_name}: worker rank(s) {sorted(dead)} died {where} ("
                    + ", ".join(f"rank {r}: {_exit_description(c)}" for r, c in sorted(dead.items()))
                    + ")"
                )
                if stuck:
                    head += f"; ranks still running: {stuck}"
            elif errors:
                kind = "desync"
                head = (
                    f"distributed test {fn_name} desynchronized {where}: rank(s) {sorted(errors)} raised, "
                    f"but ranks still running after a {grace:g} s grace period: {stuck} "
                    f"(probably blocked in a collective waiting for the failed rank(s))"
                )
            else:
                kind = "timeout"
                head = f"distributed test {fn_name} timed out after {timeout:g} s {where}; ranks still running: {stuck}"
            done = sorted(results)
            if done:
                head += f"\nranks that returned normally: {done}"
            head += f"\n(after {elapsed:.1f} s; the pool was killed, the next test gets a fresh one){called_from}"
            parts = [head]
            if errors:
                parts.append("remote errors:\n" + _format_errors(errors))
            for rank in sorted(stacks):
                text = _clean_stack_dump(stacks[rank])
                parts.append(f"===== stack of stuck rank {rank} =====\n{text}")
            raise DistributedTestError(
                "\n\n".join(parts),
                kind=kind,
                fn_name=fn_name,
                world_size=W,
                errors=errors,
                stuck=stuck,
                dead=dead,
            )

        if errors and (len(errors) < W or any(_looks_like_comm_failure(e) for e in errors.values())):
            # Inconsistent outcome or a communication failure: the process group may hold
            # unmatched traffic. Start the next test on a fresh pool.
            self.kill()
        return _Outcome(results=results, errors=errors)


# ----------------------------------------------------------------------------------------
# Session-wide pools and the public API
# ----------------------------------------------------------------------------------------

_POOLS: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    """The running pool for ``world_size``, started (or restarted) if needed."""
    _check_world_size(world_size)
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.kill()
        pool = WorkerPool(world_size)
        _POOLS[world_size] = pool
        pool.start()
    return pool


def prestart(*world_sizes: int) -> None:
    """Start the pools for several world sizes concurrently (optional; pools are lazy)."""
    launched = []
    for w in dict.fromkeys(world_sizes):
        _check_world_size(w)
        pool = _POOLS.get(w)
        if pool is not None and pool.alive:
            continue
        if pool is not None:
            pool.kill()
        pool = WorkerPool(w)
        _POOLS[w] = pool
        pool.launch()
        launched.append(pool)
    for pool in launched:
        try:
            pool.wait_ready()
        except PoolStartupError:
            pool.start()  # retry sequentially


def shutdown_all() -> None:
    """Shut every pool down (session end)."""
    pools = list(_POOLS.values())
    _POOLS.clear()
    for pool in pools:  # let all pools wind down in parallel
        try:
            pool.request_shutdown()
        except Exception:  # noqa: BLE001
            pass
    for pool in pools:
        try:
            pool.shutdown()
        except Exception:  # noqa: BLE001
            pool.kill()


atexit.register(shutdown_all)


def _pickle_task(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    try:
        return pickle.dumps((fn, args, kwargs), protocol=_PICKLE_PROTOCOL)
    except Exception as exc:  # noqa: BLE001
        raise TypeError(
            f"cannot send {_fn_name(fn)} and its arguments to the workers: {exc}. "
            "fn must be a module-level function (pickled by reference) and every "
            "argument must be picklable."
        ) from exc


def _execute(world_size: int, fn: Callable, args: tuple, kwargs: dict, timeout: float | None) -> tuple[str, _Outcome]:
    __tracebackhide__ = True
    timeout = resolve_timeout(timeout)
    payload = _pickle_task(fn, args, kwargs)
    fn_name = _fn_name(fn)
    return fn_name, get_pool(world_size).execute(payload, timeout=timeout, fn_name=fn_name)


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of the pool of that size.

    Returns the per-rank results in rank order. ``timeout`` (seconds) defaults to
    ``$SHARDWISE_TEST_TIMEOUT`` or 90. Raises DistributedTestError if any rank
    raises, hangs or dies.
    """
    __tracebackhide__ = True
    fn_name, outcome = _execute(world_size, fn, args, kwargs, timeout)
    if outcome.errors:
        failed = sorted(outcome.errors)
        ok = sorted(outcome.results)
        head = f"distributed test {fn_name} failed on rank(s) {failed} of world size {world_size}"
        if ok:
            head += f" (ranks {ok} returned normally)"
        test = _current_test()
        if test:
            head += f"\n(called from {test})"
        raise DistributedTestError(
            head + "\n\n" + _format_errors(outcome.errors),
            kind="error",
            fn_name=fn_name,
            world_size=world_size,
            errors=outcome.errors,
        )
    return [outcome.results[r] for r in range(world_size)]


def run_expect_error(
    world_size: int,
    fn: Callable,
    *args: Any,
    match: str | re.Pattern | None = None,
    exc_type: type | tuple[type, ...] | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> list[str]:
    """Run ``fn`` on every rank and require that EVERY rank raises.

    ``match``: regex that must ``re.search`` each rank's ``str(exception)``.
    ``exc_type``: exception class (or tuple) each rank's exception must be an
    instance of (checked by qualified class names along the remote MRO).
    Returns the per-rank messages (``str(exception)``) in rank order.
    """
    __tracebackhide__ = True
    fn_name, outcome = _execute(world_size, fn, args, kwargs, timeout)
    problems: list[str] = []
    if outcome.results:
        problems.append(
            f"expected an error on every rank, but rank(s) {sorted(outcome.results)} returned normally"
            + (f" (rank(s) {sorted(outcome.errors)} raised)" if outcome.errors else "")
        )
    if exc_type is not None:
        wrong = [r for r, e in sorted(outcome.errors.items()) if not e.is_instance_of(exc_type)]
        if wrong:
            names = (
                ", ".join(t.__qualname__ for t in exc_type)
                if isinstance(exc_type, tuple)
                else exc_type.__qualname__
            )
            problems.append(
                f"expected {names} on every rank, got "
                + ", ".join(f"rank {r}: {outcome.errors[r].type_name}" for r in wrong)
            )
    if match is not None:
        pattern = re.compile(match) if isinstance(match, str) else match
        wrong = [r for r, e in sorted(outcome.errors.items()) if not pattern.search(e.message)]
        if wrong:
            problems.append(
                f"regex {pattern.pattern!r} did not match the message of rank(s) {wrong}: "
                + "; ".join(f"rank {r}: {outcome.errors[r].message!r}" for r in wrong)
            )
    if problems:
        test = _current_test()
        text = f"distributed test {fn_name} on world size {world_size}: " + "; ".join(problems)
        if test:
            text += f"\n(called from {test})"
        if outcome.errors:
            text += "\n\n" + _format_errors(outcome.errors)
        raise DistributedTestError(
            text,
            kind="expectation",
            fn_name=fn_name,
            world_size=world_size,
            errors=outcome.errors,
        )
    return [outcome.errors[r].message for r in range(world_size)]


class DistRunner:
    """What the ``dist`` fixture yields: ``dist.run(...)``, ``dist.run_expect_error(...)``."""

    max_world_size = MAX_WORLD_SIZE

    def run(self, world_size: int, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        __tracebackhide__ = True
        return run_distributed(world_size, fn, *args, timeout=timeout, **kwargs)

    def run_expect_error(
        self,
        world_size: int,
        fn: Callable,
        *args: Any,
        match: str | re.Pattern | None = None,
        exc_type: type | tuple[type, ...] | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[str]:
        __tracebackhide__ = True
        return run_expect_error(
            world_size, fn, *args, match=match, exc_type=exc_type, timeout=timeout, **kwargs
        )

    def pool(self, world_size: int) -> WorkerPool:
        return get_pool(world_size)

    def shutdown(self) -> None:
        shutdown_all()
