"""Run a program on N local processes without asking the user for torchrun.

``main_or_launch(worker, nproc)`` either runs ``worker()`` (when this process is already one of
the workers of a launcher) or starts ``nproc`` copies of the current program (a script, or
``python -m module``) through torch's elastic launcher and waits. Under torchrun on many hosts
the same program just runs. ``python -m shardwise.launch --nproc N script.py`` does the same
for any script (see ``main``).

On Linux with a CPU-only torch the workers are forked from the launcher, which has imported torch (and whatever the
program imported before calling the launcher), so a worker starts in milliseconds instead of
paying 1.5-2 CPU-seconds of imports; each still runs the program from the top as ``__main__``
with one intra-op thread, as a fresh interpreter would. ``SHARDWISE_LAUNCH_START_METHOD=spawn``
starts fresh interpreters instead (the default elsewhere).

A job fails whole and fast. Each worker runs under ``shardwise.launch.worker``: a rank that fails
reports once and exits at once (no barrier on the way out), ranks whose collective it cut short
wait silently, and the elastic agent (polling every 0.2 s) stops them. The launcher then prints
ONE line, the root cause read from the workers' error files (its own exception before a timeout
before a signal before a consequence): ``FAILED: rank 1: RuntimeError: ... (the other ranks were
stopped)``. Ctrl-C reaches every worker (the agent forwards SIGINT); rank 0 prints where the job
was and the launcher exits with status 130, saying nothing more.

Restarts (``max_restarts``, the trainer's ``--max-restarts``): after a failure that restarting
may cure (an error, a killed or timed-out rank; not a verdict the program printed, nor Ctrl-C)
the launcher prints ``restart 1 of 3: <the root cause>`` and starts every worker again, with
``$SHARDWISE_RESTART_COUNT`` telling them which attempt they are. The loop is here rather than
in torch's agent (whose ``max_restarts`` restarts the worker group itself) because only here is
the failure diagnosed before the restart: the agent would restart a job that refused its own
flags, and say nothing about why it restarted. Each attempt is a fresh rendezvous; the workers
are forked again, so a restart costs milliseconds beyond the program's own start-up. Under
torchrun (``--max-restarts`` given to torchrun) torchrun's agent restarts, and the workers
read ``$TORCHELASTIC_RESTART_COUNT`` instead (``worker.restart_count``).
"""

from __future__ import annotations

import enum
import logging
import math
import os
import signal
import sys
import traceback
import uuid
from dataclasses import dataclass
from typing import Callable, NoReturn, Sequence

from shardwise.launch.worker import (LAUNCHER_PID_ENV, MAX_RESTARTS_ENV, REPORT_KEY, RESTART_COUNT_ENV,
                                     close_process_group, exit_status, run_worker, under_launcher)

__all__ = ["under_launcher", "launch", "close_process_group", "main_or_launch", "main", "USAGE"]

START_METHOD_ENV = "SHARDWISE_LAUNCH_START_METHOD"
_SHUTDOWN_TIMEOUT_S = 5  # SIGTERM to SIGKILL for a worker that does not stop
_MONITOR_INTERVAL_S = 0.2

# Workers start with SIGINT's default action (die silently) until run_worker installs its own:
# a Ctrl-C while they import torch must not print a KeyboardInterrupt traceback per rank.
_BOOTSTRAP = """\
import os, runpy, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
args = sys.argv[1:]
if args[0] == "-m":
    sys.argv = args[1:]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
    runpy.run_path(args[0], run_name="__main__")
"""


