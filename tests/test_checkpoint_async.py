"""Asynchronous saves, retention and bad storage (docs/checkpoints.md).

The oracle is the synchronous ``save`` of the same state: an ``async_save`` must leave the same
checkpoint (metadata and values), taken at the moment of the call although the live tensors
change right after. Storage failures are injected inside the worker: the checkpoint writer's
module sees a replaced ``open`` that fails as a full disk or a refused permission would, on one
rank; collectives are never touched. Every rank must raise the same one error naming the path
and the cause, and the previous checkpoint must load, with no tmp directory left.
"""

from __future__ import annotations

import errno
import glob
import json
import os

import pytest
import torch
from torch import nn

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise import Shard
from shardwise.checkpoint import safetensors_io
from shardwise.train.checkpointing import (
    DirectoryCheckpointer, TrainState, latest_readable_checkpoint, prune_checkpoints, steps_to_prune,
)
from tests.helpers import BASE, RTOL, STEPS, fake_checkpoint, one_process_run, train_run


def _full(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(7, 5, generator=g), "m": torch.randn(9, 6, generator=g), "b": torch.randn(5, generator=g)}


def _state(version: int, fill: float | None = None) -> dict:
    """Version ``version`` of the state over the world: w Shard(0), m Shard(1), b a plain tensor."""
    mesh = sw.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    full = {k: torch.full_like(v, fill) if fill is not None else v for k, v in _full(version).items()}
    return {"model": {"w": sw.distribute_tensor(full["w"], mesh, [Shard(0)], src_data_rank=None),
                      "m": sw.distribute_tensor(full["m"], mesh, [Shard(1)], src_data_rank=None)},
            "b": full["b"], "version": version if fill is None else -1}


def _loaded(path: str) -> dict:
    """The checkpoint at ``path`` loaded into a fresh state, as full tensors and the version."""
    state = _state(0, fill=-1.0)
    ckpt.load(state, path)
    return {"w": state["model"]["w"].full_tensor(), "m": state["model"]["m"].full_tensor(), "b": state["b"],
            "version": state["version"]}


def _equal(got: dict, version: int) -> bool:
    want = _full(version)
    return got["version"] == version and all(torch.equal(got[k], want[k]) for k in want)


def _tensors_json(path: str) -> dict:
    with open(os.path.join(path, ckpt.METADATA_FILE)) as f:
        return json.load(f)["tensors"]


# ------------------------------------------------------------------ async equals sync
def _async_equals_sync(base: str) -> dict:
    state = _state(1)
    ckpt.save(state, os.path.join(base, "sync"))
    pending = ckpt.async_save(state, os.path.join(base, "async"))
    for t in (state["model"]["w"]._local_tensor, state["model"]["m"]._local_tensor, state["b"]):
        t.add_(100.0)  # training goes on: the save holds the values of the call
    state["version"] = 2
    pending.result()
    first = {"same_files": _tensors_json(os.path.join(base, "sync")) == _tensors_json(os.path.join(base, "async")),
             "async_v1": _equal(_loaded(os.path.join(base, "async")), 1)}
    second = ckpt.async_save(_state(3), os.path.join(base, "async"))  # the host buffers again: replaces it
    ckpt.wait_for_pending_save()
    return {**first, "done": second.done(), "async_v3": _equal(_loaded(os.path.join(base, "async")), 3),
            "leftovers": glob.glob(os.path.join(base, "*.*-*"))}


@pytest.mark.parametrize("world", [2, 4])
def test_async_save_writes_what_save_writes(dist, tmp_path, world):
    base = str(tmp_path)
    for rank, out in enumerate(dist.run(world, _async_equals_sync, base)):
        # the same chunks and checksums as save's; the values of the call, not the ones after it
        assert out == {"same_files": True, "async_v1": True, "done": True, "async_v3": True, "leftovers": []}, \
            f"rank {rank}: {out}"
    assert _tensors_json(str(tmp_path / "async")).keys() == {"model.w", "model.m", "b"}


# ------------------------------------------------------------------ bad storage
class _FailingFile:
    """A file whose writes fail with ``code`` once ``allowed`` bytes went through."""

    def __init__(self, path: str, code: int, allowed: int) -> None:
        self._file, self._path, self._code, self._left = open(path, "wb"), path, code, allowed

    def write(self, data) -> int:
        self._left -= len(data)
        if self._left < 0:
            raise OSError(self._code, os.strerror(self._code))
        return self._file.write(data)

    def __getattr__(self, name: str):
        return getattr(self._file, name)

    def __enter__(self) -> "_FailingFile":
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


