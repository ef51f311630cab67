"""Apply parallelism to a family's single-device model, from outside, in a fixed order.

1. Tensor (and sequence) parallelism over the "tp" mesh axis: the family's own plan
   (``ModelFamily.tensor_parallel``, e.g. ``shardwise.train.models.llama.parallelize``), plan
   dicts keyed by module path. Parameters become DTensors sharded over tp.
   Expert parallelism over the "ep" axis (``ModelFamily.expert_parallel``): the routed
   experts' weights become DTensors sharded over the experts, tokens travel to them by
   all_to_all; with tp each expert is also split over "tp" (docs/parallelism.md, "Mixture of experts and expert parallelism").
2. Activation checkpointing per block (``ModelFamily.blocks``: recompute its activations in
   backward), then, with ``--compile``, ``torch.compile`` per block.
3. Data parallelism over the dp axes, chosen from the degrees as torchtitan does:
   dp_shard > 1 -> FSDP (``fully_shard`` per block, then the root), on a (dp_replicate,
   dp_shard) mesh when dp_replicate > 1 too (HSDP); dp_replicate only -> ``replicate`` (DDP).
   With context parallelism (cp > 1) FSDP shards over the flattened ``dp_shard_cp`` axis: the cp
   ranks hold the same parameters and their gradients (each from its part of the sequences)
   are averaged over it with the data-parallel ones. The model code is unchanged: the trainer
   runs each step inside ``context_parallel`` (inputs, labels and the family's sequence buffers
   sharded along the sequence, attention as ring attention over the cp axis).
   Expert-parallel modules are their own FSDP units, sharded over ``dp_shard_mod_ep`` (the
   ranks that hold the same experts; with dp_replicate as HSDP) and their gradients divided by
   every data-parallel rank (``expert_fsdp``).

The order matters: FSDP shards whatever parameters it finds, so it must come after TP has
turned them into tp-sharded DTensors (FSDP then adds its own axis), and after checkpointing
has wrapped the blocks FSDP will treat as units.

``build_parallel_model`` builds the model on the meta device (shapes only), parallelizes it,
then gives each rank storage for its own blocks (``to_empty``) and initializes them
(``init_weights``, layout-independent random numbers): no rank ever holds more than its shards,
and every layout starts from the weights of the single-device run with the same seed.
``build_stages`` does the same for this rank's pipeline stages. Nothing here names a model:
families are described in docs/trainer.md, "Adding a model family".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

from shardwise.parallel.dims import ParallelDims
from shardwise.train.spec import Args, ModelFamily

__all__ = ["ParallelAPI", "shardwise_api", "ParallelOptions", "parallelize", "build_parallel_model", "RankStages",
           "build_stages", "fsdp_applies_mixed_precision", "apply_ac", "apply_compile", "compile_backend",
           "apply_fsdp", "apply_ddp", "ExpertFSDP", "expert_fsdp"]


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
    PrepareModuleInputOutput: type | None = None  # a family's module boundaries (the MoE layer under TP)

    @classmethod
    def from_namespaces(cls, parallel: Any, placements: Any, fsdp: Any, replicate: Callable | None) -> "ParallelAPI":
        """Collect the names from a parallel-styles module, a placements module and an FSDP module."""
        return cls(parallel.parallelize_module, parallel.ColwiseParallel, parallel.RowwiseParallel,
                   parallel.SequenceParallel, parallel.PrepareModuleInput, placements.Shard, placements.Replicate,
                   fsdp.fully_shard, fsdp.MixedPrecisionPolicy, parallel.loss_parallel, replicate,
                   getattr(parallel, "PrepareModuleInputOutput", None))


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


def parallelize(model: nn.Module, family: ModelFamily, dims: ParallelDims, world_mesh, options: ParallelOptions,
                api: ParallelAPI | None = None) -> nn.Module:
    """Apply the family's TP/SP plan, then activation checkpointing, compile, FSDP/HSDP or DDP, in place.

    Args:
        model: the family's model (or a pipeline stage of it), on meta or initialized.
        family: whose plan and blocks.
        dims: the job's degrees.
        world_mesh: ``dims.build_mesh(...)`` (None when the world is one rank); a mesh with the
            same axis names from ``api``'s library.
        options: sequence/loss parallel, checkpointing, mixed precision, compile.
        api: whose parallel APIs apply the plan (default shardwise's).

    Returns:
        The same module, parallelized.

    Example:
        >>> dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
        >>> parallelize(family.build(args), family, dims, dims.build_mesh(), ParallelOptions(sequence_parallel=True))
    """
    needs_api = dims.tp_enabled or dims.dp_enabled or dims.cp_enabled
    api = api or (shardwise_api() if needs_api else None)
    if dims.tp_enabled:
        assert api is not None
        family.tensor_parallel(model, world_mesh["tp"], options, api)
    if dims.ep_enabled and family.expert_parallel is None:
        raise ValueError(f"model family {family.name!r} has no experts to shard over ep={dims.ep}")
    if family.expert_parallel is not None and (dims.ep_enabled or dims.tp_enabled):
        axes = tuple(a for a, on in (("ep", dims.ep_enabled), ("tp", dims.tp_enabled)) if on)
        family.expert_parallel(model, world_mesh[axes], options)
    blocks = family.block_modules(model)
    if options.activation_checkpointing:
        apply_ac(blocks)
    if options.compile_backend is not None:
        apply_compile(blocks, options.compile_backend)
    if dims.fsdp_enabled:
        shard = "dp_shard_cp" if dims.cp_enabled else "dp_shard"
        axes = ("dp_replicate", shard) if dims.dp_replicate_enabled else shard
        apply_fsdp(model, blocks, world_mesh[axes], options.mixed_precision, api,
                   experts=expert_fsdp(dims, world_mesh) if dims.ep_enabled else None)
    elif dims.dp_replicate_enabled:
        apply_ddp(model, world_mesh["dp_replicate"], api)
    return model


def build_parallel_model(family: ModelFamily, args: Args, dims: ParallelDims, world_mesh, options: ParallelOptions,
                         device: torch.device | str, *, materialize: bool = True) -> nn.Module:
    """A parallelized model that no rank ever held whole: meta -> parallelize -> to_empty -> init.

    Seed first (``shardwise.tensor.random.manual_seed``, the same on every rank): the parameters then
    equal those of ``family.build(args)`` built on one device after the same seed.

    Args:
        family, args: the model and its shapes.
        dims, world_mesh, options: as for ``parallelize``.
        device: where each rank's blocks live (the mesh's device type).
        materialize: False stops after parallelizing: every parameter is a meta tensor (or a
            DTensor of meta blocks) of its final layout, nothing allocated.

    Example:
        >>> shardwise.tensor.random.manual_seed(0)
        >>> model = build_parallel_model(family, family.config("debug"), dims, dims.build_mesh(), ParallelOptions(), "cpu")
    """
    with torch.device("meta"):
        model = family.build(args)
    parallelize(model, family, dims, world_mesh, options)
    if materialize:
        model.to_empty(device=device)
        model.init_weights()
    return model


@dataclass
class RankStages:
    """What one pipeline rank holds of the model: its stages and their modules together.

    ``stages`` are the stage modules (``split_stage`` of one whole model) by increasing stage
    index; ``model`` holds all of this rank's modules under the whole model's paths (one
    module for the optimizer, gradient clipping and checkpoints). They share their modules.
    """

    stages: list[nn.Module]
    indices: list[int]
    num_stages: int
    model: nn.Module
    param_names: list[str]  # every parameter of the whole model, in its order (all stages)


def build_stages(family: ModelFamily, args: Args, dims: ParallelDims, world_mesh, options: ParallelOptions,
                 device: torch.device | str, schedule: str, *, materialize: bool = True) -> RankStages:
    """This pipeline rank's stages, each parallelized on its slice of the mesh, with the
    parameters of ``family.build(args)`` built whole on one device after the same seed.

    The whole model is built on meta; each stage keeps its modules (``family.stage_paths``) and
    is parallelized as ``parallelize`` does for the whole model; only the stages' modules
    get storage. ``init_weights`` then runs on the whole model, where the other stages' meta
    modules consume their random numbers without drawing (``meta_fills_advance``), so every
    parameter gets the value it has on one device. The whole model's own buffers (a rotary
    table) are then shared by every stage: one tensor, sharded once under context parallelism.
    ``materialize=False`` stops after parallelizing (meta blocks, nothing allocated: a simulation).
    """
    from shardwise.parallel.pipeline_parallel.pipeline import split_stage
    from shardwise.parallel.pipeline_parallel.split import num_stages, stages_of_rank
    from shardwise.tensor.random import meta_fills_advance

    with torch.device("meta"):
        whole = family.build(args)
    total = num_stages(dims.pp, schedule)
    indices = stages_of_rank(world_mesh["pp"].get_local_rank(), dims.pp, schedule)
    paths = [family.stage_paths(args, total, i) for i in indices]
    stages = [split_stage(whole, p) for p in paths]
    for stage in stages:
        parallelize(stage, family, dims, world_mesh, options)
        if materialize:
            stage.to_empty(device=device)
    if materialize:
        for name, buffer in whole.named_buffers(recurse=False):
            _set_buffer(whole, name, torch.empty_like(buffer, device=device))
        with meta_fills_advance():
            whole.init_weights()
    rank_model = split_stage(whole, [p for per_stage in paths for p in per_stage])
    for module in (*stages, rank_model):
        for name, buffer in whole.named_buffers(recurse=False):
            _set_buffer(module, name, buffer)
    names = [name for name, _ in whole.named_parameters()]
    return RankStages(stages, indices, total, rank_model, names)


def _set_buffer(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` as ``module``'s buffer ``name``, saved in state dicts as before."""
    module.register_buffer(name, tensor, persistent=name not in module._non_persistent_buffers_set)


