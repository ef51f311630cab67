"""The mixture-of-experts family: a Llama-style decoder whose feed-forward is a routed MoE layer
(``model.py``), its shapes and named configs (``args.py``), its tensor- and expert-parallel
plans and load-balancing update (``parallelize.py``), registered here as ``"moe"``.

Example:
    >>> from shardwise.train.models.moe import CONFIGS, MoETransformer
    >>> model = MoETransformer(CONFIGS["debug_moe"])
"""

from __future__ import annotations

from dataclasses import replace

from shardwise.train.models.moe.args import (CONFIG_NOTES, CONFIGS, MoEArgs, MoEModelArgs, ScoreFunc, check_degrees,
                                             flops_per_token, for_seq_len)
from shardwise.train.models.moe.model import MoE, MoETransformer
from shardwise.train.models.moe.parallelize import apply_ep, apply_tp, update_expert_bias
from shardwise.train.spec import ModelFamily, register_family

__all__ = ["MOE", "CONFIGS", "CONFIG_NOTES", "MoEArgs", "MoEModelArgs", "ScoreFunc", "MoE", "MoETransformer"]


MOE = register_family(ModelFamily(
    name="moe",
    default_config="debug_moe",
    configs=CONFIGS,
    notes=CONFIG_NOTES,
    build=MoETransformer,
    tensor_parallel=apply_tp,
    expert_parallel=apply_ep,
    after_optimizer_step=update_expert_bias,
    num_layers=lambda args: args.n_layers,
    with_layers=lambda args, n: replace(args, n_layers=n, n_dense_layers=min(args.n_dense_layers, n)),
    num_params=lambda args: args.num_params(),
    flops_per_token=flops_per_token,
    blocks="layers",
    first_stage=("tok_embeddings",),
    last_stage=("norm", "output"),
    sequence_buffers={"rotary": 0},
    check_degrees=check_degrees,
    for_seq_len=for_seq_len,
))
