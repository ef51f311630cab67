"""The command line: ``python -m shardwise.train`` / ``shardwise-train``.

    python -m shardwise.train --config debug --steps 50                  # one process
    python -m shardwise.train --nproc 4 --tp 2 --dp-shard 2 --plot loss.png
    python -m shardwise.train --nproc 8 --pp 2 --dp-shard 2 --tp 2 --pp-schedule 1f1b --pp-microbatches 4
    torchrun --nproc-per-node 8 -m shardwise.train --config llama3_8b --tp 8 --mixed-precision
    python -m shardwise.train --nproc 4 --dp-shard 4 --steps 200 --stop-after 100 --checkpoint-dir ckpt
    python -m shardwise.train --nproc 4 --tp 2 --dp-shard 2 --steps 200 --checkpoint-dir ckpt --resume
    python -m shardwise.train --nproc 4 --steps 200 --checkpoint-dir ckpt --checkpoint-every 10 --max-restarts 3

Without a launcher the command starts ``--nproc`` local processes itself (gloo on CPU; nccl
when --device resolves to cuda); under torchrun it joins the launcher's job, whose size the
launcher sets (``--nproc`` is then accepted only if it equals that world size: it is this
command's own process count, not torchrun's ``--nproc-per-node``; torchrun itself rejects
``--nproc`` anywhere on its command line as an ambiguous abbreviation of that flag). The job is validated in the
launching process before any worker starts, and again in every worker: a bad job prints one
``error:`` line and exits with status 2, without a traceback. Checked there too: the output
files' directories exist and are writable, the checkpoint flags (``--resume`` needs a committed
checkpoint of the same config and seed), and that no other live run uses ``--checkpoint-dir``.
The run then holds that directory's lock (``run_lock.py``) until it ends. A checkpoint that
fails to load is refused the same way, by every worker. With ``--max-restarts N`` the launcher
restarts every worker after a failure, and each start resumes from the latest checkpoint by
itself (docs/failures.md, "Restarts").
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from typing import NoReturn

from shardwise.debug.explain import Detail
from shardwise.launch.launcher import main_or_launch, under_launcher
from shardwise.launch.worker import LAUNCHER_PID_ENV, restart_count
from shardwise.train.config import COMPILE_BACKENDS, ConfigError, JobConfig, describe_config, is_lead_process
from shardwise.train.spec import family_names, get_family
from shardwise.train.run_lock import RunLockError, hold_for_run

__all__ = ["build_parser", "job_from_argv", "main", "EXIT_BAD_JOB"]

EXIT_BAD_JOB = 2
PROG = "shardwise.train"


class _Parser(argparse.ArgumentParser):
    """An unknown flag is one error line naming the closest known flag (``--dp_shard``: did you
    mean ``--dp-shard``?) instead of the whole usage; ``--help`` still prints it."""

    def error(self, message: str) -> NoReturn:
        hint = _did_you_mean(message, [o for a in self._actions for o in a.option_strings])
        self.exit(2, f"{self.prog}: error: {message}{hint} (see --help)\n")


def _did_you_mean(message: str, flags: list[str]) -> str:
    """`` (did you mean --x?)`` for the unrecognized flags in argparse's ``message``, or ''."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    guesses = {}
    for word in message.split(":", 1)[1].split():
        typed = word.split("=", 1)[0]
        close = difflib.get_close_matches(typed.replace("_", "-"), flags, n=1, cutoff=0.75) if typed.startswith("--") else []
        if close:
            guesses[typed] = close[0]
    if len(guesses) == 1:
        return f" (did you mean {next(iter(guesses.values()))}?)"
    return f" (did you mean: {', '.join(f'{close} for {typed}' for typed, close in guesses.items())}?)" if guesses else ""


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to options with a meaningful default (not None, not an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = any(action.default is v for v in (None, False, argparse.SUPPRESS)) or not action.option_strings
        if quiet or "%(default)" in text or "default:" in text:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def _detail(word: str) -> Detail:
    """``--explain``'s optional value: the word of a ``Detail`` ("full"; "summary" is the default)."""
    try:
        return Detail(word)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes no value (a line per module) or 'full' (every op), not {word!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = JobConfig()
    p = _Parser(prog=PROG, formatter_class=_HelpFormatter,
                                description="Train a model of any registered family (default: a Llama-style decoder) on the "
                                "Python standard library's source with "
                                "any mix of FSDP/HSDP, DDP, TP, SP, loss parallelism, context parallelism (--cp), pipeline "
                                "parallelism (--pp) and expert parallelism (--ep, --family moe).")
    p.add_argument("--family", default=d.family, metavar="NAME",
                   help="model family (shardwise.train.spec): " + ", ".join(family_names()))
    p.add_argument("--config", default=None, metavar="NAME",
                   help="model shapes (default: the family's default, debug for llama), by family: " + _configs_help())
    p.add_argument("--nproc", type=int, default=None,
                   help="local processes this command starts (default: 1). Under a launcher the launcher sets the "
                        "world size, so leave --nproc out (it is accepted only if equal to it); torchrun rejects it "
                        "anyway, as an ambiguous abbreviation of its own --nproc-per-node")
    p.add_argument("--dp-replicate", type=int, default=d.dp_replicate, help="data-parallel replicas (DDP/HSDP)")
    p.add_argument("--dp-shard", type=int, default=d.dp_shard,
                   help="FSDP shards; -1 infers nproc / (dp-replicate x cp x tp), so --dp-replicate 2 with --nproc 4 is "
                        "HSDP 2 x 2 (the layout is printed at start); pass --dp-shard 1 for plain DDP")
    p.add_argument("--cp", type=int, default=d.cp,
                   help="context-parallel degree: each sequence is split over cp ranks (ring attention; --seq-len "
                        "divisible by 2 x cp); FSDP shards over dp-shard x cp")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=d.pp,
                   help="pipeline-parallel degree: the blocks are split into --pp stages of equally many layers (2 x "
                        "--pp with interleaved_1f1b), each parallelized on its own ranks")
    p.add_argument("--ep", type=int, default=d.ep,
                   help="expert-parallel degree (--family moe): the routed experts are split over ep of the "
                        "dp-shard x cp ranks, tokens sent to their experts by all_to_all; must divide dp-shard x cp")
    p.add_argument("--pp-schedule", default=d.pp_schedule, choices=("gpipe", "1f1b", "interleaved_1f1b"),
                   help="pipeline schedule (torch.distributed.pipelining's)")
    p.add_argument("--pp-microbatches", type=int, metavar="M", default=d.pp_microbatches,
                   help="microbatches per step through the pipeline; must divide each data-parallel rank's batch "
                        "(default: --pp)")
    p.add_argument("--sequence-parallel", action="store_true", help="shard norms/residuals along the sequence (tp)")
    p.add_argument("--loss-parallel", action="store_true", help="loss on vocabulary-sharded logits (tp)")
    p.add_argument("--steps", type=int, default=d.steps, help="steps of the run; the learning-rate schedule spans them")
    p.add_argument("--stop-after", type=int, metavar="N", default=None,
                   help="end this run after step N (a checkpoint is saved there with --checkpoint-dir); the "
                        "schedule still spans --steps, so --resume later continues the same run exactly")
    p.add_argument("--global-batch", type=int, default=d.global_batch, help="sequences per step, all dp ranks")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    p.add_argument("--max-norm", type=float, default=d.max_norm,
                   help="clip the gradients' total norm to this before each step (0: off)")
    p.add_argument("--seed", type=int, default=d.seed, help="weights and data order")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute block activations")
    p.add_argument("--mixed-precision", action="store_true", help="bf16 params/activations, fp32 gradient reduce")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block after parallelizing (communication in the graph)")
    p.add_argument("--compile-backend", default=d.compile_backend, choices=COMPILE_BACKENDS,
                   help="backend for --compile")
    p.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when a GPU is visible, else cpu")
    p.add_argument("--collective-timeout", type=float, metavar="SECONDS", default=d.collective_timeout,
                   help="fail a collective that has not completed after this many seconds, naming the ranks "
                        "that did not arrive")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="write the loss curve to this PNG (its directory must exist; checked before training)")
    p.add_argument("--metrics-file", metavar="FILE", default=None,
                   help="write per-step losses etc. as JSON (its directory must exist; checked before training)")
    p.add_argument("--explain", nargs="?", const=Detail.SUMMARY, default=None, type=_detail, metavar="full",
                   help="print what the first step does on rank 0, then continue: a line per module per phase "
                        "(forward, backward, optimizer) with its collectives, bytes and the layouts at its edges; "
                        "'--explain full': every DTensor op's layouts, the strategy chosen and its alternatives, "
                        "each collective")
    p.add_argument("--simulate", action="store_true",
                   help="start no workers: simulate one step of every rank (--nproc of them) in this process on "
                        "meta tensors and print each rank's parameter, gradient, optimizer and peak memory and its "
                        "bytes sent per mesh axis (with --metrics-file: as JSON, per_rank)")
    p.add_argument("--simulate-expert-imbalance", type=float, default=d.simulate_expert_imbalance, metavar="F",
                   help="with --simulate and --ep: routing is not known on meta tensors; every rank routes alike "
                        "and the busiest expert (expert 0) gets F times the mean rows, the others the rest evenly "
                        "(1: balanced)")
    ckpt = p.add_argument_group("checkpoints", "A checkpoint holds the model, the optimizer (AdamW moments and step "
                                "counts), the learning-rate schedule, the step, the data position and the seed; it "
                                "loads into any parallel layout and world size.")
    ckpt.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                      help="save checkpoints to DIR/step-<N> (atomically): every --checkpoint-every steps and at "
                           "the end of the run (after --steps, or --stop-after). The run locks DIR (DIR/.lock) until "
                           "it ends: a second run on DIR is refused")
    ckpt.add_argument("--checkpoint-every", type=int, metavar="K", default=d.checkpoint_every,
                      help="also save every K steps (K > 0; default: only at the end of the run)")
    ckpt.add_argument("--resume", action="store_true",
                      help="continue from the latest committed checkpoint in --checkpoint-dir (highest step-<N> "
                           "holding metadata.json, or torch.distributed.checkpoint's .metadata) in this run's parallel layout and world size; needs the saving "
                           "run's --config and --seed; a damaged newer checkpoint is skipped with a warning")
    ckpt.add_argument("--checkpoint-async", action="store_true",
                      help="save in the background: a step waits only while this rank's blocks are copied to host "
                           "memory; the next save and the end of the run wait for the write and commit")
    ckpt.add_argument("--checkpoint-keep", type=int, metavar="K", default=d.checkpoint_keep,
                      help="keep the newest K committed checkpoints, removing older ones (default: keep all)")
    ckpt.add_argument("--max-restarts", type=int, metavar="N", default=d.max_restarts,
                      help="when a rank fails or is killed, stop every rank and start them all again, up to N times; "
                           "each start resumes from the latest committed checkpoint in --checkpoint-dir (needed) "
                           "without --resume, or starts at step 0 if it holds none. Under torchrun, give "
                           "--max-restarts to torchrun instead: its restarts resume the same way")
    return p


