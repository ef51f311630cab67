"""The op dispatcher: five steps for every ATen op on DTensors (docs/concepts.md, "Ordinary PyTorch code on DTensors").

1. intercept (``DTensor.__torch_dispatch__`` calls ``dispatch``);
2. unpack: DTensor arguments -> specs (the cache key) and local blocks (every walk over the
   arguments and results is ``shardwise.dispatch.walk``'s);
3. propagate: ``propagation.propagate`` picks input and output layouts (cached, bounded LRU);
4. redistribute the inputs that need it, run the op on the local blocks;
5. repack the local results as DTensors with the planned specs.

A cache hit does steps 2, 4 and 5 only: one pass over the arguments to build the key, a dict
lookup, the local op, and wrapping.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from shardwise.compile.opaque import never_compiled
from shardwise.dispatch import flags, registry, tensor_class, walk
from shardwise.dispatch.cache import PLANS, registry_version
from shardwise.dispatch.render import plain as _plain, render_call
from shardwise.dispatch.propagation import Action, OutputPlan, Returns, UnsupportedOp, propagate, with_layouts
from shardwise.dispatch.strategy import OpSchema
from shardwise.core.foreign import foreign_note
from shardwise.core.placement import Replicate
from shardwise.redistribute.cross_mesh import mesh_ranks
from shardwise.redistribute.execute import redistribute_local
from shardwise.core.spec import DTensorSpec, TensorMeta

__all__ = ["dispatch", "render_call", "clear_cache", "cache_info", "implicit_replication", "ImplicitScope", "CACHE_SIZE",
           "plan_call", "deciding"]

CACHE_SIZE = 4096  # bound on the dispatcher's entries in the propagation cache
_SIGN_ONLY = registry.SCALAR_SIGN_ONLY
_PER_POSITION: set = set()  # ops whose DTensors may sit on different meshes (allow_mixed_meshes)
_Tensor = torch.Tensor
_OpOverload = torch._ops.OpOverload
_inference_mode = torch.is_inference_mode_enabled
_flags = flags.FLAGS.get  # the per-context flags: part of every cache key
_cached = PLANS.get  # the lock-free read
_signature = walk.signature
_put = walk.put


def clear_cache() -> None:
    """Forget every cached propagation (registering a strategy does it by itself)."""
    PLANS.clear()


def cache_info() -> dict[str, int]:
    return {"size": len(PLANS), "max": CACHE_SIZE}


@dataclasses.dataclass(frozen=True)
class ImplicitScope:
    """Which plain tensors count as replicated: any in ``ops``; integer/bool ones anywhere if
    ``integer_tensors`` (labels, and masks computed from them)."""

    ops: frozenset = frozenset()
    integer_tensors: bool = False

    def allows(self, func, tensors: list) -> bool:
        if func in self.ops:
            return True
        return self.integer_tensors and not any(t.is_floating_point() or t.is_complex() for t in tensors)


class implicit_replication:
    """Context manager: plain tensors mixed with DTensors count as replicated on the mesh.

    Without it, mixing is an error (a plain tensor has no layout; assuming one silently is how
    results go wrong). 0-dim and one-element tensors are scalars and are always allowed (as
    replicated values), and so are autograd's zero gradients in backward. ``scope`` limits it
    (``loss_parallel`` uses one for plain labels); the setting is part of the dispatch cache
    key, so a decision made inside never leaks outside. It holds for the current context
    only (its thread or asyncio task, see ``shardwise.dispatch.flags``).
    """

    def __init__(self, scope: ImplicitScope | None = None) -> None:
        self._scope = scope
        self._tokens: list = []

    def __enter__(self) -> None:
        self._tokens.append(flags.push_implicit(self._scope))

    def __exit__(self, *exc) -> None:
        flags.pop(self._tokens.pop())


# ---------------------------------------------------------------------- hot path
@never_compiled
def dispatch(func, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on DTensors: see the module docstring."""
    DTensor = tensor_class.DTensor
    dtensors: list = []
    try:
        op = func._op  # an OpOverload's C++ handle: hashed in C (the overload's own hash is Python)
    except AttributeError:
        op = func
    key = (op, _signature(args, dtensors, DTensor, func, _SIGN_ONLY),
           _signature(kwargs.values(), dtensors, DTensor, func, _SIGN_ONLY) + tuple(kwargs) if kwargs else (),
           _flags())
    try:
        run = _cached(key)
    except TypeError:  # an unhashable argument: a symbolic size from torch.compile(dynamic=True)
        raise UnsupportedOp(f"{render_call(func, args, kwargs)}: {_SYMBOLIC}") from None
    if run is None:
        run = _decide(key, func, args, kwargs, dtensors)
    return run(func, args, kwargs, dtensors)


