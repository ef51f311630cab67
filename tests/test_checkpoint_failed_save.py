"""A save that fails part-way leaves no ``<path>.tmp-*`` directory and the previous checkpoint intact.

Issue 10 (item 1): without numpy, torch's object collectives raise ``Numpy is not available``
right after rank 0 created the save's tmp directory, which stayed behind. Each scenario here
saves version 1 in this process (no process group), then a 2-rank gloo job tries to save
version 2 and fails:

* ``no-numpy``: the job's interpreter cannot import numpy (as in an install without it), so
  the first exchange of the save raises on every rank;
* ``peer-killed``: rank 1 is SIGKILLed while writing its file; rank 0's next collective fails;
* ``ctrl-c-rank0``: rank 0 gets SIGINT (KeyboardInterrupt) while writing its file.

Afterwards rank 0 must have raised (not hung), no tmp directory may remain, and the checkpoint
must load as version 1, bit for bit. Ranks are forked from one driver subprocess per
interpreter kind (``python tests/test_checkpoint_failed_save.py <workdir> <scenarios>``).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.commit import KILL_ENV

# Launched processes: the e2e tier (tests/conftest.py). Not a pytest marker: this file also runs
# as a script, which must not need pytest (test_install.py: only declared dependencies importable).
E2E_TESTS = ("test_failed_saves_leave_no_tmp_directory",)

WORLD = 2
BLOCK_NUMPY = "import sys; sys.modules['numpy'] = None; "  # what an interpreter without numpy sees
SCENARIOS = {
    "no-numpy": {"block_numpy": True},
    "peer-killed": {"kill": "mid_write@1"},
    "ctrl-c-rank0": {"kill": "mid_write@0:INT"},
}


def _state(version: int) -> dict:
    g = torch.Generator().manual_seed(version)
    return {"model": {"w": torch.randn(64, 48, generator=g)}, "plain": torch.randn(5, generator=g),
            "version": version}


# ------------------------------------------------------------------ child side (forked ranks)
def _rank_main(rank: int, workdir: str, kill: str | None) -> None:
    import torch.distributed as dist

    import shardwise as sw

    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    mesh = sw.init_device_mesh("cpu", (WORLD,))
    if kill:
        os.environ[KILL_ENV] = kill
    full = _state(2)
    state = {"model": {"w": sw.distribute_tensor(full["model"]["w"], mesh, [sw.Shard(0)], src_data_rank=None)},
             "plain": full["plain"], "version": 2}
    ckpt.save(state, os.path.join(workdir, "ckpt"), max_chunk_bytes=4 << 10)


def _run_rank(rank: int, workdir: str, kill: str | None) -> None:
    """Forked child: record how the save ended (rank 0 writes ``outcome``), then exit."""
    start, outcome = time.monotonic(), "saved"
    try:
        _rank_main(rank, workdir, kill)
    except BaseException as err:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(err).__name__}: {err}"
    if rank == 0:
        with open(os.path.join(workdir, "outcome"), "w") as f:
            json.dump({"outcome": outcome, "seconds": time.monotonic() - start}, f)
    os._exit(0)


def _driver(root: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names:
        workdir = os.path.join(root, name)
        pids = []
        for rank in range(WORLD):
            pid = os.fork()
            if pid == 0:
                _run_rank(rank, workdir, SCENARIOS[name].get("kill"))
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)


# ------------------------------------------------------------------ test side
def _load(path: str) -> dict:
    state = {"model": {"w": torch.full((64, 48), -1.0)}, "plain": torch.full((5,), -1.0), "version": -1}
    ckpt.load(state, path)
    return state


def _launch_driver(root: str, names: list[str], block_numpy: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", KILL_ENV)}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    code = (f"{BLOCK_NUMPY if block_numpy else ''}import runpy, sys; sys.argv = {[__file__, root, json.dumps(names)]!r}; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, f"driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_failed_saves_leave_no_tmp_directory(tmp_path):
    for name in SCENARIOS:
        os.makedirs(tmp_path / name)
        ckpt.save(_state(1), str(tmp_path / name / "ckpt"))  # version 1, saved by this process alone
    plain = [n for n, s in SCENARIOS.items() if not s.get("block_numpy")]
    _launch_driver(str(tmp_path), ["no-numpy"], block_numpy=True)
    _launch_driver(str(tmp_path), plain, block_numpy=False)
    problems = [p for name in SCENARIOS for p in _problems(tmp_path / name)]
    assert problems == [], "\n".join(problems)
    with open(tmp_path / "no-numpy" / "outcome") as f:
        assert "Numpy is not available" in json.load(f)["outcome"]


def _problems(base) -> list[str]:
    """What is wrong after one scenario: a save that succeeded or was slow to fail, leftovers,
    a checkpoint other than version 1."""
    with open(base / "outcome") as f:
        outcome = json.load(f)
    name, path, problems = base.name, str(base / "ckpt"), []
    if outcome["outcome"] == "saved":
        problems.append(f"{name}: the save was meant to fail")
    if outcome["seconds"] > 20:
        problems.append(f"{name}: rank 0 took {outcome['seconds']:.1f} s to fail")
    leftovers = [os.path.basename(p) for p in glob.glob(glob.escape(path) + ".*")]
    if leftovers:
        problems.append(f"{name}: the failed save ({outcome['outcome']}) left {leftovers}")
    state, want = _load(path), _state(1)
    if not (state["version"] == 1 and torch.equal(state["model"]["w"], want["model"]["w"])
            and torch.equal(state["plain"], want["plain"])):
        problems.append(f"{name}: the checkpoint no longer loads as version 1 (version {state['version']})")
    return problems

if __name__ == "__main__":
    _driver(sys.argv[1], json.loads(sys.argv[2]))
