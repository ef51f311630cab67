"""Fail fast and whole (issue 10): user mistakes in the core API raise one clear error on every
rank, before any collective; a layout mistake never reaches gloo as a size mismatch."""

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.core.spec import DTensorSpec, TensorMeta


def _mesh22():
    return sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


# ---------------------------------------------------------------------- placements of the wrong type
BAD_PLACEMENTS = {
    "string": "S",                     # used to be iterated character by character
    "string_in_list": ["S", "R"],
    "class_not_instance": [Shard, Replicate()],
    "int": 0,
    "int_in_list": [Replicate(), 1],
    "single_placement": Shard(0),
}


def _use_bad_placements(api: str, kind: str, mesh_shape: tuple = (2,)):
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    bad = BAD_PLACEMENTS[kind]
    x = torch.ones(4, 6)
    good = [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1)
    calls = {
        "distribute_tensor": lambda: sw.distribute_tensor(x, mesh, bad),
        "from_local": lambda: DTensor.from_local(x, mesh, bad),
        "redistribute": lambda: sw.distribute_tensor(x, mesh, good).redistribute(mesh, bad),
        "zeros": lambda: sw.zeros(4, 6, device_mesh=mesh, placements=bad),
        "randn": lambda: sw.randn(4, 6, device_mesh=mesh, placements=bad),
        "spec": lambda: DTensorSpec(mesh, bad, TensorMeta.of(x)),
        "to_local": lambda: sw.distribute_tensor(x, mesh, good).to_local(grad_placements=bad),
    }
    calls[api]()


BAD_MATCH = {
    "string": r"placements must be a list or tuple with one placement per mesh axis .*got 'S' \(a str\)",
    "string_in_list": r"placements\[0\] of \['S', 'R'\] is 'S' \(a str\); expected Placement objects: "
                      r"Shard\(dim\), Replicate\(\) or Partial\(reduce_op\) \(write Shard\(dim\), not a string\)",
    "class_not_instance": r"placements\[0\] of \[Shard, Replicate\(\)\] is the class Shard; .*call it, e\.g\. Shard\(0\)",
    "int": r"placements must be a list or tuple .*got 0 \(an int\)",
    "int_in_list": r"placements\[1\] of \[Replicate\(\), 1\] is 1 \(an int\).*write Shard\(1\)",
    "single_placement": r"got Shard\(dim=0\) \(a Shard\); write \[Shard\(dim=0\)\]",
}


@pytest.mark.parametrize("kind", sorted(BAD_PLACEMENTS))
@pytest.mark.parametrize("api", ["distribute_tensor", "from_local", "redistribute", "zeros", "randn", "spec", "to_local"])
def test_placements_of_the_wrong_type_get_one_clear_error(dist, api, kind):
    messages = dist.run_expect_error(2, _use_bad_placements, api, kind, match=BAD_MATCH[kind], exc_type=TypeError)
    prefix = {"spec": "", "to_local": "to_local: grad_placements"}.get(api, f"{api}: placements")
    assert all(m.startswith(prefix) for m in messages), messages


def test_bad_placements_on_a_2d_mesh_raise_on_every_rank(dist):
    dist.run_expect_error(4, _use_bad_placements, "from_local", "string", (2, 2), match=BAD_MATCH["string"],
                          exc_type=TypeError)
    dist.run_expect_error(4, _use_bad_placements, "distribute_tensor", "class_not_instance", (2, 2),
                          match=BAD_MATCH["class_not_instance"], exc_type=TypeError)


# ---------------------------------------------------------------------- the op's own errors
def _raise_before_any_collective(make):
    """Run ``make()``; its error must come before any collective that moves data (metadata
    exchanges that only build the message are allowed); re-raised unchanged."""
    from shardwise.debug import CommDebugMode

    with CommDebugMode() as comms:
        try:
            make()
        except Exception:
            moved = {k: v for k, v in comms.get_comm_counts().items() if k != "all_gather_object"}
            assert not moved, f"collectives before the error: {comms.get_comm_counts()}"
            raise


