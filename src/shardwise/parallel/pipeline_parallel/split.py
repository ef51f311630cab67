"""How a pipeline splits a layered model: which stages a rank runs and which modules each holds.

Pure arithmetic, no modules and no processes, so the trainer can validate a job before any
worker starts. A model of ``n_layers`` blocks is cut into ``num_stages`` contiguous runs of
equally many blocks; the first stage also holds the embedding, the last the final norm and the
output layer (torchtitan's split). Modules are named by their paths in the whole model, which
is what stage state dicts and checkpoints keep.

Schedules: GPipe and 1F1B run one stage per pipeline rank; interleaved 1F1B runs two per rank,
in loop order (pipeline rank ``r`` of ``pp`` holds stages ``r`` and ``r + pp``), so the
activations go around the ranks twice.

Example:
    >>> stage_module_paths(4, 2, 1)
    ['layers.2', 'layers.3', 'norm', 'output']
    >>> stages_of_rank(1, 2, "interleaved_1f1b")
    [1, 3]
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "stages_per_rank", "num_stages", "stages_of_rank", "stage_layers", "stage_module_paths",
           "pipeline_problems"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
FIRST_MODULES = ("tok_embeddings",)
LAST_MODULES = ("norm", "output")


def stages_per_rank(schedule: str) -> int:
    """Stages one pipeline rank runs under ``schedule``."""
    _check_schedule(schedule)
    return 2 if schedule == "interleaved_1f1b" else 1


def num_stages(pp: int, schedule: str) -> int:
    """Stages of the whole pipeline: ``pp`` times the stages per rank."""
    return pp * stages_per_rank(schedule)


def stages_of_rank(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` runs, in increasing order (loop placement)."""
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pipeline rank {pp_rank} is outside 0..{pp - 1}")
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """The block indices of ``stage``: the ``stage``-th of ``stages`` equal contiguous runs."""
    if stages < 1 or n_layers % stages:
        raise ValueError(f"{n_layers} layers do not split into {stages} stages of equally many layers")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")
    per = n_layers // stages
    return range(stage * per, (stage + 1) * per)


def stage_module_paths(n_layers: int, stages: int, stage: int) -> list[str]:
    """The top-level module paths ``stage`` keeps (``layers.<i>`` for each of its blocks)."""
    paths = list(FIRST_MODULES) if stage == 0 else []
    paths += [f"layers.{i}" for i in stage_layers(n_layers, stages, stage)]
    if stage == stages - 1:
        paths += list(LAST_MODULES)
    return paths


def pipeline_problems(n_layers: int, pp: int, schedule: str, microbatches: int, local_batch: int) -> list[str]:
    """Why this pipeline cannot run, one sentence per problem (empty: it can), naming the flags.

    Args:
        n_layers: blocks of the model.
        pp: pipeline ranks.
        schedule: one of ``SCHEDULES``.
        microbatches: microbatches per step.
        local_batch: sequences each data-parallel rank gets per step.
    """
    if schedule not in SCHEDULES:
        return [f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}"]
    problems = []
    stages = num_stages(pp, schedule)
    if n_layers % stages:
        how = f"2 x --pp {pp} = {stages} stages (interleaved 1F1B runs two per rank)" if stages != pp else \
            f"--pp {pp} stages"
        problems.append(f"the model's {n_layers} layers do not split into {how} of equally many layers")
    if microbatches < 1:
        problems.append(f"--pp-microbatches must be at least 1, got {microbatches}")
    elif local_batch % microbatches:
        problems.append(f"--pp-microbatches {microbatches} does not divide the {local_batch} sequences of each "
                        f"data-parallel rank (--global-batch / dp_replicate / dp_shard)")
    elif schedule == "interleaved_1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            problems.append(f"--pp-schedule interleaved_1f1b runs the microbatches in max(1, --pp-microbatches // "
                            f"--pp) = {rounds} rounds of equally many: --pp-microbatches {microbatches} is not "
                            f"divisible by {rounds}")
    return problems


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
