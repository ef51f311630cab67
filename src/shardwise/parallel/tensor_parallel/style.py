"""Tensor-parallel styles: how one module's parameters and activations are laid out on a mesh axis.

A style is configuration, not model code (seed 7.2): it turns a module's parameters into
DTensors and installs forward hooks that give the module its inputs in the layout its math
needs and hand its outputs on in the layout the next module expects. The classic Megatron
pairing needs no communication between the two matmuls of an MLP or an attention block:

* ``ColwiseParallel``: ``y = x @ W.T`` with W's output features sharded; x replicated, y
  sharded on its last dim (``Shard(-1)``): each rank computes its slice of the features.
* ``RowwiseParallel``: W's input features sharded; x sharded on its last dim, each rank's
  product is a partial sum of y (``Partial``), reduced to ``output_layouts`` (all-reduce for
  ``Replicate``, reduce-scatter for ``Shard(1)`` with sequence parallelism).
* ``SequenceParallel``: parameters replicated, activations sharded on the sequence dim; for
  modules whose math is independent per token (norms, dropout).

Subclass ``ParallelStyle`` to add a style: ``check`` validates (no communication) and
``apply`` distributes; ``parallelize_module`` calls ``check`` on every matched module first, so
a bad plan fails on every rank before any collective.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch import nn

from shardwise.compile.opaque import Packed, opaque, pack, tracing, unpack
from shardwise.tensor.factories import distribute_tensor
from shardwise.tensor.dtensor import DTensor
from shardwise.core.mesh import DeviceMesh
from shardwise.core.placement import Placement, Replicate, Shard

__all__ = [
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "to_layout", "from_layout", "describe_module",
]


def describe_module(module: nn.Module) -> str:
    """``Linear(in_features=8, out_features=16)`` style short description for messages."""
    return f"{type(module).__name__}({module.extra_repr()})"


def to_layout(value: Any, mesh: DeviceMesh, given: Placement | None, desired: Placement | None,
              shape: Sequence[int] | None = None) -> Any:
    """An input moved to ``desired``: a plain tensor is first taken to be laid out as ``given``.

    ``None`` (for ``given`` or ``desired``) leaves the value as it is: non-tensor arguments and
    inputs a style does not manage. ``shape``: the global shape of a plain input, where the
    style knows it (uneven blocks); otherwise it is inferred assuming even blocks.
    """
    if given is None or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor) and (desired is None or value._spec.placements == (desired,)):
        return value
    key = (mesh, given, desired, None if shape is None else tuple(shape), torch.is_grad_enabled())
    moved = _LAST_MOVE.reuse(value, key)
    if moved is None:
        moved = value
        if not isinstance(moved, DTensor):
            moved = DTensor.from_local(moved, mesh, [given], shape=shape)
        if desired is not None and moved._spec.placements != (desired,):
            moved = moved.redistribute(mesh, [desired])
        _LAST_MOVE.remember(value, key, moved)
    return moved


class _SharedMove:
    """The last input a style moved, so that modules reading one tensor share one move.

    ``wq``, ``wk`` and ``wv`` (``w1`` and ``w3``) all read the sub-block's input. Moved one by
    one, the input is gathered once per layer in forward, and in backward each layer's partial
    input gradient is reduced on its own (5 all-reduces per TP block instead of 2, 5
    reduce-scatters per SP block instead of 2). Handing every such layer the same moved DTensor
    makes the forward move once and lets autograd add the partial gradients before the one
    reduction of that move's backward: what ``PrepareModuleInput`` on the sub-blocks does by
    hand, without it in the plan.

    One slot, all weak: the source must be the same live object with the same version and the
    same layouts asked for, and the moved tensor must still be alive (autograd keeps it while
    a layer saved it for backward) and unmodified. Nothing is kept alive by the slot, and
    under a tracer (torch.compile) nothing is shared: the graph sees every move. Nor under
    ``torch.inference_mode()``: an inference tensor has no version counter, so a change made
    in place between two layers could not be seen; each layer moves its input itself.
    """

    __slots__ = ("source", "version", "key", "moved", "moved_version")

    def __init__(self) -> None:
        self.source = self.moved = None

    def reuse(self, value: torch.Tensor, key: tuple) -> DTensor | None:
        source, moved = self.source, self.moved
        if source is None or value.is_inference() or source() is not value or self.version != value._version or self.key != key:
            return None
        moved = moved()
        if moved is None or moved._version != self.moved_version or tracing():
            return None
        return moved

    def remember(self, value: torch.Tensor, key: tuple, moved: DTensor) -> None:
        if moved is value or tracing() or value.is_inference() or moved.is_inference():
            return
        self.source, self.version, self.key = weakref.ref(value), value._version, key
        self.moved, self.moved_version = weakref.ref(moved), moved._version


_LAST_MOVE = _SharedMove()


def from_layout(value: Any, mesh: DeviceMesh, desired: Placement | None, use_local_output: bool) -> Any:
    """An output moved to ``desired`` and, with ``use_local_output``, unwrapped to its block."""
    if not isinstance(value, DTensor):
        return value
    if desired is not None and value._spec.placements != (desired,):
        value = value.redistribute(mesh, [desired])
    return value.to_local() if use_local_output else value


# The hooks' work, as opaque calls under torch.compile (shardwise/compile/opaque.py). They take no
# module and no per-module closure, so every block of a model shares one compiled graph.
@opaque
def _linear_inputs(inputs: tuple, mesh: DeviceMesh, given: Packed, desired: Packed, features: int) -> tuple:
    """A Linear's input moved to ``desired`` (``features``: its in_features, -1 if unknown)."""
    given, desired = unpack(given), unpack(desired)
    x = inputs[0]
    # A Linear's input has in_features features however unevenly its blocks split them.
    shape = _with_global_size(x, mesh, given, -1, features) if features >= 0 else None
    return (to_layout(x, mesh, given, desired, shape), *inputs[1:])


