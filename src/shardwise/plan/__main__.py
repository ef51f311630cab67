"""``python -m shardwise.plan --config llama3_8b --nproc 1024 --hardware h100-80gb --gpus-per-node 8``

Ranks the parallel layouts of a world by the numbers ``python -m shardwise.train ... --simulate``
prints (docs/plan.md). Enumerates every (dp_replicate, dp_shard, cp, tp, pp) split of the world
(pp up to ``--max-pp``; for a family with experts, every expert-parallel degree it admits, up to
``--max-ep``, routing assumed balanced) and drops the invalid ones with the reason. Each valid
layout is estimated from simulations of one and two blocks per pipeline stage
(``simulated.estimated_cost``) and priced by the one cost model (``search.price``,
``shardwise.cost``); then, fastest first, layouts are simulated at full depth as ``--simulate``
simulates them (``simulated.simulated_cost``), priced again from those figures, and kept if
their simulated peak fits, until ``--top`` are found. When none fits, the closest layout is tried
with each change of ``advice.changes`` and the first that fits is printed as a command. Any
registered model family plans alike (``--family``; its counts, depth and shape checks come from
its ``shardwise.train.spec.ModelFamily``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from shardwise.cost import HARDWARE_FILE, Hardware
from shardwise.plan.advice import changes
from shardwise.plan.search import Candidate, LayoutCost, Plan, candidates, fits, load_hardware, price, rank_plans
from shardwise.units import format_bytes

if TYPE_CHECKING:
    from shardwise.train.config import JobConfig
    from shardwise.train.spec import ModelFamily

PROG = "shardwise.plan"
DESCRIPTION = ("Rank the parallel layouts of a world by predicted step time, with the peak memory per GPU that "
               "'python -m shardwise.train ... --simulate' prints for each (docs/plan.md). When none fits, say "
               "which change makes the closest fit, as a command.")


def _epilog() -> str:
    """The hardware profiles and every family's configs, for ``--help``."""
    from shardwise.train.config import describe_config
    from shardwise.train.spec import family_names, get_family

    with open(HARDWARE_FILE) as f:
        profiles = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    lines = ["hardware profiles (--hardware):"]
    lines += [f"  {name}: {format_bytes(p['memory_bytes'])}, {p['peak_flops']:.3g} FLOP/s, "
              f"{p.get('gpus_per_node', 8)} per node" for name, p in profiles.items()]
    for name in family_names():
        family = get_family(name)
        lines.append(f"configs of --family {name} (default {family.default}):")
        lines += [f"  {describe_config(family, c)}" for c in family.configs]
    return "\n".join(lines)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's lines; appends ``(default: X)`` where a default means something."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _parser() -> argparse.ArgumentParser:
    from shardwise.train.config import DEFAULT_FAMILY

    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=_epilog(), formatter_class=_Formatter)
    p.add_argument("--family", default=DEFAULT_FAMILY, help="model family")
    p.add_argument("--config", default=None, help="one of the family's configs (default: the family's default, "
                                                   "as the trainer's; listed below)")
    p.add_argument("--nproc", type=int, required=True, help="GPUs in the world")
    p.add_argument("--hardware", default="h100-80gb", help="a profile of shardwise/plan/hardware.json (listed below)")
    p.add_argument("--hardware-file", default=None, help="a JSON file of profiles of the same form")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing the intra-node link")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: --nproc)")
    p.add_argument("--max-cp", type=int, default=1, help="largest context-parallel degree considered")
    p.add_argument("--max-pp", type=int, default=1,
                   help="largest pipeline degree considered (1F1B, microbatches = pp)")
    p.add_argument("--max-ep", type=int, default=None,
                   help="largest expert-parallel degree considered (default: every one the model's experts admit; "
                        "1 for a family without experts)")
    p.add_argument("--max-replicate", type=int, default=None,
                   help="largest dp_replicate considered (default: any; each layout is simulated: fewer is faster)")
    p.add_argument("--activation-checkpointing", action="store_true", help="plan with recomputed block activations")
    p.add_argument("--mixed-precision", action="store_true", help="plan with bf16 parameters and activations")
    p.add_argument("--top", type=int, default=5,
                   help="layouts to rank, each simulated at full depth (as long as about 6 estimates: fewer is faster)")
    p.add_argument("--show-dropped", action="store_true", help="list every dropped layout with its reason")
    return p


@dataclass(frozen=True)
class Search:
    """What one plan searches: the parsed flags and what follows from them."""

    ns: argparse.Namespace
    config: str
    family: ModelFamily
    args: Any
    hw: Hardware
    batch: int
    flops: float

    def job(self, cand: Candidate) -> JobConfig:
        """The trainer's job for ``cand`` (on the CPU: the simulation runs here)."""
        from shardwise.train.config import JobConfig

        return JobConfig(config=self.config, family=self.ns.family, nproc=self.ns.nproc, global_batch=self.batch,
                         seq_len=self.ns.seq_len, device="cpu", activation_checkpointing=self.ns.activation_checkpointing,
                         mixed_precision=self.ns.mixed_precision, **cand.degrees())

    def price(self, job: JobConfig, cost: LayoutCost) -> Plan:
        """``job``'s step priced by the cost model on this search's hardware."""
        flops = self.family.flops_per_token(self.args, job.seq_len) * job.global_batch * job.seq_len
        return price(_candidate(job), cost, self.hw, self.ns.gpus_per_node, flops, job.nproc)


