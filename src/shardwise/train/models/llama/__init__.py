"""The Llama family: a Llama-style decoder (``model.py``), its shapes and named configs
(``args.py``), its tensor-parallel plan (``parallelize.py``), registered here as ``"llama"``.

Example:
    >>> from shardwise.train.models.llama import CONFIGS, Transformer
    >>> model = Transformer(CONFIGS["tiny"])
"""

from __future__ import annotations

from shardwise.train.models.llama.args import (CONFIG_NOTES, CONFIGS, ModelArgs, check_degrees, flops_per_token,
                                               for_seq_len)
from shardwise.train.models.llama.model import Transformer
from shardwise.train.models.llama.parallelize import apply_tp, build_llama, parallelize_llama, tp_plans
from shardwise.train.spec import ModelFamily, register_family

__all__ = ["LLAMA", "CONFIGS", "CONFIG_NOTES", "ModelArgs", "Transformer", "tp_plans", "parallelize_llama",
           "build_llama"]


def _with_layers(args: ModelArgs, n_layers: int) -> ModelArgs:
    from dataclasses import replace

    return replace(args, n_layers=n_layers)


LLAMA = register_family(ModelFamily(
    name="llama",
    configs=CONFIGS,
    notes=CONFIG_NOTES,
    build=Transformer,
    tensor_parallel=apply_tp,
    num_layers=lambda args: args.n_layers,
    with_layers=_with_layers,
    num_params=lambda args: args.num_params(),
    flops_per_token=flops_per_token,
    blocks="layers",
    first_stage=("tok_embeddings",),
    last_stage=("norm", "output"),
    sequence_buffers={"rotary": 0},  # [max_seq_len, head_dim / 2, 2]: positions along dim 0
    check_degrees=check_degrees,
    for_seq_len=for_seq_len,
))
