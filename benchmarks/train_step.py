#!/usr/bin/env python
"""Training-step benchmark: the trainer's model and plans applied by shardwise and by torch, in one run.

    python benchmarks/train_step.py              # debug config (3.3M params), 4 CPU ranks
    python benchmarks/train_step.py --quick      # tiny config, fewer steps (smoke check)
    python benchmarks/train_step.py --modes fsdp,tp --reps 12 --seq-len 256
    python benchmarks/train_step.py --modes ep,ep_fsdp,ep_tp --reps 6   # the MoE family (debug_moe)

The script starts 4 local gloo workers itself; under torchrun it just runs. For every mode it
builds ``shardwise.train``'s ``Transformer`` from the same seed twice and parallelizes it with
the same ``parallelize_llama`` plans, once through shardwise's APIs and once through torch's
(``torch.distributed.tensor.parallel.parallelize_module`` and its styles,
``torch.distributed.fsdp.fully_shard``, torch's ``loss_parallel``):

    fsdp       dp_shard=4                   FSDP, one unit per block plus the root
    tp         tp=4                         Megatron-style column/row pairs
    fsdp_tp    dp_shard=2 x tp=2            FSDP over the TP-sharded parameters
    tp_sp_lp   tp=4 + sequence parallel + loss parallel
    pp_fsdp    pp=2 x dp_shard=2            pipeline (1F1B, 2 microbatches) of FSDP stages
    pp_tp      pp=2 x tp=2                  pipeline (GPipe, 2 microbatches) of TP stages
    cp         cp=4                         context parallel: FSDP over dp_shard_cp, ring attention
    cp_fsdp    cp=2 x dp_shard=2            the same with two data-parallel groups of 2 context ranks
    ep         dp_shard=4, ep=4             MoE: experts over 4 ranks, FSDP on the rest (trainer --ep 4)
    ep_fsdp    dp_shard=4, ep=2             MoE: experts over 2 ranks, FSDP-sharded over the other 2
    ep_tp      dp_shard=2 x tp=2, ep=2      MoE: experts over ep, each expert over tp; TP + SP elsewhere

The MoE modes (``--moe-config``, default debug_moe; tiny_moe under --quick) build the MoE
family's model and parallelize it with ``shardwise.train.parallelize`` as the trainer's ``--ep``
flags do: shardwise through its own styles (``ExpertParallel``, ``ExpertTensorParallel``), torch
through its ``parallelize_module``/``fully_shard`` and an expert-parallel style written with its
public API in ``_torch_expert_parallel.py`` (experts ``Shard(0)`` over ep, tokens dispatched and
combined by ``all_to_all_single`` with per-peer splits, as torchtitan does). Each step ends with
the family's load-balancing update (its counts summed over the data-parallel ranks by each
library's all_reduce). Their loss is averaged over the data-parallel ranks and compared with one
process's, as the cp modes'.

The context-parallel modes run each step as the trainer's ``--cp`` does: inputs, labels and the
rotary table sharded along the sequence in the load-balanced causal layout, FSDP over the
flattened ``dp_shard_cp`` axis; shardwise through ``shardwise.parallel.context_parallel``, torch
through ``torch.distributed.tensor.experimental.context_parallel`` with its ``fully_shard``. Their
loss is averaged over ``dp_cp`` (every token of the global batch) and also compared with the
"single" run's (one process, same weights, optimizer and data). Where torch's context parallelism
cannot run (on CPU it has no SDPA kernel it can shard), its column says n/a, the exact error is
printed under the table, and shardwise's side still runs and is checked against one process.

The pipeline modes split the model by module paths the same way for both libraries
(``shardwise.parallel.pipeline_parallel.pipeline.split_stage``) and run both through torch.distributed.pipelining
(``PipelineStage`` and its schedules); only the stages' parallelization differs (shardwise's
DTensor, FSDP and styles vs torch's).

Reported per mode:

* median step time (forward, loss, backward, AdamW step), each repetition timed from a barrier
  and taken on the slowest rank; shardwise and torch repetitions alternate (and alternate which
  goes first) so that load changes on the machine hit both alike; ratio shardwise/torch;
* tokens/s: the global batch's tokens over the median step time, for each library;
* tensor peak per rank (the primary memory figure): the highest sum of live tensor bytes
  above the start while the library builds the model and runs two steps, from the
  allocation and free events of torch's profiler (``profile_memory``) on the thread running
  the step (autograd's CPU backward and gloo's temporary buffers are allocated there too). It is what
  ``torch.cuda.max_memory_allocated`` reports on a GPU, so it is the figure a GPU user compares,
  and it is the same measure for both libraries (``TensorPeak``);
* RSS rise per rank (second): the rise of the process's peak resident set size (VmHWM, reset
  through /proc/self/clear_refs after freeing the previous model) over the same build and two
  steps. On CPU it includes what glibc's allocator keeps after frees (heap retention, which
  depends on the order of allocations more than on their sizes), so two libraries with equal
  tensor peaks can differ here by a hundred MiB. Both memory figures are measured for each
  library separately, each in a pass of its own (the timed steps never run under the
  profiler), after one untimed step of each library (so imports and first-use caches are not
  counted);
* agreement: the largest relative difference between the two libraries' losses at the same
  step (same weights, same data), and between their first step's gradients, parameter by
  parameter (whole-gradient norms; AdamW's first updates hide a gradient off by a constant
  factor, so the losses alone would not); above 1e-4 the mode is marked WRONG and the run exits
  3. The cp and MoE modes also give shardwise's difference from one process's loss: above 1e-5,
  WRONG (exit 3).
  A library that cannot run a cp mode here is reported, not a failure (exit 0).

"single" (and "single_moe" with MoE modes) is the unparallelized model on rank 0 with the
whole global batch (the other ranks wait), for scale. docs/benchmarks.md describes the modes
and the memory columns.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import logging
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

from _worker import gloo_worker, native_stderr_silenced

from shardwise.launch import main_or_launch

NPROC = 4
EXIT_WRONG = 3
AGREE_RTOL = 1e-4
PARITY_RTOL = 1e-5  # a cp mode's loss vs one process's (the trainer's parity bound)
MODES = {
    "fsdp": ({"dp_shard": 4}, {}),
    "tp": ({"tp": 4, "dp_shard": 1}, {}),
    "fsdp_tp": ({"dp_shard": 2, "tp": 2}, {}),
    "tp_sp_lp": ({"tp": 4, "dp_shard": 1}, {"sequence_parallel": True, "loss_parallel": True}),
    "pp_fsdp": ({"pp": 2, "dp_shard": 2}, {}),
    "pp_tp": ({"pp": 2, "tp": 2, "dp_shard": 1}, {}),
    "cp": ({"cp": 4, "dp_shard": 1}, {}),
    "cp_fsdp": ({"cp": 2, "dp_shard": 2}, {}),
    "ep": ({"dp_shard": 4, "ep": 4}, {}),
    "ep_fsdp": ({"dp_shard": 4, "ep": 2}, {}),
    "ep_tp": ({"dp_shard": 2, "tp": 2, "ep": 2}, {"sequence_parallel": True}),
}
MOE_MODES = ("ep", "ep_fsdp", "ep_tp")  # the MoE family's model; the others are Llama's
PP_SCHEDULES = {"pp_fsdp": "1f1b", "pp_tp": "gpipe"}  # 2 microbatches (= pp) each


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="Llama's shapes (default debug; --quick tiny)")
    p.add_argument("--moe-config", default=None, help="the MoE modes' shapes (default debug_moe; --quick tiny_moe)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, among {', '.join(MODES)}")
    p.add_argument("--reps", type=int, default=None, help="timed steps per library and mode (default 8; --quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per library and mode first")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="default 128 (--quick 32)")
    p.add_argument("--quick", action="store_true", help="tiny config, short sequences, 3 reps")
    args = p.parse_args(argv)
    args.config = args.config or ("tiny" if args.quick else "debug")
    args.moe_config = args.moe_config or ("tiny_moe" if args.quick else "debug_moe")
    args.reps = args.reps or (3 if args.quick else 8)
    args.seq_len = args.seq_len or (32 if args.quick else 128)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    from shardwise.train.models.llama import CONFIGS
    from shardwise.train.models.moe import CONFIGS as MOE_CONFIGS

    if args.config not in CONFIGS:
        p.error(f"unknown config {args.config!r}; known: {', '.join(CONFIGS)}")
    if args.moe_config not in MOE_CONFIGS:
        p.error(f"unknown --moe-config {args.moe_config!r}; known: {', '.join(MOE_CONFIGS)}")
    _check_moe_degrees(p, args)
    if args.global_batch % 4:
        p.error("--global-batch must be divisible by 4 (the fsdp mode's data-parallel degree)")
    cp = max((MODES[m][0].get("cp", 1) for m in args.modes), default=1)
    if args.seq_len % (2 * cp):
        p.error(f"--seq-len {args.seq_len} must divide into 2 x cp = {2 * cp} chunks (the load-balanced causal layout)")
    return args


def _check_moe_degrees(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The MoE config fits every MoE mode asked (experts divisible by ep, heads by tp)."""
    from shardwise.parallel import ParallelDims
    from shardwise.train.config import ConfigError
    from shardwise.train.models.moe import MOE

    for mode in (m for m in args.modes if m in MOE_MODES):
        try:
            MOE.check_degrees(MOE.config(args.moe_config), ParallelDims(world_size=NPROC, **MODES[mode][0]),
                              args.moe_config)
        except ConfigError as err:
            p.error(f"mode {mode}: {err}")


