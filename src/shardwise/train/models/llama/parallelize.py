"""Llama's tensor-parallel plan: which linear layers are column- or row-sharded, where SP applies.

The family hands ``apply_tp`` to the trainer (``ModelFamily.tensor_parallel``); the generic
steps after it (activation checkpointing -> compile -> FSDP/HSDP/DDP) are
``shardwise.train.parallelize``'s. ``parallelize_llama`` and ``build_llama`` run the whole
sequence for this family (benchmarks and tests build the trainer's model with them).
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.parallel.dims import ParallelDims
from shardwise.train.models.llama.args import ModelArgs
from shardwise.train.parallelize import (ParallelAPI, ParallelOptions, build_parallel_model, parallelize,
                                         shardwise_api)

__all__ = ["tp_plans", "apply_tp", "parallelize_llama", "build_llama"]


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


def apply_tp(model: nn.Module, tp_mesh, options: ParallelOptions, api: ParallelAPI) -> None:
    """Shard the model (or a pipeline stage of it) over the 1-D ``tp_mesh`` with ``tp_plans``."""
    root, block = tp_plans(options.sequence_parallel, options.loss_parallel, api)
    root = {path: style for path, style in root.items() if getattr(model, path, None) is not None}  # pipeline stage
    api.parallelize_module(model, tp_mesh, root)
    for layer in model.layers.values():
        api.parallelize_module(layer, tp_mesh, block)


def parallelize_llama(model: nn.Module, dims: ParallelDims, world_mesh, options: ParallelOptions,
                      api: ParallelAPI | None = None) -> nn.Module:
    """``shardwise.train.parallelize.parallelize`` for this family (TP/SP, checkpointing,
    compile, FSDP/HSDP/DDP), with ``api``'s library (default shardwise's)."""
    from shardwise.train.spec import get_family

    return parallelize(model, get_family("llama"), dims, world_mesh, options, api)


def build_llama(args: ModelArgs, dims: ParallelDims, world_mesh, options: ParallelOptions,
                device: torch.device | str, *, materialize: bool = True) -> nn.Module:
    """``shardwise.train.parallelize.build_parallel_model`` for this family: a parallelized
    ``Transformer`` no rank ever held whole, with the weights of the one-device model after the
    same seed.

    Example:
        >>> shardwise.tensor.random.manual_seed(0)
        >>> model = build_llama(CONFIGS["debug"], dims, dims.build_mesh(), ParallelOptions(), "cpu")
    """
    from shardwise.train.spec import get_family

    return build_parallel_model(get_family("llama"), args, dims, world_mesh, options, device,
                                materialize=materialize)