def _configs_help() -> str:
    """Each registered family with its configs, each config with its size and what it is for."""
    families = [get_family(name) for name in family_names()]
    return "; ".join(f"{f.name}: " + "; ".join(describe_config(f, c) for c in f.configs) for f in families)


def _world_size_from_env() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if under_launcher() and "WORLD_SIZE" in os.environ else None


def job_from_argv(argv: list[str]) -> JobConfig:
    """Parse and validate; raise ``ConfigError`` for a bad job (argparse exits on bad syntax)."""
    ns = build_parser().parse_args(argv)
    world = _world_size_from_env()
    if world is not None and ns.nproc is not None and ns.nproc != world:
        raise ConfigError(
            f"--nproc {ns.nproc} differs from the launcher's world size {world}: under a launcher the launcher sets "
            f"the number of processes (torchrun: --nproc-per-node, before the program), and --nproc, which counts "
            f"the processes shardwise.train starts itself without one, is best left out"
        )
    _check_restarts_here(ns.max_restarts)
    nproc = ns.nproc if ns.nproc is not None else (world or 1)
    fields = {k: v for k, v in vars(ns).items() if k != "nproc"}
    if fields["config"] is None:
        fields["config"] = get_family(ns.family).default
    job = JobConfig(nproc=nproc, **fields).validate()
    _check_devices(job)
    return job