# ====================================================================== memory
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def _release_memory() -> None:
    """Free unreachable objects and hand freed heap pages back to the OS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRSS:
    """Peak resident memory while the block runs, above the resident memory at its start (bytes)."""

    def __enter__(self) -> "PeakRSS":
        _release_memory()
        self.supported = True
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
        except OSError:
            self.supported = False
        self.start = _status_kib("VmRSS")
        self.peak = 0
        return self

    def __exit__(self, *exc) -> None:
        self.peak = (_status_kib("VmHWM") - self.start) * 1024 if self.supported else -1


class TensorPeak:
    """Peak of the live tensor bytes while the block runs, above those live at its start (bytes).

    torch's profiler with ``profile_memory`` records every allocation and free of tensor storage
    made on this thread (where the step, its CPU backward and gloo's temporary buffers of
    all_gather, reduce_scatter, all_reduce and all_to_all allocate; a thread started inside the
    block is not seen); their running sum in time order, at its highest, is the peak. On a GPU
    it is what ``torch.cuda.max_memory_allocated`` counts above its start;
    ``tensor_peak_self_check`` checks the measure on a known pattern. A block freed on another
    thread (the last reference dropped by a gloo worker) is not recorded freed; it is taken off
    when its address is allocated again (``peak_of_memory_events``; docs/benchmarks.md).
    """

    def __enter__(self) -> "TensorPeak":
        from torch.profiler import ProfilerActivity, profile

        _release_memory()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with native_stderr_silenced():
            self._prof.start()
        self.peak = 0
        return self

    def __exit__(self, *exc) -> None:
        with native_stderr_silenced():
            self._prof.stop()
        self.peak = peak_of_memory_events(self._prof)
        del self._prof


def peak_of_memory_events(prof) -> int:
    """The highest running sum of a finished profile's allocations (+) and frees (-), in time order.

    A free made on another thread is not recorded; the allocator then hands the same address out
    again, so an allocation at an address still counted live means its block was freed before
    it: the block is taken off there (late, so the figure stays an upper bound, but close)."""
    import torch

    allocation = torch._C._profiler._EventType.Allocation
    events = sorted((n.start_time_ns, n.extra_fields.ptr, n.extra_fields.alloc_size)
                    for n in _event_nodes(prof.profiler.kineto_results.experimental_event_tree())
                    if n.tag == allocation and n.extra_fields.device.type == "cpu")
    live: dict[int, int] = {}  # address -> bytes of the blocks allocated in the window, not yet freed
    total = peak = 0
    for _, ptr, nbytes in events:
        total -= live.pop(ptr, 0)  # a free, or a missed one shown by the address coming back
        if nbytes > 0:
            live[ptr] = nbytes
            total += nbytes
        peak = max(peak, total)
    return peak


def _event_nodes(nodes) -> Iterator:
    """Every node of the profiler's event tree, depth first."""
    for node in nodes:
        yield node
        yield from _event_nodes(node.children)


