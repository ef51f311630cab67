"""Collective counts that answer to shardwise's names and to torch's collective objects.

A program ported from ``torch.distributed.tensor`` looks its counts up by torch's op objects
(``torch.ops.c10d_functional.all_gather_into_tensor``, ``funcol.all_reduce`` ...); shardwise
records its own kinds (``"all_gather"``, ``"all_reduce"`` ...). ``CommCounts`` stores shardwise's
names (so it prints and compares like ``{'all_gather': 1}``) and turns any accepted key into one
of them on lookup. Nothing here imports torch: op objects are recognised by their names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CommCounts", "collective_kind", "KINDS"]

# The kinds shardwise.comm records (comm/collectives.py: one string per collective function).
KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "scatter",
         "all_gather_object", "barrier", "send_recv")

# Torch's names for the same collectives: functional ops (c10d_functional, _c10d_functional,
# _c10d_functional_autograd), the Python functional collectives (torch.distributed.
# _functional_collectives), the c10d process-group ops (torch.ops.c10d) and the eager
# torch.distributed functions.
_TORCH_NAMES: dict[str, tuple[str, ...]] = {
    "all_reduce": ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
                   "all_reduce_inplace", "allreduce_", "allreduce_coalesced_", "legacy_allreduce"),
    "all_gather": ("all_gather", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                   "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_tensor_inplace",
                   "all_gather_inplace", "all_gather_single", "all_gather_single_autograd",
                   "all_gather_single_coalesced", "allgather_", "_allgather_base_",
                   "allgather_coalesced_", "allgather_into_tensor_coalesced_", "legacy_all_gather",
                   "legacy_all_gather_base", "legacy_allgather", "legacy_allgather_single"),
    "reduce_scatter": ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
                       "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_inplace",
                       "reduce_scatter_single", "reduce_scatter_single_autograd",
                       "reduce_scatter_single_coalesced", "reduce_scatter_", "_reduce_scatter_base_",
                       "reduce_scatter_tensor_coalesced_", "legacy_reducescatter",
                       "legacy_reduce_scatter_base", "legacy_reducescatter_single"),
    "all_to_all": ("all_to_all", "all_to_all_single", "all_to_all_single_autograd", "all_to_all_inplace",
                   "alltoall_", "alltoall_base_", "legacy_all_to_all_single"),
    "broadcast": ("broadcast", "broadcast_"),
    "scatter": ("scatter", "scatter_"),
    "all_gather_object": ("all_gather_object",),
    "barrier": ("barrier",),
    "send_recv": ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_", "recv_"),
}
_BY_TORCH_NAME = {name: kind for kind, names in _TORCH_NAMES.items() for name in names}
_OP_NAMESPACES = {"c10d_functional", "_c10d_functional", "_c10d_functional_autograd", "c10d"}
_FUNCTION_MODULES = {"torch.distributed._functional_collectives", "torch.distributed.distributed_c10d",
                     "torch.distributed"}
_ACCEPTED = (f"one of {list(KINDS)}, a torch.ops.c10d_functional / _c10d_functional / c10d collective op, "
             "or a torch.distributed(._functional_collectives) collective function")


def collective_kind(key: Any) -> str | None:
    """shardwise's name for ``key`` (a kind name, a torch collective op or function), else None.

    Example:
        >>> collective_kind(torch.ops.c10d_functional.all_gather_into_tensor)
        'all_gather'
        >>> collective_kind(funcol.reduce_scatter_tensor), collective_kind("all_to_all")
        ('reduce_scatter', 'all_to_all')
    """
    if isinstance(key, str):
        return key if key in _TORCH_NAMES else _BY_TORCH_NAME.get(key)
    packet = getattr(key, "overloadpacket", key)  # OpOverload (op.default) -> its packet
    qualified = getattr(packet, "_qualified_op_name", None)  # "c10d_functional::all_reduce"
    if isinstance(qualified, str) and "::" in qualified:
        namespace, name = qualified.split("::", 1)
        return _BY_TORCH_NAME.get(name) if namespace in _OP_NAMESPACES else None
    if callable(key) and getattr(key, "__module__", None) in _FUNCTION_MODULES:
        return _BY_TORCH_NAME.get(getattr(key, "__name__", ""))
    return None


class CommCounts(dict):
    """``{kind: count}`` keyed by shardwise's names, looked up by those or by torch's objects.

    A collective that did not run counts 0 (as torch's ``defaultdict``); a key that names no
    collective raises ``KeyError`` (a typo would otherwise always read 0). ``in`` is True only
    for collectives that ran. Equality accepts torch keys on the other side too.

    Example:
        >>> counts = comms.get_comm_counts()
        >>> counts
        {'all_gather': 1}
        >>> counts[torch.ops.c10d_functional.all_gather_into_tensor], counts["all_reduce"]
        (1, 0)
    """

    def _kind(self, key: Any) -> str | None:
        if isinstance(key, str) and dict.__contains__(self, key):  # a kind recorded under its own name
            return key
        return collective_kind(key)

    def __getitem__(self, key: Any) -> int:
        kind = self._kind(key)
        if kind is None:
            raise KeyError(f"{key!r} is not a collective: look counts up by {_ACCEPTED}")
        return dict.get(self, kind, 0)

    def get(self, key: Any, default: Any = None) -> Any:
        kind = self._kind(key)
        return dict.get(self, kind, default) if kind is not None else default

    def __contains__(self, key: object) -> bool:
        kind = self._kind(key)
        return kind is not None and dict.__contains__(self, kind)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        normalized: dict[str, Any] = {}
        for key, value in other.items():
            kind = collective_kind(key)
            if kind is None or kind in normalized:
                return False
            normalized[kind] = value
        return dict.__eq__(self, normalized)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]  # mutable, as dict
