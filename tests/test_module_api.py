"""distribute_module: default replication, partition_fn, input/output hooks (DDP as configuration)."""

import torch
from torch import nn

import shardwise as sw
from shardwise import DTensor, Replicate, Shard


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _ddp():
    """Seed 6.1: parameters replicated, the batch sharded on input; gradients become Partial."""
    mesh = sw.init_device_mesh("cpu", (4,))
    model = _model()

    def shard_batch(mod, inputs, mesh):
        return (DTensor.from_local(inputs[0], mesh, [Shard(0)]),)

    def to_local(mod, out, mesh):
        return out.redistribute(mesh, [Replicate()]).to_local()

    sw.distribute_module(model, mesh, input_fn=shard_batch, output_fn=to_local)
    torch.manual_seed(1)
    batch = torch.randn(8, 6)
    rank = torch.distributed.get_rank()
    out = model(batch[2 * rank : 2 * rank + 2])
    out.pow(2).sum().backward()
    kinds = {(type(p).__name__, isinstance(p, nn.Parameter)) for p in model.parameters()}
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return out, kinds, grads, [p.grad.placements for p in model.parameters()]


def test_ddp_as_distribute_module(dist):
    model = _model()
    torch.manual_seed(1)
    batch = torch.randn(8, 6)
    out = model(batch)
    out.pow(2).sum().backward()
    for got, kinds, grads, placements in dist.run(4, _ddp):
        assert kinds == {("DTensor", True)} and torch.allclose(got, out, atol=1e-6)
        for g, p in zip(grads, model.parameters()):
            assert torch.allclose(g, p.grad, atol=1e-5)


def _partition():
    mesh = sw.init_device_mesh("cpu", (2, 2))
    model = _model()

    def shard_linears(name, mod, mesh):
        if isinstance(mod, nn.Linear):
            mod.weight = nn.Parameter(sw.distribute_tensor(mod.weight.data, mesh, [Replicate(), Shard(0)]))

    sw.distribute_module(model, mesh, partition_fn=shard_linears)
    layouts = {n: p.placements for n, p in model.named_parameters()}
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return layouts, full


def _twice():
    mesh = sw.init_device_mesh("cpu", (4,))
    model = sw.distribute_module(_model(), mesh)
    sw.distribute_module(model, mesh)


def test_partition_fn_and_default_replication(dist):
    reference = dict(_model().named_parameters())
    for layouts, full in dist.run(4, _partition):
        assert layouts["0.weight"] == (Replicate(), Shard(0)) and layouts["0.bias"] == (Replicate(), Replicate())
        assert all(torch.equal(full[n], reference[n].detach()) for n in full)
    dist.run_expect_error(4, _twice, match="already applied to Sequential")
