"""The demo: 4 local processes, a (2, 2) mesh, one tensor walked through every placement.

Run ``python -m shardwise.demo``; it starts the 4 gloo processes itself (torch's elastic
launcher), so no torchrun knowledge is needed. Each step prints what every rank holds and which
collective moved it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.launch.launcher import close_process_group, main_or_launch

STEPS = [
    [Replicate(), Replicate()],
    [Shard(0), Replicate()],
    [Shard(0), Shard(1)],
    [Shard(1), Shard(0)],
    [Replicate(), Shard(1)],
    [Partial(), Shard(1)],
    [Partial(), Partial()],
    [Shard(0), Shard(0)],
    [Replicate(), Replicate()],
]


LEGEND = """\
How to read it:
  placements, one per mesh axis in mesh order (dp, tp):
    R       Replicate(): every rank of that axis holds the same data
    S(d)    Shard(d): tensor dim d is cut into contiguous blocks, one per rank of that axis
    P(sum)  Partial(sum): every rank holds a summand; the value is the sum over that axis
  layout, e.g. f32[4@tp,6@dp]{P(sum)@dp}: dtype float32, global shape (4, 6), dim 0 split
    over the tp axis, dim 1 over dp, and a sum over dp still pending
  rank r (i, j): the rank, its coordinate on the (dp, tp) mesh, and the block it holds"""


def _gather_text(text: str) -> list[str]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, text)
    return out


def _show(title: str, dt: sw.DTensor, comms: CommDebugMode) -> None:
    local = dt.to_local()
    line = f"  rank {dist.get_rank()} {tuple(dt.device_mesh.get_coordinate())}: {local.tolist()}"
    lines = _gather_text(line)
    moved = ", ".join(f"{k} x{v}" for k, v in comms.get_comm_counts().items()) or "no communication"
    if dist.get_rank() == 0:
        print(f"\n{title}  [{moved}, {comms.bytes_sent} B sent by rank 0]")
        print("\n".join(lines), flush=True)


def worker() -> int:
    torch.set_num_threads(1)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    if dist.get_rank() == 0:
        print(f"mesh {mesh}: ranks {mesh.mesh.tolist()}\nglobal tensor x (4, 6):\n{x}\n\n{LEGEND}")
    dt = sw.distribute_tensor(x, mesh, STEPS[0])
    for placements in STEPS[1:]:
        with CommDebugMode() as comms:
            dt = dt.redistribute(mesh, placements)
        _show(f"-> {[str(p) for p in placements]}  {dt._spec.render()}", dt, comms)
    assert torch.equal(dt.full_tensor(), x), "the walk did not return to x"
    if dist.get_rank() == 0:
        print("\nback to Replicate everywhere: every rank holds x again.")
    close_process_group()
    return 0


def main() -> None:
    main_or_launch(worker, nproc=4, module="shardwise.demo")


if __name__ == "__main__":
    main()
