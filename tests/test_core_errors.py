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
