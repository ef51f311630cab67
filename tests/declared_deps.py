"""Run code as a user who installed shardwise exactly as the README says would.

The test environment has more installed than such a user (the ``test`` extra, tools, and
whatever the system Python carries), and an import that only works because of them is a bug
users hit first (issue 10: torch's object collectives need numpy, which only the test extra
installed). ``blocking_env()`` returns an environment in which every installed top-level
module is unimportable unless it belongs to shardwise's declared runtime dependencies or
theirs (recursively, extras excluded); ``tests/declared_only/sitecustomize.py`` enforces it in
every Python process started with that environment, launched workers included.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import sys

from packaging.requirements import Requirement

__all__ = ["declared_dependencies", "declared_closure", "undeclared_modules", "blocking_env", "normalize"]

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK_DIR = os.path.join(HERE, "declared_only")
PYPROJECT = os.path.join(os.path.dirname(HERE), "pyproject.toml")


def normalize(name: str) -> str:
    """A distribution name as pip compares them (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _runtime_requirements(dist: str) -> list[str]:
    """The distributions ``dist`` needs without extras, on this platform."""
    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(normalize(req.name))
    return out


def declared_dependencies() -> list[str]:
    """shardwise's runtime dependencies as pyproject.toml declares them now (not as the
    installed metadata recorded them at the last ``pip install``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the installed metadata is all there is
        return _runtime_requirements("shardwise")
    with open(PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    return [normalize(Requirement(text).name) for text in project.get("dependencies", [])]


def declared_closure() -> set[str]:
    """shardwise, its declared dependencies and every distribution they pull in, recursively."""
    seen, todo = {"shardwise"}, declared_dependencies()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            todo.extend(_runtime_requirements(dist))
        except metadata.PackageNotFoundError:
            pass  # declared but not installed here: nothing of it to block either
    return seen


def undeclared_modules() -> list[str]:
    """Installed top-level modules that no distribution of the declared closure provides."""
    closure = declared_closure()
    out = []
    for module, dists in metadata.packages_distributions().items():
        if module in sys.stdlib_module_names or module.startswith("__"):
            continue
        if not any(normalize(d) in closure for d in dists):
            out.append(module)
    return sorted(out)


def blocking_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with every undeclared module blocked in child Pythons."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BLOCK_DIR, env.get("PYTHONPATH", "")) if p)
    env["SHARDWISE_BLOCKED_MODULES"] = ",".join(undeclared_modules())
    return env
