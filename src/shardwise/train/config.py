"""Configuration of a training job: which model (a family and one of its configs) and the job itself.

``JobConfig`` is a frozen value holding everything the CLI sets (model family and config,
parallel degrees, batch, schedule, logging). The model's shapes are the family's own args
(``shardwise.train.spec``; the built-in families live in ``shardwise.train.models``). Its
``validate()`` checks the job against its model *without building anything*, so the launcher
process can refuse a bad job before any worker starts, and every worker checks again.

Validation errors are ``ConfigError`` (a ``ValueError``) with a message that names the flag and
prints the offending values; the CLI turns them into one line and exit status 2.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from shardwise.debug.explain import Detail
from shardwise.launch.launcher import under_launcher
from shardwise.launch.worker import restart_count
from shardwise.parallel.dims import ParallelDims
from shardwise.train.checkpointing import ResumePoint, latest_readable_checkpoint
from shardwise.train.data import corpus_files
from shardwise.train.errors import ConfigError
from shardwise.train.run_lock import RunLockError, check_not_in_use
from shardwise.train.spec import Args, ModelFamily, get_family

__all__ = ["ConfigError", "DEFAULT_FAMILY", "params_label", "describe_config", "get_model_args", "JobConfig",
           "is_lead_process"]

DEFAULT_FAMILY = "llama"  # --family's default: every command without it trains this family


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "inductor+comm", "aot_eager+comm")  # +comm: comm_schedule


def params_label(count: int) -> str:
    """A parameter count as the trainer prints it: ``3.28M``, ``8.03B``."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def describe_config(family: ModelFamily, name: str) -> str:
    """``debug (3.28M params: learns on a CPU, ...)``: the size computed from the shapes."""
    note = family.notes.get(name)
    return f"{name} ({params_label(family.num_params(family.configs[name]))} params{': ' + note if note else ''})"


def get_model_args(name: str, family: str = DEFAULT_FAMILY) -> Args:
    """The named config's args of ``family``, or a ``ConfigError`` naming the unknown one."""
    return get_family(family).config(name)


