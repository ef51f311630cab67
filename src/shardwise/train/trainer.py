"""The per-rank training job: set up, build and parallelize the model, run the loop, report.

``run_job(job)`` is what every rank executes (or the only process, for a one-process job
started without a launcher). Steps:

1. ``Runtime``: process group (gloo on CPU, nccl on CUDA) and the world mesh from the degrees.
2. The model of the job's family (``shardwise.train.spec``), built on the meta device,
   parallelized, then each rank initializes only its blocks from the job's seed
   (``build_parallel_model``): the weights of the one-process run.
   With ``--pp`` each rank builds only its pipeline stages (``build_pipeline``), and a
   ``PipelineRunner`` (torch.distributed.pipelining's schedules) runs each step's microbatches
   through them; the last stage's loss is shared with every pipeline rank.
3. AdamW with linear warmup and cosine decay over ``--steps``; the data position is the step
   counter. With ``--resume``, the latest checkpoint's model, optimizer, schedule and step are
   loaded into this job's layout (``checkpointing.py``); so they are, without ``--resume``, in
   a run that may be restarted (``--max-restarts``, torchrun's) whose directory holds one.
4. The loop: forward, loss (under ``loss_parallel`` when asked), backward, step; a checkpoint
   every ``--checkpoint-every`` steps and after the last one; progress every ``log_every``
   steps and a summary at the end (rank 0), the loss curve and metrics file.

How a job stops early (``shardwise.launch.worker`` does the ending; see there):

* a non-finite loss: checked at every progress, checkpoint and last step from the first
  non-finite step of any rank (one all_reduce, so every rank stops at the same step and none
  trains on alone); no checkpoint of a diverged step is saved; rank 0 prints one ``error:``
  line naming the step, status ``EXIT_NON_FINITE_LOSS``;
* Ctrl-C / SIGINT: rank 0 prints ``interrupted at step N`` (the step in progress), with
  ``--checkpoint-dir`` the latest committed checkpoint, and every rank exits with status 130;
* a collective that does not complete within ``--collective-timeout`` seconds: every waiting
  rank reports it, naming the ranks that did not arrive (``shardwise.comm``);
* any other error on one rank: that rank reports it and exits; the process group is closed
  (barrier, teardown) on the success path only, so no rank waits for a peer that failed.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise import comm
from shardwise.tensor import random as sw_random
from shardwise.checkpoint.errors import CheckpointError
from shardwise.tensor.clip_grad import clip_grad_norm_
from shardwise.launch.worker import interrupt_context, restart_count
from shardwise.launch.launcher import close_process_group, under_launcher
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.pipeline_parallel.pipeline import share_loss
from shardwise.train.checkpointing import Checkpointer, TrainState, committed_steps, latest_checkpoint, make_checkpointer
from shardwise.train.config import ConfigError, JobConfig, params_label
from shardwise.train.data import BatchSource, load_corpus
from shardwise.train.metrics import RunMetrics
from shardwise.train.parallelize import ParallelOptions, build_parallel_model, fsdp_applies_mixed_precision
from shardwise.train.spec import ModelFamily
from shardwise.train.plot import write_loss_plot

__all__ = ["Runtime", "resolve_device", "run_job", "train", "train_step", "lr_factor", "parallel_options", "build_model", "loss_fn",
           "Progress", "NonFiniteLoss", "EXIT_NON_FINITE_LOSS"]

EXIT_NON_FINITE_LOSS = 3


def resolve_device(choice: str) -> str:
    """"cpu" or "cuda" for the --device flag ("auto": cuda when a GPU is visible)."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


