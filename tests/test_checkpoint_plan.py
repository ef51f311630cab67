"""shardwise.checkpoint without processes: planning, format, flattening, files, single-process use.

The planner is pure: for any global shape, mesh and placements, the blocks assigned to writers
tile each tensor exactly once (replicas written once, by the lowest coordinate), and for any
target block the read plan covers it exactly with chunks that all overlap it.
"""

from __future__ import annotations

import json
import math
import os
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as ckpt
from shardwise import Replicate, Shard
from shardwise.checkpoint import consolidation as consolidate_mod
from shardwise.checkpoint.flatten import flatten, replace_values
from shardwise.checkpoint.format import Chunk, Metadata
from shardwise.checkpoint.assignment import (
    Block, Proposal, assign_writers, full_block, proposed_block, read_plan, split_rows,
)
from shardwise.core.spec import local_shape_and_offset

safetensors_torch = pytest.importorskip("safetensors.torch")


def _coordinates(mesh_shape):
    return [tuple(int(i) for i in torch.tensor(c)) for c in torch.cartesian_prod(
        *[torch.arange(n) for n in mesh_shape]).reshape(-1, len(mesh_shape)).tolist()]


def _cover_count(shape, blocks) -> torch.Tensor:
    count = torch.zeros(shape, dtype=torch.int64)
    for b in blocks:
        count[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))] += 1
    return count


layouts = st.integers(1, 3).flatmap(lambda ndim: st.tuples(
    st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim),
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
).flatmap(lambda t: st.tuples(
    st.just(tuple(t[0])), st.just(tuple(t[1])),
    st.lists(st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard)),
             min_size=len(t[1]), max_size=len(t[1])),
)))


@settings(max_examples=60, deadline=None)
@given(layouts)
def test_written_blocks_tile_each_tensor_once(layout):
    shape, mesh_shape, placements = layout
    proposals = []
    for coordinate in _coordinates(mesh_shape):
        block = proposed_block(shape, mesh_shape, coordinate, placements)
        proposals.append([Proposal("t", "F32", shape, block)] if block is not None else [])
        if block is not None:  # only the first replica offers
            assert all(c == 0 for c, p in zip(coordinate, placements) if not isinstance(p, Shard))
    written = assign_writers([{"t": ("F32", shape)}] * len(proposals), proposals)
    blocks = [p.block for per_rank in written for p in per_rank]
    assert bool((_cover_count(shape, blocks) == 1).all())


def test_blocks_held_by_several_ranks_go_to_the_lowest_rank():
    # A plain tensor (every rank offers the whole of it) and a DTensor on a sub-mesh.
    whole = Proposal("p", "F32", (4,), full_block((4,)))
    half = [Proposal("d", "F32", (4,), Block((0,), (2,))), Proposal("d", "F32", (4,), Block((2,), (2,)))]
    declared = {"p": ("F32", (4,)), "d": ("F32", (4,))}
    written = assign_writers([declared] * 4, [[whole, half[0]], [whole, half[1]], [whole, half[0]], [whole, half[1]]])
    assert written == [[whole, half[0]], [half[1]], [], []]


def test_ranks_that_disagree_or_leave_holes_are_refused():
    a = {"t": ("F32", (4,))}
    with pytest.raises(ckpt.CheckpointError, match=r"ranks disagree on tensor 't'.*rank 1 has dtype BF16"):
        assign_writers([a, {"t": ("BF16", (4,))}], [[], []])
    with pytest.raises(ckpt.CheckpointError, match=r"tensor 't'.*add up to 2 elements instead of 4"):
        assign_writers([a, a], [[Proposal("t", "F32", (4,), Block((0,), (2,)))], []])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=0, max_size=3), st.integers(1, 8), st.integers(1, 200))
def test_row_slabs_tile_the_block_within_the_byte_limit(sizes, itemsize, max_bytes):
    block = Block(tuple(range(len(sizes))), tuple(sizes))
    slabs = split_rows(block, itemsize, max_bytes)
    assert sum(s.numel for s in slabs) == block.numel
    row_bytes = math.prod(sizes[1:]) * itemsize if sizes else itemsize
    assert all(s.numel * itemsize <= max(max_bytes, row_bytes) for s in slabs)