def launch(python_args: Sequence[str], nproc: int, quiet_codes: tuple[int, ...] = (), max_restarts: int = 0) -> int:
    """Start ``nproc`` local workers running ``python *python_args``; return the job's exit status.

    ``python_args`` is ``["-m", module, *args]`` or ``[script, *args]``. On a failure the
    root cause is printed in one line (see the module docstring); a failure whose root cause
    is a status the workers returned themselves (or one of ``quiet_codes``) is a verdict they
    already printed: its status is returned silently. Ctrl-C returns 130, silently.

    With ``max_restarts`` > 0, a failure that is not a verdict nor an interruption stops every
    worker and starts them all again, up to ``max_restarts`` times; each restart is one line,
    ``restart 1 of 3: <root cause>``. The workers read the restart number from
    ``$SHARDWISE_RESTART_COUNT`` (a program that saves checkpoints resumes from its latest).
    """
    # Each worker is single-threaded: 4 processes share 2 cores on small machines.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers' launching process, however started
    os.environ[MAX_RESTARTS_ENV] = str(max_restarts)
    for restart in range(max_restarts + 1):
        os.environ[RESTART_COUNT_ENV] = str(restart)
        ending = _run_once(python_args, nproc, quiet_codes)
        if ending.status == 0 or not ending.restartable or restart == max_restarts:
            if ending.line:
                used = _restarts_used(max_restarts) if max_restarts and ending.restartable else ""
                print(f"FAILED: {ending.line}{_stopped_note(nproc, used)}", file=sys.stderr, flush=True)
            return ending.status
        print(f"restart {restart + 1} of {max_restarts}: {ending.line}{_stopped_note(nproc, '')}",
              file=sys.stderr, flush=True)
    raise AssertionError("unreachable: the last attempt returns")


def _restarts_used(max_restarts: int) -> str:
    return f"all {max_restarts} restarts used" if max_restarts > 1 else "its one restart used"


def _stopped_note(nproc: int, used: str) -> str:
    """`` (the other ranks were stopped; all 3 restarts used)``, or the parts that apply."""
    parts = (["the other ranks were stopped"] if nproc > 1 else []) + ([used] if used else [])
    return f" ({'; '.join(parts)})" if parts else ""


@dataclass(frozen=True, slots=True)
class JobEnding:
    """How one launch of the workers ended: its exit status, the root cause's line (None: say
    nothing, the workers did) and whether restarting the workers may help."""

    status: int
    line: str | None = None
    restartable: bool = False


def _run_once(python_args: Sequence[str], nproc: int, quiet_codes: tuple[int, ...]) -> JobEnding:
    """Start the workers once and wait for them (see ``launch``)."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        _quiet_agent_logs()
        if _start_method() is StartMethod.FORK:
            elastic_launch(_config(nproc, "fork"), run_forked)(*python_args)
        else:
            elastic_launch(_config(nproc, "spawn"), sys.executable)("-u", "-c", _BOOTSTRAP, *python_args)
    except ChildFailedError as err:
        return diagnose(err.failures, quiet_codes)
    except (KeyboardInterrupt, SignalException) as err:
        # Ctrl-C before the workers started, or forwarded to them (rank 0 said where it was).
        signum = getattr(err, "sigval", signal.SIGINT)
        return JobEnding(128 + int(signum))
    except Exception as err:  # rendezvous errors, agent errors: not the workers', no restart
        print(f"FAILED: launcher error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return JobEnding(1)
    return JobEnding(0)


class StartMethod(enum.Enum):
    """How the launcher starts its workers."""

    FORK = "fork"  # a copy of this process: torch and the program's imports are already loaded
    SPAWN = "spawn"  # a fresh interpreter per worker (importing torch costs each 1.5-2 CPU-seconds)


def _start_method() -> StartMethod:
    """Fork on Linux with a CPU-only torch, else spawn; ``SHARDWISE_LAUNCH_START_METHOD`` chooses
    (``spawn`` gives every worker a fresh interpreter, as torchrun does).

    A torch built for CUDA or ROCm spawns: once a process has asked the GPU runtime anything
    (``torch.cuda.is_available()`` does), a forked child cannot use the GPU."""
    chosen = os.environ.get(START_METHOD_ENV, "")
    if chosen:
        return StartMethod(chosen)
    import torch

    cpu_only = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    return StartMethod.FORK if sys.platform.startswith("linux") and cpu_only else StartMethod.SPAWN


def run_forked(*python_args: str) -> int:
    """A forked worker's entry point: run the program as ``python *python_args`` would.

    The agent waits for a forked worker to RETURN (its return value), so a program ending with
    ``os._exit(0)`` (``run_worker`` does, to skip interpreter teardown) would leave it waiting
    forever. The program therefore runs in a second fork, and this process only mirrors its
    end: it forwards SIGINT and SIGTERM to it, returns 0 when it exits 0, and otherwise ends
    with its status or signal, so the agent sees what the program did."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # read when the launcher imported torch
    pid = os.fork()
    if pid == 0:
        _run_program_and_exit(list(python_args))
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda received, frame: os.kill(pid, received))
    _, wait_status = os.waitpid(pid, 0)  # retried after each forwarded signal (PEP 475)
    if os.WIFSIGNALED(wait_status):
        signum = os.WTERMSIG(wait_status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # their action cannot be changed
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # end as it ended: the agent reports the signal
        os._exit(128 + signum)  # a signal whose default action does not end a process
    status = os.waitstatus_to_exitcode(wait_status)
    if status:
        os._exit(status)
    return 0


def _run_program_and_exit(program: list[str]) -> NoReturn:
    """The program's process: stopped with its parent, unbuffered like ``python -u``, signals as
    ``_BOOTSTRAP`` sets them; its exit status is the program's (a traceback first if it raised
    before ``run_worker`` took over)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)
    try:
        _run_program(program)
        status = 0
    except SystemExit as stop:
        status = exit_status(stop)
    except BaseException:  # noqa: BLE001 - as python would: the traceback, status 1
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (the agent's last resort is SIGKILL)."""
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(128 + int(signal.SIGKILL))


def _config(nproc: int, start_method: str):
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone
        max_restarts=0,
        monitor_interval=_MONITOR_INTERVAL_S,
        start_method=start_method,
        shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
    )


