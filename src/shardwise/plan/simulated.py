"""A layout's figures from the simulator (``shardwise.simulate``), two ways (docs/plan.md).

* ``estimated_cost``: simulate the model with one and then two blocks per pipeline stage and
  extend the difference to the model's depth (every block after the first costs the same). A
  few blocks simulate in a fraction of the full model's time, so every valid layout of a world
  gets one; the plan decides which layouts to look at closely from it.
* ``simulated_cost``: simulate the job exactly as ``python -m shardwise.train ... --simulate``
  does (the named config at full depth) and take the busiest rank's figures. The plan prints
  these for every layout it ranks, so its peaks are the numbers ``--simulate`` prints.

Both return a ``search.LayoutCost``: peak memory of the busiest rank, bytes and collectives per
mesh axis (the cost model, ``shardwise.cost``, prices those into time).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from shardwise.plan.search import LayoutCost, extrapolate

if TYPE_CHECKING:
    from shardwise.simulate import SimulationReport
    from shardwise.train.config import JobConfig

__all__ = ["estimated_cost", "simulated_cost"]


def _busiest(report: SimulationReport) -> LayoutCost:
    """The figures of the rank with the highest peak (its bytes and collectives with it)."""
    worst = max(report.per_rank, key=lambda m: m.peak_memory_bytes)
    return LayoutCost(worst.peak_memory_bytes, dict(worst.comm_bytes_by_axis),
                      {a: dict(k) for a, k in worst.collectives_by_axis.items()})


def simulated_cost(job: JobConfig) -> LayoutCost:
    """The busiest rank's figures from one simulated step of ``job`` at full depth, the step
    ``--simulate`` measures (``shardwise.simulate.simulate_job``)."""
    from shardwise.simulate import simulate_job

    return _busiest(simulate_job(job))


def estimated_cost(job: JobConfig) -> LayoutCost:
    """``job``'s figures extended from simulations with 1 and 2 blocks per pipeline stage."""
    from shardwise.simulate import simulate_job

    family = job.model_family()
    named = family.config(job.config)
    one, two = (_busiest(simulate_job(dataclasses.replace(job, shapes=family.with_layers(named, n * job.pp))))
                for n in (1, 2))
    return extrapolate(one, two, family.num_layers(named) // job.pp - 1)
