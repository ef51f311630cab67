"""Checkpoints across ecosystems: torch.distributed.checkpoint (DCP) both ways.

A tiny MLP trained with torch's own fully_shard + tensor parallelism on a (dp=2, tp=2) mesh is
saved with ``torch.distributed.checkpoint.save``; shardwise loads it into a 4-way tensor-parallel
model and continues to the same losses torch reaches; shardwise's export loads back into a
fresh torch fully_shard + TP model that continues to the same losses again.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as sw


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False)
        self.w2 = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _torch_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Tiny()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.Adam(model.parameters(), lr=0.05), mesh


def _torch_step(model, opt, mesh, step: int) -> float:
    """One step on this dp rank's half of the batch; returns the global mean loss."""
    x, y = _batch(step)
    half = mesh["dp"].get_local_rank() * 4
    loss = F.mse_loss(model(x[half:half + 4]), y[half:half + 4])
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _shardwise_model():
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    model = Tiny()
    mesh = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _shardwise_step(model, opt, step: int) -> float:
    x, y = _batch(step)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _dcp_both_ways(root: str) -> dict:
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import shardwise.checkpoint as swcp
    first, second = os.path.join(root, "torch"), os.path.join(root, "shardwise")
    # torch trains 5 steps, saves with DCP, continues 2 more
    model, opt, mesh = _torch_model()
    for step in range(1, 6):
        _torch_step(model, opt, mesh, step)
    msd, osd = get_state_dict(model, opt)
    tdcp.save({"model": msd, "optim": osd}, checkpoint_id=first)
    torch_losses = [_torch_step(model, opt, mesh, step) for step in (6, 7)]
    # shardwise resumes from torch's checkpoint in another layout (4-way TP, no FSDP)
    smodel, sopt = _shardwise_model()
    state = {"model": smodel.state_dict(), "optim": swcp.optimizer_state_dict(smodel, sopt)}
    swcp.load(state, first)
    loaded = {k: v.full_tensor() for k, v in state["model"].items()}
    swcp.load_optimizer_state_dict(smodel, sopt, state["optim"])
    sw_losses = [_shardwise_step(smodel, sopt, 6)]
    swcp.save({"model": smodel.state_dict(), "optim": swcp.optimizer_state_dict(smodel, sopt)}, second, format="dcp")
    sw_losses.append(_shardwise_step(smodel, sopt, 7))
    # torch resumes from shardwise's export (after step 6) in fully_shard + TP
    model2, opt2, mesh2 = _torch_model()
    msd2, osd2 = get_state_dict(model2, opt2)
    tdcp.load({"model": msd2, "optim": osd2}, checkpoint_id=second)
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    back_loss = _torch_step(model2, opt2, mesh2, 7)
    return {"torch": torch_losses, "shardwise": sw_losses, "back": back_loss, "loaded": loaded}


def test_dcp_checkpoints_resume_across_libraries_and_layouts(dist, tmp_path):
    for out in dist.run(4, _dcp_both_ways, str(tmp_path)):
        torch_6, torch_7 = out["torch"]
        sw_6, sw_7 = out["shardwise"]
        assert abs(sw_6 - torch_6) < 1e-5 * abs(torch_6) + 1e-6, out
        assert abs(sw_7 - torch_7) < 1e-5 * abs(torch_7) + 1e-6, out
        assert abs(out["back"] - sw_7) < 1e-5 * abs(sw_7) + 1e-6, out
    # another world size: one process, plain tensors, reads torch's 4-rank checkpoint
    import shardwise.checkpoint as swcp

    plain = Tiny().state_dict()
    swcp.load({"model": plain}, str(tmp_path / "torch"))
    assert all(torch.equal(plain[k], v) for k, v in out["loaded"].items()) and plain.keys() == out["loaded"].keys()
    # and torch's DCP directory consolidates into one Hugging Face-style file
    from safetensors.torch import load_file

    swcp.consolidate(str(tmp_path / "torch"), str(tmp_path / "model.safetensors"), prefix="model.")
    consolidated = load_file(str(tmp_path / "model.safetensors"))
    assert consolidated.keys() == out["loaded"].keys()
    assert all(torch.equal(consolidated[k], v) for k, v in out["loaded"].items())
    wrong = {"model": {"w1.weight": torch.zeros(16, 9)}}
    with pytest.raises(swcp.CheckpointError, match=r"'model.w1.weight'.*F32\[16, 8\].*F32\[16, 9\]"):
        swcp.load(wrong, str(tmp_path / "torch"))


