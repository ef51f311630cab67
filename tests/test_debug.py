"""shardwise.debug: CommDebugMode counts under torch's keys, per module and phase, its table,
and visualize_sharding, on real gloo groups (and the pure parts without processes)."""

import contextlib
import io
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import shardwise as sw
from shardwise import Partial, Replicate, Shard, comm
from shardwise.debug import CommCounts, CommDebugMode, visualize_sharding
from shardwise.debug.visualize import Block, render_sharding, sharding_blocks
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

c10d_functional = torch.ops.c10d_functional
_c10d_functional = torch.ops._c10d_functional

# Every key torch's users look counts up by, per shardwise kind.
TORCH_KEYS = {
    "all_gather": [c10d_functional.all_gather_into_tensor, _c10d_functional.all_gather_into_tensor,
                   _c10d_functional.all_gather_into_tensor.default, funcol.all_gather_tensor,
                   funcol.all_gather_tensor_autograd, dist.all_gather_into_tensor],
    "all_reduce": [c10d_functional.all_reduce, _c10d_functional.all_reduce, funcol.all_reduce, dist.all_reduce,
                   torch.ops.c10d.allreduce_],
    "reduce_scatter": [c10d_functional.reduce_scatter_tensor, _c10d_functional.reduce_scatter_tensor,
                       funcol.reduce_scatter_tensor, dist.reduce_scatter_tensor],
    "all_to_all": [c10d_functional.all_to_all_single, _c10d_functional.all_to_all_single,
                   funcol.all_to_all_single, dist.all_to_all_single],
    "broadcast": [funcol.broadcast, dist.broadcast, torch.ops.c10d.broadcast_],
    "scatter": [dist.scatter, torch.ops.c10d.scatter_],
}


# ---------------------------------------------------------------------- pure
def test_counts_answer_to_shardwise_names_and_torch_keys():
    counts = CommCounts({"all_gather": 1, "all_reduce": 2})
    assert repr(counts) == "{'all_gather': 1, 'all_reduce': 2}" and list(counts) == ["all_gather", "all_reduce"]
    assert counts == {"all_gather": 1, "all_reduce": 2} and {"all_gather": 1, "all_reduce": 2} == counts
    assert counts != {"all_gather": 1}
    assert counts == {funcol.all_gather_tensor: 1, c10d_functional.all_reduce: 2}
    for kind, keys in TORCH_KEYS.items():
        for key in keys:
            assert counts[key] == dict(counts).get(kind, 0), (kind, key)
            assert (key in counts) == (kind in dict(counts)), (kind, key)
    assert counts.get(funcol.all_reduce) == 2 and counts.get("all_to_all", 0) == 0
    for not_a_collective in ("allgather", torch.ops.aten.mm, len):
        with pytest.raises(KeyError, match="is not a collective"):
            counts[not_a_collective]
        assert not_a_collective not in counts
    assert pickle.loads(pickle.dumps(counts)) == counts


def test_the_innermost_module_in_backward():
    from shardwise.debug.module_tracker import _backward_order

    # A module and its last child start on the same gradient, the parent's hook last: nesting decides.
    assert _backward_order(["T.output", "T"]) == ["T", "T.output"]
    # A shared expert stays active through the routed experts' backward: the later subtree is inner.
    started = ["T", "T.moe", "T.moe.shared", "T.moe.shared.w1", "T.moe.experts"]
    assert _backward_order(started)[-1] == "T.moe.experts"
    assert _backward_order(started[:-1])[-1] == "T.moe.shared.w1"


def test_sharding_blocks_from_the_spec_alone():
    blocks, empty = sharding_blocks((10,), [0, 1, 2, 3], [Shard(0)])  # torch.chunk: 3, 3, 3, 1
    assert [b.ranges for b in blocks] == [((0, 3),), ((3, 6),), ((6, 9),), ((9, 10),)] and empty == ()
    blocks, empty = sharding_blocks((3, 2), [0, 1, 2, 3], [Shard(0)])
    assert [b.ranks for b in blocks] == [(0,), (1,), (2,)] and empty == (3,)
    # mesh [[0, 1], [2, 3]]: axis 0 cuts columns, axis 1 cuts rows
    blocks, _ = sharding_blocks((5, 6), [[0, 1], [2, 3]], [Shard(1), Shard(0)])
    assert blocks == [Block(((0, 3), (0, 3)), (0,)), Block(((0, 3), (3, 6)), (2,)),
                      Block(((3, 5), (0, 3)), (1,)), Block(((3, 5), (3, 6)), (3,))]
    blocks, _ = sharding_blocks((4, 6), [[0, 1], [2, 3]], [Replicate(), Shard(1)])
    assert [b.ranks for b in blocks] == [(0, 2), (1, 3)]