def _decide(key: tuple, func, args: tuple, kwargs: dict, dtensors: list) -> Callable:
    """The slow path: propagate, build the call's runner, cache it."""
    version = registry_version()
    _DECIDING[0] += 1
    try:
        plan = _with_slots(plan_call(func, args, kwargs, dtensors), func, args, kwargs, len(dtensors))
        run = _runner(func, plan, args, kwargs)
    finally:
        _DECIDING[0] -= 1
    PLANS.put(key, run, version, CACHE_SIZE)
    return run


_DECIDING = [0]


def deciding() -> bool:
    """Whether this thread is deciding a call's layouts (a cache miss): the meta tensors it runs
    the op on are scratch, not the program's memory (``shardwise.simulate.memory`` skips them,
    since whether a step misses the bounded cache depends on what ran before it)."""
    return _DECIDING[0] > 0


def _runner(func, plan: OutputPlan, args: tuple, kwargs: dict) -> Callable:
    """What a cache hit calls, ``run(func, args, kwargs, dtensors)``: specialized once per call
    signature, so the hot path does not re-examine the plan on every call."""
    if plan.action is Action.CUSTOM:
        if plan.specialize is not None:
            special = plan.specialize(func, args, kwargs)
            if special is not None:
                return special
        handler = plan.handler
        return lambda func, args, kwargs, dtensors: handler(func, args, kwargs)
    if plan.action is Action.DECOMPOSE:
        return functools.partial(_run_decomposition, plan.handler)
    if not plan.moves_inputs and plan.slots is not None and plan.slots.positional is not None and plan.returns in (Returns.WRAP, Returns.VIEW):
        return _local_runner(func, plan)
    return functools.partial(_run, plan)


def _run_decomposition(handler: Callable, func, args: tuple, kwargs: dict, dtensors: list) -> Any:
    # A decomposition: its ops dispatch again. Plain tensors inside it can only be built from
    # global metadata (factories over global shapes, scalars read from DTensors), so every rank
    # builds the same ones: they are replicated values, and are taken as such.
    with implicit_replication():  # a fresh context each time: decompositions nest
        return handler(*args, **kwargs)


def _single_tensor_output(func) -> bool:
    returns = func._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)


def _local_runner(func, plan: OutputPlan) -> Callable:
    """The common cases, as lean as a plain wrapper subclass: every DTensor a top-level
    positional argument, no communication, new tensors or a view out (``_run`` does the rest)."""
    call = func._op if type(func) is _OpOverload else func  # skips the overload's Python __call__
    wrap, positions, specs, rewrite = tensor_class.wrap_block, plan.slots.positional, plan.output_specs, plan.rewrite
    if rewrite is None and plan.returns is Returns.WRAP and _single_tensor_output(func) and specs and specs[0] is not None:
        spec = specs[0]
        if positions == (0,):
            def run(func, args: tuple, kwargs: dict, dtensors: list) -> Any:
                try:
                    out = call(dtensors[0]._local_tensor, *args[1:], **kwargs)
                except Exception as err:  # the op's own error on the blocks (a dim out of range, dtypes)
                    raise with_layouts(err, render_call(func, args, kwargs)) from None
                return wrap(out, spec)
        else:
            def run(func, args: tuple, kwargs: dict, dtensors: list) -> Any:
                local_args = list(args)
                for position, dt in zip(positions, dtensors):
                    local_args[position] = dt._local_tensor
                try:
                    out = call(*local_args, **kwargs)
                except Exception as err:
                    raise with_layouts(err, render_call(func, args, kwargs)) from None
                return wrap(out, spec)
        return run
    view = plan.returns is Returns.VIEW
    single = specs[0] if _single_tensor_output(func) and specs and specs[0] is not None else None

    def run_any(func, args: tuple, kwargs: dict, dtensors: list) -> Any:
        local_args = list(args)
        for position, dt in zip(positions, dtensors):
            local_args[position] = dt._local_tensor
        local_kwargs = kwargs
        if rewrite is not None:
            local_args, local_kwargs = rewrite(local_args, local_kwargs, specs)
        try:
            out = call(*local_args, **local_kwargs)
        except Exception as err:
            raise with_layouts(err, render_call(func, args, kwargs)) from None
        if view and _inference_mode() and not args[0].is_inference():
            return _repack_view(out, specs, args[0])
        return wrap(out, single) if single is not None else _repack(out, specs)

    return run_any