class Mixed(nn.Module):
    """Two linears in different dtypes (f32 with a bias, bf16 without)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 12)
        self.w2 = nn.Linear(12, 6, bias=False).to(torch.bfloat16)


def _huggingface_round_trip(root: str) -> dict:
    import json

    from safetensors.torch import save_file

    import shardwise.checkpoint as swcp
    from shardwise.fsdp import fully_shard
    from shardwise.interop import read_weight_map, save_hf
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    source, out = os.path.join(root, "hf"), os.path.join(root, "export")
    torch.manual_seed(3)
    weights = {"w1.weight": torch.randn(12, 8), "w1.bias": torch.randn(12),
               "w2.weight": torch.randn(6, 12).to(torch.bfloat16)}
    files = {"model-00001-of-00002.safetensors": ["w1.bias", "w1.weight"],
             "model-00002-of-00002.safetensors": ["w2.weight"]}
    if dist.get_rank() == 0:
        os.makedirs(source)
        for file, keys in files.items():
            save_file({k: weights[k] for k in keys}, os.path.join(source, file), metadata={"format": "pt"})
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
                 "weight_map": {k: f for f, keys in files.items() for k in keys}}
        with open(os.path.join(source, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    dist.barrier()
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Mixed()
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(model.w1, mesh=mesh["dp"])
    fully_shard(model.w2, mesh=mesh["dp"])
    sd = model.state_dict()
    layouts = {k: [str(p) for p in v.placements] for k, v in sd.items()}
    from shardwise.checkpoint.source import ChunkReader

    read, original = [], ChunkReader._read_part
    ChunkReader._read_part = lambda self, *a: read.append(original(self, *a)) or read[-1]
    try:
        swcp.load(sd, source)
    finally:
        ChunkReader._read_part = original
    read_only_own = sum(t.numel() for t in read) == sum(v.to_local().numel() for v in sd.values())
    loaded = {k: torch.equal(v.full_tensor(), weights[k]) and v.dtype == weights[k].dtype for k, v in sd.items()}
    save_hf(model.state_dict(), out, weight_map=read_weight_map(source))
    same = {}
    for file in files:
        with open(os.path.join(source, file), "rb") as a, open(os.path.join(out, file), "rb") as b:
            same[file] = a.read() == b.read()
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index_out = json.load(f)
    return {"layouts": layouts, "loaded": loaded, "same_bytes": same, "read_only_own": read_only_own,
            "weight_map": index_out["weight_map"] == read_weight_map(source)}


def test_huggingface_shards_load_into_fsdp_tp_and_export_byte_identical(dist, tmp_path):
    for out in dist.run(4, _huggingface_round_trip, str(tmp_path)):
        assert all(len(p) == 2 for p in out["layouts"].values()), out["layouts"]  # sharded over dp and tp
        assert out["loaded"] == {"w1.weight": True, "w1.bias": True, "w2.weight": True}, out
        assert out["same_bytes"] == {"model-00001-of-00002.safetensors": True,
                                     "model-00002-of-00002.safetensors": True}, out
        assert out["weight_map"] and out["read_only_own"], out  # each rank read exactly its blocks' elements


def test_trainer_resumes_from_a_dcp_step_directory(tmp_path):
    """The trainer's --resume path (Checkpointer.restore) takes a DCP ``step-<N>``: model, AdamW
    moments, schedule and step come back exactly (one process, no process group)."""
    from shardwise.interop import save_dcp
    from shardwise.train.checkpointing import TrainState, latest_checkpoint, make_checkpointer

    def state(seed: int) -> TrainState:
        torch.manual_seed(seed)
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return TrainState(model, opt, sched, seed=7, schedule_steps=10, config="tiny")

    saved = state(0)
    for step in (1, 2, 3):
        x, y = _batch(step)
        F.mse_loss(saved.model(x), y).backward()
        saved.optimizer.step()
        saved.optimizer.zero_grad()
        saved.scheduler.step()
        saved.step = step
    save_dcp(saved.state_dict(), str(tmp_path / "step-3"))
    assert latest_checkpoint(str(tmp_path)).train["seed"] == 7

    resumed = state(1)
    assert make_checkpointer(str(tmp_path), None, 10, resume=True).restore(resumed) == 3
    for name, p in saved.model.named_parameters():
        assert torch.equal(dict(resumed.model.named_parameters())[name], p), name
        for k, v in saved.optimizer.state[p].items():
            assert torch.equal(resumed.optimizer.state[dict(resumed.model.named_parameters())[name]][k], v), (name, k)
    assert resumed.scheduler.state_dict()["last_epoch"] == 3 and resumed.optimizer.param_groups[0]["lr"] == 0.01 / 4
