"""fully_shard: parity with single-device training, collectives per group, memory, bad input.

Every distributed body trains a copy of the same seeded model (tests/toy_net.py) on its slice of
a global batch; the reference trains the same model on the whole batch in one process. Uneven
sizes are on purpose: hidden size 7 and output size 3 over 4 ranks leave short and EMPTY shards.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise import DTensor, Replicate, Shard
from shardwise.debug import CommDebugMode
from shardwise.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    UnshardedMemory,
    fully_shard,
)
from tests import toy_net as toy


# ---------------------------------------------------------------------- FSDP parity
def _fsdp_parity():
    mesh = sw.init_device_mesh("cpu", (4,))
    model = toy.shard_model(toy.net(), mesh)
    layouts = {n: (type(p).__name__, isinstance(p, DTensor), p.placements, tuple(p._local_tensor.shape))
               for n, p in model.named_parameters()}
    losses, params = toy.train(model, mesh.get_local_rank(), 4)
    state = {k: (isinstance(v, DTensor), v.placements) for k, v in model.state_dict().items()}
    return (losses, params), layouts, isinstance(model, FSDPModule), state


def test_fsdp_matches_single_device_training(dist):
    out = dist.run(4, _fsdp_parity)
    toy.check_parity([o[0] for o in out], lambda r: r, 4)
    names = [n for n, _ in toy.net().named_parameters()]
    for rank, (_, layouts, is_fsdp, state) in enumerate(out):
        assert is_fsdp and list(state) == names  # state_dict: same keys, sharded DTensors
        assert set(state.values()) == {(True, (Shard(0),))}
        assert all(is_dt and placements == (Shard(0),) for _, is_dt, placements, _ in layouts.values())
        # bias of 3 rows over 4 ranks: 1, 1, 1, 0 (rank 3 holds an EMPTY shard); 7 rows: 2, 2, 2, 1
        assert layouts["head.bias"][3] == ((1,) if rank < 3 else (0,))
        assert layouts["layers.0.up.weight"][3] == ((2, toy.D) if rank < 3 else (1, toy.D))


# ---------------------------------------------------------------------- flat layout (pure)
def test_flat_layout_round_trips_uneven_and_empty_shards():
    """Packing each rank's shards and concatenating (an all_gather) rebuilds every block;
    packing whole gradients and summing each rank's slice (a reduce_scatter) gives the shards."""
    from shardwise.parallel.data_parallel.layout import FlatLayout

    shapes, world = [(3,), (7, 2), (1, 3), (8,), (2, 2, 2)], 4
    layout = FlatLayout.build(shapes, world)
    torch.manual_seed(0)
    blocks = [torch.randn(s) for s in shapes]
    shards = [[b.chunk(world)[r] if r < len(b.chunk(world)) else b[:0] for b in blocks] for r in range(world)]
    gathered = torch.cat([layout.pack_shards(shards[r], torch.float64) for r in range(world)])
    outs = [torch.full(layout.slots[i].padded_shape(world), float("nan"), dtype=torch.float64) for i in range(len(shapes))]
    layout.unpack_gathered(gathered, outs)
    for out, block in zip(outs, blocks):
        assert torch.equal(out[: block.shape[0]], block.double())
    grads = [[torch.randn(s) for s in shapes] for _ in range(world)]
    packed = torch.stack([layout.pack_grads(g, torch.float64) for g in grads]).sum(0).view(world, -1)
    for r in range(world):
        for slot, got, parts in zip(layout.slots, layout.unpack_shards(packed[r], r), zip(*grads)):
            want = sum(p.double() for p in parts).narrow(0, slot.shard_offset(world, r), slot.shard_shape(world, r)[0])
            assert got.shape == want.shape and torch.allclose(got, want)
    assert layout.slots[0].shard_shape(world, 3) == (0,)  # 3 rows over 4 ranks: rank 3 is empty


# ---------------------------------------------------------------------- collectives per group
def _counts(reshard_after_forward: bool | None):
    mesh = sw.init_device_mesh("cpu", (4,))
    model = toy.shard_model(toy.net(), mesh, reshard_after_forward=reshard_after_forward)
    x, y = toy.local_batch(0, mesh.get_local_rank(), 4)
    with CommDebugMode() as fwd:
        out = model(x)
    loss = nn.functional.mse_loss(out, y)
    with CommDebugMode() as bwd:
        loss.backward()
    after = [(type(p).__name__, p.grad is not None and p.grad.placements == p.placements) for p in model.parameters()]
    return fwd.get_comm_counts(), bwd.get_comm_counts(), after


