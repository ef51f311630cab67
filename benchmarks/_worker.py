"""The body every benchmark worker shares: quiet warnings, one thread, a gloo group around the run."""

from __future__ import annotations

import warnings
from typing import Callable


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