def _quiet_agent_logs() -> None:
    """The agent logs every non-zero exit and every signal it forwards; the launcher reports
    the one failure that matters instead."""
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.errors", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


# ---------------------------------------------------------------------- failure report
# Root-cause order of the workers' report kinds (failfast.Ending values). No report: killed
# (SIGKILL, a crash in C++) or exited on its own, unless SIGTERM ended it (the agent stopping
# the survivors of the failure).
_PRIORITY = {"error": 0, "timeout": 1, "interrupted": 2, "verdict": 3, "no report": 4, "terminated": 5,
             "stopped": 5, "peer_lost": 6}


def diagnose(failures: dict, quiet_codes: tuple[int, ...] = ()) -> JobEnding:
    """The root cause of a failed launch (the workers' ``ProcessFailure`` by rank), its status,
    and whether a restart may help: not after a verdict or an interruption (Ctrl-C)."""
    rank, failure = min(failures.items(), key=lambda item: _order(*item))
    report = _report_of(failure)
    kind = report.get("kind") if report else None
    status = failure.exitcode if failure.exitcode > 0 else 128 + (-failure.exitcode or signal.SIGKILL)
    if kind == "verdict" or (kind is None and failure.exitcode in quiet_codes):
        return JobEnding(status)
    line = report["line"] if report else _no_report_line(rank, failure.exitcode)
    return JobEnding(status, line, restartable=kind != "interrupted")


def _order(rank: int, failure) -> tuple:
    report = _report_of(failure)
    if report:  # the rank that printed its traceback (won the store) before the clock
        return _PRIORITY.get(report.get("kind"), 4), not report.get("first"), report.get("time", math.inf), rank
    stopped = failure.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM)
    return _PRIORITY["stopped" if stopped else "no report"], True, math.inf, rank


def _report_of(failure) -> dict | None:
    """What ``failfast`` wrote into the worker's error file, if anything."""
    data = getattr(failure, "error_file_data", None)
    report = data.get(REPORT_KEY) if isinstance(data, dict) else None
    return report if isinstance(report, dict) and "line" in report else None


