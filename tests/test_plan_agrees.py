"""shardwise.plan ranks layouts by the figures ``--simulate`` prints (docs/plan.md).

The simulated peak must first be a property of the job, not of when Python collects garbage:
the instruments measuring a step (``CommDebugMode``'s module tracker) must not keep an
activation-checkpoint recompute's tensors alive in reference cycles.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.utils.checkpoint
from torch import nn

from shardwise.debug import CommDebugMode
from shardwise.simulate import MemoryTracker


def _checkpointed_steps_peak(measured_comms: bool) -> int:
    """Peak live bytes of three checkpointed forward/backward steps, garbage collection off."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 256), nn.SiLU(), nn.Linear(256, 64))
    x = torch.randn(32, 64, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        with CommDebugMode() if measured_comms else contextlib.nullcontext(), MemoryTracker() as mem:
            for _ in range(3):
                torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
        return mem.peak_bytes
    finally:
        gc.enable()


def test_measuring_a_checkpointed_step_keeps_no_recomputed_activation_alive():
    """Hooks on a recompute's outputs would hold them in cycles: each step adds its recomputed
    activations to the peak until a full collection (which gc.disable() withholds here)."""
    assert _checkpointed_steps_peak(measured_comms=True) == _checkpointed_steps_peak(measured_comms=False)