def _user_shape_mistake(kind: str):
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    a = sw.distribute_tensor(torch.ones(8, 5), mesh, [Shard(0)])
    b = sw.distribute_tensor(torch.ones(4, 3), mesh, [Replicate()])
    mistakes = {
        "mm": lambda: torch.mm(a, b),
        "sum_dim": lambda: a.sum(dim=5),
        "broadcast": lambda: a + b,
        "view": lambda: a.view(7),
        "softmax_dim": lambda: torch.softmax(a, dim=3),  # meta lets it through; the blocks refuse
    }
    _raise_before_any_collective(mistakes[kind])


OP_ERRORS = {
    # kind: (exception type torch raises on one device, start of its message, the call rendered)
    "mm": (RuntimeError, r"a and b must have same reduction dim", r"aten\.mm\(f32\[8@tp,5\], f32\[4,3\]\)"),
    "sum_dim": (IndexError, r"Dimension out of range", r"aten\.sum\.dim_IntList\(f32\[8@tp,5\], \[5\]\)"),
    "broadcast": (RuntimeError, r"Attempting to broadcast a dimension", r"aten\.add\.Tensor\(f32\[8@tp,5\], f32\[4,3\]\)"),
    "view": (RuntimeError, r"shape '\[7\]' is invalid for input of size 40", r"aten\.view\(f32\[8@tp,5\], \[7\]\)"),
    "softmax_dim": (IndexError, r"Dimension out of range", r"aten\._softmax\(f32\[8@tp,5\], 3, False\)"),
}


@pytest.mark.parametrize("kind", sorted(OP_ERRORS))
def test_a_users_shape_mistake_raises_the_ops_own_error_with_layouts(dist, kind):
    exc_type, message, call = OP_ERRORS[kind]
    messages = dist.run_expect_error(4, _user_shape_mistake, kind, exc_type=exc_type,
                                     match=rf"^{message}.*\non DTensors: {call} on mesh\(tp=4\)$")
    assert not any("shardwise has no sharding support" in m or "cannot compute output shapes" in m for m in messages)


def _colwise_where_rowwise_belongs():
    from torch import nn

    from shardwise.parallel import ColwiseParallel, parallelize_module

    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": ColwiseParallel()})  # "2" should be Rowwise
    _raise_before_any_collective(lambda: mlp(torch.randn(3, 8)))


def test_a_tp_plan_that_colwise_shards_a_rowwise_layer_raises_the_shape_error(dist):
    # The first layer hands its local [3, 4] block on as the input of the second, which expects
    # 16 features: torch's own shape error, not "UnsupportedOp", on every rank.
    dist.run_expect_error(4, _colwise_where_rowwise_belongs, exc_type=RuntimeError,
                          match=r"^a and b must have same reduction dim, but got \[3, 4\] X \[16, 8\]\.\n"
                                r"on DTensors: aten\.addmm\(f32\[8@tp\], f32\[3,4\], f32\[16,8@tp\]\)")


def _custom_op_without_sharding(bad: bool):
    from shardwise.dispatch import UnsupportedOp  # noqa: F401  (the type the test expects)

    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = sw.distribute_tensor(torch.ones(4, 3 if bad else 4), mesh, [Shard(0)])
    torch.ops.core_errors_test.square_only(x)


