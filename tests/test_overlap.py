"""Communication that runs ahead of its consumer: async redistribute, fully_shard's prefetch and
its delayed gradient reductions, and no host synchronization on the hot path.

The oracle is the blocking call (values and gradients equal) and single-device training; the
order of collectives and compute is recorded with a comm recorder and module hooks.
"""

import re
from pathlib import Path

import torch
import torch.nn as nn

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.fsdp import fully_shard

SRC = Path(__file__).resolve().parent.parent / "src" / "shardwise"


# ---------------------------------------------------------------------- async redistribute
def _async_redistribute():
    results = []
    for shape in [(4,), (2, 2)]:
        mesh = sw.init_device_mesh("cpu", shape)
        torch.manual_seed(0)
        full = torch.randn(8, 6)
        cases = [([Shard(0)], [Replicate()]), ([Shard(1)], [Replicate()]), ([Replicate()], [Shard(1)]),
                 ([Shard(0)], [Shard(1)]), ([Partial()], [Shard(0)]), ([Partial("avg")], [Replicate()])]
        for src, dst in cases:
            src, dst = src * mesh.ndim, dst * mesh.ndim
            if any(isinstance(p, Partial) for p in src):
                x0 = sw.DTensor.from_local(full / mesh.size() if src[0].reduce_op == "sum" else full.clone(), mesh, src)
            else:
                x0 = sw.distribute_tensor(full, mesh, src)
            outs = {}
            for async_op in (False, True):
                x = x0.detach().requires_grad_()
                y = x.redistribute(mesh, dst, async_op=async_op)
                ran_ahead = type(y._local_tensor).__name__ == "AsyncCollectiveTensor"
                z = (y * y + 1).sum()
                z.backward()
                grad = x.grad.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
                outs[async_op] = (y.full_tensor(), grad, y.placements, ran_ahead)
            same = torch.equal(outs[False][0], outs[True][0]) and torch.equal(outs[False][1], outs[True][1])
            results.append((shape, str(src), str(dst), same, outs[False][2] == outs[True][2], outs[True][3],
                            outs[False][3], torch.allclose(outs[True][0], full)))
    return results


def test_async_redistribute_equals_blocking(dist):
    for per_rank in dist.run(4, _async_redistribute):
        for shape, src, dst, same, same_layout, ran_ahead, sync_ran_ahead, exact in per_rank:
            assert same and same_layout and exact, (shape, src, dst)
            assert not sync_ran_ahead, (shape, src, dst)
        # an all_gather along dim 0 needs nothing local after it: the result is still in flight
        assert any(ran_ahead for *_, ran_ahead, _, _ in per_rank)
