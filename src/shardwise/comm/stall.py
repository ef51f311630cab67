"""Which ranks did not arrive at a collective that timed out.

A gloo timeout only says "this rank waited too long". To name the culprits, each rank whose
collective timed out posts what it was waiting on (``CollectiveCall.key``: kind, #seq, group)
to the job's key-value store (the default process group's store: the launcher's agent under
torchrun / ``shardwise.launch.launcher``, rank 0's TCPStore otherwise) under ``shardwise/stall/<rank>``,
then gives the other members of its group a short grace to post theirs:

* a member that posted the same collective was there (the collective failed anyway);
* a member that posted another collective is stuck in that one (named: a desynchronisation,
  or it waits on yet another rank);
* a member that posted nothing did not arrive: it is dead, stuck outside any collective, or
  far behind.

Each post also carries the last collectives that rank issued (``recent``: the issuing path's
``recent_calls``, passed in so this module needs nothing above ``errors``), and the message
lists them per rank that posted: where the ranks parted.

Nothing is stored or exchanged until a collective has already failed.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from shardwise.comm.errors import CollectiveCall

__all__ = ["diagnose", "grace_seconds", "job_store", "STALL_PREFIX"]

STALL_PREFIX = "shardwise/stall/"
_POLL_S = 0.1
_STORE_TIMEOUT = timedelta(seconds=5)  # a store that does not answer in this long is gone


def grace_seconds(timeout_s: float) -> float:
    """How long a timed-out rank waits for its peers' posts: a fifth of the timeout, 1-10 s.

    Peers that entered the collective a little later time out a little later; a fifth of the
    timeout covers that skew without doubling the time to the report.
    """
    return min(10.0, max(1.0, 0.2 * timeout_s))


def job_store() -> dist.Store | None:
    """The default process group's store with a short timeout, or None without one."""
    if not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(_STORE_TIMEOUT)  # only failure paths use it from here on
        return store
    except Exception:  # noqa: BLE001 - no store is an answer too
        return None


def diagnose(call: CollectiveCall, rank: int, timeout_s: float, store: dist.Store | None = None,
             recent: Sequence[CollectiveCall] = ()) -> tuple[tuple[int, ...] | None, str]:
    """Post this rank's stalled ``call``, collect the group's posts; return (missing ranks, message).

    The message is one line: ``rank 0 waited 5 s for all_reduce #3 over mesh axis 'dp' (ranks
    [0, 1], 16 B); rank 1 did not arrive; last collectives issued: rank 0: all_gather #2 on
    'dp', all_reduce #3 on 'dp'``. Missing is None when the store is unreachable.
    ``store`` defaults to the job's (``job_store``); ``recent`` are this rank's last collectives,
    oldest first.
    """
    head = f"rank {rank} waited {timeout_s:g} s for {call.describe()}"
    store = store if store is not None else job_store()
    if store is None:
        return None, f"{head}; which ranks did not arrive is unknown (no process-group store)"
    others = [r for r in call.group_ranks if r != rank]
    last = short_history(recent)
    try:
        store.set(f"{STALL_PREFIX}{rank}", json.dumps({"key": _key(call), "desc": call.describe(), "last": last}))
        posts = _collect(store, others, grace_seconds(timeout_s))
    except Exception as err:  # noqa: BLE001 - its host died with a rank
        return None, f"{head}; which ranks did not arrive is unknown (the job's store is unreachable: {err})"
    missing = tuple(r for r in others if r not in posts)
    elsewhere = {r: p["desc"] for r, p in posts.items() if p["key"] != _key(call)}
    histories = {rank: last, **{r: p.get("last") or [] for r, p in posts.items()}}
    return missing, head + _verdict(missing, elsewhere) + _histories(histories)


def short_history(calls: Sequence[CollectiveCall]) -> list[str]:
    """``calls`` in short, in their order: ``all_reduce #3 on 'dp'``."""
    return [f"{c.kind} #{c.seq} on " + (repr(c.axis) if c.axis is not None else "all ranks") for c in calls]


def _histories(histories: dict[int, list[str]]) -> str:
    """``; last collectives issued: rank 0: a, b; rank 1: a`` (ranks that posted any)."""
    parts = [f"rank {r}: {', '.join(h)}" for r, h in sorted(histories.items()) if h]
    return "; last collectives issued: " + "; ".join(parts) if parts else ""


def _key(call: CollectiveCall) -> list:
    """``call.key()`` as it reads back from JSON."""
    return [call.kind, call.seq, list(call.group_ranks)]


def _collect(store: dist.Store, ranks: list[int], grace_s: float) -> dict[int, dict]:
    """The posts of ``ranks`` that appear within ``grace_s`` (all of them: return at once)."""
    posts: dict[int, dict] = {}
    deadline = time.monotonic() + grace_s
    while True:
        for r in ranks:
            if r not in posts and store.check([f"{STALL_PREFIX}{r}"]):
                posts[r] = json.loads(store.get(f"{STALL_PREFIX}{r}"))
        if len(posts) == len(ranks) or time.monotonic() >= deadline:
            return posts
        time.sleep(_POLL_S)


def _verdict(missing: tuple[int, ...], elsewhere: dict[int, str]) -> str:
    parts = []
    if missing:
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(map(str, missing))}"
        parts.append(f"{who} did not arrive")
    parts += [f"rank {r} is waiting on {desc} instead" for r, desc in sorted(elsewhere.items())]
    if not parts:
        parts.append("every rank of the group arrived (the transport itself stalled)")
    return "; " + "; ".join(parts)
