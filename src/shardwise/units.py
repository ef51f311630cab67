"""Byte counts for people to read: the one formatter every report and message uses."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(nbytes: float) -> str:
    """``96 B``, ``1.5 KiB``, ``2.0 MiB``, ``1.25 GiB`` (binary units; two decimals for GiB,
    where a tenth is a hundred MiB).

        >>> format_bytes(96), format_bytes(1536), format_bytes(5 * 2**30 // 4)
        ('96 B', '1.5 KiB', '1.25 GiB')
    """
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
