"""The one path every collective takes: number it, record it, run it, name its failure.

Each collective carries a per-group sequence number (an int bumped on this rank, no
communication) and lands in a ring of the last ``RECENT`` calls, which the timeout message
lists (``recent_calls``). The hot path pays a dict update, a ``try``, a ring-buffer append and
one ``is None`` test for the pre-issue check; a failure's diagnosis runs only on failure
(docs/failures.md, "When something goes wrong").

The pre-issue check (``set_pre_issue_check``) runs before an eager collective is numbered:
``shardwise.debug.check_collectives`` installs one that compares the collective across the
group. Under ``torch.compile`` the blocks are fake or functional tensors and collectives are
issued as functional collectives (``issue_traced``): graph nodes, recorded once when traced,
neither numbered nor checked.
"""

from __future__ import annotations

import atexit
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import torch.distributed as dist

from shardwise.comm import stall, timeout
from shardwise.comm.errors import CollectiveCall, CollectiveError, CollectiveTimeout, PeerLost, classify
from shardwise.comm.recorders import _RECORDERS

if TYPE_CHECKING:
    from shardwise.core.mesh import DeviceMesh

__all__ = ["issue_eager", "issue_traced", "traced", "run_ahead", "recent_calls", "sequence_number",
           "failure_for", "PreIssueCheck", "set_pre_issue_check", "pre_issue_check", "forget_groups", "RECENT",
           "awaiting_release", "awaited_buffers", "await_release"]


class PreIssueCheck(Protocol):
    """Called before an eager collective is issued, with its number on ``group`` (``seq``) and the
    arguments ``collective`` is about to get; raising stops the collective (nothing is numbered)."""

    def __call__(self, kind: str, seq: int, group: Any, mesh: "DeviceMesh | None", axis: int, nbytes: int,
                 collective: Callable, args: tuple) -> None: ...


# Per process group: collectives this rank has issued on it (the ``#seq`` of the messages).
_SEQ: dict[object, int] = {}
# The last collectives this rank issued, raw (made readable only on failure: ``recent_calls``).
RECENT = 4
_RECENT: deque = deque(maxlen=RECENT)
_PRE_ISSUE: PreIssueCheck | None = None
_RUN_AHEAD = [0]
_AWAIT_RELEASE = [0]  # > 0 inside ``awaiting_release``
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # a StorageImpl's reference count
RELEASE_WAIT_LIMIT_S = 1.0


def set_pre_issue_check(check: PreIssueCheck | None) -> PreIssueCheck | None:
    """Run ``check`` before every eager collective from now on (None: no check); returns the
    previous one, so a caller can put it back."""
    global _PRE_ISSUE
    previous, _PRE_ISSUE = _PRE_ISSUE, check
    return previous


def pre_issue_check() -> PreIssueCheck | None:
    """The check installed with ``set_pre_issue_check``, if any."""
    return _PRE_ISSUE


def issue_eager(kind: str, mesh: "DeviceMesh | None", axis: int, nbytes: int, collective: Callable, *args, **kwargs):
    """Run ``collective(*args, group=..., **kwargs)`` on the mesh axis's group: record it, number
    it, and turn a gloo timeout or lost peer into an error that names it."""
    group = mesh.get_group(axis) if mesh is not None else dist.group.WORLD
    seq = _SEQ.get(group, 0) + 1
    if _PRE_ISSUE is not None:
        _PRE_ISSUE(kind, seq, group, mesh, axis, nbytes, collective, args)
    _SEQ[group] = seq
    _RECENT.append((kind, seq, group, mesh, axis, nbytes))
    if seq == 1:
        timeout.adopt_timeout(group)
    if mesh is not None:
        for recorder in _RECORDERS:
            recorder.record(kind, mesh, axis, nbytes)
    held = _use_counts(args) if _AWAIT_RELEASE[0] and not kwargs.get("async_op") else None
    try:
        result = collective(*args, group=group, **kwargs)
    except RuntimeError as err:
        failure = failure_for(err, kind, seq, group, mesh, axis, nbytes)
        if failure is None:
            raise
        raise failure from err
    if held:
        await_release(held)
    return result


class awaiting_release:
    """Within this context, an eager collective returns only once the backend has let go of its
    buffers.

    gloo's worker thread drops its references to a finished collective's tensors just after it
    wakes the caller (measured: after about one in six ``all_gather``s on 4 ranks the input and
    output were still referenced when the call returned), so a buffer the caller has already
    freed can stay alive a moment longer. Harmless for training, but a live-storage measurement
    (``shardwise.simulate.memory.MemoryTracker``, which compares a real step with a simulated one)
    would count it at random. Measurements turn this on; a step outside one pays one test.
    """

    def __enter__(self) -> "awaiting_release":
        _AWAIT_RELEASE[0] += 1
        return self

    def __exit__(self, *exc) -> None:
        _AWAIT_RELEASE[0] -= 1


