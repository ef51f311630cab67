"""``python -m shardwise.launch --nproc N script.py``: run a script on N local processes."""

from shardwise.launch.launcher import main

main()