def _check_restarts_here(max_restarts: int) -> None:
    """Under torchrun, torchrun restarts the workers: the trainer's own ``--max-restarts`` (which
    asks shardwise's launcher) is accepted only if it says the same as torchrun's."""
    if not under_launcher() or os.environ.get(LAUNCHER_PID_ENV) or max_restarts == 0:
        return
    theirs = restart_count()[1]
    if max_restarts != theirs:
        raise ConfigError(f"--max-restarts {max_restarts} differs from the launcher's --max-restarts {theirs}: under "
                          f"torchrun, torchrun restarts the workers (its --max-restarts, before the program), and "
                          f"each restart resumes from the latest checkpoint by itself")


def _check_devices(job: JobConfig) -> None:
    """A CUDA job started here needs a GPU per local process."""
    if job.device == "cpu":
        return
    import torch

    if job.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible")
    if torch.cuda.is_available() and not under_launcher() and job.nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {job.nproc} exceeds the {torch.cuda.device_count()} visible CUDA devices "
                          f"(use --device cpu, or torchrun across hosts)")


def _fail(message: str) -> int:
    """Print a bad job once (rank 0 under a launcher) and return its exit status."""
    if is_lead_process():
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_JOB


def _run_lock(job: JobConfig) -> contextlib.AbstractContextManager:
    """The checkpoint directory's lock for the run: taken by the launching process or rank 0.

    Under shardwise's own launcher, rank 0 finds its parent holding it and takes nothing.
    """
    if not job.checkpoint_dir or not is_lead_process():
        return contextlib.nullcontext()
    return hold_for_run(job.checkpoint_dir)


