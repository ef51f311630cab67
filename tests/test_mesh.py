"""DeviceMesh on real gloo process groups: sub-meshes, flattening, groups, errors."""

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.core.mesh import group_cached, num_cached_groups


def _seed_2d_example():
    mesh = sw.init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    return (
        mesh["tp"].mesh.tolist(), mesh["dp"].mesh.tolist(), mesh.get_coordinate(),
        mesh["tp"].get_local_rank(), mesh["dp"].size(), mesh.shape, mesh.ndim, mesh.mesh.tolist(),
    )


def test_every_rank_sees_the_sub_mesh_that_contains_it(dist):
    out = dist.run(8, _seed_2d_example)
    for rank, (tp, dp, coord, tp_rank, dp_size, shape, ndim, grid) in enumerate(out):
        assert tp == ([0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7])
        assert dp == [rank % 4, rank % 4 + 4]
        assert coord == (rank // 4, rank % 4) and tp_rank == rank % 4 and dp_size == 2
        assert shape == (2, 4) and ndim == 2 and grid == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _sub_mesh_order():
    mesh = sw.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "cp"))
    a, b = mesh["dp", "cp"], mesh["cp", "dp"]
    return a.mesh.tolist(), a.mesh_dim_names, b.mesh.tolist(), b.mesh_dim_names


def test_sub_mesh_by_tuple_keeps_the_given_order(dist):
    out = dist.run(8, _sub_mesh_order)
    # rank 0: pp coordinate 0 -> ranks {0,1,4,5}; dp is the slow axis of the root.
    assert out[0] == ([[0, 1], [4, 5]], ("dp", "cp"), [[0, 4], [1, 5]], ("cp", "dp"))
    assert out[2][0] == [[2, 3], [6, 7]]


def _flatten_and_groups():
    mesh = sw.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    # Earlier tests in this pool may have asked for the same groups (the cache is per process).
    dp_groups = [(0, 2, 4, 6), (1, 3, 5, 7)]
    missing = sum(not group_cached(ranks) for ranks in dp_groups)
    before = num_cached_groups()
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    after_first = num_cached_groups()
    again = mesh["dp_replicate", "dp_shard"].flatten("dp")
    same_sub = mesh["tp"], mesh["tp"]
    after_second = num_cached_groups()
    total = torch.ones(1)
    dist.all_reduce(total, group=mesh["dp"].get_group())
    tp_sum = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(tp_sum, group=mesh.get_group("tp"))
    return (
        dp.mesh.tolist(), mesh["dp"].mesh.tolist(), dp.size(), dp.get_local_rank(), dp == again,
        after_first - before - missing, after_second - after_first, same_sub[0] == same_sub[1],
        total.item(), tp_sum.item(), mesh["dp", "tp"].shape,
    )


def test_flatten_registers_a_named_axis_and_groups_are_cached(dist):
    out = dist.run(8, _flatten_and_groups)
    for rank, (dp, dp_again, size, local, same, new1, new2, same_sub, total, tp_sum, shape) in enumerate(out):
        assert dp == dp_again == [rank % 2, rank % 2 + 2, rank % 2 + 4, rank % 2 + 6]
        assert size == 4 and local == rank // 2 and same
        assert new1 == 0  # the two flattened "dp" groups, created once (unless cached already)
        assert new2 == 0  # flattening again and re-slicing create nothing
        assert same_sub and total == 4.0
        assert tp_sum == (rank - rank % 2) * 2 + 1  # ranks {2k, 2k+1}
        assert shape == (4, 2)


def _bad_world_size():
    sw.init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))


def _duplicate_names():
    sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp"))


def _unknown_name():
    sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["pp"]


def _rank_outside_world():
    sw.DeviceMesh("cpu", [[0, 1], [2, 9]])


def _repeated_rank():
    sw.DeviceMesh("cpu", [0, 1, 1, 2])


def test_bad_meshes_raise_the_same_clear_error_on_every_rank(dist):
    dist.run_expect_error(4, _bad_world_size, match=r"mesh_shape \(3, 2\) has 6 ranks but the world size is 4")
    dist.run_expect_error(4, _duplicate_names, match=r"duplicate names")
    dist.run_expect_error(4, _unknown_name, match=r"no axis named 'pp'.*known axes: \['dp', 'tp'\]")
    dist.run_expect_error(4, _rank_outside_world, match=r"ranks \[9\] outside world size 4")
    dist.run_expect_error(4, _repeated_rank, match=r"lists a rank twice")


def _subset_mesh():
    mesh = sw.DeviceMesh("cpu", [0, 1], mesh_dim_names=("x",))
    coordinate = mesh.get_coordinate()
    dt = sw.distribute_tensor(torch.arange(4.0), mesh, [sw.Shard(0)])
    return coordinate, dt.to_local().tolist()


def test_mesh_over_a_subset_of_ranks(dist):
    out = dist.run(4, _subset_mesh)
    assert out == [((0,), [0.0, 1.0]), ((1,), [2.0, 3.0]), (None, []), (None, [])]


def _flatten_non_contiguous():
    mesh = sw.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "cp"))
    flat = mesh["cp", "dp"].flatten("cp_dp")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=flat.get_group())
    return flat.mesh.tolist(), mesh["cp_dp"].mesh.tolist(), value.item()


def test_flatten_of_non_contiguous_axes_in_any_order(dist):
    out = dist.run(8, _flatten_non_contiguous)
    # rank 0: pp = 0 -> ranks {0, 1, 4, 5}, walked with cp as the slow axis.
    assert out[0][0] == out[0][1] == [0, 4, 1, 5] and out[0][2] == 10.0
    assert out[3][0] == [2, 6, 3, 7] and out[3][2] == 18.0


def _submesh_keeps_its_root():
    a = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    first = sw.distribute_tensor(torch.randn(4, 4), a["tp"], [sw.Shard(0)]) * 2
    b = sw.init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("x", "dp", "tp"))
    second = sw.distribute_tensor(torch.randn(4, 4), b["tp"], [sw.Shard(0)]) * 2  # same op, same layout
    return first.device_mesh._root is a, second.device_mesh._root is b, a["tp"] == b["tp"]


def test_cached_dispatch_keeps_the_submesh_of_its_own_root(dist):
    """Sub-meshes of different roots are different meshes: a cached spec never swaps them."""
    assert dist.run(4, _submesh_keeps_its_root) == [(True, True, False)] * 4
