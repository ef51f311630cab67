"""Fault injection for the jobs of tests/test_job_failures.py (kept out of the library).

``$FAULT`` is ``KIND:RANK:STEP``; ``maybe_fail(rank, step)`` fires it when both match:

    raise   raise RuntimeError("injected out of memory")
    stall   sleep forever (a rank stuck outside any collective)
    sigint  send itself SIGINT (Ctrl-C delivered to one worker only)
    kill    kill itself with SIGKILL (dies without a word, as the OOM killer does)

It first prints ``FAULT <kind> rank <r> step <n> at <time.time()>`` to stderr, so a test can
time the job's end from the fault.
"""

import os
import signal
import sys
import time


def maybe_fail(rank: int, step: int) -> None:
    spec = os.environ.get("FAULT", "")
    if not spec:
        return
    kind, who, when = spec.split(":")
    if int(who) != rank or int(when) != step:
        return
    print(f"FAULT {kind} rank {rank} step {step} at {time.time():.3f}", file=sys.stderr, flush=True)
    if kind == "raise":
        raise RuntimeError("injected out of memory")
    if kind == "stall":
        time.sleep(3600)
    if kind == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(3600)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"unknown fault kind {kind!r} in FAULT={spec!r}")
