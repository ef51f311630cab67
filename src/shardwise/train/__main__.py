"""``python -m shardwise.train``: see ``shardwise.train.cli``."""

from shardwise.train.cli import main

if __name__ == "__main__":
    main()
