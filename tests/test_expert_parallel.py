"""Expert parallelism: an ExpertParallel MoE layer equals the one-process layer (outputs, expert and
router gradients, the load-balancing bias), with the collectives it promises; the trainer's ep
layouts train to the one-process losses; bad ep jobs are refused up front.

The oracle is the same MoE layer (or the trainer's same job) run in one process on the union of
every rank's tokens. docs/parallelism.md, "Mixture of experts and expert parallelism".
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (BASE, assert_parity, layout_id, one_process_losses, refusal_in_launcher, search,
                           train_run, with_config)

RANKS = 4
TOKENS = (2, 5)  # per rank: 2 sequences of 5 tokens (10 tokens x top-2 = 20 rows over 8 experts)


# ---------------------------------------------------------------------- the dispatch plan (pure)
def test_dispatch_plan_sends_every_row_once_and_groups_by_expert():
    from shardwise.parallel.expert_parallel import plan_dispatch

    plan = plan_dispatch([1, 2, 0, 3], [1, 2, 4, 0], peers=2)
    assert (plan.send_splits, plan.recv_splits, plan.expert_rows) == ([3, 3], [3, 4], [5, 2])
    assert plan.regroup.tolist() == [0, 3, 4, 5, 6, 1, 2]  # expert 0 from both senders, then expert 1
    generator = torch.Generator().manual_seed(0)
    recv = torch.randint(0, 4, (12,), generator=generator).tolist()
    plan = plan_dispatch([0] * 12, recv, peers=4)
    assert sorted(plan.regroup.tolist()) == list(range(sum(recv)))
    with pytest.raises(ValueError, match="cannot be split over 5 ranks"):
        plan_dispatch([0] * 12, [0] * 12, peers=5)


def test_simulated_routing_balanced_or_with_a_busiest_expert():
    """What a meta step's dispatch assumes (docs/tools.md, "Expert parallelism in the simulation")."""
    from shardwise.parallel.expert_parallel.dispatch import assumed_counts, assumed_exchange

    assert assumed_counts(20, 8) == [3, 3, 3, 3, 2, 2, 2, 2]  # uneven: the first experts one row more
    assert assumed_counts(20, 8, imbalance=2.0) == [5, 3, 2, 2, 2, 2, 2, 2]  # 2 x the mean 2.5, rounded
    assert assumed_counts(20, 8, imbalance=100.0) == [20, 0, 0, 0, 0, 0, 0, 0]
    send, recv = assumed_exchange(20, 8, peers=4, me=0, imbalance=2.0)
    assert recv == [5, 3] * 4 and sum(send) == 20  # every peer sends rank 0 what it routes to experts 0, 1
    assert assumed_exchange(20, 8, peers=4, me=3)[1] == [2, 2] * 4
    with pytest.raises(ValueError, match="imbalance >= 1"):
        assumed_counts(20, 8, imbalance=0.5)


def test_ep_borrows_its_ranks_from_dp_shard_in_the_mesh_axes():
    from shardwise.parallel.dims import ParallelDims
    from shardwise.train import JobConfig

    hsdp = ParallelDims(dp_replicate=2, dp_shard=4, ep=2, world_size=8)
    assert hsdp.mesh_axes() == [("dp_replicate", 2), ("dp_shard_mod_ep", 2), ("dp_shard_in_ep", 2)]
    flat = hsdp.flattened_axes()  # every axis the trainer names keeps its ranks
    assert flat["dp_shard"] == ("dp_shard_mod_ep", "dp_shard_in_ep") and flat["ep"] == ("dp_shard_in_ep",)
    assert flat["dp"] == flat["dp_cp"] == ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep")
    # All of dp_shard holds different experts: FSDP's axis for them stays, of size 1.
    assert ParallelDims(dp_shard=4, ep=4, world_size=4).mesh_axes() == [("dp_shard_mod_ep", 1), ("dp_shard_in_ep", 4)]
    job = JobConfig(family="moe", config="tiny_moe", nproc=4, ep=2, tp=2).validate()
    assert job.describe_layout().startswith("FSDP dp_shard=2 + TP tp=2 + EP ep=2") and "ep=2" in job.layout()


