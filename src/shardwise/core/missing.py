"""Names torch's DTensor modules export that shardwise does not provide yet: one clear error.

A package lists its missing names in ``NOT_YET`` and sets ``__getattr__ = missing_names(__name__)``.
Looking such a name up then says what is missing and what to use instead, without breaking
the two ways code probes for a feature:

* ``from shardwise.parallel import fsdp`` raises ``NotProvidedImportError``,
  an ``ImportError`` (``try: ... except ImportError`` probes fall back) and a
  ``NotImplementedError``, carrying the explanation (an ``AttributeError`` raised during
  ``from ... import`` would be replaced by Python's bare "cannot import name");
* ``shardwise.parallel.fsdp``, ``hasattr`` and ``getattr(m, name, default)``
  see ``NotProvidedError``, an ``AttributeError`` (probes answer False / the default) that is
  also a ``NotImplementedError``.

Unknown names raise the ordinary ``AttributeError``.
"""

from __future__ import annotations

import dis
import sys
from typing import Callable, NoReturn

__all__ = ["NOT_YET", "NotProvidedError", "NotProvidedImportError", "missing_names"]

# shardwise module -> {name: (torch's full name, what is missing and what to use instead)}
NOT_YET: dict[str, dict[str, tuple[str, str]]] = {
    "shardwise.parallel": {
        "ddp": ("torch.distributed.tensor.parallel.ddp",
                "hooks that let torch's DistributedDataParallel hold DTensor parameters; combine tensor "
                "parallelism with shardwise.fsdp.replicate (or fully_shard) instead"),
        "fsdp": ("torch.distributed.tensor.parallel.fsdp",
                 "extensions for torch's FSDP1 (FullyShardedDataParallel) over DTensor parameters; use "
                 "shardwise.fsdp.fully_shard (FSDP2), which takes tensor-parallel DTensor parameters"),
        "input_reshard": ("torch.distributed.tensor.parallel.input_reshard",
                          "resharding a module's saved inputs for backward; no equivalent yet (activation "
                          "checkpointing in shardwise.train.parallelize saves memory instead)"),
    },
}

_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


class NotProvidedError(AttributeError, NotImplementedError):
    """A torch name shardwise does not provide yet, looked up as an attribute."""


class NotProvidedImportError(ImportError, NotImplementedError):
    """A torch name shardwise does not provide yet, imported with ``from ... import``."""


def _imported_by(frame) -> bool:
    """Whether ``frame`` is executing ``from module import name`` right now."""
    try:
        return frame.f_code.co_code[frame.f_lasti] == _IMPORT_FROM
    except (AttributeError, IndexError, TypeError):
        return False


def missing_names(module_name: str) -> Callable[[str], NoReturn]:
    """A module-level ``__getattr__`` for ``module_name`` raising the errors described above."""
    missing = NOT_YET.get(module_name, {})

    def __getattr__(name: str) -> NoReturn:
        if name not in missing:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        torch_name, why = missing[name]
        message = f"shardwise does not provide {module_name}.{name} (torch's {torch_name}) yet: {why}"
        if _imported_by(sys._getframe(1)):
            raise NotProvidedImportError(message, name=module_name)
        raise NotProvidedError(message)

    return __getattr__