@opaque
def _sequence_inputs(inputs: tuple, mesh: DeviceMesh, shard: Packed) -> tuple:
    shard = unpack(shard)
    return tuple(to_layout(x, mesh, shard, shard) for x in inputs)


@opaque
def _output(out: Any, mesh: DeviceMesh, desired: Packed, use_local_output: bool) -> Any:
    return from_layout(out, mesh, unpack(desired), use_local_output)


def _one(layout: Placement | Sequence[Placement] | None, what: str) -> Placement | None:
    """A single placement (styles act on a 1-D mesh); a 1-element sequence is accepted."""
    if layout is None or isinstance(layout, Placement):
        return layout
    layout = tuple(layout)
    if len(layout) != 1 or not isinstance(layout[0], Placement):
        raise ValueError(f"{what} must be one placement (tensor parallel styles act on a 1-D mesh), got {layout}")
    return layout[0]


class ParallelStyle:
    """Base class of module parallelization styles; see the module docstring.

    ``src_data_rank`` (set by ``parallelize_module``, as in torch): the rank, along the mesh,
    whose parameter values are distributed (default 0: the single-device model's values on
    every rank); ``None``: every rank keeps its own values and cuts its block locally, with no
    communication (for parameters each rank already initialized identically, or will reset).
    """

    src_data_rank: int | None = 0

    def check(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """Raise ``ValueError`` if this style cannot apply to ``module`` on ``mesh`` (no collectives)."""
        if mesh.ndim != 1:
            raise ValueError(
                f"{type(self).__name__} needs a 1-D mesh (the tensor-parallel axis, e.g. mesh['tp']), got {mesh}"
            )

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Distribute ``module``'s parameters and install its hooks; returns the module."""
        raise NotImplementedError

    # torch.distributed.tensor.parallel spells the entry point ``_apply``.
    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        self.check(module, mesh)
        return self.apply(module, mesh)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _shard_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement,
                     src_data_rank: int | None = 0) -> None:
    param = getattr(module, name, None)
    if param is None or isinstance(param, DTensor):
        return
    dt = distribute_tensor(param.data, mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _check_plain(module: nn.Module, style: str, name: str) -> None:
    """A style shards plain parameters only: a DTensor one means two styles on one module."""
    param = getattr(module, name)
    if isinstance(param, DTensor):
        raise ValueError(f"{style}: {type(module).__name__}.{name} is already a DTensor "
                         f"({param._spec.render()}); apply one style per module")


def _with_global_size(
    value: Any, mesh: DeviceMesh, given: Placement | None, dim: int, size: int
) -> tuple[int, ...] | None:
    """The global shape of a plain input sharded by ``given`` whose dim ``dim`` is known to be ``size``.

    A rank's block alone cannot tell an uneven split (10 features on 4 ranks: 3, 3, 3, 1) from
    an even one, but the module can: a row-sharded Linear's input has ``in_features`` features.
    None when ``given`` does not shard that dim, or when this rank's block is not the piece of
    ``size`` it should hold (then the even-block inference applies and the mistake is reported
    as before, by the Linear or the layout check).
    """
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or not isinstance(given, Shard):
        return None
    ndim, coordinate = value.dim(), mesh.get_coordinate()
    if ndim == 0 or not -ndim <= given.dim < ndim or given.normalized(ndim).dim != dim % ndim or coordinate is None:
        return None
    if value.shape[dim] != Shard.chunk(size, mesh.size(), coordinate[0])[0]:
        return None
    shape = list(value.shape)
    shape[dim] = size
    return tuple(shape)


class _LinearPair(ParallelStyle):
    """What ColwiseParallel and RowwiseParallel share: Linear/Embedding only, hooks, layouts."""

    _default_input: Placement
    _default_output: Placement

    def __init__(
        self,
        *,
        input_layouts: Placement | Sequence[Placement] | None = None,
        output_layouts: Placement | Sequence[Placement] | None = None,
        use_local_output: bool = True,
    ) -> None:
        self.input_layouts = _one(input_layouts, "input_layouts") or self._default_input
        self.output_layouts = _one(output_layouts, "output_layouts") or self._default_output
        self.use_local_output = use_local_output

    def check(self, module: nn.Module, mesh: DeviceMesh) -> None:
        super().check(module, mesh)
        name = type(self).__name__
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ValueError(f"{name} cannot shard {describe_module(module)}: it supports nn.Linear and nn.Embedding")
        for param in ("weight", "bias"):
            if getattr(module, param, None) is not None:
                _check_plain(module, name, param)

    def sharded_features(self, module: nn.Module) -> tuple[str, int] | None:
        """(what, size) of the features this style splits over the ranks, for messages and
        head-alignment checks; None where it splits no feature dim of the activations."""
        raise NotImplementedError

    def _desired_input(self, module: nn.Module) -> Placement:
        raise NotImplementedError

    def _given_input(self, module: nn.Module) -> Placement:
        """The layout a plain input arrives in."""
        return self.input_layouts

    def _install_hooks(self, module: nn.Module, mesh: DeviceMesh) -> None:
        given, desired = self._given_input(module), self._desired_input(module)
        output, local = self.output_layouts, self.use_local_output

        features = module.in_features if isinstance(module, nn.Linear) else None

        given, desired, output = pack(given), pack(desired), pack(output)
        features = -1 if features is None else features

        def before(mod, inputs):
            return _linear_inputs(inputs, mesh, given, desired, features)

        def after(mod, inputs, out):
            return _output(out, mesh, output, local)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)


