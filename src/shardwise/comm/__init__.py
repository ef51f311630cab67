"""The only package that issues collectives (docs/architecture.md; its failures: docs/failures.md,
"When something goes wrong").

One module per concern, each importing only those listed before it:

* ``errors``: ``CollectiveCall`` and what a failed collective raises (pure);
* ``timeout``: the collective timeout policy (imports nothing of shardwise, so the mesh can);
* ``recorders``: who is told about each collective (``shardwise.debug.CommDebugMode``), and the
  bytes per peer of an uneven all_to_all while they are told (``per_peer_bytes``);
* ``stall``: on a timeout, which ranks did not arrive;
* ``issue``: the one issuing path (sequence numbers, recent calls, traced vs eager, the
  pre-issue check hook that ``shardwise.debug.check_collectives`` uses);
* ``bytes``: what an all_reduce sends, per rank (pure; the redistribute planner prices it too);
* ``collectives``: all_gather, reduce_scatter, all_reduce, all_to_all, ... and their async forms.

This module re-exports their public names, so callers write ``comm.all_gather(...)``.
"""

from shardwise.comm.collectives import (
    Pending,
    all_gather,
    all_gather_async,
    all_gather_object,
    all_reduce,
    all_reduce_async,
    all_to_all,
    all_to_all_counts,
    barrier,
    broadcast,
    reduce_scatter,
    reduce_scatter_async,
    reduce_stacked,
    ring_shift,
    scatter,
)
from shardwise.comm.errors import CollectiveCall, CollectiveError, CollectiveTimeout, PeerLost, classify
from shardwise.comm.issue import (
    RECENT,
    awaiting_release,
    PreIssueCheck,
    failure_for,
    forget_groups,
    pre_issue_check,
    recent_calls,
    run_ahead,
    sequence_number,
    set_pre_issue_check,
    traced,
)
from shardwise.comm.recorders import (
    CommRecorder,
    add_recorder,
    per_peer_bytes,
    record_send,
    recording,
    remove_recorder,
)
from shardwise.comm.timeout import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    TIMEOUT_ENV,
    collective_timeout,
    set_collective_timeout,
)

__all__ = [
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "all_to_all_counts", "scatter", "broadcast",
    "all_gather_object", "barrier", "ring_shift", "reduce_stacked",
    "Pending", "all_gather_async", "reduce_scatter_async", "all_reduce_async", "run_ahead", "traced", "awaiting_release",
    "CommRecorder", "add_recorder", "remove_recorder", "record_send", "recording", "per_peer_bytes",
    "set_collective_timeout", "collective_timeout", "TIMEOUT_ENV", "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "CollectiveCall", "CollectiveError", "CollectiveTimeout", "PeerLost", "classify", "failure_for",
    "recent_calls", "sequence_number", "RECENT", "forget_groups",
    "PreIssueCheck", "set_pre_issue_check", "pre_issue_check",
]
