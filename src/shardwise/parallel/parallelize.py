"""parallelize_module: apply a plan of parallel styles to a module tree from outside.

The plan maps module paths to styles. A path is matched part by part with shell-style
wildcards, so ``"layers.*.attention.wq"`` names the query projection of every block. The whole
plan is resolved and checked before anything is distributed: a key that matches no module, a
module matched by two keys, or a style that cannot apply raises one error naming the key, the
module and the reason, on every rank, before any collective.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from shardwise.mesh import DeviceMesh
from shardwise.parallel.style import ParallelStyle, describe_module

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
            raise TypeError(f"parallelize_module: plan[{key!r}] is {style!r}, not a ParallelStyle")
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
    if unmatched:
        some = ", ".join(p for p in list(modules)[1:8])
        raise ValueError(
            f"parallelize_module: plan keys {unmatched} match no module of {type(module).__name__} "
            f"(its modules include: {some}, ...)"
        )
    return resolved


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, parallelize_plan: Plan) -> nn.Module:
    """Apply ``parallelize_plan`` to ``module`` (in place) on the 1-D ``device_mesh``.

    Args:
        module: any nn.Module tree, including models shardwise did not define.
        device_mesh: the tensor-parallel mesh (e.g. ``world_mesh["tp"]``).
        parallelize_plan: one style for ``module`` itself, or ``{path pattern: style}``.

    Returns:
        The same module.

    Example:
        >>> parallelize_module(model, mesh["tp"], {
        ...     "layers.*.feed_forward.w1": ColwiseParallel(),
        ...     "layers.*.feed_forward.w2": RowwiseParallel(),
        ... })
    """
    plan = {"": parallelize_plan} if isinstance(parallelize_plan, ParallelStyle) else dict(parallelize_plan)
    resolved = resolve_plan(module, plan)
    for key, path, target, style in resolved:
        try:
            style.check(target, device_mesh)
        except ValueError as err:
            where = f"module {path!r}" if path else "the root module"
            raise ValueError(f"parallelize_module: plan[{key!r}] on {where} ({describe_module(target)}): {err}") from None
    for _, _, target, style in resolved:
        style.apply(target, device_mesh)
    return module
