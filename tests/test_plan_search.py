"""shardwise.plan's pure logic: layouts enumerated, links placed, memory and time priced, ranked."""

from __future__ import annotations

import json

import pytest

from shardwise.plan.search import Candidate, LayoutCost, axis_links, candidates, load_hardware, price, rank_plans


def test_candidates_cover_the_world_and_name_what_is_invalid():
    found = dict(candidates(8, n_heads=8, n_kv_heads=4, global_batch=8, seq_len=128, max_tp=8))
    assert all(c.dp_replicate * c.dp_shard * c.cp * c.tp == 8 for c in found)
    assert len(found) == len(set(found)) == 20  # ordered splits of 8 = 2^3 into 4 factors
    assert found[Candidate(dp_shard=8)] is None
    assert "tp 8 does not divide the heads" in found[Candidate(tp=8)]
    assert "DDP with TP" in found[Candidate(dp_replicate=4, tp=2)]
    bad_batch = dict(candidates(8, 8, 4, global_batch=2, seq_len=128))
    assert "global batch 2" in bad_batch[Candidate(dp_shard=8)]


def test_axes_fall_inside_or_across_nodes_innermost_first():
    links = axis_links(Candidate(dp_replicate=2, dp_shard=8, tp=8), gpus_per_node=8)
    assert (links["tp"], links["dp_shard"], links["dp_replicate"]) == ("intra", "inter", "inter")
    links = axis_links(Candidate(dp_shard=2, tp=4), gpus_per_node=8)
    assert (links["tp"], links["dp_shard"]) == ("intra", "intra")


def test_price_overlaps_data_parallel_traffic_and_drops_what_does_not_fit(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"toy": {"memory_bytes": 100, "peak_flops": 10, "intra_node_bw": 10,
                                        "inter_node_bw": 1}}))
    hw = load_hardware("toy", str(path))
    c = Candidate(dp_shard=2, tp=2)
    # compute 1000 / (4 x 10 x 0.5) = 50 s; dp 20 bytes intra = 2 s (hidden); tp 30 bytes intra = 3 s
    plan = price(c, LayoutCost(90, {"dp_shard": 20, "tp": 30}), hw, 4, 1000, 4)
    assert plan.compute_s == pytest.approx(50) and plan.step_s == pytest.approx(53) and plan.dropped is None
    slow = price(c, LayoutCost(90, {"dp_shard": 200, "tp": 30}), hw, 2, 1000, 4)  # dp crosses nodes: 200 s
    assert slow.step_s == pytest.approx(203)
    big = price(c, LayoutCost(101, {}), hw, 4, 1000, 4)
    assert "needs" in big.dropped and "toy has" in big.dropped
    assert rank_plans([slow, big, plan]) == [plan, slow]
    with pytest.raises(ValueError, match="unknown hardware 'nope'"):
        load_hardware("nope", str(path))


def test_shipped_profiles_load():
    for name in ("h100-80gb", "a100-80gb", "h200", "cpu"):
        assert load_hardware(name).memory_bytes > 0


def test_pipeline_candidates_links_and_bubble():
    found = dict(candidates(8, 8, 4, global_batch=8, seq_len=128, max_pp=2, n_layers=4))
    assert found[Candidate(dp_shard=4, pp=2)] is None
    assert Candidate(dp_shard=2, pp=4) not in found  # beyond max_pp
    assert "local batch does not split into pp 2" in dict(candidates(4, 8, 4, global_batch=2, seq_len=128,
                                                                     max_pp=2))[Candidate(dp_shard=2, pp=2)]
    assert "does not divide the 3 layers" in dict(candidates(2, 8, 4, 8, 128, max_pp=2, n_layers=3))[Candidate(pp=2)]
    # pp is outermost: across nodes once the ranks inside it fill a node
    assert axis_links(Candidate(dp_shard=8, pp=2), gpus_per_node=8)["pp"] == "inter"
    assert axis_links(Candidate(dp_shard=2, pp=2), gpus_per_node=8)["pp"] == "intra"
    hw = load_hardware("h100-80gb")
    cost = LayoutCost(2**30, {"pp": 0})
    flat, piped = (price(Candidate(dp_shard=2, pp=p), cost, hw, 8, 1e15, 4) for p in (1, 2))
    assert piped.compute_s == flat.compute_s * 1.5  # 1F1B, 2 microbatches: 3 slots for 2


