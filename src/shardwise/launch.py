"""Run a program on N local processes without asking the user for torchrun.

``main_or_launch(worker, nproc)`` either runs ``worker()`` (when this process is already one of
the workers: torchrun / the elastic agent set RANK, LOCAL_RANK and TORCHELASTIC_RUN_ID), or
starts ``nproc`` copies of the current program (a script, or ``python -m module``) through
torch's elastic launcher and waits. Under torchrun on many hosts the same program just runs.

The elastic agent watches the workers: if one exits non-zero (an exception, a gloo timeout)
the others are stopped and the launcher exits non-zero, instead of the job hanging on a
collective that one rank never enters.
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Callable

_WORKER_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK")


def under_launcher() -> bool:
    """True in a worker started by torchrun or the elastic launcher."""
    return any(name in os.environ for name in _WORKER_ENV)


def launch(python_args: list[str], nproc: int, quiet_codes: tuple[int, ...] = ()) -> int:
    """Start ``nproc`` local workers running ``python *python_args``; return the exit status.

    A failure where every failed worker exited with one of ``quiet_codes`` is a verdict the
    workers already printed (not a crash): its code is returned without the agent's report.
    """
    # Each worker is single-threaded: 4 processes share 2 cores on small machines.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every non-zero exit; failures are reported below instead, once.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-u", *python_args)
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if len(codes) == 1 and codes <= set(quiet_codes):
            code = codes.pop()
            print(f"(workers exited with status {code}: see the report above)", file=sys.stderr, flush=True)
            return code
        print(f"\nFAILED: a worker exited with an error; the others were stopped.\n{err.format_msg()}",
              file=sys.stderr, flush=True)
        return 1
    except Exception as err:  # rendezvous errors, agent errors
        print(f"\nFAILED: launcher error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


def close_process_group() -> None:
    """Tear the default process group down once every rank is done with it.

    The barrier first matters: a rank that destroys its gloo connections (or exits) while a
    peer is still finishing its last collective can abort the peer at exit ("terminate called
    without an active exception"). Call it on the success path only: after an error the
    launcher stops the other workers instead.
    """
    import torch.distributed as dist

    from shardwise import comm

    if dist.is_initialized():
        comm.barrier()
        dist.destroy_process_group()


def main_or_launch(
    worker: Callable[[], int | None],
    nproc: int,
    quiet_codes: tuple[int, ...] = (),
    module: str | None = None,
) -> None:
    """Run ``worker`` here if we are a worker, else launch ``nproc`` workers of this program.

    Args:
        worker: the per-rank main; its return value is the exit status.
        nproc: local processes to start when not already under a launcher.
        quiet_codes: worker exit statuses that are verdicts, not crashes (reported briefly).
        module: run the workers as ``python -m module`` (else the current script).
    """
    if under_launcher():
        from torch.distributed.elastic.multiprocessing.errors import record

        status = record(worker)()
        close_process_group()  # if the worker left it open
        sys.exit(int(status or 0))
    program = ["-m", module] if module else [os.path.abspath(sys.argv[0])]
    sys.exit(launch(program + sys.argv[1:], nproc, quiet_codes))
