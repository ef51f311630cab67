"""Pipeline parallelism in the trainer: ``--pp`` layouts train to the losses of one process.

The model is split by module paths into stages (embedding on the first, norm and output on the
last), each stage parallelized on its slice of the mesh; torch.distributed.pipelining's
schedules carry the activations. Same job, runs and reference as ``test_train.py`` (6 steps,
``trainer_runs``); 8 ranks only where three mesh axes are needed. Interleaved 1F1B over 2
ranks needs 4 stages, so it trains ``tiny4`` (tiny with four blocks) against its own one-process
reference. A checkpoint of a pipelined run resumes in a plain FSDP layout and back into a
pipelined TP one, continuing the losses of the uninterrupted run.
"""

from __future__ import annotations

import os
import re

import pytest

from shardwise.parallel.pipeline_parallel.split import (num_stages, pipeline_problems, stage_layers, stage_module_paths,
                                               stages_of_rank)
from shardwise.train.config import JobConfig
from tests.helpers import (BASE, STEPS, assert_parity, layout_id, one_process_losses, refusal_in_launcher,
                           train_losses, with_config)


@pytest.fixture(scope="module")
def reference4() -> list[float]:
    """Losses of the one-process run of ``tiny4``."""
    return list(one_process_losses(tuple(with_config(BASE, "tiny4"))))


LAYOUTS = [
    (8, "tiny", ["--pp", "2", "--dp-shard", "2", "--tp", "2"]),
    (8, "tiny", ["--pp", "2", "--cp", "2", "--tp", "2", "--pp-schedule", "gpipe"]),
    (4, "tiny4", ["--pp", "2", "--dp-shard", "2", "--pp-schedule", "interleaved_1f1b"]),
]


@pytest.mark.parametrize("nproc,config,flags", LAYOUTS, ids=layout_id)
def test_pipeline_layout_trains_to_the_one_process_losses(trainer_runs, reference, reference4, nproc, config, flags):
    got = trainer_runs.losses(nproc, flags, config)
    assert_parity(got, reference if config == "tiny" else reference4, " ".join(flags))


def _train_and_list(argv: list[str]) -> tuple[list[float], list[str]]:
    """Train on every rank; the losses, and the tensor keys of the latest checkpoint (rank 0 reads them)."""
    from shardwise.checkpoint.source import open_source
    from shardwise.train.checkpointing import latest_checkpoint

    losses = train_losses(argv)
    directory = argv[argv.index("--checkpoint-dir") + 1]
    keys = sorted(open_source(latest_checkpoint(directory).path).metadata.tensors)
    return losses, keys


@pytest.mark.e2e
def test_pipelined_checkpoint_resumes_without_pipeline_and_back(dist, reference, tmp_path):
    """pp=2 x dp_shard=2 saves at step 2; dp_shard=4 resumes to step 4; pp=2 x tp=2 ends the run."""
    ckpt = str(tmp_path / "ckpt")
    run = BASE + ["--checkpoint-dir", ckpt]
    first = dist.run(4, _train_and_list, run + ["--nproc", "4", "--pp", "2", "--dp-shard", "2", "--stop-after", "2"],
                     timeout=240)
    losses, keys = first[0]
    assert_parity(losses + reference[2:], reference, "pp=2 dp_shard=2 before saving")
    # global module paths, from both stages: the embedding (stage 0) and the output layer (stage 1)
    assert {"model.tok_embeddings.weight", "model.layers.1.attention.wq.weight", "model.output.weight",
            "optimizer.state.layers.0.feed_forward.w2.weight.exp_avg"} <= set(keys)
    second = dist.run(4, train_losses, run + ["--nproc", "4", "--dp-shard", "4", "--resume", "--stop-after", "4"],
                      timeout=240)
    assert all(r == second[0] for r in second)
    third = dist.run(4, train_losses, run + ["--nproc", "4", "--pp", "2", "--tp", "2", "--resume"], timeout=240)
    assert all(r == third[0] for r in third)
    assert_parity(losses + second[0] + third[0], reference, "pp -> dp_shard=4 -> pp x tp, resumed")
    assert sorted(os.listdir(ckpt)) == ["step-2", "step-4", f"step-{STEPS}"]


# ---------------------------------------------------------------------- the split (pure)
def test_stages_are_contiguous_runs_with_embedding_first_and_output_last():
    assert stage_module_paths(4, 2, 0) == ["tok_embeddings", "layers.0", "layers.1"]
    assert stage_module_paths(4, 2, 1) == ["layers.2", "layers.3", "norm", "output"]
    assert stage_module_paths(2, 1, 0) == ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    assert stage_module_paths(8, 4, 2) == ["layers.4", "layers.5"]
    for n, stages in [(4, 4), (6, 3), (32, 8)]:
        covered = [i for s in range(stages) for i in stage_layers(n, stages, s)]
        assert covered == list(range(n))
    with pytest.raises(ValueError, match="6 layers do not split into 4 stages"):
        stage_layers(6, 4, 0)


