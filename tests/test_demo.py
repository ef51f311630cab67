"""``python -m shardwise.demo`` runs as the README says and explains what it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_walks_every_placement_and_explains_its_notation():
    proc = subprocess.run([sys.executable, "-m", "shardwise.demo"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for term in ("R       Replicate()", "S(d)    Shard(d)", "P(sum)  Partial(sum)", "f32[4@tp,6@dp]"):
        assert term in out, f"the legend does not explain {term!r}:\n{out}"
    assert out.count("\n-> ") == 8 and "every rank holds x again" in out, out