_SYMBOLIC = ("symbolic (dynamic) shapes reached the DTensor dispatcher, which decides layouts for "
             "concrete shapes: compile DTensor programs with torch.compile(..., dynamic=False), or mark no "
             "dimension dynamic")


def _with_slots(plan: OutputPlan, func, args: tuple, kwargs: dict, count: int) -> OutputPlan:
    """Record where the DTensors sit (``walk.Slots``, found once here so the hot path swaps
    blocks in without searching), and mark the plans of view ops (see ``_repack_view``)."""
    if plan.action is not Action.RUN:
        return plan
    if plan.returns in (Returns.WRAP, Returns.COPIED_VIEW) and _returns_view(func, args):
        view = Returns.VIEW_BITS if _may_conjugate(func, args[0], plan) else Returns.VIEW
        plan = dataclasses.replace(plan, returns=view if plan.returns is Returns.WRAP else Returns.COPIED_VIEW_OF)
    slots = walk.slots(args, kwargs, tensor_class.DTensor)
    if len(slots.paths) != count:  # the cache key's walk and pytree's disagree: a bug, never a wrong result
        raise RuntimeError(f"{render_call(func, args, kwargs)}: found {count} DTensors for the key but "
                           f"{len(slots.paths)} by pytree (see shardwise.dispatch.walk)")
    return dataclasses.replace(plan, slots=slots)


def _run(plan: OutputPlan, func, args: tuple, kwargs: dict, dtensors: list) -> Any:
    if plan.returns is Returns.SELF and getattr(args[0], "_copied_view", None):
        raise RuntimeError(
            f"{render_call(func, args, kwargs)}: in-place write into {args[0]._copied_view}, whose "
            "input had to be redistributed, so it is a copy and the write would not reach the base "
            "tensor. Redistribute the base so the view needs no communication, or assign the result."
        )
    if plan.moves_inputs:
        blocks = [
            dt._local_tensor if target is None else redistribute_local(dt._local_tensor, dt._spec, target)
            for dt, target in zip(dtensors, plan.input_specs)
        ]
    else:
        blocks = [dt._local_tensor for dt in dtensors]
    local_args, local_kwargs = _put(args, kwargs, plan.slots, blocks)
    if plan.rewrite is not None:
        local_args, local_kwargs = plan.rewrite(local_args, local_kwargs, plan.output_specs)
    try:
        out = func(*local_args, **local_kwargs)
    except Exception as err:  # the op's own error on the blocks (a dim out of range, dtypes)
        raise with_layouts(err, render_call(func, args, kwargs)) from None
    returns = plan.returns
    if returns is Returns.WRAP:
        return _repack(out, plan.output_specs)
    if returns is Returns.VIEW:
        return _repack_view(out, plan.output_specs, args[0])
    if returns is Returns.VIEW_BITS:
        return _with_bits(_repack_view(out, plan.output_specs, args[0]), out)
    if returns is Returns.COPIED_VIEW_OF:
        return _mark_copied(_with_bits(_repack_view(out, plan.output_specs, args[0]), out), func)
    if returns is Returns.COPIED_VIEW:
        return _mark_copied(_repack(out, plan.output_specs), func)
    if returns is Returns.SELF:
        return args[0]
    return kwargs["out"] if returns is Returns.OUT else None


