"""torch's own distributed-tensor objects handed to shardwise, and shardwise's handed to torch.

A script half-way through switching its imports mixes the two libraries. Each torch object
shardwise cannot take (placement, mesh, DTensor, parallel style) gets one error on every rank
naming it as torch's and the conversion to use, and so does a torch.distributed collective
called on a DTensor (what to call instead); shardwise DTensors given to torch's
distributed checkpoint are saved and loaded as torch's own are (their blocks, resharded on load).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.core.foreign import ForeignKind, foreign_kind, foreign_note


# ---------------------------------------------------------------------- recognizing torch's objects (pure)
def test_torch_objects_are_named_as_torchs_with_the_conversion():
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.tensor.parallel import ColwiseParallel

    assert foreign_kind(tdt.Shard(0)) is ForeignKind.PLACEMENT
    assert foreign_kind(tdt.Partial()) is ForeignKind.PLACEMENT
    assert foreign_kind(TorchMesh) is ForeignKind.MESH
    assert foreign_kind(ColwiseParallel()) is ForeignKind.STYLE
    assert foreign_kind(tdt.DTensor) is ForeignKind.DTENSOR
    note = foreign_note(tdt.Shard(0))
    assert note.startswith("torch.distributed.tensor's placement Shard(dim=0), not shardwise's")
    assert "placements_from_torch" in note
    assert "torch.distributed.tensor.parallel's ColwiseParallel" in foreign_note(ColwiseParallel())


def test_shardwise_objects_and_plain_values_are_not_foreign():
    assert foreign_note(sw.Shard(0)) is None
    assert foreign_note(sw.Replicate()) is None
    assert foreign_note(torch.ones(2)) is None
    assert foreign_note("S") is None


# ---------------------------------------------------------------------- errors on every rank
def _torch_placement():
    import torch.distributed.tensor as tdt

    mesh = sw.init_device_mesh("cpu", (2,))
    sw.distribute_tensor(torch.ones(4, 2), mesh, [tdt.Shard(0)])


def _torch_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    sw.distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (2,)), [sw.Shard(0)])


def _torch_dtensor_mixed_in():
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh

    a = sw.distribute_tensor(torch.ones(4, 2), sw.init_device_mesh("cpu", (2,)), [sw.Shard(0)])
    b = tdt.distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (2,)), [tdt.Shard(0)])
    a.mul(b)


def _torch_style():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from shardwise.parallel import parallelize_module

    parallelize_module(torch.nn.Linear(2, 2), sw.init_device_mesh("cpu", (2,)), {"": ColwiseParallel()})


def _collective_on_a_dtensor():
    dt = sw.distribute_tensor(torch.ones(4), sw.init_device_mesh("cpu", (2,)), [sw.Shard(0)])
    dist.all_reduce(dt)


@pytest.mark.parametrize("fn, match", [
    (_torch_placement, r"distribute_tensor: placements\[0\] of \[Shard\(dim=0\)\] is torch.distributed.tensor's "
                       r"placement Shard\(dim=0\), not shardwise's: .*placements_from_torch"),
    (_torch_mesh, r"distribute_tensor: the mesh must be a shardwise DeviceMesh; got torch.distributed.device_mesh's "
                  r"DeviceMesh, not shardwise's: .*mesh_from_torch"),
    (_torch_dtensor_mixed_in, r"aten.mul.Tensor\(.*\): argument #1 is torch.distributed.tensor's DTensor, not "
                              r"shardwise's: convert it with shardwise.interop.from_torch"),
    (_torch_style, r"plan\[''\] is torch.distributed.tensor.parallel's ColwiseParallel, not shardwise's"),
    (_collective_on_a_dtensor, r"^Operator c10d.allreduce_.default does not have a sharding strategy registered: a torch.distributed "
                               r"collective was called on a DTensor \(c10d.allreduce_\)\. .*"
                               r"redistribute.* or call the collective on dtensor.to_local\(\)"),
], ids=["placement", "mesh", "dtensor", "style", "dist.all_reduce"])
def test_a_torch_object_gets_one_error_on_every_rank_naming_it(dist, fn, match):
    dist.run_expect_error(2, fn, match=match)


# ---------------------------------------------------------------------- torch's checkpoint on shardwise tensors
def _save_with_torch_load_resharded(path: str) -> tuple[list[float], list[float], str]:
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    whole = torch.arange(30.0).reshape(5, 6)  # 5 rows over 2 ranks: uneven blocks
    mesh = sw.init_device_mesh("cpu", (2,))
    state = {"w": sw.distribute_tensor(whole, mesh, [sw.Shard(0)]), "r": sw.distribute_tensor(whole, mesh)}
    dcp.save(state, checkpoint_id=path)
    target = {"w": sw.distribute_tensor(torch.zeros(5, 6), mesh, [sw.Shard(1)]),
              "r": sw.distribute_tensor(torch.zeros(5, 6), mesh, [sw.Shard(0)])}
    dcp.load(target, checkpoint_id=path)
    mine = whole[:, 3 * rank:3 * rank + 3]
    assert torch.equal(target["w"].to_local(), mine), "Shard(0) saved, Shard(1) loaded"
    assert torch.equal(target["r"].full_tensor(), whole), "Replicate saved once, Shard(0) loaded"
    partial = sw.DTensor.from_local(torch.ones(2), mesh, [sw.Partial()])
    try:
        dcp.save({"p": partial}, checkpoint_id=path + "-partial")
    except BaseException as err:  # torch wraps the rank's error in CheckpointException (a BaseException)
        refusal = str(err)
    else:
        refusal = ""
    return target["w"].to_local().flatten().tolist(), mine.flatten().tolist(), refusal


def test_torch_checkpoint_saves_and_reshards_shardwise_dtensors(dist, tmp_path):
    results = dist.run(2, _save_with_torch_load_resharded, str(tmp_path / "ckpt"))
    for got, want, refusal in results:
        assert got == want
        assert "cannot save the Partial DTensor 'p'" in refusal and "redistribute it to Replicate()" in refusal
