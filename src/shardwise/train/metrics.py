"""Progress and summary of a training run: losses, throughput, memory per rank.

Losses are kept per step on every rank as local values (the mean over the rank's slice of the
batch) and reduced in one collective at each log step: the average over the data-parallel axis
is the mean over the whole global batch (every slice has the same number of tokens), so the
printed loss is the same number whatever the layout. Tensor-parallel ranks already agree.

Memory is the peak of each rank: ``torch.cuda.max_memory_allocated`` on GPU, the process's
maximum resident set size on CPU (it includes the Python interpreter and torch itself).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from shardwise import comm

__all__ = ["peak_memory_bytes", "RunMetrics", "format_bytes"]


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


@dataclass
class RunMetrics:
    """Collects per-step values and prints progress on rank 0.

    Args:
        tokens_per_step: global tokens per optimizer step (global batch x sequence length).
        total_steps: steps the run will take (for the progress line).
        dp_mesh: 1-D mesh of the data-parallel ranks (None: nothing to average over).
        world_mesh: 1-D mesh of all ranks (None: a single process).
        device: where memory is measured.
        rank: this process's global rank (rank 0 prints).
    """

    tokens_per_step: int
    total_steps: int
    dp_mesh: object = None
    world_mesh: object = None
    device: torch.device = torch.device("cpu")
    rank: int = 0
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    peak_memory: list[int] = field(default_factory=list)
    _pending: list[torch.Tensor] = field(default_factory=list)
    _last: float = field(default_factory=time.perf_counter)
    _window_start: float = field(default_factory=time.perf_counter)
    _window_steps: int = 0

    def start(self) -> None:
        """Start the clock (after setup, before the first step)."""
        self._last = self._window_start = time.perf_counter()

    def record_step(self, loss: torch.Tensor, lr: float) -> None:
        """Keep this step's local loss (a 0-d tensor, not yet synchronized) and its time."""
        now = time.perf_counter()
        self._pending.append(loss.detach().float().reshape(()))
        self.step_times.append(now - self._last)
        self.lrs.append(lr)
        self._last = now
        self._window_steps += 1

    def flush(self, step: int) -> None:
        """Reduce the pending losses and memory over the ranks; rank 0 prints the progress line."""
        if self._pending:
            local = torch.stack(self._pending)
            if self.dp_mesh is not None:
                local = comm.all_reduce(local, self.dp_mesh, 0, "avg")
            self.losses.extend(local.cpu().tolist())
            self._pending.clear()
        self.peak_memory = self._gather_memory()
        if self.rank == 0:
            print(self._progress_line(step), flush=True)
        self._window_start, self._window_steps = time.perf_counter(), 0

    def _gather_memory(self) -> list[int]:
        mine = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.int64, device=self.device)
        if self.world_mesh is None:
            return mine.tolist()
        n = self.world_mesh.size(0)
        return comm.all_gather(mine, self.world_mesh, 0, 0, [1] * n).cpu().tolist()

    def _progress_line(self, step: int) -> str:
        elapsed = time.perf_counter() - self._window_start
        window = max(self._window_steps, 1)
        tps = self.tokens_per_step * window / elapsed if elapsed > 0 else float("nan")
        width = len(str(self.total_steps))
        return (f"step {step:>{width}}/{self.total_steps} | loss {self.losses[-1]:.4f} | lr {self.lrs[-1]:.2e} | "
                f"{tps:,.0f} tok/s | {elapsed / window:.3f} s/step | "
                f"mem/rank max {format_bytes(max(self.peak_memory))}")

    # ------------------------------------------------------------------ end of run
    def summary(self) -> dict:
        """The run's figures (after the last flush)."""
        timed = self.step_times[1:] or self.step_times  # step 1 includes one-off warm-up costs
        median = statistics.median(timed) if timed else float("nan")
        return {
            "steps": len(self.losses),
            "losses": self.losses,
            "final_loss": self.losses[-1] if self.losses else None,
            "step_times_s": self.step_times,
            "median_step_s": median,
            "tokens_per_s": self.tokens_per_step / median if median > 0 else None,
            "peak_memory_bytes": self.peak_memory,
            "lrs": self.lrs,
        }

    def summary_lines(self, header: str) -> list[str]:
        s = self.summary()
        mem = ", ".join(f"r{r} {format_bytes(b)}" for r, b in enumerate(s["peak_memory_bytes"]))
        return [
            f"done: {header}",
            f"  loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f} (min {min(self.losses):.4f}) over {s['steps']} steps",
            f"  median step {s['median_step_s']:.3f} s, {s['tokens_per_s'] or 0:,.0f} tok/s",
            f"  peak memory per rank: {mem}",
        ]

    def write_json(self, path: str, extra: dict) -> None:
        with open(path, "w") as f:
            json.dump({**extra, **self.summary()}, f, indent=1)
