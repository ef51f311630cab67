#!/usr/bin/env python
"""Context-parallel attention benchmark: shardwise's ring attention and torch's context_parallel, in one run.

    python benchmarks/context_parallel.py            # 4 CPU ranks, causal GQA attention, 2048 tokens
    python benchmarks/context_parallel.py --quick    # 1024 tokens, 3 reps (smoke check)
    python benchmarks/context_parallel.py --seq-len 8192 --heads 16 --kv-heads 4 --reps 5

The script starts 4 local gloo workers itself; under torchrun it just runs. Every rank holds the
whole q/k/v (same seed); each library's ``context_parallel`` shards them along the sequence
over a 1-D cp mesh of all ranks (load-balanced layout), and one repetition is
``F.scaled_dot_product_attention`` forward and backward on the shards:

    shardwise   shardwise.parallel.context_parallel: ring attention (k/v passed point-to-point)
    torch       torch.distributed.tensor.experimental.context_parallel (its default ring)
    single      the whole sequence on rank 0 alone (torch's SDPA kernel), for scale

Reported: the median time of a repetition (each timed from a barrier, the slowest rank), the
ratio shardwise/torch, the peak memory per rank (the rise of the process's peak RSS over one
repetition, the inputs already allocated), the bytes each rank sent (shardwise's
``CommDebugMode``) against (cp - 1) / cp of the K and V bytes, and the largest relative
difference of shardwise's output and gradients from the single-device ones (above 1e-4 the run
is marked WRONG and exits 3). A library that cannot run here (torch's context parallelism
needs the CUDA attention kernels) is reported with its exact error instead of a time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _worker import gloo_worker, say, slowest  # noqa: E402 (the benchmark directory is not a package)
from train_step import PeakRSS  # noqa: E402

from shardwise.launch import main_or_launch  # noqa: E402

NPROC = 4
EXIT_WRONG = 3
AGREE_RTOL = 1e-4


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=None, help="tokens (default 2048; --quick 1024)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="grouped-query attention when below --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per library (default 5; --quick 3)")
    p.add_argument("--non-causal", action="store_true", help="full attention instead of causal")
    p.add_argument("--quick", action="store_true", help="1024 tokens, 3 reps")
    args = p.parse_args(argv)
    args.seq_len = args.seq_len or (1024 if args.quick else 2048)
    args.reps = args.reps or (3 if args.quick else 5)
    if args.seq_len % (2 * NPROC):
        p.error(f"--seq-len {args.seq_len} must divide into 2 x cp = {2 * NPROC} chunks")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


class Bench:
    def __init__(self, args) -> None:
        import torch
        import torch.distributed as dist

        self.args, self.torch, self.dist = args, torch, dist
        self.rank = dist.get_rank()
        self.causal = not args.non_causal
        self.gqa = args.heads != args.kv_heads

    say = staticmethod(say)
    slowest = staticmethod(slowest)

    def per_rank(self, value: int) -> list[int]:
        out = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(out, value)
        return out

    def inputs(self):
        a, torch = self.args, self.torch
        g = torch.Generator().manual_seed(0)
        q = torch.randn(a.batch, a.heads, a.seq_len, a.head_dim, generator=g)
        k = torch.randn(a.batch, a.kv_heads, a.seq_len, a.head_dim, generator=g)
        v = torch.randn(a.batch, a.kv_heads, a.seq_len, a.head_dim, generator=g)
        dout = torch.randn(q.shape, generator=g)
        return q, k, v, dout

    def attend(self, q, k, v, dout):
        """One repetition on whatever q/k/v hold: forward and backward; (out, dq, dk, dv)."""
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = self.torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                                                    enable_gqa=self.gqa)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def timed(self, run) -> tuple[float, int, object]:
        """(median seconds on the slowest rank, peak RSS rise of one rep, last result)."""
        result = run()  # warm-up: first-use caches, process groups
        times = []
        for _ in range(self.args.reps):
            self.dist.barrier()
            start = time.perf_counter()
            result = run()
            times.append(self.slowest(time.perf_counter() - start))
        del result
        with PeakRSS() as mem:
            result = run()
        return statistics.median(times), mem.peak, result

    # ------------------------------------------------------------------ the libraries
    def shardwise(self, inputs):
        import shardwise as sw
        from shardwise.debug import CommDebugMode
        from shardwise.parallel import context_parallel, context_parallel_unshard

        mesh = sw.init_device_mesh("cpu", (NPROC,), mesh_dim_names=("cp",))
        q, k, v, dout = (t.clone() for t in inputs)
        with context_parallel(mesh, buffers=[q, k, v, dout], seq_dims=[2] * 4):
            seconds, peak, _ = self.timed(lambda: self.attend(q, k, v, dout))
            with CommDebugMode() as comms:
                result = self.attend(q, k, v, dout)
            kv_bytes = 2 * k.numel() * k.element_size() * NPROC
            whole = context_parallel_unshard(mesh, list(result), [2] * 4)
        return seconds, peak, comms.bytes_sent, kv_bytes, whole

    def torch_cp(self, inputs):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (NPROC,), mesh_dim_names=("cp",))
        q, k, v, dout = (t.clone() for t in inputs)
        with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2] * 4):
            seconds, peak, _ = self.timed(lambda: self.attend(q, k, v, dout))
        return seconds, peak

    def single(self, inputs):
        """The whole sequence on rank 0 (the others wait at the barrier)."""
        if self.rank != 0:
            self.dist.barrier()
            return None, None
        start = time.perf_counter()
        for _ in range(self.args.reps):
            result = self.attend(*inputs)
        seconds = (time.perf_counter() - start) / self.args.reps
        self.dist.barrier()
        return seconds, result

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        a = self.args
        self.say(f"context-parallel attention: cp={NPROC} ranks (gloo, CPU), q [{a.batch}, {a.heads}, {a.seq_len}, "
                 f"{a.head_dim}], k/v heads {a.kv_heads}, {'causal' if self.causal else 'non-causal'}, "
                 f"forward + backward, {a.reps} reps")
        inputs = self.inputs()
        single_s, want = self.single(inputs)
        sw_s, sw_peak, sent, kv_bytes, got = self.shardwise(inputs)
        sw_peaks = self.per_rank(sw_peak)
        sent_per_rank = self.per_rank(sent)
        try:
            torch_s, torch_peak = self.torch_cp(inputs)
            torch_peaks, torch_error = self.per_rank(torch_peak), None
        except Exception as err:  # noqa: BLE001 (reported, not hidden: the exact error is printed)
            torch_s, torch_peaks, torch_error = None, None, f"{type(err).__name__}: {err}"
        if self.rank != 0:
            return 0
        worst = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
        mib = 2 ** 20
        print(f"single      rank 0 alone: {single_s * 1e3:9.1f} ms per rep (the whole sequence)")
        print(f"shardwise   {sw_s * 1e3:9.1f} ms per rep (x{single_s / sw_s:.2f} vs single), peak MiB/rank "
              f"{[round(p / mib, 1) for p in sw_peaks]}")
        print(f"            sent per rank (forward + backward): {[round(s / mib, 2) for s in sent_per_rank]} MiB; "
              f"forward share (cp-1)/cp of K and V = {(NPROC - 1) / NPROC * kv_bytes / mib:.2f} MiB")
        print(f"            agreement with single device (out, dq, dk, dv): max rel diff {worst:.2e}")
        if torch_error is None:
            print(f"torch       {torch_s * 1e3:9.1f} ms per rep, peak MiB/rank {[round(p / mib, 1) for p in torch_peaks]}")
            print(f"ratio shardwise/torch: time {sw_s / torch_s:.2f}, peak memory "
                  f"{max(sw_peaks) / max(max(torch_peaks), 1):.2f}")
        else:
            print(f"torch       unavailable here: {torch_error}")
        if worst > AGREE_RTOL:
            print(f"!! WRONG: shardwise's ring attention differs from single-device SDPA by {worst:.2e}")
            return EXIT_WRONG
        return 0


def worker() -> int:
    return gloo_worker(lambda: Bench(parse_args(sys.argv[1:])).run())


if __name__ == "__main__":
    parse_args(sys.argv[1:])  # --help and bad flags answer once, before any worker starts
    main_or_launch(worker, NPROC, quiet_codes=(EXIT_WRONG,))
