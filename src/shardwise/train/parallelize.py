"""Apply parallelism to the single-device ``Transformer``, from outside, in a fixed order.

1. Tensor (and sequence) parallelism over the "tp" mesh axis: ``parallelize_module`` with plan
   dicts keyed by module path (``tp_plans``). Parameters become DTensors sharded over tp.
2. Activation checkpointing per transformer block (recompute its activations in backward),
   then, with ``--compile``, ``torch.compile`` per block.
3. Data parallelism over the dp axes, chosen from the degrees as torchtitan does:
   dp_shard > 1 -> FSDP (``fully_shard`` per block, then the root), on a (dp_replicate,
   dp_shard) mesh when dp_replicate > 1 too (HSDP); dp_replicate only -> ``replicate`` (DDP).
   With context parallelism (cp > 1) FSDP shards over the flattened ``dp_shard_cp`` axis: the cp
   ranks hold the same parameters and their gradients (each from its part of the sequences)
   are averaged over it with the data-parallel ones. The model code is unchanged: the trainer
   runs each step inside ``context_parallel`` (inputs, labels and the rotary table sharded along
   the sequence, attention as ring attention over the cp axis).

The order matters: FSDP shards whatever parameters it finds, so it must come after TP has
turned them into tp-sharded DTensors (FSDP then adds its own axis), and after checkpointing
has wrapped the blocks FSDP will treat as units.

``build_llama`` builds the model on the meta device (shapes only), parallelizes it, then gives
each rank storage for its own blocks (``to_empty``) and initializes them (``init_weights``,
layout-independent random numbers): no rank ever holds more than its shards, and every layout
starts from the weights of the single-device run with the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

from shardwise.parallel.dims import ParallelDims
from shardwise.train.config import ModelArgs
from shardwise.train.model import Transformer

__all__ = ["ParallelAPI", "shardwise_api", "ParallelOptions", "parallelize_llama", "build_llama", "LlamaStages",
           "build_llama_stages", "tp_plans",
           "apply_tp", "apply_ac", "apply_compile", "apply_fsdp", "apply_ddp"]


@dataclass(frozen=True)
class ParallelAPI:
    """The functions and styles the plans are built from: shardwise's (``shardwise_api()``).

    torch's own have the same names and signatures, so a benchmark can pass torch's and get the
    very same plan applied by torch (this module never imports them itself).
    """

    parallelize_module: Callable
    ColwiseParallel: type
    RowwiseParallel: type
    SequenceParallel: type
    PrepareModuleInput: type
    Shard: type
    Replicate: type
    fully_shard: Callable
    MixedPrecisionPolicy: type
    loss_parallel: Callable
    replicate: Callable | None = None

    @classmethod
    def from_namespaces(cls, parallel: Any, placements: Any, fsdp: Any, replicate: Callable | None) -> "ParallelAPI":
        """Collect the names from a parallel-styles module, a placements module and an FSDP module."""
        return cls(parallel.parallelize_module, parallel.ColwiseParallel, parallel.RowwiseParallel,
                   parallel.SequenceParallel, parallel.PrepareModuleInput, placements.Shard, placements.Replicate,
                   fsdp.fully_shard, fsdp.MixedPrecisionPolicy, parallel.loss_parallel, replicate)


def shardwise_api() -> ParallelAPI:
    """shardwise's parallel APIs (imported on first use)."""
    import shardwise.parallel.data_parallel as fsdp
    import shardwise.parallel as parallel
    import shardwise.core.placement as placements

    return ParallelAPI.from_namespaces(parallel, placements, fsdp, getattr(fsdp, "replicate", None))


@dataclass(frozen=True, slots=True)
class ParallelOptions:
    """How to parallelize beyond the degrees: the flags of the job."""

    sequence_parallel: bool = False
    loss_parallel: bool = False
    activation_checkpointing: bool = False
    mixed_precision: bool = False
    compile_backend: str | None = None  # torch.compile each block with this backend (None: eager)


def parallelize_llama(model: nn.Module, dims: ParallelDims, world_mesh, options: ParallelOptions,
                      api: ParallelAPI | None = None) -> nn.Module:
    """Apply TP/SP, then activation checkpointing, then FSDP/HSDP or DDP, in place.

    Args:
        model: a ``Transformer``, initialized, on its device.
        dims: the job's degrees.
        world_mesh: ``dims.build_mesh(...)`` (None when the world is one rank); a mesh with the
            same axis names from ``api``'s library.
        options: sequence/loss parallel, checkpointing, mixed precision.
        api: whose parallel APIs apply the plan (default shardwise's).

    Returns:
        The same module, parallelized.

    Example:
        >>> dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
        >>> parallelize_llama(Transformer(args), dims, dims.build_mesh(), ParallelOptions(sequence_parallel=True))
    """
    needs_api = dims.tp_enabled or dims.dp_enabled or dims.cp_enabled
    api = api or (shardwise_api() if needs_api else None)
    if dims.tp_enabled:
        apply_tp(model, world_mesh["tp"], options.sequence_parallel, options.loss_parallel, api)
    if options.activation_checkpointing:
        apply_ac(model)
    if options.compile_backend is not None:
        apply_compile(model, options.compile_backend)
    if dims.fsdp_enabled:
        shard = "dp_shard_cp" if dims.cp_enabled else "dp_shard"
        axes = ("dp_replicate", shard) if dims.dp_replicate_enabled else shard
        apply_fsdp(model, world_mesh[axes], options.mixed_precision, api)
    elif dims.dp_replicate_enabled:
        apply_ddp(model, world_mesh["dp_replicate"], api)
    return model