def test_expert_parallel_candidates_and_their_all_to_alls_on_the_critical_path(tmp_path):
    """ep borrows dp_shard x cp ranks (whole cp groups); its dispatch and combine are priced by
    ``shardwise.cost`` as all_to_alls and not hidden, the experts' FSDP traffic is."""
    from shardwise.cost import Collective, Link, latency

    found = dict(candidates(8, 8, 4, global_batch=8, seq_len=128, max_tp=8, max_ep=4))
    assert {c.ep for c in found if c.dp_shard == 8} == {1, 2, 4}  # 8 would exceed max_ep
    assert {c.ep for c in found if c.dp_shard == 2 and c.cp == 2} == {1, 2, 4}  # multiples of cp 2
    assert Candidate(dp_shard=4, tp=2, ep=2).flags() == "--dp-shard 4 --tp 2 --ep 2"
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"toy": {"memory_bytes": 100, "peak_flops": 10, "intra_node_bw": 10,
                                        "inter_node_bw": 1, "inter_node_latency_s": 0.5}}))
    hw = load_hardware("toy", str(path))
    c = Candidate(dp_shard=8, ep=4)  # ep groups span 4 ranks: inside a 4-GPU node; dp_shard_mod_ep across
    assert axis_links(c, 4)["ep"] == Link.INTRA_NODE and axis_links(c, 2)["ep"] == Link.INTER_NODE
    cost = LayoutCost(90, {"ep": 30, "dp_shard_mod_ep": 20},
                      {"ep": {"all_to_all": 6}, "dp_shard_mod_ep": {"all_gather": 2}})
    plan = price(c, cost, hw, 2, 1000, 8)  # compute 1000 / (8 x 10 x 0.5) = 25 s
    a2a = 6 * latency(Collective.ALL_TO_ALL, 4, Link.INTER_NODE, hw) + 30 / 1
    assert a2a > 30 and plan.comm_s["ep"] == pytest.approx(a2a)
    assert plan.step_s == pytest.approx(25 + a2a)  # dp_shard_mod_ep's ~21 s hide under compute
    from shardwise.plan.search import axis_size

    assert axis_size(Candidate(dp_shard=8, tp=2, ep=4), "ep+tp") == 8  # a redistribute over both axes at once


def test_extrapolate_adds_the_second_blocks_figures_per_further_block():
    from shardwise.plan.search import extrapolate

    one = LayoutCost(10, {"tp": 4}, {"tp": {"all_gather": 2}})
    two = LayoutCost(13, {"tp": 6, "dp_shard": 1}, {"tp": {"all_gather": 3, "all_reduce": 1}})
    deep = extrapolate(one, two, 30)  # 31 blocks: 30 more than one
    assert deep.peak_memory_bytes == 100 and deep.comm_bytes_by_axis == {"tp": 64, "dp_shard": 30}
    assert deep.collectives_by_axis == {"tp": {"all_gather": 32, "all_reduce": 30}}
    assert extrapolate(one, two, 0) == LayoutCost(10, {"tp": 4, "dp_shard": 0}, {"tp": {"all_gather": 2, "all_reduce": 0}})


def test_changes_tried_when_nothing_fits_keep_the_savings_in_order():
    from shardwise.plan.advice import changes
    from shardwise.train.config import JobConfig

    job = JobConfig(config="llama3_8b", nproc=8, dp_shard=8, global_batch=16, seq_len=8192, device="cpu")
    tried = changes(job)
    saving = "--activation-checkpointing --mixed-precision"
    assert [c.flags for c in tried] == [
        "--activation-checkpointing", "--mixed-precision", saving, f"{saving} --global-batch 8",
        f"{saving} --seq-len 4096", f"{saving} --seq-len 2048", f"{saving} --seq-len 1024",
        f"{saving} --nproc 16", f"{saving} --nproc 32", f"{saving} --nproc 64"]
    more = tried[-1].job  # every rank keeps its 2 sequences and holds 1/64 of the state
    assert (more.nproc, more.dp_shard, more.global_batch, more.seq_len) == (64, 64, 128, 8192)
    assert more.activation_checkpointing and more.mixed_precision
    already = changes(JobConfig(config="llama3_8b", nproc=8, dp_shard=8, global_batch=8, seq_len=2048,
                                activation_checkpointing=True, mixed_precision=True))
    assert [c.flags for c in already] == ["--seq-len 1024", "--nproc 16", "--nproc 32", "--nproc 64"]


def test_help_lists_defaults_profiles_and_configs_and_each_family_plans_its_default_config(capsys):
    from shardwise.plan.__main__ import _parser, _search, main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0
    for shown in ("h100-80gb: 80.00 GiB", "cpu: 16.00 GiB", "llama3_8b (8.03B params", "deepseek_v2_lite (15.79B",
                  "tokens per sequence (default: 8192)", "(default: h100-80gb)", "configs of --family moe (default debug_moe)"):
        assert shown in text, shown
    assert _search(_parser().parse_args(["--family", "moe", "--nproc", "8"])).config == "debug_moe"
    assert _search(_parser().parse_args(["--nproc", "8"])).config == "debug"
    assert main(["--nproc", "8", "--config", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
