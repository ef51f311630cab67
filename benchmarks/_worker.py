"""What every benchmark worker shares: quiet warnings, one thread, a gloo group around the run,
and the profiler's native stderr lines silenced."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Callable, Iterator


def gloo_worker(run: Callable[[], int]) -> int:
    """Run ``run()`` on this rank inside a gloo process group; its status is the worker's."""
    import torch
    import torch.distributed as dist

    from shardwise.launch import close_process_group

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    status = run()
    close_process_group()  # after an error the launcher stops the other ranks
    return status


def say(text: str) -> None:
    """Print once, on rank 0."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(text, flush=True)


def slowest(value: float) -> float:
    """The largest ``value`` over all ranks (a time: the step is as slow as its slowest rank)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """The profiler's native library prints a line per start and stop on the process's stderr
    (file descriptor 2): send them nowhere. Python exceptions still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
