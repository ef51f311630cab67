"""The propagation cache: every layout decision the dispatcher and its handlers remember.

A decision depends on the op's registration, so the cache is tied to the registry's version:
``registry`` bumps it on every registration and empties the cache, and an entry computed while
a registration happened (another thread registering during a propagation) is not stored.

Reads take no lock (a dict lookup is atomic), because a hit is the dispatch hot path; inserts,
evictions and clearing take one. Eviction is first in, first out: a hit costs one lookup and
no reordering, and an evicted entry that is still in use is computed again once.

Entries are namespaced by their key's first element: the dispatcher keys by the op, handlers
(``memo``) by a tag of their own, so one object serves both.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, TypeVar

__all__ = ["PropagationCache", "PLANS", "registry_version", "bump_registry_version"]

T = TypeVar("T")

_VERSION = [0]


def registry_version() -> int:
    """How many times the op registry has changed (see ``shardwise.dispatch.registry``)."""
    return _VERSION[0]


def bump_registry_version() -> None:
    """Called by the registry on every change: what was decided before may no longer hold."""
    with PLANS._lock:
        _VERSION[0] += 1
        PLANS._entries.clear()


class PropagationCache:
    """A bounded, thread-safe map from call signatures to decisions (see the module docstring)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._entries: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self.get = self._entries.get  # the lock-free read of the hot path

    def put(self, key: Hashable, value: Any, version: int, max_size: int | None = None) -> None:
        """Store ``value``, decided at registry ``version``, unless the registry changed since;
        evict the oldest entries beyond ``max_size`` (default: ``self.max_size``)."""
        limit = self.max_size if max_size is None else max_size
        with self._lock:
            if version != _VERSION[0]:
                return
            entries = self._entries
            entries[key] = value
            while len(entries) > limit:  # "while": the limit may have been lowered
                del entries[next(iter(entries))]

    def memo(self, key: Hashable, make: Callable[[], T]) -> T:
        """The value cached under ``key``, made by ``make()`` on a miss (for custom handlers)."""
        found = self._entries.get(key)
        if found is None:
            version = _VERSION[0]
            found = make()
            self.put(key, found, version)
        return found

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# The one cache of the process (the dispatcher's ``CACHE_SIZE`` bounds its own inserts).
PLANS = PropagationCache(4096)
