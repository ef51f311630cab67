"""The FSDP tests' toy model: a seeded stack of residual blocks, its data, and its one-process
training, shared by tests/test_fsdp.py, test_replicate.py and test_overlap.py.

Uneven sizes on purpose: hidden size 7 and output size 3 over 4 ranks leave short and EMPTY shards.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.fsdp import fully_shard

STEPS = 5
BATCH = 8
D_IN, D, H, D_OUT = 5, 6, 7, 3


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.layers = nn.ModuleList(Block(D, H) for _ in range(blocks))
        self.head = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def net(blocks: int = 4) -> Net:
    torch.manual_seed(0)
    return Net(blocks)


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def optimizer(params, foreach: bool = True) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.1, foreach=foreach)


def reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = net()
    opt = optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = data(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def shard_model(model: Net, mesh, **kwargs) -> Net:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def local_batch(step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data(step)
    n = BATCH // dp_size
    return x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]


def train(model, dp_rank: int, dp_size: int, foreach: bool = True, steps: int = STEPS):
    """Train ``steps`` AdamW steps; returns local losses and full parameters by name."""
    opt = optimizer(model.parameters(), foreach)
    losses = []
    for step in range(steps):
        x, y = local_batch(step, dp_rank, dp_size)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        model.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}


def check_parity(per_rank, dp_of_rank, dp_size: int) -> None:
    ref_losses, ref_params = reference()
    for step in range(STEPS):
        # each dp rank's loss is the mean over its equal slice: the global loss is their mean
        seen = {dp_of_rank(r): losses[step] for r, (losses, _) in enumerate(per_rank)}
        got = sum(seen.values()) / dp_size
        assert abs(got - ref_losses[step]) <= 1e-5 * max(1.0, abs(ref_losses[step])), (step, got, ref_losses[step])
    for _, params in per_rank:
        assert params.keys() == ref_params.keys()
        for name, want in ref_params.items():
            torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)
