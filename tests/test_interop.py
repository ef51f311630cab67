"""shardwise.interop: DTensors, meshes and modules both ways with torch.distributed.tensor.

The oracle is torch itself and the single-device tensor: a converted tensor holds the same
storage, the same global value, and ops on it give what the original gives.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Partial, Replicate, Shard

PLACEMENTS = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max")]


def _round_trips() -> list:
    from torch.distributed.tensor import DTensor as TorchDTensor

    from shardwise.interop import from_torch, mesh_from_torch, mesh_to_torch, to_torch

    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tmesh = mesh_to_torch(mesh)
    rows = []
    for shape in ((5, 4),):  # dim 0 splits unevenly (3+2, nested 2+1+1+1), dim 1 evenly
        full = torch.arange(float(shape[0] * shape[1])).reshape(shape) - 7
        for placements in itertools.product(PLACEMENTS, repeat=2):
            if len({p.reduce_op for p in placements if isinstance(p, Partial)}) > 1:
                continue  # shardwise holds one kind of pending reduction per tensor
            x = sw.distribute_tensor(full, mesh, list(placements))
            y = to_torch(x)
            z = from_torch(y)
            ptrs = {x.to_local().data_ptr(), y.to_local().data_ptr(), z.to_local().data_ptr()}
            rows.append((
                shape, placements,
                isinstance(y, TorchDTensor) and y.device_mesh is tmesh,
                [(type(p).__name__, getattr(p, "dim", None), getattr(p, "reduce_op", None)) for p in y.placements],
                len(ptrs) == 1,
                torch.equal(y.full_tensor(), full), torch.equal(z.full_tensor(), full),
                z.placements == x.placements and z.device_mesh is mesh,
                y.shape == x.shape and y.stride() == x.stride(),
                torch.equal((y * 2 + 1).full_tensor(), full * 2 + 1),
                torch.allclose(y.sum().full_tensor(), full.sum()),
            ))
    # the meshes: same grid, names and process groups; cached both ways
    same_groups = all(tmesh.get_group(i) is mesh.get_group(i) for i in range(2))
    mesh_facts = (tmesh.mesh.tolist(), tmesh.mesh_dim_names, same_groups,
                  mesh_to_torch(mesh) is tmesh, mesh_from_torch(tmesh) is mesh,
                  mesh_to_torch(mesh["tp"]).mesh.tolist() == mesh["tp"].mesh.tolist())
    unnamed = sw.init_device_mesh("cpu", (2, 2))
    u = to_torch(sw.distribute_tensor(torch.arange(8.0).reshape(4, 2), unnamed, [Shard(0), Shard(1)]))
    mesh_facts += (u.device_mesh.mesh_dim_names, torch.equal((u + 1).full_tensor(), torch.arange(8.0).reshape(4, 2) + 1))
    return [rows, mesh_facts]


def test_round_trips_keep_values_storage_and_layout(dist):
    for rows, mesh_facts in dist.run(4, _round_trips):
        assert mesh_facts == ([[0, 1], [2, 3]], ("dp", "tp"), True, True, True, True, None, True)
        assert len(rows) == (len(PLACEMENTS) ** 2 - 2)
        for shape, placements, on_mesh, torch_placements, same_storage, *equal in rows:
            assert on_mesh and same_storage and all(equal), (shape, placements, equal)
            assert torch_placements == [(type(p).__name__, getattr(p, "dim", None), getattr(p, "reduce_op", None))
                                        for p in placements]


def _torch_side() -> list:
    """Tensors made by torch's own APIs convert to shardwise, whose ops give torch's values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as TR, Shard as TS, distribute_tensor
    from torch.distributed.tensor.placement_types import Partial as TP, _StridedShard

    from shardwise.interop import from_torch, mesh_from_torch, to_torch

    tmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    torch.manual_seed(0)
    a, b = torch.randn(6, 4), torch.randn(4, 5)
    ta = distribute_tensor(a, tmesh, [TS(0), TR()])
    tb = distribute_tensor(b, tmesh, [TR(), TS(1)])
    sa, sb = from_torch(ta), from_torch(tb)
    mesh = mesh_from_torch(tmesh)
    out = {
        "mesh": (mesh.mesh.tolist(), mesh.mesh_dim_names, [mesh.get_group(i) is tmesh.get_group(i) for i in range(2)],
                 mesh["b"].mesh.tolist() == tmesh["b"].mesh.tolist()),
        "ptr": sa.to_local().data_ptr() == ta.to_local().data_ptr(),
        "matmul": torch.allclose((sa @ sb).full_tensor(), (ta @ tb).full_tensor()),
        "softmax": torch.allclose(sa.softmax(-1).full_tensor(), ta.softmax(-1).full_tensor()),
        "back": to_torch(sa).device_mesh is tmesh,
        "sub": from_torch(distribute_tensor(a, tmesh["b"], [TS(0)])).device_mesh == mesh["b"],
    }
    # autograd both ways: gradients reach the original in its own layout
    leaf = sw.distribute_tensor(a, mesh, [Shard(0), Shard(1)]).requires_grad_()
    (to_torch(leaf).full_tensor() ** 2).sum().backward()
    tleaf = distribute_tensor(a, tmesh, [TS(1), TR()]).requires_grad_()
    (from_torch(tleaf) ** 3).sum().full_tensor().backward()
    out["grad"] = (torch.allclose(leaf.grad.full_tensor(), 2 * a), leaf.grad.placements == leaf.placements,
                   torch.allclose(tleaf.grad.full_tensor(), 3 * a * a))
    # a Partial tensor's gradient stays Partial on both sides
    plocal = torch.full((2, 2), float(dist.get_rank()), requires_grad=True)
    tp_x = type(ta).from_local(plocal, tmesh, [TP("sum"), TR()])
    (from_torch(tp_x).full_tensor() * 5).sum().backward()
    out["partial_grad"] = torch.allclose(plocal.grad, torch.full((2, 2), 5.0))
    errors = []
    for bad in ([_StridedShard(0, split_factor=2), TR()], [TR(), TP("bxor")]):
        try:
            from_torch(type(ta).from_local(torch.ones(2, 2), tmesh, bad, run_check=False))
        except ValueError as err:
            errors.append(str(err))
    out["errors"] = errors
    return out


