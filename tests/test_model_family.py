"""A model family of a few lines trains under FSDP x TP (and a pipeline) to the losses of one process.

The family is registered here, in the test module (the pool workers import it with the task's
function), and the trainer's files are untouched: ``shardwise.train.spec`` is all a family needs
(docs/trainer.md, "Adding a model family"). The oracle is the trainer's own one-process run of the same
job. The pure tests check that an unknown family, config or a degree the shapes refuse is one
``ConfigError`` naming it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.parallel.dims import ParallelDims
from shardwise.tensor.random import layout_independent
from shardwise.train import ConfigError, JobConfig, ModelFamily, get_family, register_family

STEPS = 4
RTOL = 1e-5


# ---------------------------------------------------------------------- the toy family
@dataclass(frozen=True, slots=True)
class ToyArgs:
    dim: int = 32
    hidden: int = 96  # 3 x 32: odd multiples keep the shards of tp 2 uneven in the blocks' FSDP
    n_layers: int = 2
    vocab_size: int = 256


class ToyBlock(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(args.dim)
        self.up = nn.Linear(args.dim, args.hidden, bias=False)
        self.down = nn.Linear(args.hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ToyModel(nn.Module):
    """Embedding, MLP blocks, output head; a pipeline stage has some of them None."""

    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): ToyBlock(args) for i in range(args.n_layers)})
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for block in self.layers.values():
            h = block(h)
        return self.head(h) if self.head is not None else h

    def init_weights(self) -> None:
        """The same values in every layout (shardwise's layout-independent random stream)."""
        with torch.no_grad(), layout_independent():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.05)
                elif isinstance(module, nn.RMSNorm):
                    module.reset_parameters()


def toy_tensor_parallel(model: nn.Module, tp_mesh, options, api) -> None:
    """Megatron-style MLP: ``up`` column-sharded, ``down`` row-sharded; vocabulary-parallel ends."""
    root = {"embed": api.RowwiseParallel(input_layouts=api.Replicate()),
            "head": api.ColwiseParallel(output_layouts=api.Replicate())}  # whole logits for the loss
    api.parallelize_module(model, tp_mesh, {k: v for k, v in root.items() if getattr(model, k) is not None})
    for block in model.layers.values():
        api.parallelize_module(block, tp_mesh, {"up": api.ColwiseParallel(), "down": api.RowwiseParallel()})


def toy_check_degrees(args: ToyArgs, dims: ParallelDims, config: str) -> None:
    if args.hidden % dims.tp:
        raise ConfigError(f"--tp {dims.tp} must divide hidden={args.hidden} of toy config {config!r}")


TOY = register_family(ModelFamily(
    name="toy", configs={"tiny": ToyArgs()}, build=ToyModel, tensor_parallel=toy_tensor_parallel,
    num_layers=lambda a: a.n_layers, with_layers=lambda a, n: replace(a, n_layers=n),
    num_params=lambda a: 2 * a.vocab_size * a.dim + a.n_layers * (2 * a.dim * a.hidden + a.dim),
    flops_per_token=lambda a, seq_len: 6 * (2 * a.vocab_size * a.dim + a.n_layers * 2 * a.dim * a.hidden),
    first_stage=("embed",), last_stage=("head",), check_degrees=toy_check_degrees,
))


# ---------------------------------------------------------------------- parity
def _job(nproc: int = 1, **degrees: int) -> JobConfig:
    return JobConfig(family="toy", config="tiny", nproc=nproc, steps=STEPS, global_batch=8, seq_len=32, lr=3e-3,
                     warmup=1, seed=3, log_every=1000, device="cpu", **degrees).validate()


def _losses(nproc: int, degrees: dict[str, int]) -> list[float]:
    """On every rank of a pool (or alone): train the toy job; the globally averaged losses."""
    from shardwise.train.trainer import Runtime, train

    job = _job(nproc, **degrees)
    return train(job, Runtime.create(job)).losses


@functools.cache
def _one_process() -> tuple[float, ...]:
    return tuple(_losses(1, {}))


@pytest.mark.parametrize("degrees", [dict(dp_shard=2, tp=2), dict(pp=2, dp_shard=2)], ids=["fsdp_tp", "pp_fsdp"])
def test_registered_family_trains_to_the_one_process_losses(dist, degrees):
    want = _one_process()
    per_rank = dist.run(4, _losses, 4, degrees, timeout=240)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the global loss"
    got = per_rank[0]
    assert len(got) == len(want) == STEPS
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst < RTOL, f"{degrees}: losses {got} differ from one process {want} (max rel {worst:.2e})"
    assert want[-1] < want[0], "the one-process run does not learn"


def test_parameter_count_and_stage_paths_follow_the_shapes():
    model = TOY.build(ToyArgs())
    assert sum(p.numel() for p in model.parameters()) == TOY.num_params(ToyArgs())
    assert TOY.stage_paths(ToyArgs(n_layers=4), 2, 1) == ["layers.2", "layers.3", "head"]


# ---------------------------------------------------------------------- refusals (pure)
def test_unknown_family_config_or_degree_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"unknown model family 'gpt5'; known families: llama, .*toy"):
        JobConfig(family="gpt5").validate()
    with pytest.raises(ConfigError, match=r"unknown config 'debug'; known configs: tiny \(--family toy; other "
                                          r"families: llama"):
        JobConfig(family="toy", config="debug").validate()
    with pytest.raises(ConfigError, match=r"--tp 5 must divide hidden=96 of toy config 'tiny'"):
        JobConfig(family="toy", config="tiny", nproc=5, tp=5, global_batch=5).validate()
    assert get_family("toy") is TOY


def test_a_taken_family_name_is_refused():
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register_family(replace(TOY, configs={"other": ToyArgs()}))
    assert register_family(TOY) is TOY  # the same family again (a module imported twice) is harmless