@settings(max_examples=60, deadline=None)
@given(layouts, st.data())
def test_read_plans_cover_any_target_block_from_any_saved_layout(layout, data):
    shape, mesh_shape, placements = layout
    saved = [proposed_block(shape, mesh_shape, c, placements) for c in _coordinates(mesh_shape)]
    written = assign_writers([{"t": ("F32", shape)}] * len(saved),
                             [[Proposal("t", "F32", shape, b)] if b else [] for b in saved])
    chunks = [Chunk(s.offsets, s.sizes, f"__{r}.safetensors", "k", 0)
              for r, per_rank in enumerate(written) for p in per_rank for s in split_rows(p.block, 4, 16)]
    target_mesh = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    target_placements = data.draw(st.lists(st.one_of(st.just(Replicate()), st.integers(0, len(shape) - 1).map(Shard)),
                                           min_size=len(target_mesh), max_size=len(target_mesh)))
    for coordinate in _coordinates(target_mesh):
        sizes, offsets = local_shape_and_offset(shape, target_mesh, coordinate, target_placements)
        target = Block(tuple(offsets), tuple(sizes))
        reads = read_plan(target, chunks)
        assert sum(r.part.numel for r in reads) == target.numel
        assert all(r.chunk_block.intersect(target) == r.part for r in reads)  # no chunk it does not need
        if target.numel:
            assert bool((_cover_count(shape, [r.part for r in reads]) <= 1).all())


def test_metadata_round_trips_and_rejects_damage():
    meta = Metadata({"a.w": ckpt.format.TensorEntry("F32", (3, 2), (
        Chunk((0, 0), (2, 2), "__0.safetensors", "a.w@0,0", 1), Chunk((2, 0), (1, 2), "__1.safetensors", "a.w@2,0", 2)))},
        {"step": 3, "name": "x"})
    assert Metadata.from_json(meta.to_json(), "m") == meta
    doc = json.loads(meta.to_json())
    bad = [
        (lambda d: d.update(version=99), r"format version 99"),
        (lambda d: d["tensors"]["a.w"]["chunks"][0].update(file="../evil"), r"plain file name"),
        (lambda d: d["tensors"]["a.w"]["chunks"][1].update(offsets=[2, 1]), r"lies outside shape"),
        (lambda d: d["tensors"]["a.w"].update(shape=[4, 2]), r"'a\.w'.*6 elements but shape \[4, 2\] has 8"),
        (lambda d: d["tensors"]["a.w"].update(dtype="F33"), r"unknown dtype 'F33'"),
    ]
    for damage, match in bad:
        copy = json.loads(json.dumps(doc))
        damage(copy)
        with pytest.raises(ckpt.CheckpointError, match=match):
            Metadata.from_json(json.dumps(copy), "m")
    with pytest.raises(ckpt.CheckpointError, match="not valid JSON"):
        Metadata.from_json(meta.to_json()[:-5], "m")


def test_flatten_keys_and_in_place_values():
    sd = {"model": {"layers.0.w": torch.zeros(2)}, "optim": {"state": {0: {"step": 1}}, "groups": [{"betas": (0.9, 0.99)}]}}
    flat = flatten(sd)
    assert list(flat) == ["model.layers.0.w", "optim.state.0.step", "optim.groups.0.betas.0", "optim.groups.0.betas.1"]
    groups = sd["optim"]["groups"]
    replace_values(sd, lambda k, old: 0.5 if k.endswith("betas.1") else old)
    assert sd["optim"]["groups"] is groups and groups[0]["betas"] == (0.9, 0.5)
    with pytest.raises(ckpt.CheckpointError, match=r"same key 'a\.b'"):
        flatten({"a.b": 1, "a": {"b": 2}})
    with pytest.raises(ckpt.CheckpointError, match=r"'x\.0' is the float nan"):
        flatten({"x": [float("nan")]})
    with pytest.raises(ckpt.CheckpointError, match=r"key \(1, 2\) under 'x' is a tuple"):
        flatten({"x": {(1, 2): 3}})


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(9, 4, generator=g), "e": torch.zeros(0, 3), "s": torch.tensor(seed),
                      "h": torch.randn(5, generator=g).to(torch.bfloat16)}, "step": seed, "tag": [None, "x"]}


