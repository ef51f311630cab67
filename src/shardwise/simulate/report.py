"""The text ``--simulate`` prints: one row per group of ranks with equal figures."""

from __future__ import annotations

from shardwise.simulate.measure import StepMeasurement
from shardwise.units import format_bytes

__all__ = ["report_lines", "rank_ranges"]


def rank_ranges(ranks: list[int]) -> str:
    """``0-3,8`` for [0, 1, 2, 3, 8]."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def _row(m: StepMeasurement) -> tuple:
    return (m.param_bytes, m.grad_bytes, m.optimizer_bytes, m.activation_peak_bytes, m.peak_memory_bytes,
            m.comm_bytes_per_step, tuple(sorted(m.comm_bytes_by_axis.items())))


def report_lines(per_rank: list[StepMeasurement]) -> list[str]:
    """A table of the per-rank figures, ranks with equal figures on one row."""
    groups: dict[tuple, list[int]] = {}
    for m in per_rank:
        groups.setdefault(_row(m), []).append(m.rank)
    header = f"{'ranks':<12}{'params':>12}{'grads':>12}{'optimizer':>12}{'peak act.':>12}{'peak':>12}{'comm/step':>12}  by mesh axis"
    lines = [header]
    for row, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        params, grads, optim, act, peak, sent, axes = row
        by_axis = ", ".join(f"{a} {format_bytes(b)}" for a, b in axes) or "-"
        lines.append(f"{rank_ranges(ranks):<12}{format_bytes(params):>12}{format_bytes(grads):>12}{format_bytes(optim):>12}{format_bytes(act):>12}"
                     f"{format_bytes(peak):>12}{format_bytes(sent):>12}  {by_axis}")
    return lines
