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
  - a rank whose case raised destroys that group at once: a peer left waiting in a collective
    the raising rank will never enter gets "Connection closed by peer" instead of hanging (a
    short group timeout, --op-timeout, is the backstop for a peer that went on without raising);
  - after each sample, the ranks exchange their per-case status (outcome, first line of the
    error, collectives issued on that group: ``_get_sequence_number_for_group``) over a separate
    control group that nothing else uses, which every rank reaches because errors are caught
    per rank;
  - a group where any rank raised is replaced on every rank by a fresh one (a new mesh with a
    new axis name, so no cached sharding decision refers to the old group; the libraries'
    sharding caches are cleared now and then so old groups' sockets are released).

Random ops (bernoulli, normal, dropout, rand_like...) and ops whose values are unspecified
(empty_like...) are reported separately: only shapes and dtypes are compared. Ops whose samples
have no tensor input (factories) are skipped.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import logging
import os
import random
import sys
import time
import types
import unittest
import warnings
from dataclasses import dataclass, field

from shardwise.launch import main_or_launch

NPROC = 4
LIBS = ("shardwise", "torch")
MODES = ("R", "S0")

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
    p.add_argument("--quick", action="store_true", help=f"only {len(QUICK_OPS)} common ops, 4 samples each (< 2 min)")
    p.add_argument("--ops", default=None, help="comma-separated OpInfo names (a base name takes every variant)")
    p.add_argument("--limit", type=int, default=None, help="only the first N ops")
    p.add_argument("--samples", type=int, default=None, help="samples per op (default 8, --quick 4)")
    p.add_argument("--libs", default=",".join(LIBS), help="comma-separated libraries (default shardwise,torch)")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--op-timeout", type=float, default=20.0,
                   help="seconds a rank waits in a collective of an op before it counts as desynced")
    p.add_argument("-v", "--verbose", action="store_true", help="print every failing case")
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

    kind: str  # "pass", "wrong", "error", "skip"
    msg: str = ""
    collectives: int = 0

    def same(self, other: "Case") -> bool:
        return (self.kind, self.msg, self.collectives) == (other.kind, other.msg, other.collectives)


@dataclass
class OpResult:
    """Counts of one op in one library, over its samples and layouts."""

    name: str
    random: bool
    counts: dict = field(default_factory=lambda: {"pass": 0, "wrong": 0, "error": 0, "desync": 0})
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


