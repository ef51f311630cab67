"""shardwise.checkpoint on real gloo worlds: resharding chains, optimizer state, interop.

The oracle is a set of global tensors built from a seed. Each stage of a chain loads the
previous stage's checkpoint into its own layout (mesh, placements, world size), checks every
rank's block against the global tensors, and saves what it loaded for the next stage, so a
mistake anywhere in the chain shows up downstream too.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise import Replicate, Shard
from shardwise.debug import CommDebugMode

safetensors_torch = pytest.importorskip("safetensors.torch")

VALUES = {"step": 7, "lr": 0.5, "name": "run-a", "betas": (0.9, 0.95), "flags": [True, None]}


def _globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),  # uneven on every mesh used
        "m": torch.randn(16, 8, generator=g),
        "v": torch.randn(13, generator=g),
        "h": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "i": torch.arange(12).reshape(4, 3),
        "s": torch.tensor(3.25),  # 0-d, always a plain tensor
    }


R, S0, S1 = Replicate(), Shard(0), Shard(1)
# stage -> (mesh shape, placements per tensor key); None: plain tensors.
STAGES = {
    "w8": ((2, 4), {"w": [S0, S1], "m": [S1, S0], "v": [R, S0], "h": [R, R], "i": [S0, R]}),
    "w4_hsdp": ((2, 2), {"w": [R, S0], "m": [R, S0], "v": [R, S0], "h": [S0, S1], "i": [S1, S0]}),
    "w4_flat": ((4,), {"w": [S1], "m": [S0], "v": [S0], "h": [S1], "i": [R]}),
    "w2": ((2,), {"w": [S0], "m": [S1], "v": [R], "h": [S0], "i": [S1]}),
    "w1": None,
    "w8_up": ((8,), {"w": [S0], "m": [S1], "v": [S0], "h": [R], "i": [S0]}),
}


def _target(stage: str, fill: float) -> dict:
    """A target state dict in the stage's layout, filled with a sentinel."""
    layout = STAGES[stage]
    model = {}
    mesh = sw.init_device_mesh("cpu", layout[0]) if layout else None
    for key, full in _globals().items():
        blank = torch.full_like(full, fill)
        if layout and key in layout[1]:
            model[key] = sw.distribute_tensor(blank, mesh, layout[1][key], src_data_rank=None)
        else:
            model[key] = blank
    return {"model": model, "train": {"step": 0, "lr": 0.0, "name": "", "betas": (0.0, 0.0), "flags": [False, 1]}}


def _mismatches(state: dict) -> list[str]:
    """Keys whose local block (or value) differs from the oracle."""
    bad = []
    for key, full in _globals().items():
        t = state["model"][key]
        if isinstance(t, sw.DTensor):
            shape, offset = t._spec.local_shape_and_offset()
            want = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
            got = t._local_tensor
        else:
            want, got = full, t
        if got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(key)
    loaded = dict(state["train"])
    if loaded != {**VALUES, "betas": tuple(VALUES["betas"])} or type(loaded["betas"]) is not tuple:
        bad.append(f"values {loaded}")
    return bad


def _chain_stage(stage: str, src: str | None, dst: str) -> dict:
    """Load ``src`` into this stage's layout (or build the state), check it, save it to ``dst``."""
    if src is None:
        state = _target(stage, 0.0)
        for key, full in _globals().items():
            t = state["model"][key]
            local = t._local_tensor if isinstance(t, sw.DTensor) else t
            shape, offset = (t._spec.local_shape_and_offset() if isinstance(t, sw.DTensor)
                             else (full.shape, (0,) * full.dim()))
            local.copy_(full[tuple(slice(o, o + s) for o, s in zip(offset, shape))])
        state["train"] = {**VALUES}
    else:
        state = _target(stage, -1.0)
    with CommDebugMode() as comms:
        if src is not None:
            ckpt.load(state, src)
        bad = _mismatches(state)
        ckpt.save(state, dst)
    return {"bad": bad, "comms": sorted(comms.get_comm_counts())}


def _stored_bytes(path: str) -> tuple[int, int]:
    """(bytes of the tensors in metadata.json, bytes of the chunks stored in the files)."""
    with open(os.path.join(path, ckpt.METADATA_FILE)) as f:
        meta = json.load(f)
    sizes = {"F32": 4, "BF16": 2, "I64": 8}
    total = 0
    for entry in meta["tensors"].values():
        n = 1
        for d in entry["shape"]:
            n *= d
        total += n * sizes[entry["dtype"]]
    stored = 0
    from safetensors import safe_open

    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                stored += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    return total, stored


def _plain_target() -> dict:
    return {"model": {k: torch.full_like(v, -1) for k, v in _globals().items()},
            "train": {"step": 0, "lr": 0.0, "name": "", "betas": (0.0, 0.0), "flags": [False, 1]}}


def test_reshard_chain_8_4_2_1_and_back_to_8(dist, tmp_path):
    """8 -> (2,2) HSDP -> (4,) -> 2 -> 1 -> 8, uneven shapes, empty blocks, every placement change."""
    chain = [("w8", 8), ("w4_hsdp", 4), ("w4_flat", 4), ("w2", 2), ("w1", 1), ("w8_up", 8)]
    src = None
    for stage, world in chain:
        dst = str(tmp_path / stage)
        for rank, out in enumerate(dist.run(world, _chain_stage, stage, src, dst)):
            assert out["bad"] == [], f"stage {stage} rank {rank}: wrong blocks {out['bad']} loading {src}"
            # No tensor data travels: only small metadata objects are exchanged.
            assert out["comms"] == ["all_gather_object"], f"stage {stage}: collectives {out['comms']}"
        total, stored = _stored_bytes(dst)
        assert stored == total, f"stage {stage}: {stored} bytes stored for {total} bytes of tensors (replicas written twice?)"
        src = dst
    # Single process, no process group: the 2-rank checkpoint loads into plain tensors.
    state = _plain_target()
    ckpt.load(state, str(tmp_path / "w2"))
    assert _mismatches(state) == []


