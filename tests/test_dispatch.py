"""The dispatcher: pointwise ops, Partial safety, errors, cache, user-registered strategies."""

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode
from tests.op_check import assert_no_failures, check_op, layouts_for


def _pointwise():
    mesh = sw.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    a, b, c = torch.randn(5, 7), torch.randn(7), torch.randn(5, 1)
    failures = []
    for la in layouts_for(2, 2):
        failures += check_op(torch.add, [a, b], [la, [Replicate(), Replicate()]], mesh)
        failures += check_op(lambda x, y, z: torch.where(x > 0, x * y, z).exp().relu(), [a, b, c], [la, [Replicate(), Shard(0)], [Shard(0), Replicate()]], mesh)
        failures += check_op(lambda x: (x.to(torch.float64) * 2 + 1).int(), [a], [la], mesh, grad=False)
    return failures


def test_pointwise_ops_with_broadcasting_and_type_promotion(dist):
    assert_no_failures(dist.run(4, _pointwise))


def _partial_cases():
    mesh = sw.init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    torch.manual_seed(0)
    parts = torch.randn(4, 3, 5)
    x = parts.sum(0)
    p = DTensor.from_local(parts[rank].clone(), mesh, [Partial()])
    rep = torch.randn(3, 5)
    r = sw.distribute_tensor(rep, mesh, [Replicate()])
    out = {
        "times_negative": ((p * -2.0).full_tensor(), x * -2.0),
        "plus_scalar": ((p + 1.0).full_tensor(), x + 1.0),
        "plus_replicate": ((p + r).full_tensor(), x + rep),
        "relu": (p.relu().full_tensor(), x.relu()),
        "exp": (p.exp().full_tensor(), x.exp()),
        "abs": (p.abs().full_tensor(), x.abs()),
        "clamp": (p.clamp(-0.5, 0.5).full_tensor(), x.clamp(-0.5, 0.5)),
        "partial_plus_partial": ((p + p).full_tensor(), 2 * x),
        "times_replicate": ((p * r).full_tensor(), x * rep),
    }
    pmax = DTensor.from_local(parts[rank].clone(), mesh, [Partial("max")])
    xmax = parts.amax(0)
    out["max_times_negative"] = ((pmax * -3.0).full_tensor(), xmax * -3.0)
    out["max_plus_scalar"] = ((pmax + 2.0).full_tensor(), xmax + 2.0)
    pavg = DTensor.from_local(parts[rank].clone(), mesh, [Partial("avg")])
    out["avg_plus_scalar"] = ((pavg + 1.0).full_tensor(), parts.mean(0) + 1.0)
    with CommDebugMode() as comms:
        kept = p * 3.0
    out["linear_keeps_partial"] = (torch.tensor(kept.placements == (Partial(),) and comms.get_total_counts() == 0), torch.tensor(True))
    with CommDebugMode() as comms:
        p.relu()
    out["nonlinear_reduce_scatters"] = (torch.tensor(comms.get_comm_counts() == {"reduce_scatter": 1}), torch.tensor(True))
    return {k: torch.allclose(g, w, atol=1e-6) for k, (g, w) in out.items()}


def test_partial_is_never_silently_wrong(dist):
    for rank, results in enumerate(dist.run(4, _partial_cases)):
        assert all(results.values()), f"rank {rank}: wrong: {[k for k, ok in results.items() if not ok]}"


def _in_place_keeps_identity():
    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    y = sw.distribute_tensor(torch.ones(8), mesh, [Replicate()])
    before = x
    result = x.add_(y)
    out = sw.distribute_tensor(torch.zeros(8), mesh, [Shard(0)])
    returned = torch.add(x, 1.0, out=out)
    return result is before, x.full_tensor(), returned is out, out.full_tensor()


def test_in_place_and_out_variants(dist):
    for same, x, same_out, out in dist.run(4, _in_place_keeps_identity):
        assert same and same_out
        assert torch.equal(x, torch.arange(8.0) + 1) and torch.equal(out, torch.arange(8.0) + 2)


def _mix_plain():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = sw.distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    x + torch.ones(8, 4)


def _mix_plain_allowed():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = sw.distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    scalar = (x * torch.tensor(2.0)).full_tensor()
    with sw.implicit_replication():
        implicit = (x + torch.arange(4.0)).full_tensor()
    return scalar, implicit


def _two_meshes():
    a = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    b = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sw.distribute_tensor(torch.ones(4), a, [Shard(0)]) + sw.distribute_tensor(torch.ones(4), b, [Shard(0), Replicate()])


def test_mixing_plain_tensors_and_meshes_errors_name_the_op(dist):
    dist.run_expect_error(4, _mix_plain, match=r"aten\.add\.Tensor\(f32\[8@tp,4\], f32\[8,4\]\(plain\)\) on mesh\(tp=4\): argument #1 is a plain tensor")
    for scalar, implicit in dist.run(4, _mix_plain_allowed):
        assert torch.equal(scalar, torch.full((8, 4), 2.0)) and torch.equal(implicit, 1 + torch.arange(4.0).expand(8, 4))
    dist.run_expect_error(4, _two_meshes, match=r"different meshes: DeviceMesh\('cpu', \[0, 1, 2, 3\].*and DeviceMesh\('cpu', \[\[0, 1\], \[2, 3\]\]")


