"""Random ops on DTensors: the same global values for every layout, and consistent replicas."""

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Partial, Replicate, Shard

LAYOUTS = [[Shard(0), Shard(1)], [Shard(1), Replicate()], [Replicate(), Replicate()], [Shard(0), Shard(0)], [Partial(), Shard(1)]]


def _random_ops(mesh_shape):
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x = torch.arange(1.0, 36.0).reshape(5, 7)
    out = []
    for layout in LAYOUTS[: 5 if len(mesh_shape) == 2 else 0] or [[Shard(0)], [Replicate()], [Shard(1)]]:
        sw.manual_seed(3)
        dt = sw.distribute_tensor(x, mesh, layout)
        dropped = F.dropout(dt, 0.4, training=True).full_tensor()
        filled = sw.zeros(5, 7, device_mesh=mesh, placements=[p if not p.is_partial() else Replicate() for p in layout])
        filled.normal_(2.0, 0.5)
        uniform = torch.empty_like(dt).uniform_(-1, 1).full_tensor()
        coin = torch.bernoulli(torch.full_like(dt, 0.3)).full_tensor()
        like = torch.randn_like(dt).full_tensor()
        out.append((dropped, filled.full_tensor(), uniform, coin, like))
    return out


def test_random_ops_equal_across_layouts_and_world_sizes(dist):
    reference = dist.run(1, _random_ops, (1, 1))[0][0]
    for rank_results in dist.run(4, _random_ops, (2, 2)):
        for per_layout in rank_results:
            for got, want in zip(per_layout, reference):
                assert torch.equal(got, want)
    dropped = reference[0]
    x = torch.arange(1.0, 36.0).reshape(5, 7)
    kept = dropped != 0
    assert torch.allclose(dropped[kept], x[kept] / 0.6) and 0 < kept.sum() < 35
    assert (reference[2].abs() <= 1).all() and set(reference[3].unique().tolist()) <= {0.0, 1.0}


def _dropout_grad():
    mesh = sw.init_device_mesh("cpu", (4,))
    sw.manual_seed(5)
    x = sw.distribute_tensor(torch.ones(6, 3, requires_grad=True), mesh, [Shard(0)])
    y = F.dropout(x, 0.5, training=True)
    y.full_tensor().sum().backward()
    return y.full_tensor(), x.grad.full_tensor()


def test_dropout_gradient_uses_the_same_mask(dist):
    for out, grad in dist.run(4, _dropout_grad):
        assert torch.equal(grad, out)  # d(x*mask*2)/dx = mask*2 = out for x = 1