def tensor_peak_self_check() -> None:
    """The measure on a known pattern: 1 MiB, then 2 MiB (3 live), free 1, then 0.5 (2.5 live):
    3 MiB; a tensor alive before the block and freed inside it does not count."""
    import torch

    before = torch.empty(4 << 20, dtype=torch.uint8)
    with TensorPeak() as peak:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(2 << 20, dtype=torch.uint8)
        del a, before
        c = torch.empty(1 << 19, dtype=torch.uint8)
        del b, c
    if peak.peak != 3 << 20:
        raise RuntimeError(f"the tensor-peak measure is off on this torch: {peak.peak} bytes, expected {3 << 20}")


# ====================================================================== one library's job
def torch_api():
    import torch.distributed.fsdp as fsdp
    import torch.distributed.tensor as placements
    import torch.distributed.tensor.parallel as parallel

    from shardwise.train.parallelize import ParallelAPI

    return ParallelAPI.from_namespaces(parallel, placements, fsdp, None)


def torch_mesh(dims):
    """torch's DeviceMesh with the same axes as ``dims.build_mesh()``."""
    from torch.distributed.device_mesh import init_device_mesh

    axes = dims.mesh_axes()
    mesh = init_device_mesh("cpu", [n for _, n in axes], mesh_dim_names=tuple(a for a, _ in axes))
    flattened = dims.flattened_axes()
    for name in _torch_flattened(dims):  # as build_mesh (torch has no alias: a 1-axis name is flattened too)
        mesh[flattened[name]]._flatten(name)
    return mesh