def test_torch_tensors_convert_and_compute_like_torch(dist):
    for out in dist.run(4, _torch_side):
        errors = out.pop("errors")
        assert out == {"mesh": ([[0, 1], [2, 3]], ("a", "b"), [True, True], True), "ptr": True, "matmul": True,
                       "softmax": True, "back": True, "sub": True, "grad": (True, True, True),
                       "partial_grad": True}
        assert len(errors) == 2
        assert "mesh axis 0" in errors[0] and "_StridedShard" in errors[0]
        assert "mesh axis 1" in errors[1] and "bxor" in errors[1]


def _modules() -> list:
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Replicate as TR, distribute_tensor

    from shardwise.interop import mesh_to_torch, module_from_torch, module_to_torch

    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = nn.Linear(6, 4)
    x = torch.randn(3, 6)
    model = nn.Linear(6, 4)
    model.load_state_dict(ref.state_dict())
    model.weight = nn.Parameter(sw.distribute_tensor(ref.weight.detach(), mesh, [Replicate(), Shard(0)]))
    model.bias = nn.Parameter(sw.distribute_tensor(ref.bias.detach(), mesh, [Replicate(), Shard(0)]))
    model.register_buffer("scale", sw.distribute_tensor(torch.arange(4.0), mesh, [Shard(0), Replicate()]))
    ptrs = [t.to_local().data_ptr() for t in (model.weight, model.bias, model.scale)]
    module_to_torch(model)
    kinds = [type(t) is TorchDTensor or isinstance(t, TorchDTensor) for t in (model.weight, model.bias, model.scale)]
    same = [t.to_local().data_ptr() for t in (model.weight, model.bias, model.scale)] == ptrs
    tx = distribute_tensor(x, model.weight.device_mesh, [TR(), TR()])
    out_torch = model(tx).full_tensor()
    module_from_torch(model)
    back = [isinstance(t, sw.DTensor) for t in (model.weight, model.bias, model.scale)]
    out_sw = model(sw.distribute_tensor(x, mesh, [Replicate(), Replicate()])).full_tensor()
    want = F.linear(x, ref.weight, ref.bias)
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardwise.fsdp import fully_shard

    refusals = []
    for wrap, convert in ((lambda m: fully_shard(m, mesh=mesh["dp"]), module_to_torch),
                          (lambda m: torch_fully_shard(m, mesh=mesh_to_torch(mesh)["dp"]), module_from_torch)):
        try:
            convert(wrap(nn.Sequential(nn.Linear(4, 4))))
        except ValueError as err:
            refusals.append(str(err))
    return (refusals, kinds, same, back, isinstance(model.weight, nn.Parameter),
            torch.allclose(out_torch, want, atol=1e-6), torch.allclose(out_sw, want, atol=1e-6),
            [t.to_local().data_ptr() for t in (model.weight, model.bias, model.scale)] == ptrs)


def test_module_helpers_convert_parameters_and_buffers_in_place(dist):
    for refusals, kinds, same, back, is_param, *close in dist.run(4, _modules):
        assert kinds == [True] * 3 and back == [True] * 3 and same and is_param
        assert len(refusals) == 2 and "managed by shardwise's fully_shard" in refusals[0], refusals
        assert "managed by torch's fully_shard" in refusals[1] and "format='dcp'" in refusals[1], refusals
        assert all(close), close