def test_render_sharding_tables():
    assert render_sharding((5, 6), [[0, 1], [2, 3]], [Shard(0), Shard(1)], title="x") == (
        "x\n"
        "         Col 0-2  Col 3-5\n"
        "Row 0-2  cpu:0    cpu:1\n"
        "Row 3-4  cpu:2    cpu:3")
    assert render_sharding((3,), [0, 1, 2, 3], [Shard(0)]) == (
        "         Col 0-0\nRow 0-0  cpu:0\nRow 1-1  cpu:1\nRow 2-2  cpu:2\nranks holding no elements: 3")
    partial = render_sharding((2, 3), [[0, 1], [2, 3]], [Replicate(), Partial()], axis_names=["dp", "tp"])
    assert partial.splitlines() == [
        "         Col 0-2", "Row 0-1  cpu:0,1,2,3",
        "Partial(sum) on mesh axis 'tp': ranks of a cell that differ along it hold partial values; the block is their sum"]
    assert render_sharding((2, 2, 4), [0, 1], [Shard(2)]).splitlines() == ["[0-1, 0-1, 0-1]  cpu:0", "[0-1, 0-1, 2-3]  cpu:1"]
    assert render_sharding((0, 3), [0, 1], [Shard(0)]) == "empty tensor of shape [0, 3]: no rank holds any element"


# ---------------------------------------------------------------------- real collectives
def _redistributes():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = torch.arange(40.0).reshape(10, 4)
    sharded = sw.distribute_tensor(x, mesh, [Shard(0)], src_data_rank=None)
    partial = sw.DTensor.from_local(x.clone(), mesh, [Partial()])
    out = {}
    for name, start, dst in [("gather", sharded, [Replicate()]), ("reduce", partial, [Replicate()]),
                             ("a2a", sharded, [Shard(1)]), ("rs", partial, [Shard(0)]),
                             ("none", sharded, [Shard(0)])]:
        with CommDebugMode() as comms:
            start.redistribute(mesh, dst)
        counts = comms.get_comm_counts()
        by_torch = {kind: [counts[key] for key in keys] for kind, keys in TORCH_KEYS.items()}
        out[name] = (counts, by_torch, comms.get_total_counts(), [str(r) for r in comms.records])
    return out


def test_counts_by_torch_keys_after_redistribute(dist):
    want = {"gather": "all_gather", "reduce": "all_reduce", "a2a": "all_to_all", "rs": "reduce_scatter"}
    for out in dist.run(4, _redistributes):
        for name, (counts, by_torch, total, records) in out.items():
            kind = want.get(name)
            assert counts == ({kind: 1} if kind else {}), (name, counts)
            assert total == (1 if kind else 0)
            for other, looked_up in by_torch.items():
                assert looked_up == [1 if other == kind else 0] * len(looked_up), (name, other, looked_up)
            if kind:
                assert counts[c10d_functional.all_gather_into_tensor] == (kind == "all_gather")
                assert records[0].startswith(f"{kind} on tp (") and records[0].endswith("B) in Global")


def _tp_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))


