"""How ``shardwise.launch`` starts workers: forked from the launcher on Linux with a CPU-only torch,
spawned with a GPU build or on request.

A forked worker skips importing torch (1.5-2 CPU-seconds per worker), keeps one intra-op thread
as a spawned one does, and a program that leaves with ``os._exit(0)`` ends the job normally
(the agent waits for forked workers to return; the launcher runs the program one fork further
down for that reason, see ``run_forked``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "jobs" / "fork_probe.py"


@pytest.mark.unit
def test_the_default_forks_only_on_linux_with_a_cpu_only_torch(monkeypatch):
    import torch

    from shardwise.launch.launcher import START_METHOD_ENV, StartMethod, _start_method

    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    cpu_only = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    assert _start_method() is (StartMethod.FORK if sys.platform.startswith("linux") and cpu_only else StartMethod.SPAWN)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert _start_method() is StartMethod.SPAWN
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    assert _start_method() is StartMethod.FORK


def _run(start_method: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.pop("SHARDWISE_LAUNCH_START_METHOD", None)
    if start_method:
        env["SHARDWISE_LAUNCH_START_METHOD"] = start_method
    done = subprocess.run([sys.executable, str(PROBE)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.e2e
def test_forked_workers_inherit_the_launchers_imports_and_end_with_os_exit():
    out = _run("fork")
    for rank in (0, 1):
        assert f"rank {rank}: preloaded=True threads=1 sum=2" in out, out


@pytest.mark.e2e
def test_spawn_gives_every_worker_a_fresh_interpreter():
    out = _run("spawn")
    for rank in (0, 1):
        assert f"rank {rank}: preloaded=False threads=1 sum=2" in out, out