# ---------------------------------------------------------------------- one layer vs one process
def _layer_and_tokens(groups: int = RANKS, skewed: bool = False):
    """The tiny_moe config's MoE layer (seeded), and each group's tokens [groups, 2, 5, dim].

    Without its auxiliary loss: its gradient is a mean over each rank's sequences, which the
    trainer's data parallelism averages (the parity runs check it), not this test's sum.
    """
    from dataclasses import replace

    from shardwise.train.models.moe import CONFIGS, MoE

    torch.manual_seed(0)
    args = CONFIGS["tiny_moe"]
    layer = MoE(args.dim, replace(args.moe, aux_loss_coeff=0.0))
    layer.init_weights(0.02)
    if skewed:  # experts 0 and 1 win every token at first
        with torch.no_grad():
            layer.router.gate.weight[:2] += 0.5
    tokens = torch.randn(groups, *TOKENS, args.dim)
    return layer, tokens


STYLES = {  # (mesh shape, axis names, style, the tokens' groups: one per ep rank)
    "ep4": ((4,), ("ep",), "ExpertParallel", 4),
    "ep2_tp2": ((2, 2), ("ep", "tp"), "ExpertTensorParallel", 2),
    "tp4": ((4,), ("tp",), "TensorParallel", 1),
}


def _expert_parallel_layer(kind: str):
    """On every rank: the layer's output, gradients and collectives under the style of ``kind``."""
    import shardwise as sw
    import shardwise.parallel.expert_parallel as styles
    from shardwise.debug import CommDebugMode, explain
    from shardwise.parallel import parallelize_module

    mesh_shape, names, style, groups = STYLES[kind]
    layer, tokens = _layer_and_tokens(groups)
    mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    group = mesh.get_local_rank("ep") if "ep" in names else 0  # the tp ranks of an ep rank hold the same tokens
    parallelize_module(layer, mesh, {"experts": getattr(styles, style)()})
    x = tokens[group].clone().requires_grad_(True)
    probe = _probe(tokens)[group]
    with CommDebugMode() as forward, explain() as shown:
        out = layer(x)
    with CommDebugMode() as backward:
        (out * probe).sum().backward()
    experts = {name: p.grad.full_tensor() for name, p in layer.experts.named_parameters()}
    first_of_group = "tp" not in names or mesh.get_local_rank("tp") == 0
    return {"out": out.detach(), "x_grad": x.grad, "experts": experts, "group": group,
            "gate": layer.router.gate.weight.grad if first_of_group else None,
            "counts": layer.tokens_per_expert.clone() if first_of_group else None,
            "comms": [{k: v for k, v in c.get_comm_counts().items() if v} for c in (forward, backward)],
            "exchanges": [(c.module, c.bytes, c.per_peer) for c in shown.explanation.all_collectives()
                          if c.kind == "all_to_all"],
            "ep_rank": mesh.get_local_rank("ep") if "ep" in names else None}


def _probe(tokens: torch.Tensor) -> torch.Tensor:
    return torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(STYLES))
def test_expert_parallel_layer_equals_one_process_values_and_gradients(dist, kind):
    per_rank = dist.run(RANKS, _expert_parallel_layer, kind, timeout=120)
    _, names, style, groups = STYLES[kind]
    layer, tokens = _layer_and_tokens(groups)
    x = tokens.clone().requires_grad_(True)
    out = layer(x.flatten(0, 1)).view_as(x)  # every group's sequences in one batch
    (out * _probe(tokens)).sum().backward()
    split_over_ep = [{"all_to_all": 3}, {"all_to_all": 2}]  # counts, dispatch, combine; the two row exchanges
    over_tp = {"all_reduce": 1}  # forward: the experts' partial sums; backward: the rows' gradient
    for got in per_rank:
        torch.testing.assert_close(got["out"], out[got["group"]].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["x_grad"], x.grad[got["group"]], rtol=1e-5, atol=1e-6)
        for name, grad in got["experts"].items():  # every group's tokens' gradients, gathered whole
            torch.testing.assert_close(grad, getattr(layer.experts, name).grad, rtol=1e-5, atol=1e-6)
        want = [{**(c if "ep" in names else {}), **(over_tp if "tp" in names else {})} for c in split_over_ep]
        assert got["comms"] == want, got["comms"]
    if "ep" in names:
        _check_explained_exchanges(per_rank)
    firsts = [r for r in per_rank if r["gate"] is not None]
    torch.testing.assert_close(sum(r["gate"] for r in firsts), layer.router.gate.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sum(r["counts"] for r in firsts), layer.tokens_per_expert)


