"""Pipeline parallelism: a model split by module paths into stages, run by torch's schedules.

A stage is the model itself with the modules of the other stages taken out
(``split_stage``): the model's code is unchanged, its forward skips what a stage lacks (a
missing embedding means the input is already the hidden state, and so on), and every module
keeps its path in the whole model, so a stage's ``state_dict`` uses the whole model's keys
(``layers.3.attention.wq.weight``) and checkpoints move between pipelined and plain layouts.

Each stage is then parallelized on the rest of the mesh (its ``dp_shard``/``cp``/``tp``
slice) as the whole model would be. Between stages only plain tensors travel: the blocks'
outputs are plain local tensors (tensor-parallel blocks end in a rowwise layer whose output is
local), so ``torch.distributed.pipelining`` carries them unchanged on the pipeline axis's
process group, and its schedules (GPipe, 1F1B, interleaved 1F1B) run shardwise stages as they
run torch's own. A stage's fully_shard'ed (or replicate'd) modules reduce their gradients once
per step: every microbatch's backward but the last runs with gradient sync off (the gradients
add up locally) and keeps the gathered parameters for the next microbatch, the last one
reduces the sum and frees them (``set_last_backward``), as torch's stages do for torch's FSDP
and DDP. Microbatch gradients add up and are divided by the number of microbatches
(the schedule's ``scale_grads``): the loss is the mean over microbatches, the one-process
loss when microbatches hold equally many tokens.

torch.distributed.pipelining is imported on first use only (it imports torch's own FSDP and
DTensor); nothing else in shardwise depends on it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from shardwise import comm
from shardwise.parallel.pipeline_parallel.split import SCHEDULES

__all__ = ["split_stage", "PipelineRunner", "share_loss", "set_last_backward"]


def split_stage(model: nn.Module, keep: Sequence[str]) -> nn.Module:
    """A shallow copy of ``model`` holding only the modules at the ``keep`` paths.

    ``keep`` names top-level children (``"tok_embeddings"``) or children of a top-level
    ``nn.ModuleDict`` (``"layers.3"``). A top-level child with nothing kept becomes None; a
    ModuleDict keeps only the kept entries, under their own keys. The kept modules are the
    model's own objects (not copies): parallelizing a stage changes them in ``model`` too.

    Raises:
        ValueError: a path names no module of ``model``, or goes through a container that is
            not a ModuleDict (a ModuleList renumbers its entries, so paths would change).
    """
    wanted: dict[str, set[str] | None] = {}
    for path in keep:
        top, _, rest = path.partition(".")
        if model._modules.get(top) is None:
            raise ValueError(f"split_stage: {path!r} names no module of {type(model).__name__}")
        if not rest:
            wanted[top] = None
            continue
        if not isinstance(model._modules[top], nn.ModuleDict) or rest not in model._modules[top]:
            raise ValueError(f"split_stage: {path!r} is not an entry of a ModuleDict of {type(model).__name__}")
        if top not in wanted or wanted[top] is not None:
            wanted.setdefault(top, set()).add(rest)
    stage = copy.copy(model)
    for attr, value in vars(model).items():  # own parameter, buffer and hook tables: hooks added later stay apart
        if attr.startswith("_") and isinstance(value, (dict, set)):
            object.__setattr__(stage, attr, copy.copy(value))
    modules = {}
    for name, child in model._modules.items():
        if name not in wanted:
            modules[name] = None
        elif wanted[name] is None:
            modules[name] = child
        else:
            modules[name] = nn.ModuleDict({k: v for k, v in child.items() if k in wanted[name]})
    object.__setattr__(stage, "_modules", modules)
    return stage


def share_loss(loss: torch.Tensor | None, pp_mesh, device: torch.device) -> torch.Tensor:
    """The last stage's loss on every pipeline rank (one all_reduce over ``pp_mesh``; others give 0)."""
    mine = torch.zeros((), dtype=torch.float32, device=device) if loss is None else loss.detach().float().reshape(())
    return comm.all_reduce(mine.reshape(1), pp_mesh, 0, "sum").reshape(())


def _count_sends(stage, pp_mesh) -> None:
    """Report every send ``stage``'s schedule issues (activations forward, input gradients
    backward) to ``comm``'s recorders on the pipeline axis, as shardwise's own collectives are:
    torch.distributed.pipelining sends them itself, past ``shardwise.comm``."""

    def counted(get_ops):
        def ops(chunk: int):
            out = get_ops(chunk)
            for op in out:
                if op.op is torch.distributed.isend:
                    comm.record_send("pp_send", pp_mesh, 0, op.tensor.numel() * op.tensor.element_size())
            return out
        return ops

    stage.get_fwd_send_ops = counted(stage.get_fwd_send_ops)
    stage.get_bwd_send_ops = counted(stage.get_bwd_send_ops)


