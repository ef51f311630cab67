"""ParallelDims: how many ways each kind of parallelism splits the world, and its mesh.

Configuration and topology are separate (seed 3.1.2): this dataclass only holds and validates
degrees; ``build_mesh`` turns them into a DeviceMesh whose axes are the degrees > 1, in the
order pp, dp_replicate, dp_shard, cp, tp (outermost to innermost: tp ranks are neighbours, so
the chattiest parallelism gets the fastest links), plus flattened axes used by the trainer:

* ``dp`` = dp_replicate x dp_shard: the data-parallel ranks (data loading, loss averaging);
* ``dp_shard_cp`` = dp_shard x cp: the ranks FSDP shards parameters over;
* ``dp_cp`` = dp_replicate x dp_shard x cp: the ranks gradients and the loss are reduced over.

Expert parallelism borrows its ranks from dp_shard x cp (docs/parallelism.md, "Mixture of experts and expert parallelism"): with
ep > 1 the dp_shard axis is built as two axes, ``dp_shard_mod_ep`` (outer, kept even when it
is 1: fully_shard shards the experts over it) and ``dp_shard_in_ep`` (inner), and ``dp_shard``
becomes their flattening, so every axis above keeps its name and its ranks. Then

* ``ep`` = dp_shard_in_ep x cp: the ranks that hold different experts (the all_to_alls);
* ``dp_shard_mod_ep``: the ranks that hold the same experts, over which FSDP shards them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shardwise.core.mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims"]

_AXIS_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# With ep > 1: dp_shard is two axes, and ep their inner one with cp.
_EP_SPLIT = ("dp_shard_mod_ep", "dp_shard_in_ep")
_EP_FLATTENED = {"dp_shard": _EP_SPLIT, "ep": ("dp_shard_in_ep", "cp")}


@dataclass
class ParallelDims:
    """Parallel degrees of a training job; their product must be the world size.

    Args:
        dp_replicate: data-parallel replicas (DDP / the replicate axis of HSDP).
        dp_shard: FSDP shards; -1 takes whatever the other degrees leave of the world.
        cp: context (sequence) parallel degree.
        tp: tensor parallel degree.
        pp: pipeline parallel degree.
        ep: expert parallel degree; borrows ranks of dp_shard x cp, so it must divide them.
        world_size: total ranks.

    Example:
        >>> dims = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, world_size=8)
        >>> dims.dp_shard, dims.fsdp_enabled
        (2, True)
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()

    def _degrees(self) -> str:
        return (
            f"dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, cp={self.cp}, tp={self.tp}, "
            f"pp={self.pp}, ep={self.ep}, world_size={self.world_size}"
        )

    def _validate(self) -> None:
        named = {"dp_replicate": self.dp_replicate, "cp": self.cp, "tp": self.tp, "pp": self.pp, "ep": self.ep}
        bad = [k for k, v in named.items() if not isinstance(v, int) or v < 1]
        if bad or self.world_size < 1:
            raise ValueError(f"parallel degrees must be integers >= 1 (got {self._degrees()})")
        if self.dp_shard == -1:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % others:
                raise ValueError(
                    f"cannot infer dp_shard: world_size {self.world_size} is not divisible by "
                    f"dp_replicate*cp*tp*pp = {others} ({self._degrees()})"
                )
            self.dp_shard = self.world_size // others
        if not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ValueError(f"dp_shard must be -1 or an integer >= 1 (got {self._degrees()})")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate*dp_shard*cp*tp*pp = {product} must equal world_size {self.world_size} "
                f"({self._degrees()})"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp_shard*cp = {self.dp_shard * self.cp} ({self._degrees()})")
        if self.ep > 1 and self.ep % self.cp:
            raise ValueError(f"ep={self.ep} must be a multiple of cp={self.cp}: the ep ranks are dp_shard ranks x "
                             f"all the cp ranks ({self._degrees()})")

    # ------------------------------------------------------------------ which are on
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded over dp_shard (and cp, which FSDP shards over too)."""
        return self.dp_shard * self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """Ranks of dp_shard x cp holding the same experts (FSDP shards the experts over them)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def dp_shard_in_ep(self) -> int:
        """The dp_shard part of the ep ranks (the rest of ep is cp)."""
        return self.ep // self.cp

    @property
    def dp_degree(self) -> int:
        """How many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        """The layout in words, e.g. ``HSDP dp_replicate=2 x dp_shard=2 + TP tp=2``.

        The data-parallel kind is named because the degrees alone hide it: dp_replicate=2 with
        an inferred dp_shard=2 is HSDP, not the DDP a user may have meant.
        """
        parts = [self._data_parallel_kind()] if self.dp_enabled else []
        parts += [f"{name.upper()} {name}={getattr(self, name)}" for name in ("cp", "tp", "pp", "ep")
                  if getattr(self, name) > 1]
        return " + ".join(parts) or "single process"

    def _data_parallel_kind(self) -> str:
        if self.hsdp_enabled:
            return f"HSDP dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}"
        if self.dp_replicate_enabled:
            return f"DDP dp_replicate={self.dp_replicate}"
        return f"FSDP dp_shard={self.dp_shard}"

    # ------------------------------------------------------------------ mesh
    def mesh_axes(self) -> list[tuple[str, int]]:
        """The (name, size) of each world-mesh axis: the degrees > 1, outermost first.

        With ep > 1, dp_shard is ``dp_shard_mod_ep`` (always present, even of size 1: the
        experts' FSDP axis) and ``dp_shard_in_ep`` (when > 1).
        """
        axes: list[tuple[str, int]] = []
        for name in _AXIS_ORDER:
            if name == "dp_shard" and self.ep_enabled:
                axes.append(("dp_shard_mod_ep", self.dp_shard_mod_ep))
                axes += [("dp_shard_in_ep", self.dp_shard_in_ep)] if self.dp_shard_in_ep > 1 else []
            elif getattr(self, name) > 1:
                axes.append((name, getattr(self, name)))
        return axes or [("dp_shard", 1)]

    def flattened_axes(self) -> dict[str, tuple[str, ...]]:
        """Flattened axis name -> the world-mesh axes it merges (only those that exist)."""
        present = {name for name, _ in self.mesh_axes()}
        out = {}
        split = dict(_EP_FLATTENED) if self.ep_enabled else {}
        for name, parts in {**split, **_FLATTENED}.items():
            expanded = [q for p in parts for q in (split[p] if p in split and p != name else (p,))]
            kept = tuple(p for p in expanded if p in present)
            if kept:
                out[name] = kept
        return out

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Create the world mesh (and its flattened axes) over the default process group."""
        axes = self.mesh_axes()
        mesh = init_device_mesh(device_type, [n for _, n in axes], mesh_dim_names=[a for a, _ in axes])
        for name, parts in self.flattened_axes().items():
            if parts != (name,):
                mesh[parts].flatten(name)  # a single axis becomes an alias: no new group
        self._mesh = mesh
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        """The mesh of ``build_mesh`` (built on first use, on CPU)."""
        return self._mesh if self._mesh is not None else self.build_mesh()

    @property
    def non_data_parallel_size(self) -> int:
        return math.prod((self.cp, self.tp, self.pp))
