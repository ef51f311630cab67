"""Damaged checkpoints and bad input: one clear error, the same on every rank, nothing changed.

A good checkpoint is saved by 4 ranks (Shard(0): each rank writes, and later reads, its own
file), then copies of it are damaged from the test process. Loads run on every rank; a
damaged file is noticed only by the rank reading it, so the test also shows that the others
learn of it and raise the same error instead of hanging. Each load body checks that its
target still holds the sentinel before re-raising.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise import Partial, Shard

WORLD = 4
SENTINEL = -7.0


def _model(fill: float | None, rows: int = 7) -> dict:
    g = torch.Generator().manual_seed(11)
    mesh = sw.init_device_mesh("cpu", (WORLD,))
    fulls = {"w": torch.randn(rows, 5, generator=g), "m": torch.randn(64, 32, generator=g)}
    if fill is not None:
        fulls = {k: torch.full_like(v, fill) for k, v in fulls.items()}
    return {k: sw.distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in fulls.items()}


def _save_good(path: str) -> None:
    ckpt.save({"model": _model(None), "step": 3}, path, max_chunk_bytes=1024)


def _load_expect_untouched(path: str, rows: int = 7, extra: bool = False) -> None:
    state = {"model": _model(SENTINEL, rows), "step": -1}
    if extra:
        state["optim"] = {"lr": 0.1}
    try:
        ckpt.load(state, path)
    except ckpt.CheckpointError as err:
        untouched = state["step"] == -1 and all(
            bool((t._local_tensor == SENTINEL).all()) for t in state["model"].values())
        raise ckpt.CheckpointError(f"{err} [untouched={untouched}]") from None


def _same_everywhere(messages: list[str]) -> None:
    assert len(set(messages)) == 1, f"ranks raised different errors: {messages}"
    assert messages[0].endswith("[untouched=True]"), messages[0]


def _copy(good: str, tmp_path, name: str) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(good, dst)
    return dst


def test_damaged_checkpoints_give_one_clear_error_everywhere(dist, tmp_path):
    good = str(tmp_path / "good")
    dist.run(WORLD, _save_good, good)
    dist.run(WORLD, _load_expect_untouched, good)  # the undamaged copy loads

    corrupted = _copy(good, tmp_path, "corrupted")
    victim = os.path.join(corrupted, "__3.safetensors")
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) - 9)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    _same_everywhere(dist.run_expect_error(
        WORLD, _load_expect_untouched, corrupted, match=r"'model\.m'.*__3\.safetensors: checksum mismatch.*corrupted \(on rank 3\)"))

    truncated = _copy(good, tmp_path, "truncated")
    victim = os.path.join(truncated, "__2.safetensors")
    os.truncate(victim, os.path.getsize(victim) // 2)
    _same_everywhere(dist.run_expect_error(
        WORLD, _load_expect_untouched, truncated, match=r"__2\.safetensors is damaged or truncated"))

    wrong_shape = _copy(good, tmp_path, "wrong_shape")
    meta_path = os.path.join(wrong_shape, ckpt.METADATA_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    meta["tensors"]["model.w"]["shape"] = [9, 5]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    _same_everywhere(dist.run_expect_error(
        WORLD, _load_expect_untouched, wrong_shape, match=r"tensor 'model\.w'.*shape \[9, 5\]"))

    half = _copy(good, tmp_path, "half")
    os.remove(os.path.join(half, ckpt.METADATA_FILE))
    _same_everywhere(dist.run_expect_error(
        WORLD, _load_expect_untouched, half, match=r"has no metadata\.json \(not a committed checkpoint\)"))

    _same_everywhere(dist.run_expect_error(
        WORLD, _load_expect_untouched, str(tmp_path / "nowhere"), match=r"no checkpoint at .*nowhere.*does not exist"))


def test_target_mismatch_names_every_problem(dist, tmp_path):
    good = str(tmp_path / "good")
    dist.run(WORLD, _save_good, good)
    msgs = dist.run_expect_error(WORLD, _load_expect_untouched, good, 8, True,
                                 match=r"2 problems.*'model\.w'.*F32\[7, 5\].*F32\[8, 5\].*'optim\.lr'.*missing")
    _same_everywhere(msgs)


def _save_partial(path: str) -> None:
    mesh = sw.init_device_mesh("cpu", (WORLD,))
    ckpt.save({"model": {"g": sw.DTensor.from_local(torch.ones(3), mesh, [Partial()])}}, path)


def _save_bad_value(path: str) -> None:
    ckpt.save({"model": _model(None), "extra": {"when": {1, 2}}}, path)


def test_bad_state_dicts_are_refused_before_writing(dist, tmp_path):
    path = str(tmp_path / "never")
    dist.run_expect_error(WORLD, _save_partial, path, match=r"'model\.g' is a DTensor with pending reductions")
    dist.run_expect_error(WORLD, _save_bad_value, path, match=r"'extra\.when' is a set")
    assert not os.listdir(tmp_path), "a refused save left files behind"
