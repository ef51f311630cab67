"""The collective timeout: how long a collective may take before it fails with a message.

One policy for the whole process: ``set_collective_timeout``, else
``$SHARDWISE_COLLECTIVE_TIMEOUT``, else ``DEFAULT_COLLECTIVE_TIMEOUT_S`` (docs/failures.md, "The
collective timeout"). ``shardwise.core.mesh`` reads it when it creates process groups, so this module
imports nothing of shardwise: the mesh sits below the rest of comm, and the timeout below it.

Groups that exist before the timeout is set are found without asking the mesh: every group
shardwise creates or issues a collective on is remembered here (``remember_group``), and
``set_collective_timeout`` updates those and the default group.
"""

from __future__ import annotations

import atexit
import math
import os
from datetime import timedelta

import torch.distributed as dist

__all__ = ["set_collective_timeout", "collective_timeout", "adopt_timeout", "remember_group",
           "forget_groups", "TIMEOUT_ENV", "DEFAULT_COLLECTIVE_TIMEOUT_S"]

TIMEOUT_ENV = "SHARDWISE_COLLECTIVE_TIMEOUT"
# gloo's own default is 30 minutes. Five minutes still covers the longest legitimate wait of a
# CPU job (one rank alone writing or loading a large checkpoint while the others wait at the
# next collective) yet turns a dead or stuck rank into an error long before anyone gives up on
# the job. The trainer sets its own (--collective-timeout).
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
_timeout_s: float | None = None
# Every process group shardwise made or used: ``set_collective_timeout`` updates them all.
_KNOWN_GROUPS: set = set()


def set_collective_timeout(seconds: float) -> None:
    """Fail any collective that has not completed after ``seconds`` (this process).

    Applies to process groups created afterwards (``init_device_mesh`` and the mesh axis groups
    pass it to ``init_process_group`` / ``new_group``), to the default group and every group
    shardwise has created or used, and to any other group the first time shardwise issues a
    collective on it (one created by the user with another timeout included). Takes precedence
    over ``$SHARDWISE_COLLECTIVE_TIMEOUT``, which acts the same way; with neither set, groups
    shardwise creates get ``DEFAULT_COLLECTIVE_TIMEOUT_S`` and others keep their own.

    Example:
        >>> shardwise.comm.set_collective_timeout(60)  # before init_device_mesh
    """
    global _timeout_s
    _timeout_s = _checked_seconds(seconds, "set_collective_timeout")
    _apply_to_known_groups(collective_timeout())


def collective_timeout() -> timedelta:
    """The collective timeout: ``set_collective_timeout``, else the env var, else the default."""
    if _timeout_s is not None:
        return timedelta(seconds=_timeout_s)
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"${TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    return timedelta(seconds=_checked_seconds(seconds, f"${TIMEOUT_ENV}"))


def remember_group(group: object) -> None:
    """Note a process group shardwise created, so a later ``set_collective_timeout`` reaches it."""
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:  # meshes make every slice's group
        _KNOWN_GROUPS.add(group)


def adopt_timeout(group: object) -> None:
    """First collective on ``group``: remember it and give it the chosen timeout (a group the
    user or torchrun created would otherwise keep gloo's 30 minutes)."""
    remember_group(group)
    set_pg_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.3
    if set_pg_timeout is not None and _configured():
        set_pg_timeout(collective_timeout(), group)


def forget_groups() -> None:
    """Drop the remembered groups (at exit, and when a new world starts: the simulator)."""
    _KNOWN_GROUPS.clear()


atexit.register(forget_groups)  # hold no group into interpreter teardown (see ``core.mesh``)


def _configured() -> bool:
    """Whether the user chose a timeout (``set_collective_timeout`` or the env var)."""
    return _timeout_s is not None or bool(os.environ.get(TIMEOUT_ENV, "").strip())


def _checked_seconds(seconds: float, where: str) -> float:
    if not 0 < float(seconds) < math.inf:
        raise ValueError(f"{where}: the collective timeout must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


def _apply_to_known_groups(timeout: timedelta) -> None:
    """Give groups that already exist the new timeout (gloo reads it at every collective)."""
    if not dist.is_initialized():
        return
    set_pg_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.3
    if set_pg_timeout is None:
        return
    for group in {dist.group.WORLD, *_KNOWN_GROUPS}:
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            set_pg_timeout(timeout, group)
        except (RuntimeError, ValueError):  # destroyed since (a finished world): nothing to time
            _KNOWN_GROUPS.discard(group)
