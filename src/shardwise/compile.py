"""torch.compile of DTensor programs: what Dynamo and AOTAutograd need from shardwise.

How a compiled DTensor program is built (the README's "Compiling" section has the user view):

1. Dynamo captures the Python program. A DTensor is a traceable wrapper subclass: it flattens
   to its block plus its ``DTensorSpec`` (``DTensor.__tensor_flatten__``), and guards compare
   specs (mesh by identity, placements, global shape and stride).
2. The layout conversions (``from_local``, ``to_local``, ``redistribute``, ``full_tensor``)
   are opaque to Dynamo (``opaque``): it records one call per conversion instead of tracing
   their Python, whose bookkeeping (noting blocks for later checks, building wrapper tensors)
   it could not capture. Meshes, placements and specs pass into them as constants
   (``register_constants``).
3. AOTAutograd then traces everything, conversions included, through ``__torch_dispatch__``
   on fake blocks: the dispatcher decides every layout at trace time, and ``comm`` issues
   functional collectives for fake blocks, so each collective is a graph node with its wait.
   The compiled graph runs on plain local tensors: no per-op dispatch remains.

Checks that need the data of several ranks (``from_local(run_check=True)``, the settling of
noted blocks, parallel styles' replicated-input check) run in eager only: under tracing there
is no data to compare. Run one step eagerly first to have them.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
import torch._dynamo
import torch.utils._pytree as pytree

from shardwise.mesh import DeviceMesh
from shardwise.placement import Partial, Placement, Replicate, Shard
from shardwise.spec import DTensorSpec, TensorMeta

__all__ = ["eager_only", "never_compiled", "opaque", "register_constants", "tracing", "pack", "unpack", "Packed"]

F = TypeVar("F", bound=Callable)


def tracing() -> bool:
    """Whether code runs under a tracer (Dynamo, or AOTAutograd's fake tensors), not on data."""
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def opaque(fn: F) -> F:
    """``fn`` as one call in a Dynamo graph, traced by AOTAutograd rather than by Dynamo."""
    return torch._dynamo.nonstrict_trace(fn)


# What crosses into an opaque call must be a tensor, a primitive, a container of those, or an
# object that existed before compilation (a registered constant). Placements and dtypes are
# often made inside the compiled code (``[Replicate()]`` in a hook), so they travel packed as
# primitives; an optional value travels as () or (value,), since None is refused.
Packed = tuple


def pack(value: Any) -> Packed:
    """Primitives for an optional placement (or sequence of placements and Nones), dtype, or
    registered constant."""
    if value is None:
        return ()
    if isinstance(value, torch.dtype):
        return ("dtype", str(value).removeprefix("torch."))
    if isinstance(value, Placement):
        return ("placement", _pack_placement(value))
    if isinstance(value, (tuple, list)) and all(p is None or isinstance(p, Placement) for p in value):
        return ("placements", tuple(_pack_placement(p) for p in value))
    return ("value", value)


def unpack(packed: Packed) -> Any:
    """The value ``pack`` packed (None for ())."""
    if not packed:
        return None
    kind, body = packed
    if kind == "dtype":
        return getattr(torch, body)
    if kind == "placement":
        return _unpack_placement(body)
    if kind == "placements":
        return tuple(_unpack_placement(p) for p in body)
    return body


def _pack_placement(p: Placement | None) -> tuple:
    if p is None:
        return ("none",)
    if p.is_shard():
        return ("shard", p.dim)
    if p.is_partial():
        return ("partial", p.reduce_op)
    return ("replicate",)


def _unpack_placement(packed: tuple) -> Placement | None:
    kind = packed[0]
    if kind == "none":
        return None
    if kind == "shard":
        return Shard(packed[1])
    if kind == "partial":
        return Partial(packed[1])
    return Replicate()


def eager_only(fn: F) -> F:
    """``fn`` always runs eagerly, never traced: a compiled module calls it between graphs.

    For hooks that manage memory and issue their own collectives at module boundaries
    (``fully_shard``, ``replicate``): the block's compute between them is one graph, as when
    torch compiles each block of an FSDP2 model."""
    return torch._dynamo.disable(fn, reason="shardwise data-parallel hook: runs eagerly at block boundaries")


def never_compiled(fn: F) -> F:
    """Dynamo never compiles ``fn``'s own frame (no wrapper, nothing on the call path).

    For the dispatcher: it runs below Dynamo (AOTAutograd traces it through
    ``__torch_dispatch__``), but eager code that a compiled program calls back into (hooks,
    autograd functions run between graphs) would otherwise have Dynamo compile and recompile
    its frames per op."""
    torch._dynamo.eval_frame.skip_code(fn.__code__)
    return fn


_REGISTERED = False


def register_constants() -> None:
    """Meshes, placements and specs are constants to a compiled program (hashable, compared
    with ``==``), so they may be passed to ``opaque`` functions."""
    global _REGISTERED
    if _REGISTERED:
        return
    for cls in (DeviceMesh, Shard, Replicate, Partial, DTensorSpec, TensorMeta):
        pytree.register_constant(cls)
    _REGISTERED = True


register_constants()