class ColwiseParallel(_LinearPair):
    """Shard a Linear's output features (weight ``Shard(0)``) or an Embedding's embedding dim.

    Input: ``input_layouts`` (default ``Replicate()``), moved to replicated. Output: sharded on
    the last dim, moved to ``output_layouts`` (default ``Shard(-1)``); a local tensor unless
    ``use_local_output=False``. A feature count the ranks do not divide is split as torch.chunk
    splits it (10 on 4 ranks: 3, 3, 3, 1); ``parallelize_module`` refuses a split that would
    cut an attention head (``heads.py``).
    """

    _default_input = Replicate()
    _default_output = Shard(-1)

    def sharded_features(self, module: nn.Module) -> tuple[str, int] | None:
        if isinstance(module, nn.Linear):
            return "out_features", module.out_features
        return "embedding_dim", module.embedding_dim

    def _desired_input(self, module: nn.Module) -> Placement:
        return Replicate()

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            _shard_parameter(module, "weight", mesh, Shard(0), self.src_data_rank)
            _shard_parameter(module, "bias", mesh, Shard(0), self.src_data_rank)
        else:
            _shard_parameter(module, "weight", mesh, Shard(1), self.src_data_rank)
        self._install_hooks(module, mesh)
        return module


class RowwiseParallel(_LinearPair):
    """Shard a Linear's input features (weight ``Shard(1)``, bias replicated) or an Embedding's rows.

    Input: ``input_layouts`` (default ``Shard(-1)``; ``Replicate()`` token ids for an Embedding),
    moved to what the math needs. Output: a partial sum, reduced to ``output_layouts`` (default
    ``Replicate()``: one all-reduce; ``Shard(1)``: one reduce-scatter, for sequence parallelism).
    Uneven splits as in ColwiseParallel: a plain input's blocks are read against the Linear's
    ``in_features``, so the blocks a ColwiseParallel before it hands on fit.
    """

    _default_input = Shard(-1)
    _default_output = Replicate()

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True) -> None:
        self._explicit_input = input_layouts is not None
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)

    def sharded_features(self, module: nn.Module) -> tuple[str, int] | None:
        if isinstance(module, nn.Linear):
            return "in_features", module.in_features
        return None  # an Embedding's rows are vocabulary entries, not activation features

    def _desired_input(self, module: nn.Module) -> Placement:
        return Shard(-1) if isinstance(module, nn.Linear) else Replicate()

    def _given_input(self, module: nn.Module) -> Placement:
        # Without explicit input_layouts, an Embedding's token ids are whole on every rank.
        return self.input_layouts if self._explicit_input or isinstance(module, nn.Linear) else Replicate()

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            _shard_parameter(module, "weight", mesh, Shard(1), self.src_data_rank)
            _shard_parameter(module, "bias", mesh, Replicate(), self.src_data_rank)
        else:
            _shard_parameter(module, "weight", mesh, Shard(0), self.src_data_rank)
        self._install_hooks(module, mesh)
        return module