def _candidate(job: JobConfig) -> Candidate:
    return Candidate(job.dp_replicate, job.dp_shard, job.cp, job.tp, job.pp, job.ep)


def command(job: JobConfig, module: str = "shardwise.train") -> str:
    """The command line that runs ``job`` (``--simulate`` added, simulates it)."""
    from shardwise.train.config import DEFAULT_FAMILY

    family = f" --family {job.family}" if job.family != DEFAULT_FAMILY else ""
    flags = "".join(f" --{f}" for f, on in (("activation-checkpointing", job.activation_checkpointing),
                                            ("mixed-precision", job.mixed_precision)) if on)
    layout = f" {_candidate(job).flags()}" if module == "shardwise.train" else ""
    return (f"python -m {module}{family} --config {job.config} --nproc {job.nproc}{layout} "
            f"--global-batch {job.global_batch} --seq-len {job.seq_len}{flags}")


def _search(ns: argparse.Namespace) -> Search:
    """The search the flags describe; ``ConfigError`` or ``ValueError`` naming a bad one."""
    from shardwise.train.spec import get_family

    family = get_family(ns.family)
    config = ns.config or family.default
    args = family.config(config)
    hw = load_hardware(ns.hardware, ns.hardware_file)
    batch = ns.global_batch or ns.nproc
    return Search(ns, config, family, args, hw, batch, family.flops_per_token(args, ns.seq_len) * batch * ns.seq_len)


def _valid(s: Search) -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """The layouts to simulate, and the others with why."""
    ns, valid, dropped = s.ns, [], []
    max_ep = ns.max_ep if ns.max_ep is not None else (ns.nproc if s.family.expert_parallel is not None else 1)
    n_layers = s.family.num_layers(s.args)
    # Heads 0 turn search's own head check off: the family checks its shapes (``_model_refuses``).
    for cand, why in candidates(ns.nproc, 0, 0, s.batch, ns.seq_len, ns.gpus_per_node, ns.max_pp, n_layers, max_ep):
        if why is None:
            why = _model_refuses(s, cand)
        if why is None and cand.cp > ns.max_cp:
            why = f"cp {cand.cp} > --max-cp {ns.max_cp}"
        if why is None and ns.max_replicate is not None and cand.dp_replicate > ns.max_replicate:
            why = f"dp_replicate {cand.dp_replicate} > --max-replicate {ns.max_replicate}"
        if why is None:
            valid.append(cand)
        else:
            dropped.append((cand, why))
    return valid, dropped


def _try(simulate: Callable[[JobConfig], LayoutCost], job: JobConfig) -> LayoutCost | str:
    """``simulate(job)``, or why the simulation could not run it (reported, not fatal)."""
    try:
        return simulate(job)
    except Exception as err:
        return f"simulation failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"


def _estimate(s: Search, valid: list[Candidate], dropped: list[tuple[Candidate, str]],
              estimate: Callable[[JobConfig], LayoutCost]) -> list[Plan]:
    """Every valid layout priced from its estimate (``dropped`` gets those that fail)."""
    plans = []
    for cand in valid:
        cost = _try(estimate, s.job(cand))
        if isinstance(cost, str):
            dropped.append((cand, cost))
        else:
            plans.append(s.price(s.job(cand), cost))
    return plans


def _simulate_fastest(s: Search, estimated: list[Plan], dropped: list[tuple[Candidate, str]],
                      simulate: Callable[[JobConfig], LayoutCost]) -> tuple[list[Plan], int]:
    """The ``--top`` fastest layouts whose full-depth simulation fits, priced from it, and how
    many layouts were simulated; layouts are simulated in the order of their estimates (those
    estimated not to fit are not)."""
    kept: list[Plan] = []
    simulations = 0
    for plan in rank_plans(estimated):
        if len(kept) == s.ns.top:
            break
        simulations += 1
        cost = _try(simulate, s.job(plan.candidate))
        if isinstance(cost, str):
            dropped.append((plan.candidate, cost))
            continue
        simulated = dataclasses.replace(s.price(s.job(plan.candidate), cost), simulated=True)
        if simulated.dropped:
            dropped.append((plan.candidate, f"{simulated.dropped} (simulated at full depth)"))
        else:
            kept.append(simulated)
    return rank_plans(kept), simulations


def _print_plans(s: Search, ranked: list[Plan]) -> None:
    for i, p in enumerate(ranked, 1):
        comm = ", ".join(f"{a} {t * 1e3:.0f} ms ({p.placement[a]})" for a, t in sorted(p.comm_s.items()))
        print(f"{i}. step {p.step_s:.2f} s (compute {p.compute_s:.2f} s; {comm or 'no communication'}); "
              f"peak {format_bytes(p.cost.peak_memory_bytes)}/GPU")
        print(f"   {command(s.job(p.candidate))}")


