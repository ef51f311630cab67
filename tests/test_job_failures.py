"""A job fails whole and fast (issue 10: items 2, 3, 4 and the non-finite loss / stray
LOCAL_RANK parts of 8).

Real launched jobs: shardwise's launcher (``python -m shardwise.train --nproc 2``, ``python -m
shardwise.launch``), torchrun, or one process. A fault is injected on one rank by the job
scripts of tests/jobs (never by the library), or a signal is sent as a terminal would, and
each test asserts the exit status, how soon after the fault or signal the job ended, the one
line that names the rank, that no rank buried it under tracebacks, and that no process of the
job is left. Timing bounds are loose (the machine is shared); the behaviour they guard against
took minutes (a failing rank blocked in a barrier until gloo's timeout) or 30 s (Ctrl-C).

Starting a job costs seconds of CPU (torch imports in every process), waiting on it almost
none, so the jobs of the selected tests all start together when the first one needs its job
(``JOBS_OF``); each test then waits for its own. The first such test therefore takes most of
the time; the module as a whole takes about one job's start-up plus the longest wait.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as tdist

from shardwise import comm

from shardwise.launch import launcher as launch

from shardwise.comm import stall

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "jobs"
LAUNCH = [sys.executable, "-m", "shardwise.launch", "--nproc", "2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TRAIN = [sys.executable, "-m", "shardwise.train"]
TINY = ["--config", "tiny", "--global-batch", "4", "--seq-len", "32", "--warmup", "2"]
STARTUP_S = 180.0  # a loaded 2-core machine can take a minute to start a job
ENDS_WITHIN_S = 10.0  # after a fault or a signal (it takes ~1 s when the machine is idle)
TIMEOUT_S = 4  # --collective-timeout of the stall tests
MARKER_ENV = "SHARDWISE_TEST_JOB"


# ---------------------------------------------------------------------- running jobs
class Job:
    """A job's top process in a session of its own; its output lines, timestamped."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.marker = uuid.uuid4().hex
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", MARKER_ENV: self.marker, **(env or {})}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[tuple[float, str, str]] = []  # (time, "out" | "err", text)
        self._readers = [threading.Thread(target=self._read, args=(s, n), daemon=True)
                         for s, n in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for reader in self._readers:
            reader.start()
        self.ended_at: float | None = None  # when the top process exited (its reaper's clock)
        self._ended = threading.Event()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.proc.wait()
        self.ended_at = time.time()
        self._ended.set()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            self.lines.append((time.time(), name, line.rstrip("\n")))

    def text(self, stream: str | None = None) -> str:
        return "\n".join(t for _, s, t in list(self.lines) if stream in (None, s))

    def wait_for(self, pattern: str, timeout: float = STARTUP_S) -> float:
        """The time of the first output line matching ``pattern`` (waiting for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, _, line in list(self.lines):
                if re.search(pattern, line):
                    return when
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the readers drain
                if not any(re.search(pattern, line) for _, _, line in self.lines):
                    pytest.fail(f"job ended (status {self.proc.returncode}) before {pattern!r}:\n{self.text()}")
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"no {pattern!r} within {timeout:g} s:\n{self.text()}")

    def fault_time(self) -> float:
        """When the injected fault fired (the worker's own clock, printed by tests/jobs/faults.py)."""
        self.wait_for(r"^FAULT ")
        line = next(t for _, _, t in self.lines if t.startswith("FAULT "))
        return float(line.rsplit(" at ", 1)[1])

    def finish(self, since: float, within: float) -> tuple[int, float]:
        """Wait for the job to end; return (status, seconds from ``since`` to its end). Fails
        (and kills everything) unless it ended within ``within`` seconds after ``since``."""
        if not self._ended.wait(timeout=max(since + within - time.time(), 0.1)):
            self.kill()
            pytest.fail(f"job still running {within:g} s after the event:\n{self.text()}")
        took = self.ended_at - since
        for reader in self._readers:
            reader.join(timeout=5)
        print(f"status {self.proc.returncode}, ended {took:.2f} s after the event")  # shown with -rP
        assert took <= within, f"job ended {took:.1f} s after the event (bound {within:g} s):\n{self.text()}"
        return self.proc.returncode, took

    def leftovers(self) -> list[int]:
        """Live processes of this job (found by the marker in their environment)."""
        needle = f"{MARKER_ENV}={self.marker}".encode()
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    mine = needle in f.read().split(b"\0")
                with open(f"/proc/{pid}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                continue
            if mine and not zombie:
                found.append(int(pid))
        return found

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 3.0  # the kernel may take a moment to reap
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            self.kill()
            pytest.fail(f"processes of the job left running: {left}")

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.leftovers()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _trainer_ctrl_c(tmp: Path) -> tuple[list[str], dict]:
    return [*TRAIN, "--nproc", "2", *TINY, "--steps", "100000", "--checkpoint-dir", str(tmp / "ckpt"),
            "--checkpoint-every", "2"], {}


# The job each launched test checks: test name -> (argv, extra environment), given a tmp dir.
JOBS_OF = {
    "test_a_rank_raising_ends_the_trainer_job_at_once_naming_it":
        lambda tmp: ([*LAUNCH, str(JOBS / "train_fault.py"), *TINY, "--steps", "50"], {"FAULT": "raise:1:3"}),
    "test_a_rank_raising_under_torchrun_ends_the_job_at_once":
        lambda tmp: ([*TORCHRUN, "-m", "shardwise.launch", str(JOBS / "collective_fault.py")], {"FAULT": "raise:1:3"}),
    "test_a_worker_receiving_sigint_alone_ends_the_job_naming_it":
        lambda tmp: ([*LAUNCH, str(JOBS / "collective_fault.py")], {"FAULT": "sigint:1:3"}),
    "test_a_rank_killed_without_a_word_is_named":
        lambda tmp: ([*LAUNCH, str(JOBS / "collective_fault.py")], {"FAULT": "kill:1:3"}),
    "test_a_rank_killed_during_torchs_own_collective_is_named":
        lambda tmp: ([*LAUNCH[:-1], "4", str(JOBS / "collective_fault.py")], {"FAULT": "kill:1:3", "RAW": "1"}),
    "test_ctrl_c_stops_the_trainer_with_one_line_naming_step_and_checkpoint": _trainer_ctrl_c,
    "test_ctrl_c_under_torchrun_stops_every_worker_with_one_line":
        lambda tmp: ([*TORCHRUN, "-m", "shardwise.launch", str(JOBS / "collective_fault.py")], {"STEPS": "100000"}),
    "test_ctrl_c_stops_a_one_process_run_with_one_line":
        lambda tmp: ([*TRAIN, *TINY, "--steps", "100000"], {}),
    "test_a_stalled_rank_is_named_after_the_collective_timeout":
        lambda tmp: ([sys.executable, "-m", "shardwise.launch", "--nproc", "3", "--collective-timeout", str(TIMEOUT_S),
                      str(JOBS / "collective_fault.py"), "--flag", "x"], {"FAULT": "stall:1:3", "GROUP": "pair"}),
    "test_the_trainers_collective_timeout_names_a_stalled_rank":
        lambda tmp: ([*LAUNCH, str(JOBS / "train_fault.py"), *TINY, "--steps", "50", "--collective-timeout",
                      str(TIMEOUT_S)], {"FAULT": "stall:1:3"}),
    "test_a_non_finite_loss_stops_every_rank_at_the_same_step":
        lambda tmp: ([*TRAIN, "--nproc", "2", *TINY, "--steps", "8", "--lr", "inf"], {"LOCAL_RANK": "1", "RANK": "1"}),
}


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The jobs of every selected test of this module, started together; killed at the end."""
    tmp = tmp_path_factory.mktemp("jobs")
    selected = {item.originalname for item in request.session.items if item.module.__name__ == __name__}
    jobs = {name: Job(*spec(tmp)) for name, spec in JOBS_OF.items() if name in selected}
    yield jobs, tmp
    for job in jobs.values():
        job.kill()


@pytest.fixture
def job(started, request) -> Job:
    """This test's job (see ``JOBS_OF``), already running."""
    return started[0][request.node.originalname]


def _no_tracebacks_but(job: Job, rank: int | None, launcher_may_print: bool = False) -> None:
    """Only ``rank`` (if any) printed a traceback, and only once, each line tagged with it.
    torchrun prints its own report, a traceback of its own included (``launcher_may_print``)."""
    text = job.text()
    assert "KeyboardInterrupt" not in text, text
    tagged = re.findall(r"^\[rank (\d+)\] Traceback", text, re.MULTILINE)
    assert tagged == ([str(rank)] if rank is not None else []), text
    if not launcher_may_print:
        assert text.count("Traceback") == len(tagged), text


# ---------------------------------------------------------------------- item 2: one rank fails
@pytest.mark.e2e
def test_a_rank_raising_ends_the_trainer_job_at_once_naming_it(job):
    """Old: rank 1 blocked in close_process_group's barrier (a finally), rank 0 in its next
    collective: no output and no exit until gloo's 30-minute timeout."""
    status, took = job.finish(job.fault_time(), ENDS_WITHIN_S)
    assert status == 1, job.text()
    last = job.text("err").splitlines()[-1]
    assert last == "FAILED: rank 1: RuntimeError: injected out of memory (the other ranks were stopped)", job.text()
    _no_tracebacks_but(job, rank=1)
    assert "[rank 1] RuntimeError: injected out of memory" in job.text()
    job.assert_nothing_left()


@pytest.mark.e2e
def test_a_rank_raising_under_torchrun_ends_the_job_at_once(job):
    """The worker side alone (torchrun is the launcher): the failing rank exits at once, the
    waiting one stays silent until torchrun stops it."""
    status, took = job.finish(job.fault_time(), ENDS_WITHIN_S)
    assert status != 0, job.text()
    _no_tracebacks_but(job, rank=1, launcher_may_print=True)
    assert "[rank 1] RuntimeError: injected out of memory" in job.text()
    assert "[rank 0]" not in job.text(), job.text()
    job.assert_nothing_left()


@pytest.mark.e2e
def test_a_worker_receiving_sigint_alone_ends_the_job_naming_it(job):
    """The issue's reproduction of item 2: SIGINT to one worker at step 3."""
    status, took = job.finish(job.fault_time(), ENDS_WITHIN_S)
    assert status == 130, job.text()
    assert job.text("err").splitlines()[-1] == "FAILED: rank 1: interrupted at step 3 (the other ranks were stopped)"
    _no_tracebacks_but(job, rank=None)
    job.assert_nothing_left()


@pytest.mark.e2e
def test_a_rank_killed_without_a_word_is_named(job):
    """SIGKILL (the OOM killer): no report from it; its peers' lost connections are not
    mistaken for the cause."""
    status, took = job.finish(job.fault_time(), ENDS_WITHIN_S)
    assert status == 128 + signal.SIGKILL, job.text()
    assert job.text("err").splitlines()[-1].startswith("FAILED: rank 1 was killed by SIGKILL"), job.text()
    _no_tracebacks_but(job, rank=None)
    job.assert_nothing_left()


@pytest.mark.e2e
def test_a_rank_killed_during_torchs_own_collective_is_named(job):
    """The same SIGKILL while every rank is in torch's own all_reduce (not issued by
    shardwise.comm, so not classified there), on 4 ranks: the survivors' gloo errors ("Connection
    reset by peer", "Connection closed by peer") are consequences, whichever arrives first, and
    the survivors print nothing of them (gloo's message ends "GLHF!")."""
    status, took = job.finish(job.fault_time(), ENDS_WITHIN_S)
    assert status == 128 + signal.SIGKILL, job.text()
    assert job.text("err").splitlines()[-1].startswith("FAILED: rank 1 was killed by SIGKILL"), job.text()
    assert "GLHF" not in job.text() and "by peer" not in job.text(), job.text()
    _no_tracebacks_but(job, rank=None)
    job.assert_nothing_left()


# ---------------------------------------------------------------------- item 3: Ctrl-C
@pytest.mark.e2e
def test_ctrl_c_stops_the_trainer_with_one_line_naming_step_and_checkpoint(job, started):
    """Old: up to 30 s of silence (when the barrier deadlocks until the agent's SIGKILL), then
    pages of KeyboardInterrupt tracebacks and 'FAILED: launcher error'."""
    ckpt = started[1] / "ckpt"
    job.wait_for(r"^step +4/")
    sent = time.time()
    os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal does
    status, took = job.finish(sent, ENDS_WITHIN_S)
    assert status == 130, job.text()
    err = job.text("err").splitlines()
    said = [line for line in err if line.startswith("interrupted")]
    assert len(said) == 1, job.text()
    match = re.fullmatch(r"interrupted at step (\d+); latest checkpoint: (\S+) \(step (\d+); --resume continues "
                         r"from it\)", said[0])
    assert match, said
    step, path, saved = int(match[1]), match[2], int(match[3])
    # step >= saved: a Ctrl-C right after step N's checkpoint, before step N+1 starts, is "at step N"
    assert saved >= 4 and saved % 2 == 0 and step >= saved, said
    assert path == str(ckpt / f"step-{saved}") and (ckpt / f"step-{saved}" / "metadata.json").is_file()
    assert not any("FAILED" in line or "Traceback" in line for line in err), job.text()
    job.assert_nothing_left()


@pytest.mark.e2e
def test_ctrl_c_under_torchrun_stops_every_worker_with_one_line(job):
    job.wait_for(r"^step 5$")
    sent = time.time()
    os.killpg(job.proc.pid, signal.SIGINT)  # torchrun forwards it to its workers
    status, took = job.finish(sent, ENDS_WITHIN_S)
    assert status != 0
    said = [line for line in job.text("err").splitlines() if line.startswith("interrupted")]
    assert len(said) == 1 and re.fullmatch(r"interrupted at step \d+", said[0]), job.text()
    assert "[rank" not in job.text() and "KeyboardInterrupt" not in job.text(), job.text()
    job.assert_nothing_left()


@pytest.mark.e2e
def test_ctrl_c_stops_a_one_process_run_with_one_line(job):
    """Old: a KeyboardInterrupt traceback and status -2."""
    job.wait_for(r"^step +3/")
    sent = time.time()
    os.killpg(job.proc.pid, signal.SIGINT)
    status, took = job.finish(sent, ENDS_WITHIN_S)
    assert status == 130, job.text()
    err = job.text("err").splitlines()
    assert len(err) == 1 and re.fullmatch(r"interrupted at step \d+", err[0]), job.text()


# ---------------------------------------------------------------------- item 4: collective timeout
@pytest.mark.e2e
def test_a_stalled_rank_is_named_after_the_collective_timeout(job):
    """Three ranks; rank 1 sleeps before an all_reduce over ranks 0 and 1 (a group from
    new_group, whose own default timeout is gloo's 30 minutes); rank 2 idles. Old: rank 0
    waited 30 minutes."""
    status, took = job.finish(job.fault_time(), TIMEOUT_S + stall.grace_seconds(TIMEOUT_S) + ENDS_WITHIN_S)
    assert status == 1, job.text()
    assert took >= TIMEOUT_S, job.text()
    assert "argv ['--flag', 'x'] world 3" in job.text("out").splitlines(), job.text()  # python -m shardwise.launch
    report = (f"rank 0 waited {TIMEOUT_S} s for all_reduce #3 over mesh axis 'pair' (ranks [0, 1], 16 B); "
              f"rank 1 did not arrive; last collectives issued: rank 0: all_reduce #1 on 'pair', "
              f"all_reduce #2 on 'pair', all_reduce #3 on 'pair'")
    assert f"[rank 0] {report}" in job.text("err").splitlines(), job.text()  # the live rank says it
    assert job.text("err").splitlines()[-1] == f"FAILED: {report} (the other ranks were stopped)"
    _no_tracebacks_but(job, rank=None)
    job.assert_nothing_left()


@pytest.mark.e2e
def test_the_trainers_collective_timeout_names_a_stalled_rank(job):
    """--collective-timeout reaches the trainer's process group (gloo's default: 30 minutes)."""
    status, took = job.finish(job.fault_time(), TIMEOUT_S + stall.grace_seconds(TIMEOUT_S) + ENDS_WITHIN_S)
    assert status == 1, job.text()
    last = job.text("err").splitlines()[-1]
    assert re.fullmatch(rf"FAILED: rank 0 waited {TIMEOUT_S} s for \w+ #\d+ over mesh axis 'dp_shard' "
                        r"\(ranks \[0, 1\], [^)]+\); rank 1 did not arrive; last collectives issued: rank 0: (\w+ #\d+ on "
                        r"('\w+'|all ranks), ){0,3}\w+ #\d+ on 'dp_shard' \(the other ranks were stopped\)", last), last
    job.assert_nothing_left()


# ---------------------------------------------------------------------- item 8: non-finite loss
@pytest.mark.e2e
def test_a_non_finite_loss_stops_every_rank_at_the_same_step(job):
    """--lr inf: the first update makes the weights inf, the loss of step 2 is nan. Old: the
    run trained to its end on nan and exited 0. The shell's stray LOCAL_RANK and RANK do not
    make the launching process a worker (old: it was taken for one and failed to start)."""
    status, took = job.finish(time.time(), STARTUP_S)
    assert status == 3, job.text()
    errors = [line for line in job.text("err").splitlines() if "error" in line]
    assert errors == ["shardwise.train: error: the loss is not finite (nan or inf) at step 2: training diverged "
                      "(--lr inf); stopped without saving it (lower --lr, or clip gradients with --max-norm)"], job.text()
    assert re.search(r"^step +1/8", job.text("out"), re.MULTILINE) and not re.search(r"^step +2/", job.text("out"))
    assert "FAILED" not in job.text() and "Traceback" not in job.text(), job.text()


# ---------------------------------------------------------------------- who is a worker
_LAUNCHER_ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("stray", [{"LOCAL_RANK": "1"}, {"RANK": "1"}, {"RANK": "1", "WORLD_SIZE": "2"},
                                   {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0", "RANK": "0"}],
                         ids=lambda env: ",".join(env))
def test_stray_launcher_variables_do_not_make_a_worker(monkeypatch, stray):
    for name in [*_LAUNCHER_ENV, "LOCAL_RANK", "TORCHELASTIC_RUN_ID"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in stray.items():
        monkeypatch.setenv(name, value)
    assert not launch.under_launcher()


def test_the_variables_every_launcher_sets_make_a_worker(monkeypatch):
    for name, value in _LAUNCHER_ENV.items():
        monkeypatch.setenv(name, value)
    assert launch.under_launcher()


# ---------------------------------------------------------------------- python -m shardwise.launch
def test_launch_command_line(monkeypatch, capsys):
    assert launch._parse(["--nproc", "3", "-m", "pkg.mod", "--nproc", "9"]) == (3, None, ["-m", "pkg.mod", "--nproc", "9"])
    assert launch._parse(["--nproc=2", "--collective-timeout", "7.5", "x.py", "-v"]) == (2, "7.5", ["x.py", "-v"])
    for argv, message in ((["--nproc", "0", "x.py"], "--nproc must be a positive integer, got '0'"),
                          (["--collective-timeout", "inf", "x.py"], "--collective-timeout must be a positive"),
                          (["--verbose", "x.py"], "unknown option '--verbose'"),
                          (["--nproc", "2"], "no program given")):
        with pytest.raises(ValueError, match=re.escape(message)):
            launch._parse(argv)
    with pytest.raises(SystemExit) as stop:
        launch.main(["--help"])
    assert stop.value.code == 0 and capsys.readouterr().out == launch.USAGE
    for name, value in _LAUNCHER_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:  # under torchrun: --nproc must be its world size
        launch.main(["--nproc", "4", "x.py"])
    assert stop.value.code == 2
    assert "--nproc 4 differs from the launcher's world size 2" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["2", "script.py"], "no script '2': "),  # forgot --nproc
    (["--nproc", "2", "no_such_script.py"], "no script 'no_such_script.py': "),
    (["--nproc", "2", "-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
])
def test_a_missing_program_is_refused_before_any_worker_starts(monkeypatch, capsys, tmp_path, argv, message):
    monkeypatch.chdir(tmp_path)
    for name in _LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch, "launch", _must_not_start)
    with pytest.raises(SystemExit) as stop:
        launch.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"shardwise.launch: error: {message}") and err.count("\n") == 1, err
    if argv[0] == "2":
        assert "--nproc 2 goes before the script" in err


def _must_not_start(*args, **kwargs):
    raise AssertionError("the launcher started workers for a program that does not exist")


# ---------------------------------------------------------------------- the library setting
@pytest.mark.parametrize("text,kind", [
    ("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 4000ms for recv operation to complete", "timeout"),
    ("[../gloo/transport/tcp/unbound_buffer.cc:81] Application timeout caused pair closure", "timeout"),
    ("[../gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:1234", "peer"),
    ("gloo: unsupported reduction on this dtype", None),
])
def test_gloo_failure_wordings_are_classified(text, kind):
    """Each wording gloo uses for a timeout (either: the wait expiring, or the timeout closing the
    connection first) and for a lost peer; anything else is gloo's own error, re-raised."""
    assert comm.classify(text) == kind, text


def test_collective_timeout_setting(monkeypatch):
    monkeypatch.setattr(comm.timeout, "_timeout_s", None)
    monkeypatch.delenv(comm.TIMEOUT_ENV, raising=False)
    assert comm.collective_timeout() == timedelta(seconds=comm.DEFAULT_COLLECTIVE_TIMEOUT_S)
    monkeypatch.setenv(comm.TIMEOUT_ENV, "12.5")
    assert comm.collective_timeout() == timedelta(seconds=12.5)
    comm.set_collective_timeout(3)
    assert comm.collective_timeout() == timedelta(seconds=3)  # the call wins over the env var
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive number of seconds"):
            comm.set_collective_timeout(bad)
    monkeypatch.setattr(comm.timeout, "_timeout_s", None)
    monkeypatch.setenv(comm.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=r"\$SHARDWISE_COLLECTIVE_TIMEOUT='soon' is not a number of seconds"):
        comm.collective_timeout()


def test_stall_diagnosis_names_absent_ranks_and_ranks_stuck_elsewhere():
    """Four ranks of a group: 0 times out on all_reduce #7; 1 posted the same; 2 waits in
    another collective; 3 posted nothing. Each post's last collectives are listed, per rank."""
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    call = comm.CollectiveCall("all_reduce", 7, (0, 1, 2, 3), "dp", 4096)
    other = comm.CollectiveCall("broadcast", 2, (2, 5), "tp", 8)
    last = {1: ["all_gather #6 on 'dp'", "all_reduce #7 on 'dp'"], 2: ["broadcast #2 on 'tp'"]}
    for rank, posted in ((1, call), (2, other)):
        store.set(f"{stall.STALL_PREFIX}{rank}", json.dumps({"key": stall._key(posted), "desc": posted.describe(),
                                                             "last": last[rank]}))
    recent = [comm.CollectiveCall("all_reduce", 6, (0, 1, 2, 3), "dp", 4096), call]
    began = time.monotonic()
    missing, message = stall.diagnose(call, 0, 2.0, store=store, recent=recent)
    assert missing == (3,)
    assert message == ("rank 0 waited 2 s for all_reduce #7 over mesh axis 'dp' (ranks [0, 1, 2, 3], 4.0 KiB); "
                       "rank 3 did not arrive; rank 2 is waiting on broadcast #2 over mesh axis 'tp' (ranks [2, 5], "
                       "8 B) instead; last collectives issued: rank 0: all_reduce #6 on 'dp', all_reduce #7 on 'dp'; "
                       "rank 1: all_gather #6 on 'dp', all_reduce #7 on 'dp'; rank 2: broadcast #2 on 'tp'")
    assert time.monotonic() - began >= stall.grace_seconds(2.0)  # rank 3 had its grace
