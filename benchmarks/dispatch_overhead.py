#!/usr/bin/env python
"""Eager dispatch overhead per op: shardwise vs torch.distributed.tensor, on the cached path.

    python benchmarks/dispatch_overhead.py             # full run (world sizes 1 and 4)
    python benchmarks/dispatch_overhead.py --quick     # fewer iterations (< 60 s)
    python benchmarks/dispatch_overhead.py --ops mm,view --worlds 4
    python benchmarks/dispatch_overhead.py --clock cpu # CPU time of the timing thread (loaded machine)
    python benchmarks/dispatch_overhead.py --worlds 1 --clock cpu --sessions 5   # the floor comparison

Overhead of an op = (time of the op on DTensors) - (time of the same op on plain tensors that are
this rank's local blocks). Every layout is chosen so that the op needs NO communication (each
op is first run once under both libraries' CommDebugMode to check that, and its local result is
compared with the plain op on the local blocks), so what is left is the cost of dispatch:
unwrapping, sharding propagation (a cache hit after warm-up), local call, rewrapping.

The reference "wrapper" column is a minimal ``_make_wrapper_subclass`` tensor whose
``__torch_dispatch__`` unwraps, calls and rewraps (one plain pass over the arguments, no
pytree): the floor any Python tensor subclass pays.

Each world size runs as its own group of local gloo processes (world 1: one process). Only rank
0 times (timeit-style: ``--number`` calls per repeat, the variants interleaved so machine load
hits them alike, gc off; the fastest of ``--repeat`` repeats, since load only ever adds time,
or with ``--stat median`` their median); the other ranks wait at a barrier so they do not
compete for the cores. An overhead is a difference of two timings, so its noise is theirs
added: the per-op ratios to the floor move by tens of percent between runs on a shared machine
with the median, much less with the fastest repeat.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

from shardwise.launch import close_process_group, launch, under_launcher

OPS = ("add", "mul", "relu", "sum", "mm", "linear", "view", "transpose", "layer_norm", "softmax",
       "embedding", "clone")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations (< 60 s)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated ops (default: all of {','.join(OPS)})")
    p.add_argument("--worlds", default="1,4", help="comma-separated world sizes (default 1,4)")
    p.add_argument("--size", type=int, default=16, help="global tensors are SIZE x SIZE (default 16)")
    p.add_argument("--number", type=int, default=None, help="calls per timed repeat (default 1000, --quick 60)")
    p.add_argument("--repeat", type=int, default=None, help="timed repeats (default 11, --quick 5)")
    p.add_argument("--sessions", type=int, default=1,
                   help="fresh process groups per world size; the summary takes each op's median over them "
                        "(default 1)")
    p.add_argument("--stat", choices=("min", "median"), default="min",
                   help="statistic over the repeats: the fastest (default; load only adds time) or the median")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time (default), or the timing thread's CPU time: steadier on a shared, loaded machine")
    p.add_argument("--_out", default=None, help=argparse.SUPPRESS)  # worker -> parent results file
    args = p.parse_args(argv)
    args.op_list = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.op_list if o not in OPS]
    if bad:
        p.error(f"unknown ops {bad}; choose from {','.join(OPS)}")
    args.world_list = [int(w) for w in args.worlds.split(",")]
    if args.number is None:
        args.number = 60 if args.quick else 1000
    if args.repeat is None:
        args.repeat = 5 if args.quick else 11
    if args.sessions < 1:
        p.error("--sessions must be >= 1")
    if args.size % 4:
        p.error("--size must be a multiple of 4 (the view case splits a dim into 4)")
    return args


# ====================================================================== the op cases
@dataclass
class Case:
    """One op: global inputs, a placement name per input ("R", "S0", "S1"), the call."""

    fn: Callable[..., Any]
    inputs: list
    layouts: list[str]


def make_case(op: str, n: int) -> Case:
    """The op on n x n float32 tensors, with a layout that needs no communication."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=g)
    y = torch.randn(n, n, generator=g)
    w = torch.randn(n, n, generator=g)
    b = torch.randn(n, generator=g)
    cases = {
        "add": Case(lambda a, c: a + c, [x, y], ["S0", "S0"]),
        "mul": Case(lambda a, c: a * c, [x, y], ["S0", "S0"]),
        "relu": Case(torch.relu, [x], ["S0"]),
        "sum": Case(torch.sum, [x], ["S0"]),  # -> Partial(sum): no communication until read
        "mm": Case(torch.mm, [x, w], ["S0", "R"]),
        "linear": Case(F.linear, [x, w, b], ["S0", "R", "R"]),
        "view": Case(lambda a: a.view(a.shape[0], 4, a.shape[1] // 4), [x], ["S0"]),
        "transpose": Case(lambda a: a.transpose(0, 1), [x], ["S0"]),
        "layer_norm": Case(lambda a, wt, bs: F.layer_norm(a, (a.shape[1],), wt, bs), [x, b, b.flip(0)],
                           ["S0", "R", "R"]),
        "softmax": Case(lambda a: torch.softmax(a, dim=1), [x], ["S0"]),
        "embedding": Case(F.embedding, [torch.randint(0, n, (n,), generator=g), w], ["S0", "R"]),
        "clone": Case(torch.clone, [x], ["S0"]),
    }
    return cases[op]


# ====================================================================== the floor
def make_wrapper_cls():
    """A minimal Python tensor subclass: unwrap, call, rewrap. Its overhead is the floor.

    No pytree: one pass over the arguments (and one level of lists), which is all these ops
    need, so the floor is not inflated by a generic tree walk.
    """
    import torch

    class Wrapper(torch.Tensor):
        __slots__ = ("elem",)

        @staticmethod
        def __new__(cls, elem):
            r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                    device=elem.device, requires_grad=False)
            r.elem = elem
            return r

        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            def unwrap(t):
                if isinstance(t, Wrapper):
                    return t.elem
                if isinstance(t, (list, tuple)):
                    return type(t)(unwrap(x) for x in t)
                return t

            out = func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})
            if isinstance(out, torch.Tensor):
                return Wrapper(out)
            if isinstance(out, (list, tuple)):
                return type(out)(Wrapper(t) if isinstance(t, torch.Tensor) else t for t in out)
            return out

    return Wrapper