def _check_explained_exchanges(per_rank: list[dict]) -> None:
    """``explain`` shows the counts, dispatch and combine all_to_alls under the experts module with
    bytes per peer: none to itself, summing to the bytes sent, and each rank's combine sends peer
    s what s's dispatch sent it."""
    by_ep = {r["ep_rank"]: r["exchanges"] for r in per_rank}
    for ep_rank, exchanges in by_ep.items():
        assert len(exchanges) == 3, exchanges
        for module, sent, per_peer in exchanges:
            assert module.endswith("experts") and len(per_peer) == len(by_ep), (module, per_peer)
            assert per_peer[ep_rank] == 0 and sum(per_peer) == sent
        combine = exchanges[2][2]
        assert combine == [by_ep[s][1][2][ep_rank] for s in range(len(by_ep))], (ep_rank, combine)


def _misfit_experts(kind: str) -> None:
    """On every rank: a style refused before any collective (the plan is checked first)."""
    import shardwise as sw
    import shardwise.parallel.expert_parallel as styles
    from shardwise.parallel import parallelize_module
    from shardwise.train.models.moe.model import GroupedExperts

    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    experts = GroupedExperts(8, 4, 3)  # 3 experts on 2 ranks
    parallelize_module(experts, mesh, getattr(styles, kind)())


@pytest.mark.parametrize("kind,message", [
    ("ExpertParallel", r"the same number of experts along dim 0, divisible by the 2 ranks"),
    ("ExpertTensorParallel", r"needs a 2-D \(ep, tp\) mesh"),
])
def test_a_style_that_does_not_fit_is_refused_on_every_rank(dist, kind, message):
    dist.run_expect_error(2, _misfit_experts, kind, match=message, exc_type=ValueError)


# ---------------------------------------------------------------------- the trainer's model: gradients
def _trainer_gradients(argv: list[str]) -> dict[str, torch.Tensor]:
    """The trainer's model for ``argv`` after one forward and backward of step 0's batch: every
    parameter's whole gradient (rank 0's answer; ``full_tensor`` is collective, so all ranks ask)."""
    from shardwise.train import cli
    from shardwise.train.data import BatchSource, load_corpus
    from shardwise.train.trainer import Runtime, build_model, loss_fn

    job = cli.job_from_argv(argv)
    runtime = Runtime.create(job)
    model = build_model(job, runtime)
    data = BatchSource(load_corpus(), job.global_batch, job.seq_len, job.seed, runtime.dims.dp_degree, runtime.dp_rank)
    inputs, labels = data.batch_at(0)
    loss_fn(model(inputs), labels).backward()
    return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for name, p in model.named_parameters()}


def test_expert_gradients_under_ep_and_fsdp_equal_one_process(dist):
    """--ep 2 --dp-shard 4: experts split over 2 ranks and FSDP-sharded over the other 2, their
    gradients divided by all 4 data-parallel ranks (AdamW would hide a wrong factor in the losses)."""
    argv = MOE + ["--nproc", "4", "--ep", "2", "--dp-shard", "4"]
    got = dist.run(4, _trainer_gradients, argv, timeout=120)[0]
    want = _trainer_gradients(MOE)
    assert got.keys() == want.keys() and any(".moe.experts." in name for name in got)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------- load balancing
def _imbalance(counts: torch.Tensor) -> float:
    return float(counts.max() / counts.mean())


def _balancing_steps(layer, tokens: torch.Tensor, steps: int, dp_mesh=None) -> list[float]:
    """Forward ``tokens`` ``steps`` times, updating the bias after each; the imbalance seen at each."""
    from shardwise.train.models.moe.parallelize import update_expert_bias

    seen = []
    for _ in range(steps):
        with torch.no_grad():
            layer(tokens)
        counts = layer.tokens_per_expert.clone()
        update_expert_bias(layer, dp_mesh)
        seen.append(counts)
    return seen


def test_load_balancing_bias_moves_a_skewed_router_towards_balance():
    layer, tokens = _layer_and_tokens(skewed=True)  # load_balance_coeff 1e-2
    seen = _balancing_steps(layer, tokens.flatten(0, 1), steps=40)
    assert _imbalance(seen[0]) > 2, "the router is not skewed to start with"
    assert _imbalance(seen[-1]) < 0.65 * _imbalance(seen[0]), [_imbalance(c) for c in seen]
    assert float(layer.expert_bias[:2].max()) < 0 < float(layer.expert_bias[2:].max())


