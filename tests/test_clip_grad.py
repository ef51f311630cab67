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
