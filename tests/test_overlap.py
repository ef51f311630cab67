"""Communication that runs ahead of its consumer: async redistribute, fully_shard's prefetch and
its delayed gradient reductions, and no host synchronization on the hot path.

The oracle is the blocking call (values and gradients equal) and single-device training; the
order of collectives and compute is recorded with a comm recorder and module hooks.
"""

import ast
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.fsdp import fully_shard
from tests.toy_net import Block

SRC = Path(sw.__file__).resolve().parent  # the code under test


# ---------------------------------------------------------------------- async redistribute
def _async_redistribute():
    results = []
    for shape in [(4,), (2, 2)]:
        mesh = sw.init_device_mesh("cpu", shape)
        torch.manual_seed(0)
        full = torch.randn(8, 6)
        cases = [([Shard(0)], [Replicate()]), ([Shard(1)], [Replicate()]), ([Replicate()], [Shard(1)]),
                 ([Shard(0)], [Shard(1)]), ([Partial()], [Shard(0)]), ([Partial("avg")], [Replicate()])]
        for src, dst in cases:
            src, dst = src * mesh.ndim, dst * mesh.ndim
            if any(isinstance(p, Partial) for p in src):
                x0 = sw.DTensor.from_local(full / mesh.size() if src[0].reduce_op == "sum" else full.clone(), mesh, src)
            else:
                x0 = sw.distribute_tensor(full, mesh, src)
            outs = {}
            for async_op in (False, True):
                x = x0.detach().requires_grad_()
                y = x.redistribute(mesh, dst, async_op=async_op)
                ran_ahead = type(y._local_tensor).__name__ == "AsyncCollectiveTensor"
                z = (y * y + 1).sum()
                z.backward()
                grad = x.grad.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
                outs[async_op] = (y.full_tensor(), grad, y.placements, ran_ahead)
            same = torch.equal(outs[False][0], outs[True][0]) and torch.equal(outs[False][1], outs[True][1])
            results.append((shape, str(src), str(dst), same, outs[False][2] == outs[True][2], outs[True][3],
                            outs[False][3], torch.allclose(outs[True][0], full)))
    return results


def test_async_redistribute_equals_blocking(dist):
    for per_rank in dist.run(4, _async_redistribute):
        for shape, src, dst, same, same_layout, ran_ahead, sync_ran_ahead, exact in per_rank:
            assert same and same_layout and exact, (shape, src, dst)
            assert not sync_ran_ahead, (shape, src, dst)
        # an all_gather along dim 0 needs nothing local after it: the result is still in flight
        assert any(ran_ahead for *_, ran_ahead, _, _ in per_rank)


# ---------------------------------------------------------------------- fully_shard prefetch
class _Stack(nn.Module):
    def __init__(self, widths: list[int], d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, h) for h in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value on the host (``.item()``, ``bool(t)``, ...):
    on a GPU each one waits for the device to finish everything queued before it."""

    READS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.READS:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


class _Events:
    """Collectives (named by the layer whose bytes they carry) and layer computations, in order."""

    def __init__(self, names: dict[tuple[str, int], str]) -> None:
        self.names, self.log = names, []

    def record(self, kind, mesh, axis, nbytes) -> None:
        self.log.append(self.names.get((kind, nbytes), f"{kind}?{nbytes}"))


def _prefetch_run(mode: str):
    """Two training steps of a 3-block stack; the second one's events, values, grads, memory."""
    from shardwise import comm
    from shardwise.parallel.data_parallel.memory import UnshardedMemory
    from shardwise.parallel.data_parallel.state import state_of

    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    widths = [12, 20, 28]
    model = _Stack(widths)
    reference = _Stack(widths)
    reference.load_state_dict(model.state_dict())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layers = list(model.layers)
    if mode == "off":
        for layer in layers + [model]:
            layer.set_modules_to_forward_prefetch([])
            layer.set_modules_to_backward_prefetch([])
    elif mode == "explicit":  # the first block gathers both others at once
        layers[0].set_modules_to_forward_prefetch([layers[1], layers[2]])
        for layer in layers[1:]:
            layer.set_modules_to_forward_prefetch([])
    names, block_bytes = {}, 0
    for i, layer in enumerate(layers):
        group = state_of(layer).group
        width = group.layout.per_rank + len(group.params)
        names[("all_gather", 3 * group.layout.per_rank * 4)] = f"AG{i}"
        names[("reduce_scatter", 3 * width * 4)] = f"RS{i}"
        block_bytes = max(block_bytes, sum(p.unsharded_nbytes for p in group.params))
    assert len(names) == 2 * len(layers)
    events = _Events(names)
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: events.log.append(f"F{i}"))
    x = torch.randn(4, 8)
    model(x).square().mean().backward()  # the first step: the module order is learned
    events.log.clear()
    comm.add_recorder(events)
    syncs = _HostReads()
    try:
        with UnshardedMemory() as mem, syncs:
            out = model(x)
            events.log.append("loss")
            out.square().mean().backward()
    finally:
        comm.remove_recorder(events)
    ref_out = reference(x)
    ref_out.square().mean().backward()
    ref_out = reference(x)  # the second step's forward (no optimizer step: the same values)
    ref_out.square().mean().backward()
    grads_ok = all(torch.allclose(p.grad.full_tensor(), r.grad, atol=1e-6)
                   for p, r in zip(model.parameters(), reference.parameters()))
    return {"log": events.log, "out_ok": torch.allclose(out.full_tensor() if isinstance(out, sw.DTensor) else out,
                                                         ref_out, atol=1e-6),
            "grads_ok": grads_ok, "peak": mem.peak_bytes, "staged": mem.peak_bytes_with_staging,
            "block": block_bytes, "host_reads": syncs.calls}


