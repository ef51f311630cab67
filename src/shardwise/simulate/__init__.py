"""See a training step before running it: one process plays every rank of a job on meta tensors.

``simulate_job(job)`` returns, per rank, the bytes the step sends on each mesh axis and its
memory (parameters, gradients, optimizer state, peak); ``python -m shardwise.train ...
--simulate`` prints them. ``process_group.py`` is the simulated process group, ``memory.py``
the live-storage tracker, ``measure.py`` the instruments shared with real runs,
``symmetry.py`` (pure) which ranks need simulating, ``pipeline.py`` a pipeline stage's
microbatches in its schedule's order, ``run.py`` the driver, ``report.py`` the text.
"""

from shardwise.simulate.measure import StepMeasurement, measure_step
from shardwise.simulate.memory import MemoryTracker
from shardwise.simulate.process_group import simulated_world
from shardwise.simulate.run import SimulationReport, simulate_job, simulate_rank
from shardwise.simulate.symmetry import ParamLayout, rank_classes

__all__ = ["MemoryTracker", "ParamLayout", "SimulationReport", "StepMeasurement", "measure_step", "rank_classes",
           "simulate_job", "simulate_rank", "simulated_world"]
