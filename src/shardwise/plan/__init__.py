"""Rank parallel plans for a world: ``python -m shardwise.plan`` (search.py pure, __main__.py the CLI)."""

from shardwise.plan.search import (Candidate, Hardware, LayoutCost, Plan, candidates, extrapolate, fits, load_hardware,
                                   price, rank_plans)

__all__ = ["Candidate", "Hardware", "LayoutCost", "Plan", "candidates", "extrapolate", "fits", "load_hardware", "price",
           "rank_plans"]
