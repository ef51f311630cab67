"""Crash safety: SIGKILL at any moment of a save never loses the last good checkpoint.

Each scenario is a 2-rank gloo job that saves version 1 of a sharded state, then saves more
versions while being killed: at a named point of the save (``SHARDWISE_CHECKPOINT_KILL_AT``,
see ``shardwise.checkpoint.commit``) or after a random delay. Afterwards, in this process
(no process group), the checkpoint must load and be bit-identical to the last version
committed (or to the one in flight, if it committed just before the kill), leftovers of the
killed save must never load as anything but a complete version, and the next save must
recover and tidy up.

To keep this cheap on small machines, one subprocess imports torch once and forks the rank
processes of every scenario (``python tests/test_checkpoint_crash.py <workdir> <scenarios>``).
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch

import shardwise.checkpoint as ckpt
from shardwise.checkpoint.commit import KILL_ENV

# Launched processes: the e2e tier (tests/conftest.py). Not a pytest marker: this file also runs
# as a script, which must not need pytest (test_install.py: only declared dependencies importable).
E2E_TESTS = ("test_killed_saves_keep_the_last_checkpoint",)

WORLD = 2
POINTS = ["mid_write@1", "after_write@0", "before_metadata", "before_commit", "between_renames", "after_commit"]
RANDOM_KILLS = 4


def _full_state(version: int) -> dict:
    g = torch.Generator().manual_seed(version)
    return {
        "model": {"w": torch.randn(33, 17, generator=g), "big": torch.randn(512, 256, generator=g)},
        "plain": torch.randn(5, generator=g),
        "version": version,
    }


# ------------------------------------------------------------------ child side (forked ranks)
def _rank_main(rank: int, store: str, path: str, progress: str, versions: list[int], kill: dict) -> None:
    import torch.distributed as dist

    import shardwise as sw

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    mesh = sw.init_device_mesh("cpu", (WORLD,))
    for version in versions:
        if version == kill.get("version"):
            os.environ[KILL_ENV] = kill["point"]
        full = _full_state(version)
        state = {"model": {k: sw.distribute_tensor(v, mesh, [sw.Shard(0)], src_data_rank=None)
                           for k, v in full["model"].items()},
                 "plain": full["plain"], "version": version}
        ckpt.save(state, path, max_chunk_bytes=64 << 10)
        if rank == 0:
            with open(progress, "a") as f:
                f.write(f"{version}\n")


def _run_scenario(workdir: str, scenario: dict) -> None:
    """Fork the ranks, kill them as the scenario says, reap them."""
    name = scenario["name"]
    os.makedirs(os.path.join(workdir, name))
    path, progress = os.path.join(workdir, name, "ckpt"), os.path.join(workdir, name, "progress")
    store = os.path.join(workdir, name, "store")
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank_main(rank, store, path, progress, scenario["versions"], scenario.get("kill", {}))
            except BaseException:  # noqa: BLE001 - a peer was killed: this rank's collective fails
                code = 3
            os._exit(code)
        pids.append(pid)
    if "delay" in scenario:
        _kill_after_first_commit(pids, progress, scenario["delay"])
    _reap(pids)


def _kill_after_first_commit(pids: list[int], progress: str, delay: float) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _committed(progress) == 0:
        time.sleep(0.005)
    time.sleep(delay)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def _reap(pids: list[int]) -> None:
    """Wait for one rank to end; the others are then stuck in a collective: kill them."""
    remaining = set(pids)
    pid, _ = os.wait()
    remaining.discard(pid)
    for other in remaining:
        try:
            os.kill(other, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for other in remaining:
        os.waitpid(other, 0)


def _zygote(workdir: str, scenarios: list[dict]) -> None:
    torch.set_num_threads(1)
    for scenario in scenarios:
        _run_scenario(workdir, scenario)


# ------------------------------------------------------------------ test side
def _scenarios(rng: random.Random) -> list[dict]:
    out = [{"name": f"point-{p.replace('@', '-r')}", "versions": [1, 2], "kill": {"version": 2, "point": p}}
           for p in POINTS]
    out += [{"name": f"random-{i}", "versions": list(range(1, 200)), "delay": round(rng.uniform(0.0, 0.4), 3)}
            for i in range(RANDOM_KILLS)]
    return out


def _load_plain(path: str) -> dict:
    state = {k: v for k, v in _full_state(0).items()}
    state = {"model": {k: torch.full_like(v, -1) for k, v in state["model"].items()},
             "plain": torch.full_like(state["plain"], -1), "version": -1}
    ckpt.load(state, path)
    return state


def _identical(state: dict, version: int) -> bool:
    want = _full_state(version)
    return (state["version"] == version and torch.equal(state["plain"], want["plain"])
            and all(torch.equal(state["model"][k], want["model"][k]) for k in want["model"]))


def _committed(progress: str) -> int:
    """The last version rank 0 saw committed (0: none yet)."""
    if not os.path.exists(progress):
        return 0
    with open(progress) as f:
        lines = f.read().split()
    return int(lines[-1]) if lines else 0


def _check_scenario(workdir: str, scenario: dict) -> None:
    base = os.path.join(workdir, scenario["name"])
    path = os.path.join(base, "ckpt")
    committed = _committed(os.path.join(base, "progress"))
    assert committed >= 1, f"{scenario}: version 1 was never committed"
    state = _load_plain(path)
    if "kill" in scenario:
        allowed = {2} if scenario["kill"]["point"] == "after_commit" else {1}
    else:
        allowed = {committed, committed + 1}  # the save in flight may have committed just before the kill
    assert state["version"] in allowed, f"{scenario}: loaded version {state['version']}, expected one of {allowed}"
    assert _identical(state, state["version"]), f"{scenario}: version {state['version']} is not bit-identical"
    for leftover in glob.glob(glob.escape(path) + ".tmp-*"):
        try:
            partial = _load_plain(leftover)
        except ckpt.CheckpointError:
            continue
        assert _identical(partial, partial["version"]), f"{scenario}: {leftover} loads as a half checkpoint"
    # The next save recovers (puts an aside checkpoint back, removes leftovers) and commits.
    ckpt.save(_full_state(99), path)
    assert _identical(_load_plain(path), 99)
    assert glob.glob(glob.escape(path) + ".*") == [], f"{scenario}: leftovers after the next save"


def test_killed_saves_keep_the_last_checkpoint(tmp_path):
    seed = random.randrange(1 << 30)
    scenarios = _scenarios(random.Random(seed))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", KILL_ENV)}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path), json.dumps(scenarios)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"crash driver failed (seed {seed}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for scenario in scenarios:
        _check_scenario(str(tmp_path), {**scenario, "seed": seed})


if __name__ == "__main__":
    _zygote(sys.argv[1], json.loads(sys.argv[2]))
