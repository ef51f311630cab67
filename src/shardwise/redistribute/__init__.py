"""Changing a DTensor's layout: a pure planner, an executor over ``comm``, autograd Functions."""

from shardwise.redistribute.execute import plan_for, redistribute_local
from shardwise.redistribute.planner import Plan, Step, plan_redistribute

__all__ = ["Plan", "Step", "plan_redistribute", "plan_for", "redistribute_local"]