def _returns_view(func, args: tuple) -> bool:
    """The op's output aliases its first argument, a DTensor (``t``, ``view``, ``select``...)."""
    returns = getattr(func, "_schema", None) and func._schema.returns
    alias = returns[0].alias_info if returns else None
    return alias is not None and not alias.is_write and bool(args) and isinstance(args[0], tensor_class.DTensor)


def _may_conjugate(func, base: Any, plan: OutputPlan) -> bool:
    """A view whose block may carry a lazy conjugate / negative bit: of or into complex numbers,
    or the negative view itself (see ``_with_bits``)."""
    complex_out = any(s is not None and s.tensor_meta.dtype.is_complex for s in plan.output_specs)
    return base.dtype.is_complex or complex_out or func is torch.ops.aten._neg_view.default


def _repack_view(out: Any, specs: tuple, base: Any) -> Any:
    """``_repack`` for a view op. Under ``torch.inference_mode()`` a view of a normal tensor is a
    normal tensor (torch then shares the base's version counter with it, which an inference
    tensor has not): the wrapper is made outside inference mode in that case."""
    if _inference_mode() and not base.is_inference():
        with torch.inference_mode(False):
            return _repack(out, specs)
    return _repack(out, specs)


def _with_bits(wrapped: Any, out: Any) -> Any:
    """A lazily conjugated or negated block (``_conj``, ``_neg_view`` and views of them) marks its
    wrapper alike, so torch resolves the bit before ops that read values (``view_as_real``)."""
    if isinstance(out, torch.Tensor) and (out.is_conj() or out.is_neg()):
        torch._C._set_conj(wrapped, out.is_conj())
        torch._C._set_neg(wrapped, out.is_neg())
    return wrapped


def _mark_copied(out: Any, func) -> Any:
    """Tag the outputs of a view that had to communicate (see ``_run``)."""
    for item in walk.leaves(out):
        if isinstance(item, tensor_class.DTensor):
            item._copied_view = f"the result of {func} (a view)"
    return out


def _repack(out: Any, specs: tuple) -> Any:
    """Wrap local results in DTensors with the planned specs (in leaf order)."""
    return walk.wrap_results(out, specs, tensor_class.wrap_block)


# ---------------------------------------------------------------------- slow path
def plan_call(func, args: tuple, kwargs: dict, dtensors: list) -> OutputPlan:
    """What the dispatcher will do for this call (uncached): ``shardwise.debug.explain`` shows it."""
    DTensor = tensor_class.DTensor
    describe = lambda: render_call(func, args, kwargs)  # noqa: E731
    if not dtensors:
        raise UnsupportedOp(f"{describe()}: no DTensor argument")
    meshes = list(dict.fromkeys(dt._spec.mesh for dt in dtensors))
    if len(meshes) > 1 and func in _PER_POSITION:  # each position is its own op, on its own mesh
        return OutputPlan(Action.CUSTOM, handler=registry.lookup(func).fn)
    if len(meshes) > 1:
        raise ValueError(f"{describe()}: {_mixed_meshes(dtensors, meshes)}")
    mesh = meshes[0]
    query = _METADATA_QUERIES.get(func)
    if query is not None:
        return OutputPlan(Action.CUSTOM, handler=lambda f, a, k: query(*a, **k))
    if _composite(func) and registry.lookup(func) is None:
        return OutputPlan(Action.CUSTOM, handler=_decompose)
    plain = _plain_data(func, args, kwargs)
    unplaced = [(w, t) for w, t in plain if not _scalar_like(t)]
    if unplaced and not _allowed(func, unplaced):
        return _StrictPlan(mesh)
    if unplaced:
        return _ImplicitPlan(mesh)
    if plain:  # one-element tensors only: they broadcast like tensors, so they take part as DTensors
        return _ImplicitPlan(mesh, scalars_only=True)
    schema = OpSchema(func, *walk.spec_tree(args, kwargs, DTensor), tuple(dt._spec for dt in dtensors))
    meta_args, meta_kwargs = walk.map_leaves(lambda v: _to_meta(v, DTensor), (tuple(args), kwargs))
    plan = propagate(func, schema, meta_args, meta_kwargs, describe)
    if plan.action is Action.RUN and mesh.get_coordinate() is None:
        return _absent_plan(plan, func)
    return plan


