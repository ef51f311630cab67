"""A pipeline rank's step, simulated: its stage's microbatches in the schedule's order, on meta tensors.

torch's pipeline schedules cannot run on a simulated process group: before the first step
they vote between ranks with point-to-point messages whose values they read (``.item()``), and
their shape inference exchanges pickled metadata; a simulated group delivers no values. So
``SimulatedPipeline`` stands in for ``parallel.pipeline.PipelineRunner`` (same ``step``): it
runs this rank's stage module on each microbatch, forward and backward, in the order the
schedule runs them, with the microbatches a neighbour would send made up as meta tensors of the
stage boundary's shape, and records each send of the step on the ``pp`` axis exactly as the
real runner counts them (``PipelineRunner`` reports every send the schedule issues):

* forward: every stage but the last sends each microbatch's output (microbatches x boundary bytes);
* backward: every stage but the first sends the gradient of each microbatch's input.

Memory follows from running the microbatches in the schedule's order, each forward's graph
(activations) kept until its backward:

* gpipe: all forwards, then all backwards: every microbatch in flight at the peak;
* 1f1b: ``min(microbatches, pp - stage)`` forwards first, then one backward and one forward in
  turn: that many in flight at the peak.

A stage keeps each microbatch's output until that microbatch's backward, as torch's stages do
(on the last stage that is the logits, which the loss alone would not keep). The real runner
asks the schedule not to keep the last stage's outputs for returning them (``return_outputs``):
the loss is all it needs.

Assumed, as torch's stages do: the buffers that receive a neighbour's activations and
gradients are allocated once per microbatch when the stage is built and reused every step (so
a steady-state step does not allocate them; the real runner's are not counted either), and
gradients are divided by the number of microbatches in place after the last backward, and (as
the real stages do) fully_shard and replicate reduce gradients on the last backward only, and
fully_shard keeps its gathered parameters until then.
Interleaved 1F1B (two stages per rank) is not simulated.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from shardwise import comm
from shardwise.parallel.pipeline_parallel.pipeline import set_last_backward

__all__ = ["SIMULATED_SCHEDULES", "SimulatedPipeline", "schedule_order", "boundary_meta"]

SIMULATED_SCHEDULES = ("gpipe", "1f1b")


def schedule_order(schedule: str, microbatches: int, pp: int, stage: int) -> list[tuple[str, int]]:
    """The (``"F"``/``"B"``, microbatch) actions of ``stage`` in one step of ``schedule`` (pure).

    Example:
        >>> schedule_order("1f1b", 4, 2, 0)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('F', 3), ('B', 2), ('B', 3)]
    """
    if schedule == "gpipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    if schedule != "1f1b":
        raise ValueError(f"--simulate does not simulate the {schedule!r} pipeline schedule yet; use gpipe or 1f1b")
    warmup = min(microbatches, pp - stage)
    order = [("F", i) for i in range(warmup)]
    forward = warmup
    for backward in range(microbatches):
        order.append(("B", backward))
        if forward < microbatches:
            order.append(("F", forward))
            forward += 1
    return order


def boundary_meta(job, dims, microbatch_rows: int) -> torch.Tensor:
    """The meta tensor a stage receives from the previous one: the residual stream of one microbatch.

    Its sequence is this rank's part (split over ``cp``, and over ``tp`` with sequence
    parallelism); its dtype bf16 when FSDP casts the blocks (mixed precision), else fp32.
    """
    seq = job.seq_len // dims.cp
    if job.sequence_parallel and dims.tp > 1:
        seq //= dims.tp
    bf16 = job.mixed_precision and dims.fsdp_enabled
    return torch.empty((microbatch_rows, seq, job.model_args().dim),
                       dtype=torch.bfloat16 if bf16 else torch.float32, device="meta")


class SimulatedPipeline:
    """This rank's pipeline stage run microbatch by microbatch on meta tensors (``step`` as ``PipelineRunner``).

    Args:
        stages: this rank's stage modules (one: interleaved schedules are not simulated).
        indices: their stage indices.
        num_stages: stages of the whole pipeline.
        pp_mesh: the 1-D pipeline mesh (the sends are recorded on its axis).
        schedule, microbatches: as ``PipelineRunner``.
        loss_fn: the mean loss of one microbatch (run by the last stage).
        boundary: ``boundary(rows)``, the meta tensor a stage receives for a microbatch of ``rows`` rows.
    """

    def __init__(self, stages: Sequence[nn.Module], indices: Sequence[int], num_stages: int, pp_mesh,
                 schedule: str, microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 boundary: Callable[[int], torch.Tensor]) -> None:
        if len(stages) != 1:
            raise ValueError(f"--simulate does not simulate the {schedule!r} pipeline schedule yet "
                             f"({len(stages)} stages per rank); use gpipe or 1f1b")
        self.module, self.index = stages[0], indices[0]
        self.num_stages, self.pp_mesh = num_stages, pp_mesh
        self.schedule, self.microbatches = schedule, microbatches
        self.loss_fn, self.boundary = loss_fn, boundary
        self.has_first = self.index == 0
        self.has_last = self.index == num_stages - 1
        self._received: list[torch.Tensor] | None = None  # per microbatch, allocated once (as torch's stages)
        self._grads_in: list[torch.Tensor] | None = None

    def _record_send(self, t: torch.Tensor) -> None:
        comm.record_send("pp_send", self.pp_mesh, 0, t.numel() * t.element_size())

    def _buffers(self, rows: int) -> None:
        if self._received is None and not self.has_first:
            self._received = [self.boundary(rows) for _ in range(self.microbatches)]
        if self._grads_in is None and not self.has_last:
            self._grads_in = [torch.empty_like(self.boundary(rows)) for _ in range(self.microbatches)]

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch on meta tensors; the mean loss on the last stage, else None."""
        m = self.microbatches
        in_mbs, label_mbs = inputs.tensor_split(m), labels.tensor_split(m)
        self._buffers(in_mbs[0].shape[0])
        # per microbatch in flight: what its backward starts from, the stage's input, the stage's output
        pending: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}
        losses: list[torch.Tensor] = []
        order = schedule_order(self.schedule, m, self.num_stages, self.index)
        last_backward = [i for action, i in order if action == "B"][-1]
        for action, i in order:
            if action == "F":
                x = in_mbs[i] if self.has_first else self._received[i].detach().requires_grad_()
                out = stage_out = self.module(x)
                if self.has_last:
                    out = self.loss_fn(out, label_mbs[i])
                    losses.append(out.detach())
                else:
                    expected = self._grads_in[i]
                    if (out.shape, out.dtype) != (expected.shape, expected.dtype):
                        raise RuntimeError(f"simulated pipeline: stage {self.index} sends {out.dtype}{list(out.shape)}, "
                                           f"the boundary was assumed {expected.dtype}{list(expected.shape)}")
                    self._record_send(out)
                pending[i] = (out, None if self.has_first else x, stage_out)
            else:
                out, x, _ = pending.pop(i)
                # as the real stages: data-parallel gradients are reduced (and gathered parameters
                # freed) on the last backward only
                set_last_backward(self.module, i == last_backward)
                if self.has_last:
                    out.backward()
                else:
                    torch.autograd.backward(out, self._grads_in[i])
                if x is not None:
                    self._record_send(x.grad)
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.div_(m)
        if self.has_last:
            values = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in losses]
            return torch.stack([v.float().reshape(()) for v in values]).mean()
        return None