# An op no strategy covers (aten ops keep gaining support; a user's op has none until registered).
torch.library.define("shardwise_test::unsharded_scale", "(Tensor x, float factor) -> Tensor")


@torch.library.impl("shardwise_test::unsharded_scale", "CompositeExplicitAutograd")
def _unsharded_scale(x, factor):
    return x * factor


@torch.library.register_fake("shardwise_test::unsharded_scale")
def _unsharded_scale_fake(x, factor):
    return torch.empty_like(x)


def _unsupported():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = sw.distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    torch.ops.shardwise_test.unsharded_scale(x, 2.0)


def _fallback():
    import warnings

    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    x = sw.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    with sw.allow_replicate_fallback(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.ops.shardwise_test.unsharded_scale(x, 2.0)
        torch.ops.shardwise_test.unsharded_scale(x, 2.0)
    return out.full_tensor(), out.placements, len([w for w in caught if "replicating" in str(w.message)])


def test_unsupported_op_error_and_opt_in_fallback(dist):
    dist.run_expect_error(4, _unsupported, match=r"no sharding support for shardwise_test\.unsharded_scale\(f32\[8@tp,4\], 2\.0\) on mesh\(tp=4\)\. Register one with @shardwise\.register_sharding")
    x = torch.arange(8.0).reshape(4, 2)
    for full, placements, warned in dist.run(4, _fallback):
        assert torch.allclose(full, x * 2.0) and placements == (Replicate(),) and warned == 1


def test_render_call_matches_the_documented_form():
    from shardwise.dispatch import render_call
    from shardwise.core.spec import DTensorSpec, TensorMeta

    mesh = sw.DeviceMesh("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=("dp_shard", "tp"))
    spec = DTensorSpec(mesh, (Shard(0), Replicate()), TensorMeta(torch.Size([2048, 256]), (256, 1), torch.float32))
    fake = DTensor(torch.empty(0), spec, requires_grad=False)
    text = render_call(torch.ops.aten.embedding.default, (fake, torch.zeros(8, 128, dtype=torch.int64)), {})
    assert text == "aten.embedding(f32[2048@dp_shard,256], i64[8,128](plain)) on mesh(dp_shard=2, tp=4)"


def _cache_bounded():
    from shardwise.dispatch import dispatcher

    mesh = sw.init_device_mesh("cpu", (2,))
    x = sw.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    old = dispatcher.CACHE_SIZE
    dispatcher.CACHE_SIZE = 8
    try:
        for k in range(30):
            x = x * (k % 20)  # 20 distinct int scalar keys
        x.sum(dim=[0, 1]) if False else None
        return dispatcher.cache_info()["size"]
    finally:
        dispatcher.CACHE_SIZE = old


def test_dispatch_cache_is_bounded(dist):
    assert dist.run(2, _cache_bounded) == [8, 8]


def _changing_float_scalars():
    from shardwise.dispatch import dispatcher

    mesh = sw.init_device_mesh("cpu", (2,))
    x = sw.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    dispatcher.clear_cache()
    for k in range(10):  # a learning rate that changes every step
        y = x * (0.1 + k)
    hits_one_entry = dispatcher.cache_info()["size"] == 1
    peak = sw.DTensor.from_local(torch.tensor([float(torch.distributed.get_rank())]), mesh, [Partial("max")])
    flipped = (peak * -2.0).placements, (peak * 3.0).placements, (peak * -2.0).full_tensor()
    return hits_one_entry, y.full_tensor(), flipped


def test_float_scalars_of_pointwise_ops_share_a_cache_entry_by_sign(dist):
    """Pointwise layouts depend on a float only through its sign: new values reuse the entry,
    while a negative factor on Partial(max) still becomes Partial(min)."""
    for one_entry, y, (negative, positive, value) in dist.run(2, _changing_float_scalars):
        assert one_entry
        assert torch.equal(y, torch.arange(8.0).reshape(4, 2) * 9.1)
        assert negative == (Partial("min"),) and positive == (Partial("max"),)
        assert torch.equal(value, torch.tensor([-2.0]))  # -2 * max(0, 1)


torch.library.define("shardwise_test::scale", "(Tensor x, float factor) -> Tensor")


@torch.library.impl("shardwise_test::scale", "CompositeExplicitAutograd")
def _scale(x, factor):
    return x * factor


@torch.library.register_fake("shardwise_test::scale")
def _scale_fake(x, factor):
    return torch.empty_like(x)


def _custom_op():
    @sw.register_sharding(torch.ops.shardwise_test.scale.default)
    def _(schema):
        return [([Shard(0)], [Shard(0)]), ([Replicate()], [Replicate()])]

    mesh = sw.init_device_mesh("cpu", (4,))
    x = sw.distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    with CommDebugMode() as comms:
        y = torch.ops.shardwise_test.scale(x, 3.0)
    return y.placements, y.full_tensor(), comms.get_total_counts()


def test_user_registered_strategy_for_a_custom_op(dist):
    for placements, full, comms in dist.run(4, _custom_op):
        assert placements == (Shard(0),) and torch.equal(full, torch.arange(8.0) * 3) and comms == 0