def _balancing_under_ep(steps: int):
    import shardwise as sw
    from shardwise.parallel import ExpertParallel, parallelize_module

    layer, tokens = _layer_and_tokens(skewed=True)
    mesh = sw.init_device_mesh("cpu", (RANKS,), mesh_dim_names=("ep",))
    parallelize_module(layer, mesh, {"experts": ExpertParallel()})
    _balancing_steps(layer, tokens[mesh.get_local_rank()], steps, dp_mesh=mesh)
    return layer.expert_bias.clone()


def test_load_balancing_bias_under_expert_parallelism_equals_one_process(dist):
    steps = 12
    per_rank = dist.run(RANKS, _balancing_under_ep, steps, timeout=120)
    layer, tokens = _layer_and_tokens(skewed=True)
    seen = _balancing_steps(layer, tokens.flatten(0, 1), steps)
    assert _imbalance(seen[-1]) < _imbalance(seen[0])
    for bias in per_rank:
        torch.testing.assert_close(bias, layer.expert_bias, rtol=0, atol=1e-6)


SKEW = 0.05  # added to experts 0 and 1's bias at the start: they win about 3 in 4 token-choices


def _trainer_balancing(argv: list[str], steps: int) -> dict:
    """On every rank (or alone): the trainer's model for ``argv``, every MoE layer's bias skewed
    towards experts 0 and 1, then ``steps`` forwards of the trainer's batches, each followed by
    the family's update as the trainer calls it (``after_optimizer_step`` on the loss mesh). The
    tokens per expert this rank counted at each step (None on a tp rank after the first: tp ranks
    route the same tokens) and the biases at the end [layers, experts]."""
    from shardwise.train import cli
    from shardwise.train.data import BatchSource, load_corpus
    from shardwise.train.models.moe.model import moe_layers
    from shardwise.train.trainer import Runtime, build_model

    job = cli.job_from_argv(argv)
    runtime = Runtime.create(job)
    model = build_model(job, runtime)
    layers = moe_layers(model)
    for layer in layers:
        layer.expert_bias[:2] += SKEW
    data = BatchSource(load_corpus(), job.global_batch, job.seq_len, job.seed, runtime.dims.dp_degree, runtime.dp_rank)
    seen = []
    for step in range(steps):
        with torch.no_grad():
            model(data.batch_at(step)[0])
        seen.append(torch.stack([layer.tokens_per_expert for layer in layers]).clone())  # [layers, experts]
        job.model_family().after_optimizer_step(model, runtime.loss_mesh)
    counts_tokens = not runtime.dims.tp_enabled or runtime.world_mesh["tp"].get_local_rank() == 0
    return {"seen": torch.stack(seen) if counts_tokens else None,
            "bias": torch.stack([layer.expert_bias for layer in layers]).clone()}


@pytest.mark.parametrize("flags", [["--ep", "2", "--dp-shard", "4"], ["--ep", "2", "--tp", "2"],
                                   ["--dp-replicate", "2", "--dp-shard", "2", "--ep", "2"]], ids=layout_id)
