#!/usr/bin/env python
"""Checkpoint benchmark: shardwise.checkpoint vs torch.distributed.checkpoint, same run, 4 CPU ranks.

    python benchmarks/checkpoint.py             # debug (~4M params) and large (~80M) models
    python benchmarks/checkpoint.py --quick     # debug model, one repetition (smoke check)
    python benchmarks/checkpoint.py --models large --layouts tp --reps 5 --dir /data/bench

The script starts 4 local gloo workers itself (torch's elastic launcher); under torchrun it
just runs. The state is a Llama-shaped model's parameters plus AdamW moments (exp_avg,
exp_avg_sq, step), fp32, in two layouts over a (4,) mesh:

* ``fsdp``: every parameter and moment Shard(0);
* ``tp``: column-parallel weights (wq, wk, wv, w1, w3, embedding, output) Shard(0), row-parallel
  ones (wo, w2) Shard(1), norms replicated (written once).

Both libraries get DTensors (shardwise's and torch.distributed.tensor's) over the same local
blocks, and save to / load from a fresh directory each time (each fsyncs its files). Reported,
per model and layout: median save and load wall time over --reps (barrier before and after;
the slowest rank's time), bytes written per rank (the files each rank wrote; rank 0 also
writes the metadata), and the ratios ours/torch. Then the time training is blocked per save:
the synchronous save (``save`` / ``dcp.save``) against the asynchronous one's call
(``async_save`` / ``dcp.async_save``, each on a gloo group of its own), which returns once the
blocks are staged in host memory, with the asynchronous save's total time to its commit
(``result()``); blocked/sync is the fraction of a synchronous save's stall that remains. Loads go into zero-filled targets of the same
layout and are checked against the saved blocks; a mismatch is printed as WRONG (exit 3).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

from shardwise.launch import main_or_launch

NPROC = 4
EXIT_WRONG = 3
MODELS = {  # dim, layers, ffn hidden, vocab
    "debug": (256, 4, 688, 2048),
    "large": (768, 8, 2048, 16384),
}
LAYOUTS = ("fsdp", "tp")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="debug model only, one repetition")
    p.add_argument("--models", default=None, help="comma-separated among debug,large (default both)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated among fsdp,tp")
    p.add_argument("--reps", type=int, default=None, help="repetitions per library (default 3, --quick 1)")
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    args = p.parse_args(argv)
    args.models = (args.models or ("debug" if args.quick else "debug,large")).split(",")
    args.layouts = args.layouts.split(",")
    args.reps = args.reps or (1 if args.quick else 3)
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")
    for lay in args.layouts:
        if lay not in LAYOUTS:
            p.error(f"unknown layout {lay!r}; choose from {LAYOUTS}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


# ====================================================================== the state
def param_shapes(model: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Parameter name -> (shape, role), role in colwise / rowwise / norm."""
    dim, layers, hidden, vocab = MODELS[model]
    shapes = {"tok_embeddings.weight": ((vocab, dim), "colwise")}
    for i in range(layers):
        pre = f"layers.{i}."
        for name in ("wq", "wk", "wv"):
            shapes[pre + f"attention.{name}.weight"] = ((dim, dim), "colwise")
        shapes[pre + "attention.wo.weight"] = ((dim, dim), "rowwise")
        shapes[pre + "feed_forward.w1.weight"] = ((hidden, dim), "colwise")
        shapes[pre + "feed_forward.w3.weight"] = ((hidden, dim), "colwise")
        shapes[pre + "feed_forward.w2.weight"] = ((dim, hidden), "rowwise")
        shapes[pre + "attention_norm.weight"] = ((dim,), "norm")
        shapes[pre + "ffn_norm.weight"] = ((dim,), "norm")
    shapes["norm.weight"] = ((dim,), "norm")
    shapes["output.weight"] = ((vocab, dim), "colwise")
    return shapes


def placement_of(layout: str, role: str) -> str:
    if layout == "fsdp":
        return "S0"
    return {"colwise": "S0", "rowwise": "S1", "norm": "R"}[role]


@dataclass
class Block:
    """One tensor of the state: global shape, placement and this rank's local block."""

    shape: tuple[int, ...]
    placement: str
    local: "object"


def local_blocks(model: str, layout: str, rank: int) -> dict[str, Block]:
    """Flat key -> this rank's block of params and AdamW moments (deterministic values)."""
    import torch

    from shardwise import Replicate, Shard
    from shardwise.core.spec import local_shape_and_offset

    out = {}
    for name, (shape, role) in param_shapes(model).items():
        placement = placement_of(layout, role)
        p = Replicate() if placement == "R" else Shard(int(placement[1]))
        local_shape, _ = local_shape_and_offset(shape, (NPROC,), (rank,), [p])
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            # Replicas must hold equal values: their seed does not depend on the rank.
            seed = zlib.crc32(f"{kind}:{name}".encode()) + (0 if placement == "R" else 7919 * (rank + 1))
            g = torch.Generator().manual_seed(seed)
            out[f"{kind}:{name}"] = Block(shape, placement, torch.randn(local_shape, generator=g))
    return out