# ====================================================================== per-rank machinery
class Slot:
    """A library's mesh on its own process group, for one layout; replaced once any rank raised on it."""

    def __init__(self, h: "Harness", lib: str, mode: str) -> None:
        import torch.distributed as dist

        h.generation += 1
        name = f"{lib[:2]}{mode}g{h.generation}"  # new name: no cached decision refers to old groups
        before = _socket_fds()
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=h.args.op_timeout))
        after = _socket_fds()
        # This group's listener and peer connections, as (fd, inode): gloo closes a pair's fd when
        # the peer goes away and the number may then be reused, so the inode is checked again.
        self.sockets = sorted((fd, ino) for fd, ino in after.items() if before.get(fd) != ino)
        if lib == "shardwise":
            self.mesh = h.sw.DeviceMesh("cpu", list(range(h.world)), mesh_dim_names=(name,))
            self.mesh._groups = [self.group]  # run this mesh's collectives on the dedicated group
        else:
            from torch.distributed.device_mesh import DeviceMesh

            self.mesh = DeviceMesh.from_group(self.group, "cpu", mesh_dim_names=(name,))
        self.alive = True

    def seq(self) -> int:
        return int(self.group._get_sequence_number_for_group()) if self.alive else -1

    def destroy(self) -> None:
        """Tear the group down so that peers blocked in one of its collectives fail at once.

        Destroying a gloo group does not close its connections while anything still refers to
        it (the library's caches do), so its peer sockets are shut down directly: a peer waiting
        on this rank gets "Connection closed by peer", raises and shuts down its own in turn.
        """
        import socket

        import torch.distributed as dist

        if not self.alive:
            return
        self.alive = False
        try:
            dist.destroy_process_group(self.group)
        except Exception:  # noqa: BLE001 - already broken; it only has to go away
            pass
        for fd, ino in self.sockets:
            try:
                if os.fstat(fd).st_ino != ino:
                    continue  # closed by gloo, and the number reused by another socket
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # never the listener
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.close()  # the duplicate only; the group closes its own when freed


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
        self.ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ctrl_timeout))
        self.slots = {(lib, mode): Slot(self, lib, mode) for lib in args.lib_list for mode in MODES}
        self.replaced = 0  # slots replaced since the libraries' caches were last cleared
        self.replaced_total = 0
        self.dtensor_types = (sw.DTensor, tdt.DTensor)

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
            got = [x.full_tensor() if isinstance(x, self.dtensor_types) else x for x in out_leaves]
            problem = self.compare(got, expected, rand)
            case = Case("wrong", problem) if problem else Case("pass")
        except Exception as err:  # noqa: BLE001 - a verdict per case
            case = Case("error", first_line(err))
            case.collectives = slot.seq() - before
            slot.destroy()  # release any peer waiting for this rank in a collective
            return case
        case.collectives = slot.seq() - before
        return case

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

    def run_op(self, opinfo) -> dict[str, OpResult] | str:
        """Per-library results of one op, or why it was skipped (the same on every rank)."""
        torch = self.torch
        rand = is_random(opinfo)
        results = {lib: OpResult(full_name(opinfo), rand) for lib in self.args.lib_list}
        try:
            samples = self.samples(opinfo)
        except Exception as err:  # noqa: BLE001
            return self.agree_skip(f"sample_inputs raised {first_line(err)}")
        ran_any = False
        skip_why = "no samples"
        for sample in samples:
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
                    for lib in self.args.lib_list:
                        mine[(lib, mode)] = self.run_case(opinfo, leaves, spec, expected, lib, mode, rand)
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
                if any(e[key].kind == "error" for e in everyone):
                    broken.append(key)  # some rank destroyed its group
            self.replace_slots(broken)
        if self.replaced >= 16:
            self.clear_caches()
        return results if ran_any else skip_why

    def agree_skip(self, why: str) -> str:
        everyone: list = [None] * self.world
        self.dist.all_gather_object(everyone, why, group=self.ctrl)
        return next(w for w in everyone if w)

    @staticmethod
    def classify(cases: list[Case]) -> tuple[str, str]:
        """One verdict from every rank's outcome of a case (and, for a desync, its root cause)."""
        kinds = {c.kind for c in cases}
        counts = [c.collectives for c in cases]
        errors = [(r, c.msg) for r, c in enumerate(cases) if c.kind == "error"]
        # The error a rank raised by itself, not the one it got because a peer left a collective.
        roots = [(r, m) for r, m in errors if not _is_comm_failure(m)] or errors
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
            if len(msgs) > 1 and any(_is_comm_failure(m) for m in msgs):
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
            self.slots[key] = Slot(self, *key)
        if keys:
            # new_group can return on one rank before a peer has accepted its connections: no
            # rank may use (or shut down) the new groups until every rank has them.
            self.dist.barrier(group=self.ctrl)
        self.replaced += len(keys)
        self.replaced_total += len(keys)

    def clear_caches(self) -> None:
        """Drop cached sharding decisions: they hold old meshes, whose groups hold sockets."""
        import gc

        from shardwise.dispatch.dispatcher import clear_cache

        clear_cache()
        try:
            from torch.distributed.tensor._redistribute import _gen_transform_infos
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()
            _gen_transform_infos.cache_clear()
        except Exception:  # noqa: BLE001 - private torch helpers; a leak is not an error
            pass
        gc.collect()
        self.replaced = 0

    # ------------------------------------------------------------------ main
    def run(self) -> int:
        torch = self.torch
        start = time.perf_counter()
        ops = select_ops(load_op_db(), self.args)
        self.say(f"op coverage: OpInfo float32 CPU samples (first {self.args.samples} per op), "
                 f"{len(ops)} OpInfos, mesh ({self.world},) gloo, layouts {'/'.join(MODES)}, "
                 f"torch {torch.__version__}, libraries: {', '.join(self.args.lib_list)}")
        per_lib: dict[str, list[OpResult]] = {lib: [] for lib in self.args.lib_list}
        skipped: dict[str, str] = {}
        for index, opinfo in enumerate(ops):
            t0 = time.perf_counter()
            res = self.run_op(opinfo)
            if isinstance(res, str):
                skipped[full_name(opinfo)] = res
                continue
            for lib, r in res.items():
                per_lib[lib].append(r)
            self.say(_op_line(index, len(ops), res, time.perf_counter() - t0))
        if self.rank == 0:
            report(per_lib, skipped, time.perf_counter() - start)
        return 0


