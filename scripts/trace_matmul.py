#!/usr/bin/env python
"""Print the shardwise functions ``a @ b`` visits, on a cache miss and then on a hit.

    python -m shardwise.launch --nproc 2 scripts/trace_matmul.py

``a`` [8, 4] and ``b`` [4, 3] are both Shard(0) on a 1-D mesh of 2 ranks, so one of them must
move: the miss prices the rule's candidates with the cost model and plans the move, the hit
runs the cached runner (the move, then the local mm). Rank 0 prints each call into a shardwise module (file:function), indented by
depth, once per call site in a row; docs/trace.md is this output, explained.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import shardwise
from shardwise import Shard

ROOT = os.path.dirname(os.path.abspath(shardwise.__file__)) + os.sep
MAX_DEPTH = 9  # deeper calls are the rules' own helpers
# Frames that are not steps: comprehensions, lambdas, dunder helpers of values, the import hook.
_SKIPPED = ("<", "__hash__", "__eq__", "__post_init__", "_DynamoImportHook")


def _traced(fn) -> list[str]:
    lines: list[str] = []
    depth = [0]

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(ROOT):
            return
        if event == "call":
            name = frame.f_code.co_qualname
            shown = depth[0] < MAX_DEPTH and not any(part in name for part in _SKIPPED)
            line = f"{'  ' * depth[0]}{path[len(ROOT):]}:{name}"
            if shown and (not lines or lines[-1] != line):
                lines.append(line)
            depth[0] += 1
        elif event == "return":
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return lines


def main() -> None:
    dist.init_process_group("gloo")
    mesh = shardwise.init_device_mesh("cpu", (dist.get_world_size(),))
    a = shardwise.distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    b = shardwise.distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    shardwise.dispatch.clear_cache()
    miss = _traced(lambda: a @ b)
    hit = _traced(lambda: a @ b)
    if dist.get_rank() == 0:
        print("# cache miss (first a @ b of this signature)")
        print("\n".join(miss))
        print("\n# cache hit (the same call again)")
        print("\n".join(hit))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