def _use_counts(args: tuple) -> list[tuple[Any, Any, int]]:
    """(tensor or storage, its counter, its reference count now) for every tensor argument (lists
    of tensors included) and its storage: a backend may hold the very tensor it was given (which
    keeps its storage alive without counting on it) or tensors of its own over the storage."""
    if _use_count is None:  # a torch without the counter: nothing to wait for
        return []
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [x for a in args if isinstance(a, (list, tuple)) for x in a if isinstance(x, torch.Tensor)]
    counted: list[tuple[Any, Any, int]] = []
    for x in tensors:
        storage = x.untyped_storage()
        counted.append((x, _tensor_uses, x._use_count()))
        counted.append((storage, _storage_uses, _use_count(storage._cdata)))
    return counted


def _tensor_uses(x: torch.Tensor) -> int:
    return x._use_count()


def _storage_uses(storage: Any) -> int:
    return _use_count(storage._cdata)


def awaited_buffers(args: tuple) -> list[tuple[Any, Any, int]] | None:
    """Inside ``awaiting_release``: the reference counts of ``args``' tensors and buffers before a
    collective is issued without waiting (``Pending`` waits for them after its ``wait()``); else None."""
    return _use_counts(args) if _AWAIT_RELEASE[0] else None


def await_release(held: list[tuple[Any, Any, int]], limit_s: float = RELEASE_WAIT_LIMIT_S) -> None:
    """Yield until every tensor and storage is back to the references it had before the
    collective, at most ``limit_s``."""
    deadline = time.monotonic() + limit_s
    for thing, uses, count in held:
        while uses(thing) > count and time.monotonic() < deadline:
            time.sleep(0)


def issue_traced(kind: str, mesh: "DeviceMesh", axis: int, nbytes: int, collective: Callable, *args, **kwargs):
    """``collective(*args, group=..., **kwargs)``, a functional collective: recorded, returns its result."""
    group = mesh.get_group(axis)
    for recorder in _RECORDERS:
        recorder.record(kind, mesh, axis, nbytes)
    return collective(*args, group=group, **kwargs)


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a block seen while tracing (fake or functional), not real data.

    Any tensor that is not a plain ``torch.Tensor`` takes the functional path; that path is
    also right in eager, only slower; inside ``run_ahead()`` eager blocks take it too."""
    return (type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)) or _RUN_AHEAD[0] > 0


class run_ahead:
    """Within this context, collectives return at once with a tensor that waits for its data at
    first use (the functional collectives' ``AsyncCollectiveTensor``), so a consumer issued
    later overlaps the transfer. What a collective's result needs locally before it is handed
    back (an average's division, moving a gathered dim back into place) waits there."""

    def __enter__(self) -> "run_ahead":
        _RUN_AHEAD[0] += 1
        return self

    def __exit__(self, *exc) -> None:
        _RUN_AHEAD[0] -= 1


def sequence_number(group: Any) -> int:
    """How many collectives this rank has issued on ``group`` (the last one's ``#seq``)."""
    return _SEQ.get(group, 0)


def recent_calls() -> list[CollectiveCall]:
    """The last ``RECENT`` collectives this rank issued through ``issue_eager``, oldest first."""
    calls = []
    for kind, seq, group, mesh, axis, nbytes in list(_RECENT):
        try:
            ranks = tuple(dist.get_process_group_ranks(group))
        except Exception:  # noqa: BLE001 - a group destroyed since
            ranks = ()
        calls.append(CollectiveCall(kind, seq, ranks, mesh.axis_name(axis) if mesh is not None else None, nbytes))
    return calls


def failure_for(err: RuntimeError, kind: str, seq: int, group: Any, mesh: "DeviceMesh | None", axis: int,
                nbytes: int) -> CollectiveError | None:
    """The error to raise for collective ``kind #seq`` that failed with ``err``, or None to
    re-raise the backend's own (neither a timeout nor a lost peer)."""
    what = classify(str(err))
    if what is None:
        return None
    call = CollectiveCall(kind, seq, tuple(dist.get_process_group_ranks(group)),
                          mesh.axis_name(axis) if mesh is not None else None, nbytes)
    rank = dist.get_rank()
    if what == "peer":
        return PeerLost(f"rank {rank}: {call.describe()} failed: a peer closed its connection (it exited "
                        f"or crashed; its own report names the cause)", call, rank)
    missing, text = stall.diagnose(call, rank, timeout.collective_timeout().total_seconds(), recent=recent_calls())
    return CollectiveTimeout(text, call, rank, missing)


def forget_groups() -> None:
    """Forget every group seen: sequence numbers restart at #1, the recent calls and the
    timeout's remembered groups empty (at exit; and when a new world starts: the simulator)."""
    _SEQ.clear()
    _RECENT.clear()
    timeout.forget_groups()


atexit.register(forget_groups)  # drop the groups held as keys and history (see ``core.mesh``)
