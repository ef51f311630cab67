"""Pickling and copying: meshes, DTensors and parallelized models survive copy.deepcopy, pickle
and torch.save / torch.load in the same world; a copied model is independent (the EMA pattern)."""

from __future__ import annotations

import copy
import io
import pickle

import torch
from torch import nn

import shardwise as sw
from shardwise import DTensor, Partial, Shard
from shardwise.debug import CommDebugMode
from shardwise.fsdp import fully_shard, replicate
from shardwise.core.mesh import num_cached_groups
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _saved(obj: object, **load) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, **load)


def _mesh_cases() -> dict:
    """Every way of copying every kind of mesh: equal, same process groups, no new group."""
    root = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = root["dp", "tp"].flatten("all")
    before = num_cached_groups()
    out = {}
    for label, mesh in {"root": root, "tp": root["tp"], "dp": root["dp"], "flat": flat}.items():
        for how, copied in {"pickle": pickle.loads(pickle.dumps(mesh)), "deepcopy": copy.deepcopy(mesh),
                            "torch.load": _saved(mesh)}.items():
            same_groups = [copied.get_group(i) is mesh.get_group(i) for i in range(mesh.ndim)]
            out[f"{label}/{how}"] = (copied == mesh, all(same_groups), copied.get_coordinate() == mesh.get_coordinate())
    out["copy of root slices"] = copy.deepcopy(root)["tp"] == root["tp"] and copy.deepcopy(root)["all"] == flat
    out["groups created"] = num_cached_groups() - before
    return out


def _dtensor_cases() -> dict:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    whole = torch.randn(6, 5)
    d = sw.distribute_tensor(whole, mesh, [Shard(0), Shard(1)])
    partial = DTensor.from_local(torch.full((2,), float(torch.distributed.get_rank())), mesh["tp"], [Partial()])
    out = {}
    with CommDebugMode() as comm:
        copies = {"pickle": pickle.loads(pickle.dumps(d)), "deepcopy": copy.deepcopy(d),
                  "load": _saved(d), "load_unsafe": _saved(d, weights_only=False)}
    out["collectives while copying"] = comm.get_total_counts()
    for how, c in copies.items():
        out[how] = (type(c) is DTensor, c.placements == d.placements, c.device_mesh == d.device_mesh,
                    torch.equal(c.full_tensor(), whole))
    copies["deepcopy"]._local_tensor.add_(1)  # independent storage
    out["original unchanged"] = torch.equal(d.full_tensor(), whole)
    p = _saved(partial)
    out["partial"] = (p.placements, p.full_tensor().tolist())
    leaf = sw.distribute_tensor(whole, mesh, [Shard(0), Shard(1)]).requires_grad_()
    (leaf * 2).sum().backward()
    c = copy.deepcopy(leaf)
    out["grad and requires_grad copied"] = (c.requires_grad, torch.equal(c.grad.full_tensor(), torch.full((6, 5), 2.0)))
    try:
        copy.deepcopy(leaf * 2)
        out["non-leaf"] = "copied"
    except RuntimeError as err:
        out["non-leaf"] = str(err)
    return out


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _ema_case(kind: str) -> dict:
    """deepcopy(parallelized model): equal values, forward/backward matching one device, and
    independent: stepping the copy leaves the original (and its gradients) untouched."""
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    reference, model = _mlp(), _mlp()
    if kind == "tp":
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    elif kind == "fsdp":
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        replicate(model, mesh=mesh)
    x = torch.randn(3, 4)
    model(x).sum().backward()  # the original has run once: hooks fired, buffers used
    original_grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    twin = copy.deepcopy(model)
    out = {"values equal": all(torch.equal(_full(a), _full(b)) for a, b in zip(model.parameters(), twin.parameters()))}
    out["types"] = sorted({type(p).__name__ for p in twin.parameters()}) == sorted({type(p).__name__ for p in model.parameters()})
    reference(x).sum().backward()
    for p in twin.parameters():
        p.grad = None
    y = twin(x)
    out["forward"] = torch.allclose(_full(y), reference(x), atol=1e-6)
    y.sum().backward()
    out["backward"] = all(torch.allclose(_full(p.grad), r.grad, atol=1e-6)
                          for p, r in zip(twin.parameters(), reference.parameters()))
    out["original grads untouched"] = all(torch.equal(_full(p.grad), original_grads[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    out["original values untouched"] = all(torch.equal(_full(p), r) for p, r in zip(model.parameters(), reference.parameters()))
    out["copy stepped"] = all(torch.equal(_full(p), r * 0.5) for p, r in zip(twin.parameters(), reference.parameters()))
    out["original still trains"] = torch.allclose(_full(model(x)), reference(x), atol=1e-6)
    return out


def _body(_: object) -> dict:
    return {"mesh": _mesh_cases(), "dtensor": _dtensor_cases(),
            **{kind: _ema_case(kind) for kind in ("tp", "fsdp", "replicate")}}


def test_pickle_copy_and_deepcopy_models(dist):
    for rank, result in enumerate(dist.run(4, _body, None)):
        mesh = result["mesh"]
        assert mesh.pop("groups created") == 0, rank
        assert all(v == (True, True, True) for k, v in mesh.items() if "/" in k), (rank, mesh)
        assert mesh["copy of root slices"] is True
        dt = result["dtensor"]
        assert dt.pop("collectives while copying") == 0
        for how in ("pickle", "deepcopy", "load", "load_unsafe"):
            assert dt[how] == (True, True, True, True), (rank, how, dt[how])
        assert dt["original unchanged"] is True
        assert dt["partial"] == (tuple([Partial()]), [float(2 * (rank // 2 * 2) + 1)] * 2)
        assert dt["grad and requires_grad copied"] == (True, True)
        assert "non-leaf" in dt["non-leaf"] and "detach" in dt["non-leaf"]
        for kind in ("tp", "fsdp", "replicate"):
            failed = [k for k, ok in result[kind].items() if ok is not True]
            assert not failed, (rank, kind, failed)