class SequenceParallel(ParallelStyle):
    """Replicate a per-token module's parameters and shard its activations on ``sequence_dim``.

    For norms and dropout between the tensor-parallel matmuls: their math is independent per
    token, so each rank normalizes its own tokens and the activations between blocks take
    1/tp of the memory. Inputs, as in ``torch.distributed.tensor.parallel``:

    * a plain tensor is this rank's sequence shard: the global sequence is the ranks' shards
      end to end (tp times as long as the local one when they are even);
    * a DTensor keeps its values: a replicated one is cut into sequence shards locally (no
      communication), any other layout is redistributed to ``Shard(sequence_dim)``.

    A plain tensor carries no layout, so handing over the whole (replicated) sequence where a
    shard is expected would silently multiply the sequence by tp (e.g. a plan that shards the
    norms but not the embedding feeding them). On its first call the module therefore checks
    its plain inputs once, with one small all_gather of a 16-byte fingerprint per input: if
    every rank holds the very same non-constant tensor, it raises on every rank. Pass
    ``check_plain_inputs=False`` where identical sequence shards are intended.

    The output stays a DTensor unless ``use_local_output``. Parameter gradients come out
    ``Partial(sum)`` (each rank saw some tokens) and are reduced when read.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False,
                 check_plain_inputs: bool = True) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output
        self.check_plain_inputs = check_plain_inputs

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for submodule in module.modules():
            for name, param in list(submodule.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    _shard_parameter(submodule, name, mesh, Replicate(), self.src_data_rank)
        shard, local = pack(Shard(self.sequence_dim)), self.use_local_output
        unchecked = [self.check_plain_inputs]  # cleared by the first call

        def before(mod, inputs):
            if unchecked[0] and not tracing():  # needs data: eager only (see shardwise/compile/opaque.py)
                unchecked[0] = False
                _refuse_replicated_plain_inputs(mod, inputs, mesh, self.sequence_dim)
            return _sequence_inputs(inputs, mesh, shard)

        def after(mod, inputs, out):
            return _output(out, mesh, shard, local)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
        return module


_FINGERPRINT_CHUNK = 1 << 22  # bytes per step: bounds the check's temporary memory


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers summarizing ``t``'s bytes, exactly (equal tensors: equal numbers).

    Integer sums do not depend on the reduction order, so ranks holding equal tensors always
    agree; the position-weighted sum tells apart tensors that are permutations of each other.
    """
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    total = torch.zeros(2, dtype=torch.int64, device=raw.device)
    for start in range(0, raw.numel(), _FINGERPRINT_CHUNK):
        part = raw[start:start + _FINGERPRINT_CHUNK].to(torch.int64)
        position = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=raw.device)
        total += torch.stack((part.sum(), (part * position).sum()))
    return total