def _torch_flattened(dims) -> list[str]:
    """The flattened axes torch's side names: FSDP's dp_shard_cp under cp; under ep, dp_shard
    (split in two around the experts), ep and dp (the load-balancing counts' sum)."""
    names = ["dp_shard_cp"] if dims.cp_enabled else []
    return names + (["dp_shard", "ep", "dp"] if dims.ep_enabled else [])


def make_optimizer(params):
    """Every run's optimizer (both libraries, every mode, the single-process oracle)."""
    import torch

    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def shardwise_cp_context(cp_mesh):
    """The trainer's step context under cp: inputs, labels and the rotary table sharded along the
    sequence (load-balanced), SDPA as shardwise's ring attention."""
    from shardwise.parallel import context_parallel

    def ctx(model, inputs, labels):
        return context_parallel(cp_mesh, buffers=[inputs, labels, model.rotary], seq_dims=[1, 1, 0],
                                no_restore_buffers={inputs, labels})
    return ctx


def torch_cp_context(cp_mesh):
    """The same with torch's experimental context_parallel (its load-balanced causal layout)."""
    from torch.distributed.tensor.experimental import context_parallel

    def ctx(model, inputs, labels):
        return context_parallel(cp_mesh, buffers=[inputs, labels, model.rotary], buffer_seq_dims=[1, 1, 0],
                                no_restore_buffers={inputs, labels})
    return ctx


