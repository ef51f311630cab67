"""Reports how a launched worker started, then leaves with ``os._exit(0)`` (tests/test_launch_start.py).

Printed per rank: whether torch was already imported when this script began (a forked worker
inherits the launcher's imports; a spawned one starts empty) and torch's intra-op threads.
"""

import os
import sys

preloaded = "torch" in sys.modules

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardwise.launch import main_or_launch  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    ones = torch.ones(1)
    dist.all_reduce(ones)
    print(f"rank {dist.get_rank()}: preloaded={preloaded} threads={torch.get_num_threads()} sum={int(ones)}", flush=True)
    os._exit(0)  # no return, no teardown: the launcher must still see a finished worker


if __name__ == "__main__":
    main_or_launch(main, nproc=2)