@torch.library.custom_op("core_errors_test::square_only", mutates_args=())
def _square_only(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_square_only.register_fake
def _(x):
    if x.shape[0] != x.shape[1]:
        raise ValueError(f"square_only needs a square matrix, got {list(x.shape)}")
    return torch.empty_like(x)


def test_unsupported_op_only_when_a_rule_is_missing(dist):
    from shardwise.dispatch import UnsupportedOp

    dist.run_expect_error(2, _custom_op_without_sharding, False, exc_type=UnsupportedOp,
                          match=r"shardwise has no sharding support for core_errors_test\.square_only")
    dist.run_expect_error(2, _custom_op_without_sharding, True, exc_type=ValueError,
                          match=r"^square_only needs a square matrix, got \[4, 3\]\n"
                                r"on DTensors: core_errors_test\.square_only\(f32\[4@tp,3\]\)")


# ---------------------------------------------------------------------- from_local blocks
def _from_local_checked(case: str):
    rank = dist.get_rank()
    if case == "2d_totals":  # dp row 1 holds one row more: its tp slice adds up to 5, row 0 to 4
        mesh = _mesh22()
        rows = 3 if rank == 2 else 2
        DTensor.from_local(torch.ones(rows, 3), mesh, [Replicate(), Shard(0)], run_check=True)
        return
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    blocks = {
        "wide": torch.ones(2, 5 if rank == 0 else 4),                   # the case
        "uneven_split": torch.ones(3 if rank == 2 else 2, 3),          # 2,2,3,2: no chunk split of 9
        "dtype": torch.ones(2, 3, dtype=torch.float64 if rank == 3 else torch.float32),
        "memory": torch.ones(3, 2).t() if rank == 1 else torch.ones(2, 3),  # a transposed block
        "ndim": torch.ones(2) if rank == 2 else torch.ones(2, 3),
    }
    DTensor.from_local(blocks[case], mesh, [Shard(0)], run_check=True)


RUN_CHECK_ERRORS = {
    "wide": r"dim 1 \(not sharded\) differs: 5 on rank 0; 4 on ranks 1, 2, 3$",
    "uneven_split": r"rank 0 along axis tp holds a \[2, 3\] block where the layout needs \[3, 3\]; .*"
                    r"rank 3 along axis tp holds a \[2, 3\] block where the layout needs \[0, 3\]$",
    "dtype": r"dtypes differ: f32 on ranks 0, 1, 2; f64 on rank 3$",
    "memory": r"blocks have different memory layouts: contiguous on ranks 0, 2, 3; "
              r"strided \(dims by stride 1, 0\) on rank 1",
    "ndim": r"ranks hold blocks of different ranks \(number of dims\): 2 on ranks 0, 1, 3; 1 on rank 2",
    "2d_totals": r"dim 0 \(sharded over tp\) adds up to different totals: 4 on ranks 0, 1; 5 on ranks 2, 3$",
}


@pytest.mark.parametrize("case", sorted(RUN_CHECK_ERRORS))
def test_from_local_run_check_verifies_every_block_on_every_rank(dist, case):
    dist.run_expect_error(4, _from_local_checked, case, exc_type=ValueError,
                          match=r"^from_local\(run_check=True\): the blocks do not form one .* layout on mesh\(.*\): "
                                + RUN_CHECK_ERRORS[case])


def _nested_shards_inferred():
    from shardwise.debug import CommDebugMode

    mesh = _mesh22()
    full = torch.arange(30.0).reshape(10, 3)  # axis dp cuts 5 + 5 rows, axis tp cuts each 5 into 3 + 2
    r = dist.get_rank()
    start = [0, 3, 5, 8][r]
    block = full[start : start + (3 if r % 2 == 0 else 2)]
    checked = DTensor.from_local(block, mesh, [Shard(0), Shard(0)], run_check=True)
    given = DTensor.from_local(block, mesh, [Shard(0), Shard(0)], shape=(10, 3))
    with CommDebugMode() as comms:
        gathered = given.full_tensor()
    return checked.shape, torch.equal(checked.full_tensor(), full), torch.equal(gathered, full), comms.get_comm_counts()


def test_from_local_infers_nested_uneven_shards_from_every_block(dist):
    for shape, checked_ok, given_ok, counts in dist.run(4, _nested_shards_inferred):
        assert shape == torch.Size([10, 3]) and checked_ok and given_ok  # was [5, 3]: the last axis overwrote it
        assert counts == {"all_gather": 2}  # the agreement check of from_local is not counted


def _from_local_unchecked(case: str):
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    rank = dist.get_rank()
    if case == "uneven_inferred":  # each rank infers another global shape: gloo aborted in full_tensor
        dt = DTensor.from_local(torch.ones(3 if rank == 0 else 2, 4), mesh, [Shard(0)])
    else:  # shape= given, but rank 2 holds 2 rows where torch.chunk gives it 1
        dt = DTensor.from_local(torch.ones(2 if rank < 3 else 0, 3), mesh, [Shard(0)], shape=(5, 3))
    _raise_before_any_collective(dt.full_tensor)


def test_from_local_mistakes_raise_on_every_rank_instead_of_aborting_in_gloo(dist):
    dist.run_expect_error(
        4, _from_local_unchecked, "uneven_inferred", exc_type=ValueError,
        match=r"from_local without run_check left the ranks of mesh\(tp=4\) with inconsistent blocks: in call \d+ "
              r"since the last check \(shape inferred assuming even blocks\), the ranks read their blocks as "
              r"different global tensors: f32\[12@tp,4\] on rank 0; f32\[8@tp,4\] on ranks 1, 2, 3 "
              r"\(blocks \[3, 4\] on rank 0; \[2, 4\] on ranks 1, 2, 3\)\. .*pass shape=")
    dist.run_expect_error(4, _from_local_unchecked, "misfit", exc_type=ValueError,
                          match=r"\(shape= given\), rank 2 holds a \[2, 3\] block where f32\[5@tp,3\] needs \[1, 3\]")


def _settle_on_a_2d_world_mesh(case: str):
    """from_local on the 2-D mesh of all ranks: its agreement check is one all_reduce (the
    default group), not one per axis; a disagreement still raises on every rank."""
    from torch.profiler import ProfilerActivity, profile

    mesh, rank = _mesh22(), dist.get_rank()
    rows = 3 if case == "uneven" and rank == 0 else 2
    dt = DTensor.from_local(torch.full((rows, 4), float(rank // 2)), mesh, [Shard(0), Replicate()])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        full = dt.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    reduces = sum(e.name == "gloo:all_reduce" for e in prof.events())
    return reduces, torch.equal(full, torch.arange(2.0).repeat_interleave(2)[:, None].expand(4, 4))


def test_the_agreement_check_on_a_world_mesh_is_one_all_reduce(dist):
    for reduces, values_ok in dist.run(4, _settle_on_a_2d_world_mesh, "even"):
        assert reduces == 1 and values_ok  # was 2: one per mesh axis
    dist.run_expect_error(4, _settle_on_a_2d_world_mesh, "uneven", exc_type=ValueError,
                          match=r"from_local without run_check left the ranks of mesh\(dp=2, tp=2\) with inconsistent "
                                r"blocks: .* f32\[6@dp,4\] on rank 0; f32\[4@dp,4\] on ranks 1, 2, 3")


def _wrong_block_on_every_rank():
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([8, 4]), (4, 1), torch.float32))
    DTensor(torch.ones(3, 4), spec, requires_grad=False).full_tensor()  # 3 rows where the spec says 2


def test_redistribute_refuses_a_block_that_is_not_the_ranks_piece(dist):
    dist.run_expect_error(4, _wrong_block_on_every_rank, exc_type=ValueError,
                          match=r"rank \d holds a \[3, 4\] block of f32\[8@tp,4\] on mesh\(tp=4\), where the layout "
                                r"puts a \[2, 4\] block; not entering all_gather with it")


# ---------------------------------------------------------------------- moving between meshes
def _move(x, mesh, placements):
    from shardwise.debug import CommDebugMode

    with CommDebugMode() as comms:
        y = x.redistribute(mesh, placements)
    return y, comms.get_comm_counts()


def _cross_mesh_moves():
    from shardwise.core.mesh import DeviceMesh

    mesh = _mesh22()
    flat = mesh["dp", "tp"].flatten("world")                                  # (4,), same order
    renamed = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("a", "b"))  # other names
    reordered = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("a", "b"))  # the transpose
    even, uneven = torch.arange(32.0).reshape(8, 4), torch.arange(50.0).reshape(10, 5)
    out = {}
    cases = {
        "flatten": (even, [Shard(0), Shard(0)], flat, [Shard(0)]),
        "rename": (uneven, [Shard(0), Shard(1)], renamed, [Shard(0), Shard(1)]),
        "reorder": (uneven, [Shard(0), Replicate()], reordered, [Shard(0), Replicate()]),
        "flatten_uneven": (uneven, [Shard(0), Shard(0)], flat, [Shard(0)]),   # 3,2,3,2 rows vs 3,3,3,1
        "to_partial": (uneven, [Shard(1), Replicate()], flat, [Partial()]),
    }
    for name, (full, src, dst_mesh, dst) in cases.items():
        x = sw.distribute_tensor(full, mesh, src)
        y, counts = _move(x, dst_mesh, dst)
        out[name] = (y.device_mesh == dst_mesh, y.placements, torch.equal(y.full_tensor(), full), counts,
                     torch.equal(y.to_local(), sw.distribute_tensor(full, dst_mesh, dst).to_local()))
    # A Partial source on the flat mesh: its contributions are reduced on the way.
    contribution = uneven * (dist.get_rank() + 1) / 10
    p = DTensor.from_local(contribution, flat, [Partial()])
    y, counts = _move(p, mesh, [Shard(0), Replicate()])
    out["from_partial"] = (y.device_mesh == mesh, y.placements, torch.allclose(y.full_tensor(), uneven), counts, True)
    return out


