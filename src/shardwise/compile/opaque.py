"""torch.compile of DTensor programs: what Dynamo and AOTAutograd need from shardwise.

How a compiled DTensor program is built (docs/parallelism.md, "Compiling: torch.compile", has the user view):

1. Dynamo captures the Python program. A DTensor is a traceable wrapper subclass: it flattens
   to its block plus its ``DTensorSpec`` (``DTensor.__tensor_flatten__``), and guards compare
   specs (mesh by identity, placements, global shape and stride).
2. The layout conversions (``from_local``, ``to_local``, ``redistribute``, ``full_tensor``)
   are opaque to Dynamo (``opaque``): it records one call per conversion instead of tracing
   their Python, whose bookkeeping (noting blocks for later checks, building wrapper tensors)
   it could not capture. Placements and specs pass into them as constants; a mesh is an
   opaque reference (as torch's DeviceMesh): a graph input guarded by identity, which may
   also be passed to a DTensor method that Dynamo records as a call (``.redistribute(mesh,
   ...)``). While AOTAutograd traces, a mesh arrives wrapped in a fake script object, which
   the marked conversions unwrap (``real``) before any shardwise code sees it
   (``register_constants``).
3. AOTAutograd then traces everything, conversions included, through ``__torch_dispatch__``
   on fake blocks: the dispatcher decides every layout at trace time, and ``comm`` issues
   functional collectives for fake blocks, so each collective is a graph node with its wait.
   The compiled graph runs on plain local tensors: no per-op dispatch remains.

Checks that need the data of several ranks (``from_local(run_check=True)``, the settling of
noted blocks, parallel styles' replicated-input check) run in eager only: under tracing there
is no data to compare. Run one step eagerly first to have them.

The Dynamo markings are applied lazily: ``import shardwise`` does not import torch._dynamo
(about half of its import time, and plain ``import torch`` does not pay it). The decorators
below record what they mark; the first import of torch._dynamo (by ``torch.compile``, or
anything else) applies the markings right after Dynamo's package has loaded, before it can
trace any frame (``_DynamoImportHook``). If torch._dynamo is already loaded when shardwise is
imported, the decorators mark at once.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from types import CodeType, ModuleType
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.utils._pytree as pytree
from torch._library.fake_class_registry import FakeScriptObject

from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Partial, Placement, Replicate, Shard
from shardwise.core.spec import DTensorSpec, TensorMeta

__all__ = ["eager_only", "never_compiled", "opaque", "register_constants", "tracing", "pack", "unpack", "Packed"]

F = TypeVar("F", bound=Callable)


def tracing() -> bool:
    """Whether code runs under a tracer (Dynamo, or AOTAutograd's fake tensors), not on data."""
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def opaque(fn: F) -> F:
    """``fn`` as one call in a Dynamo graph, traced by AOTAutograd rather than by Dynamo.

    ``fn`` must be a module-level function, called through its module's global name: the
    Dynamo-marked callable (``torch._dynamo.nonstrict_trace``) replaces that global once
    torch._dynamo loads. Until then no frame can be compiled, and eager calls go straight
    to ``fn``."""
    if fn.__qualname__ != fn.__name__:
        raise TypeError(f"opaque({fn.__qualname__}): only a module-level function can be marked opaque "
                        "(its module's global name is rebound to the Dynamo-marked function)")
    if _LAZY.ready:
        return _nonstrict(fn)
    _LAZY.opaque.append(fn)
    return fn


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
    return real(body)


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


_EAGER_ONLY_REASON = "shardwise data-parallel hook: runs eagerly at block boundaries"


def eager_only(fn: F) -> F:
    """``fn`` always runs eagerly, never traced: a compiled module calls it between graphs.

    For hooks that manage memory and issue their own collectives at module boundaries
    (``fully_shard``, ``replicate``): the block's compute between them is one graph, as when
    torch compiles each block of an FSDP2 model.

    Before torch._dynamo loads, a thin forwarder to ``fn`` (hooks may be registered, as bound
    methods, before the program is compiled); when it loads, the forwarder calls
    ``torch._dynamo.disable(fn)`` instead and carries its marks, so Dynamo treats the
    forwarder exactly as the disabled function."""
    if _LAZY.ready:
        return _disabled(fn)
    impl: list[Callable] = [fn]

    @functools.wraps(fn)
    def eager(*args: Any, **kwargs: Any) -> Any:
        return impl[0](*args, **kwargs)

    _LAZY.eager_only.append((eager, impl))
    return eager  # type: ignore[return-value]


def never_compiled(fn: F) -> F:
    """Dynamo never compiles ``fn``'s frame nor the frames it calls (no wrapper, nothing on
    the call path).

    For the dispatcher: it runs below Dynamo (AOTAutograd traces it through
    ``__torch_dispatch__``), but eager code that a compiled program calls back into (hooks,
    autograd functions run between graphs) would otherwise have Dynamo compile and recompile
    its frames, and the op handlers they call, per op; and Dynamo may not read a mesh's
    internals (an opaque reference), which the handlers do."""
    if _LAZY.ready:
        _skip(fn.__code__)
    else:
        _LAZY.skipped.append(fn.__code__)
    return fn


# ---------------------------------------------------------------------- lazy Dynamo markings
def _nonstrict(fn: Callable) -> Callable:
    import torch._dynamo

    @functools.wraps(fn)
    def with_real_meshes(*args: Any, **kwargs: Any) -> Any:
        return fn(*map(real, args), **kwargs)

    return torch._dynamo.nonstrict_trace(with_real_meshes)


def _disabled(fn: Callable) -> Callable:
    import torch._dynamo

    return torch._dynamo.disable(fn, reason=_EAGER_ONLY_REASON)


def _skip(code: CodeType) -> None:
    """Dynamo neither compiles ``code``'s frames nor any frame they call (recursive skip)."""
    import torch._dynamo.eval_frame
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    torch._dynamo.eval_frame.set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


# What ``torch._dynamo.disable`` sets on its wrapper, and Dynamo reads to skip a callable.
_DISABLE_MARKS: Sequence[str] = ("_torchdynamo_disable", "_torchdynamo_disable_msg",
                                 "_torchdynamo_orig_callable", "_torchdynamo_disable_recursive")


class _Pending:
    """The markings recorded before torch._dynamo loaded, and whether it has."""

    def __init__(self) -> None:
        self.ready = "torch._dynamo" in sys.modules
        self.opaque: list[Callable] = []
        self.skipped: list[CodeType] = []
        self.eager_only: list[tuple[Callable, list[Callable]]] = []

    def apply(self) -> None:
        """Mark everything recorded (once torch._dynamo's package has loaded)."""
        self.ready = True
        for code in self.skipped:
            _skip(code)
        for fn in self.opaque:
            module = sys.modules[fn.__module__]
            if getattr(module, fn.__name__, None) is not fn:
                raise RuntimeError(f"opaque({fn.__module__}.{fn.__name__}): its module's global no longer "
                                   "names it, so the Dynamo-marked function cannot replace it")
            setattr(module, fn.__name__, _nonstrict(fn))
        for eager, impl in self.eager_only:
            disabled = _disabled(impl[0])
            for mark in _DISABLE_MARKS:
                setattr(eager, mark, getattr(disabled, mark))
            eager._torchdynamo_wrapper_id = id(eager)  # type: ignore[attr-defined]
            impl[0] = disabled
        if self.eager_only:  # the forwarder's own frame, run between graphs, is not compiled either
            _skip(self.eager_only[0][0].__code__)
        self.opaque, self.skipped, self.eager_only = [], [], []


_LAZY = _Pending()


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Applies the recorded markings right after torch._dynamo's package executes: before
    any ``torch.compile`` can trace a frame, whoever imports it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_then_mark(module: ModuleType) -> None:
            execute(module)
            _LAZY.apply()

        spec.loader.exec_module = exec_then_mark  # type: ignore[method-assign]
        return spec


if not _LAZY.ready:
    sys.meta_path.insert(0, _DynamoImportHook())


_REGISTERED = False

# What compiled code may read of a mesh: evaluated on the real mesh while tracing, the result
# a constant of the graph.
_MESH_MEMBERS: Sequence[str] = (
    "device_type", "mesh_dim_names", "ndim", "shape", "size", "get_coordinate", "get_local_rank",
    "get_rank", "axis_name", "__eq__", "__ne__", "__hash__",
)


def register_constants() -> None:
    """How compiled programs hold shardwise's objects.

    Placements and specs are constants (hashable, compared with ``==``), so they may be passed
    to ``opaque`` functions. A mesh is an opaque reference (as torch's own DeviceMesh): Dynamo
    passes the object itself into graph calls, such as a ``DTensor.redistribute(mesh, ...)``
    method call, guarded by identity; while AOTAutograd traces, it arrives wrapped in a fake
    script object, which ``real`` unwraps."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch._library.opaque_object import MemberType, register_opaque_type

    for cls in (Shard, Replicate, Partial, DTensorSpec, TensorMeta):
        pytree.register_constant(cls)
    register_opaque_type(DeviceMesh, typ="reference",
                         members={name: MemberType.USE_REAL for name in _MESH_MEMBERS})
    _REGISTERED = True


def real(value: Any) -> Any:
    """``value``, or the mesh a tracer's fake script object stands for."""
    return value.real_obj if type(value) is FakeScriptObject else value


register_constants()
