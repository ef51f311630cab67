"""Progress and summary of a training run: losses, throughput, memory per rank.

Losses are kept per step on every rank as local values (the mean over the rank's slice of the
batch) and reduced in one collective at each log step: the average over the data-parallel axis
is the mean over the whole global batch (every slice has the same number of tokens), so the
printed loss is the same number whatever the layout. Tensor-parallel ranks already agree.

Memory is reported two ways per rank. The peak: ``torch.cuda.max_memory_allocated`` on GPU,
the process's maximum resident set size on CPU. RSS includes the Python interpreter and torch
itself (a few hundred MiB), which hides what a layout saves on small models, so next to it the
run reports the training state this rank holds: the bytes of its parameter blocks, gradient
blocks and optimizer state (for a DTensor, its local block only). FSDP over 4 ranks shows a
quarter of the single-process figure there, whatever the runtime baseline.
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
from shardwise.units import format_bytes

__all__ = ["peak_memory_bytes", "RunMetrics", "StateBytes", "format_bytes", "state_bytes"]


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux


def _local_bytes(t: torch.Tensor | None) -> int:
    """Bytes of this rank's storage for ``t``: its local block if it is a DTensor."""
    if t is None or not isinstance(t, torch.Tensor):
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


@dataclass(frozen=True)
class StateBytes:
    """The training state one rank holds, in bytes (its own blocks, not the global tensors)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def max(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(max(self.params, other.params), max(self.grads, other.grads),
                          max(self.optimizer, other.optimizer))

    def as_list(self) -> list[int]:
        return [self.params, self.grads, self.optimizer]


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """What this rank stores for ``model``'s parameters, their gradients and ``optimizer``'s state.

    Call it between ``backward`` and ``zero_grad`` to see the gradients.
    """
    params = list(model.parameters())
    optim = 0
    if optimizer is not None:
        optim = sum(_local_bytes(v) for state in optimizer.state.values() for v in state.values())
    return StateBytes(sum(_local_bytes(p) for p in params), sum(_local_bytes(p.grad) for p in params), optim)


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
    first_step: int = 1  # the step of losses[0]: after a resume, the checkpoint's step + 1
    step_times: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    peak_memory: list[int] = field(default_factory=list)
    state: list[StateBytes] = field(default_factory=list)
    _state_peak: StateBytes = field(default_factory=StateBytes)
    _pending: list[torch.Tensor] = field(default_factory=list)
    _last: float = field(default_factory=time.perf_counter)
    _window_start: float = field(default_factory=time.perf_counter)
    _window_steps: int = 0
    per_rank: list[dict] = field(default_factory=list)  # one measured step per rank (--metrics-file)

    def start(self) -> None:
        """Start the clock (after setup, before the first step)."""
        self._last = self._window_start = time.perf_counter()

    def record_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Note the training state this rank holds (after the optimizer step, before zero_grad)."""
        self._state_peak = self._state_peak.max(state_bytes(model, optimizer))

    def step_state(self) -> StateBytes:
        """The training state recorded so far (the measured step's, after its optimizer step)."""
        return self._state_peak

    def keep_step_measurement(self, measurement) -> None:
        """Collect every rank's measured step (``shardwise.simulate.measure``): one collective,
        which every rank reaches after the same step."""
        mine = measurement.as_dict()
        self.per_rank = (comm.all_gather_object(mine, self.world_mesh, 0) if self.world_mesh is not None
                         else [mine])

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
        """Every rank's peak memory; also fills ``self.state`` (one collective for both)."""
        row = [peak_memory_bytes(self.device), *self._state_peak.as_list()]
        mine = torch.tensor([row], dtype=torch.int64, device=self.device)
        if self.world_mesh is not None:
            n = self.world_mesh.size(0)
            mine = comm.all_gather(mine, self.world_mesh, 0, 0, [1] * n)
        rows = mine.cpu().tolist()
        self.state = [StateBytes(*r[1:]) for r in rows]
        return [r[0] for r in rows]

    def _progress_line(self, step: int) -> str:
        elapsed = time.perf_counter() - self._window_start
        window = max(self._window_steps, 1)
        tps = self.tokens_per_step * window / elapsed if elapsed > 0 else float("nan")
        width = len(str(self.total_steps))
        return (f"step {step:>{width}}/{self.total_steps} | loss {self.losses[-1]:.4f} | lr {self.lrs[-1]:.2e} | "
                f"{tps:,.0f} tok/s | {elapsed / window:.3f} s/step | "
                f"mem/rank max {format_bytes(max(self.peak_memory))}{self._state_note()}")

    def _state_note(self) -> str:
        """`` (params+grads+optim 1.2 MiB)``: the largest state any rank holds, when recorded."""
        largest = max((s.total for s in self.state), default=0)
        return f" (params+grads+optim {format_bytes(largest)})" if largest else ""

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
            "state_bytes": [{"params": b.params, "grads": b.grads, "optimizer": b.optimizer} for b in self.state],
            "lrs": self.lrs,
            **({"per_rank": self.per_rank} if self.per_rank else {}),
        }

    def summary_lines(self, header: str) -> list[str]:
        s = self.summary()
        mem = ", ".join(f"r{r} {format_bytes(b)}" for r, b in enumerate(s["peak_memory_bytes"]))
        return [
            f"done: {header}",
            f"  loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f} (min {min(self.losses):.4f}) over {s['steps']} steps",
            f"  median step {s['median_step_s']:.3f} s, {s['tokens_per_s'] or 0:,.0f} tok/s",
            f"  peak memory per rank: {mem}",
            *self._state_lines(),
        ]

    def _state_lines(self) -> list[str]:
        if not any(b.total for b in self.state):
            return []
        held = ", ".join(f"r{r} {format_bytes(b.params)}/{format_bytes(b.grads)}/{format_bytes(b.optimizer)}"
                         for r, b in enumerate(self.state))
        return [f"  training state per rank (params/grads/optimizer): {held}"]

    def write_json(self, path: str, extra: dict) -> None:
        with open(path, "w") as f:
            json.dump({**extra, **self.summary()}, f, indent=1)
