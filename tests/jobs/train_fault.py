"""``shardwise.train`` with a fault injected on one rank (faults.py), for tests/test_job_failures.py.

The fault fires in the loss function at the given step (after the forward, before the
backward's collectives). Run it under a launcher, with the trainer's flags:
``python -m shardwise.launch --nproc 2 tests/jobs/train_fault.py --config tiny ...`` or
``torchrun --nproc-per-node 2 tests/jobs/train_fault.py --config tiny ...``.
"""

import os

from faults import maybe_fail

from shardwise.train import cli, trainer

_real_loss_fn = trainer.loss_fn
_calls = [0]


def _loss_fn(logits, labels):
    _calls[0] += 1
    maybe_fail(int(os.environ.get("RANK", "0")), _calls[0])
    return _real_loss_fn(logits, labels)


if __name__ == "__main__":
    trainer.loss_fn = _loss_fn
    cli.main()