def _prefetch_modes():
    runs = {mode: _prefetch_run(mode) for mode in ("default", "off", "explicit")}
    model = fully_shard(Block(4, 4), mesh=sw.init_device_mesh("cpu", (4,)))
    try:  # bad input: a module that is not fully_shard'ed is named, before any collective
        model.set_modules_to_forward_prefetch([nn.Linear(2, 2)])
        runs["bad_input"] = None
    except TypeError as err:
        runs["bad_input"] = str(err)
    return runs


def test_fully_shard_prefetch_order(dist):
    runs = dist.run(4, _prefetch_modes)
    for per_rank in runs:
        bad = per_rank.pop("bad_input")
        assert bad is not None and "Linear is not a fully_shard'ed module" in bad, bad
        for mode, r in per_rank.items():
            assert r["out_ok"] and r["grads_ok"], mode
            assert r["host_reads"] == [], (mode, r["host_reads"])
            # at most one block's parameters gathered; one more in flight in the staging buffers
            assert r["peak"] <= r["block"], (mode, r["peak"], r["block"])
            if mode != "explicit":  # (which has two blocks in flight at once)
                assert r["staged"] <= r["block"] * (2 + 1 / 4), (mode, r["staged"], r["block"])
        on, off, explicit = per_rank["default"]["log"], per_rank["off"]["log"], per_rank["explicit"]["log"]
        split = on.index("loss")
        forward, backward = on[:split], on[split + 1:]
        # forward: block k+1's all_gather is issued before block k computes
        assert forward == ["AG0", "AG1", "F0", "AG2", "F1", "F2"], on
        assert off[:off.index("loss")] == ["AG0", "F0", "AG1", "F1", "AG2", "F2"], off
        assert explicit[:explicit.index("loss")] == ["AG0", "AG1", "AG2", "F0", "F1", "F2"], explicit
        # backward: block k-1's all_gather is issued before block k's gradients are reduced
        for k in (2, 1):
            assert backward.index(f"AG{k - 1}") < backward.index(f"RS{k}"), backward
        off_backward = off[off.index("loss") + 1:]
        for k in (2, 1):
            assert off_backward.index(f"AG{k - 1}") > off_backward.index(f"RS{k}"), off_backward
        assert sorted(backward) == sorted(off_backward) == ["AG0", "AG1", "AG2", "RS0", "RS1", "RS2"]


# ---------------------------------------------------------------------- no host synchronization
# Reading a value on the host (.item(), .tolist(), .cpu(), .numpy(), bool(t.any())) waits for the
# device: none on the hot path (dispatch, redistribute, collectives, DTensor, parallel styles,
# fully_shard/replicate). The few that stay are here with their reason; a new one fails the audit.
_HOT = ["dispatch", "redistribute", "parallel/data_parallel", "parallel/tensor_parallel/style.py",
        "parallel/tensor_parallel/prepare.py", "comm", "tensor/dtensor.py", "core/spec.py", "core/placement.py",
        "tensor/factories.py"]
_HOST_READS = {"item", "tolist", "cpu", "numpy"}
_ALLOWED = {
    # only when some parameter has no gradient on this rank: the flags say whether any rank had one
    ("parallel/data_parallel/group.py", "return (flags > 0).tolist()"),
    # a plain tensor mixed with DTensors inside backward: allowed only if it is all zeros (error path)
    ("dispatch/dispatcher.py", "return t.is_meta or t.numel() == 0 or not bool(t.any())"),
    # SequenceParallel's check that plain inputs differ across ranks: the first call only
    ("parallel/tensor_parallel/style.py", "if not bool(rows[0, 2]) and bool((rows == rows[0]).all()):"),
    ("parallel/tensor_parallel/style.py", "constant = flat.numel() == 0 or bool((flat == flat[0]).all())"),
    # a per-position scalar tensor of a _foreach op becomes the per-tensor op's number
    ("dispatch/ops/foreach.py", "return value.item()"),
}


def _is_host_read(node: ast.AST) -> bool:
    """``x.item()`` / ``.tolist()`` / ``.cpu()`` / ``.numpy()``, or ``bool(<x>.any())`` / ``bool(<x>.all())``."""
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Attribute) and node.func.attr in _HOST_READS and not node.args:
        return True
    if isinstance(node.func, ast.Name) and node.func.id == "bool" and len(node.args) == 1:
        inner = node.args[0]
        return isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr in ("any", "all")
    return False


def _host_reads() -> set[tuple[str, str]]:
    """(file, source line) of every host read in the hot-path modules (code only, not text)."""
    found = set()
    for entry in _HOT:
        path = SRC / entry
        assert path.exists(), f"the hot-path audit names {entry}, which is not in {SRC}"
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            source = file.read_text()
            lines = source.splitlines()
            for node in ast.walk(ast.parse(source)):
                if _is_host_read(node):
                    found.add((str(file.relative_to(SRC)), lines[node.lineno - 1].strip()))
    return found


def test_no_host_reads_on_the_hot_path():
    found = _host_reads()
    assert found <= _ALLOWED, sorted(found - _ALLOWED)
    assert found == _ALLOWED, f"allowed but gone (remove from _ALLOWED): {sorted(_ALLOWED - found)}"
