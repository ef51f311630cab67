"""What the trainer reports about memory: the training state each rank holds, beside RSS.

RSS on CPU carries the runtime's few hundred MiB, so a layout's saving shows only in the
state figures: parameter, gradient and optimizer bytes of this rank's own blocks.
"""

from __future__ import annotations

import torch

from shardwise.train.metrics import StateBytes, format_bytes, state_bytes
from tests.helpers import BASE, one_process_run


def _one_step_state(model: torch.nn.Module) -> tuple[StateBytes, torch.optim.Optimizer]:
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 5)).sum().backward()
    optimizer.step()
    return state_bytes(model, optimizer), optimizer


def test_state_bytes_count_parameters_gradients_and_adam_moments():
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2, bias=False))
    got, _ = _one_step_state(model)
    params = (5 * 7 + 7 + 7 * 2) * 4
    steps = 3 * 4  # one fp32 step counter per parameter tensor
    assert got == StateBytes(params=params, grads=params, optimizer=2 * params + steps)
    assert state_bytes(model).optimizer == 0


def test_fsdp_ranks_each_hold_a_quarter_of_the_one_process_state(trainer_runs):
    """The parity job's runs (tests/helpers.py): one process, and FSDP over 4 ranks."""
    whole = one_process_run(tuple(BASE))["state"]
    assert len(whole) == 1 and whole[0].params > 0 and whole[0].grads == whole[0].params
    per_rank = trainer_runs.get(4, ["--dp-shard", "4"])[0]["state"]
    assert len(per_rank) == 4
    assert sum(s.params for s in per_rank) == whole[0].params  # every element held once
    assert max(s.total for s in per_rank) < 0.3 * whole[0].total, (per_rank, whole)


def test_format_bytes_keeps_small_figures_readable():
    assert [format_bytes(n) for n in (96 * 1024, 5 * 2**20 + 2**19, 3 * 2**30)] == ["96.0 KiB", "5.5 MiB", "3.00 GiB"]