def build_state(lib: str, blocks: dict[str, Block], mesh, zeros: bool) -> dict:
    """{"model": {...}, "optim": {"state": {name: {...}}}} of ``lib`` DTensors over ``blocks``."""
    import torch

    if lib == "shardwise":
        from shardwise import DTensor, Replicate, Shard
    else:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    model, optim = {}, {}
    for key, b in blocks.items():
        kind, name = key.split(":", 1)
        p = Replicate() if b.placement == "R" else Shard(int(b.placement[1]))
        local = torch.zeros_like(b.local) if zeros else b.local
        dt = DTensor.from_local(local, mesh, [p], run_check=False, shape=torch.Size(b.shape),
                                stride=_contiguous(b.shape))
        if kind == "param":
            model[name] = dt
        else:
            optim.setdefault(name, {"step": torch.tensor(0.0 if zeros else 10.0)})[kind] = dt
    return {"model": model, "optim": {"state": optim}}


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _locals(state: dict) -> dict[str, "object"]:
    out = {}
    for name, t in state["model"].items():
        out[f"param:{name}"] = t.to_local()
    for name, moments in state["optim"]["state"].items():
        for kind in ("exp_avg", "exp_avg_sq"):
            out[f"{kind}:{name}"] = moments[kind].to_local()
    return out