@dataclass
class Runtime:
    """Where this rank runs: its device, rank, degrees and meshes (None for one process)."""

    device: torch.device
    rank: int
    world_size: int
    dims: ParallelDims
    world_mesh: object = None  # the N-D mesh of ParallelDims.build_mesh
    flat_mesh: object = None  # 1-D mesh of all ranks (summaries)

    @property
    def dp_mesh(self):
        """1-D mesh of the data-parallel ranks, or None without data parallelism."""
        return self.world_mesh["dp"] if self.world_mesh is not None and self.dims.dp_enabled else None

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    @property
    def cp_mesh(self):
        """1-D mesh of the context-parallel ranks (one sequence's parts), or None without cp."""
        return self.world_mesh["cp"] if self.world_mesh is not None and self.dims.cp_enabled else None

    @property
    def pp_mesh(self):
        """1-D mesh of the pipeline ranks (one stage or two each), or None without pipeline parallelism."""
        return self.world_mesh["pp"] if self.world_mesh is not None and self.dims.pp_enabled else None

    @property
    def loss_mesh(self):
        """1-D mesh the loss is averaged over: ``dp_cp`` (data and context ranks; every rank holds
        the same number of tokens), or None when there is nothing to average."""
        if self.cp_mesh is not None:
            return self.world_mesh["dp_cp"]
        return self.dp_mesh

    @classmethod
    def create(cls, job: JobConfig) -> "Runtime":
        """Join the process group of the launcher (if any) and build the meshes."""
        device_type = resolve_device(job.device)
        dims = job.parallel_dims()
        if not under_launcher():
            device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
            return cls(device, 0, 1, dims)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        comm.set_collective_timeout(job.collective_timeout)  # also the groups the meshes create
        if not dist.is_initialized():
            _init_process_group("nccl" if device_type == "cuda" else "gloo")
        from shardwise.core.mesh import DeviceMesh

        world = dist.get_world_size()
        flat = DeviceMesh(device_type, list(range(world)), mesh_dim_names=("world",))
        return cls(device, dist.get_rank(), world, dims, dims.build_mesh(device_type), flat)

    def close(self) -> None:
        """Close the process group (a barrier first): on the success path only."""
        if self.world_mesh is not None:
            close_process_group()


def _init_process_group(backend: str) -> None:
    """Join the job's default process group, in a store of its own on a restart.

    torchrun's agent keeps one store for all its restarts (``$TORCHELASTIC_USE_AGENT_STORE``),
    and ``env://`` gives every attempt the same keys: a restarted rank could read the attempt
    before's keys (gloo's addresses of dead peers: "Connection refused"; the failure posted by
    ``shardwise.launch.worker``). Each restart's keys get the restart number as prefix.
    """
    timeout = comm.collective_timeout()
    count, _ = restart_count()
    if count == 0:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"  # else the agent hosts it
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=hosts,
                           timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"shardwise/restart-{count}/", shared), rank=rank,
                            world_size=world, timeout=timeout)


@dataclass
class Progress:
    """Where the job is, for the line an interruption prints (read from the signal thread)."""

    step: int = 0  # the step in progress, 1-based; 0 before the first
    finished: bool = False

    def describe(self, checkpoint_dir: str | None) -> str:
        """``at step 5; latest checkpoint: ckpt/step-4 (--resume continues from it)``."""
        if self.finished:
            where = f"after the last step ({self.step})"
        else:
            where = f"at step {self.step}" if self.step else "during start-up"
        return where + (_latest_checkpoint_note(checkpoint_dir) if checkpoint_dir else "")


def _latest_checkpoint_note(directory: str) -> str:
    try:
        point = latest_checkpoint(directory)
    except CheckpointError as err:
        return f"; the latest checkpoint in {directory} is unreadable: {err}"
    if point is None:
        return f"; no checkpoint saved in {directory} yet"
    return f"; latest checkpoint: {point.path} (step {point.step}; --resume continues from it)"


class NonFiniteLoss(Exception):
    """The loss became nan or inf; every rank raises it at the same check."""

    def __init__(self, step: int, lr: float) -> None:
        super().__init__(f"the loss is not finite (nan or inf) at step {step}: training diverged (--lr {lr:g}); "
                         f"stopped without saving it (lower --lr, or clip gradients with --max-norm)")
        self.step = step


class _FiniteCheck:
    """The first step whose local loss was not finite, agreed by all ranks when asked.

    ``record`` is a tensor op (no host sync, no communication); ``first_bad`` takes the
    minimum over every rank (one all_reduce), so all ranks see the same step or None.
    """

    def __init__(self, flat_mesh, device: torch.device) -> None:
        self._mesh = flat_mesh
        self._first = torch.full((1,), math.inf, dtype=torch.float64, device=device)

    def record(self, loss: torch.Tensor, step: int) -> None:
        bad = ~torch.isfinite(loss.detach().reshape(1)) & torch.isinf(self._first)
        self._first = torch.where(bad, torch.full_like(self._first, step), self._first)

    def first_bad(self) -> int | None:
        first = self._first if self._mesh is None else comm.all_reduce(self._first, self._mesh, 0, "min")
        value = first.item()
        return None if math.isinf(value) else int(value)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Learning-rate multiplier at 0-based ``step``: linear warmup, then cosine down to 10%."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def parallel_options(job: JobConfig) -> ParallelOptions:
    """How to parallelize beyond the degrees: the job's flags."""
    return ParallelOptions(job.sequence_parallel, job.loss_parallel, job.activation_checkpointing,
                           job.mixed_precision, job.compile_backend if job.compile else None)


