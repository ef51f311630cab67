"""Context parallelism in the trainer: ``--cp`` layouts train to the losses of one process.

Each sequence is dealt to the cp ranks (load-balanced chunks), attention runs as ring
attention, the rotary table is sharded with the inputs (global positions), FSDP shards over
``dp_shard_cp`` and the loss is averaged over ``dp_cp``. Same job, runs and reference as
``test_train.py`` (the tiny config, 6 steps); 8 ranks only where three mesh axes are needed.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_parity, layout_id, refusal_in_launcher

LAYOUTS = [
    (8, ["--cp", "2", "--dp-shard", "2", "--tp", "2"]),
    (4, ["--cp", "4"]),  # a ring of 4; FSDP over dp_shard_cp = the 4 cp ranks (dp_shard=1 inferred)
]


@pytest.mark.parametrize("nproc,flags", LAYOUTS, ids=layout_id)
def test_context_parallel_layout_trains_to_the_one_process_losses(trainer_runs, reference, nproc, flags):
    assert_parity(trainer_runs.losses(nproc, flags), reference, " ".join(flags))


BAD_JOBS = [
    (["--nproc", "4", "--cp", "2", "--seq-len", "34"],
     r"--seq-len 34 is not divisible by 2 x --cp 2 = 4: context parallelism deals each sequence"),
    (["--nproc", "4", "--cp", "3"], r"cannot infer --dp-shard: the number of processes 4 .* is not divisible by "
                                    r"--dp-replicate 1 x --cp 3 x --tp 1 = 3"),
    (["--nproc", "4", "--cp", "2", "--dp-shard", "4"], r"--dp-replicate 1 x --dp-shard 4 x --cp 2 x --tp 1 = 8 must equal"),
    (["--cp", "0"], r"must be at least 1: --cp 0"),
]


@pytest.mark.parametrize("argv,message", BAD_JOBS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_context_parallel_job_is_refused_up_front(monkeypatch, capsys, argv, message):
    import re

    err = refusal_in_launcher(monkeypatch, capsys, argv)
    assert re.search(message, err), err


def test_context_parallel_layout_is_named():
    from shardwise.train.config import JobConfig

    job = JobConfig(config="tiny", nproc=8, cp=2, tp=2).validate()
    assert job.layout() == "dp_shard=2 cp=2 tp=2"
    assert job.describe_layout() == ("FSDP dp_shard=2 + CP cp=2 + TP tp=2 (dp_shard inferred: --nproc 8 / "
                                     "(--dp-replicate 1 x --cp 2 x --tp 2))")
