#!/usr/bin/env python
"""Op coverage: torch's OpInfo database on DTensors, shardwise vs torch.distributed.tensor.

    python benchmarks/op_coverage.py --quick            # ~40 common ops (< 2 min; the CI smoke test)
    python benchmarks/op_coverage.py                    # every OpInfo with float32 CPU samples
    python benchmarks/op_coverage.py --ops mm,view -v   # chosen ops, every failing sample printed
    python benchmarks/op_coverage.py --limit 100 --libs shardwise

Four local gloo processes, mesh (4,). For every OpInfo (float32 on CPU) and each of its first
--samples sample inputs, the op runs on plain tensors (the reference) and, in each library,
on DTensors made from the same tensors in two layouts:

* ``R``: every tensor input Replicate;
* ``S0``: the first tensor input Shard(0) (when it has a dim 0 of size > 0), the others
  Replicate.

Every tensor output is read back with ``full_tensor()`` and compared with the reference
(``torch.testing.assert_close``, --rtol/--atol, NaN == NaN, dtype and shape must match). A case
(sample x layout) is:

* pass / wrong (a value, shape or dtype differs) / error (every rank raised the same error);
* desync: the ranks did not do the same thing: one raised while the others went on, they
  raised different errors, or they issued different numbers of collectives. In a real program
  that is a hang or a silently mismatched collective; here it is detected without hanging:

  - every (library, layout) pair runs on its own gloo process group (and mesh);
  - after every case each rank posts "done" to the job's key-value store and waits for the
    others' posts. A rank whose case raised waits only --release-after seconds: a peer that has
    not posted by then is presumed stuck in a collective this rank will never enter, so this rank
    tears the group down (shuts its sockets): the peer gets "Connection closed by peer" and
    raises instead of hanging (and in turn tears down its own). The group timeout
    (--op-timeout) is the backstop for a peer that went on without anyone raising;
  - after each sample, the ranks exchange their per-case status (outcome, first line of the
    error, collectives issued on that group: ``_get_sequence_number_for_group``) over a separate
    control group that nothing else uses, which every rank reaches because errors are caught
    per rank;
  - a group that was torn down, or where the ranks did not all raise the same error after the
    same number of collectives, is replaced on every rank by a fresh one (a new mesh with a new
    axis name, so no cached sharding decision refers to the old group; the libraries' caches
    are cleared now and then so that old groups can be freed).

Before ``full_tensor``, every rank checks that its block of each DTensor output has the shape
the output's layout says (torch.chunk semantics): a block that does not (e.g. a squeeze that
dropped a sharded dim on one rank only) is a wrong result, reported before it can feed a gloo
collective blocks of mismatched sizes -- which gloo answers by aborting the process.

Crashes: an abort still kills every worker. The script then starts them again from the op that
was running (found from the per-rank progress files), with the library that crashed it left out
of that op, and reports the op as a crash for that library. Results accumulate in a state folder
so nothing already run is lost.

Random ops (bernoulli, normal, dropout, rand_like...) and ops whose values are unspecified
(empty_like...) are reported separately: only shapes and dtypes are compared (so are the
samples of attention ops that ask for dropout). Ops whose samples have no tensor input
(factories) are skipped.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
import types
import unittest
import warnings
from dataclasses import dataclass, field

from _gloo_slots import Slot, clear_caches, is_comm_failure, open_fds
from shardwise.launch import launch, under_launcher

NPROC = 4
LIBS = ("shardwise", "torch")
MODES = ("R", "S0")
KINDS = ("pass", "wrong", "error", "desync", "crash")
MAX_LAUNCHES = 40

# Common ops for --quick (base names: every OpInfo variant of the name is included).
QUICK_OPS = (
    "add", "sub", "mul", "div", "neg", "abs", "exp", "sqrt", "sigmoid", "tanh",
    "nn.functional.relu", "nn.functional.gelu", "where", "clamp", "pow", "maximum",
    "sum", "mean", "amax", "argmax", "softmax", "log_softmax",
    "mm", "bmm", "matmul", "addmm", "nn.functional.linear", "nn.functional.layer_norm",
    "nn.functional.embedding", "view", "reshape", "transpose", "permute", "t", "unsqueeze",
    "flatten", "cat", "clone", "masked_fill", "nn.functional.dropout",
)

# Ops whose values legitimately differ between runs / layouts: random, or unspecified (empty).
RANDOM_WORDS = ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "exponential",
                "geometric", "cauchy", "poisson", "rrelu", "fractional_max_pool", "lowrank", "empty")
RANDOM_NAMES = {"resize_", "resize_as_"}  # new elements are uninitialized


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only {len(QUICK_OPS)} common ops (all their OpInfo variants), 4 samples each (< 2 min)")
    p.add_argument("--ops", default=None, help="comma-separated OpInfo names (a base name takes every variant)")
    p.add_argument("--limit", type=int, default=None, help="only the first N ops")
    p.add_argument("--samples", type=int, default=None, help="samples per op (default 8, --quick 4)")
    p.add_argument("--libs", default=",".join(LIBS), help="comma-separated libraries (default shardwise,torch)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (default 1e-4)")
    p.add_argument("--op-timeout", type=float, default=20.0,
                   help="seconds a rank waits in a collective of an op before it counts as desynced")
    p.add_argument("--release-after", type=float, default=2.0,
                   help="seconds a rank that raised waits for its peers before tearing the group down")
    p.add_argument("-v", "--verbose", action="store_true", help="print every failing case")
    p.add_argument("--_state", default=None, help=argparse.SUPPRESS)  # parent <-> workers folder
    p.add_argument("--_start", type=int, default=0, help=argparse.SUPPRESS)  # first op index
    args = p.parse_args(argv)
    if args.samples is None:
        args.samples = 4 if args.quick else 8
    args.lib_list = [x.strip() for x in args.libs.split(",") if x.strip()]
    bad = [x for x in args.lib_list if x not in LIBS]
    if bad or not args.lib_list:
        p.error(f"--libs: choose from {','.join(LIBS)}")
    return args


def load_op_db() -> list:
    """torch's OpInfo list; its test utilities import expecttest, stubbed when not installed."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        sys.modules["expecttest"] = stub
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def full_name(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def is_random(opinfo) -> bool:
    name = opinfo.name
    return (getattr(opinfo, "has_nondeterministic_output", False) or name in RANDOM_NAMES
            or any(w in name for w in RANDOM_WORDS))


def sample_is_random(name: str, sample) -> bool:
    """A sample of a deterministic op that asks for randomness (attention with dropout)."""
    if any("dropout" in k and isinstance(v, (int, float)) and v > 0 for k, v in sample.kwargs.items()):
        return True
    if name == "nn.functional.multi_head_attention_forward":  # dropout_p is positional, 10th
        p = sample.args[9] if len(sample.args) > 9 else 0.0
        return isinstance(p, (int, float)) and p > 0 and sample.kwargs.get("training", True)
    return False


def select_ops(op_db: list, args: argparse.Namespace) -> list:
    import torch

    ops = [o for o in op_db if torch.float32 in o.supported_dtypes("cpu") and not o.is_factory_function]
    wanted = args.ops.split(",") if args.ops else (QUICK_OPS if args.quick else None)
    if wanted is not None:
        wanted = {w.strip() for w in wanted if w.strip()}
        ops = [o for o in ops if o.name in wanted or full_name(o) in wanted]
    if args.limit is not None:
        ops = ops[: args.limit]
    return ops


def first_line(err: BaseException) -> str:
    lines = [x.strip() for x in str(err).strip().splitlines() if x.strip()]
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


# ====================================================================== results
@dataclass
class Case:
    """One rank's outcome of one (sample, library, layout)."""

    kind: str  # "pass", "wrong", "error"
    msg: str = ""
    collectives: int = 0
    stray: bool = False  # this rank left the op early (it raised, or saw a bad block)
    broke: bool = False  # this rank tore the case's group down


@dataclass
class OpResult:
    """Counts of one op in one library, over its samples and layouts."""

    name: str
    random: bool
    counts: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    first: dict = field(default_factory=dict)  # kind -> first message of that kind

    def add(self, kind: str, msg: str) -> None:
        self.counts[kind] += 1
        if msg and kind not in self.first:
            self.first[kind] = msg

    @property
    def cases(self) -> int:
        return sum(self.counts.values())

    @property
    def passing(self) -> bool:
        return self.cases > 0 and self.counts["pass"] == self.cases

    def to_json(self) -> dict:
        return {"name": self.name, "random": self.random, "counts": self.counts, "first": self.first}

    @staticmethod
    def from_json(d: dict) -> "OpResult":
        r = OpResult(d["name"], d["random"])
        r.counts.update(d["counts"])
        r.first.update(d["first"])
        return r


# ====================================================================== per-rank machinery
class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.tensor as tdt

        import shardwise as sw

        self.args = args
        self.torch, self.dist, self.sw, self.tdt = torch, dist, sw, tdt
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.generation = 0
        ctrl_timeout = 4 * args.op_timeout + 600
        self.long_wait = datetime.timedelta(seconds=ctrl_timeout)
        self.ctrl = dist.new_group(backend="gloo", timeout=self.long_wait)
        self.store = dist.PrefixStore("op_coverage/", dist.distributed_c10d._get_default_store())
        self.slots = {(lib, mode): self.new_slot(lib, mode) for lib in args.lib_list for mode in MODES}
        self.replaced = 0  # slots replaced since the libraries' caches were last cleared
        self.replaced_total = 0
        self.dtensor_types = (sw.DTensor, tdt.DTensor)
        self.state = args._state
        self.excluded = _read_excluded(self.state)  # {op name: [libs]} that crashed a rank before
        self.position: tuple = ()

    def mark(self, *position) -> None:
        """Record where this rank is (op index, sample, case...): the parent reads it after a crash."""
        self.position = position
        if self.state:
            with open(os.path.join(self.state, f"at.{self.rank}.json"), "w") as f:
                json.dump(list(position), f)

    def new_slot(self, lib: str, mode: str) -> Slot:
        self.generation += 1
        return Slot(lib, f"{lib[:2]}{mode}g{self.generation}", self.world, self.args.op_timeout)

    def say(self, *a) -> None:
        if self.rank == 0:
            print(*a, flush=True)

    # ------------------------------------------------------------------ inputs
    def block(self, t, shard: bool):
        if not shard:
            return t.clone()
        size, n, i = t.shape[0], self.world, self.rank
        chunk = -(-size // n)  # torch.chunk semantics: trailing ranks shorter or empty
        start = min(i * chunk, size)
        return t.narrow(0, start, max(0, min(size, start + chunk) - start)).clone()

    def distribute(self, lib: str, slot: Slot, t, shard: bool):
        if lib == "shardwise":
            sw = self.sw
            p = sw.Shard(0) if shard else sw.Replicate()
            return sw.DTensor.from_local(self.block(t, shard), slot.mesh, [p], shape=tuple(t.shape))
        tdt = self.tdt
        p = tdt.Shard(0) if shard else tdt.Replicate()
        return tdt.DTensor.from_local(self.block(t, shard), slot.mesh, [p], run_check=False,
                                      shape=t.shape, stride=t.stride())

    # ------------------------------------------------------------------ one case
    def run_case(self, opinfo, leaves, spec, expected, lib: str, mode: str, rand: bool) -> Case:
        """This rank's outcome of the op on DTensors in one library and layout."""
        from torch.utils._pytree import tree_flatten, tree_unflatten

        torch = self.torch
        slot = self.slots[(lib, mode)]
        before = slot.seq()
        if os.environ.get("OP_COVERAGE_CRASH_TEST") == f"{full_name(opinfo)}:{lib}" and self.rank == 1:
            os.abort()  # test hook: check that a crash is survived and blamed on this op and library
        try:
            first = True
            dleaves = []
            for x in leaves:
                if isinstance(x, torch.Tensor):
                    dleaves.append(self.distribute(lib, slot, x, shard=(mode == "S0" and first)))
                    first = False
                else:
                    dleaves.append(x)
            inp, args, kwargs = tree_unflatten(dleaves, spec)
            out = opinfo(inp, *args, **kwargs)
            out_leaves, _ = tree_flatten(out)
            bad = self.bad_block(out_leaves)
            if bad:
                # Reading it back would feed a collective mismatched sizes (gloo aborts).
                return Case("wrong", bad, slot.seq() - before, stray=True)
            got = [x.full_tensor() if isinstance(x, self.dtensor_types) else x for x in out_leaves]
            problem = self.compare(got, expected, rand)
            case = Case("wrong", problem) if problem else Case("pass")
        except Exception as err:  # noqa: BLE001 - a verdict per case
            return Case("error", first_line(err), slot.seq() - before, stray=True)
        case.collectives = slot.seq() - before
        return case

    def bad_block(self, out_leaves: list) -> str:
        """'' unless this rank's block of a DTensor output is not the shape its layout implies."""
        for i, x in enumerate(out_leaves):
            if not isinstance(x, self.dtensor_types):
                continue
            want = list(x.shape)
            for p in x.placements:  # a 1-D mesh: one placement
                if type(p).__name__ == "_StridedShard":
                    return ""
                if p.is_shard():
                    size = want[p.dim]
                    chunk = -(-size // self.world)
                    start = min(self.rank * chunk, size)
                    want[p.dim] = max(0, min(size, start + chunk) - start)
            got = list(x.to_local().shape)
            if got != want:
                return (f"output {i}: rank {self.rank} holds a {got} block where {list(x.placements)} of "
                        f"{list(x.shape)} needs {want}")
        return ""

    def compare(self, got: list, expected: list, rand: bool) -> str:
        torch = self.torch
        if len(got) != len(expected):
            return f"{len(got)} outputs, expected {len(expected)}"
        for i, (a, e) in enumerate(zip(got, expected)):
            if isinstance(e, torch.Tensor):
                if not isinstance(a, torch.Tensor):
                    return f"output {i}: {type(a).__name__}, expected a tensor"
                if a.shape != e.shape or a.dtype != e.dtype:
                    return f"output {i}: {a.dtype} {list(a.shape)}, expected {e.dtype} {list(e.shape)}"
                if rand:
                    continue
                try:
                    torch.testing.assert_close(a, e, rtol=self.args.rtol, atol=self.args.atol, equal_nan=True,
                                               check_device=False, check_stride=False, check_layout=False)
                except AssertionError as err:
                    detail = [x.strip() for x in str(err).splitlines() if x.strip()][:3]
                    return f"output {i}: " + " ".join(detail)[:200]
            elif not rand and not _same_value(a, e):
                return f"output {i}: {a!r:.60}, expected {e!r:.60}"
        return ""

    # ------------------------------------------------------------------ one op
    def samples(self, opinfo) -> list:
        """The first --samples samples, the same on every rank (seeded by the op's name)."""
        torch = self.torch
        seed = int.from_bytes(hashlib.sha1(full_name(opinfo).encode()).digest()[:4], "little")
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            import numpy

            numpy.random.seed(seed)
        except ImportError:
            pass
        gen = opinfo.sample_inputs("cpu", torch.float32, requires_grad=False)
        return list(itertools.islice(gen, self.args.samples))

    def prepare(self, sample):
        """(leaves, spec, expected out leaves or an error string, digest) of one sample."""
        from torch.utils._pytree import tree_flatten

        torch = self.torch
        leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors:
            return None, None, "no tensor input", b""
        if any(t.layout != torch.strided for t in tensors):
            return None, None, "non-strided input", b""
        leaves = [x.detach().contiguous().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        h = hashlib.sha1()
        for t in tensors:
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return leaves, spec, None, h.digest()

    def reference(self, opinfo, leaves, spec):
        from torch.utils._pytree import tree_flatten, tree_unflatten

        torch = self.torch
        cloned = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        inp, args, kwargs = tree_unflatten(cloned, spec)
        out, _ = tree_flatten(opinfo(inp, *args, **kwargs))
        return out

    def run_op(self, index: int, opinfo) -> dict[str, OpResult] | str:
        """Per-library results of one op, or why it was skipped (the same on every rank)."""
        torch = self.torch
        rand = is_random(opinfo)
        name = full_name(opinfo)
        libs = [lib for lib in self.args.lib_list if lib not in self.excluded.get(name, ())]
        results = {lib: OpResult(name, rand) for lib in libs}
        if not libs:
            return "crashed a rank in every library"
        try:
            samples = self.samples(opinfo)
        except Exception as err:  # noqa: BLE001
            return self.agree_skip(f"sample_inputs raised {first_line(err)}")
        ran_any = False
        skip_why = "no samples"
        for sample_no, sample in enumerate(samples):
            leaves, spec, why, digest = self.prepare(sample)
            expected = None
            if why is None:
                try:
                    expected = self.reference(opinfo, leaves, spec)
                except Exception as err:  # noqa: BLE001 - the op refuses this sample on one device too
                    why = f"reference raised {first_line(err)}"
            mine: dict = {"digest": digest, "why": why}
            if why is None:
                first = next(x for x in leaves if isinstance(x, torch.Tensor))
                for mode in MODES:
                    if mode == "S0" and (first.dim() == 0 or first.shape[0] == 0):
                        continue
                    for lib in libs:
                        self.mark(index, sample_no, mode, lib, name, rand)
                        case = self.run_case(opinfo, leaves, spec, expected, lib, mode,
                                             rand or sample_is_random(name, sample))
                        self.settle(f"{index}/{sample_no}/{mode}/{lib}", case, self.slots[(lib, mode)])
                        mine[(lib, mode)] = case
            everyone: list = [None] * self.world
            self.dist.all_gather_object(everyone, mine, group=self.ctrl)
            if any(e["why"] for e in everyone):
                skip_why = next(e["why"] for e in everyone if e["why"])
                continue
            if len({e["digest"] for e in everyone}) > 1:
                skip_why = "sample inputs differ across ranks (nondeterministic sample_inputs)"
                continue
            ran_any = True
            broken = []
            for key in [k for k in mine if isinstance(k, tuple)]:
                kind, msg = self.classify([e[key] for e in everyone])
                results[key[0]].add(kind, msg)
                if self.args.verbose and kind != "pass":
                    self.say(f"    {full_name(opinfo)} [{key[0]} {key[1]}] sample {_describe(sample)}: {kind}: {msg}")
                if self.needs_new_group([e[key] for e in everyone]):
                    broken.append(key)
            self.replace_slots(broken)
        if self.replaced >= 16:
            self.clear_caches()
        return results if ran_any else skip_why

    def settle(self, case_id: str, case: Case, slot: Slot) -> None:
        """Wait until every rank is done with this case, releasing peers stuck because of us."""
        self.store.set(f"{case_id}/{self.rank}", b"1")
        keys = [f"{case_id}/{r}" for r in range(self.world)]
        if case.stray:
            if is_comm_failure(case.msg):
                case.broke = True  # the group is broken already: pass the failure on at once
                slot.destroy()
            else:
                try:
                    self.store.wait(keys, datetime.timedelta(seconds=self.args.release_after))
                    return
                except Exception:  # noqa: BLE001 - a peer is (presumably) waiting for us
                    case.broke = True
                    slot.destroy()
        self.store.wait(keys, self.long_wait)

    @staticmethod
    def needs_new_group(cases: list[Case]) -> bool:
        """A group is reused only if every rank did the same thing on it."""
        if any(c.broke for c in cases) or not any(c.stray for c in cases):
            return any(c.broke for c in cases)
        first = cases[0]
        return any((c.kind, c.msg, c.collectives, c.stray) != (first.kind, first.msg, first.collectives, first.stray)
                   for c in cases)

    def agree_skip(self, why: str) -> str:
        everyone: list = [None] * self.world
        self.dist.all_gather_object(everyone, why, group=self.ctrl)
        return next(w for w in everyone if w)

    @staticmethod
    def classify(cases: list[Case]) -> tuple[str, str]:
        """One verdict from every rank's outcome of a case (and, for a desync, its root cause)."""
        kinds = {c.kind for c in cases}
        counts = [c.collectives for c in cases]
        blocks = [c.msg for c in cases if c.kind == "wrong" and c.stray]
        if blocks:  # a rank held a block its layout does not allow; peers then lost the group
            return "wrong", blocks[0]
        errors = [(r, c.msg) for r, c in enumerate(cases) if c.kind == "error"]
        # The error a rank raised by itself, not the one it got because a peer left a collective.
        roots = [(r, m) for r, m in errors if not is_comm_failure(m)] or errors
        cause = ""
        if roots:
            ranks = [r for r, m in roots if m == roots[0][1]]
            cause = f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {roots[0][1]}"
        if errors and len(errors) < len(cases):
            went_on = [r for r, c in enumerate(cases) if c.kind != "error"]
            return "desync", f"{cause} -- while rank(s) {','.join(map(str, went_on))} went on"
        if len(set(counts)) > 1:
            return "desync", f"collectives issued per rank {counts}" + (f"; {cause}" if cause else "")
        if kinds == {"error"}:
            msgs = {m for _, m in errors}
            if len(msgs) > 1 and any(is_comm_failure(m) for m in msgs):
                return "desync", f"ranks raised different errors; {cause}"
            return "error", errors[0][1] if len(msgs) == 1 else " | ".join(sorted(msgs))[:300]
        if "wrong" in kinds:
            return "wrong", next(c.msg for c in cases if c.kind == "wrong")
        return "pass", ""

    def replace_slots(self, keys: list[tuple[str, str]]) -> None:
        """Fresh groups and meshes for (lib, mode) keys: the old ones may hold unmatched collectives.

        Every old group goes down before any new one is made, so no socket is shut down after
        its number went to a new group.
        """
        for key in keys:
            self.slots[key].destroy()
        for key in keys:
            self.slots[key] = self.new_slot(*key)
        if keys:
            # new_group can return on one rank before a peer has accepted its connections: no
            # rank may use (or shut down) the new groups until every rank has them.
            self.dist.barrier(group=self.ctrl)
        self.replaced += len(keys)
        self.replaced_total += len(keys)

    def clear_caches(self) -> None:
        clear_caches()
        self.replaced = 0

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        torch = self.torch
        start = time.perf_counter()
        ops = select_ops(load_op_db(), self.args)
        if self.args._start == 0:
            self.say(f"op coverage: OpInfo float32 CPU samples (first {self.args.samples} per op), "
                     f"{len(ops)} OpInfos, mesh ({self.world},) gloo, layouts {'/'.join(MODES)}, "
                     f"torch {torch.__version__}, libraries: {', '.join(self.args.lib_list)}")
        for index in range(self.args._start, len(ops)):
            opinfo = ops[index]
            t0 = time.perf_counter()
            res = self.run_op(index, opinfo)
            record = {"index": index, "name": full_name(opinfo)}
            if isinstance(res, str):
                record["skip"] = res
            else:
                record["results"] = {lib: r.to_json() for lib, r in res.items()}
                self.say(_op_line(index, len(ops), res, time.perf_counter() - t0))
            self.save(record)
        self.save({"done": len(ops), "seconds": time.perf_counter() - start})
        return 0

    def save(self, record: dict) -> None:
        if self.rank == 0 and self.state:
            with open(os.path.join(self.state, "results.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")


def _same_value(a, e) -> bool:
    if isinstance(a, float) and isinstance(e, float) and a != a and e != e:
        return True
    try:
        return bool(a == e)
    except Exception:  # noqa: BLE001
        return False


def _describe(sample) -> str:
    import torch

    def d(x):
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(d(y) for y in x) + "]"
        return repr(x)[:30]

    kw = ", ".join(f"{k}={d(v)}" for k, v in sample.kwargs.items())
    return f"({', '.join([d(sample.input), *(d(a) for a in sample.args)] + ([kw] if kw else []))})"


# ====================================================================== reporting
def _counts(r: OpResult) -> str:
    c = r.counts
    if r.passing:
        return f"{c['pass']}/{r.cases} pass"
    parts = [f"{c['pass']}/{r.cases} pass"] + [f"{c[k]} {k}" for k in KINDS[1:] if c[k]]
    return " ".join(parts)


def _op_line(index: int, total: int, res: dict[str, OpResult], seconds: float) -> str:
    name = next(iter(res.values())).name
    tag = " (random: shapes only)" if next(iter(res.values())).random else ""
    head = f"[{index + 1}/{total}] {name}{tag} ({seconds:.1f} s)"
    lines = [head]
    for lib, r in res.items():
        line = f"    {lib:<9} {_counts(r)}"
        for kind in ("crash", "desync", "wrong", "error"):
            if kind in r.first:
                line += f" | {kind}: {r.first[kind][:220]}"
                break
        lines.append(line)
    return "\n".join(lines)


def report(per_lib: dict[str, list[OpResult]], skipped: dict[str, str], elapsed: float) -> None:
    print("\n=== summary ===")
    if skipped:
        print(f"skipped {len(skipped)} ops (no tensor input, reference raised on every sample, ...): "
              + ", ".join(sorted(skipped))[:600])
    for lib, results in per_lib.items():
        plain = [r for r in results if not r.random]
        rand = [r for r in results if r.random]
        tot = {k: sum(r.counts[k] for r in plain) for k in KINDS}
        passing = [r for r in plain if r.passing]
        desync = [r.name for r in results if r.counts["desync"]]
        crash = [r.name for r in results if r.counts["crash"]]
        wrong = [r.name for r in plain if r.counts["wrong"]]
        error = [r.name for r in plain if r.counts["error"] and not (r.counts["wrong"] or r.counts["desync"]
                                                                     or r.counts["crash"])]
        print(f"{lib}: ops tried {len(plain)}, ops fully passing {len(passing)}, "
              f"cases pass {tot['pass']} / wrong {tot['wrong']} / error {tot['error']} / desync {tot['desync']}"
              + (f" / crash {tot['crash']}" if tot["crash"] else ""))
        print(f"  {lib} desync ops ({len(desync)}): {', '.join(desync) or '-'}")
        print(f"  {lib} crash ops ({len(crash)}): {', '.join(crash) or '-'}")
        print(f"  {lib} wrong ops ({len(wrong)}): {', '.join(wrong) or '-'}")
        print(f"  {lib} error-only ops ({len(error)}): {', '.join(error) or '-'}")
        r_ok = [r.name for r in rand if r.passing]
        r_bad = [f"{r.name} ({next(k for k in ('crash', 'desync', 'wrong', 'error') if r.counts[k])})"
                 for r in rand if not r.passing and r.cases]
        print(f"  {lib} random ops ({len(rand)}; shapes/dtypes only): {len(r_ok)} ran on every case"
              + (f"; not: {', '.join(r_bad)}" if r_bad else ""))
        print(f"RESULT {lib}: ops_tried={len(plain)} ops_passing={len(passing)} cases_pass={tot['pass']} "
              f"cases_wrong={tot['wrong']} cases_error={tot['error']} cases_desync={tot['desync']} "
              f"wrong_ops={len(wrong)} desync_ops={len(desync)} crash_ops={len(crash)}")
    print(f"elapsed: {elapsed:.1f} s", flush=True)


# ====================================================================== the worker
def worker() -> int:
    args = parse_args(sys.argv[1:])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4 * args.op_timeout + 600))
    if dist.get_world_size() != NPROC:
        raise SystemExit(f"needs {NPROC} ranks, got {dist.get_world_size()}")
    if args._state:
        import faulthandler

        # A rank that aborts (gloo, a segfault) leaves its traceback here: the parent learns
        # which rank crashed, hence which case to blame.
        fault = open(os.path.join(args._state, f"fault.{dist.get_rank()}.txt"), "w")  # noqa: SIM115
        faulthandler.enable(file=fault)
    harness = Harness(args)
    status = harness.run()
    if harness.rank == 0 and args.verbose:
        print(f"(groups replaced: {harness.replaced_total}; open fds on rank 0: {open_fds()}, "
              f"threads: {len(os.listdir('/proc/self/task'))})", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Replaced groups may still hold timed-out work; tearing everything down can block. Leave.
    os._exit(status)


# ====================================================================== the parent
def _read_excluded(state: str | None) -> dict[str, list[str]]:
    if not state or not os.path.exists(os.path.join(state, "excluded.json")):
        return {}
    with open(os.path.join(state, "excluded.json")) as f:
        return json.load(f)


def _read_records(state: str) -> list[dict]:
    path = os.path.join(state, "results.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _crash_site(state: str, start: int) -> list | None:
    """Where the rank that crashed was (the earliest such position); else the earliest of any rank.

    A crashing rank leaves a traceback in its fault file (faulthandler); the others, stopped by
    the launcher with SIGTERM, do not.
    """
    sites, crashed = [], []
    for rank in range(NPROC):
        path = os.path.join(state, f"at.{rank}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            try:
                site = json.load(f)
            except ValueError:
                continue
        if not site or site[0] < start:
            continue
        sites.append(site)
        fault = os.path.join(state, f"fault.{rank}.txt")
        if os.path.exists(fault) and os.path.getsize(fault) > 0:
            crashed.append(site)
    key = lambda s: tuple(s[:2]) + (MODES.index(s[2]), LIBS.index(s[3]))  # noqa: E731
    pool = crashed or sites
    return min(pool, key=key) if pool else None


def parent(args: argparse.Namespace) -> int:
    """Launch the workers; after a crash, relaunch from the op that crashed, without its library."""
    script = os.path.abspath(sys.argv[0])
    state = tempfile.mkdtemp(prefix="op_coverage.")
    start_time = time.perf_counter()
    crashes: dict[str, dict[str, tuple]] = {}  # op -> lib -> (where, random op)
    start = 0
    try:
        for _ in range(MAX_LAUNCHES):
            for rank in range(NPROC):
                for path in (os.path.join(state, f"at.{rank}.json"), os.path.join(state, f"fault.{rank}.txt")):
                    if os.path.exists(path):
                        os.remove(path)
            code = launch([script, *sys.argv[1:], f"--_state={state}", f"--_start={start}"], NPROC)
            records = _read_records(state)
            if any("done" in r for r in records):
                break
            site = _crash_site(state, start)
            if site is None:
                print(f"\nFAILED: the workers stopped (status {code}) before running any op", flush=True)
                return 1
            index, sample, mode, lib, name, rand = site
            print(f"\n!! CRASH: op {name} ({lib}, layout {mode}, sample {sample}) brought the workers down "
                  f"(status {code}); restarting from it without {lib}\n", flush=True)
            crashes.setdefault(name, {})[lib] = (f"crashed a rank (layout {mode}, sample {sample})", rand)
            excluded = _read_excluded(state)
            excluded.setdefault(name, []).append(lib)
            with open(os.path.join(state, "excluded.json"), "w") as f:
                json.dump(excluded, f)
            start = index
        else:
            print(f"\nFAILED: more than {MAX_LAUNCHES} crashes", flush=True)
            return 1
        per_lib: dict[str, list[OpResult]] = {lib: [] for lib in args.lib_list}
        skipped: dict[str, str] = {}
        seen: dict[str, dict[str, OpResult]] = {}
        for rec in records:
            if "results" in rec:
                seen[rec["name"]] = {lib: OpResult.from_json(d) for lib, d in rec["results"].items()}
            elif "skip" in rec and rec["name"] not in crashes:
                skipped[rec["name"]] = rec["skip"]
        for name, libs in crashes.items():
            for lib, (where, rand) in libs.items():
                r = seen.setdefault(name, {}).setdefault(lib, OpResult(name, rand))
                r.add("crash", where)
        for name, res in seen.items():
            for lib, r in res.items():
                per_lib[lib].append(r)
        report(per_lib, skipped, time.perf_counter() - start_time)
        return 0
    finally:
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    parsed = parse_args(sys.argv[1:])  # --help and bad flags answer once, before any worker starts
    if under_launcher():
        from torch.distributed.elastic.multiprocessing.errors import record

        sys.exit(int(record(worker)() or 0))
    sys.exit(parent(parsed))