def _counts_per_setting():
    return {setting: _counts(setting) for setting in (True, False, None)}


def test_one_all_gather_and_one_reduce_scatter_per_group(dist):
    groups = 5  # four blocks and the root (inp + head)
    for per_setting in dist.run(4, _counts_per_setting):
        fwd, bwd, after = per_setting[True]
        assert fwd == {"all_gather": groups}
        assert bwd == {"all_gather": groups, "reduce_scatter": groups}  # gathered again for backward
        assert set(after) == {("DTensor", True)}
        fwd, bwd, _ = per_setting[False]
        assert fwd == {"all_gather": groups} and bwd == {"reduce_scatter": groups}
        # the default (None): the blocks reshard, the root keeps its parameters for backward
        fwd, bwd, _ = per_setting[None]
        assert fwd == {"all_gather": groups} and bwd == {"all_gather": groups - 1, "reduce_scatter": groups}


# ---------------------------------------------------------------------- eval, accumulation, SGD
def _accumulate_and_eval():
    from shardwise.parallel.data_parallel.memory import live_bytes

    mesh = sw.init_device_mesh("cpu", (4,))
    model = toy.shard_model(toy.net(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    rank = mesh.get_local_rank()
    for step in range(2):
        x, y = toy.local_batch(step, rank, 4)
        for micro in range(2):  # two backward passes per step, gradients accumulate
            nn.functional.mse_loss(model(x[micro : micro + 1]), y[micro : micro + 1]).div(2).backward()
        opt.step()
        model.zero_grad()
    with torch.no_grad():
        evaluated = model(toy.data(9)[0])
    grads_cleared = all(p.grad is None for p in model.parameters())
    return evaluated, {n: p.full_tensor() for n, p in model.named_parameters()}, grads_cleared, live_bytes()


def test_gradient_accumulation_sgd_and_no_grad_eval(dist):
    model = toy.net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for step in range(2):
        x, y = toy.data(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        want_eval = model(toy.data(9)[0])
    for evaluated, params, grads_cleared, live in dist.run(4, _accumulate_and_eval):
        torch.testing.assert_close(evaluated, want_eval, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert grads_cleared and live == 0  # nothing stays gathered after an eval forward


# ---------------------------------------------------------------------- gradient sync off
MICRO = 3


def _no_sync_both_meshes():
    return [_no_sync_accumulation(shape) for shape in ((4,), (2, 2))]


def _no_sync_accumulation(shape: tuple[int, ...]):
    """Two SGD steps of MICRO microbatches each, gradient sync on only for the last microbatch;
    on a 2-D mesh (HSDP) as well. Returns the parameters, and the collectives of each backward."""
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = sw.init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = toy.shard_model(toy.net(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank, counts, grads_untouched = dist.get_rank(), [], True
    for step in range(2):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            x, y = toy.local_batch(step * MICRO + micro, rank, 4)
            loss = nn.functional.mse_loss(model(x), y) / MICRO
            with CommDebugMode() as comms:
                loss.backward()
            counts.append(comms.get_comm_counts())
            if micro < MICRO - 1:
                grads_untouched &= all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
    # recurse=False turns off the root's own group only: the four blocks still reduce
    model.set_requires_gradient_sync(False, recurse=False)
    with CommDebugMode() as comms:
        nn.functional.mse_loss(model(x), y).backward()
    return {n: p.full_tensor() for n, p in model.named_parameters()}, counts, grads_untouched, comms.get_comm_counts()


def _one_process_accumulated() -> nn.Module:
    """The oracle: toy.net after two SGD steps of MICRO accumulated microbatches on one process."""
    model = toy.net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        for micro in range(MICRO):
            x, y = toy.data(step * MICRO + micro)
            (nn.functional.mse_loss(model(x), y) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return model


def test_set_requires_gradient_sync_reduces_accumulated_grads_once(dist):
    model = _one_process_accumulated()
    groups = 5
    synced_by_mesh = ({"reduce_scatter": groups}, {"reduce_scatter": groups, "all_reduce": groups})  # 1-D, HSDP
    for per_mesh in dist.run(4, _no_sync_both_meshes):
        for synced, (params, counts, grads_untouched, root_off) in zip(synced_by_mesh, per_mesh):
            for name, p in model.named_parameters():
                torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
            # backward gathers the blocks again (the root kept its parameters), never reduces
            unsynced = {"all_gather": groups - 1}
            assert counts == [unsynced, unsynced, {**unsynced, **synced}] * 2, counts
            assert grads_untouched
            assert root_off["reduce_scatter"] == groups - 1


def _kept_between_microbatches():
    """Two SGD steps of MICRO microbatches; before the last, gradient sync and resharding after
    backward are off (as a pipeline stage runs its microbatches). The parameters, each
    microbatch's collectives (forward and backward together), and the gathered bytes left."""
    from shardwise.parallel.data_parallel.memory import live_bytes

    mesh = sw.init_device_mesh("cpu", (4,))
    model = toy.shard_model(toy.net(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank, counts = dist.get_rank(), []
    for step in range(2):
        for micro in range(MICRO):
            last = micro == MICRO - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            x, y = toy.local_batch(step * MICRO + micro, rank, 4)
            with CommDebugMode() as comms:
                (nn.functional.mse_loss(model(x), y) / MICRO).backward()
            counts.append(comms.get_comm_counts())
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() for n, p in model.named_parameters()}, counts, live_bytes()


def test_set_reshard_after_backward_keeps_parameters_for_the_next_microbatch(dist):
    model = _one_process_accumulated()
    groups = 5  # four blocks and the root
    for params, counts, live in dist.run(4, _kept_between_microbatches):
        for name, p in model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        # The first microbatch gathers every group in forward and the blocks again in backward
        # (freed after forward); later ones only the blocks for backward: forward finds them
        # kept by the previous backward (and frees them after it, reshard_after_forward).
        first, later = {"all_gather": 2 * groups - 1}, {"all_gather": groups - 1}
        assert counts == [first, later, {**later, "reduce_scatter": groups}] * 2, counts
        assert live == 0  # the last backward freed what the others kept


# ---------------------------------------------------------------------- HSDP
def _hsdp_parity():
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = toy.shard_model(toy.net(), mesh)
    placements = {p.placements for p in model.parameters()}
    x, y = toy.local_batch(0, dist.get_rank(), 4)
    with CommDebugMode() as comms:
        nn.functional.mse_loss(model(x), y).backward()
    model.zero_grad()
    kinds = sorted({(r.kind, r.mesh.axis_name(r.axis)) for r in comms.records})
    return toy.train(model, dist.get_rank(), 4), placements, comms.get_comm_counts(), kinds


def test_hsdp_matches_single_device_training(dist):
    out = dist.run(4, _hsdp_parity)
    toy.check_parity([o[0] for o in out], lambda r: r, 4)  # every rank is its own data-parallel rank
    for _, placements, counts, kinds in out:
        assert placements == {(Replicate(), Shard(0))}
        # 5 gathers in forward, 4 in backward: the root keeps its parameters after forward (the
        # reshard_after_forward default, None, is False for the root, as in torch's FSDP2)
        assert counts == {"all_gather": 9, "reduce_scatter": 5, "all_reduce": 5}
        assert kinds == [("all_gather", "shard"), ("all_reduce", "replicate"), ("reduce_scatter", "shard")]


# ---------------------------------------------------------------------- FSDP + TP
def _tp_partition(name: str, module: nn.Module, mesh) -> None:
    """Colwise ``up`` (weight and bias Shard(0)), rowwise ``down`` (weight Shard(1)); the rest replicated."""
    if name.endswith(".up"):
        module.weight = nn.Parameter(sw.distribute_tensor(module.weight.data, mesh, [Shard(0)]))
        module.bias = nn.Parameter(sw.distribute_tensor(module.bias.data, mesh, [Shard(0)]))
    elif name.endswith(".down"):
        module.weight = nn.Parameter(sw.distribute_tensor(module.weight.data, mesh, [Shard(1)]))


def _fsdp_tp_parity(hsdp: bool):
    """TP by hand on ``tp``, then fully_shard over ``dp`` (or HSDP over (dp_replicate=1, dp_shard=2))."""
    if hsdp:
        mesh = sw.init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp_mesh, shard_axis = mesh["dp_replicate", "dp_shard"], "dp_shard"
    else:
        mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, shard_axis = mesh["dp"], "dp"
    model = sw.distribute_module(
        toy.net(),
        mesh["tp"],
        partition_fn=_tp_partition,
        input_fn=lambda mod, inputs, m: (DTensor.from_local(inputs[0], m, [Replicate()]),),
        output_fn=lambda mod, out, m: out.redistribute(m, [Replicate()]).to_local(),
    )
    toy.shard_model(model, dp_mesh)
    seen = []
    model.layers[0].up.register_forward_hook(
        lambda mod, args, out: seen.append((type(mod.weight).__name__, mod.weight.device_mesh.mesh_dim_names, mod.weight.placements))
    )
    layouts = {
        n: (p.device_mesh.mesh_dim_names, dict(zip(p.device_mesh.mesh_dim_names, p.placements)))
        for n, p in model.named_parameters()
    }
    dp_rank = mesh.get_local_rank(shard_axis)
    x, _ = toy.local_batch(0, dp_rank, 2)
    with CommDebugMode() as comms:
        model(x)
    gathers = sum(1 for r in comms.records if r.kind == "all_gather" and r.mesh.axis_name(r.axis) == shard_axis)
    return toy.train(model, dp_rank, 2), layouts, seen[0], gathers


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp_tp", "hsdp_tp"])
def test_fsdp_with_tensor_parallel_matches_single_device_training(dist, hsdp):
    out = dist.run(4, _fsdp_tp_parity, hsdp)
    toy.check_parity([o[0] for o in out], lambda r: r // 2, 2)  # tp is the last axis: dp = rank // 2
    dp = {"dp_replicate": Replicate(), "dp_shard": Shard(0)} if hsdp else {"dp": Shard(0)}
    names = ("tp", *dp)  # TP cut the global tensor first, FSDP cuts dim 0 of the TP block
    for _, layouts, seen, gathers in out:
        assert layouts["layers.1.up.weight"] == (names, {"tp": Shard(0), **dp})
        assert layouts["layers.1.up.bias"] == (names, {"tp": Shard(0), **dp})
        assert layouts["layers.1.down.weight"] == (names, {"tp": Shard(1), **dp})
        assert layouts["head.bias"] == (names, {"tp": Replicate(), **dp})
        assert seen == ("DTensor", ("tp",), (Shard(0),))  # forward computes on the TP layout
        assert gathers == 5  # one all_gather over the shard axis per group


# ---------------------------------------------------------------------- mixed precision
def _mixed_precision():
    mesh = sw.init_device_mesh("cpu", (4,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = toy.shard_model(toy.net(), mesh, mp_policy=policy)
    seen = []
    model.layers[0].up.register_forward_hook(lambda mod, args, out: seen.append((mod.weight.dtype, args[0].dtype, out.dtype)))
    x, y = toy.local_batch(0, mesh.get_local_rank(), 4)
    nn.functional.mse_loss(model(x).float(), y).backward()
    grads = {n: (p.grad.dtype, p.grad.full_tensor()) for n, p in model.named_parameters()}
    toy.optimizer(model.parameters()).step()
    kept = {(p.dtype, p._local_tensor.dtype) for p in model.parameters()}
    return seen, grads, kept


def test_mixed_precision_computes_in_bf16_and_reduces_fp32_grads(dist):
    model = toy.net()
    x, y = toy.data(0)
    nn.functional.mse_loss(model(x), y).backward()
    for seen, grads, kept in dist.run(4, _mixed_precision):
        assert seen == [(torch.bfloat16, torch.bfloat16, torch.bfloat16)]
        assert kept == {(torch.float32, torch.float32)}  # sharded params and optimizer stay fp32
        for name, p in model.named_parameters():
            dtype, grad = grads[name]
            assert dtype == torch.float32
            # bf16 keeps ~3 significant digits: loose, yet far below a wrong average (x4) or sign
            torch.testing.assert_close(grad, p.grad, rtol=0.05, atol=0.02 * p.grad.abs().max().item(), msg=name)


# ---------------------------------------------------------------------- peak parameter memory
class Stack(nn.Module):
    """Blocks only: after per-block fully_shard the root group holds no parameters."""

    def __init__(self, blocks: int, d: int, h: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(toy.Block(d, h) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _peak_memory(reshard_after_forward: bool):
    """Peak parameter bytes on this rank during forward + backward.

    Measured: sharded storage (the bytes of every parameter's local shard, read from the
    tensors) + the peak of gathered parameter storage, which fully_shard counts on every
    resize of an unsharded parameter's storage (``UnshardedMemory``); at every block's forward
    the counter is checked against the storages of all gathered parameters. The all_gather
    send/receive buffers are reported separately (``peak_bytes_with_staging``).
    """
    from shardwise.parallel.data_parallel.memory import live_bytes
    from shardwise.parallel.data_parallel.state import state_of

    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = Stack(6, 17, 38)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.layers)
    # rounding of uneven shards: a shard has ceil(rows / 4) rows, a gathered block ceil(rows / 4) * 4
    def row_bytes(p):
        return p[0].numel() * p.element_size()

    def ceil_rows(p):
        return -(-p.shape[0] // 4)

    shard_round = sum((ceil_rows(p) - p.shape[0] / 4) * row_bytes(p) for p in model.parameters())
    block_round = max(sum((4 * ceil_rows(p) - p.shape[0]) * row_bytes(p) for p in b.parameters()) for b in model.layers)
    pad = shard_round + block_round
    originals = [weakref.ref(p) for p in model.parameters()]
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    gc.collect()
    assert all(ref() is None for ref in originals), "fully_shard keeps whole parameters alive"
    sharded = sum(p._local_tensor.untyped_storage().nbytes() for p in model.parameters())
    states = [state_of(m) for m in model.modules() if state_of(m) is not None]
    checks = []

    def storage_matches_counter(*_):
        real = sum(p.unsharded.untyped_storage().nbytes() for s in states for p in s.group.params)
        checks.append(real == live_bytes("unsharded"))

    for layer in model.layers:
        layer.register_forward_hook(storage_matches_counter)
    x = torch.randn(4, 17)
    with UnshardedMemory() as mem:
        model(x).square().mean().backward()
    return {"sharded": sharded, "peak": mem.peak_bytes, "staged": mem.peak_bytes_with_staging,
                "total": total, "block": block, "pad": pad, "checks": checks, "live_after": live_bytes("unsharded")}


def test_peak_parameter_memory_is_one_shard_plus_one_block(dist):
    for m in dist.run(4, _peak_memory, True):
        assert all(m["checks"]) and len(m["checks"]) == 6 and m["live_after"] == 0
        bound = m["total"] / 4 + m["block"] + m["pad"]
        assert m["block"] <= m["peak"] and m["sharded"] + m["peak"] <= bound, m
        # the all_gather buffers (one block's flat receive buffer + this rank's send buffer) come on top
        assert m["sharded"] + m["staged"] <= bound + (m["block"] + m["pad"]) * (1 + 1 / 4), m
    # Without resharding every block stays gathered until its backward: the bound must catch it.
    for m in dist.run(4, _peak_memory, False):
        assert m["sharded"] + m["peak"] > m["total"] / 4 + m["block"] + m["pad"], m


# ---------------------------------------------------------------------- bad input
class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


def _twice():
    mesh = sw.init_device_mesh("cpu", (4,))
    layer = fully_shard(nn.Linear(4, 4), mesh=mesh)
    with CommDebugMode() as comms:
        try:
            fully_shard(layer, mesh=mesh)
        finally:
            assert comms.get_total_counts() == 0
            dist.barrier()


def _child_after_parent():
    mesh = sw.init_device_mesh("cpu", (4,))
    model = fully_shard(Pair(), mesh=mesh)
    fully_shard(model.b, mesh=mesh)


def _three_d_mesh():
    mesh = sw.init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    fully_shard(Pair(), mesh=mesh)


def _different_meshes():
    mesh = sw.init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "tp", "cp"))
    model = Pair()
    model.a.weight = nn.Parameter(sw.distribute_tensor(model.a.weight.data, mesh["tp"], [Shard(0)]))
    model.b.weight = nn.Parameter(sw.distribute_tensor(model.b.weight.data, mesh["cp"], [Shard(1)]))
    fully_shard(model, mesh=mesh["dp"])


def _unrelated_mesh():
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    other = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    model = Pair()
    model.b.bias = nn.Parameter(sw.distribute_tensor(model.b.bias.data, other, [Replicate()]))
    fully_shard(model, mesh=mesh["dp"])


def test_bad_input_raises_one_clear_error_on_every_rank(dist):
    dist.run_expect_error(4, _twice, match=r"fully_shard was already applied to Linear")
    dist.run_expect_error(4, _child_after_parent, match=r"fully_shard\(Linear\): parameter 'weight' is already sharded")
    dist.run_expect_error(4, _three_d_mesh, match=r"fully_shard\(Pair\): the mesh must be 1-D .* or 2-D .*3 axes")
    dist.run_expect_error(
        4, _different_meshes, match=r"fully_shard\(Pair\): parameters are on different meshes: 'a.weight' .* 'b.weight'"
    )
    dist.run_expect_error(4, _unrelated_mesh, match=r"fully_shard\(Pair\): parameter 'b.bias' lives on mesh\(x=4\)")


# ---------------------------------------------------------------------- activation checkpointing
class Checkpointed(nn.Module):
    """Recomputes ``inner``'s forward during backward (non-reentrant activation checkpointing)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _checkpointed_grads():
    mesh = sw.init_device_mesh("cpu", (4,))
    model = toy.net()
    model.layers = nn.ModuleList(Checkpointed(layer) for layer in model.layers)
    toy.shard_model(model, mesh)
    x, y = toy.local_batch(0, mesh.get_local_rank(), 4)
    nn.functional.mse_loss(model(x), y).backward()
    return {n.replace(".inner", ""): p.grad.full_tensor() for n, p in model.named_parameters()}


def test_activation_checkpointing_recomputes_with_gathered_parameters(dist):
    model = toy.net()
    x, y = toy.data(0)
    nn.functional.mse_loss(model(x), y).backward()
    for grads in dist.run(4, _checkpointed_grads):
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


class _Branchy(nn.Module):
    """``sometimes`` is used only when asked (data-dependent use); ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.always = nn.Linear(4, 4)
        self.sometimes = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        y = self.always(x)
        return self.sometimes(y) if use_sometimes else y


def _unused_parameters():
    mesh = sw.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = fully_shard(_Branchy(), mesh=mesh)
    rank = dist.get_rank()
    torch.manual_seed(1)
    x = torch.randn(4, 2, 4)[rank]
    model(x, use_sometimes=rank == 0).sum().backward()
    return {n: (None if p.grad is None else p.grad.full_tensor()) for n, p in model.named_parameters()}


def test_parameters_no_rank_used_keep_grad_none(dist):
    """As on one device: no gradient -> None (AdamW skips it, no weight decay); a parameter
    used on some ranks gets the average over all ranks (zeros from the others)."""
    torch.manual_seed(0)
    model = _Branchy()
    torch.manual_seed(1)
    xs = torch.randn(4, 2, 4)
    sum(model(xs[r], use_sometimes=r == 0).sum() for r in range(4)).backward()
    for grads in dist.run(4, _unused_parameters):
        assert grads["never.weight"] is None and grads["never.bias"] is None
        for name in ("always.weight", "always.bias", "sometimes.weight", "sometimes.bias"):
            torch.testing.assert_close(grads[name], dict(model.named_parameters())[name].grad / 4)


# ---------------------------------------------------------------------- one-row parameters
def _one_row_steps():
    """A [1, 6] output weight over 4 ranks (three empty shards): optimizers step it in place."""
    mesh = sw.init_device_mesh("cpu", (4,))
    out = {}
    for name, make in _ONE_ROW_OPTIMIZERS.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 1))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = make(model.parameters())
        for step in range(2):
            x, y = toy.local_batch(step, mesh.get_local_rank(), 4)
            nn.functional.mse_loss(model(x), y[:, :1]).backward()
            opt.step()
            opt.zero_grad()
        out[name] = ({n: p.full_tensor() for n, p in model.named_parameters()},
                     {n: p.placements for n, p in model.named_parameters()})
    return out


_ONE_ROW_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
    "sgd_foreach_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.02, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.02, foreach=True),
}


def test_optimizers_step_parameters_whose_shards_are_empty_on_some_ranks(dist):
    for per_optimizer in dist.run(4, _one_row_steps):
        for name, (params, placements) in per_optimizer.items():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 1))
            opt = _ONE_ROW_OPTIMIZERS[name](model.parameters())
            for step in range(2):
                x, y = toy.data(step)
                nn.functional.mse_loss(model(x), y[:, :1]).backward()
                opt.step()
                opt.zero_grad()
            assert set(placements.values()) == {(Shard(0),)}, (name, placements)  # still sharded after the steps
            for n, p in model.named_parameters():
                torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6, msg=f"{name} {n}")
