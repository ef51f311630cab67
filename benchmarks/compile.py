#!/usr/bin/env python
"""torch.compile benchmark: the trainer's model, eager and compiled, shardwise and torch, in one run.

    python benchmarks/compile.py                 # tiny config, modes tp, fsdp, fsdp_tp, 4 CPU ranks
    python benchmarks/compile.py --config debug --reps 6 --backend inductor

For every mode the same model and plan (``benchmarks/train_step.py``'s modes and builders) is
built three times: shardwise eager, shardwise with every block compiled, and torch's own
DTensor/FSDP2 with every block compiled (``block.compile(backend=...)`` after parallelizing,
the torchtitan pattern). Reported per mode:

* median step time (forward, loss, backward, AdamW) of each, slowest rank, repetitions
  interleaved; ratios compiled/eager (shardwise) and shardwise/torch (compiled), both also in CPU
  time (each rank's process_time over the step, the largest: what the step computes, without
  waits, so less swayed by other load on the machine);
* compile time: the first step's time minus the median step;
* collectives per step, counted from the profiler's record of the backend's calls (eager and
  compiled alike; torch's CommDebugMode would make Dynamo run the compiled blocks eagerly);
* agreement of the losses of the three (same weights, same data).

The last rows measure compiled per-op overhead: the same elementwise/matmul chain (32 and 128
ops) compiled on replicated DTensors and on plain tensors (no communication; rank 0's CPU time
while the others wait). Printed: each length's DTensor/plain ratio per call, the per-op ratio
(the slope between the two lengths) and the DTensor program's fixed cost per call (guards on
its DTensor inputs, unwrapping them, wrapping its output). ``--modes ""`` runs these rows only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _worker import gloo_worker, native_stderr_silenced, say, slowest

from shardwise.launch import main_or_launch

NPROC = 4
MODES = ("tp", "fsdp", "fsdp_tp")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help="model shapes (default tiny)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, among {', '.join(MODES)}")
    p.add_argument("--reps", type=int, default=5, help="timed steps per variant and mode")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--show-losses", action="store_true", help="print every variant's losses")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    return args


OVERHEAD_ROUNDS, OVERHEAD_CALLS = 15, 100
SHORT, LONG = 8, 32  # chain lengths, in (matmul, tanh, mul, add) groups: 32 and 128 ops


def _chain(x, w, groups: int):
    import torch

    for _ in range(groups):
        x = torch.tanh(x @ w) * 0.5 + x
    return x


# One function per variant: each compiled program has its own code object and Dynamo cache.
def _plain_short(x, w):
    return _chain(x, w, SHORT)


def _dtensor_short(x, w):
    return _chain(x, w, SHORT)


def _plain_long(x, w):
    return _chain(x, w, LONG)


def _dtensor_long(x, w):
    return _chain(x, w, LONG)


CHAINS = {"plain short": _plain_short, "dtensor short": _dtensor_short,
          "plain long": _plain_long, "dtensor long": _dtensor_long}





class Bench:
    def __init__(self, args) -> None:
        import torch
        import torch.distributed as dist

        self.args, self.torch, self.dist = args, torch, dist
        self.rank = dist.get_rank()

    say = staticmethod(say)
    slowest = staticmethod(slowest)

    def jobs(self, mode: str, meshes: dict, data) -> dict:
        from train_step import build_job

        from shardwise.train.models.llama import LLAMA
        from shardwise.train.parallelize import apply_compile

        out = {"sw eager": build_job("shardwise", mode, self.args, meshes, data)}
        for name, lib in (("sw compiled", "shardwise"), ("torch compiled", "torch")):
            job = build_job(lib, mode, self.args, meshes, data)
            apply_compile(LLAMA.block_modules(job.model), self.args.backend)
            out[name] = job
        return out

    def collectives(self, job, i: int) -> int:
        """Collectives one step issues, counted from the profiler's record of the backend's calls
        (``gloo:all_reduce`` ...): one per collective, eager or issued from compiled code.

        Not torch's CommDebugMode: a dispatch mode makes Dynamo skip compiled frames ("non-infra
        torch dispatch mode present"), so under it a compiled model runs eagerly and the count
        would be the eager step's.
        """
        from torch.profiler import ProfilerActivity, profile

        with native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
            job.step(i)
        return sum(1 for e in prof.events() if e.name.startswith(("gloo:", "nccl:")) and "barrier" not in e.name)

    def measure(self, mode: str, meshes: dict, data) -> dict:
        jobs = self.jobs(mode, meshes, data)
        first, failed = {}, {}
        for name, job in list(jobs.items()):  # the first step compiles
            self.dist.barrier()
            t0 = time.perf_counter()
            error = ""
            try:
                job.record_loss(job.step(0))
            except Exception as err:  # every rank fails alike (same program); reported, not fatal
                error = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
            if self.slowest(float(bool(error))):
                failed[name] = error or "failed on another rank"
                del jobs[name]
                continue
            first[name] = self.slowest(time.perf_counter() - t0)
        counts = {name: self.collectives(job, 1) for name, job in jobs.items()}
        for name, job in jobs.items():
            job.record_loss(job.step(2))
        order = list(jobs.items())
        cpu: dict[str, list[float]] = {name: [] for name in jobs}
        for i in range(self.args.reps):
            for name, job in (order if i % 2 == 0 else order[::-1]):
                self.dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = job.step(3 + i)
                c1, t1 = time.process_time(), time.perf_counter()
                job.times.append(self.slowest(t1 - t0))
                cpu[name].append(self.slowest(c1 - c0))
                job.record_loss(loss)
        median = {name: statistics.median(job.times) for name, job in jobs.items()}
        cpu_median = {name: statistics.median(values) for name, values in cpu.items()}
        base = jobs["sw eager"].losses
        diff = max(max(abs(a - b) / abs(b) for a, b in zip(job.losses, base)) for job in jobs.values())
        if self.rank == 0 and self.args.show_losses:
            for name, job in jobs.items():
                print(f"    {mode} {name}: {[round(x, 5) for x in job.losses]}")
        return {"median": median, "cpu": cpu_median, "compile": {n: first[n] - median[n] for n in jobs},
                "counts": counts, "diff": diff, "failed": failed}

    def overhead(self) -> dict[str, float]:
        """Compiled elementwise/matmul chains, DTensor blocks vs plain tensors (median CPU seconds per call).

        Each variant is its own function (its own code object, so its own Dynamo cache: no call
        checks another variant's guards first), compiled alone; rank 0 times them (the others
        wait: four ranks on few cores would time contention) with the process's CPU-time clock
        (time.process_time: a rank descheduled by load does not count), ``OVERHEAD_ROUNDS``
        interleaved rounds, median. Two chain lengths separate what a DTensor program pays per
        op (the slope: the compiled graphs are the same kernels) from what it pays once per call
        at the subclass boundary (guards on the DTensor inputs, unwrapping them, wrapping the
        output).
        """
        import shardwise as sw
        from shardwise import Replicate

        torch = self.torch
        world = sw.init_device_mesh("cpu", (NPROC,))
        torch.manual_seed(0)
        x, w = torch.randn(64, 64), torch.randn(64, 64) / 8
        dx, dw = (sw.distribute_tensor(t, world, [Replicate()]) for t in (x, w))
        compiled = {name: torch.compile(fn, backend=self.args.backend, dynamic=False) for name, fn in CHAINS.items()}
        inputs = {"plain": (x, w), "dtensor": (dx, dw)}
        variants = [(name, fn, inputs[name.split()[0]]) for name, fn in compiled.items()]
        for _, fn, args in variants:
            for _ in range(3):
                fn(*args)
        samples: dict[str, list[float]] = {name: [] for name in compiled}
        if self.rank == 0:
            for i in range(OVERHEAD_ROUNDS):  # interleaved, alternating order, so load changes hit all alike
                for name, fn, args in (variants if i % 2 == 0 else variants[::-1]):
                    t0 = time.process_time()
                    for _ in range(OVERHEAD_CALLS):
                        fn(*args)
                    samples[name].append((time.process_time() - t0) / OVERHEAD_CALLS)
        self.dist.barrier()
        if self.rank != 0:
            return {}
        return {name: statistics.median(values) for name, values in samples.items()}

    def run(self) -> int:
        from train_step import torch_mesh

        from shardwise.parallel import ParallelDims
        from shardwise.train.config import get_model_args
        from shardwise.train.data import BatchSource, load_corpus

        a = self.args
        self.say(f"compile: config {a.config!r} ({get_model_args(a.config).num_params() / 1e6:.2f}M params), "
                 f"{NPROC} ranks (gloo, CPU), backend {a.backend}, batch {a.global_batch} x {a.seq_len}, "
                 f"{a.reps} timed steps per variant")
        import train_step

        rows = []
        for mode in a.modes:
            self.torch._dynamo.reset()
            dims = ParallelDims(world_size=NPROC, **train_step.MODES[mode][0])
            sw_mesh = dims.build_mesh("cpu")
            meshes = {mode: (dims, sw_mesh, torch_mesh(dims))}
            dp_rank = sw_mesh["dp"].get_local_rank() if dims.dp_enabled else 0
            data = BatchSource(load_corpus(), a.global_batch, a.seq_len, 0, dims.dp_degree, dp_rank)
            rows.append((mode, self.measure(mode, meshes, data)))
            self.say(f"  measured {mode}")
        overhead = self.overhead()
        if self.rank == 0:
            self.report(rows, overhead)
        return 0

    def report(self, rows: list, chains: dict[str, float]) -> None:
        names = ("sw eager", "sw compiled", "torch compiled")
        head = (f"{'mode':<8} " + " ".join(f"{n + ' s':>17}" for n in names)
                + f" {'sw compiled/eager':>17} {'(CPU time)':>10} {'sw/torch compiled':>17} {'(CPU time)':>10}   collectives/step (sw eager, sw compiled, "
                  "torch compiled)   compile s (sw, torch)   loss rel diff")
        print("\n" + head + "\n" + "-" * len(head))
        nan = float("nan")
        for mode, r in rows:
            m, c, k, cpu = r["median"], r["counts"], r["compile"], r["cpu"]
            t = {n: m.get(n, nan) for n in names}
            print(f"{mode:<8} " + " ".join(f"{t[n]:>17.4f}" for n in names)
                  + f" {t['sw compiled'] / t['sw eager']:>17.2f}"
                  + f" {cpu.get('sw compiled', nan) / cpu.get('sw eager', nan):>10.2f}"
                  + f" {t['sw compiled'] / t['torch compiled']:>17.2f}"
                  + f" {cpu.get('sw compiled', nan) / cpu.get('torch compiled', nan):>10.2f}"
                  + "   " + " ".join(f"{c.get(n, '-'):>4}" for n in names)
                  + f"{'':>28}{k.get('sw compiled', nan):>6.1f} {k.get('torch compiled', nan):>6.1f}   {r['diff']:.1e}")
            for name, error in r["failed"].items():
                print(f"         !! {name} failed: {error}")
        per_op = (chains["dtensor long"] - chains["dtensor short"]) / (chains["plain long"] - chains["plain short"])

        def fixed(kind: str) -> float:  # the intercept: time per call of a chain of no ops
            short, long = chains[f"{kind} short"], chains[f"{kind} long"]
            return short - SHORT * (long - short) / (LONG - SHORT)

        boundary = fixed("dtensor") - fixed("plain")
        print(f"\ncompiled chains, CPU time per call (median of {OVERHEAD_ROUNDS} x {OVERHEAD_CALLS} calls):")
        for groups, length in ((SHORT, "short"), (LONG, "long")):
            p, d = chains[f"plain {length}"], chains[f"dtensor {length}"]
            print(f"  {4 * groups:>3}-op chain: plain {p * 1e6:.1f} us, DTensor {d * 1e6:.1f} us, ratio {d / p:.3f}")
        print(f"  per op (slope between the two lengths): DTensor/plain {per_op:.3f} (goal <= 1.05); "
              f"per call at the DTensor boundary: {boundary * 1e6:.1f} us")


def worker() -> int:
    import torch

    torch._dynamo.config.cache_size_limit = 64  # both libraries' blocks share TransformerBlock.forward's code
    return gloo_worker(lambda: Bench(parse_args(sys.argv[1:])).run())


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and bad flags answer once, before any worker starts
    main_or_launch(worker, NPROC)
