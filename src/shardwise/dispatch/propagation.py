"""Sharding propagation: from an op and its input specs to target input and output specs.

Runs once per distinct (op, input specs, non-tensor arguments); the dispatcher caches the
result. Output metadata (global shapes, dtypes) comes from running the op on meta tensors of the
global shapes, so no strategy has to restate an op's shape semantics.

In-place ops: a DTensor an op writes keeps its placements. Candidates that keep them win; if
none does and the op writes only ``self``, it runs in the cheapest other layout (counting the
way back) and the result is written back into self's own block (``_write_back``); otherwise
(``out=``) it is an error, as in torch.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardwise.dispatch import flags, registry, tensor_class, walk
from shardwise.dispatch.cache import bump_registry_version
from shardwise.dispatch.flags import fallback_enabled
from shardwise.dispatch.strategy import (
    Candidate, OpSchema, choose, count_specs, expand, input_cost, partial_axes, pending_reduction, replicate_all,
)
from shardwise.dispatch.render import render_call
from shardwise.core.spec import DTensorSpec, TensorMeta
from shardwise.redistribute.execute import redistribute_local

__all__ = [
    "Action", "Returns", "OutputPlan", "propagate", "UnsupportedOp", "fallback_enabled", "allow_replicate_fallback",
    "is_meta_limitation", "with_layouts", "keeps_mutated",
]


class Action(enum.Enum):
    """What the dispatcher does for a call: see ``OutputPlan``."""

    RUN = "run"
    CUSTOM = "custom"
    DECOMPOSE = "decompose"


class Returns(enum.Enum):
    """What a RUN call returns (``_returns`` and the dispatcher's ``_with_positions`` pick it)."""

    WRAP = "wrap"  # new DTensors wrapping the local results
    VIEW = "view"  # a view of the first argument (made outside inference mode if it is not an inference tensor)
    VIEW_BITS = "view_bits"  # a view that may carry a lazy conjugate / negative bit
    COPIED_VIEW = "copied_view"  # a view op that had to move its input: a copy, marked so writes fail loudly
    COPIED_VIEW_OF = "copied_view_of"  # the same for a view of a DTensor argument
    SELF = "self"  # the mutated first argument (in place)
    OUT = "out"  # the out= argument
    NONE = "none"  # nothing (an in-place op returning no tensor)


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """What the dispatcher does for one call signature.

    ``action`` is RUN (redistribute inputs to ``input_specs``, run locally, wrap outputs with
    ``output_specs``), CUSTOM (call ``handler``) or DECOMPOSE (call ``handler``, a
    decomposition that re-enters dispatch).
    """

    action: Action
    input_specs: tuple[DTensorSpec | None, ...] = ()
    output_specs: tuple[DTensorSpec | None, ...] = ()
    rewrite: Callable | None = None
    handler: Callable | None = None
    # CUSTOM only: the handler's per-signature specialization (registry.register_custom_handler).
    specialize: Callable | None = None
    returns: Returns = Returns.WRAP
    moves_inputs: bool = False
    # Where the DTensors sit in the call (set by the dispatcher once per call signature): lets
    # the hot path swap blocks in without searching the arguments.
    slots: walk.Slots | None = None


class UnsupportedOp(NotImplementedError):
    """No sharding support for an op (the message says how to add it)."""


_WARNED: set = set()


class allow_replicate_fallback:
    """Context manager (or ``allow_replicate_fallback.set(True)``): gather the inputs of ops
    without sharding support and run them replicated, warning once per op. Off by default:
    silently gathering a large tensor is how distributed programs run out of memory.

    The context manager changes the current context only (its thread or task, see
    ``shardwise.dispatch.flags``); ``set`` changes the process-wide default that contexts
    without their own setting follow."""

    def __init__(self) -> None:
        self._tokens: list = []

    def __enter__(self) -> None:
        self._tokens.append(flags.push(fallback=True))

    def __exit__(self, *exc) -> None:
        flags.pop(self._tokens.pop())

    @staticmethod
    def set(enabled: bool) -> None:
        if flags.set_fallback_default(enabled):
            bump_registry_version()  # decisions made under the old default are keyed alike


def propagate(op: Any, schema: OpSchema, meta_args: tuple, meta_kwargs: dict, describe: Callable[[], str]) -> OutputPlan:
    """Decide the layouts for one call (see the module docstring for the priority order).

    A user's own mistake (shapes that do not fit, a dim out of range) surfaces as the op's own
    error, as torch raises it on one device, with the layouts appended: the op runs on meta
    tensors of the GLOBAL shapes, the same on every rank, so every rank raises it, before any
    collective. ``UnsupportedOp`` means only that a sharding rule is missing.
    """
    try:
        return _propagate(op, schema, meta_args, meta_kwargs, describe)
    except Exception:
        # A rule or a layout predicate may trip over inputs the op itself rejects: then say
        # what the op says (the error path only; a second meta run costs nothing here).
        _raise_if_op_rejects(op, meta_args, meta_kwargs, describe)
        raise


def _propagate(op: Any, schema: OpSchema, meta_args: tuple, meta_kwargs: dict, describe: Callable[[], str]) -> OutputPlan:
    special = registry.layout_handler(op, schema)
    if special is not None:
        return OutputPlan(Action.CUSTOM, handler=special)
    registration = registry.lookup(op)
    if registration is not None and registration.kind is registry.Kind.CUSTOM:
        return OutputPlan(Action.CUSTOM, handler=registration.fn, specialize=registration.specialize)
    if registration is None:
        decomposition = _decomposition(op)
        if decomposition is not None:
            return OutputPlan(Action.DECOMPOSE, handler=decomposition)
        if not fallback_enabled():
            _raise_if_op_rejects(op, meta_args, meta_kwargs, describe)
            raise UnsupportedOp(_unsupported_message(op, describe()))
    outputs = _meta_outputs(op, meta_args, meta_kwargs, describe)
    if registration is None:
        _warn_fallback(op, describe())
        candidate = replicate_all(schema, len(outputs))
        write_back = not keeps_mutated(op, schema, candidate)
        if write_back and not _mutates_self_only(op, schema):
            raise UnsupportedOp(f"{describe()}: the replicate fallback cannot write into "
                                f"{_mutated_layouts(op, schema)} in place; use the out-of-place op")
    else:
        candidate, write_back = _candidate(op, schema, registration, len(outputs), describe, outputs)
    plan = _plan(schema, candidate, outputs)
    return OutputPlan(Action.CUSTOM, handler=_write_back(plan)) if write_back else plan


def registered_candidates(schema: OpSchema, registration, num_outputs: int) -> list[Candidate]:
    """Every candidate layout the op's registration lists with valid outputs (per-axis
    strategies are expanded over the mesh); ``_candidate`` chooses among them, and
    ``shardwise.debug.explain`` shows the rejected ones."""
    if registration.per_axis:
        candidates = expand(registration.fn(schema), num_outputs, schema.mesh.ndim)
    else:
        candidates = registration.fn(schema)
    return [c for c in candidates if c is not None and _valid_outputs(c)]


def _candidate(op: Any, schema: OpSchema, registration, num_outputs: int, describe,
               outputs: list = ()) -> tuple[Candidate, bool]:
    """The chosen layout, and whether the mutated ``self`` must be written back into its own
    layout after the op ran in another one (see ``_write_back``)."""
    candidates = registered_candidates(schema, registration, num_outputs)
    # Look ahead past the op (strategy.pending_reduction), except for views: a view that
    # moves its input is a copy, so a Partial passes through views as it is.
    owed = partial_axes(schema.specs) if outputs and schema.specs and not _is_view(op) else ()
    extra = (lambda c: pending_reduction(c, outputs, schema.mesh.shape, owed)) if any(owed) else None
    best = choose(schema, [c for c in candidates if keeps_mutated(op, schema, c)], extra=extra)
    if best is not None:
        return best, False
    if _mutates_self_only(op, schema):
        # In place, but no layout keeps self's: run it in the cheapest layout (the way back
        # into self's layout counted too), then write the result into self's own block.
        best = choose(schema, [c for c in candidates if c.outputs and c.outputs[0] is not None],
                      extra=lambda c: _write_back_cost(schema, c))
        if best is not None:
            return best, True
    if fallback_enabled() and not _mutated_inputs(op):
        _warn_fallback(op, describe())
        return replicate_all(schema, num_outputs), False
    if _mutated_inputs(op):
        raise UnsupportedOp(
            f"{describe()}: an in-place operation that would change the layout of the tensor it writes "
            f"({_mutated_layouts(op, schema)}); no layout of the inputs keeps it. Use the out-of-place op "
            "and assign the result"
        )
    raise UnsupportedOp(f"{describe()}: no layout of the inputs supports this op")


def _mutates_self_only(op: Any, schema: OpSchema) -> bool:
    """An in-place op proper: it writes its first argument (a DTensor), nothing else, and returns it."""
    return (_mutated_inputs(op) == [op._schema.arguments[0].name] and bool(schema.args)
            and isinstance(schema.args[0], DTensorSpec) and _returns(schema, False) is Returns.SELF)


def _mutated_layouts(op: Any, schema: OpSchema) -> str:
    specs = [schema.specs[i] for i in _mutated_spec_indices(op, schema, _mutated_inputs(op))]
    return ", ".join(s.render() for s in specs) or "a plain tensor"


def _write_back_cost(schema: OpSchema, candidate: Candidate) -> float:
    """Predicted seconds to bring the op's result (self's output layout) back into self's layout."""
    spec = schema.specs[0]
    return input_cost(spec.with_placements(candidate.outputs[0]), spec.placements)


def _write_back(plan: OutputPlan) -> Callable:
    """Run an in-place op whose ``self`` had to change layout, and keep ``self``'s layout.

    The op runs on the redistributed blocks; its result (laid out as the plan's first output)
    is redistributed back to self's layout and copied into self's own block, so self keeps
    its placements and its storage (views of it see the write).
    """
    def handler(func: Any, args: tuple, kwargs: dict) -> Any:
        if getattr(args[0], "_copied_view", None):
            raise RuntimeError(
                f"{render_call(func, args, kwargs)}: in-place write into {args[0]._copied_view}, "
                "whose input had to be redistributed, so it is a copy and the write would not reach the base tensor"
            )
        where = walk.slots(args, kwargs, tensor_class.DTensor)
        dtensors = [walk.at(args, kwargs, path) for path in where.paths]
        blocks = [
            dt._local_tensor if target is None else redistribute_local(dt._local_tensor, dt._spec, target)
            for dt, target in zip(dtensors, plan.input_specs)
        ]
        local_args, local_kwargs = walk.put(args, kwargs, where, blocks)
        if plan.rewrite is not None:
            local_args, local_kwargs = plan.rewrite(local_args, local_kwargs, plan.output_specs)
        try:
            result = func(*local_args, **local_kwargs)
        except Exception as err:
            raise with_layouts(err, render_call(func, args, kwargs)) from None
        target = args[0]
        back = redistribute_local(result, plan.output_specs[0], target._spec)
        if back is not target._local_tensor:
            target._local_tensor.copy_(back)
        return target

    return handler


def _plan(schema: OpSchema, candidate: Candidate, outputs: list) -> OutputPlan:
    inputs = tuple(
        None if target is None or target == spec.placements else spec.with_placements(target)
        for spec, target in zip(schema.specs, candidate.inputs)
    )
    mesh = schema.mesh
    specs = []
    for meta, placements in zip(outputs, candidate.outputs):
        if isinstance(meta, torch.Tensor) and placements is not None:
            specs.append(DTensorSpec(mesh, placements, TensorMeta(meta.shape, tuple(meta.stride()), meta.dtype)))
        else:
            specs.append(None)
    moves = any(s is not None for s in inputs)
    return OutputPlan(Action.RUN, inputs, tuple(specs), candidate.rewrite, returns=_returns(schema, moves), moves_inputs=moves)


def _returns(schema: OpSchema, moves: bool) -> Returns:
    """What a call returns: new tensors, or the very argument it mutated (in place / out=).

    COPIED_VIEW: a view op that had to move its input returns a copy, not a view; the
    dispatcher marks it so an in-place write through it fails loudly instead of being lost.
    """
    returns = schema.op._schema.returns
    if moves and returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
        return Returns.COPIED_VIEW
    if any(name == "out" for name, _ in schema.kwargs):
        return Returns.OUT
    arguments = schema.op._schema.arguments
    if arguments and arguments[0].alias_info is not None and arguments[0].alias_info.is_write:
        if not schema.op._schema.returns:
            return Returns.NONE
        if isinstance(schema.args[0], DTensorSpec):
            return Returns.SELF
    return Returns.WRAP


def _is_view(op: Any) -> bool:
    """Whether the op returns an alias of an input (a view), not new data."""
    returns = op._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


# ---------------------------------------------------------------------- mutation
def _mutated_inputs(op: Any) -> list[str]:
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def keeps_mutated(op: Any, schema: OpSchema, candidate: Candidate) -> bool:
    """A mutated DTensor keeps its layout: its input target and its output equal its placements."""
    names = _mutated_inputs(op)
    if not names:
        return True
    mutated = _mutated_spec_indices(op, schema, names)
    for i in mutated:
        current = schema.specs[i].placements
        if candidate.inputs[i] not in (None, current):
            return False
    # In-place ops return self first; out= ops return the out tensors in order.
    for out_index, i in enumerate(mutated[: len(candidate.outputs)]):
        if candidate.outputs[out_index] not in (None, schema.specs[i].placements):
            return False
    return True


def _valid_outputs(candidate: Candidate) -> bool:
    """Output layouts must be layouts: no mix of pending reduction kinds (per-axis expansion can make one)."""
    for placements in candidate.outputs:
        if placements is not None and len({p.reduce_op for p in placements if p.is_partial()}) > 1:
            return False
    return True


def _mutated_spec_indices(op: Any, schema: OpSchema, names: list[str]) -> list[int]:
    """Positions in ``schema.specs`` of the DTensors passed for the mutated arguments."""
    positions, index = [], 0
    kwargs = dict(schema.kwargs)
    for pos, argument in enumerate(op._schema.arguments):
        value = schema.args[pos] if pos < len(schema.args) and not argument.kwarg_only else kwargs.get(argument.name)
        count = count_specs(value)
        if argument.name in names:
            positions += range(index, index + count)
        index += count
    return positions


# ---------------------------------------------------------------------- metadata
def _meta_outputs(op: Any, meta_args: tuple, meta_kwargs: dict, describe) -> list:
    """The op's outputs, flattened, computed on meta tensors of the global shapes."""
    try:
        out = _run_meta(op, meta_args, meta_kwargs)
    except Exception as err:
        if not is_meta_limitation(err):
            raise with_layouts(err, describe()) from None
        if not any(r.type.kind().startswith("Tensor") or "Tensor" in str(r.type) for r in op._schema.returns):
            return [None] * len(op._schema.returns)
        raise UnsupportedOp(f"{describe()}: cannot compute output shapes on meta tensors ({err})") from None
    return flatten_outputs(out)


def _run_meta(op: Any, meta_args: tuple, meta_kwargs: dict) -> Any:
    if "device" in meta_kwargs:  # _to_copy / new_* with device=cpu would leave meta
        meta_kwargs = {**meta_kwargs, "device": torch.device("meta")}
    return op(*meta_args, **meta_kwargs)


def _raise_if_op_rejects(op: Any, meta_args: tuple, meta_kwargs: dict, describe) -> None:
    """Raise the op's own error if it rejects these (global) inputs; otherwise return."""
    try:
        _run_meta(op, meta_args, meta_kwargs)
    except Exception as err:
        if not is_meta_limitation(err):
            raise with_layouts(err, describe()) from None


def is_meta_limitation(err: BaseException) -> bool:
    """True if ``err`` says the op cannot run on meta tensors, not that its inputs are wrong.

    Ops without a meta kernel raise NotImplementedError; data-dependent ones (``item``,
    ``repeat_interleave`` without output_size) a RuntimeError that names meta tensors.
    """
    return isinstance(err, NotImplementedError) or "meta" in str(err).lower()


def with_layouts(err: BaseException, call: str) -> BaseException:
    """``err`` itself (same type, so callers catch it as on one device) with the call's layouts
    appended to its message: ``...\non DTensors: aten.mm(f32[4@tp,5], f32[4,3]) on mesh(tp=2)``."""
    line = f"on DTensors: {call}"
    if err.args and isinstance(err.args[0], str) and not isinstance(err, KeyError):
        if line not in err.args[0]:
            err.args = (f"{err.args[0]}\n{line}",) + err.args[1:]
    elif hasattr(err, "add_note"):
        err.add_note(line)
    return err


def flatten_outputs(out: Any) -> list:
    """An op's result as a flat list: its leaves (``walk.leaves``), in the order of output specs."""
    return walk.leaves(out)


def _decomposition(op: Any) -> Callable | None:
    """torch's decomposition of ``op``, else its composite (CompositeImplicitAutograd) kernel.

    Composite ops (``flatten.using_ints``, ``quantile``, ``cross`` ...) are normally expanded
    above the dispatcher, but reach it when called from inside another decomposition.
    """
    from torch._decomp import decomposition_table

    found = decomposition_table.get(op)
    if found is None and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return op.decompose
    return found


def _warn_fallback(op: Any, call: str) -> None:
    if op not in _WARNED:
        _WARNED.add(op)
        warnings.warn(f"shardwise: replicating every input of {call} (no sharding support for {op})", stacklevel=4)


# torch.distributed's collectives as ATen ops (dist.all_reduce is c10d.allreduce_).
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _unsupported_message(op: Any, call: str) -> str:
    if getattr(op, "namespace", None) in _COLLECTIVE_NAMESPACES:
        return (
            f"Operator {op} does not have a sharding strategy registered: a torch.distributed collective was "
            f"called on a DTensor ({call.split('(')[0]}). A DTensor is one "
            "logical tensor whose layout implies its communication. Change the layout instead "
            "(dtensor.redistribute(mesh, [Replicate()]) sums a Partial DTensor; dtensor.full_tensor() gives the "
            "whole value), or call the collective on dtensor.to_local() to communicate this rank's block"
        )
    return (
        f"Operator {op} does not have a sharding strategy registered. shardwise has no sharding support for "
        f"{call}. Register one with "
        f"@shardwise.register_sharding({op}) (per-axis placements), or run it replicated with "
        "`with shardwise.allow_replicate_fallback():`"
    )