def test_redistribute_moves_between_meshes_over_the_same_ranks(dist):
    for rank_out in dist.run(4, _cross_mesh_moves):
        for name, (on_mesh, placements, values_ok, counts, block_ok) in rank_out.items():
            assert on_mesh and values_ok and block_ok, (name, placements)
        assert rank_out["flatten"][3] == {} and rank_out["rename"][3] == {}  # every rank keeps its block
        # to [Replicate(), Shard(0)] by one all_gather, then relabel: an exchange would send half
        # the bytes, but on a block this small the cpu profile predicts the native collective
        # faster (shardwise.cost; docs/tools.md, "The redistribute planner")
        assert rank_out["reorder"][3] == {"all_gather": 1}
        assert rank_out["flatten_uneven"][3] == {"all_gather": 2}  # no cheaper layout has the flat blocks
        assert rank_out["to_partial"][3] == {"all_gather": 1}
        assert rank_out["from_partial"][3] == {"all_reduce": 1}


def _cross_mesh_gradient():
    from shardwise.core.mesh import DeviceMesh

    mesh = _mesh22()
    reordered = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("a", "b"))
    full = torch.arange(35.0).reshape(5, 7).requires_grad_()
    weight = torch.arange(35.0).reshape(5, 7).cos()
    x = sw.distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    (x.redistribute(reordered, [Shard(1), Shard(0)]).full_tensor() * weight).sum().backward()
    return x.grad.device_mesh == mesh, x.grad.placements, torch.allclose(x.grad.full_tensor(), weight)


