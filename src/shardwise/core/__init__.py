"""The values everything else is built on: placements, the device mesh, a DTensor's spec.

``placement`` and ``spec`` are pure (no processes); ``mesh`` creates the process groups.
"""