def set_last_backward(module: nn.Module, last: bool) -> int:
    """Prepare a stage's backward of one microbatch: the last one reduces the gradients and frees
    the gathered parameters, the ones before keep both (the gradients add up locally, and the
    parameters stay gathered for the next microbatch's forward and backward, as torch's stages
    keep torch's FSDP parameters: one all_gather per block per step fewer than resharding after
    every microbatch). How many data-parallel modules there are."""
    from shardwise.parallel.data_parallel.replicate import STATE_ATTR as REPLICATE_ATTR
    from shardwise.parallel.data_parallel.state import state_of

    count = 0
    for m in module.modules():
        if (fsdp := state_of(m)) is not None:
            fsdp.requires_gradient_sync = fsdp.reshard_after_backward = last
        elif (ddp := m.__dict__.get(REPLICATE_ATTR)) is not None:  # replicate: no gathered parameters
            ddp.requires_gradient_sync = last
        else:
            continue
        count += 1
    return count


_STAGE_CLASS: type | None = None


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """Restore ``module``'s buffers (those with data) that changed to their values on entry
    (only those: writing one that autograd saved, a rotary table, would fail its backward)."""
    kept = [(b, b.clone()) for b in module.buffers() if not b.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                if not torch.equal(buffer, value):
                    buffer.copy_(value)


def _stage_class() -> type:
    """torch's ``PipelineStage`` whose backward reduces a stage's fully_shard gradients and frees
    its gathered parameters on the last microbatch only (torch's own stage does so for torch's
    FSDP modules alone)."""
    global _STAGE_CLASS
    if _STAGE_CLASS is None:
        from torch.distributed.pipelining import PipelineStage

        class _ReduceOnceStage(PipelineStage):
            def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
                set_last_backward(self.submod, bool(last_backward))
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

            def _forward_metadata_inference(self, *args, **kwargs):
                # torch runs each stage once more at its first step to infer shapes: state a forward
                # keeps in buffers (an MoE layer's tokens per expert) must not count that run
                with _buffers_kept(self.submod):
                    return super()._forward_metadata_inference(*args, **kwargs)

        _STAGE_CLASS = _ReduceOnceStage
    return _STAGE_CLASS


class PipelineRunner:
    """The stages of one pipeline rank and the schedule that runs them (torch.distributed.pipelining).

    Args:
        stages: this rank's stage modules, by increasing stage index.
        indices: their stage indices.
        num_stages: stages of the whole pipeline.
        pp_mesh: the 1-D pipeline mesh (its process group carries the activations).
        device: where the stages run.
        schedule: one of ``SCHEDULES`` ("gpipe", "1f1b", "interleaved_1f1b").
        microbatches: microbatches per step (they must divide the batch given to ``step``).
        loss_fn: ``loss_fn(output, target)``, the mean loss of one microbatch (run by the last stage).
    """

    def __init__(self, stages: Sequence[nn.Module], indices: Sequence[int], num_stages: int, pp_mesh,
                 device: torch.device, schedule: str, microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        from torch.distributed import pipelining

        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
        group = pp_mesh.get_group()
        self.indices = list(indices)
        self.num_stages = num_stages
        stage_class = _stage_class()
        self.stages = [stage_class(m, i, num_stages, device, group=group) for m, i in zip(stages, indices)]
        self.has_first = 0 in self.indices
        self.has_last = num_stages - 1 in self.indices
        kind = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
                "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B}[schedule]
        target = self.stages if schedule == "interleaved_1f1b" else self.stages[0]
        self.schedule = kind(target, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
        # The last stage's outputs (a microbatch's logits each) are not needed after their loss:
        # unless told, torch's schedule keeps every microbatch's until the step ends and then
        # concatenates them, a result ``step`` never used.
        self._step_kwargs = ({"return_outputs": False}
                             if "return_outputs" in inspect.signature(self.schedule.step).parameters else {})
        for stage in self.stages:
            _count_sends(stage, pp_mesh)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch; the mean microbatch loss on the last stage's rank, else None.

        Gradients are left in the parameters' ``.grad`` (mean over microbatches), as after
        ``loss.backward()`` of the whole batch.
        """
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*args, target=labels, losses=losses, **self._step_kwargs)
            values = [x.full_tensor() if hasattr(x, "full_tensor") else x for x in losses]
            return torch.stack([v.detach().float().reshape(()) for v in values]).mean()
        self.schedule.step(*args, **self._step_kwargs)
        return None
