"""``python -m shardwise.plan --config llama3_8b --nproc 1024 --hardware h100-80gb --gpus-per-node 8``

Enumerates every (dp_replicate, dp_shard, cp, tp, pp) split of the world (pp up to
``--max-pp``), for a family with experts each with every expert-parallel degree it admits (up to
``--max-ep``; routing assumed balanced), drops the invalid ones with the reason, simulates each valid layout
(``shardwise.simulate``: once with one block per pipeline stage and once with two,
extrapolated linearly to the model's depth, since every block costs the same),
prices it on the hardware profile (``search.price``) and prints the fastest that fit, each as
the trainer command that runs it. Any registered model family plans alike (``--family``; its
counts, depth and shape checks come from its ``shardwise.train.spec.ModelFamily``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import TYPE_CHECKING, Any

from shardwise.plan.search import Candidate, LayoutCost, candidates, load_hardware, price, rank_plans

if TYPE_CHECKING:
    from shardwise.train.config import JobConfig
    from shardwise.train.spec import ModelFamily

PROG = "shardwise.plan"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default=None, help="model family (default: the trainer's)")
    p.add_argument("--config", default="llama3_8b", help="one of the family's configs")
    p.add_argument("--nproc", type=int, required=True, help="GPUs in the world")
    p.add_argument("--hardware", default="h100-80gb", help="a profile of shardwise/plan/hardware.json")
    p.add_argument("--hardware-file", default=None, help="a JSON file of profiles of the same form")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: --nproc)")
    p.add_argument("--max-cp", type=int, default=1, help="largest context-parallel degree considered")
    p.add_argument("--max-pp", type=int, default=1,
                   help="largest pipeline degree considered (1F1B, microbatches = pp)")
    p.add_argument("--max-ep", type=int, default=None,
                   help="largest expert-parallel degree considered (default: every one the model's experts admit; "
                        "1 for a family without experts)")
    p.add_argument("--max-replicate", type=int, default=None,
                   help="largest dp_replicate considered (each layout is one simulation: fewer is faster)")
    p.add_argument("--activation-checkpointing", action="store_true", help="plan with recomputed block activations")
    p.add_argument("--mixed-precision", action="store_true", help="plan with bf16 parameters and activations")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--show-dropped", action="store_true", help="list every dropped layout with its reason")
    return p


def simulated_cost(job: JobConfig, n_layers: int) -> LayoutCost:
    """The busiest rank's peak memory, bytes and collectives per axis, extrapolated from
    simulations with 1 and 2 blocks per pipeline stage (the job carries those shapes itself:
    ``JobConfig.shapes``)."""
    from shardwise.simulate import simulate_job

    family = job.model_family()
    named = family.config(job.config)
    figures = []
    for layers in (job.pp, 2 * job.pp):
        report = simulate_job(dataclasses.replace(job, shapes=family.with_layers(named, layers)))
        worst = max(report.per_rank, key=lambda m: m.peak_memory_bytes)
        figures.append(worst)
    one, two = figures
    more = n_layers // job.pp - 1  # blocks per stage beyond the first
    peak = one.peak_memory_bytes + more * (two.peak_memory_bytes - one.peak_memory_bytes)
    axes = {a: one.comm_bytes_by_axis.get(a, 0) + more * (two.comm_bytes_by_axis.get(a, 0) - one.comm_bytes_by_axis.get(a, 0))
            for a in set(one.comm_bytes_by_axis) | set(two.comm_bytes_by_axis)}
    calls = {a: {k: one.collectives_by_axis.get(a, {}).get(k, 0)
                 + more * (two.collectives_by_axis.get(a, {}).get(k, 0) - one.collectives_by_axis.get(a, {}).get(k, 0))
                 for k in set(one.collectives_by_axis.get(a, {})) | set(two.collectives_by_axis.get(a, {}))}
             for a in set(one.collectives_by_axis) | set(two.collectives_by_axis)}
    return LayoutCost(peak, axes, calls)


def main(argv: list[str] | None = None) -> int:
    from shardwise.train.config import ConfigError, JobConfig

    ns = _parser().parse_args(argv)
    model = {"family": ns.family} if ns.family else {}  # without --family: JobConfig's default
    try:
        family = JobConfig(config=ns.config, **model).model_family()
        args = family.config(ns.config)
        hw = load_hardware(ns.hardware, ns.hardware_file)
    except (ConfigError, ValueError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    batch = ns.global_batch or ns.nproc
    tokens = batch * ns.seq_len
    flops = family.flops_per_token(args, ns.seq_len) * tokens
    n_layers = family.num_layers(args)
    print(f"{PROG}: {ns.config} ({family.num_params(args) / 1e9:.2f}B params) on {ns.nproc} x {hw.name} "
          f"({ns.gpus_per_node} per node), global batch {batch} x {ns.seq_len} tokens; "
          f"compute {flops:.3g} FLOP/step at {hw.peak_flops:.3g} FLOP/s x MFU 0.5 per GPU")
    plans, dropped = [], []
    started = time.perf_counter()
    # Heads 0 turn search's own head check off: the family checks its shapes (``_model_refuses``).
    max_ep = ns.max_ep if ns.max_ep is not None else (ns.nproc if family.expert_parallel is not None else 1)
    for cand, why in candidates(ns.nproc, 0, 0, batch, ns.seq_len, ns.gpus_per_node, ns.max_pp, n_layers, max_ep):
        if why is None:
            why = _model_refuses(family, args, cand, ns)
        if why is None and cand.cp > ns.max_cp:
            why = f"cp {cand.cp} > --max-cp {ns.max_cp}"
        if why is None and ns.max_replicate is not None and cand.dp_replicate > ns.max_replicate:
            why = f"dp_replicate {cand.dp_replicate} > --max-replicate {ns.max_replicate}"
        if why is not None:
            dropped.append((cand, why))
            continue
        job = JobConfig(config=ns.config, **model, nproc=ns.nproc, global_batch=batch, seq_len=ns.seq_len, device="cpu",
                        activation_checkpointing=ns.activation_checkpointing, mixed_precision=ns.mixed_precision,
                        **cand.degrees())
        try:
            cost = simulated_cost(job, n_layers)
        except Exception as err:  # a layout the simulation cannot run is reported, not fatal
            dropped.append((cand, f"simulation failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"))
            continue
        plan = price(cand, cost, hw, ns.gpus_per_node, flops, ns.nproc)
        if plan.dropped:
            dropped.append((cand, plan.dropped))
        plans.append(plan)
    ranked = rank_plans(plans)
    extra = "".join(f" --{f}" for f, on in (("activation-checkpointing", ns.activation_checkpointing),
                                            ("mixed-precision", ns.mixed_precision)) if on)
    print(f"{PROG}: {len(plans)} valid layouts simulated in {time.perf_counter() - started:.0f} s, "
          f"{len(ranked)} fit, {len(dropped)} dropped")
    print("overlap: data-parallel traffic (dp_shard, dp_replicate) hides under compute; tp/cp traffic does not"
          + ("; nor do ep's token all_to_alls (the experts' FSDP on dp_shard_mod_ep does hide)" if max_ep > 1 else "")
          + ("; pp sends do not, and the 1F1B bubble adds (pp - 1)/pp of compute" if ns.max_pp > 1 else ""))
    for i, p in enumerate(ranked[:ns.top], 1):
        comm = ", ".join(f"{a} {t * 1e3:.0f} ms ({p.placement[a]})" for a, t in sorted(p.comm_s.items()))
        print(f"{i}. step {p.step_s:.2f} s (compute {p.compute_s:.2f} s; {comm or 'no communication'}); "
              f"peak {p.cost.peak_memory_bytes / 2**30:.1f} GiB/GPU")
        family_flag = f" --family {ns.family}" if ns.family else ""
        print(f"   python -m shardwise.train{family_flag} --config {ns.config} --nproc {ns.nproc} {p.candidate.flags()} "
              f"--global-batch {batch} --seq-len {ns.seq_len}{extra}")
    shown = dropped if ns.show_dropped else [d for d in dropped if "GiB" in d[1] or "simulation" in d[1]][:6]
    for cand, why in shown:
        print(f"   dropped {cand.flags()}: {why}")
    return 0 if ranked else 1


def _model_refuses(family: ModelFamily, args: Any, cand: Candidate, ns: argparse.Namespace) -> str | None:
    """The family's reason the layout does not fit its shapes (heads not divisible by tp), or None."""
    from shardwise.parallel.dims import ParallelDims
    from shardwise.train.config import ConfigError

    if cand.ep > 1 and family.expert_parallel is None:
        return f"ep {cand.ep}: the family has no experts"
    try:
        dims = ParallelDims(**cand.degrees(), world_size=ns.nproc)
        family.check_degrees(args, dims, ns.config)
    except (ConfigError, ValueError) as err:
        return str(err)
    return None


if __name__ == "__main__":
    sys.exit(main())