def _print_dropped(s: Search, dropped: list[tuple[Candidate, str]]) -> None:
    """Every dropped layout with ``--show-dropped``; else those dropped for memory or a failed simulation."""
    shown = dropped if s.ns.show_dropped else [d for d in dropped if "GiB" in d[1] or "simulation" in d[1]][:6]
    for cand, why in shown:
        print(f"   dropped {cand.flags()}: {why}")


def _advise(s: Search, estimated: list[Plan], estimate: Callable[[JobConfig], LayoutCost],
            simulate: Callable[[JobConfig], LayoutCost]) -> None:
    """No layout fits: try each change (``advice.changes``) on the layout with the least memory,
    print the first that fits at full depth as a command."""
    if not estimated:
        print(f"{PROG}: no layout could be simulated")
        return
    closest = min(estimated, key=lambda p: p.cost.peak_memory_bytes)
    job = s.job(closest.candidate)
    print(f"{PROG}: no layout fits in {format_bytes(s.hw.memory_bytes)} per GPU ({s.hw.name}); the closest, "
          f"{closest.candidate.flags()}, needs about {format_bytes(closest.cost.peak_memory_bytes)}")
    for change in changes(job):
        cost = _try(estimate, change.job)
        if isinstance(cost, str) or not fits(cost, s.hw):
            continue
        full = _try(simulate, change.job)
        if isinstance(full, str) or not fits(full, s.hw):
            continue
        print(f"{PROG}: it fits with {change.flags}: peak {format_bytes(full.peak_memory_bytes)}/GPU "
              f"(simulated at full depth), step {s.price(change.job, full).step_s:.2f} s")
        print(f"   {command(change.job)}")
        print(f"   every layout with that change: {command(change.job, PROG)}")
        return
    print(f"{PROG}: none of {', '.join(c.flags for c in changes(job)[:3]) or 'the changes tried'}, a smaller "
          f"batch, shorter sequences or up to 8x the GPUs makes it fit")


def main(argv: list[str] | None = None, estimate: Callable[[JobConfig], LayoutCost] | None = None,
         simulate: Callable[[JobConfig], LayoutCost] | None = None) -> int:
    """Print the ranked layouts; 0 if one fits, 1 if none does (with the change that makes the
    closest fit), 2 for bad flags. ``estimate`` and ``simulate`` default to
    ``simulated.estimated_cost`` and ``simulated.simulated_cost``."""
    from shardwise.plan.simulated import estimated_cost, simulated_cost
    from shardwise.train.config import ConfigError, params_label

    estimate, simulate = estimate or estimated_cost, simulate or simulated_cost
    ns = _parser().parse_args(argv)
    try:
        s = _search(ns)
    except (ConfigError, ValueError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"{PROG}: {s.config} ({params_label(s.family.num_params(s.args))} params) on {ns.nproc} x {s.hw.name} "
          f"({ns.gpus_per_node} per node), global batch {s.batch} x {ns.seq_len} tokens; "
          f"compute {s.flops:.3g} FLOP/step at {s.hw.peak_flops:.3g} FLOP/s x MFU 0.5 per GPU")
    started = time.perf_counter()
    valid, dropped = _valid(s)
    estimated = _estimate(s, valid, dropped, estimate)
    dropped += [(p.candidate, f"{p.dropped} (estimated)") for p in estimated if p.dropped]
    ranked, simulations = _simulate_fastest(s, estimated, dropped, simulate)
    print(f"{PROG}: {len(estimated)} valid layouts estimated, {simulations} simulated at full depth, in "
          f"{time.perf_counter() - started:.0f} s; {len(ranked)} ranked, {len(dropped)} dropped")
    print("overlap: data-parallel traffic (dp_shard, dp_replicate) hides under compute; tp/cp traffic does not"
          + ("; nor do ep's token all_to_alls (the experts' FSDP on dp_shard_mod_ep does hide)"
             if s.family.expert_parallel is not None else "")
          + ("; pp sends do not, and the 1F1B bubble adds (pp - 1)/pp of compute" if ns.max_pp > 1 else ""))
    _print_plans(s, ranked)
    _print_dropped(s, dropped)
    if not ranked:
        _advise(s, estimated, estimate, simulate)
    return 0 if ranked else 1


def _model_refuses(s: Search, cand: Candidate) -> str | None:
    """The family's reason the layout does not fit its shapes (heads not divisible by tp), or None."""
    from shardwise.parallel.dims import ParallelDims
    from shardwise.train.config import ConfigError

    if cand.ep > 1 and s.family.expert_parallel is None:
        return f"ep {cand.ep}: the family has no experts"
    try:
        dims = ParallelDims(**cand.degrees(), world_size=s.ns.nproc)
        s.family.check_degrees(s.args, dims, s.config)
    except (ConfigError, ValueError) as err:
        return str(err)
    return None


if __name__ == "__main__":
    sys.exit(main())
