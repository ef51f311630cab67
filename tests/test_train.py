"""The trainer: every parallel layout trains to the losses of one process; bad jobs are refused.

Parity runs the trainer's own ``train`` on the gloo worker pools (no process start-up per
layout), each layout once per session (``trainer_runs``, shared with the other modules that check
the same run); the reference is a one-process run in the test process. One end-to-end run goes
through the command line as a subprocess (launching, progress, metrics file, plot), and bad
jobs are checked through the CLI entry point: one ``error:`` line, exit status 2, no traceback,
refused before any worker starts.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from shardwise.train import cli
from shardwise.train.config import JobConfig
from shardwise.train.data import BatchSource, load_corpus
from shardwise.train.models.llama import CONFIGS, Transformer, tp_plans
from shardwise.train.plot import render_loss_png
from tests.helpers import BASE, STEPS, assert_parity, cli_job, cli_run, layout_id, refusal_in_launcher, search


# ---------------------------------------------------------------------- parity
# 8 ranks only where three mesh axes are needed. The FSDP run's state bytes are checked by
# tests/test_train_metrics.py: the same run (``trainer_runs``).
LAYOUTS = [
    (4, ["--tp", "2", "--dp-shard", "2"]),
    (4, ["--dp-shard", "4"]),
    (4, ["--tp", "4", "--sequence-parallel", "--loss-parallel"]),
    (4, ["--dp-replicate", "2", "--dp-shard", "2"]),
    (4, ["--tp", "2", "--sequence-parallel", "--dp-shard", "2", "--activation-checkpointing"]),
    (8, ["--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"]),
    (2, ["--dp-replicate", "2", "--activation-checkpointing"]),  # DDP: recomputation uses the plain replicas
    (4, ["--tp", "2", "--dp-shard", "2", "--sequence-parallel", "--compile", "--compile-backend", "aot_eager"]),
]


@pytest.mark.parametrize("nproc,flags", LAYOUTS, ids=layout_id)
def test_layout_trains_to_the_one_process_losses(trainer_runs, reference, nproc, flags):
    assert_parity(trainer_runs.losses(nproc, flags), reference, " ".join(flags))
    assert reference[-1] < reference[0], "the reference run does not learn"


def test_mixed_precision_stays_near_fp32(trainer_runs, reference):
    got = trainer_runs.losses(4, ["--dp-shard", "4", "--mixed-precision"])
    assert got != reference, "bf16 parameters gave bit-identical losses: mixed precision is not applied"
    assert max(abs(g - w) / w for g, w in zip(got, reference)) < 2e-2, (got, reference)


@pytest.mark.e2e
@pytest.mark.extras  # its plot: matplotlib's when installed
def test_command_line_run_launches_reports_and_matches(monkeypatch, capsys, tmp_path, reference):
    """One real launched job: progress, summary, metrics file, plot, parity; and its checkpoint
    directory: the launching process holds it for its workers until the job ends (a second run
    is refused meanwhile), rank 0 prints the resolved layout (``--dp-shard`` inferred). Two
    workers: every layout's parity is checked on the pools above, and the README's quick start
    (tests/test_readme.py) launches the 4-process FSDP x TP job."""
    from shardwise.train.run_lock import live_holder

    metrics, plot, ckpt = tmp_path / "m.json", tmp_path / "loss.png", tmp_path / "ckpt"
    argv = BASE + ["--nproc", "2", "--log-every", "3", "--metrics-file", str(metrics),
                   "--plot", str(plot), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
    job = cli_job(argv)
    try:
        deadline = time.monotonic() + 120
        while live_holder(str(ckpt)) is None and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        holder = live_holder(str(ckpt))
        assert holder is not None and holder.pid == job.pid, holder
        err = refusal_in_launcher(monkeypatch, capsys, BASE + ["--nproc", "2", "--checkpoint-dir", str(ckpt)])
        assert f"is in use by another run (pid {job.pid} on host" in err, err
        out, errors = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=30)
    assert job.returncode == 0, out + errors
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == STEPS // 3, out  # rank 0 prints, once per log step
    assert all("tok/s" in line and "mem/rank" in line for line in lines), lines
    assert "done: tiny dp_shard=2" in out and "peak memory per rank: r0" in out
    assert ("shardwise.train: layout: FSDP dp_shard=2 (dp_shard inferred: --nproc 2 / "
            "(--dp-replicate 1 x --tp 1))") in out.splitlines(), out
    record = json.loads(metrics.read_text())
    assert_parity(record["losses"], reference, "CLI dp_shard=2")
    assert len(record["peak_memory_bytes"]) == 2 and min(record["peak_memory_bytes"]) > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in ckpt.iterdir()) == [".lock", "step-3", "step-6"]
    assert live_holder(str(ckpt)) is None  # released with the job


# ---------------------------------------------------------------------- bad jobs
BAD_JOBS = [
    (["--nproc", "4", "--tp", "2", "--dp-shard", "4"], r"--dp-replicate 1 x --dp-shard 4 x --tp 2 = 8 must equal the number of processes 4"),
    (["--nproc", "4", "--tp", "3"], r"cannot infer --dp-shard: the number of processes 4 .* is not divisible by --dp-replicate 1 x --tp 3 = 3"),
    (["--nproc", "4", "--global-batch", "6"], r"--global-batch 6 is not divisible by the data-parallel degree .* = 4"),
    (["--nproc", "3", "--tp", "3", "--config", "tiny"], r"--tp 3 must divide the attention heads of config 'tiny': n_heads=8, n_kv_heads=4"),
    (["--nproc", "8", "--tp", "8", "--config", "tiny"], r"--tp 8 must divide .* n_kv_heads=4"),
    (["--nproc", "16", "--tp", "16", "--config", "llama3_8b"], r"--tp 16 must divide the attention heads of config 'llama3_8b'"),
    (["--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "33"], r"--seq-len 33 is not divisible by --tp 2"),
    (["--nproc", "4", "--dp-replicate", "2", "--tp", "2"], r"--dp-replicate 2 with --tp 2 needs --dp-shard > 1 \(HSDP\)"),
    (["--config", "gpt5"], r"unknown config 'gpt5'; known configs: " + ", ".join(CONFIGS)),
    (["--loss-parallel"], r"--loss-parallel shards over the tensor-parallel axis: use --tp > 1"),
    (["--checkpoint-every", "5"], r"--checkpoint-every needs --checkpoint-dir"),
    (["--checkpoint-every", "5", "--resume"], r"--checkpoint-every and --resume need --checkpoint-dir"),
    (["--max-norm", "-1"], r"--max-norm must be >= 0 \(0 turns clipping off\), got -1.0"),
]


@pytest.mark.parametrize("argv,message", BAD_JOBS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_job_is_refused_in_the_launching_process(monkeypatch, capsys, argv, message):
    err = refusal_in_launcher(monkeypatch, capsys, argv)
    assert search(message, err)


@pytest.mark.parametrize("argv,message", BAD_JOBS[:3], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_job_is_refused_again_in_every_worker(monkeypatch, capsys, argv, message):
    """Under torchrun the launching process is torchrun itself: each worker validates."""
    nproc = argv[argv.index("--nproc") + 1]
    monkeypatch.setattr(sys, "argv", ["shardwise.train", *argv])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # a worker is told so by all four variables
    monkeypatch.setenv("MASTER_PORT", "29500")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", nproc)
        assert cli.worker() == 2
        err = capsys.readouterr().err
        assert (search(message, err) is not None) == (rank == "0"), err  # printed once, by rank 0


def test_nproc_must_match_the_launchers_world(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["shardwise.train", "--nproc", "4"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert cli.worker() == 2
    assert "--nproc 4 differs from the launcher's world size 2" in capsys.readouterr().err


@pytest.mark.e2e
def test_bad_job_from_the_shell_exits_2_without_traceback():
    proc = cli_run(["--nproc", "4", "--tp", "2", "--dp-shard", "4"], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "must equal the number of processes 4" in proc.stderr


# ---------------------------------------------------------------------- pieces
def test_model_uses_torchtitan_names_and_grouped_kv_heads():
    args = CONFIGS["tiny"]
    torch.manual_seed(0)
    model = Transformer(args)
    names = dict(model.named_parameters())
    for path in ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.1.feed_forward.w3.weight",
                 "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight", "norm.weight", "output.weight"):
        assert path in names, path
    assert names["layers.0.attention.wk.weight"].shape == (args.n_kv_heads * args.head_dim, args.dim)
    assert args.n_kv_heads < args.n_heads
    assert names["output.weight"].data_ptr() != names["tok_embeddings.weight"].data_ptr()  # untied
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    tokens = torch.randint(0, 256, (2, 16))
    assert model(tokens).shape == (2, 16, args.vocab_size)
    # causal: changing a later token leaves earlier logits unchanged
    other = tokens.clone()
    other[:, 10] = (other[:, 10] + 1) % 256
    torch.testing.assert_close(model(other)[:, :10], model(tokens)[:, :10])
    assert not torch.allclose(model(other)[:, 10:], model(tokens)[:, 10:])


def test_debug_config_is_a_laptop_model():
    assert 1e6 <= CONFIGS["debug"].num_params() <= 4e6
    assert CONFIGS["llama3_8b"].num_params() > 7e9  # Llama 3 8B shapes (with its 128k vocabulary)


def test_tp_plans_cover_every_linear_and_the_sp_norms():
    root, block = tp_plans(sequence_parallel=True, loss_parallel=True)
    assert set(root) == {"tok_embeddings", "output", "norm"}
    linears = {f"attention.{w}" for w in ("wq", "wk", "wv", "wo")} | {f"feed_forward.{w}" for w in ("w1", "w2", "w3")}
    assert linears | {"attention_norm", "ffn_norm", "attention", "feed_forward"} == set(block)
    plain_root, plain_block = tp_plans(sequence_parallel=False, loss_parallel=False)
    assert "norm" not in plain_root and set(plain_block) == linears | {"attention", "feed_forward"}


def test_batches_are_deterministic_and_dp_slices_tile_the_global_batch():
    corpus = load_corpus()
    assert corpus.numel() > 1_000_000  # the standard library's source
    whole = BatchSource(corpus, 8, 32, seed=3).global_batch_at(5)
    assert whole.shape == (8, 33)
    assert torch.equal(whole, BatchSource(corpus, 8, 32, seed=3).global_batch_at(5))
    assert not torch.equal(whole, BatchSource(corpus, 8, 32, seed=3).global_batch_at(6))
    parts = [BatchSource(corpus, 8, 32, seed=3, dp_degree=4, dp_rank=r).batch_at(5) for r in range(4)]
    torch.testing.assert_close(torch.cat([x for x, _ in parts]), whole[:, :-1], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([y for _, y in parts]), whole[:, 1:], rtol=0, atol=0)


def test_builtin_png_writer():
    png = render_loss_png([5.0, 4.0, 4.5, 3.0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR" and png[-8:-4] == b"IEND"
    # a resumed run's curve is labelled from its first step: the same curve, other step labels
    assert render_loss_png([5.0, 4.0, 4.5, 3.0], first_step=6) != png
    assert render_loss_png([5.0, 4.0, 4.5, 3.0], first_step=1) == png


def test_job_layout_names():
    job = JobConfig(nproc=8, dp_replicate=2, tp=2, sequence_parallel=True).validate()
    assert job.layout() == "dp_replicate=2 dp_shard=2 tp=2 +sp"
