"""What one training step costs a rank: bytes sent per mesh axis, peak memory, training state.

``measure_step`` wraps one step, real or simulated, with the same two instruments, so the two
can be compared figure for figure:

* communication: ``CommDebugMode`` (``shardwise.comm``'s own byte accounting: what this rank
  sends under each collective's optimal algorithm), summed per mesh axis, and the collectives
  issued per axis and kind (``shardwise.plan`` prices each one's latency with
  ``shardwise.cost``);
* memory: ``MemoryTracker``, the live bytes of tensor storage on this rank, counting the state
  held when the step starts (parameter blocks, gradients, optimizer state, buffers, the batch)
  and everything the step allocates until it is freed. ``peak_memory_bytes`` is its highest
  total; ``activation_peak_bytes`` the part above the state held at the start (activations,
  gathered parameters, gradients, temporaries). On CUDA, ``cuda_peak_allocated_bytes`` adds
  ``torch.cuda.max_memory_allocated`` over the step (the allocator's figure, rounded to its
  blocks, with everything else on the device).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from shardwise.simulate.memory import MemoryTracker

__all__ = ["StepMeasurement", "measure_step", "state_tensors"]


@dataclass
class StepMeasurement:
    """One rank's figures for one step (the fields of a metrics file's ``per_rank`` entries)."""

    rank: int
    comm_bytes_per_step: int = 0
    comm_bytes_by_axis: dict[str, int] = field(default_factory=dict)
    collectives_by_axis: dict[str, dict[str, int]] = field(default_factory=dict)  # axis -> kind -> count
    collectives_per_step: int = 0
    peak_memory_bytes: int = 0
    activation_peak_bytes: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    cuda_peak_allocated_bytes: int | None = None
    simulated_as: int | None = None  # the rank whose simulation stands for this one

    def as_dict(self) -> dict:
        out = asdict(self)
        return {k: v for k, v in out.items() if v is not None}


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """Every tensor a rank keeps between steps: parameters, gradients, buffers, optimizer state."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def measure_step(rank: int, device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 held: Iterable[torch.Tensor], state: Callable[[], object],
                 keep: Callable[[StepMeasurement], None]) -> Iterator[None]:
    """Measure the step run inside; hand the figures to ``keep`` when it ends.

    Args:
        rank: this rank's global rank (recorded).
        device: where the step runs (CUDA adds the allocator's peak).
        model, optimizer: whose state is held at the start.
        held: other tensors alive through the step (the batch).
        state: returns the ``metrics.StateBytes`` recorded during the step (after the
            optimizer step, before zero_grad).
        keep: receives the measurement.
    """
    from shardwise.debug import CommDebugMode

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracker, comms = MemoryTracker(), CommDebugMode()
    with comms, tracker:
        tracker.hold([*state_tensors(model, optimizer), *held])
        start = tracker.live_bytes
        yield
    by_axis: dict[str, int] = {}
    calls: dict[str, dict[str, int]] = {}
    for record in comms.records:
        by_axis[record.axis_name] = by_axis.get(record.axis_name, 0) + record.bytes_sent
        kinds = calls.setdefault(record.axis_name, {})
        kinds[record.kind] = kinds.get(record.kind, 0) + 1
    held_state = state()
    keep(StepMeasurement(
        rank=rank,
        comm_bytes_per_step=comms.bytes_sent,
        comm_bytes_by_axis=by_axis,
        collectives_by_axis=calls,
        collectives_per_step=len(comms.records),
        peak_memory_bytes=tracker.peak_bytes,
        activation_peak_bytes=tracker.peak_bytes - start,
        param_bytes=held_state.params,
        grad_bytes=held_state.grads,
        optimizer_bytes=held_state.optimizer,
        cuda_peak_allocated_bytes=int(torch.cuda.max_memory_allocated(device)) if cuda else None,
    ))
