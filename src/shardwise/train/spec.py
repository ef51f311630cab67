"""Model families: what the trainer needs to know about a model, registered by name.

The trainer never names a model (docs/trainer.md, "Adding a model family"). A family is one folder under
``shardwise/train/models/`` whose ``__init__`` builds a ``ModelFamily`` and calls
``register_family``; ``get_family(name)`` finds it (``shardwise.train`` imports
``shardwise.train.models``, so the built-in families are registered first). The family holds everything
model-specific: its named configs (args of the family's own type), how to build the
single-device model, its tensor-parallel plan, where its blocks are (the units of activation
checkpointing, ``torch.compile``, FSDP and pipeline stages), which buffers run along the
sequence (context parallelism), the checks of its shapes against the parallel degrees, and its
parameter and FLOP counts. The generic steps (checkpointing -> compile -> FSDP/HSDP/DDP) stay
in ``shardwise.train.parallelize``, the same for every family.

Example:
    >>> family = get_family("llama")
    >>> args = family.config("tiny")
    >>> model = family.build(args)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise.parallel.dims import ParallelDims
from shardwise.train.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.core.mesh import DeviceMesh
    from shardwise.train.parallelize import ParallelAPI, ParallelOptions

__all__ = ["ModelFamily", "register_family", "get_family", "family_names"]

# The family's args type is its own (a frozen dataclass); the spec only passes it back to the
# family's functions, so it is typed as Any here.
Args = Any


def _same_args(args: Args, seq_len: int) -> Args:
    return args


def _no_check(args: Args, dims: ParallelDims, config: str) -> None:
    return None


def _nothing_after_step(model: nn.Module, dp_mesh: DeviceMesh | None) -> None:
    return None


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One model family: its configs and how the trainer builds, parallelizes and counts it.

    Args:
        name: the family's name (``--family``).
        configs: config name -> args (the family's own frozen dataclass), e.g. ``"debug"``.
        build: ``build(args)`` -> the single-device model. Called under ``torch.device("meta")``
            by the trainer, so it must allocate nothing else; the model must have
            ``init_weights()``, which fills every parameter and buffer after ``to_empty``
            (with ``shardwise.tensor.random.layout_independent`` for parameters, so every
            layout starts from the one-process weights).
        tensor_parallel: ``tensor_parallel(model, tp_mesh, options, api)`` applies the family's
            TP/SP plan in place with ``api``'s styles (``api.parallelize_module`` etc.). It also
            gets pipeline stages, whose missing modules are None.
        num_layers: ``num_layers(args)`` -> how many blocks the model has.
        with_layers: ``with_layers(args, n)`` -> the same shapes with ``n`` blocks
            (``shardwise.plan`` simulates one and two blocks per stage and extrapolates).
        blocks: the attribute holding the blocks, an ``nn.ModuleDict`` keyed "0", "1", ...:
            one unit each of activation checkpointing, compile and FSDP; pipeline stages are
            contiguous runs of them.
        first_stage / last_stage: top-level modules the first / last pipeline stage holds
            besides its blocks (the embedding; the final norm and output layer).
        sequence_buffers: buffer name -> its sequence dim, for buffers that run along the
            sequence (a rotary table): trimmed to the job's ``--seq-len`` and sharded with the
            inputs under context parallelism.
        check_degrees: ``check_degrees(args, dims, config)`` raises ``ConfigError`` naming the
            shape and flag that do not fit (heads not divisible by ``--tp``).
        num_params: ``num_params(args)`` -> parameter count, from the shapes.
        flops_per_token: ``flops_per_token(args, seq_len)`` -> training FLOPs per token
            (forward and backward), for the plan's compute time and MFU.
        for_seq_len: ``for_seq_len(args, seq_len)`` -> args that can run sequences of
            ``seq_len`` (a longer rotary table); default: unchanged.
        notes: config name -> what it is for (``--help`` prints it next to its size).
        default_config: the config ``--family NAME`` trains without ``--config``; default:
            ``"debug"`` if the family has one, else its first config.
        expert_parallel: ``expert_parallel(model, experts_mesh, options)`` splits the model's
            routed experts over ``experts_mesh``, whose axes are "ep" and/or "tp" (called when
            either degree is > 1; ``shardwise.parallel.expert_parallel``'s styles); None: the
            family has no experts and ``--ep`` is refused.
        after_optimizer_step: ``after_optimizer_step(model, dp_mesh)``, called by the trainer
            after every optimizer step with the data-parallel mesh (None for one process): state
            kept across the step's microbatches outside autograd (MoE load balancing).
    """

    name: str
    configs: Mapping[str, Args]
    build: Callable[[Args], nn.Module]
    tensor_parallel: Callable[[nn.Module, DeviceMesh, ParallelOptions, ParallelAPI], None]
    num_layers: Callable[[Args], int]
    with_layers: Callable[[Args, int], Args]
    num_params: Callable[[Args], int]
    flops_per_token: Callable[[Args, int], float]
    blocks: str = "layers"
    first_stage: tuple[str, ...] = ()
    last_stage: tuple[str, ...] = ()
    sequence_buffers: Mapping[str, int] = field(default_factory=dict)
    check_degrees: Callable[[Args, ParallelDims, str], None] = _no_check
    for_seq_len: Callable[[Args, int], Args] = _same_args
    notes: Mapping[str, str] = field(default_factory=dict)
    default_config: str = ""
    expert_parallel: Callable[[nn.Module, DeviceMesh, ParallelOptions], None] | None = None
    after_optimizer_step: Callable[[nn.Module, DeviceMesh | None], None] = _nothing_after_step

    def __post_init__(self) -> None:
        if not self.name or not self.configs:
            raise ValueError(f"a model family needs a name and at least one config, got {self.name!r} with "
                             f"configs {list(self.configs)}")
        if self.default_config and self.default_config not in self.configs:
            raise ValueError(f"model family {self.name!r}: default config {self.default_config!r} is not one of its "
                             f"configs {list(self.configs)}")

    @property
    def default(self) -> str:
        """The config a job of this family runs when none is named."""
        if self.default_config:
            return self.default_config
        return "debug" if "debug" in self.configs else next(iter(self.configs))

    def config(self, name: str) -> Args:
        """The named config's args, or a ``ConfigError`` listing this family's configs."""
        try:
            return self.configs[name]
        except KeyError:
            others = [f for f in family_names() if f != self.name]
            also = f" (--family {self.name}; other families: {', '.join(others)})" if others else ""
            raise ConfigError(f"unknown config {name!r}; known configs: {', '.join(self.configs)}{also}") from None

    def block_modules(self, model: nn.Module) -> list[nn.Module]:
        """The model's (or a pipeline stage's) blocks, in order."""
        return list(getattr(model, self.blocks).values())

    def stage_paths(self, args: Args, stages: int, stage: int) -> list[str]:
        """The module paths pipeline ``stage`` of ``stages`` holds: its contiguous run of blocks,
        with ``first_stage``'s modules on the first and ``last_stage``'s on the last."""
        from shardwise.parallel.pipeline_parallel.split import stage_layers

        paths = list(self.first_stage) if stage == 0 else []
        paths += [f"{self.blocks}.{i}" for i in stage_layers(self.num_layers(args), stages, stage)]
        return paths + (list(self.last_stage) if stage == stages - 1 else [])


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make ``family`` known to the trainer, the simulation and the planner under its name.

    Registering the same object twice is harmless (a module imported again); another family
    under a taken name is refused.
    """
    held = _FAMILIES.get(family.name)
    if held is not None and held is not family:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def get_family(name: str) -> ModelFamily:
    """The registered family ``name``, or a ``ConfigError`` listing the known ones."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ConfigError(f"unknown model family {name!r}; known families: {', '.join(_FAMILIES)}") from None


def family_names() -> Sequence[str]:
    """Every registered family's name, built-in ones first (``shardwise.train`` imports them)."""
    return list(_FAMILIES)
