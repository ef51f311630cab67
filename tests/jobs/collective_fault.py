"""A small distributed job for tests/test_job_failures.py: a fault on one rank (faults.py).

Rank 0 prints its argv, then every rank all_reduces a tensor over a 1-D mesh of the world once
per step, through shardwise.comm as the library does (``$GROUP=pair``: over a mesh of ranks 0
and 1 only, whose group comes from new_group, while the other ranks idle); rank 0 prints
``step N`` after each, and an interruption says ``interrupted at step N``. ``$RAW=1``: torch.distributed.all_reduce over the world instead (a collective shardwise did not
issue). ``$STEPS`` (default
1000) and ``$STEP_S`` (default 0.05 s) pace the run. Run it under a launcher:
``python -m shardwise.launch --nproc 2 tests/jobs/collective_fault.py`` or
``torchrun --nproc-per-node 2 -m shardwise.launch tests/jobs/collective_fault.py``.
"""

import os
import sys
import time

import torch
from faults import maybe_fail

from shardwise import DeviceMesh, comm, init_device_mesh
from shardwise.launch.worker import interrupt_context


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    if os.environ.get("GROUP") == "pair":  # ranks 0 and 1 only: a group from new_group
        mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("pair",))
    rank = mesh.get_rank()
    if rank == 0:
        print(f"argv {sys.argv[1:]} world {world}", flush=True)
    x = torch.ones(4)
    step = 0
    with interrupt_context(lambda: f"at step {step}"):  # Ctrl-C says where the job was
        for step in range(1, int(os.environ.get("STEPS", "1000")) + 1):
            maybe_fail(rank, step)
            if os.environ.get("RAW"):  # torch's own collective, as FSDP hooks or user code issue them
                torch.distributed.all_reduce(x)
            elif mesh.get_coordinate() is not None:
                x = comm.all_reduce(x, mesh, 0, "avg")
            if rank == 0:
                print(f"step {step}", flush=True)
            time.sleep(float(os.environ.get("STEP_S", "0.05")))


if __name__ == "__main__":
    main()
