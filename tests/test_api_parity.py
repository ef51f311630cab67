"""The API table (docs/api.md, "API compared with torch.distributed.tensor") against the installed torch.

Every public name of torch's DTensor modules has one row; a name marked supported exists under
the same name in the matching shardwise module (and its ``__all__``); a partly supported one
exists where the row says; a name marked not yet raises an error naming it, without breaking
``hasattr`` / ``try: import`` probes. Pure: no processes.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
SECTION = "# API compared with torch.distributed.tensor"

# torch module -> the shardwise module a user switches the import to
MATCHING = {
    "torch.distributed.tensor": "shardwise",
    "torch.distributed.tensor.parallel": "shardwise.parallel",
    "torch.distributed.tensor.debug": "shardwise.debug",
    "torch.distributed.tensor.experimental": "shardwise.experimental",
    "torch.distributed.tensor.placement_types": "shardwise.placement_types",
    "torch.distributed.device_mesh": "shardwise.device_mesh",
}
STATUSES = ("supported", "partly", "not yet")
ROW = re.compile(r"^\| `([\w.]+)` \| (?:`([\w.]+)`)? *\| (supported|partly|not yet) \|")


def _public_home(obj: object) -> bool:
    """Defined in a public module of torch's DTensor packages (not a re-exported helper)."""
    home = getattr(obj, "__module__", None) or ""
    ours = home.startswith("torch.distributed.tensor") or home == "torch.distributed.device_mesh"
    return ours and not any(part.startswith("_") for part in home.split("."))


class Submodule(str):
    """A public submodule of torch's, named but not imported (some pull in FSDP1, slowly)."""


@functools.lru_cache(maxsize=None)
def torch_public_names() -> dict[str, object]:
    """Full name -> object: each module's ``__all__``, public submodules, public re-exported classes."""
    names = {}
    for module_name in MATCHING:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            names[f"{module_name}.{name}"] = getattr(module, name)
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
            if not info.name.startswith("_"):
                names[f"{module_name}.{info.name}"] = Submodule(f"{module_name}.{info.name}")
        for name in dir(module):
            obj = getattr(module, name)
            if not name.startswith("_") and not inspect.ismodule(obj) and _public_home(obj):
                names.setdefault(f"{module_name}.{name}", obj)
    return names


def table_rows() -> list[tuple[str, str | None, str]]:
    text = API_PAGE.read_text()
    assert SECTION in text, f"docs/api.md has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [m.groups() for m in map(ROW.match, body.splitlines()) if m]
    table_lines = [line for line in body.splitlines() if line.startswith("| `")]
    assert len(rows) == len(table_lines), "a table row does not read as | `torch name` | `shardwise name` | status |"
    return rows


def _split(full: str) -> tuple[str, str]:
    """("torch.distributed.tensor.parallel", "ColwiseParallel") for a torch full name."""
    module, _, name = full.rpartition(".")
    return module, name


def resolve(full: str) -> object:
    """The object a dotted shardwise name denotes: a module, or an attribute of one."""
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError:
        module, _, name = full.rpartition(".")
        return getattr(importlib.import_module(module), name)


def test_the_table_lists_every_public_torch_name_once():
    listed = [torch_name for torch_name, _, _ in table_rows()]
    duplicated = sorted({n for n in listed if listed.count(n) > 1})
    assert not duplicated, f"listed twice: {duplicated}"
    names = torch_public_names()
    assert sorted(set(names) - set(listed)) == [], "torch names missing from the API table (docs/api.md)"
    assert sorted(set(listed) - set(names)) == [], "the API table (docs/api.md) lists names torch does not have"


ROWS = table_rows()


@pytest.mark.parametrize("torch_name,shardwise_name", [(t, s) for t, s, status in ROWS if status == "supported"])
def test_a_supported_name_is_the_same_name_in_the_matching_module(torch_name, shardwise_name):
    module, name = _split(torch_name)
    assert shardwise_name == f"{MATCHING[module]}.{name}", "a supported name keeps its name in the matching module"
    ours, theirs = resolve(shardwise_name), torch_public_names()[torch_name]
    assert inspect.ismodule(ours) == isinstance(theirs, Submodule)
    if inspect.isclass(theirs):  # users subclass torch's classes and test isinstance against them
        assert inspect.isclass(ours)
    assert callable(ours) == (callable(theirs) and not isinstance(theirs, Submodule))
    if not inspect.ismodule(ours):
        assert name in importlib.import_module(MATCHING[module]).__all__, f"{name} missing from {MATCHING[module]}.__all__"


@pytest.mark.parametrize("torch_name,shardwise_name", [(t, s) for t, s, status in ROWS if status == "partly"])
def test_a_partly_supported_name_exists_where_the_table_says(torch_name, shardwise_name):
    assert shardwise_name, f"{torch_name}: a partly supported row names its shardwise counterpart"
    resolve(shardwise_name)


@pytest.mark.parametrize("torch_name", [t for t, _, status in ROWS if status == "not yet"])
def test_a_missing_name_raises_an_error_naming_it_and_probes_stay_sane(torch_name):
    from shardwise.core.missing import NotProvidedError, NotProvidedImportError

    module_name, name = _split(torch_name)
    ours = importlib.import_module(MATCHING[module_name])
    assert not hasattr(ours, name)
    assert getattr(ours, name, "default") == "default"
    with pytest.raises(NotProvidedError, match=re.escape(torch_name)) as looked_up:
        getattr(ours, name)
    assert isinstance(looked_up.value, (AttributeError, NotImplementedError))
    with pytest.raises(NotProvidedImportError, match=re.escape(f"{MATCHING[module_name]}.{name}")) as imported:
        exec(f"from {MATCHING[module_name]} import {name}", {})
    assert isinstance(imported.value, ImportError) and isinstance(imported.value, NotImplementedError)


def test_unknown_names_keep_python_s_own_errors():
    import shardwise.experimental

    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'") as looked_up:
        shardwise.experimental.no_such_name  # noqa: B018
    assert not isinstance(looked_up.value, NotImplementedError)
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        exec("from shardwise.parallel import no_such_name", {})
