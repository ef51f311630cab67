"""Meshes over part of the world (pipeline stages): on ranks outside the mesh DTensors hold empty
blocks, ops and redistributes communicate nothing and return the members' metadata; ``with mesh:``
sets the default mesh; _foreach_norm over gradients on different sub-meshes."""

from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F

import shardwise as sw
from shardwise import DeviceMesh, DTensor, Replicate, Shard
from shardwise.debug import CommDebugMode

_WHOLE = torch.arange(24.0).reshape(4, 6) / 7


def _ops(mesh: DeviceMesh) -> dict:
    """name -> (DTensor result, single-device value) for a batch of ops on ``mesh``."""
    x = sw.distribute_tensor(_WHOLE, mesh, [Shard(0)])
    xr = sw.distribute_tensor(_WHOLE, mesh, [Replicate()])
    w = sw.distribute_tensor(torch.ones(5, 6) / 3, mesh, [Replicate()])
    return {
        "add": (x + 1, _WHOLE + 1),
        "select": (xr[1], _WHOLE[1]),
        "layer_norm": (F.layer_norm(x, (6,)), F.layer_norm(_WHOLE, (6,))),
        "linear": (F.linear(x, w), F.linear(_WHOLE, torch.ones(5, 6) / 3)),
        "sum": (x.sum(), _WHOLE.sum()),
        "view": (x.view(24), _WHOLE.view(24)),
        "to_replicate": (x.redistribute(mesh, [Replicate()]), _WHOLE),
        "partial_to_replicate": (x.sum(0).redistribute(mesh, [Replicate()]), _WHOLE.sum(0)),
        "zeros": (sw.zeros(4, 6, device_mesh=mesh, placements=[Shard(1)]), torch.zeros(4, 6)),
        "from_local": (DTensor.from_local(torch.ones(2, 6), mesh, [Shard(0)]), torch.ones(4, 6)),
    }


def _members_and_outsiders(_: object) -> dict:
    rank = tdist.get_rank()
    stage = DeviceMesh("cpu", [0, 2])
    inside = stage.get_coordinate() is not None
    out = {}
    with CommDebugMode() as comm:
        results = _ops(stage)
        grad_source = sw.distribute_tensor(_WHOLE, stage, [Shard(0)]).requires_grad_()
        (grad_source * grad_source).sum().backward()
    out["collectives"] = comm.get_total_counts()
    for name, (result, expected) in results.items():
        local = result._local_tensor
        meta = (tuple(result.shape), result.placements, result.dtype)
        if inside:
            ok = torch.allclose(result.full_tensor(), expected, atol=1e-6)
        else:  # an empty block (a 0-dim result holds a 0), and full_tensor() returns it
            ok = (local.numel() == 0 or local.ndim == 0) and result.full_tensor().numel() in (0, int(local.ndim == 0))
        out[name] = (meta, ok)
    grad = grad_source.grad
    out["grad"] = ((tuple(grad.shape), grad.placements),
                   torch.allclose(grad.full_tensor(), 2 * _WHOLE) if inside else grad._local_tensor.numel() == 0)
    # Membership required: one clear error naming the rank and the rank grid (no collective).
    errors = []
    for call in (lambda: stage.get_local_rank(), lambda: stage.get_group()):
        try:
            call()
        except RuntimeError as err:
            errors.append(str(err))
    out["errors"] = errors
    # A slice of an init_device_mesh as its own mesh: a pipeline stage.
    grid = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    first = DeviceMesh("cpu", grid.mesh[0], mesh_dim_names=("tp",))
    y = sw.distribute_tensor(_WHOLE, first, [Shard(1)]) * 2
    out["stage slice"] = ((tuple(y.shape), y.placements),
                          torch.equal(y.full_tensor(), _WHOLE * 2) if rank < 2 else y._local_tensor.numel() == 0)
    return out


def _foreach_and_default_mesh(_: object) -> dict:
    grid = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    a = sw.distribute_tensor(torch.arange(4.0), grid["pp"], [Shard(0)])
    b = sw.distribute_tensor(torch.arange(6.0).reshape(2, 3), grid["tp"], [Shard(1)])
    norms = torch._foreach_norm([a, b])
    out = {"foreach_norm": [round(n.full_tensor().item(), 5) for n in norms],
           "meshes": [n.device_mesh == m for n, m in zip(norms, (grid["pp"], grid["tp"]))]}
    stage = DeviceMesh("cpu", [1, 3])
    meshes = []
    with grid:
        meshes.append(sw.distribute_tensor(torch.ones(2, 2)).device_mesh == grid)
        with stage as entered:
            meshes.append(entered is stage)
            meshes.append(sw.distribute_tensor(torch.ones(2, 2), placements=[Shard(0)]).device_mesh == stage)
            meshes.append(DTensor.from_local(torch.ones(2)).device_mesh == stage)
            meshes.append(sw.zeros(2, 2).device_mesh == stage)
        meshes.append(sw.ones(2, 2).device_mesh == grid)
        meshes.append(DTensor.from_local(torch.ones(2)).placements == (Replicate(), Replicate()))
    meshes.append(sw.ones(2).device_mesh.ndim == 1 and sw.ones(2).device_mesh.size() == 4)
    out["with mesh"] = meshes
    return out


def test_ranks_outside_a_mesh_hold_empty_blocks_and_never_communicate(dist):
    per_rank = dist.run(4, _members_and_outsiders, None)
    members = [per_rank[0], per_rank[2]]
    for rank, result in enumerate(per_rank):
        inside = rank in (0, 2)
        errors = result.pop("errors")
        assert len(errors) == (0 if inside else 2), rank
        for message in errors:
            assert f"rank {rank} is not in DeviceMesh('cpu', [0, 2]" in message, message
        collectives = result.pop("collectives")
        assert collectives == 0 or inside, rank
        for name, (meta, ok) in result.items():
            assert ok is True, (rank, name)
            assert meta == members[0][name][0], (rank, name, meta)  # same metadata on every rank


def test_foreach_norm_across_submeshes_and_with_mesh(dist):
    expected = [round(torch.arange(4.0).norm().item(), 5), round(torch.arange(6.0).norm().item(), 5)]
    for result in dist.run(4, _foreach_and_default_mesh, None):
        assert result["foreach_norm"] == expected
        assert result["meshes"] == [True, True]
        assert result["with mesh"] == [True] * 8


def test_with_mesh_nests_and_pops_in_order():
    from shardwise.core.mesh import current_mesh

    outer, inner = DeviceMesh("cpu", [0]), DeviceMesh("cpu", [[0]], mesh_dim_names=("a", "b"))
    assert current_mesh() is None
    with outer:
        with inner:
            assert current_mesh() is inner
        assert current_mesh() is outer
        inner.__enter__()
        try:
            outer.__exit__(None, None, None)
            raise AssertionError("leaving the outer block first must raise")
        except RuntimeError as err:
            assert "innermost mesh entered is mesh(a=1, b=1)" in str(err)
        inner.__exit__(None, None, None)
    assert current_mesh() is None
