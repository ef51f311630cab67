#!/usr/bin/env python
"""fully_shard overlap benchmark: step time with prefetch on vs off, and torch's fully_shard, in one run.

    python benchmarks/overlap.py                 # 2 CPU ranks, 6 compute-heavy blocks
    python benchmarks/overlap.py --quick         # smaller, fewer steps (smoke check)
    python benchmarks/overlap.py --nproc 4 --blocks 8 --width 768 --repeat 6

Every block is ``repeat`` passes of the same two matmuls (``width x 4*width`` and back), so its
compute is ``repeat`` times that of its parameters' size while its all_gather stays the same:
an artificial compute-heavy block, so that communication can hide behind compute. gloo runs its
collectives on its own threads, so on CPU a prefetched all_gather (issued before the previous
block computes) and a reduce_scatter left in flight overlap the step's compute when the machine
has a free core per rank.

Compared, on the same model, data and seed (one unit per block plus the root):

    sw               shardwise fully_shard, default prefetch (the previous step's module order)
    sw-no-prefetch   shardwise with set_modules_to_forward/backward_prefetch([]) on every module
    torch            torch.distributed.fsdp.fully_shard, its defaults
    torch-prefetch   torch with the same explicit forward/backward prefetch as shardwise's default

Step = forward, loss, backward, SGD step. Each repetition is timed from a barrier on the slowest
rank; the variants alternate within a repetition. The losses of all variants must agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _worker import gloo_worker, say, slowest

from shardwise.launch import main_or_launch

EXIT_WRONG = 3
VARIANTS = ("sw", "sw-no-prefetch", "torch", "torch-prefetch")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--blocks", type=int, default=None, help="blocks (default 6; --quick 3)")
    p.add_argument("--width", type=int, default=None, help="model width (default 512; --quick 128)")
    p.add_argument("--repeat", type=int, default=2, help="passes of each block's matmuls (compute per parameter)")
    p.add_argument("--batch", type=int, default=None, help="rows per rank (default 32; --quick 16)")
    p.add_argument("--reps", type=int, default=None, help="timed steps per variant (default 6; --quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (the order is learned)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    a.blocks = a.blocks or (3 if a.quick else 6)
    a.width = a.width or (128 if a.quick else 512)
    a.batch = a.batch or (16 if a.quick else 32)
    a.reps = a.reps or (3 if a.quick else 6)
    if a.nproc < 2:
        p.error("--nproc must be at least 2 (overlap needs communication)")
    return a


def _model(a: argparse.Namespace):
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(a.width, 4 * a.width)
            self.down = nn.Linear(4 * a.width, a.width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(a.repeat):
                x = x + self.down(torch.relu(self.up(x))) / a.repeat
            return x

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(a.blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    return Stack()


def _build(variant: str, a: argparse.Namespace):
    model = _model(a)
    layers = list(model.layers)
    if variant.startswith("sw"):
        import shardwise as sw
        from shardwise.fsdp import fully_shard

        mesh = sw.init_device_mesh("cpu", (a.nproc,))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (a.nproc,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if variant == "sw-no-prefetch":
        for m in layers + [model]:
            m.set_modules_to_forward_prefetch([])
            m.set_modules_to_backward_prefetch([])
    if variant == "torch-prefetch":
        model.set_modules_to_forward_prefetch(layers[:1])
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
            layer.set_modules_to_backward_prefetch(layers[i - 1:i] if i else [])
        model.set_modules_to_backward_prefetch(layers[-1:])
    return model


def _step(model, optimizer, x, y) -> float:
    loss = (model(x) - y).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def run(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    params = sum(p.numel() for p in _model(a).parameters())
    say(f"overlap: {a.nproc} ranks (gloo, CPU), {a.blocks} blocks x {a.repeat} passes, width {a.width} "
        f"({params / 1e6:.2f}M params), {a.batch} rows/rank, {a.warmup} warm-up + {a.reps} timed steps per variant")
    torch.manual_seed(1 + rank)
    x, y = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    runs = {}
    for v in VARIANTS:
        model = _build(v, a)
        runs[v] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
    times = {v: [] for v in VARIANTS}
    losses = {v: [] for v in VARIANTS}
    for rep in range(a.warmup + a.reps):
        order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
        for v in order:
            dist.barrier()
            start = time.perf_counter()
            loss = _step(*runs[v], x, y)
            took = slowest(time.perf_counter() - start)
            losses[v].append(loss)
            if rep >= a.warmup:
                times[v].append(took)
    median = {v: statistics.median(times[v]) for v in VARIANTS}
    diff = max(abs(a_ - b) / max(abs(b), 1e-12) for v in VARIANTS for a_, b in zip(losses[v], losses["torch"]))
    diff = slowest(diff)
    if rank == 0:
        print(f"\n{'variant':<16} {'median step s':>13} {'vs sw':>7}")
        for v in VARIANTS:
            print(f"{v:<16} {median[v]:>13.4f} {median[v] / median['sw']:>7.2f}")
        print(f"prefetch on/off: {median['sw'] / median['sw-no-prefetch']:.2f}   "
              f"shardwise/torch: {median['sw'] / median['torch']:.2f}   "
              f"shardwise/torch-prefetch: {median['sw'] / median['torch-prefetch']:.2f}   "
              f"loss rel diff {diff:.1e}")
    return EXIT_WRONG if diff > 1e-4 else 0


def worker() -> int:
    return gloo_worker(lambda: run(parse_args(sys.argv[1:])))


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    main_or_launch(worker, args.nproc, quiet_codes=(EXIT_WRONG,))