def _no_report_line(rank: int, exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if -exitcode == signal.SIGKILL else ""
        return f"rank {rank} was killed by {name}{hint}"
    return f"rank {rank} exited with status {exitcode}"


def main_or_launch(
    worker: Callable[[], int | None],
    nproc: int,
    quiet_codes: tuple[int, ...] = (),
    module: str | None = None,
    max_restarts: int = 0,
) -> NoReturn:
    """Run ``worker`` here if we are a worker, else launch ``nproc`` workers of this program.

    Args:
        worker: the per-rank main; its return value is the exit status (non-zero: a verdict
            it printed itself, which the launcher does not repeat).
        nproc: local processes to start when not already under a launcher.
        quiet_codes: further worker exit statuses that are verdicts, not crashes.
        module: run the workers as ``python -m module`` (else the current script).
        max_restarts: restart every worker after a failure up to this many times (``launch``).
    """
    if under_launcher():
        run_worker(worker)
    program = ["-m", module] if module else [os.path.abspath(sys.argv[0])]
    sys.exit(launch(program + sys.argv[1:], nproc, quiet_codes, max_restarts))


# ---------------------------------------------------------------------- python -m shardwise.launch
USAGE = """\
usage: python -m shardwise.launch [--nproc N] [--collective-timeout SECONDS] script.py [args ...]
       python -m shardwise.launch [--nproc N] [--collective-timeout SECONDS] -m module [args ...]

Run a Python program as N local processes (ranks) of one job, like
`torchrun --standalone --nproc-per-node N`. Each worker gets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, so init_device_mesh() / init_process_group() need no arguments.

The job fails whole and fast: when one rank raises, the launcher stops the others within
about a second and prints that rank's error in one line (its traceback is printed once, above);
a collective that does not complete within the collective timeout names the ranks that did
not arrive; Ctrl-C stops every rank at once (exit status 130). Under torchrun the same command
runs the program in each of torchrun's workers.

options:
  --nproc N                     processes to start (default 1; under torchrun: its world size)
  --collective-timeout SECONDS  fail a collective that has not completed after SECONDS
                                (sets $SHARDWISE_COLLECTIVE_TIMEOUT; default 300)
  -m module                     run a module, as python -m does
  -h, --help                    show this help
"""


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """``python -m shardwise.launch``: launch the program, or run it here in a worker."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        nproc, timeout, program = _parse(argv)
    except ValueError as err:
        print(f"{USAGE}\nshardwise.launch: error: {err}", file=sys.stderr)
        sys.exit(2)
    if timeout is not None:
        os.environ["SHARDWISE_COLLECTIVE_TIMEOUT"] = timeout
    if not under_launcher():
        problem = _missing_program(program)
        if problem:
            print(f"shardwise.launch: error: {problem}", file=sys.stderr)
            sys.exit(2)
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        if nproc is not None and nproc != world:
            _refuse(f"--nproc {nproc} differs from the launcher's world size {world}")
        run_worker(lambda: _run_program(program))
    sys.exit(launch(["-m", "shardwise.launch", *argv], nproc or 1))


def _refuse(message: str) -> NoReturn:
    if os.environ.get("RANK") == "0":
        print(f"shardwise.launch: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _parse(argv: list[str]) -> tuple[int | None, str | None, list[str]]:
    """(--nproc, --collective-timeout, the program: [script, *args] or ["-m", module, *args])."""
    nproc = timeout = None
    while argv:
        head = argv[0]
        if head in ("-h", "--help"):
            print(USAGE, end="")
            sys.exit(0)
        if head == "-m":
            if len(argv) < 2:
                raise ValueError("-m needs a module name")
            return nproc, timeout, argv
        name, _, value = head.partition("=")
        if name not in ("--nproc", "--collective-timeout"):
            if head.startswith("-"):
                raise ValueError(f"unknown option {head!r} (options go before the program)")
            return nproc, timeout, argv
        if not value:
            if len(argv) < 2:
                raise ValueError(f"{name} needs a value")
            value, argv = argv[1], argv[1:]
        argv = argv[1:]
        if name == "--nproc":
            nproc = _positive_int(value)
        else:
            timeout = _positive_seconds(value)
    raise ValueError("no program given (a script or -m module)")


def _missing_program(program: list[str]) -> str | None:
    """Why ``program`` cannot run (checked before any worker starts), or None."""
    if program[0] == "-m":
        import importlib.util

        try:
            found = importlib.util.find_spec(program[1]) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"no module named {program[1]!r} (-m {program[1]})"
    script = program[0]
    if os.path.isfile(script):
        return None
    hint = f" (a process count? --nproc {script} goes before the script)" if script.isdigit() else ""
    return f"no script {script!r}: {os.path.abspath(script)} is not a file{hint}"


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--nproc must be a positive integer, got {text!r}")
    return int(text)


def _positive_seconds(text: str) -> str:
    try:
        ok = 0 < float(text) < math.inf
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--collective-timeout must be a positive number of seconds, got {text!r}")
    return text


def _run_program(program: list[str]) -> int:
    """Run the user's program in this process as ``python`` would (``__main__``, its argv)."""
    import runpy

    if program[0] == "-m":
        sys.argv = program[1:]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.abspath(program[0]))
        runpy.run_path(program[0], run_name="__main__")
    return 0

