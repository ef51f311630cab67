"""Exceptions that are torch's types too, so code written for torch's DTensor catches them.

Where torch raises an ``AssertionError`` and shardwise's check is a ``ValueError`` (a length
mismatch, a module given twice), the exception is both: ``except ValueError`` and
``assertRaises(AssertionError)`` both hold (docs/api.md, "Errors"). Messages start with torch's
wording and go on with shardwise's detail. Pure: no process group.
"""

from __future__ import annotations

__all__ = ["ValueAssertionError"]


class ValueAssertionError(ValueError, AssertionError):
    """A refusal torch raises as ``AssertionError`` and shardwise as ``ValueError``."""
