"""DTensor creation and conversion on real gloo groups, checked against single-process values."""

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode


def _mesh22():
    return sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _distribute_from_source():
    mesh = _mesh22()
    mine = torch.full((5, 3), float(dist.get_rank()))  # only rank 0's values may survive
    mine[0, 0] = 100.0 + dist.get_rank()
    out = {}
    for placements in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Replicate(), Replicate()], [Partial(), Shard(1)]):
        with CommDebugMode() as comms:
            dt = sw.distribute_tensor(mine, mesh, placements)
        out[str(placements)] = (dt.full_tensor(), comms.get_comm_counts())
    with CommDebugMode() as none:
        local_only = sw.distribute_tensor(mine, mesh, [Shard(0), Replicate()], src_data_rank=None)
    return out, none.get_total_counts(), local_only.to_local()


def test_distribute_tensor_sends_the_source_data(dist):
    out = dist.run(4, _distribute_from_source)
    want = torch.zeros(5, 3)
    want[0, 0] = 100.0
    for rank, (results, no_comms, local_only) in enumerate(out):
        for placements, (full, counts) in results.items():
            assert torch.equal(full, want), (rank, placements)
            assert set(counts) <= {"scatter", "broadcast"}, counts
        assert no_comms == 0
        own = torch.full((5, 3), float(rank))
        own[0, 0] = 100.0 + rank
        assert torch.equal(local_only, own[:3] if rank < 2 else own[3:])  # its own data, cut locally


def _attributes():
    mesh = _mesh22()
    x = torch.arange(30.0).reshape(5, 6).requires_grad_()
    dt = sw.distribute_tensor(x, mesh, [Shard(0), Shard(-1)])
    return (
        dt.shape, dt.stride(), dt.dtype, dt.device, dt.requires_grad, dt.is_leaf, dt.placements,
        tuple(dt.to_local().shape), repr(dt), dt.ndim, dt.numel(), dt.device_mesh == mesh,
    )


def test_dtensor_looks_like_the_global_tensor(dist):
    out = dist.run(4, _attributes)
    for rank, (shape, stride, dtype, device, rg, leaf, placements, local, text, ndim, numel, same) in enumerate(out):
        assert shape == torch.Size([5, 6]) and stride == (6, 1) and dtype == torch.float32
        assert device == torch.device("cpu") and rg and leaf and same and ndim == 2 and numel == 30
        assert placements == (Shard(0), Shard(1))
        assert local == ((3, 3), (3, 3), (2, 3), (2, 3))[rank]
        assert "f32[5@dp,6@tp]" in text and "mesh(dp=2, tp=2)" in text and f"local_shape={list(local)}" in text


def _from_local_cases():
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    block = torch.arange(6.0).reshape(2, 3) + 10 * rank
    even = DTensor.from_local(block, mesh, [Shard(0)])
    same_storage = even.to_local().data_ptr() == block.data_ptr()
    uneven_local = torch.ones(2 if rank < 2 else (1 if rank == 2 else 0), 3)  # 5 rows: 2,2,1,0
    given = DTensor.from_local(uneven_local, mesh, [Shard(0)], shape=(5, 3), stride=(3, 1))
    inferred = DTensor.from_local(uneven_local, mesh, [Shard(0)], run_check=True)
    return same_storage, even.shape, even.full_tensor(), given.shape, given.full_tensor().shape, inferred.shape


def test_from_local_is_zero_copy_and_handles_uneven_blocks(dist):
    out = dist.run(4, _from_local_cases)
    want = torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(4)])
    for same, even_shape, full, given, given_full, inferred in out:
        assert same and even_shape == torch.Size([8, 3]) and torch.equal(full, want)
        assert given == given_full == torch.Size([5, 3]) and inferred == torch.Size([5, 3])


def _from_local_bad_replicas():
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    value = torch.ones(2, 2) * (dist.get_rank() == 3)  # rank 3's replica differs
    DTensor.from_local(value, mesh, [Replicate(), Replicate()], run_check=True)


def _from_local_bad_shapes():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], run_check=True, shape=(6, 3))


def test_from_local_run_check_raises_on_every_rank(dist):
    dist.run_expect_error(4, _from_local_bad_replicas, match=r"replicas differ along axis (dp|tp)")
    dist.run_expect_error(4, _from_local_bad_shapes, match=r"rank 3 along axis tp holds a \[2, 3\] block where the layout needs \[0, 3\]")