def test_interleaved_schedule_places_two_stages_per_rank_in_loop_order():
    assert [stages_of_rank(r, 2, "1f1b") for r in range(2)] == [[0], [1]]
    assert [stages_of_rank(r, 4, "interleaved_1f1b") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert num_stages(3, "gpipe") == 3 and num_stages(3, "interleaved_1f1b") == 6
    every = sorted(s for r in range(4) for s in stages_of_rank(r, 4, "interleaved_1f1b"))
    assert every == list(range(8))


def test_pipeline_problems_name_the_flags():
    assert pipeline_problems(4, 2, "interleaved_1f1b", 4, 4) == []
    assert pipeline_problems(2, 2, "1f1b", 2, 4) == []
    assert pipeline_problems(2, 2, "interleaved_1f1b", 2, 4) == [
        "the model's 2 layers do not split into 2 x --pp 2 = 4 stages (interleaved 1F1B runs two per rank) "
        "of equally many layers"]
    assert "--pp-microbatches 3 does not divide the 4 sequences" in pipeline_problems(4, 2, "1f1b", 3, 4)[0]
    assert "is not divisible by 2" in pipeline_problems(4, 2, "interleaved_1f1b", 5, 10)[0]
    assert pipeline_problems(4, 2, "zb", 2, 4) == ["--pp-schedule must be one of gpipe, 1f1b, interleaved_1f1b, got 'zb'"]


# ---------------------------------------------------------------------- the command line (no processes)
BAD_JOBS = [
    (["--nproc", "4", "--pp", "2", "--pp-schedule", "interleaved_1f1b"],
     r"config 'tiny''s 2 layers do not split into 2 x --pp 2 = 4 stages"),
    (["--nproc", "4", "--pp", "2", "--pp-microbatches", "3"],
     r"--pp-microbatches 3 does not divide the 4 sequences of each data-parallel rank"),
    (["--nproc", "4", "--pp", "2", "--pp-microbatches", "0"], r"--pp-microbatches must be at least 1, got 0"),
    (["--nproc", "4", "--pp", "3"], r"cannot infer --dp-shard: .* --tp 1 x --pp 3 = 3"),
    (["--nproc", "4", "--pp", "2", "--dp-shard", "4"], r"--dp-replicate 1 x --dp-shard 4 x --tp 1 x --pp 2 = 8 must"),
    (["--nproc", "4", "--pp", "0"], r"must be at least 1: --pp 0"),
    (["--nproc", "4", "--pp-microbatches", "2"], r"--pp-microbatches applies to pipeline parallelism: use --pp > 1"),
    (["--nproc", "4", "--pp-schedule", "gpipe"], r"--pp-schedule applies to pipeline parallelism: use --pp > 1"),
    (["--config", "tiny4", "--nproc", "4", "--pp", "2", "--tp", "2", "--pp-schedule", "interleaved_1f1b",
      "--sequence-parallel"], r"--pp-schedule interleaved_1f1b with --sequence-parallel is not supported"),
]


@pytest.mark.parametrize("argv,message", BAD_JOBS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_pipeline_job_is_refused_up_front(monkeypatch, capsys, argv, message):
    err = refusal_in_launcher(monkeypatch, capsys, ["--config", "tiny", "--global-batch", "8", *argv])
    assert re.search(message, err), err


def test_pipeline_layout_is_named():
    job = JobConfig(config="tiny4", nproc=8, pp=2, tp=2, pp_schedule="interleaved_1f1b").validate()
    assert job.layout() == "dp_shard=2 tp=2 pp=2 +interleaved_1f1b"
    assert job.describe_layout() == ("FSDP dp_shard=2 + TP tp=2 + PP pp=2 (interleaved_1f1b, 2 microbatches) "
                                     "(dp_shard inferred: --nproc 8 / (--dp-replicate 1 x --tp 2 x --pp 2))")


def test_meta_fills_advance_the_stream_as_real_fills_do():
    """A stage's modules get their one-device values while the other stages' stay on meta."""
    import torch
    from torch import nn

    from shardwise.tensor import random as sw_random

    def fills(device: str) -> torch.Tensor:
        sw_random.manual_seed(3)
        with sw_random.layout_independent():
            nn.init.trunc_normal_(torch.empty(5, 3, device=device), std=0.02)
            nn.init.normal_(torch.empty(7, device=device))
            nn.init.uniform_(torch.empty(2, 2, dtype=torch.float64, device=device))
            return nn.init.normal_(torch.empty(4))  # the next module's values

    want = fills("cpu")
    with sw_random.meta_fills_advance():
        assert torch.equal(fills("meta"), want)
    assert not torch.equal(fills("meta"), want)  # outside, meta fills consume nothing


def test_stages_run_in_sequence_equal_the_whole_model_and_keep_its_keys():
    """split_stage: the model's own code, modules removed; chained stages give the whole model's logits."""
    import torch

    from shardwise.parallel.pipeline_parallel.pipeline import split_stage
    from shardwise.train.models.llama import CONFIGS, Transformer

    torch.manual_seed(0)
    whole = Transformer(CONFIGS["tiny4"])
    tokens = torch.randint(0, 256, (2, 16))
    stages = [split_stage(whole, stage_module_paths(4, 4, i)) for i in range(4)]
    h = tokens
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)
    assert sorted(stages[1].state_dict()) == sorted(k for k in whole.state_dict() if k.startswith("layers.1."))
    assert stages[0].norm is None and stages[3].tok_embeddings is None and list(stages[2].layers) == ["2"]
    assert len(whole.layers) == 4 and whole.output is not None  # the whole model is untouched
    with pytest.raises(ValueError, match=r"split_stage: 'layers.9' is not an entry of a ModuleDict"):
        split_stage(whole, ["layers.9"])
    with pytest.raises(ValueError, match=r"split_stage: 'head' names no module of Transformer"):
        split_stage(whole, ["head"])


# ---------------------------------------------------------------------- FSDP reduction once per step
class _Piped:
    """A tiny model splittable by ``split_stage``: its forward skips the modules a stage lacks."""

    @staticmethod
    def build():
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inp = nn.Linear(5, 6)
                self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 6))
                                             for i in range(4)})
                self.head = nn.Linear(6, 3)

            def forward(self, x):
                x = self.inp(x) if self.inp is not None else x
                for layer in self.layers.values():
                    x = x + layer(x)
                return self.head(x) if self.head is not None else x

        torch.manual_seed(0)
        return Net()