def build_llama(args: ModelArgs, dims: ParallelDims, world_mesh, options: ParallelOptions,
                device: torch.device | str, *, materialize: bool = True) -> nn.Module:
    """A parallelized ``Transformer`` that no rank ever held whole: meta -> parallelize -> to_empty -> init.

    Seed first (``shardwise.tensor.random.manual_seed``, the same on every rank): the parameters then
    equal those of ``Transformer(args)`` built on one device after the same seed.

    Args:
        args: the model shapes.
        dims, world_mesh, options: as for ``parallelize_llama``.
        device: where each rank's blocks live (the mesh's device type).
        materialize: False stops after parallelizing: every parameter is a meta tensor (or a
            DTensor of meta blocks) of its final layout, nothing allocated.

    Example:
        >>> shardwise.tensor.random.manual_seed(0)
        >>> model = build_llama(CONFIGS["debug"], dims, dims.build_mesh(), ParallelOptions(), "cpu")
    """
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_llama(model, dims, world_mesh, options)
    if materialize:
        model.to_empty(device=device)
        model.init_weights()
    return model


@dataclass
class LlamaStages:
    """What one pipeline rank holds of the model: its stages and their modules together.

    ``stages`` are the stage modules (``split_stage`` of one whole ``Transformer``) by increasing
    stage index; ``model`` holds all of this rank's modules under the whole model's paths (one
    module for the optimizer, gradient clipping and checkpoints). They share their modules.
    """

    stages: list[nn.Module]
    indices: list[int]
    num_stages: int
    model: nn.Module
    param_names: list[str]  # every parameter of the whole model, in its order (all stages)


def build_llama_stages(args: ModelArgs, dims: ParallelDims, world_mesh, options: ParallelOptions,
                       device: torch.device | str, schedule: str, *, materialize: bool = True) -> LlamaStages:
    """This pipeline rank's stages, each parallelized on its slice of the mesh, with the
    parameters of ``Transformer(args)`` built whole on one device after the same seed.

    The whole model is built on meta; each stage keeps its modules (``stage_module_paths``) and
    is parallelized as ``parallelize_llama`` does for the whole model; only the stages' modules
    get storage. ``init_weights`` then runs on the whole model, where the other stages' meta
    modules consume their random numbers without drawing (``meta_fills_advance``), so every
    parameter gets the value it has on one device. ``materialize=False`` stops after
    parallelizing (meta blocks, nothing allocated: a simulation).
    """
    from shardwise.parallel.pipeline_parallel.pipeline import split_stage
    from shardwise.parallel.pipeline_parallel.split import num_stages, stage_module_paths, stages_of_rank
    from shardwise.tensor.random import meta_fills_advance

    with torch.device("meta"):
        whole = Transformer(args)
    total = num_stages(dims.pp, schedule)
    indices = stages_of_rank(world_mesh["pp"].get_local_rank(), dims.pp, schedule)
    paths = [stage_module_paths(args.n_layers, total, i) for i in indices]
    stages = [split_stage(whole, p) for p in paths]
    for stage in stages:
        parallelize_llama(stage, dims, world_mesh, options)
        if materialize:
            stage.to_empty(device=device)
    if materialize:
        whole.register_buffer("rotary", torch.empty_like(whole.rotary, device=device), persistent=False)
        with meta_fills_advance():
            whole.init_weights()
    rank_model = split_stage(whole, [p for per_stage in paths for p in per_stage])
    for module in (*stages, rank_model):
        module.register_buffer("rotary", whole.rotary, persistent=False)  # one tensor: sharded once under cp
    names = [name for name, _ in whole.named_parameters()]
    return LlamaStages(stages, indices, total, rank_model, names)


def fsdp_applies_mixed_precision(dims: ParallelDims) -> bool:
    """Whether FSDP casts parameters for this layout (else the trainer autocasts the forward)."""
    return dims.fsdp_enabled