def _bad_placements(kind):
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.ones(4, 6)
    if kind == "length":
        sw.distribute_tensor(x, mesh, [Shard(0)])
    elif kind == "dim":
        sw.distribute_tensor(x, mesh, [Shard(0), Shard(2)])
    elif kind == "mixed":
        sw.distribute_tensor(x, mesh, [Partial("sum"), Partial("max")])
    elif kind == "mesh":
        pair = sw.DeviceMesh("cpu", [0, 1])  # other ranks: a relabelled mesh of all 4 would be fine
        sw.distribute_tensor(x, mesh, [Shard(0), Replicate()]).redistribute(pair, [Replicate()])


@pytest.mark.parametrize("kind,match", [
    ("length", r"^`placements` must have the same length as `device_mesh.ndim`! Found placements length: 1, and device_mesh.ndim: 2\..*shape \[4, 6\] on mesh\(dp=2, tp=2\) with placements \[Shard\(dim=0\)\]"),
    ("dim", r"Shard\(2\) is outside the tensor's 2 dims.*\[4, 6\].*mesh\(dp=2, tp=2\)"),
    ("mixed", r"mix Partial reduce ops \['max', 'sum'\]"),
    ("mesh", r"cannot move f32\[4@dp,6\] from mesh\(dp=2, tp=2\) \(ranks \[0, 1, 2, 3\]\) to .*\(ranks \[0, 1\]\)"),
])
def test_bad_layouts_raise_clearly_on_every_rank(dist, kind, match):
    dist.run_expect_error(4, _bad_placements, kind, match=match, exc_type=ValueError)


RANDOM_LAYOUTS = [[Shard(0), Shard(1)], [Shard(1), Replicate()], [Replicate(), Replicate()], [Shard(0), Shard(0)]]


def _random_across_layouts(mesh_shape):
    """randn/rand of an uneven (5, 7) tensor in every RANDOM_LAYOUTS layout, each from seed 7."""
    from shardwise.tensor import random as sw_random

    mesh = sw.init_device_mesh("cpu", mesh_shape)
    out = []
    for placements in RANDOM_LAYOUTS:
        sw_random.manual_seed(7)
        normal = sw.randn(5, 7, device_mesh=mesh, placements=placements)
        uniform = sw.rand((5, 7), device_mesh=mesh, placements=placements, dtype=torch.float64)
        out.append((normal.full_tensor(), uniform.full_tensor(), normal.to_local().shape))
    torch.manual_seed(8)  # a new torch seed restarts the stream from it
    reseeded = sw.randn(5, 7, device_mesh=mesh, placements=RANDOM_LAYOUTS[0]).full_tensor()
    following = sw.randn(5, 7, device_mesh=mesh, placements=RANDOM_LAYOUTS[0]).full_tensor()
    return out, reseeded, following


def _factories():
    from shardwise.tensor import random as sw_random

    mesh = _mesh22()
    ones_p = sw.ones(4, 2, device_mesh=mesh, placements=[Partial(), Shard(0)])
    sw_random.manual_seed(7)
    rand_p = sw.rand(4, 2, device_mesh=mesh, placements=[Partial(), Shard(0)])
    return (
        ones_p.full_tensor(), sw.zeros(3, 3, device_mesh=mesh, placements=[Shard(0), Shard(0)]).to_local().shape,
        sw.full((2, 3), 7.0, device_mesh=mesh, placements=[Replicate(), Shard(1)]).full_tensor(),
        sw.empty(8, device_mesh=mesh, placements=[Shard(0), Shard(0)]).to_local().shape,
        sw.zeros(4, device_mesh=mesh, dtype=torch.float64, requires_grad=True).requires_grad,
        rand_p.full_tensor(), rand_p.to_local(),
    )