def _absent_plan(plan: OutputPlan, func) -> OutputPlan:
    """The plan of a rank outside the mesh: no collective, no local op, empty blocks out.

    Decided here, once per call signature (the mesh is part of the cache key), so the hot path
    never asks. The outputs have the planned global metadata and placements, as on the
    mesh's ranks; their blocks are empty (0-dim results hold a 0), as torch's are.
    """
    returns = func._schema.returns
    as_list = len(returns) == 1 and isinstance(returns[0].type, torch.ListType)

    def handler(func, args, kwargs):
        if plan.returns is Returns.SELF:
            return args[0]
        if plan.returns is Returns.OUT:
            return kwargs["out"]
        if plan.returns is Returns.NONE:
            return None
        device = walk.dtensors(args, kwargs, tensor_class.DTensor)[0]._local_tensor.device
        outs = [None if spec is None else tensor_class.DTensor(_empty_block(spec, device), spec, requires_grad=False)
                for spec in plan.output_specs]
        if as_list:
            return outs
        return outs[0] if len(returns) == 1 else tuple(outs)

    return OutputPlan(Action.CUSTOM, handler=handler)


def _empty_block(spec: DTensorSpec, device: torch.device) -> torch.Tensor:
    """What a rank outside the mesh holds for a tensor laid out as ``spec``."""
    if spec.ndim == 0:
        return torch.zeros((), dtype=spec.dtype, device=device)
    return torch.empty((0,) * spec.ndim, dtype=spec.dtype, device=device)


def allow_mixed_meshes(*ops: Any) -> None:
    """Let calls of ``ops`` take DTensors on different meshes: their custom handlers run each
    position as its own op (the ``_foreach_*`` family: gradients of a pipeline stage's and of
    another sub-mesh's parameters in one ``_foreach_norm``)."""
    _PER_POSITION.update(ops)


def _scalar_like(t: torch.Tensor) -> bool:
    """One value, replicated by construction: a one-element tensor or a broadcast scalar."""
    return t.numel() == 1 or _broadcast_scalar(t)


def _broadcast_scalar(t: torch.Tensor) -> bool:
    """A scalar expanded to a shape (every stride 0): one value, replicated like a 0-dim tensor.

    Composite ops build these (``quantile``'s ``q`` broadcast against its DTensor input)."""
    return t.numel() > 0 and all(s == 0 for s in t.stride())


def _mixed_meshes(dtensors: list, meshes: list) -> str:
    """Which DTensor is on which mesh, and a move that works (see ``DTensor.redistribute``)."""
    a = dtensors[0]
    b = next(dt for dt in dtensors if dt._spec.mesh != a._spec.mesh)
    where = (f"DTensors on different meshes: {a._spec.mesh.describe()} (a: {a._spec.render()}) and "
             f"{b._spec.mesh.describe()} (b: {b._spec.render()})")
    if all(mesh_ranks(m) == mesh_ranks(meshes[0]) for m in meshes):
        return (f"{where}. The meshes hold the same ranks: move one onto the other's mesh first, e.g. "
                "`b = b.redistribute(a.device_mesh, a.placements)` (a relabelling, plus a gather only where "
                "blocks must move between ranks)")
    return (f"{where}. The meshes hold different ranks, and an op needs its DTensors on one mesh: gather b on its "
            "ranks (full = b.full_tensor()) and lay it out on a's mesh with "
            "`distribute_tensor(full, a.device_mesh, a.placements, src_data_rank=None)`")


# Queries that read only shapes: answered from global metadata, whatever mixes with DTensors.
_METADATA_QUERIES = {
    torch.ops.aten.is_same_size.default: lambda a, b: a.shape == b.shape,
}