def _refuse_replicated_plain_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh, sequence_dim: int) -> None:
    """Raise on every rank if a plain input is the same on all ranks (see SequenceParallel).

    Every rank calls this on the same call of the same module (SPMD), so the all_gather is
    entered by all; each rank decides from the same gathered numbers.
    """
    from shardwise import comm

    n = mesh.size()
    plain = [x for x in inputs if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)]
    if n == 1 or not plain:
        return
    if any(x.is_meta for x in plain):  # a simulated step (shardwise.simulate): the same collective, no data to judge
        comm.all_gather(torch.zeros(1, len(plain), 3, dtype=torch.int64, device=plain[0].device), mesh, 0, 0, [1] * n)
        return
    # Per input: its fingerprint, and whether it is constant (then sameness proves nothing).
    mine = torch.stack([torch.cat((_fingerprint(x), _is_constant(x))) for x in plain])  # [inputs, 3]
    everyone = comm.all_gather(mine.unsqueeze(0), mesh, 0, 0, [1] * n)  # [ranks, inputs, 3]
    for i, x in enumerate(plain):
        rows = everyone[:, i]
        if not bool(rows[0, 2]) and bool((rows == rows[0]).all()):
            seq = x.shape[sequence_dim] if -x.dim() <= sequence_dim < x.dim() else None
            total = f"{n * seq} instead of {seq}" if seq is not None else f"{n} times as long"
            raise ValueError(
                f"SequenceParallel on {describe_module(module)}: its plain input {i} "
                f"({_render_plain(x)}) is the same tensor on all {n} ranks of {mesh}, but a plain input is "
                f"taken as this rank's sequence shard (dim {sequence_dim}), which would make the global "
                f"sequence {total}. Hand it the sequence-sharded activations (e.g. shard the layer "
                f"before it with output_layouts=Shard({sequence_dim}): RowwiseParallel(input_layouts=Replicate(), "
                f"output_layouts=Shard({sequence_dim})) on the embedding), or a DTensor (a replicated one is "
                f"cut into shards); if identical shards are intended, SequenceParallel(check_plain_inputs=False)"
            )


def _is_constant(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().reshape(-1)
    constant = flat.numel() == 0 or bool((flat == flat[0]).all())
    return torch.tensor([int(constant)], dtype=torch.int64, device=x.device)


def _render_plain(x: torch.Tensor) -> str:
    dtype = str(x.dtype).removeprefix("torch.")
    return f"{dtype}{list(x.shape)}"