def _tp_forward_backward():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = parallelize_module(_tp_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    hooks_before = [len(m._forward_hooks) for m in model.modules()]
    global_before = len(torch.nn.modules.module._global_forward_pre_hooks)
    x = torch.arange(18.0).reshape(3, 6).div(7).requires_grad_()
    with CommDebugMode() as comms:
        y = model(x)
        y.pow(2).sum().backward()
    counts = comms.get_comm_counts()
    forward, backward = comms.comm_module_counts["Global"]["forward"], comms.comm_module_counts["Global"]["backward"]
    per_module = comms.get_per_module_comm_counts()
    phases = {name: {p: dict(c) for p, c in v.items()} for name, v in comms.comm_module_counts.items()}
    left = ([len(m._forward_hooks) for m in model.modules()] == hooks_before
            and len(torch.nn.modules.module._global_forward_pre_hooks) == global_before)
    grad = x.grad.clone()
    with CommDebugMode() as forward_only:  # backward after the mode: not recorded, no error
        z = model(x.detach().requires_grad_())
    z.sum().backward()
    lookups = (counts[funcol.all_reduce], counts[c10d_functional.all_reduce], forward[_c10d_functional.all_reduce],
               backward[funcol.all_reduce], per_module["Sequential.2"][funcol.all_reduce],
               per_module["Sequential.0"][c10d_functional.all_reduce], per_module["Sequential.1"][funcol.all_reduce])
    tables = {level: comms.generate_comm_debug_tracing_table(noise_level=level) for level in (0, 1, 2)}
    return (y.detach(), grad, counts, per_module, phases, lookups, left, forward_only.get_comm_counts(),
            [(r.module, r.phase.value, r.axis_name) for r in comms.records], tables, comms.get_sharding_info())


def test_tp_linear_counts_per_module_forward_and_backward(dist):
    x = torch.arange(18.0).reshape(3, 6).div(7).requires_grad_()
    model = _tp_mlp()
    want = model(x)
    want.pow(2).sum().backward()
    for (y, grad, counts, per_module, phases, lookups, left, forward_only, records, tables, sharding) in dist.run(4, _tp_forward_backward):
        assert torch.allclose(y, want, atol=1e-5) and torch.allclose(grad, x.grad, atol=1e-5)
        assert counts == {"all_reduce": 2} and lookups == (2, 2, 1, 1, 1, 1, 0)
        # rowwise output Partial -> Replicate in forward; colwise input gradient in backward
        assert records == [("Sequential.2", "forward", "tp"), ("Sequential.0", "backward", "tp")]
        assert per_module == {"Global": {"all_reduce": 2}, "Sequential": {"all_reduce": 2},
                              "Sequential.0": {"all_reduce": 1}, "Sequential.1": {}, "Sequential.2": {"all_reduce": 1}}
        assert phases["Sequential.2"] == {"forward": {"all_reduce": 1}, "backward": {}}
        assert phases["Sequential.0"] == {"forward": {}, "backward": {"all_reduce": 1}}
        assert left, "hooks left on the model or globally after the mode"
        assert forward_only == {"all_reduce": 1}
        # all_reduce of a [3, 6] f32 on 4 ranks sends 18 + 2 * 5 elements = 112 B
        assert tables[0].splitlines() == [
            "Global",
            "  forward   all_reduce      x1   on tp       112 B",
            "  backward  all_reduce      x1   on tp       112 B",
            "  Sequential",
            "    forward   all_reduce      x1   on tp       112 B",
            "    backward  all_reduce      x1   on tp       112 B",
            "    Sequential.0",
            "      backward  all_reduce      x1   on tp       112 B",
            "    Sequential.1",
            "    Sequential.2",
            "      forward   all_reduce      x1   on tp       112 B",
        ]
        assert "    Sequential.0 (Linear)  weight: f32[8@tp,6]  bias: f32[8@tp]" in tables[1].splitlines()
        assert "    Sequential.2 (Linear)  weight: f32[6,8@tp]  bias: f32[6]" in tables[1].splitlines()
        assert "        #1   forward   all_reduce      on tp       112 B" in tables[2].splitlines()
        assert sharding == {"Sequential.0.weight": (Shard(0),), "Sequential.0.bias": (Shard(0),),
                            "Sequential.2.weight": (Shard(1),), "Sequential.2.bias": (Replicate(),)}


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the mesh (Megatron's f)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: sw.DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return comm.all_reduce(grad.contiguous(), ctx.mesh, 0, "sum"), None


class _Routed(nn.Module):
    def __init__(self, mesh: sw.DeviceMesh) -> None:
        super().__init__()
        self.mesh, self.lin = mesh, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_SumGradients.apply(x, self.mesh))  # [3, 4]


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _TwoReaders(nn.Module):
    """Two siblings read the same input, the routed one first (as a mixture of experts' routed
    and shared experts): the shared one, run last, runs its backward first."""

    def __init__(self, mesh: sw.DeviceMesh) -> None:
        super().__init__()
        self.routed, self.shared = _Routed(mesh), _Shared()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x) + self.shared(x)


def _backward_of_siblings():
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = _TwoReaders(mesh)
    x = torch.randn(3, 4, requires_grad=True)
    with CommDebugMode() as comms:
        model(x).sum().backward()
    return [(r.module, r.phase.value) for r in comms.records]


def test_a_backward_collective_is_filed_under_the_module_whose_backward_runs(dist):
    # The shared sibling stays active until x's whole gradient exists, through the routed one's
    # backward; the all_reduce belongs to the routed one, whose backward started last.
    for records in dist.run(2, _backward_of_siblings):
        assert records == [("_TwoReaders.routed", "backward")], records


def _visualize():
    shown = {}
    mesh2 = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh1 = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    cases = {
        "grid": sw.distribute_tensor(torch.ones(5, 6), mesh2, [Shard(0), Shard(1)]),
        "uneven": sw.distribute_tensor(torch.ones(10), mesh1, [Shard(0)]),
        "replicated": sw.distribute_tensor(torch.ones(2, 3), mesh1, [Replicate()]),
        "partial": sw.DTensor.from_local(torch.ones(2, 3), mesh2, [Shard(1), Partial()]),
    }
    for name, dt in cases.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            visualize_sharding(dt, header=name if name == "grid" else "")
        shown[name] = buf.getvalue()
    return shown


def test_visualize_sharding_prints_once_which_rank_holds_which_block(dist):
    out = dist.run(4, _visualize)
    assert all(text == "" for rank in out[1:] for text in rank.values()), "only rank 0 prints"
    shown = out[0]
    assert shown["grid"] == ("grid\n"
                             "         Col 0-2  Col 3-5\n"
                             "Row 0-2  cpu:0    cpu:1\n"
                             "Row 3-4  cpu:2    cpu:3\n")
    assert shown["uneven"].splitlines() == ["f32[10@tp] on mesh(tp=4)", "         Col 0-0", "Row 0-2  cpu:0",
                                            "Row 3-5  cpu:1", "Row 6-8  cpu:2", "Row 9-9  cpu:3"]
    assert shown["replicated"].splitlines() == ["f32[2,3] on mesh(tp=4)", "         Col 0-2", "Row 0-1  cpu:0,1,2,3"]
    assert shown["partial"].splitlines() == [
        "f32[2,6@dp]{P(sum)@tp} on mesh(dp=2, tp=2)",
        "         Col 0-2  Col 3-5",
        "Row 0-1  cpu:0,1  cpu:2,3",
        "Partial(sum) on mesh axis 'tp': ranks of a cell that differ along it hold partial values; the block is their sum",
    ]