# ---------------------------------------------------------------------- tensor parallelism
def tp_plans(sequence_parallel: bool, loss_parallel: bool, api: ParallelAPI | None = None) -> tuple[dict, dict]:
    """(root plan, per-block plan) for tensor parallelism, keyed by module path.

    Linear layers pair up Megatron-style: ``wq/wk/wv`` and ``w1/w3`` are column-sharded (each
    rank computes some heads / hidden units), ``wo`` and ``w2`` row-sharded (their partial sums
    are reduced once per sub-block). With sequence parallelism the residual stream and the norms
    stay sharded along the sequence (dim 1) between sub-blocks, so the reduction becomes a
    reduce-scatter and the block input an all-gather. With loss parallelism the output layer
    keeps logits sharded over the vocabulary (dim -1) for the loss.
    """
    api = api or shardwise_api()
    ColwiseParallel, RowwiseParallel, SequenceParallel = api.ColwiseParallel, api.RowwiseParallel, api.SequenceParallel
    PrepareModuleInput, Replicate, Shard = api.PrepareModuleInput, api.Replicate, api.Shard
    between = Shard(1) if sequence_parallel else Replicate()  # residual-stream layout
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
        "feed_forward.w3": ColwiseParallel(),
    }
    # The sub-blocks take their input as one DTensor that the colwise layers share, so the
    # gradients of wq/wk/wv (w1/w3) with respect to it add up as one pending sum, reduced once
    # per sub-block instead of once per layer (with SP: one reduce-scatter instead of three).
    block.update({
        "attention": PrepareModuleInput(input_layouts=(between, None), desired_input_layouts=(Replicate(), None)),
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
    })
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    return root, block


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool, loss_parallel: bool,
             api: ParallelAPI | None = None) -> None:
    """Shard the model over the 1-D ``tp_mesh`` with ``tp_plans``."""
    api = api or shardwise_api()
    root, block = tp_plans(sequence_parallel, loss_parallel, api)
    root = {path: style for path, style in root.items() if getattr(model, path, None) is not None}  # pipeline stage
    api.parallelize_module(model, tp_mesh, root)
    for layer in model.layers.values():
        api.parallelize_module(layer, tp_mesh, block)


# ---------------------------------------------------------------------- compilation
def apply_compile(model: nn.Module, backend: str) -> None:
    """``torch.compile`` every transformer block in place, after TP and checkpointing, before
    data parallelism (as torchtitan orders them): each block's ops, layout decisions and TP
    collectives become one graph; FSDP's and DDP's hooks run eagerly at its boundaries.
    Shapes are static (``dynamic=False``): layouts are decided per shape at trace time."""
    for block in model.layers.values():
        block.compile(backend=compile_backend(backend), dynamic=False)


def compile_backend(name: str) -> Any:
    """What ``torch.compile`` takes for a backend name: the name itself, or for "<base>+comm"
    the backend ``base`` with shardwise's communication pass (bucketing and overlap, see
    ``shardwise.compile.schedule``) over every compiled graph."""
    base, plus, extra = name.partition("+")
    if not plus:
        return name
    if extra != "comm":
        raise ValueError(f"compile backend {name!r}: the only suffix is '+comm'")
    from shardwise.compile import schedule as comm_schedule

    return comm_schedule.backend(base)


# ---------------------------------------------------------------------- activation checkpointing
_CHECKPOINTED: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    """A subclass of ``cls`` whose forward runs under non-reentrant activation checkpointing.

    Swapping the instance's class (rather than wrapping it in another module) keeps every
    parameter name unchanged, so plans, FSDP and checkpoints see the same paths with or without
    checkpointing.
    """
    if cls not in _CHECKPOINTED:
        def forward(self, *args, **kwargs):
            inner = super(sub, self).forward
            return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

        sub = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
        _CHECKPOINTED[cls] = sub
    return _CHECKPOINTED[cls]


def apply_ac(model: nn.Module) -> None:
    """Recompute each transformer block's activations in backward instead of keeping them."""
    for block in model.layers.values():
        if type(block) not in _CHECKPOINTED.values():
            block.__class__ = _checkpointed_class(type(block))


# ---------------------------------------------------------------------- data parallelism
def apply_fsdp(model: nn.Module, dp_mesh, mixed_precision: bool, api: ParallelAPI | None = None) -> None:
    """Shard parameters over ``dp_mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP).

    Each block is its own unit (its parameters are gathered just before it runs and freed
    after); the root unit holds the embedding, final norm and output. The last block keeps its
    parameters after forward, since backward needs them first, and so does the root (its
    output layer runs first in backward): fully_shard's default for the root, as in torch's FSDP2.
    """
    api = api or shardwise_api()
    fully_shard, MixedPrecisionPolicy = api.fully_shard, api.MixedPrecisionPolicy
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)  # the root keeps its parameters (default)


def apply_ddp(model: nn.Module, dp_mesh, api: ParallelAPI | None = None) -> None:
    """Replicate the model over ``dp_mesh``; gradients are averaged over it after backward."""
    api = api or shardwise_api()
    if api.replicate is None:
        raise NotImplementedError("this parallel API has no replicate(): use --dp-shard for data parallelism")
    api.replicate(model, mesh=dp_mesh)
