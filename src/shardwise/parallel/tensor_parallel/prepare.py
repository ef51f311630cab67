"""PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput: layout conversions at a
module's boundary.

They shard nothing. They say what layout a module's inputs (or outputs) are in and what layout
they should be moved to, e.g. an attention block that receives the sequence-sharded residual
stream and needs it whole: ``PrepareModuleInput(input_layouts=(Shard(1), None),
desired_input_layouts=(Replicate(), None))`` inserts one all-gather. ``None`` marks an argument
that is left alone (masks, rotary tables, non-tensors).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from shardwise.compile.opaque import Packed, opaque, pack, unpack
from shardwise.core.mesh import DeviceMesh
from shardwise.core.torch_errors import ValueAssertionError
from shardwise.parallel.tensor_parallel.style import ParallelStyle, from_layout, to_layout
from shardwise.core.placement import Placement

__all__ = ["PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"]

Layouts = Placement | Sequence[Placement | None] | None


def _as_tuple(layouts: Layouts) -> tuple[Placement | None, ...]:
    if layouts is None:
        return ()
    if isinstance(layouts, Placement):
        return (layouts,)
    return tuple(layouts)


def _pair(given: Layouts, desired: Layouts, what: str) -> tuple[tuple, tuple]:
    given_t, desired_t = _as_tuple(given), _as_tuple(desired)
    if len(given_t) != len(desired_t):
        raise ValueAssertionError(
            f"input_layouts and desired_input_layouts should have same length! {what}: {len(given_t)} input "
            f"layouts but {len(desired_t)} desired layouts; give one of each per argument"
        )
    for g, d in zip(given_t, desired_t):
        if (g is None) != (d is None):
            raise ValueError(f"{what}: layouts {given_t} and desired layouts {desired_t} must mark the same arguments None")
    return given_t, desired_t


class PrepareModuleInput(ParallelStyle):
    """Move a module's inputs (positional, and keyword by name) to the desired layouts.

    Args:
        input_layouts: per positional input, the layout it arrives in (``None``: leave it).
        desired_input_layouts: per positional input, the layout the module needs.
        input_kwarg_layouts / desired_input_kwarg_layouts: the same for keyword inputs.
        use_local_output: hand the module local blocks instead of DTensors.
    """

    def __init__(
        self,
        *,
        input_layouts: Layouts = None,
        desired_input_layouts: Layouts = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.input_layouts, self.desired_input_layouts = _pair(input_layouts, desired_input_layouts, "PrepareModuleInput")
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError(
                f"PrepareModuleInput: keyword layouts for {sorted(self.input_kwarg_layouts)} but desired layouts "
                f"for {sorted(self.desired_input_kwarg_layouts)}; name the same keywords in both"
            )
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(self._make_hook(mesh), with_kwargs=True)
        return module

    def _make_hook(self, mesh: DeviceMesh):
        given, desired = pack(self.input_layouts), pack(self.desired_input_layouts)
        keys = tuple(sorted(self.input_kwarg_layouts))
        kw_given = pack(tuple(self.input_kwarg_layouts[k] for k in keys))
        kw_desired = pack(tuple(self.desired_input_kwarg_layouts[k] for k in keys))
        local, count = self.use_local_output, len(self.input_layouts)

        def hook(mod, args, kwargs):
            if len(args) < count:
                raise ValueError(
                    f"PrepareModuleInput on {type(mod).__name__}: layouts given for {count} positional "
                    f"inputs, but the module was called with {len(args)}"
                )
            return _prepare_inputs(args, kwargs, mesh, given, desired, keys, kw_given, kw_desired, local)

        return hook


def _convert(value: Any, mesh: DeviceMesh, given: Placement | None, desired: Placement | None, local: bool) -> Any:
    moved = to_layout(value, mesh, given, desired)
    return from_layout(moved, mesh, None, local) if given is not None else moved


@opaque
def _prepare_inputs(args: tuple, kwargs: dict, mesh: DeviceMesh, given: Packed, desired: Packed,
                    keys: tuple[str, ...], kw_given: Packed, kw_desired: Packed, local: bool) -> tuple:
    """PrepareModuleInput's work (one opaque call under torch.compile, no module argument)."""
    given, desired = unpack(given), unpack(desired)
    kw_given, kw_desired = dict(zip(keys, unpack(kw_given) or ())), dict(zip(keys, unpack(kw_desired) or ()))
    new_args = tuple(
        _convert(a, mesh, given[i], desired[i], local) if i < len(given) else a for i, a in enumerate(args)
    )
    new_kwargs = {k: _convert(v, mesh, kw_given.get(k), kw_desired.get(k), local) for k, v in kwargs.items()}
    return new_args, new_kwargs


class PrepareModuleOutput(ParallelStyle):
    """Move a module's outputs from ``output_layouts`` to ``desired_output_layouts``.

    Outputs that are plain tensors are taken to be in the given layout; the results are local
    blocks unless ``use_local_output=False``.
    """

    def __init__(self, *, output_layouts: Layouts, desired_output_layouts: Layouts, use_local_output: bool = True) -> None:
        self.output_layouts, self.desired_output_layouts = _pair(output_layouts, desired_output_layouts, "PrepareModuleOutput")
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        given, desired, local = pack(self.output_layouts), pack(self.desired_output_layouts), self.use_local_output
        count = len(self.output_layouts)

        def hook(mod, inputs, out):
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            if len(outs) != count:
                raise ValueError(
                    f"PrepareModuleOutput on {type(mod).__name__}: layouts given for {count} outputs, "
                    f"but the module returned {len(outs)}"
                )
            moved = _prepare_outputs(outs, mesh, given, desired, local)
            return moved[0] if single else moved

        module.register_forward_hook(hook)
        return module


@opaque
def _prepare_outputs(outs: tuple, mesh: DeviceMesh, given: Packed, desired: Packed, local: bool) -> tuple:
    """PrepareModuleOutput's work (one opaque call under torch.compile, no module argument)."""
    given, desired = unpack(given), unpack(desired)
    return tuple(
        from_layout(to_layout(o, mesh, g, d), mesh, None, local) if g is not None else o
        for o, g, d in zip(outs, given, desired)
    )


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module, as one plan entry.

    A plan maps each module to one style, so a module whose inputs and outputs both change
    layout (e.g. a block that takes the sequence-sharded stream whole and hands it back
    sharded) takes this one. The arguments are those of the two styles; ``use_local_input``
    is ``PrepareModuleInput``'s ``use_local_output`` (hand the module local blocks).
    """

    def __init__(
        self,
        *,
        input_layouts: Layouts = None,
        desired_input_layouts: Layouts = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Layouts,
        desired_output_layouts: Layouts,
        use_local_output: bool = True,
    ) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input.apply(module, mesh)
        self.prepare_module_output.apply(module, mesh)
        return module
