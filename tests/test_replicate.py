"""replicate (DDP with DTensor): parity with single-device training and bucketed all_reduce."""

from __future__ import annotations

from torch import nn

import shardwise as sw
from shardwise import Replicate
from shardwise.debug import CommDebugMode
from shardwise.fsdp import replicate
from shardwise.parallel.data_parallel.buckets import plan_buckets
from tests import toy_net as toy


def _replicate_parity(bucket_cap_mb: float):
    mesh = sw.init_device_mesh("cpu", (4,))
    model = replicate(toy.net(), mesh=mesh, bucket_cap_mb=bucket_cap_mb)
    layouts = {(type(p).__name__, p.placements) for p in model.parameters()}
    x, y = toy.local_batch(0, mesh.get_local_rank(), 4)
    loss = nn.functional.mse_loss(model(x), y)
    with CommDebugMode() as comms:
        loss.backward()
    model.zero_grad()
    return toy.train(model, mesh.get_local_rank(), 4), layouts, comms.get_comm_counts()


def test_replicate_matches_single_device_training_with_bucketed_all_reduce(dist):
    sizes = [p.numel() * p.element_size() for p in toy.net().parameters()]
    for cap_mb in (25.0, 300 / 2**20):  # the default cap, and ~300 bytes: a few parameters per bucket
        buckets = len(plan_buckets(sizes, ["f32"] * len(sizes), int(cap_mb * 2**20)))
        assert buckets == 1 if cap_mb == 25.0 else 1 < buckets < len(sizes)
        out = dist.run(4, _replicate_parity, cap_mb)
        toy.check_parity([o[0] for o in out], lambda r: r, 4)
        for _, layouts, counts in out:
            assert layouts == {("DTensor", (Replicate(),))}
            assert counts == {"all_reduce": buckets}  # one collective per bucket, not per parameter


def test_bucket_plan_walks_parameters_backwards_and_splits_on_cap_and_dtype():
    assert plan_buckets([40, 4, 40, 4], ["f32"] * 4, cap_bytes=50) == [(3, 2, 1), (0,)]
    assert plan_buckets([8, 100, 8], ["f32"] * 3, cap_bytes=50) == [(2,), (1,), (0,)]  # too big: alone
    assert plan_buckets([4, 4, 4], ["f32", "bf16", "bf16"], cap_bytes=50) == [(2, 1), (0,)]


def _replicate_twice():
    mesh = sw.init_device_mesh("cpu", (4,))
    replicate(replicate(toy.net(), mesh=mesh), mesh=mesh)


def _replicate_on_2d_mesh():
    replicate(toy.net(), mesh=sw.init_device_mesh("cpu", (2, 2)))


def test_replicate_bad_input_raises_on_every_rank(dist):
    dist.run_expect_error(4, _replicate_twice, match=r"replicate\(Net\): the module is already managed")
    dist.run_expect_error(4, _replicate_on_2d_mesh, match=r"replicate\(Net\): replicate needs a 1-D data-parallel mesh")