def _is_comm_failure(msg: str) -> bool:
    """An error a rank gets when a peer left a collective (it destroyed the group, or timed out)."""
    low = msg.lower()
    return any(w in low for w in ("connection closed", "timed out", "timeout", "connection reset", "broken pipe"))


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
    parts = [f"{c['pass']}/{r.cases} pass"] + [f"{c[k]} {k}" for k in ("wrong", "error", "desync") if c[k]]
    return " ".join(parts)


def _op_line(index: int, total: int, res: dict[str, OpResult], seconds: float) -> str:
    name = next(iter(res.values())).name
    tag = " (random: shapes only)" if next(iter(res.values())).random else ""
    head = f"[{index + 1}/{total}] {name}{tag} ({seconds:.1f} s)"
    lines = [head]
    for lib, r in res.items():
        line = f"    {lib:<9} {_counts(r)}"
        for kind in ("desync", "wrong", "error"):
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
        tot = {k: sum(r.counts[k] for r in plain) for k in ("pass", "wrong", "error", "desync")}
        passing = [r for r in plain if r.passing]
        desync = [r.name for r in results if r.counts["desync"]]
        wrong = [r.name for r in plain if r.counts["wrong"]]
        error = [r.name for r in plain if r.counts["error"] and not r.counts["wrong"] and not r.counts["desync"]]
        print(f"{lib}: ops tried {len(plain)}, ops fully passing {len(passing)}, "
              f"cases pass {tot['pass']} / wrong {tot['wrong']} / error {tot['error']} / desync {tot['desync']}")
        print(f"  {lib} desync ops ({len(desync)}): {', '.join(desync) or '-'}")
        print(f"  {lib} wrong ops ({len(wrong)}): {', '.join(wrong) or '-'}")
        print(f"  {lib} error-only ops ({len(error)}): {', '.join(error) or '-'}")
        r_ok = [r.name for r in rand if r.passing]
        r_bad = [f"{r.name} ({'desync' if r.counts['desync'] else 'wrong' if r.counts['wrong'] else 'error'})"
                 for r in rand if not r.passing]
        print(f"  {lib} random ops ({len(rand)}; shapes/dtypes only): {len(r_ok)} ran on every case"
              + (f"; not: {', '.join(r_bad)}" if r_bad else ""))
        print(f"RESULT {lib}: ops_tried={len(plain)} ops_passing={len(passing)} cases_pass={tot['pass']} "
              f"cases_wrong={tot['wrong']} cases_error={tot['error']} cases_desync={tot['desync']} "
              f"wrong_ops={len(wrong)} desync_ops={len(desync)}")
    print(f"elapsed: {elapsed:.1f} s", flush=True)


def _socket_fds() -> dict[int, int]:
    """This process's open socket file descriptors and their inodes."""
    import stat

    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except (OSError, ValueError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[int(name)] = st.st_ino
    return out


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


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
    harness = Harness(args)
    status = harness.run()
    if harness.rank == 0 and args.verbose:
        print(f"(groups replaced: {harness.replaced_total}; open fds on rank 0: {_open_fds()})", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Replaced groups may still hold timed-out work; tearing everything down can block. Leave.
    os._exit(status)


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and bad flags answer once, before any worker starts
    main_or_launch(worker, NPROC)
