"""Spec math without processes: validation, local blocks, and the tiling property."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise import DeviceMesh, DTensorSpec, Partial, Replicate, Shard, TensorMeta
from shardwise.core.spec import local_shape_and_offset


def _meta(*shape):
    return TensorMeta(torch.Size(shape), tuple(torch.empty(shape).stride()), torch.float32)


def _mesh(*shape, names=None):
    return DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape), mesh_dim_names=names)


def test_spec_is_frozen_hashable_and_normalizes_dims():
    mesh = _mesh(2, 2)
    a = DTensorSpec(mesh, (Shard(-1), Replicate()), _meta(4, 6))
    b = DTensorSpec(mesh, [Shard(1), Replicate()], _meta(4, 6))
    assert a == b and hash(a) == hash(b)
    assert a.placements == (Shard(1), Replicate())
    with pytest.raises(Exception):
        a.placements = ()


def test_wrong_number_of_placements_names_shape_mesh_and_placements():
    with pytest.raises(ValueError) as err:
        DTensorSpec(_mesh(2, 2, names=("dp", "tp")), (Shard(0),), _meta(4, 6))
    msg = str(err.value)
    assert msg.startswith("`placements` must have the same length as `device_mesh.ndim`! Found placements length: 1, and device_mesh.ndim: 2.") and "[4, 6]" in msg and "mesh(dp=2, tp=2)" in msg
    assert "Shard(dim=0)" in msg


def test_shard_dim_outside_tensor_names_everything():
    with pytest.raises(ValueError) as err:
        DTensorSpec(_mesh(4, names=("tp",)), (Shard(2),), _meta(4, 6))
    msg = str(err.value)
    assert "Shard(2) is outside the tensor's 2 dims" in msg and "[4, 6]" in msg and "mesh(tp=4)" in msg


def test_mixed_partials_in_spec_raise_value_error_with_context():
    with pytest.raises(ValueError, match=r"mix Partial reduce ops.*\[4, 6\]"):
        DTensorSpec(_mesh(2, 2), (Partial("sum"), Partial("max")), _meta(4, 6))


def test_render_marks_sharded_dims_and_partials():
    spec = DTensorSpec(_mesh(2, 4, names=("dp_shard", "tp")), (Shard(0), Partial()), _meta(2048, 256))
    assert spec.render() == "f32[2048@dp_shard,256]{P(sum)@tp}"


def test_uneven_nested_blocks():
    # (5, 4) over a (2, 2) mesh, both axes cutting dim 0: 5 -> 3|2, then 3 -> 2|1 and 2 -> 1|1.
    got = {c: local_shape_and_offset((5, 4), (2, 2), c, (Shard(0), Shard(0))) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert got == {
        (0, 0): ((2, 4), (0, 0)), (0, 1): ((1, 4), (2, 0)),
        (1, 0): ((1, 4), (3, 0)), (1, 1): ((1, 4), (4, 0)),
    }


def test_empty_shards_for_more_ranks_than_rows():
    shapes = [local_shape_and_offset((3, 5), (8,), (k,), (Shard(0),))[0] for k in range(8)]
    assert shapes == [(1, 5)] * 3 + [(0, 5)] * 5


placement_st = st.one_of(
    st.builds(Shard, st.integers(0, 2)), st.just(Replicate()), st.just(Partial())
)


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    mesh_shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
)
def test_shards_tile_the_global_tensor_exactly_once(shape, mesh_shape, data):
    placements = [data.draw(placement_st) for _ in mesh_shape]
    placements = [Shard(p.dim % len(shape)) if isinstance(p, Shard) else p for p in placements]
    count = torch.zeros(shape, dtype=torch.int64)
    coords = list(__import__("itertools").product(*(range(n) for n in mesh_shape)))
    for coord in coords:
        local, offset = local_shape_and_offset(shape, mesh_shape, coord, placements)
        index = tuple(slice(o, o + l) for o, l in zip(offset, local))
        count[index] += 1
        assert all(0 <= o and o + l <= s for o, l, s in zip(offset, local, shape))
    # Each element is held once per rank of the axes that do not cut the tensor.
    copies = math.prod(n for n, p in zip(mesh_shape, placements) if not p.is_shard())
    assert bool((count == copies).all())
