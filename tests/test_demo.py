"""The demo explains the notation it prints (tests/test_readme.py runs ``python -m shardwise.demo``)."""

from __future__ import annotations

from shardwise import Shard
from shardwise.demo import LEGEND, STEPS


def _legend_entry(placement) -> str:
    return "S(d)" if isinstance(placement, Shard) else str(placement)


def test_demo_legend_explains_every_notation_it_prints():
    shown = {_legend_entry(p) for step in STEPS for p in step}
    assert shown == {"R", "S(d)", "P(sum)"}
    for entry in shown:
        assert f"\n    {entry} " in LEGEND, f"the legend does not explain {entry}"
    assert "f32[4@tp,6@dp]{P(sum)@dp}" in LEGEND and "coordinate" in LEGEND