def _failing_open(code: int, at_open: bool):
    """``open`` for the writer module: the data files fail (a full disk after a few bytes, or a
    permission refused at the open); anything else opens normally."""
    def fake(path, mode="r", *args, **kwargs):
        if "w" not in mode or not path.endswith(".safetensors"):
            return open(path, mode, *args, **kwargs)
        if at_open:
            raise PermissionError(code, os.strerror(code), path)
        return _FailingFile(path, code, allowed=64)
    return fake


def _save_failing(base: str, failing_rank: int, code: int, at_open: bool, asynchronous: bool) -> dict:
    """Version 1 saved; version 2's save fails on ``failing_rank``. What every rank saw."""
    path = os.path.join(base, "ckpt")
    ckpt.save(_state(1), path)
    mine = torch.distributed.get_rank() == failing_rank
    if mine:
        safetensors_io.open = _failing_open(code, at_open)  # type: ignore[attr-defined]
    try:
        if asynchronous:
            pending = ckpt.async_save(_state(2), path)
            error = _error_of(pending.result)
            again = _error_of(ckpt.wait_for_pending_save)  # result() raised it already: not twice
        else:
            error, again = _error_of(lambda: ckpt.save(_state(2), path)), None
    finally:
        if mine:
            del safetensors_io.open  # type: ignore[attr-defined]
    torch.distributed.barrier()
    return {"error": error, "again": again, "v1": _equal(_loaded(path), 1),
            "leftovers": glob.glob(glob.escape(path) + ".*")}


def _error_of(fn) -> str | None:
    try:
        fn()
    except ckpt.CheckpointError as err:
        return str(err)
    return None


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_full_disk_is_one_error_on_every_rank_and_the_previous_checkpoint_stays(dist, tmp_path, asynchronous):
    outs = dist.run(2, _save_failing, str(tmp_path), 1, errno.ENOSPC, False, asynchronous)
    want = os.path.join(str(tmp_path), "ckpt.tmp-")
    for rank, out in enumerate(outs):
        assert out["error"] == outs[0]["error"], "ranks disagree on the error"
        assert want in out["error"] and "__1.safetensors: No space left on device (ENOSPC) (on rank 1)" \
            in out["error"], out["error"]
        assert out["error"].count("\n") == 0 and out["again"] is None
        assert (out["v1"], out["leftovers"]) == (True, []), f"rank {rank}: {out}"
    assert outs[0]["error"].startswith("asynchronous save to " if asynchronous else "cannot write checkpoint file")


def test_permission_denied_names_the_file_on_every_rank(dist, tmp_path):
    outs = dist.run(2, _save_failing, str(tmp_path), 0, errno.EACCES, True, False)
    for out in outs:
        assert out["error"].startswith(f"cannot write checkpoint file {tmp_path}/ckpt.tmp-"), out["error"]
        assert out["error"].endswith("__0.safetensors: Permission denied (EACCES) (on rank 0)"), out["error"]
        assert (out["v1"], out["leftovers"]) == (True, [])


def _staging_fails(base: str) -> dict:
    """Rank 1 cannot copy its blocks to host memory: rank 0 must not wait for it forever."""
    from shardwise.checkpoint import asynchronous

    path = os.path.join(base, "ckpt")
    ckpt.save(_state(1), path)
    buffers = asynchronous._BUFFERS
    if torch.distributed.get_rank() == 1:
        asynchronous._BUFFERS = _NoMemory()  # type: ignore[assignment]
    try:
        error = _error_of(ckpt.async_save(_state(2), path).result)
    finally:
        asynchronous._BUFFERS = buffers
    torch.distributed.barrier()
    return {"error": error, "v1": _equal(_loaded(path), 1), "leftovers": glob.glob(glob.escape(path) + ".*")}


class _NoMemory:
    def stage(self, blocks):
        raise RuntimeError("out of host memory")


def test_a_rank_that_cannot_stage_fails_the_save_on_every_rank(dist, tmp_path):
    for out in dist.run(2, _staging_fails, str(tmp_path)):
        assert out["error"] == (f"asynchronous save to {tmp_path}/ckpt failed: copying the blocks to host memory "
                                f"failed: RuntimeError: out of host memory (on rank 1)"), out["error"]
        assert (out["v1"], out["leftovers"]) == (True, [])


def _save_under_a_file(path: str) -> None:
    ckpt.async_save(_state(1), path)


def test_a_path_under_a_regular_file_is_refused_before_anything_is_written(dist, tmp_path):
    (tmp_path / "file").write_text("not a directory")  # stops root too, unlike chmod
    dist.run_expect_error(2, _save_under_a_file, str(tmp_path / "file" / "ckpt"),
                          match=rf"^cannot prepare for saving {tmp_path}/file/ckpt: Not a directory \(ENOTDIR\)$")