def build_model(job: JobConfig, runtime: Runtime, materialize: bool = True) -> torch.nn.Module:
    """The model from ``job.seed``, built on meta, parallelized, then each rank initializes its blocks.

    The parameters equal those of the family's model built whole on one device from the same
    seed (``build_parallel_model``), and no rank ever allocates more than its own shards.
    """
    sw_random.manual_seed(job.seed)
    family = job.model_family()
    model = build_parallel_model(family, job.model_args(), runtime.dims, runtime.world_mesh, parallel_options(job),
                                 runtime.device, materialize=materialize)  # False: meta blocks (a simulation)
    if runtime.cp_mesh is not None:
        _fit_sequence_buffers(family, [model], job.seq_len)
    return model


def _fit_sequence_buffers(family: ModelFamily, modules: list[torch.nn.Module], seq_len: int) -> None:
    """Cut the family's sequence buffers (a rotary table) to one sequence, one tensor shared by ``modules``.

    Under context parallelism they are sharded along the sequence with the inputs at every
    step: they must cover exactly positions 0 .. seq_len-1 so each part keeps its global positions.
    """
    for name, dim in family.sequence_buffers.items():
        fitted = getattr(modules[0], name).narrow(dim, 0, seq_len).clone()
        for module in modules:
            setattr(module, name, fitted)


def build_pipeline(job: JobConfig, runtime: Runtime, materialize: bool = True):
    """This rank's pipeline stages (parameters of the one-process model) and the runner of its schedule.

    Returns ``(model, runner, names)``: ``model`` holds this rank's modules under the whole
    model's paths (optimizer, clipping, checkpoints); ``runner.step`` runs one batch through the
    stages; ``names`` are the whole model's parameter names (for the optimizer's checkpoint).
    ``materialize=False`` (a simulation): meta blocks, and the stages run on meta tensors.
    """
    from shardwise.parallel.pipeline_parallel.pipeline import PipelineRunner
    from shardwise.train.parallelize import build_stages

    sw_random.manual_seed(job.seed)
    family = job.model_family()
    held = build_stages(family, job.model_args(), runtime.dims, runtime.world_mesh, parallel_options(job),
                        runtime.device, job.pp_schedule, materialize=materialize)
    if runtime.cp_mesh is not None:  # as build_model (one tensor shared by the stages)
        _fit_sequence_buffers(family, [held.model, *held.stages], job.seq_len)
    device = runtime.device if materialize else torch.device("meta")
    runner = PipelineRunner(held.stages, held.indices, held.num_stages, runtime.pp_mesh, device,
                            job.pp_schedule, job.microbatches, loss_fn)
    return held.model, runner, held.param_names