# ====================================================================== results
@dataclass
class Row:
    op: str
    plain_us: float = float("nan")
    torch_us: float = float("nan")
    sw_us: float = float("nan")
    wrapper_us: float = float("nan")
    torch_error: str = ""
    sw_error: str = ""
    notes: str = ""

    @property
    def torch_over(self) -> float:
        return self.torch_us - self.plain_us

    @property
    def sw_over(self) -> float:
        return self.sw_us - self.plain_us

    @property
    def wrapper_over(self) -> float:
        return self.wrapper_us - self.plain_us


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"


# ====================================================================== the worker
def worker() -> int:
    args = parse_args(sys.argv[1:])
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rows = Bench(args).run()
    close_process_group()  # after an error the launcher stops the other ranks
    if args._out and rows is not None:
        with open(args._out, "w") as f:
            json.dump([asdict(r) for r in rows], f)
    return 0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.tensor as tdt
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh

        import shardwise as sw

        self.args = args
        self.torch, self.dist, self.sw, self.tdt = torch, dist, sw, tdt
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.sw_mesh = sw.init_device_mesh("cpu", (self.world,))
        self.t_mesh = torch_mesh("cpu", (self.world,))
        self.Wrapper = make_wrapper_cls()

    def say(self, *a) -> None:
        if self.rank == 0:
            print(*a, flush=True)

    # ------------------------------------------------------------------ inputs
    def block(self, t, layout: str):
        """This rank's block of global ``t`` laid out as ``layout`` (torch.chunk semantics)."""
        if layout == "R":
            return t.clone()
        dim = int(layout[1:])
        size, n, i = t.shape[dim], self.world, self.rank
        chunk = -(-size // n)
        start = min(i * chunk, size)
        return t.narrow(dim, start, max(0, min(size, start + chunk) - start)).clone()

    def sw_input(self, t, layout: str):
        sw = self.sw
        p = sw.Replicate() if layout == "R" else sw.Shard(int(layout[1:]))
        return sw.DTensor.from_local(self.block(t, layout), self.sw_mesh, [p], shape=tuple(t.shape))

    def torch_input(self, t, layout: str):
        tdt = self.tdt
        p = tdt.Replicate() if layout == "R" else tdt.Shard(int(layout[1:]))
        return tdt.DTensor.from_local(self.block(t, layout), self.t_mesh, [p], run_check=False,
                                      shape=t.shape, stride=t.stride())

    # ------------------------------------------------------------------ one op
    def check(self, lib: str, case: Case, dts: list, plain_out) -> str:
        """Run once under the library's CommDebugMode: '' if no comms and the local result is right."""
        torch = self.torch
        if lib == "shardwise":
            from shardwise.debug import CommDebugMode
        else:
            from torch.distributed.tensor.debug import CommDebugMode
        with CommDebugMode() as comms:
            out = case.fn(*dts)
        notes = []
        if comms.get_total_counts():
            notes.append(f"{lib} communicates: {dict(comms.get_comm_counts())}")
        local = out.to_local()
        if local.shape != plain_out.shape or not torch.allclose(local, plain_out, rtol=1e-5, atol=1e-6):
            notes.append(f"{lib} local block differs from the plain op")
        return "; ".join(notes)

    def agree(self, mine: str) -> list[str]:
        """Every rank's string (an error or a note), on every rank."""
        out: list = [None] * self.world
        self.dist.all_gather_object(out, mine)
        return out

    def run_op(self, op: str) -> Row:
        case = make_case(op, self.args.size)
        row = Row(op)
        plain = [self.block(t, lay) for t, lay in zip(case.inputs, case.layouts)]
        plain_out = case.fn(*plain)
        variants: dict[str, Callable[[], Any]] = {"plain": lambda: case.fn(*plain)}
        wrapped = [self.Wrapper(t) for t in plain]
        variants["wrapper"] = lambda: case.fn(*wrapped)
        for lib, make in (("torch", self.torch_input), ("shardwise", self.sw_input)):
            mine = ""
            note = ""
            try:
                dts = [make(t, lay) for t, lay in zip(case.inputs, case.layouts)]
                note = self.check(lib, case, dts, plain_out)
            except Exception as err:  # noqa: BLE001 - reported per op
                mine = first_line(err)
            errors = [e for e in self.agree(mine) if e]
            notes = sorted({n for n in self.agree(note) if n})
            attr = "sw_error" if lib == "shardwise" else "torch_error"
            if errors:
                setattr(row, attr, errors[0])
                continue
            if any("communicates" in n for n in notes):
                setattr(row, attr, notes[0])  # not a dispatch-overhead measurement: not timed
                continue
            if notes:
                row.notes = "; ".join(filter(None, [row.notes, *notes]))
            variants[lib] = (lambda d: lambda: case.fn(*d))(dts)
        times = self.time_variants(variants)
        row.plain_us = times.get("plain", float("nan"))
        row.wrapper_us = times.get("wrapper", float("nan"))
        row.torch_us = times.get("torch", float("nan"))
        row.sw_us = times.get("shardwise", float("nan"))
        return row

    def time_variants(self, variants: dict[str, Callable[[], Any]]) -> dict[str, float]:
        """µs per call of each variant, the ``--stat`` of its repeats (rank 0 times; the others
        wait at a barrier)."""
        result: dict[str, float] = {}
        if self.rank == 0:
            number, repeat = self.args.number, self.args.repeat
            names = list(variants)
            for name in names:  # warm-up: caches filled, allocator settled
                for _ in range(max(20, number // 4)):
                    variants[name]()
            samples: dict[str, list[float]] = {name: [] for name in names}
            clock = time.thread_time_ns if self.args.clock == "cpu" else time.perf_counter_ns
            gc_was = gc.isenabled()
            gc.disable()
            try:
                for rep in range(repeat):
                    order = names[rep % len(names):] + names[: rep % len(names)]
                    for name in order:
                        fn = variants[name]
                        t0 = clock()
                        for _ in range(number):
                            fn()
                        samples[name].append((clock() - t0) / number / 1e3)
            finally:
                if gc_was:
                    gc.enable()
            stat = min if self.args.stat == "min" else statistics.median
            result = {name: stat(v) for name, v in samples.items()}
        self.dist.barrier()
        return result

    # ------------------------------------------------------------------ main
    def run(self) -> list[Row] | None:
        torch = self.torch
        start = time.perf_counter()
        self.say(f"\n=== world size {self.world} (gloo, {self.world} process{'es' if self.world > 1 else ''}), "
                 f"{self.args.size}x{self.args.size} float32, torch {torch.__version__}, "
                 f"{self.args.number} calls x {self.args.repeat} repeats ({self.args.stat}), timed on rank 0 ===")
        rows = [self.run_op(op) for op in self.args.op_list]
        if self.rank != 0:
            return None
        for line in table(rows):
            print(line)
        for line in summary(rows, self.world):
            print(line)
        print(f"elapsed: {time.perf_counter() - start:.1f} s", flush=True)
        return rows


# ====================================================================== reporting
def _f(v: float, width: int = 8) -> str:
    return f"{'-':>{width}}" if v != v else f"{v:>{width}.1f}"


def _r(v: float) -> str:
    return f"{'-':>6}" if v != v else f"{v:>6.2f}"


def table(rows: list[Row]) -> list[str]:
    head = (f"{'op':<11} {'plain µs':>8} {'torch +µs':>9} {'sw +µs':>8} {'sw/torch':>8} "
            f"{'wrapper +µs':>11} {'sw/floor':>8}  notes")
    lines = [head, "-" * len(head)]
    for r in rows:
        notes = []
        if r.torch_error:
            notes.append(f"torch unsupported: {r.torch_error}")
        if r.sw_error:
            notes.append(f"unsupported: {r.sw_error}")
        if r.notes:
            notes.append(f"!! {r.notes}")
        ratio = r.sw_over / r.torch_over if r.torch_over > 0 and r.sw_over == r.sw_over else float("nan")
        floor = r.sw_over / r.wrapper_over if r.wrapper_over > 0 and r.sw_over == r.sw_over else float("nan")
        lines.append(f"{r.op:<11} {_f(r.plain_us)} {_f(r.torch_over, 9)} {_f(r.sw_over)} {_r(ratio):>8} "
                     f"{_f(r.wrapper_over, 11)} {_r(floor):>8}  " + "; ".join(notes))
    return lines


def medians(rows: list[Row]) -> dict[str, float]:
    """Median overheads over the ops both libraries ran, plus the shardwise-only median."""
    both = [r for r in rows if r.sw_over == r.sw_over and r.torch_over == r.torch_over]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    t = med([r.torch_over for r in both])
    s = med([r.sw_over for r in both])
    return {
        "ops": len(both),
        "of": len(rows),
        "torch": t,
        "shardwise": s,
        "wrapper": med([r.wrapper_over for r in rows if r.wrapper_over == r.wrapper_over]),
        "ratio": s / t if t > 0 else float("nan"),
        "sw_unsupported": [r.op for r in rows if r.sw_error],
    }


def summary(rows: list[Row], world: int) -> list[str]:
    m = medians(rows)
    per_op = {r.op: r.sw_over / r.wrapper_over for r in rows if r.wrapper_over > 0 and r.sw_over == r.sw_over}
    floors = list(per_op.values())
    lines = [
        f"world {world}: median overhead over {m['ops']}/{m['of']} ops: torch {_f(m['torch']).strip()} µs, "
        f"shardwise {_f(m['shardwise']).strip()} µs, ratio of medians shardwise/torch {_r(m['ratio']).strip()}; "
        f"wrapper floor {_f(m['wrapper']).strip()} µs",
    ]
    if floors:
        lines.append(f"world {world}: shardwise / wrapper floor, per op: median {_r(statistics.median(floors)).strip()}, "
                     f"max {_r(max(floors)).strip()} ({max(per_op, key=per_op.__getitem__)})")
        lines.append(f"world {world}: per op: " + ", ".join(f"{op} {_r(v).strip()}" for op, v in per_op.items()))
    if m["sw_unsupported"]:
        lines.append(f"world {world}: shardwise unsupported: {', '.join(m['sw_unsupported'])}")
    return lines


def across_sessions(sessions: list[list[Row]]) -> list[Row]:
    """One row per op: each timing the median over the sessions (errors and notes of the first).

    A process's timings carry effects that last as long as it does (where its code and data
    landed in memory), so one process can read an op 15% above the floor and the next 10%
    below it; the median over fresh processes is steadier than more repeats in one."""
    out = []
    for rows in zip(*sessions):
        med = lambda name: statistics.median(getattr(r, name) for r in rows)  # noqa: E731
        out.append(Row(rows[0].op, med("plain_us"), med("torch_us"), med("sw_us"), med("wrapper_us"),
                       rows[0].torch_error, rows[0].sw_error, rows[0].notes))
    return out


# ====================================================================== the parent
def parent(args: argparse.Namespace) -> int:
    """Run every world size as its own launch, then print the combined summary."""
    script = os.path.abspath(sys.argv[0])
    start = time.perf_counter()
    status = 0
    runs: dict[int, list[list[Row]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world, session in [(w, k) for w in args.world_list for k in range(args.sessions)]:
            out = os.path.join(tmp, f"world{world}-{session}.json")
            code = launch([script, *sys.argv[1:], f"--_out={out}"], world)
            if code != 0 or not os.path.exists(out):
                print(f"!! world {world}: the workers failed (status {code})", flush=True)
                status = status or code or 1
                continue
            with open(out) as f:
                runs.setdefault(world, []).append([Row(**r) for r in json.load(f)])
    combined = [(world, across_sessions(rows)) for world, rows in runs.items()]
    sessions = f"; each op's median over {args.sessions} sessions" if args.sessions > 1 else ""
    print(f"\n=== summary (median over ops of the per-op overhead = DTensor op µs - plain op µs{sessions}) ===")
    for world, rows in combined:
        for line in summary(rows, world):
            print(line)
    print(f"total elapsed: {time.perf_counter() - start:.1f} s", flush=True)
    return status


if __name__ == "__main__":
    parsed = parse_args(sys.argv[1:])  # --help and bad flags answer once, before any worker starts
    if under_launcher():
        from torch.distributed.elastic.multiprocessing.errors import record

        sys.exit(int(record(worker)() or 0))
    sys.exit(parent(parsed))
