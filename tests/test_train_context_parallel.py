"""Context parallelism in the trainer: ``--cp`` layouts train to the losses of one process.

Each sequence is dealt to the cp ranks (load-balanced chunks), attention runs as ring
attention, the rotary table is sharded with the inputs (global positions), FSDP shards over
``dp_shard_cp`` and the loss is averaged over ``dp_cp``. Same jobs, pools and reference as
``test_train.py`` (8 ranks, the tiny config, 6 steps).
"""

from __future__ import annotations

import pytest

from tests.test_train import BASE, _assert_parity, _losses, reference  # noqa: F401 (fixture)

LAYOUTS = [
    (8, ["--cp", "2", "--dp-shard", "2", "--tp", "2"]),
    (8, ["--cp", "4"]),  # dp_shard=2 inferred: FSDP over dp_shard_cp = 8 ranks
]


@pytest.mark.parametrize("nproc,flags", LAYOUTS, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_context_parallel_layout_trains_to_the_one_process_losses(dist, reference, nproc, flags):
    per_rank = dist.run(nproc, _losses, BASE + ["--nproc", str(nproc), *flags], timeout=240)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the global loss"
    _assert_parity(per_rank[0], reference, " ".join(flags))