@dataclass
class Job:
    """One library's parallelized model, optimizer and step function for a mode."""

    lib: str
    model: object
    optimizer: object
    loss_ctx: object
    data: object
    losses: list = field(default_factory=list)
    times: list = field(default_factory=list)
    runner: object = None  # pipeline modes: the PipelineRunner of this rank's stages
    pp_mesh: object = None  # pipeline modes: shardwise's pp mesh (to share the last stage's loss)
    seq_ctx: object = None  # cp modes: seq_ctx(model, inputs, labels) shards the sequence for one step
    loss_mesh: object = None  # cp and MoE modes: shardwise's mesh the loss is averaged over (every token)
    after_step: object = None  # MoE: after_step(model), the load-balancing update after the optimizer step

    def step(self, i: int, inspect=None):
        """One optimizer step on batch ``i``; ``inspect(job)`` (untimed passes only) sees the
        gradients before the update."""
        from shardwise.train.trainer import loss_fn

        inputs, labels = self.data.batch_at(i)
        seq_ctx = contextlib.nullcontext()
        if self.seq_ctx is not None:  # sharded in place: own copies, not views of one token tensor
            inputs, labels = inputs.clone(), labels.clone()
            seq_ctx = self.seq_ctx(self.model, inputs, labels)
        with seq_ctx, self.loss_ctx():
            if self.runner is not None:
                loss = self.runner.step(inputs, labels)  # None except on the last stage's ranks
            else:
                loss = loss_fn(self.model(inputs), labels)
                loss.backward()
        if inspect is not None:
            inspect(self)
        self.optimizer.step()
        if self.after_step is not None:
            self.after_step(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def grad_norms(self) -> list[float]:
        """Every parameter's whole gradient norm, in parameter order (0 for none): sharded ones
        gathered first (a collective over each parameter's mesh)."""
        modules = self.model if isinstance(self.model, list) else [self.model]
        out = []
        for param in (p for module in modules for p in module.parameters()):
            grad = param.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            out.append(0.0 if grad is None else float(grad.norm()))
        return out

    def record_loss(self, loss) -> None:
        if self.pp_mesh is not None:  # untimed: every rank gets the last stage's loss
            import torch

            from shardwise.parallel.pipeline_parallel.pipeline import share_loss

            loss = share_loss(loss, self.pp_mesh, torch.device("cpu"))
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        if self.loss_mesh is not None:  # untimed: the mean over the data and context ranks (equal token counts)
            from shardwise import comm

            value = comm.all_reduce(value.detach().float().reshape(1), self.loss_mesh, 0, "sum") / self.loss_mesh.size()
        self.losses.append(float(value))


def build_job(lib: str, mode: str, args, meshes: dict, data) -> Job:
    from shardwise.train.config import get_model_args
    from shardwise.train.models.llama import Transformer, parallelize_llama
    from shardwise.train.parallelize import ParallelOptions, shardwise_api

    dim_kwargs, opt_kwargs = MODES[mode]
    dims, sw_mesh, t_mesh = meshes[mode]
    if mode in MOE_MODES:
        return _moe_job(lib, mode, args, dims, sw_mesh, t_mesh, data)
    api = shardwise_api() if lib == "shardwise" else torch_api()
    import shardwise.tensor.random

    shardwise.tensor.random.manual_seed(0)  # restarts shardwise's stream too: every build has the same weights
    model = Transformer(get_model_args(args.config))
    options = ParallelOptions(**opt_kwargs)
    mesh = sw_mesh if lib == "shardwise" else t_mesh
    ctx = api.loss_parallel if options.loss_parallel else contextlib.nullcontext
    if dims.pp_enabled:
        return _pipeline_job(lib, mode, model, dims, mesh, sw_mesh, options, api, ctx, data)
    if dims.cp_enabled:  # as the trainer: the rotary table covers exactly one sequence (global positions)
        model.rotary = model.rotary[:args.seq_len].clone()
    parallelize_llama(model, dims, mesh, options, api)
    optimizer = make_optimizer(model.parameters())
    if dims.cp_enabled:
        seq_ctx = (shardwise_cp_context if lib == "shardwise" else torch_cp_context)(mesh["cp"])
        return Job(lib, model, optimizer, ctx, data, seq_ctx=seq_ctx, loss_mesh=sw_mesh["dp_cp"])
    return Job(lib, model, optimizer, ctx, data)


def _moe_job(lib: str, mode: str, args, dims, sw_mesh, t_mesh, data) -> Job:
    """The MoE family's model parallelized as the trainer's --ep flags do, by ``lib``: shardwise
    through the family's own plans, torch through its API and ``_torch_expert_parallel``."""
    import shardwise.tensor.random
    from shardwise.train.models.moe import MOE
    from shardwise.train.parallelize import ParallelOptions, parallelize, shardwise_api

    shardwise.tensor.random.manual_seed(0)  # every build (and the single run) has the same weights
    model = MOE.build(MOE.config(args.moe_config))
    options = ParallelOptions(**MODES[mode][1])
    if lib == "shardwise":
        parallelize(model, MOE, dims, sw_mesh, options, shardwise_api())
        family_update, dp_mesh = MOE.after_optimizer_step, sw_mesh["dp"]
    else:
        from _torch_expert_parallel import sum_reduce_experts, torch_moe_family, torch_update_expert_bias

        parallelize(model, torch_moe_family(MOE), dims, t_mesh, options, torch_api())
        if dims.dp_shard_mod_ep > 1:  # gloo has no pre-multiplied sum (see sum_reduce_experts)
            sum_reduce_experts(model)
        family_update, dp_mesh = torch_update_expert_bias, t_mesh["dp"]
    return Job(lib, model, make_optimizer(model.parameters()), contextlib.nullcontext, data,
               loss_mesh=sw_mesh["dp"], after_step=lambda m: family_update(m, dp_mesh))


def _pipeline_job(lib: str, mode: str, model, dims, mesh, sw_mesh, options, api, ctx, data) -> Job:
    """This rank's stages of ``model`` (the same split for both libraries), parallelized by ``api``,
    run by torch.distributed.pipelining's schedule."""
    import torch

    from shardwise.parallel.pipeline_parallel.pipeline import PipelineRunner, split_stage
    from shardwise.parallel.pipeline_parallel.split import num_stages, stage_module_paths, stages_of_rank
    from shardwise.train.models.llama import parallelize_llama
    from shardwise.train.trainer import loss_fn

    schedule = PP_SCHEDULES[mode]
    total = num_stages(dims.pp, schedule)
    indices = stages_of_rank(mesh["pp"].get_local_rank(), dims.pp, schedule)
    stages = [split_stage(model, stage_module_paths(model.args.n_layers, total, i)) for i in indices]
    for stage in stages:
        parallelize_llama(stage, dims, mesh, options, api)
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = make_optimizer(params)
    runner = PipelineRunner(stages, indices, total, mesh["pp"], torch.device("cpu"), schedule, dims.pp, loss_fn)
    return Job(lib, stages, optimizer, ctx, data, runner=runner, pp_mesh=sw_mesh["pp"])


# ====================================================================== the worker
class Bench:
    def __init__(self, args) -> None:
        import torch
        import torch.distributed as dist

        self.args, self.torch, self.dist = args, torch, dist
        # torch's DTensor logs a warning for each gather of an expert gradient (first_step_grads)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.rank = dist.get_rank()
        self.rows: list[dict] = []
        self.single_losses: dict[bool, list[float]] = {}  # by "is the MoE family"

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def slowest(self, values: list[float]) -> list[float]:
        t = self.torch.tensor(values, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def per_rank(self, value: int) -> list[int]:
        out = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(out, value)
        return out

    def meshes(self) -> dict:
        from shardwise.parallel import ParallelDims

        out = {}
        for mode in self.args.modes:
            dims = ParallelDims(world_size=NPROC, **MODES[mode][0])
            out[mode] = (dims, dims.build_mesh("cpu"), torch_mesh(dims))
        return out

    def data_for(self, dims, sw_mesh):
        from shardwise.train.data import BatchSource, load_corpus

        dp_rank = sw_mesh["dp"].get_local_rank() if dims.dp_enabled else 0
        return BatchSource(load_corpus(), self.args.global_batch, self.args.seq_len, 0, dims.dp_degree, dp_rank)

    def run_single(self, moe: bool) -> None:
        """The plain model (Llama's, or the MoE family's with ``moe``) on rank 0 with the whole
        batch, the others waiting; its losses (the same weights, optimizer and data as the modes)
        go to every rank, the oracle of the cp and MoE modes."""
        import shardwise.tensor.random
        from shardwise.train.data import BatchSource, load_corpus
        from shardwise.train.spec import get_family

        family = get_family("moe" if moe else "llama")
        steps = self.args.warmup + self.args.reps
        times, losses = [], self.torch.zeros(steps, dtype=self.torch.float64)
        if self.rank == 0:
            shardwise.tensor.random.manual_seed(0)  # as build_job: the same weights
            model = family.build(family.config(self.args.moe_config if moe else self.args.config))
            job = Job("single", model, make_optimizer(model.parameters()), contextlib.nullcontext,
                      BatchSource(load_corpus(), self.args.global_batch, self.args.seq_len, 0),
                      after_step=lambda m: family.after_optimizer_step(m, None))
            for i in range(steps):
                t0 = time.perf_counter()
                loss = job.step(i)
                if i >= self.args.warmup:
                    times.append(time.perf_counter() - t0)
                losses[i] = float(loss)
            del job, model
        self.dist.barrier()
        _release_memory()
        median = self.torch.tensor([statistics.median(times) if times else 0.0], dtype=self.torch.float64)
        self.dist.broadcast(median, src=0)
        self.dist.broadcast(losses, src=0)
        self.single_losses[moe] = losses.tolist()
        self.rows.append({"mode": "single_moe" if moe else "single", "sw": float(median), "torch": float("nan")})

    def torch_error(self, mode: str, meshes: dict, data) -> str | None:
        """None if torch's side of a cp mode runs a step here, else its exact error (one line).

        torch's context_parallel may not run on this machine (its ring needs attention kernels
        CPU lacks); the error is raised alike on every rank, checked here."""
        if not MODES[mode][0].get("cp", 1) > 1:
            return None
        try:
            build_job("torch", mode, self.args, meshes, data).step(0)
            error = None
        except Exception as err:  # noqa: BLE001 (reported, not hidden: the exact error is printed)
            error = " ".join(f"{type(err).__name__}: {err}".split())
        _release_memory()
        errors = self.per_rank(error)
        if len(set(errors)) > 1:
            raise RuntimeError(f"{mode}: torch's side failed on some ranks only: {errors}")
        return error

    def first_step_grads(self, mode: str, meshes: dict, data, libs: tuple[str, ...]) -> float:
        """One untimed step of each library (so imports and first-use caches stay out of the
        measures after it); returns the largest relative difference between their first
        gradients, parameter by parameter (nan without torch). The losses alone would hide a
        gradient off by a constant factor: AdamW's first updates barely depend on its scale."""
        norms: dict[str, list[float]] = {}
        for lib in libs:
            build_job(lib, mode, self.args, meshes, data).step(0, lambda job: norms.setdefault(lib, job.grad_norms()))
        if len(norms) < 2:
            return float("nan")
        sw, ref = norms["shardwise"], norms["torch"]
        floor = 1e-6 * max(ref, default=0.0) + 1e-30  # a vanishing gradient is compared at the scale of the others
        return self.slowest([max((abs(a - b) / max(b, floor) for a, b in zip(sw, ref)), default=0.0)])[0]

    def measure_memory(self, mode: str, meshes: dict, data, libs: tuple[str, ...]) -> dict[str, dict[str, list]]:
        """Per library, the tensor peak and the peak RSS rise of every rank, each measured in a
        pass of its own (the profiler's records would count in RSS), after ``first_step_grads``."""
        out: dict[str, dict[str, list]] = {lib: {} for lib in libs}
        for kind, measure in (("tensor", TensorPeak), ("rss", PeakRSS)):
            for lib in libs:
                self.dist.barrier()
                with measure() as peak:
                    job = build_job(lib, mode, self.args, meshes, data)
                    for i in range(2):
                        job.step(i)
                    del job
                out[lib][kind] = self.per_rank(peak.peak)
        _release_memory()
        return out

    def measure_time(self, mode: str, meshes: dict, data, libs: tuple[str, ...]) -> tuple[dict, float, float]:
        """Median step times, the largest relative loss difference shardwise vs torch (nan without
        torch) and, for the cp modes (losses averaged over every token), shardwise vs one process."""
        jobs = [build_job(lib, mode, self.args, meshes, data) for lib in libs]
        for i in range(self.args.warmup + self.args.reps):
            for job in (jobs if i % 2 == 0 else jobs[::-1]):
                self.dist.barrier()
                t0 = time.perf_counter()
                loss = job.step(i)
                elapsed = time.perf_counter() - t0
                if i >= self.args.warmup:
                    job.times.append(elapsed)
                job.record_loss(loss)
        medians = {j.lib: statistics.median(self.slowest(j.times)) for j in jobs}
        sw = jobs[0]
        diff = _rel_diff(sw.losses, jobs[1].losses) if len(jobs) > 1 else float("nan")
        single = self.single_losses[mode in MOE_MODES]
        vs_single = _rel_diff(sw.losses, single) if sw.loss_mesh is not None else float("nan")
        return medians, self.slowest([diff])[0], self.slowest([vs_single])[0]

    def run(self) -> int:
        from shardwise.train.spec import get_family

        a = self.args
        families = [(moe, name) for moe, name in ((False, "llama"), (True, "moe"))
                    if any((m in MOE_MODES) == moe for m in a.modes)]
        configs = ", ".join(f"{name} {cfg!r} ({get_family(name).num_params(get_family(name).config(cfg)) / 1e6:.2f}M "
                            f"params)" for moe, name in families for cfg in [a.moe_config if moe else a.config])
        self.say(f"train step: {configs}, {NPROC} ranks (gloo, CPU), global batch {a.global_batch} x {a.seq_len} "
                 f"tokens, {a.warmup} warm-up + {a.reps} timed steps per library and mode")
        tensor_peak_self_check()
        meshes = self.meshes()
        for moe, _ in families:
            self.run_single(moe)
        for mode in a.modes:
            data = self.data_for(*meshes[mode][:2])
            error = self.torch_error(mode, meshes, data)
            libs = ("shardwise",) if error else ("shardwise", "torch")
            grad_diff = self.first_step_grads(mode, meshes, data, libs)
            memory = self.measure_memory(mode, meshes, data, libs)
            medians, diff, vs_single = self.measure_time(mode, meshes, data, libs)
            self.rows.append({"mode": mode, "sw": medians["shardwise"], "torch": medians.get("torch", float("nan")),
                              "mem_sw": memory["shardwise"], "mem_torch": memory.get("torch", {}), "diff": diff,
                              "grad_diff": grad_diff, "vs_single": vs_single, "torch_error": error})
            _release_memory()
            self.say(f"  measured {mode}")
        return self.report()

    def report(self) -> int:
        wrong = [r["mode"] for r in self.rows if _worse(r.get("diff"), AGREE_RTOL)
                 or _worse(r.get("grad_diff"), AGREE_RTOL) or _worse(r.get("vs_single"), PARITY_RTOL)]
        if self.rank != 0:
            return EXIT_WRONG if wrong else 0
        tokens = self.args.global_batch * self.args.seq_len
        w = max(14, 4 * NPROC + 3)  # one "a/b/c/d" list of MiB per rank
        head = (f"{'mode':<10} {'shardwise s':>11} {'torch s':>8} {'sw/torch':>8} {'tok/s sw':>9} {'tok/s torch':>11}  "
                f"{'tensor MiB sw':>{w}} {'tensor MiB torch':>{w}}  {'RSS MiB sw':>{w}} {'RSS MiB torch':>{w}}"
                f"  loss rel diff")
        print("\n" + head + "\n" + "-" * len(head))
        for r in self.rows:
            if r["mode"].startswith("single"):
                print(f"{r['mode']:<10} {r['sw']:>11.3f} {'':>8} {'':>8} {tokens / r['sw']:>9.0f} {'':>11}  "
                      f"(1 process, whole batch, no parallelism)")
                continue
            print(self._row(r, tokens, w, wrong))
        ratios = [r["sw"] / r["torch"] for r in self.rows if not r["mode"].startswith("single") and r["torch"] == r["torch"]]
        if ratios:
            print(f"shardwise/torch step time: worst {max(ratios):.2f}, best {min(ratios):.2f}")
        print("tensor MiB: per rank, the peak of live tensor bytes (torch's profiler's allocation events) while "
              "building the model and running 2 steps; RSS MiB: the rise of the process's peak RSS over the same "
              "(on CPU it includes the allocator's retained heap)")
        for r in self.rows:
            if r.get("torch_error"):
                print(f"{r['mode']}: torch unavailable here: {r['torch_error']}")
        for mode in wrong:
            print(f"!! WRONG: {mode}: shardwise's losses or first gradients differ from torch's by more than "
                  f"{AGREE_RTOL:g}, or its losses from one process's by more than {PARITY_RTOL:g}")
        return EXIT_WRONG if wrong else 0


    @staticmethod
    def _row(r: dict, tokens: int, w: int, wrong: list[str]) -> str:
        """One mode's line of the table."""
        mib = lambda xs: "/".join(f"{x / 2**20:.0f}" for x in xs) if xs else "-"  # noqa: E731
        has_torch = r["torch"] == r["torch"]
        torch_s, ratio, torch_tps = ((f"{r['torch']:.3f}", f"{r['sw'] / r['torch']:.2f}", f"{tokens / r['torch']:.0f}")
                                     if has_torch else ("n/a", "n/a", "n/a"))
        diff = "n/a" if r["diff"] != r["diff"] else f"{r['diff']:.1e}, grads {r['grad_diff']:.1e}"
        if r["vs_single"] == r["vs_single"]:
            diff += f" (vs 1 process {r['vs_single']:.1e})"
        note = "  !! WRONG" if r["mode"] in wrong else ""
        sw, to = r["mem_sw"], r["mem_torch"]
        return (f"{r['mode']:<10} {r['sw']:>11.3f} {torch_s:>8} {ratio:>8} {tokens / r['sw']:>9.0f} {torch_tps:>11}  "
                f"{mib(sw.get('tensor')):>{w}} {mib(to.get('tensor')):>{w}}  {mib(sw.get('rss')):>{w}} "
                f"{mib(to.get('rss')):>{w}}  {diff}{note}")


def _rel_diff(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))


def _worse(diff: float | None, rtol: float) -> bool:
    """Above the tolerance (nan: nothing compared)."""
    return diff is not None and diff == diff and diff > rtol


def worker() -> int:
    return gloo_worker(lambda: Bench(parse_args(sys.argv[1:])).run())


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and bad flags answer once, before any worker starts
    main_or_launch(worker, NPROC, quiet_codes=(EXIT_WRONG,))
