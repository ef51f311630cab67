"""The job runtime: start workers, end them promptly on failure, report one line.

``launcher`` starts N local workers through torch's elastic agent (``python -m shardwise.launch``)
and reads their reports; ``worker`` is how each worker runs and ends (one report, no barrier on
the way out, signals). Collective timeouts are diagnosed in ``shardwise.comm.stall``.
"""

from shardwise.launch.launcher import USAGE, close_process_group, launch, main, main_or_launch, under_launcher

__all__ = ["under_launcher", "launch", "close_process_group", "main_or_launch", "main", "USAGE"]
