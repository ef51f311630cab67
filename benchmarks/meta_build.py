#!/usr/bin/env python
"""Build a Llama on the meta device and parallelize it with FSDP+TP: no rank holds more than its shards.

    python benchmarks/meta_build.py                                   # llama3_8b, 8 ranks, meta only
    python benchmarks/meta_build.py --layers 4 --materialize          # 4 blocks of it, then to_empty + init
    python -m shardwise.launch --nproc 8 benchmarks/meta_build.py     # the same, launched explicitly

The script starts its ranks itself (torch's elastic launcher; under a launcher it just runs).
Each rank runs the trainer's own path (``shardwise.train.models.llama.build_llama``): the
``Transformer`` built under ``torch.device("meta")``, then TP over "tp" and FSDP over
"dp_shard" (``parallelize_llama``). Reported per rank: peak resident memory (``ru_maxrss``)
before and after, the parameter count (global shapes of the DTensor parameters; it must equal
the config's count) and the bytes of this rank's shards. With ``--materialize`` each rank then
calls ``to_empty(device="cpu")`` and ``init_weights()``: its peak RSS should grow by about its
shard bytes (plus the one-block temporaries of initialization), never by the whole model.
A parameter block that is not meta before ``to_empty`` is reported as WRONG (exit 3).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import resource
import sys
import time

from shardwise.launch import main_or_launch

EXIT_WRONG = 3


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="llama3_8b", help="a trainer config name (default llama3_8b)")
    p.add_argument("--nproc", type=int, default=8, help="ranks (default 8)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2); dp_shard = nproc / tp")
    p.add_argument("--layers", type=int, default=None, help="override the config's block count (to fit --materialize)")
    p.add_argument("--materialize", action="store_true", help="then to_empty(device='cpu') + init_weights()")
    args = p.parse_args(argv)
    if args.nproc % args.tp:
        p.error(f"--tp {args.tp} does not divide --nproc {args.nproc}")
    return args


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker() -> int:
    import torch
    import torch.distributed as dist

    from shardwise.tensor import random as sw_random
    from shardwise.tensor.dtensor import DTensor
    from shardwise.parallel.dims import ParallelDims
    from shardwise.train.config import get_model_args
    from shardwise.train.models.llama import build_llama
    from shardwise.train.parallelize import ParallelOptions

    args = parse_args(sys.argv[1:])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_args = get_model_args(args.config)
    if args.layers is not None:
        model_args = dataclasses.replace(model_args, n_layers=args.layers)
    dims = ParallelDims(dp_shard=world // args.tp, tp=args.tp, world_size=world)
    mesh = dims.build_mesh("cpu")
    dist.barrier()

    row = {"rank": rank, "rss_before": peak_rss_mib()}
    start = time.perf_counter()
    sw_random.manual_seed(0)
    model = build_llama(model_args, dims, mesh, ParallelOptions(), "cpu", materialize=False)
    row["build_s"] = time.perf_counter() - start
    row["rss_meta"] = peak_rss_mib()
    params = list(model.parameters())
    locals_ = [p._local_tensor if isinstance(p, DTensor) else p for p in params]
    row["all_meta"] = all(t.is_meta for t in locals_)
    row["params"] = sum(math.prod(p.shape) for p in params)
    row["shard_bytes"] = sum(t.numel() * t.element_size() for t in locals_)
    row["layouts"] = sorted({str(tuple(p.placements)) for p in params if isinstance(p, DTensor)})
    if args.materialize:
        start = time.perf_counter()
        model.to_empty(device="cpu")
        model.init_weights()
        row["init_s"] = time.perf_counter() - start
        row["rss_init"] = peak_rss_mib()
        row["cpu"] = all(not p._local_tensor.is_meta for p in model.parameters() if isinstance(p, DTensor))
    rows = [None] * world
    dist.all_gather_object(rows, row)
    ok = all(r["all_meta"] and r["params"] == model_args.num_params() for r in rows)
    if rank == 0:
        print("\n".join(_report(args, model_args.num_params(), rows)), flush=True)
        if not ok:
            print("WRONG: a block was allocated before to_empty, or the parameter count differs", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else EXIT_WRONG


def _report(args: argparse.Namespace, expected: int, rows: list[dict]) -> list[str]:
    lines = [
        f"meta build of {args.config}{f' with {args.layers} blocks' if args.layers else ''} "
        f"({expected / 1e9:.2f}B params by the config), "
        f"dp_shard={len(rows) // args.tp} x tp={args.tp} on {len(rows)} CPU ranks",
        f"  layouts: {'; '.join(rows[0]['layouts'])}",
        "  rank  params(global)  shard MiB  peak RSS MiB: start -> after meta build"
        + ("  -> after to_empty+init  (growth / shard)" if args.materialize else ""),
    ]
    for r in rows:
        shard = r["shard_bytes"] / 2**20
        line = (f"  {r['rank']:>4}  {r['params']:>14,}  {shard:>9.1f}  "
                f"{r['rss_before']:>10.0f} -> {r['rss_meta']:>6.0f} (+{r['rss_meta'] - r['rss_before']:.0f})"
                f"{'' if r['all_meta'] else '  NOT META'}")
        if args.materialize:
            growth = r["rss_init"] - r["rss_meta"]
            line += f"  -> {r['rss_init']:>6.0f} (+{growth:.0f}, {growth / shard:.2f}x)"
        lines.append(line)
    build = max(r["build_s"] for r in rows)
    lines.append(f"  meta build + parallelize: {build:.2f} s (slowest rank)"
                 + (f"; to_empty + init_weights: {max(r['init_s'] for r in rows):.2f} s" if args.materialize else ""))
    return lines


if __name__ == "__main__":
    parsed = parse_args(sys.argv[1:])  # --help and bad flags answer once, before any worker starts
    main_or_launch(worker, parsed.nproc, quiet_codes=(EXIT_WRONG,))
