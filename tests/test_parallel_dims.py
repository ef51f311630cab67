"""ParallelDims: validation (pure) and the meshes it builds (on gloo)."""

import pytest
import torch.distributed as dist

from shardwise.parallel import ParallelDims


def test_dp_shard_is_inferred_and_flags_follow():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
    assert dims.dp_shard == 2 and dims.dp_degree == 4
    assert dims.dp_enabled and dims.fsdp_enabled and dims.hsdp_enabled and dims.tp_enabled
    assert not (dims.cp_enabled or dims.pp_enabled or dims.ep_enabled)
    assert dims.mesh_axes() == [("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)]
    assert dims.flattened_axes() == {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard",), "dp_cp": ("dp_replicate", "dp_shard")}


@pytest.mark.parametrize("kwargs,match", [
    (dict(dp_replicate=2, dp_shard=2, tp=3, world_size=8), r"= 12 must equal world_size 8 \(dp_replicate=2, dp_shard=2, cp=1, tp=3"),
    (dict(dp_shard=-1, tp=3, world_size=8), r"cannot infer dp_shard: world_size 8 is not divisible by dp_replicate\*cp\*tp\*pp = 3"),
    (dict(dp_shard=0, world_size=8), r"dp_shard must be -1 or an integer >= 1"),
    (dict(tp=0, world_size=8), r"parallel degrees must be integers >= 1"),
    (dict(dp_shard=2, ep=4, world_size=2), r"ep=4 must divide dp_shard\*cp = 2"),
])
def test_validation_errors_print_every_degree(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_single_rank_has_one_trivial_axis():
    dims = ParallelDims(world_size=1)
    assert dims.mesh_axes() == [("dp_shard", 1)] and not dims.dp_enabled


def _build(kwargs):
    dims = ParallelDims(**kwargs, world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    out = {"world": (mesh.mesh_dim_names, mesh.shape)}
    for name in dims.flattened_axes():
        out[name] = mesh[name].mesh.tolist()
    return out


def test_build_mesh_with_flattened_axes(dist):
    out = dist.run(8, _build, dict(dp_replicate=2, dp_shard=2, tp=2))
    assert out[0]["world"] == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2))
    assert out[0]["dp"] == [0, 2, 4, 6] and out[1]["dp"] == [1, 3, 5, 7]
    assert out[0]["dp_shard_cp"] == [0, 2] and out[5]["dp_shard_cp"] == [5, 7]
    assert out[3]["dp_cp"] == [1, 3, 5, 7]
    fsdp = dist.run(4, _build, dict(dp_shard=-1))
    assert fsdp[2] == {"world": (("dp_shard",), (4,)), "dp": [0, 1, 2, 3], "dp_shard_cp": [0, 1, 2, 3], "dp_cp": [0, 1, 2, 3]}