def worker() -> int:
    """The per-rank entry point (under a launcher, or the only process)."""
    try:
        job = job_from_argv(sys.argv[1:])
        if job.simulate:
            raise ConfigError("--simulate starts no workers and plays every rank in one process: run it without a "
                              "launcher (python -m shardwise.train ... --simulate --nproc N)")
        with _run_lock(job):
            return _run(job)
    except (ConfigError, RunLockError) as err:
        return _fail(str(err))


def _run(job: JobConfig) -> int:
    """Train on this rank; a checkpoint this job cannot resume from is a bad job too."""
    from shardwise.train.trainer import run_job

    if is_lead_process():
        print(f"{PROG}: layout: {job.describe_layout()}", flush=True)
    try:
        return run_job(job)
    except ConfigError as err:
        return _fail(str(err))


def _simulate(job: JobConfig) -> int:
    """``--simulate``: every distinct rank's step simulated here; print, and write the metrics file."""
    import json

    from shardwise.simulate import simulate_job
    from shardwise.simulate.report import report_lines

    print(f"{PROG}: layout: {job.describe_layout()}", flush=True)
    report = simulate_job(job)
    simulated = [c[0] for c in report.classes]
    print(f"{PROG}: simulated one step of {job.nproc} ranks ({job.config}, global batch {job.global_batch} x "
          f"{job.seq_len}) in {report.seconds:.1f} s; ranks simulated: {simulated[:8]}"
          f"{' ...' if len(simulated) > 8 else ''} (the others hold blocks of the same shapes)", flush=True)
    print("\n".join(report_lines(report.per_rank)), flush=True)
    if job.metrics_file:
        with open(job.metrics_file, "w") as f:
            json.dump({"job": job.as_dict(), "layout": job.layout(), **report.as_dict()}, f, indent=1)
        print(f"  metrics: {job.metrics_file}", flush=True)
    return 0


def main() -> None:
    """Validate here, then train in this process (one CPU/GPU rank) or launch the workers.

    The launching process holds the checkpoint directory's lock while its workers run.
    """
    if under_launcher():
        main_or_launch(worker, 1, quiet_codes=(EXIT_BAD_JOB,), module=PROG)
        return
    try:
        job = job_from_argv(sys.argv[1:])
        if job.simulate:
            sys.exit(_simulate(job))
        with _run_lock(job):
            if job.nproc == 1 and job.max_restarts == 0:
                sys.exit(_run(job))
            main_or_launch(worker, job.nproc, quiet_codes=(EXIT_BAD_JOB,), module=PROG, max_restarts=job.max_restarts)
    except (ConfigError, RunLockError) as err:
        sys.exit(_fail(str(err)))