# ====================================================================== measuring
def _barrier_time(fn) -> float:
    """Wall time of ``fn`` on the slowest rank (barriers before and after)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _save(lib: str, state: dict, path: str) -> None:
    if lib == "shardwise":
        import shardwise.checkpoint as ckpt

        ckpt.save(state, path)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=path)


def _load(lib: str, state: dict, path: str) -> None:
    if lib == "shardwise":
        import shardwise.checkpoint as ckpt

        ckpt.load(state, path)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=path)


def _bytes_written(lib: str, path: str, rank: int) -> int:
    """Bytes of the files this rank wrote (its data file(s); rank 0 also the metadata)."""
    total = 0
    for name in os.listdir(path):
        mine = name.startswith(f"__{rank}.") if lib == "shardwise" else name.startswith(f"__{rank}_")
        meta = name in ("metadata.json", ".metadata")
        if mine or (meta and rank == 0):
            total += os.path.getsize(os.path.join(path, name))
    return total


@dataclass
class Measure:
    save_s: float
    load_s: float
    bytes_per_rank: list[int]
    correct: bool
    blocked_s: float = 0.0  # the asynchronous save's call: how long training waits
    async_total_s: float = 0.0  # the asynchronous save from its call to its commit


def _async_save(lib: str, state: dict, path: str, group):
    """Start an asynchronous save; return what to wait on (``result()``)."""
    if lib == "shardwise":
        import shardwise.checkpoint as ckpt

        return ckpt.async_save(state, path)
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(state, checkpoint_id=path, process_group=group)


def _async_times(lib: str, state: dict, path: str, group) -> tuple[float, float]:
    """(blocked s, total s) of one asynchronous save, the slowest rank's each."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    pending = _async_save(lib, state, path, group)
    blocked = time.perf_counter() - t0
    pending.result()
    total = time.perf_counter() - t0
    times = torch.tensor([blocked, total], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return float(times[0]), float(times[1])


def warm_up_async(meshes: dict[str, object], base: str, group) -> None:
    """One small asynchronous save per library: the groups, threads and imports are not timed."""
    import torch

    for lib, mesh in meshes.items():
        block = Block((4,), "R", torch.zeros(4))
        _async_times(lib, build_state(lib, {"param:w": block}, mesh, zeros=False), os.path.join(base, f"warm-{lib}"),
                     group)


def measure(blocks: dict[str, Block], meshes: dict[str, object], base: str, reps: int, tag: str,
            group=None) -> dict[str, Measure]:
    """Both libraries, repetitions interleaved (the order alternates) so neither gets a warmer disk."""
    import torch.distributed as dist

    sources = {lib: build_state(lib, blocks, mesh, zeros=False) for lib, mesh in meshes.items()}
    times: dict[str, tuple[list, list]] = {lib: ([], []) for lib in meshes}
    async_times: dict[str, list[tuple[float, float]]] = {lib: [] for lib in meshes}
    written, correct = {lib: 0 for lib in meshes}, {lib: True for lib in meshes}
    for rep in range(reps):
        order = list(meshes) if rep % 2 == 0 else list(reversed(meshes))
        for lib in order:
            path = os.path.join(base, f"{tag}-{lib}-{rep}")
            save_s, load_s, written[lib], ok = _one_rep(lib, sources[lib], blocks, meshes[lib], path)
            times[lib][0].append(save_s)
            times[lib][1].append(load_s)
            correct[lib] &= ok
            async_times[lib].append(_async_times(lib, sources[lib], path + "-async", group))
    gathered = [None] * NPROC
    dist.all_gather_object(gathered, (written, correct))
    return {lib: Measure(statistics.median(times[lib][0]), statistics.median(times[lib][1]),
                         [w[lib] for w, _ in gathered], all(c[lib] for _, c in gathered),
                         statistics.median(b for b, _ in async_times[lib]),
                         statistics.median(t for _, t in async_times[lib]))
            for lib in meshes}


def _one_rep(lib: str, source: dict, blocks: dict[str, Block], mesh, path: str) -> tuple[float, float, int, bool]:
    """Save, load into zeros, check; (save s, load s, bytes this rank wrote, correct)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    save_s = _barrier_time(lambda: _save(lib, source, path))
    written = _bytes_written(lib, path, rank)
    target = build_state(lib, blocks, mesh, zeros=True)
    load_s = _barrier_time(lambda: _load(lib, target, path))
    got = _locals(target)
    ok = all(torch.equal(got[k], b.local) for k, b in blocks.items())
    ok &= all(float(m["step"]) == 10.0 for m in target["optim"]["state"].values())
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return save_s, load_s, written, ok


# ====================================================================== main
def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _report(model: str, layout: str, n_params: int, results: dict[str, Measure]) -> list[str]:
    ours, theirs = results["shardwise"], results["torch"]
    ratio_bytes = sum(ours.bytes_per_rank) / max(sum(theirs.bytes_per_rank), 1)
    ratio_time = (ours.save_s + ours.load_s) / (theirs.save_s + theirs.load_s)
    lines = [f"== model {model} ({n_params / 1e6:.1f}M params + 2 AdamW moments, fp32), layout {layout}"]
    for lib, m in results.items():
        flag = "" if m.correct else "   !! WRONG values after load"
        lines.append(f"  {lib:9s}: save {m.save_s:7.3f} s  load {m.load_s:7.3f} s  bytes written per rank "
                     f"[{', '.join(_fmt_bytes(b) for b in m.bytes_per_rank)}] total "
                     f"{_fmt_bytes(sum(m.bytes_per_rank))}{flag}")
    lines.append(f"  ratio ours/torch: bytes {ratio_bytes:.3f}x, save+load time {ratio_time:.2f}x "
                 f"(save {ours.save_s / theirs.save_s:.2f}x, load {ours.load_s / theirs.load_s:.2f}x)")
    for lib, m in results.items():
        lines.append(f"  {lib:9s}: blocked per save: sync {m.save_s:7.3f} s, async {m.blocked_s:7.3f} s "
                     f"({m.blocked_s / m.save_s:.3f}x of sync; the async save commits after {m.async_total_s:.3f} s)")
    lines.append(f"BLOCKED {model} {layout}: ours_sync={ours.save_s:.4f} ours_async={ours.blocked_s:.4f} "
                 f"ours_ratio={ours.blocked_s / ours.save_s:.4f} torch_sync={theirs.save_s:.4f} "
                 f"torch_async={theirs.blocked_s:.4f} torch_ratio={theirs.blocked_s / theirs.save_s:.4f}")
    lines.append(f"RESULT {model} {layout}: bytes_ratio={ratio_bytes:.4f} time_ratio={ratio_time:.4f} "
                 f"ours_save={ours.save_s:.4f} ours_load={ours.load_s:.4f} "
                 f"torch_save={theirs.save_s:.4f} torch_load={theirs.load_s:.4f} "
                 f"correct={int(ours.correct and theirs.correct)}")
    return lines


def worker() -> int:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import shardwise as sw

    warnings.filterwarnings("ignore")
    args = parse_args(sys.argv[1:])
    torch.set_num_threads(1)
    sw_mesh = sw.init_device_mesh("cpu", (NPROC,))
    t_mesh = torch_mesh("cpu", (NPROC,))
    rank = dist.get_rank()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "manual")
    base = os.path.join(args.dir or tempfile.gettempdir(), f"shardwise-ckpt-bench-{run_id}")
    if rank == 0:
        os.makedirs(base, exist_ok=True)
    dist.barrier()
    group = dist.new_group(backend="gloo")  # torch's async_save: its checkpoint traffic off the default group
    all_ok = True
    try:
        warm_up_async({"shardwise": sw_mesh, "torch": t_mesh}, base, group)
        for model in args.models:
            n_params = sum(_numel(s) for s, _ in param_shapes(model).values())
            for layout in args.layouts:
                blocks = local_blocks(model, layout, rank)
                meshes = {"shardwise": sw_mesh, "torch": t_mesh}
                results = measure(blocks, meshes, base, args.reps, f"{model}-{layout}", group)
                all_ok &= all(m.correct for m in results.values())
                if rank == 0:
                    print("\n".join(_report(model, layout, n_params, results)), flush=True)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    return 0 if all_ok else EXIT_WRONG


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and bad flags answer once, before any worker starts
    main_or_launch(worker, NPROC, quiet_codes=(EXIT_WRONG,))
