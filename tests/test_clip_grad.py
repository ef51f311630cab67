"""clip_grad_norm_ over gradients on several meshes (FSDP + TP) and plain ones, against one device."""

import pytest
import torch

import shardwise as sw
from shardwise import Replicate, Shard


def _grads():
    torch.manual_seed(0)
    return [torch.randn(6, 5), torch.randn(7), torch.randn(3, 2), torch.randn(4)]


def _reference(max_norm: float, norm_type: float):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads()]
    for p, g in zip(params, _grads()):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return total, [p.grad for p in params]


def _sharded(max_norm: float, norm_type: float):
    root = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    grads = _grads()
    layouts = [(root, [Shard(0), Shard(1)]), (root["dp"], [Shard(0)]), (root["tp"], [Replicate()]), None]
    params = []
    for g, layout in zip(grads, layouts):
        if layout is None:  # a plain, replicated parameter
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
        else:
            mesh, placements = layout
            p = torch.nn.Parameter(sw.distribute_tensor(torch.zeros_like(g), mesh, placements))
            p.grad = sw.distribute_tensor(g, mesh, placements)
        params.append(p)
    total = sw.clip_grad_norm_(params, max_norm, norm_type)
    return total, [p.grad.full_tensor() if isinstance(p.grad, sw.DTensor) else p.grad for p in params]


@pytest.mark.parametrize("max_norm,norm_type", [(1.0, 2.0), (100.0, 2.0), (0.5, float("inf")), (2.0, 1.0)])
def test_clip_grad_norm_across_meshes_matches_single_device(dist, max_norm, norm_type):
    total, grads = _reference(max_norm, norm_type)
    for got_total, got_grads in dist.run(4, _sharded, max_norm, norm_type):
        torch.testing.assert_close(got_total, total)
        for got, want in zip(got_grads, grads):
            torch.testing.assert_close(got, want)


def _pipelined(cases: list[tuple[float, float]]):
    """2 pipeline ranks x 2 tp ranks: pipeline rank r holds gradients r, r+2 of ``_grads()`` (stages own
    different parameters); ``across`` the pp axis the norm is that of all four."""
    root = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    mine = [i for i in range(4) if i % 2 == root.get_local_rank("pp")]
    out = []
    for max_norm, norm_type in cases:
        params = []
        for i in mine:
            g = _grads()[i]
            p = torch.nn.Parameter(sw.distribute_tensor(torch.zeros_like(g), root["tp"], [Replicate()]))
            p.grad = sw.distribute_tensor(g, root["tp"], [Shard(0)] if g.shape[0] % 2 == 0 else [Replicate()])
            params.append(p)
        total = sw.clip_grad_norm_(params, max_norm, norm_type, across=root["pp"])
        out.append((total, {i: p.grad.full_tensor() for i, p in zip(mine, params)}))
    return out


def test_clip_grad_norm_across_pipeline_stages_matches_single_device(dist):
    cases = [(1.0, 2.0), (0.5, float("inf")), (2.0, 1.0)]
    for per_case in dist.run(4, _pipelined, cases):
        for (max_norm, norm_type), (got_total, got_grads) in zip(cases, per_case):
            total, grads = _reference(max_norm, norm_type)
            torch.testing.assert_close(got_total, total)
            for i, got in got_grads.items():
                torch.testing.assert_close(got, grads[i])
