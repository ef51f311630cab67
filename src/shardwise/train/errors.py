"""``ConfigError``: a job the trainer refuses to start.

Its own module so that the job's configuration (``config.py``), the family registry
(``spec.py``) and each family's args can raise it without importing one another.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A job the trainer refuses to start; the message is meant for the command line."""
