"""Loaded by every interpreter started with this folder on PYTHONPATH (``tests/declared_deps.py``).

It hides the top-level modules named in ``$SHARDWISE_BLOCKED_MODULES`` (comma-separated) as if
they were not installed: the test environment then behaves like an install that followed the
README (shardwise and its declared dependencies only), in this process and every process it
starts. Each import finder is wrapped so that it does not see those names: ``import x`` raises
the usual ``ModuleNotFoundError`` and ``importlib.util.find_spec("x")`` returns None, which is
what code probing for optional packages (torch does) expects.
"""

import os
import sys


class _Hiding:
    """An import finder that does not find the hidden top-level names; otherwise ``inner``."""

    def __init__(self, inner, names: frozenset) -> None:
        self._inner = inner
        self._names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self._names:
            return None
        find_spec = getattr(self._inner, "find_spec", None)
        return find_spec(fullname, path, target) if find_spec else None

    def __getattr__(self, name):  # invalidate_caches, find_distributions, ...
        return getattr(self._inner, name)


_names = frozenset(n for n in os.environ.get("SHARDWISE_BLOCKED_MODULES", "").split(",") if n)
if _names:
    sys.meta_path[:] = [_Hiding(finder, _names) for finder in sys.meta_path]
