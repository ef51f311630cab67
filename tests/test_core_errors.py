"""Fail fast and whole (issue 10): user mistakes in the core API raise one clear error on every
rank, before any collective; a layout mistake never reaches gloo as a size mismatch."""

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.spec import DTensorSpec, TensorMeta


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
    """Run ``make()``; its error must come before any collective (re-raised unchanged)."""
    from shardwise.debug import CommDebugMode

    with CommDebugMode() as comms:
        try:
            make()
        except Exception:
            assert comms.get_total_counts() == 0, f"collectives before the error: {comms.get_comm_counts()}"
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