def test_gradients_flow_back_to_the_source_mesh(dist):
    for same_mesh, placements, ok in dist.run(4, _cross_mesh_gradient):
        assert same_mesh and placements == (Shard(0), Shard(1)) and ok


def _ops_across_meshes(follow_advice: bool):
    mesh = _mesh22()
    flat = mesh["dp", "tp"].flatten("world")
    a = sw.distribute_tensor(torch.ones(8, 4), mesh, [Shard(0), Replicate()])
    b = sw.distribute_tensor(torch.arange(32.0).reshape(8, 4), flat, [Shard(0)])
    if follow_advice:  # what the error says to do
        b = b.redistribute(a.device_mesh, a.placements)
        return torch.equal((a + b).full_tensor(), torch.arange(32.0).reshape(8, 4) + 1)
    return a + b


def test_the_cross_mesh_op_error_gives_advice_that_works(dist):
    dist.run_expect_error(4, _ops_across_meshes, False, exc_type=ValueError,
                          match=r"DTensors on different meshes: DeviceMesh\('cpu', \[\[0, 1\], \[2, 3\]\], .*\(a: "
                                r"f32\[8@dp,4\]\) and DeviceMesh\('cpu', \[0, 1, 2, 3\], .*\(b: f32\[8@world,4\]\)\. "
                                r"The meshes hold the same ranks: move one onto the other's mesh first, e\.g\. "
                                r"`b = b\.redistribute\(a\.device_mesh, a\.placements\)`")
    assert dist.run(4, _ops_across_meshes, True) == [True] * 4


def _to_other_ranks(kind: str):
    mesh = _mesh22()
    world = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("w",))
    x = sw.distribute_tensor(torch.ones(8, 4), world, [Shard(0)])
    if kind == "redistribute":
        x.redistribute(mesh["tp"], [Replicate()])
    else:
        x + sw.distribute_tensor(torch.ones(8, 4), mesh["tp"], [Shard(0)])


def test_meshes_over_other_ranks_get_an_error_saying_what_to_do(dist):
    dist.run_expect_error(4, _to_other_ranks, "redistribute", exc_type=ValueError,
                          match=r"cannot move f32\[8@w,4\] from mesh\(w=4\) \(ranks \[0, 1, 2, 3\]\) to mesh\(tp=2\) "
                                r"\(ranks \[(0, 1|2, 3)\]\): a redistribute keeps the data on the same ranks.*"
                                r"distribute_tensor\(full, other_mesh, placements, src_data_rank=None\)")
    dist.run_expect_error(4, _to_other_ranks, "op", exc_type=ValueError,
                          match=r"The meshes hold different ranks, .*full = b\.full_tensor\(\)")
