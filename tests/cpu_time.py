"""CPU seconds a test costs, workers and launched jobs included (``pytest --cpu-durations=N``).

Wall time on a shared 2-core machine measures the neighbours as much as the test; CPU time is
the steadier figure. A test's CPU is the change, over its setup, call and teardown, of: this
process's own time, the time of the children it reaped (``RUSAGE_CHILDREN``: launched jobs), and
each live descendant's time with the time of the children it reaped (pool workers under the
harness's forkserver, torchrun's workers). A descendant's time moves into its parent's reaped
total when it ends, so nothing is counted twice. Linux only (``/proc``); elsewhere it reads 0.
"""

from __future__ import annotations

import os
import resource

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, utime + stime + cutime + cstime in seconds) of ``pid``, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), sum(int(v) for v in fields[11:15]) / _TICKS


def _descendants_seconds(root: int) -> float:
    """CPU seconds of every live descendant of ``root`` (with what each reaped)."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0.0
    stats = {int(p): s for p in pids if (s := _stat(p)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo.extend(children.get(pid, []))
    return total


def cpu_seconds() -> float:
    """CPU seconds used so far by this process, its reaped children and its live descendants."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime
    return own + _descendants_seconds(os.getpid())
