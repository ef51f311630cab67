"""torch's own distributed-tensor objects, recognized where a shardwise one was expected.

shardwise mirrors ``torch.distributed.tensor`` name for name, so a script that switched most of
its imports can still hand shardwise a torch ``Shard(0)``, ``DeviceMesh``, ``DTensor`` or
parallel style. Both print alike (``Shard(dim=0)``), so an error that only shows the value
contradicts itself. The gates that check placements, meshes, styles and plain tensors ask
``foreign_note`` and, for torch's objects, say whose they are and the conversion to use
(``shardwise.interop``; docs/checkpoints.md, "Interop").

Pure: objects are recognized by the module their class comes from; torch's modules are never
imported here.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ForeignKind", "foreign_kind", "foreign_note"]


class ForeignKind(Enum):
    """Which of torch's distributed-tensor objects a value is."""

    PLACEMENT = "placement"
    MESH = "DeviceMesh"
    DTENSOR = "DTensor"
    STYLE = "parallel style"


# What shardwise uses instead of each, and how to convert.
_INSTEAD = {
    ForeignKind.PLACEMENT: "use shardwise's (from shardwise import Shard, Replicate, Partial), or convert a list "
                           "with shardwise.interop.placements_from_torch(placements)",
    ForeignKind.MESH: "use shardwise.init_device_mesh, or convert with shardwise.interop.mesh_from_torch(mesh)",
    ForeignKind.DTENSOR: "convert it with shardwise.interop.from_torch(dtensor) (zero-copy), or a whole module's "
                         "with shardwise.interop.module_from_torch(module)",
    ForeignKind.STYLE: "use shardwise.parallel's style of the same name",
}
_TORCH_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor", "torch.distributed.device_mesh")


def foreign_kind(value: object) -> ForeignKind | None:
    """The kind of torch distributed-tensor object ``value`` is, or None (anything else)."""
    cls = value if isinstance(value, type) else type(value)
    module = getattr(cls, "__module__", "") or ""
    if not module.startswith(_TORCH_MODULES):
        return None
    if cls.__name__ == "DeviceMesh":
        return ForeignKind.MESH
    if any(base.__name__ == "Placement" for base in cls.__mro__):
        return ForeignKind.PLACEMENT
    if any(base.__name__ == "ParallelStyle" for base in cls.__mro__):
        return ForeignKind.STYLE
    if cls.__name__ == "DTensor":
        return ForeignKind.DTENSOR
    return None


def foreign_note(value: object) -> str | None:
    """``"torch.distributed.tensor's Shard(dim=0), not shardwise's: use ..."`` for torch's
    objects; None for anything else (the caller keeps its own message)."""
    kind = foreign_kind(value)
    if kind is None:
        return None
    cls = value if isinstance(value, type) else type(value)
    package = "torch.distributed.tensor.parallel" if kind is ForeignKind.STYLE else _package(cls.__module__)
    return f"{package}'s {_shown(value, cls, kind)}, not shardwise's: {_INSTEAD[kind]}"


def _shown(value: object, cls: type, kind: ForeignKind) -> str:
    if kind is ForeignKind.PLACEMENT:
        return f"placement {cls.__name__ if isinstance(value, type) else repr(value)}"
    return cls.__name__  # DeviceMesh, DTensor, ColwiseParallel...


def _package(module: str) -> str:
    """The public package a torch class is imported from (``torch.distributed.tensor``)."""
    return next(prefix for prefix in _TORCH_MODULES if module.startswith(prefix)).replace("._tensor", ".tensor")
