"""Meta-device models: build on meta, shard, ``to_empty``, initialize; equal to one device.

No rank allocates a whole tensor: meta tensors stay meta through ``distribute_tensor``, the
factories, ``distribute_module``, ``parallelize_module``, ``fully_shard`` and ``replicate``;
``to_empty`` gives each rank storage for its blocks in the same layout (Partial buffers
included), and ``init_weights`` fills them with layout-independent random numbers, so the
gathered parameters equal the single-device model's after the same seed. The trainer builds
its model this way; its first losses equal a one-process run of the model built whole.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.train import cli

LAYOUTS = {"fsdp": {"dp_shard": 4}, "tp": {"tp": 4}, "fsdp+tp": {"dp_shard": 2, "tp": 2}}


def _single_device(args, seed: int) -> dict[str, torch.Tensor]:
    from shardwise import random as sw_random
    from shardwise.train.model import Transformer

    sw_random.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Transformer(args).state_dict().items()}


def _model_equals_single_device(seed: int) -> dict:
    """Every layout, built on meta then initialized, against the model built whole on this rank."""
    from shardwise import random as sw_random
    from shardwise.dtensor import DTensor
    from shardwise.parallel.parallel_dims import ParallelDims
    from shardwise.train.config import CONFIGS
    from shardwise.train.parallelize import ParallelOptions, build_llama

    args = CONFIGS["tiny"]
    want = _single_device(args, seed)
    out = {}
    for name, degrees in LAYOUTS.items():
        dims = ParallelDims(world_size=4, **{"dp_shard": 1, **degrees})
        mesh = dims.build_mesh()
        sw_random.manual_seed(seed)
        meta = build_llama(args, dims, mesh, ParallelOptions(), "cpu", materialize=False)
        # Meta: every block is a meta tensor of the block's shape; nothing was allocated.
        blocks_meta = all(
            p._local_tensor.is_meta and tuple(p._local_tensor.shape) == p._spec.local_shape()
            for p in meta.parameters() if isinstance(p, DTensor)
        )
        sw_random.manual_seed(seed)
        model = build_llama(args, dims, mesh, ParallelOptions(), "cpu")
        got = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
        sharded = [k for k, v in model.state_dict().items() if isinstance(v, DTensor) and len(v.placements) > 0
                   and any(not p.is_replicate() for p in v.placements)]
        out[name] = {
            "blocks_meta": blocks_meta,
            "unequal": [k for k in want if not torch.equal(got[k], want[k])],
            "keys": sorted(got) == sorted(want),
            "sharded": len(sharded),
            "cpu": all(p.device.type == "cpu" for p in model.parameters()),
        }
    return out


def test_meta_built_model_equals_single_device_model_for_fsdp_tp_and_both(dist):
    results = dist.run(4, _model_equals_single_device, 11, timeout=180)
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            assert r["blocks_meta"], f"rank {rank} {layout}: a parameter block was allocated before to_empty"
            assert r["keys"] and r["cpu"], (rank, layout, r)
            assert r["sharded"] > 0, f"{layout}: nothing was sharded"
            assert not r["unequal"], f"rank {rank} {layout}: {r['unequal']} differ from the single-device model"