def _reference_training(steps: int) -> list[dict]:
    """Single-device AdamW run: parameters and moments after each of ``steps`` steps."""
    model = _mlp(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, foreach=True)
    history = []
    for step in range(steps):
        for name, p in model.named_parameters():
            p.grad = _grad(step, name, p.shape)
        opt.step()
        history.append({
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "moments": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()},
        })
    return history


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def _grad(step: int, name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def _sharded_mlp(seed: int, mesh, placements) -> nn.Module:
    model = _mlp(seed)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            dt = sw.distribute_tensor(p.detach(), mesh, placements(p), src_data_rank=None)
            module.register_parameter(name, nn.Parameter(dt))
    return model


def _step(model: nn.Module, opt, step: int) -> None:
    mesh = next(model.parameters()).device_mesh
    for name, p in model.named_parameters():
        p.grad = sw.distribute_tensor(_grad(step, name, p.shape), mesh, p.placements, src_data_rank=None)
    opt.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, sw.DTensor) else t).detach().clone()


def _train_and_save(path: str) -> None:
    """FSDP-style (Shard(0) on 4 ranks): two real AdamW steps, then save model + optimizer."""
    mesh = sw.init_device_mesh("cpu", (4,))
    model = _sharded_mlp(0, mesh, lambda p: [S0])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, foreach=True)
    for step in range(2):
        _step(model, opt, step)
    state = {"model": model.state_dict(), "optim": ckpt.optimizer_state_dict(model, opt),
             "train": {"step": 2, "data_position": 64, "seed": 1234}}
    ckpt.save(state, path)


def _resume(path: str) -> dict:
    """Another layout ((2,2): weights [S1, S0], biases replicated), fresh model and optimizer."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    model = _sharded_mlp(5, mesh, lambda p: [S1, S0] if p.dim() == 2 else [R, R])
    opt = torch.optim.AdamW(model.parameters(), lr=0.3, weight_decay=0.0, foreach=True)
    only_model = {"model": model.state_dict()}
    ckpt.load(only_model, path)  # a subset of the checkpoint
    after_subset = {n: _full(p) for n, p in model.named_parameters()}
    state = {"model": model.state_dict(), "optim": ckpt.optimizer_state_dict(model, opt),
             "train": {"step": 0, "data_position": 0, "seed": 0}}
    ckpt.load(state, path)
    ckpt.load_optimizer_state_dict(model, opt, state["optim"])
    moments = {n: {k: _full(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    placements_kept = all(opt.state[p]["exp_avg"].placements == p.placements for p in model.parameters())
    _step(model, opt, 2)
    return {"subset": after_subset, "moments": moments, "train": state["train"],
            "lr": opt.param_groups[0]["lr"], "placements_kept": placements_kept,
            "after_step": {n: _full(p) for n, p in model.named_parameters()}}


def test_optimizer_state_follows_parameters_to_another_layout(dist, tmp_path):
    """Save after 2 AdamW steps on (4,) Shard(0); resume on (2,2) and take step 3: equals single-device."""
    path = str(tmp_path / "opt")
    ref = _reference_training(3)
    dist.run(4, _train_and_save, path)
    for rank, out in enumerate(dist.run(4, _resume, path)):
        for name, want in ref[1]["params"].items():
            assert torch.equal(out["subset"][name], want), f"rank {rank} {name} (model-only load)"
        for name, moments in ref[1]["moments"].items():
            for key, want in moments.items():
                torch.testing.assert_close(out["moments"][name][key], want, msg=f"rank {rank} {name} {key}")
        assert out["train"] == {"step": 2, "data_position": 64, "seed": 1234}
        assert out["lr"] == 0.05 and out["placements_kept"]
        for name, want in ref[2]["params"].items():
            torch.testing.assert_close(out["after_step"][name], want, msg=f"rank {rank} {name} after resumed step")


def _load_plain_file(file: str, dst: str) -> dict:
    """A single-device safetensors file into a Shard(0) model on 4 ranks; then save sharded."""
    mesh = sw.init_device_mesh("cpu", (4,))
    model = _sharded_mlp(9, mesh, lambda p: [S0])
    ckpt.load(model.state_dict(), file)
    ckpt.save(model.state_dict(), dst)
    return {n: _full(p) for n, p in model.named_parameters()}


def test_single_device_interop_both_ways(dist, tmp_path):
    plain = _mlp(seed=3)
    file = str(tmp_path / "plain.safetensors")
    safetensors_torch.save_file(plain.state_dict(), file)
    for out in dist.run(4, _load_plain_file, file, str(tmp_path / "sharded")):
        for name, p in plain.named_parameters():
            assert torch.equal(out[name], p.detach()), name
    out_file = str(tmp_path / "consolidated.safetensors")
    keys = ckpt.consolidate(str(tmp_path / "sharded"), out_file)
    assert sorted(keys) == sorted(plain.state_dict())
    fresh = _mlp(seed=4)
    fresh.load_state_dict(safetensors_torch.load_file(out_file))
    for (name, a), b in zip(plain.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