def test_factories_allocate_blocks_and_random_values_are_layout_independent(dist):
    from shardwise.tensor.random import uniform as sw_uniform

    (single, single_reseeded, _), = dist.run(1, _random_across_layouts, (1, 1))
    want_normal, want_uniform, _ = single[0]
    assert want_uniform.dtype == torch.float64 and want_uniform.min() >= 0 and want_uniform.max() < 1
    for rank, (layouts, reseeded, following) in enumerate(dist.run(4, _random_across_layouts, (2, 2))):
        for placements, (normal, uniform, local_shape) in zip(RANDOM_LAYOUTS, layouts):
            assert torch.equal(normal, want_normal) and torch.equal(uniform, want_uniform), (rank, placements)
            assert local_shape != (5, 7) or placements == [Replicate(), Replicate()]  # blocks, not copies
        assert torch.equal(reseeded, single_reseeded) and not torch.equal(reseeded, want_normal)
        assert not torch.equal(following, reseeded)  # the stream advances between calls
    want_p = sw_uniform((4, 2), (0, 0), (4, 2), seed=7, offset=0)  # what manual_seed(7) + rand give
    for rank, (ones_p, zshape, full, eshape, rg, rand_p, rand_p_local) in enumerate(dist.run(4, _factories)):
        assert torch.equal(ones_p, torch.ones(4, 2)) and torch.equal(full, torch.full((2, 3), 7.0))
        assert zshape == ((1, 3), (1, 3), (1, 3), (0, 3))[rank] and eshape == (2,) and rg
        assert torch.equal(rand_p, want_p)  # Partial(sum): the value on axis-rank 0, zeros elsewhere
        assert torch.equal(rand_p_local, want_p[rank % 2 * 2 : rank % 2 * 2 + 2] * (rank < 2))


# ---------------------------------------------------------------------- autograd
LAYOUTS = [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()], [Replicate(), Replicate()]]


def _grad_through_redistribute(src, dst):
    mesh = _mesh22()
    x = torch.arange(35.0).reshape(5, 7).sin().requires_grad_()
    weight = torch.arange(35.0).reshape(5, 7).cos()
    dt = sw.distribute_tensor(x, mesh, src)
    loss = (dt.redistribute(mesh, dst).full_tensor() * weight).sum()
    loss.backward()
    return loss.detach(), dt.grad.placements, dt.grad.full_tensor()


@pytest.mark.parametrize("src", LAYOUTS, ids=str)
@pytest.mark.parametrize("dst", LAYOUTS + [[Partial(), Shard(0)]], ids=str)
def test_redistribute_gradients_match_single_process(dist, src, dst):
    x = torch.arange(35.0).reshape(5, 7).sin().requires_grad_()
    weight = torch.arange(35.0).reshape(5, 7).cos()
    loss = (x * weight).sum()
    loss.backward()
    for got_loss, placements, grad in dist.run(4, _grad_through_redistribute, src, dst):
        assert torch.allclose(got_loss, loss) and placements == tuple(src)
        assert torch.allclose(grad, x.grad)


def _partial_gradient_reduce_scatters():
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    dt = sw.distribute_tensor(torch.ones(8, 2, requires_grad=True), mesh, [Shard(0)])
    local = dt.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    loss = (local * (rank + 1)).sum()  # each rank's own loss term: the gradient is Partial
    with CommDebugMode() as comms:
        loss.backward()
    return comms.get_comm_counts(), dt.grad.to_local()


def test_partial_gradient_turns_into_reduce_scatter(dist):
    for rank, (counts, grad) in enumerate(dist.run(4, _partial_gradient_reduce_scatters)):
        assert counts == {"reduce_scatter": 1}
        assert torch.equal(grad, torch.full((2, 2), 10.0))  # 1 + 2 + 3 + 4


def _from_local_to_local_grads():
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    block = (torch.arange(6.0).reshape(2, 3) + rank).requires_grad_()
    weight = torch.arange(24.0).reshape(8, 3)
    full = DTensor.from_local(block, mesh, [Shard(0)]).full_tensor()
    (full * weight).sum().backward()
    roundtrip = (torch.ones(3) * (rank + 1)).requires_grad_()
    out = DTensor.from_local(roundtrip, mesh, [Partial()]).to_local()
    (out * 2).sum().backward()
    return block.grad, roundtrip.grad


def test_from_local_and_to_local_gradients(dist):
    weight = torch.arange(24.0).reshape(8, 3)
    for rank, (block_grad, roundtrip_grad) in enumerate(dist.run(4, _from_local_to_local_grads)):
        assert torch.equal(block_grad, weight[2 * rank : 2 * rank + 2])
        assert torch.equal(roundtrip_grad, torch.full((3,), 2.0))
