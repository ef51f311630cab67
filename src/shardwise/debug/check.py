"""check_collectives(): the ranks of a group compare each collective before issuing it.

A program whose ranks disagree (one rank skips an op, takes another branch, passes another
shape) normally hangs until the collective timeout. With checking on, every collective
``shardwise.comm`` issues is preceded by one small all_gather on the same group: each rank
contributes a fixed-size fingerprint of what it is about to do

* the collective's kind and its number on that group (``#seq``, as the timeout names it),
* the mesh axis and the group's ranks,
* dtype and shape of the buffer (the shape is not compared for all_to_all, whose per-rank sizes
  legitimately differ),
* the call site: the innermost frame outside shardwise and torch (``train.py:42 in step``).

If the fingerprints differ, every rank raises the same ``CollectiveMismatch`` naming the
collective and what each rank tried to do, instead of issuing it. The checker assumes SPMD
code: two ranks reaching the same collective from different lines count as diverging.

Ranks that diverge onto *different groups* (one waits on the tp group, another on the world)
cannot meet in one all_gather: that still ends at the collective timeout, whose message lists
the last collectives each rank issued (``comm.recent_calls``, always on).

Cost: one ``is None`` test per collective when off. Turning it on installs ``_check`` as the
issuing path's pre-issue check (``shardwise.comm.set_pre_issue_check``, run before every eager
collective is numbered); off removes it. On, each collective costs one extra small all_gather
plus a walk up the Python stack. Collectives traced by torch.compile are not checked.

Enable it with ``SHARDWISE_CHECK_COLLECTIVES=1`` (read when ``shardwise`` is imported), or::

    shardwise.debug.check_collectives()            # from here on, in this process
    with shardwise.debug.check_collectives():      # inside the block only
        ...
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm.collectives import all_gather_single
from shardwise.core.mesh import DeviceMesh
from shardwise.core.spec import dtype_name

__all__ = ["check_collectives", "CollectiveMismatch", "CHECK_ENV", "checking", "fingerprint"]

CHECK_ENV = "SHARDWISE_CHECK_COLLECTIVES"
_WIDTH = 384  # bytes per rank in the exchange: compared key, a NUL, then the description
_KEY_WIDTH = 200
# Frames in these packages are library code, not the call site a user wants to see: shardwise/, torch/.
_SKIPPED_DIRS = (os.path.dirname(os.path.dirname(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)


class CollectiveMismatch(RuntimeError):
    """The ranks of a group were about to issue different collectives (raised on every rank)."""

    def __init__(self, message: str, seq: int, per_rank: dict[int, str]) -> None:
        super().__init__(message)
        self.seq = seq
        self.per_rank = per_rank


def checking() -> bool:
    """Whether collectives are being checked in this process."""
    return comm.pre_issue_check() is _check


def _set(enabled: bool) -> None:
    if enabled:
        comm.set_pre_issue_check(_check)
    elif checking():
        comm.set_pre_issue_check(None)


class check_collectives:
    """Turn the check on (``enabled=True``) or off; as a context manager, only for the block.

    Every rank of a group must have it on (the check is itself a collective on the group):
    turn it on at the same point of the program on every rank, or use the environment variable.
    """

    def __init__(self, enabled: bool = True) -> None:
        self._before = checking()
        _set(enabled)

    def __enter__(self) -> "check_collectives":
        return self

    def __exit__(self, *exc) -> None:
        _set(self._before)


# ---------------------------------------------------------------------- the check
def _check(kind: str, seq: int, group: Any, mesh: DeviceMesh | None, axis: int, nbytes: int, collective: Callable,
           args: tuple) -> None:
    """The pre-issue check: the fingerprint exchange for collective ``kind #seq`` on ``group``."""
    key, text = fingerprint(kind, seq, mesh, axis, collective, args)
    _compare(key, text, kind, seq, group, mesh, axis, nbytes)


def fingerprint(kind: str, seq: int, mesh: DeviceMesh | None, axis: int, collective: Callable,
                args: tuple) -> tuple[str, str]:
    """(what must agree across the group, what a message shows) for one collective."""
    where = f"mesh axis {mesh.axis_name(axis)!r}" if mesh is not None else "all ranks"
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        layout, compared = "", ""
    else:
        layout = f"{dtype_name(tensor.dtype)}[{','.join(map(str, tensor.shape))}]"
        compared = dtype_name(tensor.dtype) if collective is dist.all_to_all_single else layout
    site = call_site()
    key = f"{kind}|{seq}|{where}|{compared}|{site}"
    text = f"{kind} #{seq} over {where}" + (f" of {layout}" if layout else "") + f" at {site}"
    return key, text


def call_site() -> str:
    """``file.py:42 in fn``: the innermost frame outside shardwise and torch (the user's line)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIPPED_DIRS) and not name.startswith("<"):
            return f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<no Python caller>"


def _encode(key: str, text: str) -> bytes:
    raw = key.encode()[:_KEY_WIDTH] + b"\0" + text.encode()
    return raw[:_WIDTH].ljust(_WIDTH, b"\0")


def _decode(raw: bytes) -> tuple[str, str]:
    key, _, text = raw.partition(b"\0")
    return key.decode(errors="replace"), text.rstrip(b"\0").decode(errors="replace")


def _compare(key: str, text: str, kind: str, seq: int, group: Any, mesh: DeviceMesh | None, axis: int,
             nbytes: int) -> None:
    """All-gather the fingerprints on ``group``; raise the same error on every rank if they differ."""
    device = _device_of(group)
    mine = torch.frombuffer(bytearray(_encode(key, text)), dtype=torch.uint8).to(device)
    ranks = dist.get_process_group_ranks(group)
    everyone = torch.empty(len(ranks) * _WIDTH, dtype=torch.uint8, device=device)
    try:
        all_gather_single(everyone, mine, group=group)
    except RuntimeError as err:  # a timeout or a lost peer: name the collective, as comm does
        failure = comm.failure_for(err, kind, seq, group, mesh, axis, nbytes)
        if failure is None:
            raise
        raise failure from err
    raw = everyone.cpu().numpy().tobytes()
    decoded = [_decode(raw[i * _WIDTH:(i + 1) * _WIDTH]) for i in range(len(ranks))]
    if len({k for k, _ in decoded}) == 1:
        return
    per_rank = {r: t for r, (_, t) in zip(ranks, decoded)}
    first = decoded[0][0]
    lines = [f"  rank {r}: {t}" + ("" if k == first else "   <- differs from rank " + str(ranks[0]))
             for r, (k, t) in zip(ranks, decoded)]
    message = (f"collective check: the ranks {ranks} disagree at their collective #{seq} on this group "
               f"(the first collective where they part; nothing was issued):\n" + "\n".join(lines))
    raise CollectiveMismatch(message, seq, per_rank)


def _device_of(group: Any) -> torch.device:
    """Where the exchange's buffers live: the current GPU for NCCL groups, else the CPU."""
    try:
        backend = dist.get_backend(group)
    except Exception:  # noqa: BLE001
        backend = "gloo"
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def enable_from_env() -> None:
    """Turn checking on if ``$SHARDWISE_CHECK_COLLECTIVES`` says so (1, true, yes, on)."""
    if os.environ.get(CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        _set(True)