# ------------------------------------------------------------------ retention
def test_retention_keeps_the_newest_k_committed_checkpoints(tmp_path):
    assert steps_to_prune([2, 10, 4, 6], 2) == [4, 2] and steps_to_prune([3], 1) == []
    with pytest.raises(ValueError, match="keep must be >= 1, got 0"):
        steps_to_prune([3], 0)
    for step in (2, 4, 6, 8):
        fake_checkpoint(str(tmp_path), step)
    os.makedirs(tmp_path / "step-9.tmp-0123456789ab")  # a save in progress: not retention's business
    removed = prune_checkpoints(str(tmp_path), 2)
    assert sorted(removed) == [str(tmp_path / "step-2"), str(tmp_path / "step-4")]
    assert sorted(os.listdir(tmp_path)) == ["step-6", "step-8", "step-9.tmp-0123456789ab"]


# ------------------------------------------------------------------ --resume falls back
def _train_state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(6, 5)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return TrainState(model, optimizer, scheduler, seed=7, schedule_steps=8, config="tiny")


def _save_steps(directory: str, asynchronous: bool) -> None:
    """Steps 2 and 4 saved (the model changes between them), keep 3."""
    checkpointer = DirectoryCheckpointer(directory, 2, 4, False, asynchronous, keep=3)
    state = _train_state(0)
    for step in (1, 2, 3, 4):
        state.step = step
        with torch.no_grad():
            state.model.weight.add_(1.0)
        checkpointer.after_step(state)
    checkpointer.finish()


def _restore(directory: str) -> dict:
    state = _train_state(1)
    step = DirectoryCheckpointer(directory, None, 8, True).restore(state)
    return {"step": step, "weight": state.model.weight.detach().clone(), "warning": state.resume_warning}


def test_resume_falls_back_from_a_damaged_latest_checkpoint(dist, tmp_path):
    truncated, deleted = str(tmp_path / "truncated"), str(tmp_path / "deleted")
    dist.run(2, _save_steps, truncated, True)
    dist.run(2, _save_steps, deleted, False)
    assert sorted(os.listdir(truncated)) == ["step-2", "step-4"]
    data = os.path.join(truncated, "step-4", "__0.safetensors")
    os.truncate(data, os.path.getsize(data) - 16)
    os.remove(os.path.join(deleted, "step-4", ckpt.METADATA_FILE))
    want = _train_state(0).model.weight.detach().clone()
    want.add_(1.0).add_(1.0)  # step 2's weights, as _save_steps made them
    for directory, why in ((truncated, f"checkpoint file {data} is damaged or truncated"),
                           (deleted, f"{deleted}/step-4 holds no metadata.json (half-written or half-deleted)")):
        for out in dist.run(2, _restore, directory):
            assert out["step"] == 2 and torch.equal(out["weight"], want)
            assert out["warning"].startswith(f"skipped the newer checkpoint(s): {why}"), out["warning"]
            assert out["warning"].endswith(f"; resumed from {directory}/step-2 instead")


def test_unreadable_metadata_of_the_latest_is_skipped_when_checking_the_job(tmp_path):
    for step in (2, 4):
        fake_checkpoint(str(tmp_path), step)
    (tmp_path / "step-4" / ckpt.METADATA_FILE).write_text("{not json")
    point, problems = latest_readable_checkpoint(str(tmp_path))
    assert point.step == 2 and len(problems) == 1 and "step-4/metadata.json is not valid JSON" in problems[0]


# ------------------------------------------------------------------ the trainer
@pytest.mark.e2e
def test_trainer_with_async_checkpoints_resumes_with_the_same_losses(dist, tmp_path):
    ckpt_dir, stop = str(tmp_path / "ckpt"), 3
    whole = one_process_run(tuple(BASE))
    flags = ["--nproc", "2", "--dp-shard", "2", "--checkpoint-dir", ckpt_dir, "--checkpoint-async"]
    first = dist.run(2, train_run, BASE + flags + ["--checkpoint-every", "2", "--checkpoint-keep", "1",
                                                   "--stop-after", str(stop)], timeout=240)
    assert sorted(os.listdir(ckpt_dir)) == [f"step-{stop}"]  # step-2 saved, then retention removed it
    second = dist.run(2, train_run, BASE + flags + ["--resume"], timeout=240)
    got = first[0]["losses"] + second[0]["losses"]
    assert len(got) == STEPS and max(abs(g - w) / abs(w) for g, w in zip(got, whole["losses"])) < RTOL, \
        (got, whole["losses"])
    assert sorted(os.listdir(ckpt_dir)) == [f"step-{stop}", f"step-{STEPS}"]  # no --checkpoint-keep: all