SHARD_LAYOUTS = [((2, 2), (Shard(0), Shard(1))), ((2, 2), (Shard(1), Shard(0))), ((2, 2), (Shard(0), Shard(0))),
                 ((4,), (Shard(0),)), ((4,), (Shard(1),))]


def _sharded_tensors() -> dict:
    import warnings

    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    from shardwise.interop import from_sharded_tensor, to_sharded_tensor

    warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice
    rows = []
    for mesh_shape, placements in SHARD_LAYOUTS:
        mesh = sw.init_device_mesh("cpu", mesh_shape)
        for shape in ((5, 6), (3, 7)):  # uneven, and a rank with an empty box on 4-way dim 0
            full = torch.arange(float(shape[0] * shape[1])).reshape(shape)
            x = sw.distribute_tensor(full, mesh, list(placements))
            st = to_sharded_tensor(x)
            local = st.local_shards()[0]
            box = tuple(slice(o, o + n) for o, n in zip(local.metadata.shard_offsets, local.metadata.shard_sizes))
            back = from_sharded_tensor(st, mesh, placements)
            rows.append((mesh_shape, placements, shape,
                         tuple(st.size()) == shape, torch.equal(local.tensor, full[box]),
                         local.tensor.data_ptr() == x.to_local().data_ptr() == back.to_local().data_ptr(),
                         torch.equal(back.full_tensor(), full)))
    # a ShardedTensor built by torch's own API, with its layout inferred (ChunkShardingSpec)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(4)])
    native = sharded_tensor.empty(spec, 10, 3)
    local = native.local_shards()[0]
    local.tensor.copy_(torch.arange(30.0).reshape(10, 3)[local.metadata.shard_offsets[0]:][:local.tensor.shape[0]])
    inferred = from_sharded_tensor(native)
    facts = (inferred.placements, torch.equal(inferred.full_tensor(), torch.arange(30.0).reshape(10, 3)))
    errors = []
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for placements in ([Shard(0), Replicate()], [Partial(), Shard(1)]):
        try:
            to_sharded_tensor(sw.distribute_tensor(torch.ones(4, 4), mesh, placements))
        except ValueError as err:
            errors.append(str(err))
    try:
        from_sharded_tensor(native, mesh, [Shard(1), Shard(0)])
    except ValueError as err:
        errors.append(str(err))
    return {"rows": rows, "native": facts, "errors": errors}


def test_sharded_tensor_round_trips_for_shard_layouts(dist):
    for out in dist.run(4, _sharded_tensors):
        assert len(out["rows"]) == 2 * len(SHARD_LAYOUTS)
        for mesh_shape, placements, shape, *checks in out["rows"]:
            assert all(checks), (mesh_shape, placements, shape, checks)
        assert out["native"] == ((Shard(0),), True)
        replicate, partial, mismatch = out["errors"]
        assert "mesh axis 1 ('tp') is Replicate()" in replicate and "only Shard" in replicate
        assert "mesh axis 0 ('dp') is Partial(sum)" in partial
        assert "rank" in mismatch and "box" in mismatch


def _foreign_device_mesh():
    sw.DeviceMesh("xla", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))


def test_device_type_without_collectives_fails_naming_the_backend(dist):
    dist.run_expect_error(4, _foreign_device_mesh, exc_type=RuntimeError,
                          match=r"DeviceMesh\('xla'\).*backend 'gloo'.*no collective backend for device type 'xla'")


def test_only_interop_imports_torch_distributed_tensor():
    """The library's own code stays independent of torch.distributed.tensor (and of torch's
    checkpoint and ShardedTensor stacks); shardwise.interop is the one bridge."""
    import ast
    from pathlib import Path

    src = Path(sw.__file__).parent
    bridged = ("torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed._shard",
               "torch.distributed.fsdp")
    # The one exception: the answers a DTensor gives when torch's own checkpoint calls it (its
    # dunder protocol). It imports torch's checkpoint classes inside those calls only, when torch's
    # checkpoint is loaded already (no import at module level: checked below).
    protocol = src / "tensor" / "torch_checkpoint.py"
    offenders = []
    for path in src.rglob("*.py"):
        if path.parent.name == "interop" or path == protocol:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(src)}: {n}" for n in names if n.startswith(bridged)]
    assert offenders == []
    assert (src / "interop" / "dtensor.py").read_text().count("from torch.distributed.tensor import") == 1
    top_level = [node for node in ast.parse(protocol.read_text()).body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not [n for node in top_level for n in _imported(node) if n.startswith(bridged)], "imports at call time only"


def _imported(node) -> list[str]:
    import ast

    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