@dataclass(frozen=True, slots=True)
class JobConfig:
    """One training job, as the command line describes it.

    Args:
        family: the model family (``shardwise.train.spec``; default the built-in Llama).
        config: name of one of the family's configs (its model shapes).
        shapes: the family's args themselves, used instead of the named config's (``shardwise.plan``
            simulates a config with fewer blocks); None: the named config's.
        nproc: processes (ranks) in the job.
        dp_replicate / dp_shard / cp / tp: parallel degrees (dp_shard=-1 takes what is left); cp
            shards each sequence over the cp ranks (ring attention, load-balanced layout).
        pp: pipeline-parallel degree: the blocks are split into stages (``pipeline_split.py``).
        ep: expert-parallel degree: the routed experts are split over ep of the dp_shard x cp ranks,
            tokens sent to their experts by all_to_all (docs/parallelism.md, "Mixture of experts and expert parallelism").
        pp_schedule: the pipeline schedule: gpipe, 1f1b or interleaved_1f1b (two stages per rank).
        pp_microbatches: microbatches per step through the pipeline (None: ``pp``).
        sequence_parallel: shard norms and residuals along the sequence over the tp axis.
        loss_parallel: compute the loss on vocabulary-sharded logits (no logits all-gather).
        steps: optimizer steps of the run (the learning-rate schedule spans them).
        global_batch: sequences per step over all data-parallel ranks.
        seq_len: tokens per sequence.
        lr / warmup: peak learning rate and its linear warmup in steps.
        max_norm: clip the gradients' total 2-norm to this before each step (0: no clipping).
        seed: seeds the weights and the data order (same for every layout).
        activation_checkpointing: recompute each block's activations in backward.
        mixed_precision: bf16 parameters and activations, fp32 gradient reduction.
        compile: ``torch.compile`` each transformer block after parallelizing it (the block's
            ops and collectives become one graph; data-parallel hooks run between graphs).
        compile_backend: the ``torch.compile`` backend for ``compile`` (inductor, aot_eager, eager;
            "inductor+comm" / "aot_eager+comm" also bucket and overlap the collectives of each
            compiled block, see ``shardwise.compile.schedule``).
        device: "cpu", "cuda", or "auto" (cuda when available).
        log_every: steps between progress lines.
        plot: write the loss curve to this PNG file.
        metrics_file: write per-step losses and the summary to this JSON file.
        explain: print ``shardwise.debug.explain``'s account of the first step (rank 0) and continue:
            ``Detail.SUMMARY`` a line per module per phase, ``Detail.FULL`` every op (docs/explain.md).
        checkpoint_dir: save checkpoints to ``<checkpoint_dir>/step-<N>`` (see ``checkpointing.py``):
            every ``checkpoint_every`` steps (None: only at the end of the run) and at its end.
        resume: continue from the latest checkpoint in ``checkpoint_dir`` (any layout).
        checkpoint_async: save in the background (``shardwise.checkpoint.async_save``).
        checkpoint_keep: keep the newest K committed checkpoints (None: all).
        max_restarts: restart every worker after a failure up to this many times (shardwise's
            launcher); the run then resumes from the latest checkpoint by itself, as it does on
            its first start if ``checkpoint_dir`` holds one (``resumes_by_itself``).
        stop_after: end this run after this step (None: after ``steps``); the schedule still
            spans ``steps``, so a resumed run continues the same schedule.
        collective_timeout: seconds after which a collective that has not completed fails,
            naming the ranks that did not arrive (the backend's own default waits 30 minutes).
    """

    config: str = "debug"
    family: str = DEFAULT_FAMILY
    shapes: Any = None
    nproc: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    steps: int = 20
    global_batch: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    warmup: int = 2
    max_norm: float = 1.0
    seed: int = 0
    activation_checkpointing: bool = False
    mixed_precision: bool = False
    compile: bool = False
    compile_backend: str = "inductor"
    device: str = "auto"
    log_every: int = 1
    plot: str | None = None
    metrics_file: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    checkpoint_async: bool = False
    checkpoint_keep: int | None = None
    max_restarts: int = 0
    stop_after: int | None = None
    collective_timeout: float = 120.0
    explain: Detail | None = None
    simulate: bool = False  # --simulate: no workers, one process simulates every rank (shardwise.simulate)
    simulate_expert_imbalance: float = 1.0  # --simulate: the busiest expert's rows over the mean (1: balanced)

    # ------------------------------------------------------------------ derived values
    def model_family(self) -> ModelFamily:
        """The registered family of ``family`` (``ConfigError`` naming it if unknown)."""
        return get_family(self.family)

    def model_args(self) -> Args:
        """The model's shapes (``shapes``, or the named config's) fitted to this job's sequences."""
        family = self.model_family()
        args = self.shapes if self.shapes is not None else family.config(self.config)
        return family.for_seq_len(args, self.seq_len)

    def parallel_dims(self) -> ParallelDims:
        """The degrees as a validated ``ParallelDims`` (dp_shard=-1 resolved)."""
        self._check_degrees()
        try:
            dims = ParallelDims(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp,
                                pp=self.pp, world_size=self.nproc)
        except ValueError as err:
            raise ConfigError(f"parallel degrees do not fit --nproc {self.nproc}: {err}") from None
        if self.ep == 1:
            return dims
        self._check_expert_degree(dims)
        return ParallelDims(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp,
                            pp=dims.pp, ep=self.ep, world_size=self.nproc)

    def _check_expert_degree(self, dims: ParallelDims) -> None:
        """``--ep`` borrows ranks from dp_shard x cp: it must divide them, and take whole cp groups."""
        if self.ep < 1:
            raise ConfigError(f"--ep must be at least 1, got {self.ep}")
        borrowed = dims.dp_shard * dims.cp
        if borrowed % self.ep or (dims.cp > 1 and self.ep % dims.cp):
            over = f"dp_shard x cp = {dims.dp_shard} x {dims.cp} = {borrowed}" if dims.cp > 1 else f"dp_shard = {borrowed}"
            cp = f" and be a multiple of --cp {dims.cp} (each ep group takes whole cp groups)" if dims.cp > 1 else ""
            raise ConfigError(f"--ep {self.ep} must divide the FSDP degree {over}{cp}: expert parallelism borrows "
                              f"its ranks from them (experts split over ep of them, sharded by FSDP over the rest)")

    def _check_degrees(self) -> None:
        """The product of the degrees is the world size, said in the CLI's flags.

        ``ParallelDims`` also knows ep, which the trainer has no flag for yet.
        """
        world = f"the number of processes {self.nproc} (--nproc, or the launcher's world size)"
        cp = f" x --cp {self.cp}" if self.cp != 1 else ""
        pp = f" x --pp {self.pp}" if self.pp != 1 else ""
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.nproc % others:
                raise ConfigError(f"cannot infer --dp-shard: {world} is not divisible by --dp-replicate "
                                  f"{self.dp_replicate}{cp} x --tp {self.tp}{pp} = {others}")
            return
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.nproc:
            raise ConfigError(f"--dp-replicate {self.dp_replicate} x --dp-shard {self.dp_shard}{cp} x --tp {self.tp}{pp} "
                              f"= {product} must equal {world}; --dp-shard -1 (the default) infers it")

    def describe_layout(self) -> str:
        """The resolved layout in words, e.g. ``HSDP dp_replicate=2 x dp_shard=2 (dp_shard inferred ...)``."""
        text = self.parallel_dims().describe()
        extras = [f for f, on in (("+SP", self.sequence_parallel), ("+loss parallel", self.loss_parallel)) if on]
        text += "".join(" " + e for e in extras)
        if self.pp > 1:
            text += f" ({self.pp_schedule}, {self.microbatches} microbatches)"
        inferred = self.nproc // (self.dp_replicate * self.cp * self.tp * self.pp)
        if self.dp_shard == -1 and inferred > 1:
            cp = f" x --cp {self.cp}" if self.cp != 1 else ""
            pp = f" x --pp {self.pp}" if self.pp != 1 else ""
            text += (f" (dp_shard inferred: --nproc {self.nproc} / (--dp-replicate {self.dp_replicate}{cp} x "
                     f"--tp {self.tp}{pp}))")
        return text

    @property
    def microbatches(self) -> int:
        """Microbatches per step through the pipeline: ``--pp-microbatches``, or ``--pp``."""
        return self.pp_microbatches if self.pp_microbatches is not None else self.pp

    @property
    def resumes_by_itself(self) -> bool:
        """A run that may be restarted (``--max-restarts``, or torchrun's) resumes from the latest
        checkpoint of ``checkpoint_dir`` without ``--resume``, and starts at step 0 without one."""
        return self.max_restarts > 0 or restart_count()[1] > 0

    @property
    def last_step(self) -> int:
        """The step this run ends after: ``stop_after`` if given, else ``steps``."""
        return self.steps if self.stop_after is None else min(self.stop_after, self.steps)

    def layout(self) -> str:
        """A short name of the layout, e.g. ``dp_shard=2 tp=2 +sp +loss_parallel``."""
        dims = self.parallel_dims()
        parts = [f"{n}={getattr(dims, n)}" for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
                 if getattr(dims, n) > 1]
        if dims.pp > 1:
            parts.append(f"+{self.pp_schedule}")
        flags = [f for f, on in (("+sp", self.sequence_parallel), ("+loss_parallel", self.loss_parallel),
                                 ("+ac", self.activation_checkpointing), ("+bf16", self.mixed_precision),
                                 ("+compile", self.compile)) if on]
        return " ".join(parts or ["single"]) + "".join(" " + f for f in flags)

    def as_dict(self) -> dict:
        """The job as JSON-ready values (``--explain``'s ``Detail`` as its word)."""
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in asdict(self).items()}

    # ------------------------------------------------------------------ validation
    def validate(self) -> "JobConfig":
        """Check the job without building anything; raise ``ConfigError`` naming the problem."""
        self._check_numbers()
        model = self.model_args()
        dims = self.parallel_dims()
        self._check_batch(dims)
        self.model_family().check_degrees(model, dims, self.config)
        if dims.ep > 1 and self.model_family().expert_parallel is None:
            raise ConfigError(f"--ep {dims.ep}: model family {self.family!r} has no experts (use --family moe)")
        if not self.simulate_expert_imbalance >= 1.0:
            raise ConfigError(f"--simulate-expert-imbalance is the busiest expert's rows over the mean, at least 1; "
                              f"got {self.simulate_expert_imbalance}")
        if self.simulate_expert_imbalance != 1.0 and not (self.simulate and dims.ep > 1):
            raise ConfigError(f"--simulate-expert-imbalance {self.simulate_expert_imbalance} sets the routing a "
                              f"simulated expert-parallel step assumes: use it with --simulate and --ep")
        self._check_layout(dims)
        self._check_pipeline(model, dims)
        self._check_checkpointing()
        self._check_outputs()
        self._check_corpus()
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        self._check_compile()
        return self

    def _check_compile(self) -> None:
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ConfigError(f"--compile-backend must be one of {', '.join(COMPILE_BACKENDS)}, got {self.compile_backend!r}")
        if self.compile and self.cp > 1:
            raise ConfigError("--compile with --cp is not supported yet: ring attention's point-to-point exchange "
                              "is not traceable; drop --compile or --cp")

    def _check_numbers(self) -> None:
        at_least_one = {"--nproc": self.nproc, "--steps": self.steps, "--global-batch": self.global_batch,
                        "--log-every": self.log_every, "--tp": self.tp, "--cp": self.cp, "--pp": self.pp,
                        "--dp-replicate": self.dp_replicate, "--ep": self.ep}
        bad = [f"{k} {v}" for k, v in at_least_one.items() if v < 1]
        if bad:
            raise ConfigError(f"must be at least 1: {', '.join(bad)}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ConfigError(f"--dp-shard must be -1 (infer) or at least 1, got {self.dp_shard}")
        if self.seq_len < 2:
            raise ConfigError(f"--seq-len must be at least 2, got {self.seq_len}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.max_norm >= 0:
            raise ConfigError(f"--max-norm must be >= 0 (0 turns clipping off), got {self.max_norm}")
        if not 0 < self.collective_timeout < math.inf:
            raise ConfigError(f"--collective-timeout must be a positive number of seconds, got {self.collective_timeout}")

    def _check_batch(self, dims: ParallelDims) -> None:
        dp = dims.dp_degree
        if self.global_batch % dp:
            raise ConfigError(
                f"--global-batch {self.global_batch} is not divisible by the data-parallel degree "
                f"dp_replicate*dp_shard = {dims.dp_replicate}*{dims.dp_shard} = {dp}"
            )

    def _check_layout(self, dims: ParallelDims) -> None:
        """The flags that shard over the tp and cp axes fit the degrees (the model's own shapes
        are its family's to check: ``ModelFamily.check_degrees``)."""
        tp = dims.tp
        if (self.sequence_parallel or self.loss_parallel) and tp == 1:
            used = [f for f, on in (("--sequence-parallel", self.sequence_parallel),
                                    ("--loss-parallel", self.loss_parallel)) if on]
            verb = "shard" if len(used) > 1 else "shards"
            raise ConfigError(f"{' and '.join(used)} {verb} over the tensor-parallel axis: "
                              f"use --tp > 1 (got --tp 1)")
        if tp > 1 and dims.dp_replicate > 1 and dims.dp_shard * dims.cp == 1:
            raise ConfigError(
                f"--dp-replicate {dims.dp_replicate} with --tp {tp} needs --dp-shard > 1 (HSDP): replicated data "
                f"parallelism (DDP) takes plain parameters, not tensor-parallel ones"
            )
        if self.sequence_parallel and self.seq_len % tp:
            raise ConfigError(f"--seq-len {self.seq_len} is not divisible by --tp {tp} (needed by --sequence-parallel)")
        if dims.cp > 1 and self.seq_len % (2 * dims.cp):
            raise ConfigError(f"--seq-len {self.seq_len} is not divisible by 2 x --cp {dims.cp} = {2 * dims.cp}: context "
                              f"parallelism deals each sequence to the cp ranks in 2 x cp equal chunks (load-balanced "
                              f"causal attention)")
        if dims.cp > 1 and self.sequence_parallel and (self.seq_len // dims.cp) % tp:
            raise ConfigError(f"--seq-len {self.seq_len} / --cp {dims.cp} is not divisible by --tp {tp} (needed by "
                              f"--sequence-parallel on each cp rank's part of the sequence)")

    def _check_pipeline(self, model: Args, dims: ParallelDims) -> None:
        """Pipeline flags: stages of equally many layers, microbatches that split each rank's batch."""
        from shardwise.parallel.pipeline_parallel.split import SCHEDULES, pipeline_problems

        if dims.pp == 1:
            used = [f for f, on in (("--pp-schedule", self.pp_schedule != "1f1b"),
                                    ("--pp-microbatches", self.pp_microbatches is not None)) if on]
            if used:
                raise ConfigError(f"{' and '.join(used)} {'apply' if len(used) > 1 else 'applies'} to pipeline "
                                  f"parallelism: use --pp > 1 (got --pp 1)")
            return
        if self.pp_schedule not in SCHEDULES:
            raise ConfigError(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {self.pp_schedule!r}")
        problems = pipeline_problems(self.model_family().num_layers(model), dims.pp, self.pp_schedule, self.microbatches,
                                     self.global_batch // dims.dp_degree)
        if problems:
            raise ConfigError(problems[0].replace("the model's", f"config {self.config!r}'s", 1))
        if self.pp_schedule == "interleaved_1f1b" and self.sequence_parallel:
            raise ConfigError("--pp-schedule interleaved_1f1b with --sequence-parallel is not supported: torch's "
                              "multi-stage schedules first run each stage on placeholder inputs, identical on the tp "
                              "ranks, which sequence parallelism refuses as sequence shards; use --pp-schedule 1f1b "
                              "or gpipe")

    def _check_checkpointing(self) -> None:
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be > 0, got {self.checkpoint_every}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ConfigError(f"--stop-after must be between 1 and --steps {self.steps}, got {self.stop_after}")
        if self.checkpoint_keep is not None and self.checkpoint_keep < 1:
            raise ConfigError(f"--checkpoint-keep must be > 0, got {self.checkpoint_keep}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        used = [f for f, on in (("--checkpoint-every", self.checkpoint_every is not None),
                                ("--resume", self.resume), ("--checkpoint-async", self.checkpoint_async),
                                ("--checkpoint-keep", self.checkpoint_keep is not None),
                                ("--max-restarts", self.max_restarts > 0)) if on]
        if used and not self.checkpoint_dir:
            raise ConfigError(f"{' and '.join(used)} {'need' if len(used) > 1 else 'needs'} --checkpoint-dir")
        if not self.checkpoint_dir:
            return
        if os.path.exists(self.checkpoint_dir) and not os.path.isdir(self.checkpoint_dir):
            raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir!r} exists and is not a directory")
        self._check_not_in_use()
        point = self._latest_checkpoint()
        if self.resume or (self.resumes_by_itself and point is not None):
            self._check_resume(point)
        elif point is not None:
            raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir!r} already holds checkpoints (latest "
                              f"{point.path}): pass --resume to continue that run, or use another directory")

    def _check_not_in_use(self) -> None:
        """No other live run holds the directory (checked before reading checkpoints it may be writing).

        Rank 0 (or the launching process) speaks for the job: it holds the lock, or its parent
        does. Another rank could read the record while rank 0 is still writing it.
        """
        if not is_lead_process():
            return
        try:
            check_not_in_use(self.checkpoint_dir)
        except RunLockError as err:
            raise ConfigError(str(err)) from None

    def _latest_checkpoint(self) -> ResumePoint | None:
        """The newest checkpoint whose metadata reads (``--resume`` skips damaged newer ones)."""
        point, problems = latest_readable_checkpoint(self.checkpoint_dir)
        if point is None and problems:
            raise ConfigError(f"--checkpoint-dir {self.checkpoint_dir!r}: {'; '.join(problems)}")
        return point

    def _check_resume(self, point: ResumePoint | None) -> None:
        """A checkpoint to resume from, saved by a run of the same model and data order."""
        where = f"--resume: --checkpoint-dir {self.checkpoint_dir!r}"
        if not os.path.isdir(self.checkpoint_dir):
            raise ConfigError(f"{where} does not exist")
        if point is None:
            raise ConfigError(f"{where} holds no checkpoint (no step-<N> directory with metadata.json)")
        if point.train.get("config") != self.config:
            raise ConfigError(f"--config {self.config!r} differs from the config {point.train.get('config')!r} "
                              f"of checkpoint {point.path}")
        if point.train.get("seed") != self.seed:
            raise ConfigError(f"--seed {self.seed} differs from the seed {point.train.get('seed')!r} of checkpoint "
                              f"{point.path}: batches follow the seed, so the data would not continue; "
                              f"pass --seed {point.train.get('seed')}")

    def _check_outputs(self) -> None:
        """Files written at the end of the run can be written: refused now, not after training.

        Only where they are written: rank 0 (or the process without a launcher); another host
        of a torchrun job need not have the directory.
        """
        if not is_lead_process():
            return
        outputs = {flag: path for flag, path in (("--plot", self.plot), ("--metrics-file", self.metrics_file)) if path}
        for flag, path in outputs.items():
            _check_output_file(flag, path)
        if len(outputs) == 2 and os.path.abspath(self.plot) == os.path.abspath(self.metrics_file):
            raise ConfigError(f"--plot and --metrics-file name the same file {self.plot!r}")

    def _check_corpus(self) -> None:
        size = sum(os.path.getsize(p) for p in corpus_files())
        if size < self.seq_len + 1:
            raise ConfigError(f"--seq-len {self.seq_len} is longer than the training corpus ({size} bytes)")


def is_lead_process() -> bool:
    """Rank 0 of a launched job, or a process without a launcher (a stray RANK in the shell aside):
    the one that prints a bad job, writes the output files and holds the checkpoint dir's lock."""
    return not under_launcher() or os.environ.get("RANK") == "0"


def _check_output_file(flag: str, path: str) -> None:
    """``path`` can be created or overwritten: its directory exists and is writable (nothing is created)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a directory; give a file name")
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ConfigError(f"{flag} {path!r}: its directory {parent!r} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r}: its directory {parent!r} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path!r} exists and is not writable")