def _composite(func) -> bool:
    """Ops made of other ops (``linear``, ``matmul``, ``layer_norm``...). Autograd runs their
    parts and never shows them to a tensor subclass; under ``torch.inference_mode()`` they come
    whole."""
    return isinstance(func, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeImplicitAutograd")


def _decompose(func, args: tuple, kwargs: dict) -> Any:
    """Run a composite op as its parts, each dispatched on DTensors, as outside inference mode."""
    return func.decompose(*args, **kwargs)


def _plain_data(func, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """Plain tensors of 1+ dims that are data (not an op's plain index argument).

    0-dim ones are scalars and stay plain on the local blocks; one-element ones of 1+ dims are
    replicated values, as torch takes them; any other needs a layout (an error unless
    ``implicit_replication`` says otherwise)."""
    return [(w, t) for w, t in _plain_tensors(args, kwargs, tensor_class.DTensor) if not registry.is_plain_index(func, w, t)]


def _allowed(func, plain: list) -> bool:
    implicit = flags.implicit()
    return implicit is True or bool(implicit and implicit.allows(func, [t for _, t in plain]))


def _StrictPlan(mesh) -> OutputPlan:
    """Plain tensors with no layout: an error, except autograd's zero gradients in backward.

    Autograd builds those itself from global shapes (the gradient of an unused output of
    ``split``, of ``select_scatter``'s source...): they are zero everywhere, the same on every
    rank, so replicated by construction. The check runs per call (the plan is cached by
    metadata, and the same call outside backward, or with other values, is a user's mistake).
    """
    implicit = _ImplicitPlan(mesh).handler

    def handler(func, args, kwargs):
        plain = [(w, t) for w, t in _plain_data(func, args, kwargs) if not _scalar_like(t)]
        if torch._C._current_graph_task_id() != -1 and all(_zero_filled(t) for _, t in plain):
            return implicit(func, args, kwargs)
        where, tensor = plain[0]
        if foreign := foreign_note(tensor):
            raise ValueError(f"{render_call(func, args, kwargs)}: argument {where} is {foreign}")
        raise ValueError(
            f"{render_call(func, args, kwargs)}: argument {where} is a plain tensor {_plain(tensor)} mixed with "
            "DTensors. Make it a DTensor (distribute_tensor / DTensor.from_local), or use "
            "`with shardwise.implicit_replication():` to treat plain tensors as replicated"
        )

    return OutputPlan(Action.CUSTOM, handler=handler)


def _zero_filled(t: torch.Tensor) -> bool:
    return t.is_meta or t.numel() == 0 or not bool(t.any())


def _ImplicitPlan(mesh, scalars_only: bool = False) -> OutputPlan:
    """Re-dispatch with plain tensors wrapped as replicated DTensors (``scalars_only``: just the
    one-element data tensors, see ``_plain_data``)."""

    def handler(func, args, kwargs):
        if scalars_only:
            chosen = {id(t) for _, t in _plain_data(func, args, kwargs) if _scalar_like(t)}
            wrap = lambda v: _as_replicate(v, mesh) if id(v) in chosen else v  # noqa: E731
        else:
            wrap = lambda v: _as_replicate(v, mesh)  # noqa: E731
        plain = lambda v: isinstance(v, torch.Tensor) and not isinstance(v, tensor_class.DTensor) and v.ndim > 0  # noqa: E731
        new_args, new_kwargs = walk.map_leaves(lambda v: wrap(v) if plain(v) else v, (tuple(args), kwargs))
        return func(*new_args, **new_kwargs)

    return OutputPlan(Action.CUSTOM, handler=handler)


def _as_replicate(t: torch.Tensor, mesh) -> Any:
    DTensor = tensor_class.DTensor
    spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, TensorMeta.of(t))
    return DTensor(t, spec, requires_grad=False)


def _plain_tensors(args: tuple, kwargs: dict, DTensor: type) -> list[tuple[str, torch.Tensor]]:
    """Non-scalar plain tensors in the call, with where they are (``#1``, ``#2[0]``, ``weight``)."""
    return [(w, v) for w, v in walk.labelled(args, kwargs)
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.ndim > 0]


def _to_meta(value: Any, DTensor: type) -> Any:
    """A leaf for the meta run of propagation: tensors become meta tensors of the global shapes."""
    if isinstance(value, DTensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    return value
