"""The runtime dependencies in pyproject.toml are complete (issue 10, item 1).

An install that follows the README (``pip install torch==2.13.0 -e .``, no test extra) crashed
on every rank with ``RuntimeError: Numpy is not available``: torch's object collectives need
numpy, which only the test extra installed, so the suite never saw it. Two checks:

* every third-party module the library imports is a declared dependency, unless the import is
  optional (inside ``try: ... except ImportError``, with a fallback);
* a 2-rank job using what needs more than torch itself (``from_local(run_check=True)``, a
  checkpoint save and load: object collectives) runs with every module outside the declared
  dependencies blocked (``tests/declared_deps.py``), as in a README install.

``.ci/run`` also proves it for real, in a fresh virtual environment without the test extra.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

# Launched processes: the e2e tier (tests/conftest.py). Not a pytest marker: this file also runs
# as a script, which must not need pytest (test_install.py: only declared dependencies importable).
E2E_TESTS = ("test_library_runs_with_only_declared_dependencies",)

REPO = pathlib.Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "shardwise"


# ------------------------------------------------------------------ static: imports are declared
def _guarded_by_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    return any(isinstance(h.type, ast.Name) and h.type.id in names
               or isinstance(h.type, ast.Tuple) and any(getattr(e, "id", None) in names for e in h.type.elts)
               for h in node.handlers)


def _imports(tree: ast.AST, optional: bool = False):
    """(top-level module, line, optional) for every absolute import under ``tree``."""
    for node in ast.iter_child_nodes(tree):
        inner_optional = optional or (isinstance(node, ast.Try) and _guarded_by_import_error(node))
        if isinstance(node, ast.Import):
            yield from ((a.name.partition(".")[0], node.lineno, optional) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.partition(".")[0], node.lineno, optional
        if isinstance(node, ast.Try):
            for part in node.body:  # only the try body is guarded, not the handlers
                yield from _imports(ast.Module(body=[part], type_ignores=[]), inner_optional)
            for part in [*node.handlers, *node.orelse, *node.finalbody]:
                yield from _imports(part, optional)
        else:
            yield from _imports(node, optional)


def _third_party_imports() -> dict[str, list[tuple[str, bool]]]:
    found: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for module, line, optional in _imports(ast.parse(path.read_text(), str(path))):
            if module not in sys.stdlib_module_names and module not in ("shardwise", "__future__"):
                found.setdefault(module, []).append((f"{path.relative_to(REPO)}:{line}", optional))
    return found


def test_every_library_import_is_a_declared_dependency():
    from tests.declared_deps import declared_dependencies, normalize

    declared, providers = set(declared_dependencies()), metadata.packages_distributions()
    problems = []
    for module, places in _third_party_imports().items():
        dists = {normalize(d) for d in providers.get(module, [module])}
        required = [where for where, optional in places if not optional]
        if required and not dists & declared:
            problems.append(f"{module} (distribution {sorted(dists)}) imported at {required} "
                            f"is not in pyproject's dependencies {sorted(declared)}")
    assert problems == [], "\n".join(problems)


def test_import_walker_sees_required_and_optional_imports():
    """The walker itself: a plain import is required, one under ``except ImportError`` optional."""
    tree = ast.parse("import a.b\nfrom c import d\ntry:\n    import e\nexcept ImportError:\n    import f\n"
                     "def g():\n    import h\n")
    assert sorted((m, o) for m, _, o in _imports(tree)) == [
        ("a", False), ("c", False), ("e", True), ("f", False), ("h", False)]


def test_ci_installs_every_optional_import_for_the_extras_step():
    """.ci/run's extras step installs exactly the modules the library imports only optionally."""
    optional = {m for m, places in _third_party_imports().items() if all(o for _, o in places)}
    line = next(ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.startswith("OPTIONAL_EXTRAS="))
    assert set(line.partition("=")[2].strip('"').split()) == optional, (line, sorted(optional))


# ------------------------------------------------------------------ dynamic: a README install
def _job(path: str) -> None:
    """Runs on 2 ranks with undeclared modules blocked: the library's object collectives."""
    import importlib

    import torch.distributed as dist

    import shardwise as sw
    import shardwise.checkpoint as dcp

    try:
        importlib.import_module("pytest")
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("the blocker is not active: pytest is importable")
    mesh = sw.init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    local = torch.arange(6.0).reshape(2, 3) + 10 * rank
    x = sw.DTensor.from_local(local, mesh, [sw.Shard(0)], run_check=True)
    dcp.save({"x": x, "step": 3}, path)
    state = {"x": sw.distribute_tensor(torch.zeros(4, 3), mesh, [sw.Replicate()]), "step": 0}
    dcp.load(state, path)
    assert torch.equal(state["x"].full_tensor(), x.full_tensor()) and state["step"] == 3
    if rank == 0:
        print("install job: ok", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def test_library_runs_with_only_declared_dependencies():
    from tests.declared_deps import blocking_env

    env = blocking_env()
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, os.path.join(tmp, "ckpt")]
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "install job: ok" in out, (
        f"exit {proc.returncode} with only the declared dependencies importable "
        f"(blocked: {env['SHARDWISE_BLOCKED_MODULES']}):\n{out[-4000:]}")


if __name__ == "__main__":
    _job(sys.argv[1])