def fsdp_applies_mixed_precision(dims: ParallelDims) -> bool:
    """Whether FSDP casts parameters for this layout (else the trainer autocasts the forward)."""
    return dims.fsdp_enabled


# ---------------------------------------------------------------------- compilation
def apply_compile(blocks: Iterable[nn.Module], backend: str) -> None:
    """``torch.compile`` every block in place, after TP and checkpointing, before
    data parallelism (as torchtitan orders them): each block's ops, layout decisions and TP
    collectives become one graph; FSDP's and DDP's hooks run eagerly at its boundaries.
    Shapes are static (``dynamic=False``): layouts are decided per shape at trace time."""
    for block in blocks:
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


def apply_ac(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in backward instead of keeping them."""
    for block in blocks:
        if type(block) not in _CHECKPOINTED.values():
            block.__class__ = _checkpointed_class(type(block))


# ---------------------------------------------------------------------- data parallelism
@dataclass(frozen=True)
class ExpertFSDP:
    """How FSDP treats expert-parallel modules: the mesh of the ranks holding the same experts,
    and what their summed gradients are divided by."""

    mesh: Any
    divide_factor: int


def expert_fsdp(dims: ParallelDims, world_mesh) -> ExpertFSDP:
    """Experts are sharded over ``dp_shard_mod_ep`` (HSDP with dp_replicate). An expert's
    gradient on its owner already sums the tokens of its ep peers (the all_to_all's backward
    brings them), so it is divided by all dp_replicate x dp_shard x cp ranks: the mean over the
    global batch, as dense gradients get by averaging."""
    axes = ("dp_replicate", "dp_shard_mod_ep") if dims.dp_replicate_enabled else "dp_shard_mod_ep"
    return ExpertFSDP(world_mesh[axes], dims.dp_replicate * dims.dp_shard * dims.cp)


def _expert_modules(block: nn.Module) -> list[nn.Module]:
    """Modules of ``block`` holding parameters sharded over an "ep" mesh axis."""
    def on_ep(param: torch.Tensor) -> bool:
        mesh = getattr(param, "device_mesh", None)
        return mesh is not None and "ep" in (mesh.mesh_dim_names or ())

    return [m for m in block.modules() if any(on_ep(p) for p in m.parameters(recurse=False))]


def apply_fsdp(model: nn.Module, blocks: Sequence[nn.Module], dp_mesh, mixed_precision: bool,
               api: ParallelAPI | None = None, experts: ExpertFSDP | None = None) -> None:
    """Shard parameters over ``dp_mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP).

    Each block is its own unit (its parameters are gathered just before it runs and freed
    after); the root unit holds the rest (an embedding, final norm and output layer). The last
    block keeps its parameters after forward, since backward needs them first, and so does the
    root (its output layer runs first in backward): fully_shard's default for the root, as in torch's FSDP2.
    With ``experts``, each expert-parallel module of a block is a unit of its own first, on
    ``experts.mesh``, its gradients divided by ``experts.divide_factor``.
    """
    api = api or shardwise_api()
    fully_shard, MixedPrecisionPolicy = api.fully_shard, api.MixedPrecisionPolicy
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    for i, block in enumerate(blocks):
        for module in _expert_modules(block) if experts is not None else []:
            assert experts is not None
            fully_shard(module, mesh=experts.mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
            module.set_gradient_divide_factor(experts.divide_factor)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)  # the root keeps its parameters (default)


def apply_ddp(model: nn.Module, dp_mesh, api: ParallelAPI | None = None) -> None:
    """Replicate the model over ``dp_mesh``; gradients are averaged over it after backward."""
    api = api or shardwise_api()
    if api.replicate is None:
        raise NotImplementedError("this parallel API has no replicate(): use --dp-shard for data parallelism")
    api.replicate(model, mesh=dp_mesh)
