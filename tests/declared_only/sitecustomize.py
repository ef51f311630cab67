"""Loaded by every interpreter started with this folder on PYTHONPATH (``tests/declared_deps.py``).

It makes the top-level modules named in ``$SHARDWISE_BLOCKED_MODULES`` (comma-separated)
unimportable, as if they were not installed: the test environment then behaves like an
install that followed the README (shardwise and its declared dependencies only), in this
process and every process it starts.
"""

import os
import sys


class _Blocked:
    """A meta path finder that answers "not installed" for the blocked top-level names."""

    def __init__(self, names: frozenset) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (blocked: not a declared dependency of shardwise; "
                f"see tests/declared_deps.py)", name=fullname)
        return None


_names = frozenset(n for n in os.environ.get("SHARDWISE_BLOCKED_MODULES", "").split(",") if n)
if _names:
    sys.meta_path.insert(0, _Blocked(_names))
