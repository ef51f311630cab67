"""``shardwise.train`` with ranks killed at chosen steps across restarts, for tests/test_restart.py.

``$CHAOS`` lists ``KIND:RANK:STEP`` faults, comma-separated; ``$CHAOS_DIR`` is a directory where
each fault, when it fires, leaves a file, so that it fires once in the whole run (a restarted run
trains its lost steps again). A fault fires when rank RANK draws the batch of step STEP (1-based,
before the step's forward):

    kill    the rank kills itself with SIGKILL (dies without a word, as the OOM killer does)
    killjob the rank kills its whole job (launcher included) with SIGKILL: the machine died

Each prints ``FAULT <kind> rank <r> step <n> at <time>`` to stderr first. Run it as
``python tests/jobs/train_chaos.py --nproc 4 --config tiny ... --max-restarts 3``.
"""

import os
import signal
import sys
import time

from shardwise.train import cli, data

_real_batch_at = data.BatchSource.batch_at


def _fire(kind: str, rank: int, step: int) -> None:
    print(f"FAULT {kind} rank {rank} step {step} at {time.time():.3f}", file=sys.stderr, flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "killjob":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    raise ValueError(f"unknown fault kind {kind!r} in CHAOS={os.environ['CHAOS']!r}")


def _maybe_fail(step: int) -> None:
    rank = int(os.environ.get("RANK", "0"))
    for index, spec in enumerate(filter(None, os.environ.get("CHAOS", "").split(","))):
        kind, who, when = spec.split(":")
        marker = os.path.join(os.environ["CHAOS_DIR"], f"fired-{index}")
        if int(who) == rank and int(when) == step and not os.path.exists(marker):
            open(marker, "w").close()
            _fire(kind, rank, step)


def _batch_at(self, step):
    _maybe_fail(step + 1)
    return _real_batch_at(self, step)


if __name__ == "__main__":
    data.BatchSource.batch_at = _batch_at
    cli.main()