def test_load_balancing_under_trainer_ep_layouts_moves_like_one_process(dist, flags):
    """The skewed routing balances out under the trainer's ep layouts (with FSDP, TP, HSDP)
    exactly as in one process: each step's tokens per expert, summed over the data-parallel
    ranks, are the one-process counts, and every rank ends with the one-process biases (tp
    ranks, which count the same tokens, are not summed twice: ``update_expert_bias`` reduces
    over the loss mesh only)."""
    steps = 10
    per_rank = dist.run(4, _trainer_balancing, MOE + ["--nproc", "4", *flags], steps, timeout=180)
    want = _trainer_balancing(MOE, steps)
    seen = sum(r["seen"] for r in per_rank if r["seen"] is not None)  # [steps, layers, experts]
    assert torch.equal(seen, want["seen"]), (seen.sum(1), want["seen"].sum(1))
    imbalance = [_imbalance(c.sum(0)) for c in seen]  # busiest expert over the mean, all layers
    assert imbalance[0] > 2.5 and sum(imbalance[-3:]) / 3 < 0.75 * imbalance[0], imbalance  # batches vary: 3 steps
    assert float(want["bias"][:, :2].max()) < SKEW - 0.03, want["bias"]  # 1e-2 a step, down for the busiest
    for rank, got in enumerate(per_rank):
        torch.testing.assert_close(got["bias"], want["bias"], rtol=0, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")


# ---------------------------------------------------------------------- the trainer's ep layouts
MOE = with_config(BASE, "tiny_moe") + ["--family", "moe"]
LAYOUTS = [
    (4, ["--ep", "4"]),
    (4, ["--ep", "2", "--tp", "2", "--sequence-parallel"]),
    (4, ["--dp-replicate", "2", "--dp-shard", "2", "--ep", "2"]),
    (4, ["--ep", "2", "--dp-shard", "4"]),  # experts also FSDP-sharded, over the 2 ranks holding the same ones
    (8, ["--ep", "2", "--dp-shard", "4", "--tp", "2"]),
    # Pipeline stages, each with its experts over ep; torch's pipelining runs each stage once more
    # at the first step to infer shapes, which must not count towards the load-balancing bias.
    (4, ["--ep", "2", "--pp", "2", "--dp-shard", "2"]),
    # ep over the cp ranks (dp_shard 2 x cp 2: ep = cp); the config has no sequence-wise aux loss.
    (4, ["--ep", "2", "--cp", "2", "--config", "tiny_moe_cp"]),
]


@pytest.mark.e2e
@pytest.mark.parametrize("nproc,flags", LAYOUTS, ids=layout_id)
def test_expert_parallel_layout_trains_to_the_one_process_losses(trainer_runs, nproc, flags):
    config = flags[flags.index("--config") + 1] if "--config" in flags else "tiny_moe"
    flags = [f for f in flags if f not in ("--config", config)]
    reference = list(one_process_losses(tuple(with_config(MOE, config))))
    assert_parity(trainer_runs.losses(nproc, ["--family", "moe", *flags], config=config), reference, " ".join(flags))
    assert reference[-1] < reference[0], "the reference run does not learn"


@pytest.mark.e2e
def test_checkpoint_saved_under_ep_resumes_without_ep_with_the_same_losses(dist, tmp_path):
    """Saved on --ep 4 after 3 steps (experts Shard(0) over 4 ranks, AdamW moments, the
    load-balancing bias), resumed on --ep 2 --tp 2 for the rest, then the last step again on
    --dp-shard 4 without ep: the losses of the uninterrupted one-process run."""
    ckpt = str(tmp_path / "ckpt")
    whole = one_process_losses(tuple(MOE))
    layouts = [(["--ep", "4", "--stop-after", "3"], slice(0, 3)), (["--ep", "2", "--tp", "2", "--stop-after", "5"],
                                                                    slice(3, 5)), (["--dp-shard", "4"], slice(5, 6))]
    for i, (flags, steps) in enumerate(layouts):
        resume = ["--resume"] if i else []
        got = dist.run(4, train_run, MOE + ["--nproc", "4", "--checkpoint-dir", ckpt, *resume, *flags], timeout=240)
        assert_parity(got[0]["losses"], list(whole[steps]), " ".join(flags), steps=steps.stop - steps.start)


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("argv,message", [
    (["--nproc", "4", "--ep", "3"], r"--ep 3 must divide the FSDP degree dp_shard = 4"),
    (["--nproc", "8", "--ep", "2", "--cp", "4", "--config", "tiny_moe_cp", "--seq-len", "64"],
     r"--ep 2 must divide the FSDP degree dp_shard x cp = 2 x 4 = 8 and be a multiple of --cp 4"),
    (["--nproc", "4", "--cp", "2"], r"config 'tiny_moe''s auxiliary balance loss \(aux_loss_coeff=0.01\)"),
    (["--nproc", "2", "--ep", "2", "--family", "llama", "--config", "tiny"], r"model family 'llama' has no experts"),
    (["--nproc", "4", "--ep", "2", "--simulate", "--simulate-expert-imbalance", "0.5"],
     r"--simulate-expert-imbalance is the busiest expert's rows over the mean, at least 1; got 0.5"),
    (["--nproc", "4", "--ep", "2", "--simulate-expert-imbalance", "2"], r"use it with --simulate and --ep"),
    (["--nproc", "16", "--ep", "16", "--dp-shard", "16", "--global-batch", "16"],
     r"--ep 16 must divide the experts of config 'tiny_moe': num_experts=8"),
])
def test_a_bad_ep_job_is_one_error_line(monkeypatch, capsys, argv, message):
    err = refusal_in_launcher(monkeypatch, capsys, [*MOE, *argv])
    assert search(message, err), err