def _pipeline_fsdp_step():
    """pp=2 x dp=2, 2 microbatches, FSDP (gpipe and 1f1b) or DDP stages: the stage's gradients
    after one step, and the reduce_scatters, all_reduces and all_gathers that step issued."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import shardwise as sw
    from shardwise.debug import CommDebugMode
    from shardwise.fsdp import fully_shard, replicate
    from shardwise.parallel.pipeline_parallel.pipeline import PipelineRunner, split_stage

    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    keep = (["inp", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"])[pp]
    out = {}
    for schedule, data_parallel in (("gpipe", "fsdp"), ("1f1b", "fsdp"), ("1f1b", "ddp")):
        stage = split_stage(_Piped.build(), keep)
        if data_parallel == "ddp":
            replicate(stage, mesh=mesh["dp"])
        else:
            for name in keep:
                if name.startswith("layers."):
                    fully_shard(stage.layers[name.split(".")[1]], mesh=mesh["dp"])
            fully_shard(stage, mesh=mesh["dp"])
        runner = PipelineRunner([stage], [pp], 2, mesh["pp"], torch.device("cpu"), schedule, 2,
                                lambda out, target: nn.functional.mse_loss(out, target))
        batch = (x[dp * 4:(dp + 1) * 4], y[dp * 4:(dp + 1) * 4])
        # The first step infers the stages' shapes with autograd.grad, which the module
        # tracking of CommDebugMode (an "all" gradient hook on the leaf stage input) cannot be in.
        runner.step(*batch)
        stage.zero_grad()
        with CommDebugMode() as comms:
            runner.step(*batch)
        grads = {n: p.grad.full_tensor() for n, p in stage.named_parameters()}
        counts = comms.get_comm_counts()
        out[schedule, data_parallel] = (grads, counts.get("reduce_scatter", 0), counts.get("all_reduce", 0),
                                        counts.get("all_gather", 0))
    dist.barrier()
    return out


def test_pipeline_stages_reduce_fsdp_gradients_once_per_step(dist):
    import torch
    from torch import nn

    model = _Piped.build()
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    nn.functional.mse_loss(model(x), y).backward()  # mean of the microbatch means: the batch mean
    want = {n: p.grad for n, p in model.named_parameters()}
    for per_schedule in dist.run(4, _pipeline_fsdp_step):
        for (_, data_parallel), (grads, reduce_scatters, all_reduces, all_gathers) in per_schedule.items():
            assert grads and set(grads) <= set(want)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)
            # FSDP: three groups per stage (two blocks and the stage root); DDP: one bucket.
            # Each is reduced once per step, not once per microbatch.
            assert (reduce_scatters, all_reduces) == ((3, 0) if data_parallel == "fsdp" else (0, 1))
            # FSDP gathers as torch's stages do: the first forward gathers the three groups, the
            # two blocks (freed after each forward) are gathered again by one more forward and
            # one backward; after a backward before the last, nothing is freed (7, not 10).
            assert all_gathers == (7 if data_parallel == "fsdp" else 0)