def build_optimizer(job: JobConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over the model's parameters (their local blocks hold its state)."""
    return torch.optim.AdamW(model.parameters(), lr=job.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every token of the (local) batch, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _step_context(job: JobConfig, runtime: Runtime, model: torch.nn.Module, inputs: torch.Tensor,
                  labels: torch.Tensor) -> contextlib.AbstractContextManager:
    """context_parallel over the cp axis (inputs, labels and the family's sequence buffers sharded
    along the sequence; inputs and labels keep their part); loss_parallel for vocabulary-sharded
    logits; bf16 autocast when FSDP does not cast."""
    stack = contextlib.ExitStack()
    if runtime.cp_mesh is not None:
        from shardwise.parallel import context_parallel

        along = job.model_family().sequence_buffers
        stack.enter_context(context_parallel(runtime.cp_mesh, buffers=[inputs, labels, *(getattr(model, n) for n in along)],
                                             seq_dims=[1, 1, *along.values()], no_restore_buffers={inputs, labels}))
    if job.loss_parallel:
        from shardwise.parallel import loss_parallel

        stack.enter_context(loss_parallel())
    if job.mixed_precision and not fsdp_applies_mixed_precision(runtime.dims):
        stack.enter_context(torch.autocast(runtime.device.type, dtype=torch.bfloat16))
    return stack


def _local_value(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: a loss-parallel loss is a DTensor, possibly still Partial."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def _say(runtime: Runtime, text: str) -> None:
    if runtime.rank == 0:
        print(text, flush=True)


def run_job(job: JobConfig) -> int:
    """Train ``job`` on this rank (joining or starting its process group); return the exit status.

    An error leaves the process group open on purpose (closing starts with a barrier that a
    failed peer never reaches): the caller ends the process (``failfast.run_worker``).
    """
    progress = Progress()
    with interrupt_context(lambda: progress.describe(job.checkpoint_dir)):
        runtime = Runtime.create(job)
        try:
            metrics = train(job, runtime, progress)
        except NonFiniteLoss as err:
            if runtime.rank == 0:
                print(f"shardwise.train: error: {err}", file=sys.stderr, flush=True)
            runtime.close()  # every rank stopped at the same check
            return EXIT_NON_FINITE_LOSS
        _finish(job, runtime, metrics)
        runtime.close()
    return 0


def _check_due(job: JobConfig, step: int) -> bool:
    """Agree on the loss being finite before a progress line, a checkpoint, and at the end."""
    periodic_save = job.checkpoint_dir and job.checkpoint_every and step % job.checkpoint_every == 0
    return step % job.log_every == 0 or step == job.last_step or bool(periodic_save)


def train(job: JobConfig, runtime: Runtime, progress: Progress | None = None) -> RunMetrics:
    """Run the job's steps on this rank; return what was measured (losses on every rank).

    Raises:
        NonFiniteLoss: on every rank at the same step, when the loss became nan or inf.
    """
    progress = progress if progress is not None else Progress()
    family = job.model_family()
    _say(runtime, f"shardwise.train: config {job.config!r} ({params_label(family.num_params(job.model_args()))} params), "
                  f"{job.nproc} rank(s) on {runtime.device.type}, layout {job.layout()}, "
                  f"global batch {job.global_batch} x {job.seq_len} tokens, {job.steps} steps")
    runner, names = None, None
    if runtime.pp_mesh is not None:
        model, runner, names = build_pipeline(job, runtime)
    else:
        model = build_model(job, runtime)
    optimizer = build_optimizer(job, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, job.warmup, job.steps))
    state = TrainState(model, optimizer, scheduler, seed=job.seed, schedule_steps=job.steps, config=job.config,
                       param_names=names)
    checkpointer = make_checkpointer(job.checkpoint_dir, job.checkpoint_every, job.last_step, _resumes(job),
                                     asynchronous=job.checkpoint_async, keep=job.checkpoint_keep)
    first = _restore(job, runtime, checkpointer, state)
    data = BatchSource(load_corpus(), job.global_batch, job.seq_len, job.seed, runtime.dims.dp_degree, runtime.dp_rank)
    metrics = RunMetrics(job.global_batch * job.seq_len, job.steps, runtime.loss_mesh, runtime.flat_mesh,
                         runtime.device, runtime.rank)
    metrics.first_step = first + 1
    finite = _FiniteCheck(runtime.flat_mesh, runtime.device)
    metrics.start()
    for step in range(first, job.last_step):
        progress.step = step + 1
        inputs, labels = (t.to(runtime.device) for t in data.batch_at(step))
        with _explaining(job, runtime, step == first), \
                _measured(job, runtime, metrics, step - first, job.last_step - first, model, optimizer, inputs, labels):
            loss = train_step(job, runtime, model, optimizer, inputs, labels, runner)
            metrics.record_state(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
        value = _local_value(loss)
        metrics.record_step(value, scheduler.get_last_lr()[0])
        finite.record(value, step + 1)
        scheduler.step()
        state.step = step + 1
        if _check_due(job, state.step) and (bad := finite.first_bad()) is not None:
            checkpointer.finish()  # a save in flight is of a finite step: let it commit
            raise NonFiniteLoss(bad, job.lr)
        checkpointer.after_step(state)
        if state.step % job.log_every == 0 or state.step == job.last_step:
            metrics.flush(state.step)
    checkpointer.finish()
    progress.finished = True
    return metrics


@contextlib.contextmanager
def _explaining(job: JobConfig, runtime: Runtime, first_step: bool) -> Iterator[None]:
    """``--explain``: record the first step on rank 0 (recording is local: the other ranks run
    as usual) and print it when it ends, summed up per module or every op (``job.explain``)."""
    if job.explain is None or not (first_step and runtime.rank == 0):
        yield
        return
    from shardwise.debug import explain

    with explain(detail=job.explain) as ex:
        yield
    print(ex, flush=True)


def train_step(job: JobConfig, runtime: Runtime, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               inputs: torch.Tensor, labels: torch.Tensor, runner=None) -> torch.Tensor:
    """One optimizer step on this rank's batch: forward, loss, backward, clipping, step; returns the loss.

    With a pipeline ``runner`` (``build_pipeline``) the schedule runs the stages and the last
    stage's loss reaches every pipeline rank. The simulation (``shardwise.simulate``) runs this
    very function on meta tensors.
    """
    with _step_context(job, runtime, model, inputs, labels):
        if runner is not None:
            loss = share_loss(runner.step(inputs, labels), runtime.pp_mesh, runtime.device)
        else:
            loss = loss_fn(model(inputs), labels)
            loss.backward()
    if job.max_norm > 0:
        clip_grad_norm_(model.parameters(), job.max_norm, across=runtime.pp_mesh)
    optimizer.step()
    job.model_family().after_optimizer_step(model, runtime.loss_mesh)  # MoE load balancing: once per step
    return loss


def _measured(job: JobConfig, runtime: Runtime, metrics: RunMetrics, index: int, count: int, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
              labels: torch.Tensor) -> contextlib.AbstractContextManager:
    """With ``--metrics-file``: measure the run's second step (its first if it has one), the
    first in steady state, as the simulation does (``shardwise.simulate.measure``)."""
    if not job.metrics_file or index != min(1, count - 1):
        return contextlib.nullcontext()
    from shardwise.simulate.measure import measure_step

    return measure_step(runtime.rank, runtime.device, model, optimizer, (inputs, labels), metrics.step_state,
                        metrics.keep_step_measurement)


def _resumes(job: JobConfig) -> bool:
    """Whether this run starts from a checkpoint: ``--resume``, or a run that may be restarted
    (``JobConfig.resumes_by_itself``) whose directory holds one. Every rank reads the same
    directory, which nothing writes to before the first step, so all agree. A damaged newest
    checkpoint still counts: loading falls back to an older one, or says what is wrong."""
    return job.resume or bool(job.resumes_by_itself and job.checkpoint_dir and committed_steps(job.checkpoint_dir))


def _restart_note() -> str:
    """`` (restart 2 of 3)`` in a restarted worker, else ''."""
    count, most = restart_count()
    return f" (restart {count} of {most})" if count else ""


def _restore(job: JobConfig, runtime: Runtime, checkpointer: Checkpointer, state: TrainState) -> int:
    """Load the latest checkpoint when resuming; return the first step to run (its data position).

    A checkpoint that cannot be loaded into this job (damaged, another model) is a bad job:
    ``ConfigError`` on every rank (``load`` fails on all ranks together).
    """
    try:
        first = checkpointer.restore(state)
    except CheckpointError as err:
        raise ConfigError(f"--resume: {err}") from None
    saved = state.resumed_from
    if state.resume_warning:
        _say(runtime, f"warning: --resume: {state.resume_warning}")
    if saved is None and restart_count()[0]:
        _say(runtime, f"starting at step 0{_restart_note()}: no checkpoint saved yet")
    if saved is not None:
        _say(runtime, f"resumed from {saved['path']} at step {first}{_restart_note()}")
        if saved["steps"] != job.steps:
            _say(runtime, f"note: the checkpoint was saved by a run of --steps {saved['steps']}; the learning-rate "
                          f"schedule now spans --steps {job.steps}, so this does not continue either run exactly "
                          f"(--stop-after ends a run early on its full schedule)")
        if first >= job.last_step:
            _say(runtime, f"nothing to train: the run ends at step {job.last_step}")
    return first


def _finish(job: JobConfig, runtime: Runtime, metrics: RunMetrics) -> None:
    """Summary, metrics file and loss plot (rank 0)."""
    if runtime.rank != 0 or not metrics.losses:
        return
    print("\n".join(metrics.summary_lines(f"{job.config} {job.layout()}")), flush=True)
    if job.metrics_file:
        metrics.write_json(job.metrics_file, {"job": job.as_dict(), "layout": job.layout()})
        print(f"  metrics: {job.metrics_file}", flush=True)
    if job.plot:
        print(f"  {write_loss_plot(job.plot, metrics.losses, title=f'{job.config} {job.layout()}', first_step=metrics.first_step)}", flush=True)