def test_single_process_save_load_and_bounded_consolidate(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    ckpt.save(_state(1), path, max_chunk_bytes=40)  # several slabs per tensor
    target = _state(2)
    ckpt.load(target, path)
    want = _state(1)
    assert target["step"] == 1 and target["tag"] == [None, "x"]
    assert all(torch.equal(target["model"][k], want["model"][k]) for k in want["model"])
    # consolidate holds one whole tensor at a time.
    live = []
    real = consolidate_mod.read_full_tensor

    def tracked(*args):
        assert all(ref() is None for ref in live), "consolidate held two tensors at once"
        out = real(*args)
        live.append(weakref.ref(out))
        return out

    monkeypatch.setattr(consolidate_mod, "read_full_tensor", tracked)
    out = str(tmp_path / "model.safetensors")
    assert ckpt.consolidate(path, out, prefix="model.") == ["e", "h", "s", "w"]
    loaded = safetensors_torch.load_file(out)
    assert all(torch.equal(loaded[k], want["model"][k]) for k in want["model"])


def test_crash_between_renames_reads_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    ckpt.save(_state(1), path)
    os.rename(path, path + ".old-abc")  # as if killed between the two renames of a commit
    target = _state(3)
    ckpt.load(target, path)
    assert target["step"] == 1
    ckpt.save(_state(4), path)  # the next save puts it back, then replaces it
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    ckpt.load(target, path)
    assert target["step"] == 4


def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    with pytest.raises(ckpt.CheckpointError, match=r"not a checkpoint; refusing to replace it"):
        ckpt.save(_state(1), str(tmp_path / "data"))
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"


def test_an_outside_reader_rebuilds_tensors_from_the_documented_format(tmp_path):
    """json + safetensors + zlib only, following the package docstring."""
    import zlib

    from safetensors import safe_open

    path = tmp_path / "ckpt"
    ckpt.save(_state(5), str(path), max_chunk_bytes=24)
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["format"] == "shardwise-checkpoint" and meta["version"] == 1 and meta["values"]["step"] == 5
    for key, entry in meta["tensors"].items():
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64}[entry["dtype"]]
        whole = torch.empty(entry["shape"], dtype=dtype)
        for c in entry["chunks"]:
            with safe_open(str(path / c["file"]), "pt") as f:
                data = f.get_tensor(c["key"])
            assert zlib.crc32(data.reshape(-1).view(torch.uint8).numpy().tobytes()) == c["crc32"]
            whole[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"]))] = data
        assert torch.equal(whole, _state(5)["model"][key.removeprefix("model.")]), key


def test_ranks_may_save_different_keys_but_agree_on_shared_ones():
    """Pipeline stages hold different modules: each key is written by the ranks that hold it."""
    from shardwise.checkpoint.assignment import merged_declarations

    a, b = {"x": ("F32", (2,)), "s": ("F32", ())}, {"y": ("F32", (3,)), "s": ("F32", ())}
    assert merged_declarations([a, b]) == {"x": ("F32", (2,)), "s": ("F32", ()), "y": ("F32", (3,))}
    px, py, ps = (Proposal(k, "F32", shape, full_block(shape)) for k, shape in (("x", (2,)), ("y", (3,)), ("s", ())))
    assert assign_writers([a, b], [[px, ps], [py, ps]]) == [[px, ps], [py]]
    with pytest.raises(ckpt.CheckpointError, match=r"ranks disagree on tensor 's': rank 0 has dtype F32 shape \[\], "
                                                   r"rank 1 has dtype F32 shape \[1\]"):
        merged_declarations([a, {"s": ("F32", (1,))}])
