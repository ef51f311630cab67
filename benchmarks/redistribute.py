#!/usr/bin/env python
"""Redistribute benchmark: shardwise vs torch.distributed.tensor, in one run, on CPU processes.

    python benchmarks/redistribute.py            # full run: meshes 4, 2x2, 2x2x2 (long)
    python benchmarks/redistribute.py --quick    # smoke check (< 60 s)
    python benchmarks/redistribute.py --reps 9 --meshes 2x2 --shapes 512x512
    python benchmarks/redistribute.py --meshes 2x2x2 --shapes 7x5 --sample 0   # all 4096 pairs

The script starts local gloo workers itself (torch's elastic launcher), one job per world size
among the meshes (4 ranks for (4,) and (2,2), 8 for (2,2,2)); under torchrun it just runs the
meshes of its world size. For every mesh, every global shape (tiny and large, even and uneven)
and every pair of layouts over {R, S0, S1, P(sum)} per mesh axis (a deterministic sample of
``--sample`` pairs on meshes with more pairs than that), it reports:

* bytes sent by the busiest rank and by all ranks together, for shardwise and for torch. Both are
  computed the same way, from the sizes of the collectives each library actually issues, seen by
  a TorchDispatchMode on the c10d / functional-collective ops (shardwise's own CommDebugMode
  figure is cross-checked against it). Per collective, with n the group size:
  all_gather (n-1)*input; reduce_scatter input-output; all_reduce numel+(n-2)*ceil(numel/n)
  elements; all_to_all input minus the part kept locally; broadcast/scatter what the source sends.
* the true lower bound (``shardwise.redistribute.bound``): what all ranks together must send
  (the sum of what each rank lacks, or the reduction's minimum for Partial sources) and the
  least the busiest rank sends in one round (a plan of several steps may relay below it; for
  Partial sources the any-schedule bound, which bound.py shows is not always reachable
  together with the total: rows marked "sw max > LB" there may be at their best);
* median wall time over --reps repetitions or more (barrier before each, the slowest rank's
  time; quick transitions get up to --max-reps, about --budget-ms of timing per library);
* correctness: the result's placements, this rank's block, and full_tensor() must equal the
  source global tensor, for both libraries. Any mismatch is printed as WRONG and the run exits 3.

Sources are built with ``DTensor.from_local`` from identical blocks in both libraries (Partial
axes: axis coordinate 0 holds the block, the others zeros), since torch cannot distribute into
Partial. torch refuses ``redistribute`` to a Partial target from its public API ("for internal
use only"); those transitions run through torch's internal ``redistribute_local_tensor`` (marked
``int``), and the ones torch cannot do at all are marked ``n/a`` and left out of comparisons.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

from shardwise.launch import close_process_group, main_or_launch

EXIT_WRONG = 3
PLACEMENTS = ("R", "S0", "S1", "P")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None,
                   help="timed repetitions per transition, at least (default 5, --quick 2)")
    p.add_argument("--budget-ms", type=float, default=None,
                   help="more reps for quick transitions, until one library's reps take about this long "
                        "(at most --max-reps; default 100, --quick 0: off)")
    p.add_argument("--max-reps", type=int, default=60)
    p.add_argument("--quick", action="store_true", help="a subset of transitions and fewer reps (< 60 s)")
    p.add_argument("--meshes", default="4,2x2,2x2x2", help="comma-separated mesh shapes (default 4,2x2,2x2x2)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated global shapes (default 8x4,7x5,1024x1024,1023x1021; "
                        "--quick 8x4,7x5,512x512,511x509)")
    p.add_argument("--sample", type=int, default=None,
                   help="at most this many layout pairs per mesh and shape, a fixed sample (0: all; "
                        "default 0, --quick 30)")
    p.add_argument("--trace", action="store_true", help="print the collectives of every transition")
    p.add_argument("--timeout", type=float, default=180.0, help="gloo collective timeout, seconds")
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if args.sample is None:
        args.sample = 30 if args.quick else 0
    if args.budget_ms is None:
        args.budget_ms = 0.0 if args.quick else 100.0
    if args.shapes is None:
        args.shapes = "8x4,7x5,512x512,511x509" if args.quick else "8x4,7x5,1024x1024,1023x1021"
    args.mesh_shapes = [_dims(s) for s in args.meshes.split(",")]
    args.global_shapes = [_dims(s) for s in args.shapes.split(",")]
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.lower().split("x"))


# ====================================================================== collective accounting
@dataclass
class Collective:
    """One collective seen on the dispatcher: its op, group size and the bytes this rank sends."""

    op: str
    group_size: int
    bytes_sent: int

    def __str__(self) -> str:
        return f"{self.op}(n={self.group_size}, {self.bytes_sent} B)"


def _make_spy():
    """A TorchDispatchMode that records every collective issued while it is active."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    watched = ("_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor")
    ignored = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_",
               "check_for_nan", "mesh_get_process_group"}

    def nbytes(t) -> int:
        if isinstance(t, (list, tuple)):
            return sum(nbytes(x) for x in t)
        return t.numel() * t.element_size()

    def group(g):
        """(size, rank in group) of a group name, a ProcessGroup or its TorchScript box."""
        if isinstance(g, str):
            g = dist.distributed_c10d._resolve_process_group(g)
        elif isinstance(g, torch.ScriptObject):
            g = dist.ProcessGroup.unbox(g)
        return g.size(), g.rank()

    def all_reduce_bytes(t, n: int) -> int:
        numel = t.numel()
        return (numel + (n - 2) * -(-numel // n)) * t.element_size() if n > 1 else 0

    def a2a_bytes(inp, splits, n: int, me: int) -> int:
        if inp.numel() == 0:
            return 0
        if not splits:
            return nbytes(inp) * (n - 1) // n
        row = inp.numel() // inp.shape[0]
        return (inp.numel() - int(splits[me]) * row) * inp.element_size()

    class Spy(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[Collective] = []
            self.unknown: set[str] = set()

        @property
        def bytes_sent(self) -> int:
            return sum(c.bytes_sent for c in self.calls)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace in watched:
                name = func._schema.name.split("::")[1]
                if name not in ignored:
                    a = dict(zip((x.name for x in func._schema.arguments), args))
                    a.update(kwargs)
                    self._account(func.namespace, name, a)
            return func(*args, **kwargs)

        def _account(self, ns: str, name: str, a: dict) -> None:
            base = name.rstrip("_").removesuffix("_out")
            if ns == "c10d":
                n, me = group(a["process_group"])
                if base == "allreduce" or base == "allreduce_coalesced":
                    sent = sum(all_reduce_bytes(t, n) for t in a["tensors"])
                elif base in ("_allgather_base", "allgather", "allgather_into_tensor_coalesced", "allgather_coalesced"):
                    inp = a.get("input_tensor", a.get("input_tensors", a.get("inputs", a.get("input_list"))))
                    sent = (n - 1) * nbytes(inp)
                elif base in ("_reduce_scatter_base", "reduce_scatter_tensor_coalesced"):
                    inp = a.get("input_tensor", a.get("inputs"))
                    out = a.get("output_tensor", a.get("outputs"))
                    sent = nbytes(inp) - nbytes(out)
                elif base == "reduce_scatter":
                    sent = nbytes(a["input_tensors"]) - nbytes(a["output_tensors"])
                elif base == "alltoall_base":
                    sent = a2a_bytes(a["input"], a["input_split_sizes"], n, me)
                elif base == "alltoall":
                    sent = nbytes(a["input_tensors"]) - nbytes(a["input_tensors"][me])
                elif base == "broadcast":
                    sent = nbytes(a["tensors"]) if a["root_rank"] == me else 0
                elif base == "scatter":
                    ins = a["input_tensors"]
                    sent = nbytes(ins[0]) - nbytes(ins[0][me]) if a["root_rank"] == me and ins else 0
                elif base == "gather":
                    sent = nbytes(a["input_tensors"]) if a["root_rank"] != me else 0
                elif base == "send":
                    sent = nbytes(a["tensors"])
                elif base in ("recv", "recv_any_source"):
                    sent = 0
                else:
                    self.unknown.add(f"{ns}::{name}")
                    sent = 0
            else:
                gname = a.get("group_name")
                n, me = group(gname) if gname is not None else (0, 0)
                if base in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
                    sent = (n - 1) * nbytes(a.get("input", a.get("inputs")))
                elif base in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
                    inp = a.get("input", a.get("inputs"))
                    inp = inp if isinstance(inp, (list, tuple)) else [inp]
                    sent = sum(nbytes(t) - nbytes(t) // n for t in inp)
                elif base in ("all_reduce", "all_reduce_coalesced"):
                    inp = a.get("input", a.get("inputs"))
                    inp = inp if isinstance(inp, (list, tuple)) else [inp]
                    sent = sum(all_reduce_bytes(t, n) for t in inp)
                elif base == "all_to_all_single":
                    sent = a2a_bytes(a["input"], a["input_split_sizes"], n, me)
                elif base == "broadcast":
                    sent = nbytes(a["input"]) if a["src"] == me else 0
                elif base == "shard_dim_alltoall":
                    sent = nbytes(a["input"]) * (n - 1) // n
                elif base == "isend":
                    sent = nbytes(a["tensor"])
                elif base == "irecv":
                    sent = 0
                elif base == "batch_p2p_ops":
                    sent = sum(nbytes(t) for op, t in zip(a["op_list"], a["tensors"]) if "send" in op)
                else:
                    self.unknown.add(f"{ns}::{name}")
                    sent = 0
            self.calls.append(Collective(f"{name}", n, sent))

    return Spy


# ====================================================================== results
@dataclass
class Row:
    mesh: tuple
    shape: tuple
    src: tuple
    dst: tuple
    lower_bound: int  # the busiest rank's one-round bound (see the module docstring)
    sw_plan: str
    lb_total: int = 0
    sw_total: int = 0
    torch_total: int = 0
    sw_r0: int = 0
    sw_max: int = 0
    sw_reported_mismatch: bool = False  # CommDebugMode figure != bytes of the collectives seen
    sw_ms: float = float("nan")
    sw_best_ms: float = float("nan")  # the fastest rep (the least disturbed by load)
    sw_error: str = ""  # shardwise raised
    sw_wrong: str = ""  # shardwise's result is not the source tensor in the target layout
    torch_path: str = "api"  # "api", "int" (internal redistribute_local_tensor), "n/a"
    torch_r0: int = 0
    torch_max: int = 0
    torch_ms: float = float("nan")
    torch_best_ms: float = float("nan")
    torch_error: str = ""  # torch raised (the transition is n/a for torch)
    torch_wrong: str = ""
    sw_calls: list = field(default_factory=list)
    torch_calls: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{','.join(self.src)} -> {','.join(self.dst)}"

    @property
    def compared(self) -> bool:
        return self.torch_path != "n/a" and not self.sw_error


# ====================================================================== the worker
def worker() -> int:
    args = parse_args(sys.argv[1:])
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    status = Bench(args).run()
    close_process_group()  # after an error the launcher stops the other ranks
    return status


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        import shardwise as sw
        import torch.distributed.tensor as tdt

        self.args = args
        self.torch, self.dist, self.sw, self.tdt = torch, dist, sw, tdt
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        args.mesh_shapes = [m for m in args.mesh_shapes if math.prod(m) == self.world]
        if not args.mesh_shapes:
            raise SystemExit(f"no mesh of {self.world} ranks among --meshes")
        self.Spy = _make_spy()
        self.rows: list[Row] = []
        self.unknown_ops: set[str] = set()
        self.op_kinds: dict[str, dict[str, int]] = {"shardwise": {}, "torch": {}}

    # ------------------------------------------------------------------ helpers
    def say(self, *a) -> None:
        if self.rank == 0:
            print(*a, flush=True)

    def sw_placement(self, name: str):
        sw = self.sw
        return {"R": sw.Replicate(), "S0": sw.Shard(0), "S1": sw.Shard(1), "P": sw.Partial("sum")}[name]

    def torch_placement(self, name: str):
        t = self.tdt
        return {"R": t.Replicate(), "S0": t.Shard(0), "S1": t.Shard(1), "P": t.Partial("sum")}[name]

    def expected_block(self, glob, mesh_shape, coord, layout):
        from shardwise.core.spec import local_shape_and_offset

        shape, offset = local_shape_and_offset(
            tuple(glob.shape), mesh_shape, coord, [self.sw_placement(n) for n in layout])
        block = glob
        for d, (length, start) in enumerate(zip(shape, offset)):
            block = block.narrow(d, start, length)
        return block

    def check(self, out, layout, placements, glob, mesh_shape, coord) -> str:
        """'' when ``out`` is ``glob`` laid out as ``layout``; else what is wrong."""
        torch = self.torch
        problems = []
        if tuple(out.placements) != tuple(placements):
            problems.append(f"placements {list(out.placements)}")
        if "P" not in layout:
            local = out.to_local()
            want = self.expected_block(glob, mesh_shape, coord, layout)
            if tuple(local.shape) != tuple(want.shape):
                problems.append(f"block shape {list(local.shape)} != {list(want.shape)}")
            elif not torch.equal(local, want):
                problems.append("block values")
        try:
            full = out.full_tensor()
        except Exception as err:  # noqa: BLE001 - a verdict, not a crash
            problems.append(f"full_tensor raised {type(err).__name__}: {str(err).splitlines()[0][:100]}")
        else:
            if tuple(full.shape) != tuple(glob.shape) or not torch.equal(full, glob):
                problems.append("full_tensor values")
        return "; ".join(problems)

    def agree_flag(self, bad: bool) -> bool:
        """True on every rank if ``bad`` on any rank."""
        flag = self.torch.tensor([1 if bad else 0], dtype=self.torch.int32)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX)
        return bool(flag.item())

    def timed_pair(self, fn_a, fn_b) -> tuple[list[float], list[float]]:
        """Seconds per rep of ``fn_a`` and ``fn_b`` (None: not run, NaN), a barrier before each call.

        Both get the same number of reps, alternating (and alternating which goes first), so load
        changes hit both alike: ``--reps``, raised for quick transitions until the slower library's
        reps take about ``--budget-ms`` (a sub-millisecond transition's median over 5 reps is mostly
        noise). Every rank agrees on the count (a MAX reduction of the first pair's times)."""
        times: tuple[list[float], list[float]] = ([], [])
        reps = self.args.reps
        rep = 0
        while rep < reps:
            order = ((0, fn_a), (1, fn_b)) if rep % 2 == 0 else ((1, fn_b), (0, fn_a))
            for which, fn in order:
                if fn is None:
                    times[which].append(float("nan"))
                    continue
                self.dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[which].append(time.perf_counter() - t0)
            if rep == 0:
                reps = self.agreed_reps(max((t for t in (times[0][0], times[1][0]) if t == t), default=0.0))
            rep += 1
        return times

    def agreed_reps(self, first_s: float) -> int:
        """The reps every rank runs: ``--reps`` or more, so that quick transitions fill the budget."""
        slowest = self.torch.tensor([first_s], dtype=self.torch.float64)
        self.dist.all_reduce(slowest, op=self.dist.ReduceOp.MAX)
        wanted = math.ceil(self.args.budget_ms / 1e3 / max(float(slowest), 1e-6))
        return max(self.args.reps, min(self.args.max_reps, wanted))

    def measure(self, lib: str, fn):
        """Run ``fn`` once under the spy (and CommDebugMode for shardwise): (out, spy, reported, error)."""
        from shardwise.debug import CommDebugMode

        spy = self.Spy()
        reported = None
        out, error = None, ""
        try:
            if lib == "shardwise":
                with CommDebugMode() as comms, spy:
                    out = fn()
                reported = comms.bytes_sent
            else:
                with spy:
                    out = fn()
        except Exception as err:  # noqa: BLE001 - reported in the table, the run goes on
            error = f"{type(err).__name__}: {str(err).splitlines()[0][:150]}"
        self.unknown_ops |= spy.unknown
        for c in spy.calls:
            kinds = self.op_kinds[lib]
            kinds[c.op] = kinds.get(c.op, 0) + 1
        return out, spy, reported, error

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        torch, args = self.torch, self.args
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh

        start = time.perf_counter()
        self.say(f"redistribute benchmark: shardwise vs torch {torch.__version__} "
                 f"(gloo, {self.world} CPU processes, float32, {args.reps} to {max(args.reps, args.max_reps)} timed reps "
                 f"(a budget of {args.budget_ms:g} ms per library), "
                 f"{'quick' if args.quick else 'full'} run)")
        for mesh_shape in args.mesh_shapes:
            names = ("x",) if len(mesh_shape) == 1 else tuple("abcdefgh"[: len(mesh_shape)])
            sw_mesh = self.sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            t_mesh = torch_mesh("cpu", mesh_shape, mesh_dim_names=names)
            for shape in args.global_shapes:
                rows = self.run_case(mesh_shape, sw_mesh, t_mesh, shape)
                self.rows += rows
                self.report_case(mesh_shape, shape, rows)
        return self.report_overall(time.perf_counter() - start)

    def pairs(self, ndim: int) -> list[tuple[tuple, tuple]]:
        layouts = list(itertools.product(PLACEMENTS, repeat=ndim))
        pairs = [(s, d) for s in layouts for d in layouts if s != d]
        if 0 < self.args.sample < len(pairs):
            import random

            pairs = sorted(random.Random(ndim).sample(pairs, self.args.sample))
        return pairs

    def run_case(self, mesh_shape, sw_mesh, t_mesh, shape) -> list[Row]:
        torch, sw = self.torch, self.sw
        from shardwise.redistribute import plan_redistribute
        from shardwise.redistribute.bound import lower_bound
        from shardwise.redistribute.execute import flattened_groups
        from torch.distributed.tensor import DTensor as TDTensor

        gen = torch.Generator().manual_seed(1234)
        glob = torch.randn(shape, generator=gen, dtype=torch.float32)
        coord = sw_mesh.get_coordinate()
        itemsize = glob.element_size()
        sources: dict[tuple, tuple] = {}

        def source(layout):
            if layout not in sources:
                block = self.expected_block(glob, mesh_shape, coord, layout).clone()
                if any(n == "P" and coord[i] != 0 for i, n in enumerate(layout)):
                    block = torch.zeros_like(block)
                s = sw.DTensor.from_local(block.clone(), sw_mesh, [self.sw_placement(n) for n in layout],
                                          shape=tuple(shape))
                t = TDTensor.from_local(block.clone(), t_mesh, [self.torch_placement(n) for n in layout],
                                        run_check=False, shape=torch.Size(shape), stride=glob.stride())
                from shardwise.tensor import agreement as sw_agreement

                sw_agreement.settle(sw_mesh)  # from_local's deferred check: not part of a measured run
                # Both libraries must read the same blocks as the same global tensor.
                for lib, dt in (("shardwise", s), ("torch", t)):
                    if self.agree_flag(not torch.equal(dt.full_tensor(), glob)):
                        raise RuntimeError(f"{lib} source {layout} on mesh {mesh_shape}, shape {shape} "
                                           "does not read back as the global tensor")
                sources[layout] = (s, t)
            return sources[layout]

        rows = []
        for src, dst in self.pairs(len(mesh_shape)):
            sw_src, t_src = source(src)
            sw_dst = [self.sw_placement(n) for n in dst]
            t_dst = tuple(self.torch_placement(n) for n in dst)
            sw_src_placements = [self.sw_placement(n) for n in src]
            plan = plan_redistribute(tuple(shape), itemsize, mesh_shape, sw_src_placements, sw_dst,
                                     flattened_groups(sw_mesh))
            bound = lower_bound(tuple(shape), itemsize, mesh_shape, sw_src_placements, sw_dst)
            row = Row(mesh_shape, tuple(shape), src, dst, bound.busiest, str(plan), lb_total=bound.total)

            # -- shardwise
            def sw_fn():
                return sw_src.redistribute(sw_mesh, sw_dst)

            out, spy, reported, err = self.measure("shardwise", sw_fn)
            row.sw_calls = [str(c) for c in spy.calls]
            sw_bytes, sw_wrong, sw_mismatch = 0, "", False
            if self.agree_flag(bool(err)):  # agree first: a failed rank must not skip a check's collectives
                row.sw_error = err or "raised on another rank"
            else:
                sw_wrong = self.check(out, dst, sw_dst, glob, mesh_shape, coord)
                sw_bytes = spy.bytes_sent
                sw_mismatch = reported != sw_bytes
            # -- torch: the public API, or the internal path for Partial targets it refuses
            internal = any(d == "P" and s != "P" for s, d in zip(src, dst))
            row.torch_path = "int" if internal else "api"

            def torch_fn():
                if not internal:
                    return t_src.redistribute(t_mesh, t_dst)
                from torch.distributed.tensor._dtensor_spec import DTensorSpec
                from torch.distributed.tensor._redistribute import redistribute_local_tensor

                spec = DTensorSpec(t_mesh, t_dst, tensor_meta=t_src._spec.tensor_meta)
                local = redistribute_local_tensor(t_src._local_tensor, t_src._spec, spec, is_explicit=True)
                return TDTensor(local, spec, requires_grad=False)

            out, spy, _, err = self.measure("torch", torch_fn)
            row.torch_calls = [str(c) for c in spy.calls]
            t_bytes, t_wrong = 0, ""
            if self.agree_flag(bool(err)):
                row.torch_path = "n/a"
                row.torch_error = err or "raised on another rank"
            else:
                t_wrong = self.check(out, dst, t_dst, glob, mesh_shape, coord)
                t_bytes = spy.bytes_sent
            del out
            # -- timing: sw and torch reps alternate (and alternate which goes first), so load
            # changes on the machine hit both libraries alike.
            sw_times, t_times = self.timed_pair(sw_fn if not row.sw_error else None,
                                                torch_fn if row.torch_path != "n/a" else None)
            # One reduction for everything: bytes, verdicts, times (-1 = not run; MAX keeps it).
            flags = [bool(sw_wrong), sw_mismatch, bool(t_wrong)]
            stats = torch.tensor([sw_bytes, t_bytes, *flags, *sw_times, *t_times], dtype=torch.float64)
            stats = torch.nan_to_num(stats, nan=-1.0)
            r0 = stats.clone()
            totals = stats[:2].clone()
            self.dist.all_reduce(stats, op=self.dist.ReduceOp.MAX)
            self.dist.all_reduce(totals)
            row.sw_total, row.torch_total = int(totals[0]), int(totals[1])
            reps = len(sw_times)
            row.sw_r0, row.torch_r0 = int(r0[0]), int(r0[1])
            row.sw_max, row.torch_max = int(stats[0]), int(stats[1])
            if stats[2] > 0:
                row.sw_wrong = sw_wrong or "wrong on another rank"
            row.sw_reported_mismatch = bool(stats[3] > 0)
            if stats[4] > 0:
                row.torch_wrong = t_wrong or "wrong on another rank"
            # Median over reps of the slowest rank's time.
            if not row.sw_error:
                row.sw_ms = statistics.median(stats[5: 5 + reps].tolist()) * 1e3
                row.sw_best_ms = min(stats[5: 5 + reps].tolist()) * 1e3
            if row.torch_path != "n/a":
                row.torch_ms = statistics.median(stats[5 + reps:].tolist()) * 1e3
                row.torch_best_ms = min(stats[5 + reps:].tolist()) * 1e3
            rows.append(row)
            if self.args.trace:
                self.say(f"  [{row.label}] plan: {row.sw_plan}\n"
                         f"      shardwise rank0: {', '.join(row.sw_calls) or '-'}\n"
                         f"      torch({row.torch_path}) rank0: {', '.join(row.torch_calls) or '-'}"
                         + (f"  (torch raised: {row.torch_error})" if row.torch_error else ""))
        return rows

    # ------------------------------------------------------------------ reporting
    def report_case(self, mesh_shape, shape, rows: list[Row]) -> None:
        if self.rank != 0:
            return
        big = max(max(r.lb_total, r.torch_total, r.sw_total) for r in rows) >= 100 * 1024
        unit = "KiB" if big else "B"
        kib = (lambda b: f"{b / 1024:,.1f}") if big else (lambda b: f"{b:,}")  # noqa: E731
        print(f"\n=== mesh {mesh_shape}, global shape {tuple(shape)} float32: {len(rows)} transitions "
              f"(bytes in {unit}; max = the busiest rank, all = every rank together; LB = true lower bound) ===")
        w = max(len(r.label) for r in rows) + 1
        head = (f"{'transition':<{w}} {'sw max':>9} {'sw all':>9} {'torch max':>9} {'torch all':>9} "
                f"{'LB max':>9} {'LB all':>9} {'sw ms':>8} {'torch ms':>8} {'sw/torch':>8}  notes")
        print(head)
        print("-" * len(head))
        for r in rows:
            notes = []
            if r.sw_error:
                notes.append(f"!! ERROR shardwise: {r.sw_error}")
            if r.sw_wrong:
                notes.append(f"!! WRONG shardwise: {r.sw_wrong}")
            if r.torch_path == "n/a":
                notes.append(f"torch n/a: {r.torch_error}")
            if r.torch_wrong:
                notes.append(f"!! WRONG torch: {r.torch_wrong}")
            if r.torch_path == "int":
                notes.append("torch internal path")
            if r.compared and r.sw_max > r.torch_max:
                notes.append("!! sw max > torch max")
            if r.compared and r.sw_total > r.torch_total:
                notes.append("!! sw all > torch all")
            if not r.sw_error and r.sw_total > r.lb_total:
                notes.append("sw all > LB")
            if not r.sw_error and r.sw_max > r.lower_bound:
                notes.append("sw max > LB")
            if r.sw_reported_mismatch:
                notes.append("!! CommDebugMode bytes != collectives seen")
            tb = lambda b: kib(b) if r.torch_path != "n/a" else "-"  # noqa: E731
            ratio = r.sw_ms / r.torch_ms if r.compared and r.torch_ms > 0 else float("nan")
            if r.compared and r.sw_best_ms > r.torch_best_ms:
                notes.append(f"slower at best {r.sw_best_ms:.2f}/{r.torch_best_ms:.2f} ms")
            print(f"{r.label:<{w}} {kib(r.sw_max):>9} {kib(r.sw_total):>9} {tb(r.torch_max):>9} "
                  f"{tb(r.torch_total):>9} {kib(r.lower_bound):>9} {kib(r.lb_total):>9} "
                  f"{_ms(r.sw_ms):>8} {_ms(r.torch_ms):>8} {_x(ratio):>8}  " + "; ".join(notes))
        for line in summarize(rows):
            print(line)

    def report_overall(self, elapsed: float) -> int:
        rows = self.rows
        wrong_sw = [r for r in rows if r.sw_error or r.sw_wrong]
        wrong_torch = [r for r in rows if r.torch_wrong]
        if self.rank == 0:
            print("\n=== overall ===")
            for line in summarize(rows):
                print(line)
            for lib, kinds in self.op_kinds.items():
                seen = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none"
                print(f"collectives seen on rank 0 ({lib}, measured runs): {seen}")
            if self.unknown_ops:
                print(f"!! collectives with no byte formula (counted as 0 B): {sorted(self.unknown_ops)}")
            for r in wrong_sw:
                print(f"!! WRONG shardwise: mesh {r.mesh} shape {r.shape} {r.label}: {r.sw_error or r.sw_wrong} (plan: {r.sw_plan})")
            for r in wrong_torch:
                print(f"!! WRONG torch: mesh {r.mesh} shape {r.shape} {r.label}: {r.torch_wrong}")
            if not wrong_sw and not wrong_torch:
                print("values: every result of both libraries equals the source tensor "
                      "(placements, local blocks, full_tensor)")
            print(f"elapsed: {elapsed:.1f} s")
        return EXIT_WRONG if wrong_sw or wrong_torch else 0


def _ms(v: float) -> str:
    return "-" if v != v else f"{v:.2f}"


def _x(v: float) -> str:
    return "-" if v != v else f"{v:.2f}"


def summarize(rows: list[Row]) -> list[str]:
    """Bytes against the lower bound and torch, and time against torch."""
    ran = [r for r in rows if not r.sw_error]
    both = [r for r in rows if r.compared]
    only = [r for r in rows if r.torch_path == "n/a" and not r.sw_error]
    div = lambda a, b: a / b if b else float("nan")  # noqa: E731
    at_total = sum(r.sw_total == r.lb_total for r in ran)
    at_max = sum(r.sw_max <= r.lower_bound for r in ran)
    at_both = sum(r.sw_total == r.lb_total and r.sw_max <= r.lower_bound for r in ran)
    worst_total = max((div(r.sw_total, r.lb_total) for r in ran if r.lb_total), default=float("nan"))
    worst_max = max((div(r.sw_max, r.lower_bound) for r in ran if r.lower_bound), default=float("nan"))
    free_but_sent = sum(r.lb_total == 0 and r.sw_total > 0 for r in ran)
    ratios = [r.sw_ms / r.torch_ms for r in both if r.torch_ms > 0 and r.sw_ms > 0]
    best = [r.sw_best_ms / r.torch_best_ms for r in both if r.torch_best_ms > 0 and r.sw_best_ms > 0]
    geo = math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else float("nan")
    med = statistics.median(ratios) if ratios else float("nan")
    sw_t, t_t = sum(r.sw_ms for r in both), sum(r.torch_ms for r in both)
    lines = [
        f"vs the lower bound, {len(ran)} transitions: all-ranks bytes at the bound {at_total}, busiest rank at or "
        f"below its one-round bound {at_max}, both {at_both}; worst ratio all/LB {_x(worst_total)}, "
        f"max/LB {_x(worst_max)}; sent bytes where the bound is 0: {free_but_sent}",
        f"  sums (all ranks): shardwise {sum(r.sw_total for r in ran):,} B, lower bound "
        f"{sum(r.lb_total for r in ran):,} B (shardwise/LB = {_x(div(sum(r.sw_total for r in ran), sum(r.lb_total for r in ran)))})",
        f"vs torch, {len(both)} transitions both ran: all-ranks bytes shardwise {sum(r.sw_total for r in both):,} B, "
        f"torch {sum(r.torch_total for r in both):,} B, LB {sum(r.lb_total for r in both):,} B "
        f"(torch/LB = {_x(div(sum(r.torch_total for r in both), sum(r.lb_total for r in both)))})",
        f"  shardwise sent MORE than torch: busiest rank {sum(r.sw_max > r.torch_max for r in both)}, "
        f"all ranks {sum(r.sw_total > r.torch_total for r in both)}; fewer (all ranks): "
        f"{sum(r.sw_total < r.torch_total for r in both)}",
        f"  time: shardwise {sw_t:,.1f} ms, torch {t_t:,.1f} ms; per-transition sw/torch median {_x(med)}, "
        f"geometric mean {_x(geo)}, slower than torch in {sum(x > 1 for x in ratios)} of {len(ratios)} "
        f"(by the fastest rep of each: {sum(x > 1 for x in best)}, median {_x(statistics.median(best) if best else math.nan)})",
    ]
    if only:
        lines.append(
            f"  + {len(only)} transitions torch cannot do (shardwise only): shardwise "
            f"{sum(r.sw_total for r in only):,} B vs lower bound {sum(r.lb_total for r in only):,} B, "
            f"{sum(r.sw_ms for r in only):,.1f} ms")
    wrong = sum(1 for r in rows if r.sw_error or r.sw_wrong)
    if wrong:
        lines.append(f"  !! {wrong} shardwise transitions WRONG or failed")
    wrong = sum(1 for r in rows if r.torch_wrong)
    if wrong:
        lines.append(f"  !! {wrong} torch transitions WRONG")
    mismatch = sum(1 for r in rows if r.sw_reported_mismatch)
    if mismatch:
        lines.append(f"  !! {mismatch} transitions where shardwise's CommDebugMode bytes differ from its collectives")
    return lines


def _launch_per_world_size(args: argparse.Namespace) -> int:
    """One job per world size among the meshes (each worker runs the meshes of its size)."""
    import os

    from shardwise.launch import launch

    status = 0
    argv = sys.argv[1:]
    if "--meshes" in argv:
        i = argv.index("--meshes")
        argv = argv[:i] + argv[i + 2:]
    argv = [a for a in argv if not a.startswith("--meshes=")]
    sizes: dict[int, list[str]] = {}
    for m in args.mesh_shapes:
        sizes.setdefault(math.prod(m), []).append("x".join(map(str, m)))
    for size, meshes in sizes.items():
        code = launch([os.path.abspath(sys.argv[0]), *argv, "--meshes", ",".join(meshes)], size,
                      quiet_codes=(EXIT_WRONG,))
        status = status or code
    return status


if __name__ == "__main__":
    from shardwise.launch import under_launcher

    _args = parse_args(sys.argv[1:])  # --help and bad flags answer once, before any worker starts
    if not under_launcher():
        sys.exit(_launch_per_world_size(_args))
    main_or_launch(worker, 0, quiet_codes=(EXIT_WRONG,))
