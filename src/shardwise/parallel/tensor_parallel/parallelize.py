"""parallelize_module: apply a plan of parallel styles to a module tree from outside.

The plan maps module paths to styles. A path is matched part by part with shell-style
wildcards, so ``"layers.*.attention.wq"`` names the query projection of every block. The whole
plan is resolved and checked before anything is distributed: a module matched by two keys or a
style that cannot apply raises one error naming the key, the module and the reason, on every
rank, before any collective; a key that matches no module warns, as torch's does, and the rest
of the plan applies. A ColwiseParallel or
RowwiseParallel split that would give a rank part of an attention head is refused then too
(``heads.py``).
"""

from __future__ import annotations

import warnings
from fnmatch import fnmatchcase

from torch import nn

from shardwise.tensor.factories import default_mesh
from shardwise.core.foreign import foreign_note
from shardwise.core.mesh import DeviceMesh, check_mesh
from shardwise.parallel.tensor_parallel.heads import check_head_alignment, check_head_groups
from shardwise.parallel.tensor_parallel.style import ParallelStyle, describe_module

__all__ = ["parallelize_module"]

Plan = ParallelStyle | dict[str, ParallelStyle]


def _matches(pattern: str, path: str) -> bool:
    parts, names = pattern.split("."), path.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for n, p in zip(names, parts))


def resolve_plan(module: nn.Module, plan: dict[str, ParallelStyle]) -> list[tuple[str, str, nn.Module, ParallelStyle]]:
    """(key, module path, module, style) for every module the plan names, in plan order."""
    modules = dict(module.named_modules())
    resolved, owner, unmatched = [], {}, []
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            got = foreign_note(style) or f"{style!r}, not a ParallelStyle"
            raise TypeError(f"parallelize_module: plan[{key!r}] is {got}")
        hits = [path for path in modules if path and _matches(key, path)] if key else [""]
        if not hits:
            unmatched.append(key)
        for path in hits:
            if path in owner:
                raise ValueError(
                    f"parallelize_module: module {path!r} is matched by plan keys {owner[path]!r} and {key!r}; "
                    "give each module one style"
                )
            owner[path] = key
            resolved.append((key, path, modules[path], style))
    for key in unmatched:
        _warn_unmatched(key, modules)
    return resolved


def _warn_unmatched(key: str, modules: dict[str, nn.Module]) -> None:
    """torch's warning for a plan key that names no module (its wording first, so filters written
    for torch's match), naming the first part of the key that matched nothing."""
    parts, parent = key.split("."), ""
    for depth in range(len(parts)):
        below = [p for p in modules if p and _matches(".".join(parts[:depth + 1]), p)]
        if not below:
            break
        parent = below[0]
    token, where = parts[depth], modules[parent]
    children = ", ".join(name for name, _ in where.named_children()) or "none"
    warnings.warn(f"Parallelize plan key {key!r} could not be resolved: no submodule matching token {token!r} in "
                  f"module {type(where).__name__} (shardwise: its children are {children}); the rest of the "
                  "plan is applied", UserWarning, stacklevel=4)


def _check_attention_groups(resolved: list, modules: dict[str, nn.Module], mesh: DeviceMesh) -> None:
    """Query and key/value projections of one attention module keep their heads together."""
    by_parent: dict[str, list] = {}
    for _, path, target, style in resolved:
        if path:
            parent_path = path.rpartition(".")[0]
            by_parent.setdefault(parent_path, []).append((path, style, target, modules[parent_path]))
    for parent_path, projections in by_parent.items():
        try:
            check_head_groups(projections, mesh)
        except ValueError as err:
            where = f"module {parent_path!r}" if parent_path else "the root module"
            raise ValueError(f"parallelize_module: the plan splits the attention heads of {where} apart: {err}") from None


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: Plan | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Apply ``parallelize_plan`` to ``module`` (in place) on the 1-D ``device_mesh``.

    Args:
        module: any nn.Module tree, including models shardwise did not define.
        device_mesh: the tensor-parallel mesh (e.g. ``world_mesh["tp"]``); default: the mesh
            ``distribute_tensor`` would use (a 1-D mesh over the world).
        parallelize_plan: one style for ``module`` itself, or ``{path pattern: style}``.
            None: nothing to apply; as torch, this warns and returns the module unchanged.
        src_data_rank: the rank (along the mesh) whose parameter values are distributed
            (default 0, the single-device semantics); None: each rank cuts its block from its
            own values, with no communication.

    Returns:
        The same module.

    Example:
        >>> parallelize_module(model, mesh["tp"], {
        ...     "layers.*.feed_forward.w1": ColwiseParallel(),
        ...     "layers.*.feed_forward.w2": RowwiseParallel(),
        ... })
    """
    if parallelize_plan is None:
        warnings.warn("parallelize_module got no parallelize_plan: nothing to apply, the module is "
                      "returned unchanged (there is no automatic plan)", stacklevel=2)
        return module
    if not isinstance(parallelize_plan, (ParallelStyle, dict)):
        got = foreign_note(parallelize_plan) or type(parallelize_plan).__name__
        raise TypeError(f"parallelize_module: parallelize_plan must be a ParallelStyle or a dict of them, got {got}")
    if device_mesh is None:
        device_mesh = default_mesh()
    check_mesh(device_mesh, "parallelize_module")
    plan = {"": parallelize_plan} if isinstance(parallelize_plan, ParallelStyle) else dict(parallelize_plan)
    resolved = resolve_plan(module, plan)
    modules = dict(module.named_modules())
    for key, path, target, style in resolved:
        parent_path = path.rpartition(".")[0]
        try:
            style.check(target, device_mesh)
            if path:
                check_head_alignment(style, target, modules[parent_path], parent_path, device_mesh)
        except ValueError as err:
            where = f"module {path!r}" if path else "the root module"
            raise ValueError(f"parallelize_module: plan[{key!r}] on {where} ({describe_module(target)}): {err}") from None
    _check_attention_groups(resolved, modules, device_mesh)
    for _, _, target, style in resolved:
        style.src_data_rank = src_data_rank
        style.apply(target, device_mesh)
    return module
