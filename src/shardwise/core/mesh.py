"""DeviceMesh: an N-D grid of ranks, one process group per axis.

Each axis ("mesh dim") of the grid is one kind of parallelism: a (2, 4) mesh named
("dp", "tp") is 2-way data parallel times 4-way tensor parallel over 8 ranks. Every rank
holds the mesh object that contains it, so ``mesh["tp"]`` is ``[0, 1, 2, 3]`` on ranks 0-3 and
``[4, 5, 6, 7]`` on ranks 4-7 (SPMD: same code, each rank sees its own slice).

Process groups are created eagerly, for every slice of every axis, in the same order on every
rank (c10d requires all ranks to enter ``new_group`` identically), and cached by their rank
list, so building the same sub-mesh twice creates no new group.

Named axes may be flattened: ``mesh["dp_replicate", "dp_shard"].flatten("dp")`` registers a
1-D axis "dp" on the root mesh whose ranks are the row-major walk of those axes; afterwards
``root["dp"]`` returns it.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch._opaque_base import OpaqueBase

from shardwise.comm.timeout import collective_timeout, remember_group
from shardwise.core.foreign import foreign_note

__all__ = ["DeviceMesh", "init_device_mesh", "current_mesh", "default_mesh", "world_mesh", "axis_slices",
           "group_cached", "forget_groups", "check_mesh", "UNPICKLE_FUNCTIONS"]

# Rank tuple -> process group. Shared by all meshes of the process so each group exists once.
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
# Every mesh alive, by id: their groups are released at exit (``_release_groups``).
_LIVE_MESHES: "weakref.WeakValueDictionary[int, DeviceMesh]" = weakref.WeakValueDictionary()
# Meshes entered with ``with mesh:``, innermost last.
_MESH_STACK: list["DeviceMesh"] = []


def _release_groups() -> None:
    """At exit, drop this module's references to process groups while the interpreter is alive.

    Otherwise the cached groups die during interpreter finalization, and gloo's worker threads
    can still hold work objects whose tensors need the (then gone) interpreter: an occasional
    ``terminate called without an active exception`` after a clean run. Best effort: it releases
    shardwise's references only (``comm`` drops its own the same way); meshes still alive (a
    script's globals) forget their groups, which they no longer need."""
    _GROUPS.clear()
    _MESH_STACK.clear()
    for mesh in list(_LIVE_MESHES.values()):
        mesh._groups = []
    gc.collect()


atexit.register(_release_groups)


def current_mesh() -> "DeviceMesh | None":
    """The innermost mesh entered with ``with mesh:``, or None outside any."""
    return _MESH_STACK[-1] if _MESH_STACK else None


_DEFAULT_MESHES: dict[str, "DeviceMesh"] = {}  # device type -> its world mesh


def check_mesh(mesh: object, where: str) -> None:
    """Raise one TypeError naming ``where`` unless ``mesh`` is a shardwise DeviceMesh (torch's
    own mesh is named as torch's, with the conversion to use)."""
    if not isinstance(mesh, DeviceMesh):
        what = foreign_note(mesh) or f"{mesh!r} (a {type(mesh).__name__})"
        raise TypeError(f"{where}: the mesh must be a shardwise DeviceMesh; got {what}")


def default_mesh(device_type: str = "cpu") -> "DeviceMesh":
    """The mesh used when none is given: the innermost ``with mesh:``, else ``world_mesh``."""
    current = current_mesh()
    return current if current is not None else world_mesh(device_type)


def world_mesh(device_type: str = "cpu") -> "DeviceMesh":
    """A 1-D mesh over the whole world (fully_shard's and replicate's default, as in torch)."""
    mesh = _DEFAULT_MESHES.get(device_type)
    if mesh is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        mesh = _DEFAULT_MESHES[device_type] = init_device_mesh(device_type, (world,))
    return mesh


def _group_for(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The cached process group over ``ranks`` (creating it on every rank if new)."""
    group = _GROUPS.get(ranks)
    if group is None:
        if ranks == tuple(range(dist.get_world_size())):
            group = dist.group.WORLD
        else:
            # new_group's own default is gloo's 30 minutes, whatever the default group has.
            group = dist.new_group(list(ranks), timeout=collective_timeout())
        _GROUPS[ranks] = group
        remember_group(group)
    return group


def adopt_group(ranks: tuple[int, ...], group: object) -> None:
    """Make ``group`` the cached group over ``ranks`` unless one is cached already.

    For groups created elsewhere (``shardwise.interop`` reuses torch's meshes' groups): a mesh
    built afterwards over these ranks takes them instead of creating new ones. A rank outside
    ``ranks`` may pass any placeholder; it never uses the group, but caching it keeps every
    rank's sequence of group creations the same.
    """
    if _GROUPS.setdefault(tuple(ranks), group) is group:
        remember_group(group)


def forget_groups() -> None:
    """Forget every cached process group: the next mesh creates its own (a new world, as the
    simulator starts for each simulated rank)."""
    _GROUPS.clear()


def group_cached(ranks: tuple[int, ...]) -> bool:
    """Whether a mesh already asked for the process group over ``ranks`` (so it exists on every rank)."""
    return ranks in _GROUPS


def num_cached_groups() -> int:
    """How many distinct process groups meshes have asked for (for tests and tools)."""
    return len(_GROUPS)


def _current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def axis_slices(family: torch.Tensor, sub_ndim: int) -> list[list[tuple[int, ...]]]:
    """For each of the last ``sub_ndim`` axes of ``family``, every 1-D slice along it.

    ``family`` stacks every rank's version of a mesh: its leading dims enumerate the copies,
    its trailing ``sub_ndim`` dims are the mesh itself. The slices are the process groups that
    all ranks together must create for that axis.
    """
    lead = family.ndim - sub_ndim
    slices = []
    for axis in range(sub_ndim):
        moved = family.movedim(lead + axis, -1).reshape(-1, family.shape[lead + axis])
        slices.append(sorted({tuple(int(r) for r in row) for row in moved}))
    return slices


class DeviceMesh(OpaqueBase):
    """An N-D arrangement of ranks with one process group per axis.

    Args:
        device_type: "cpu" (gloo) or "cuda" (nccl).
        mesh: the rank grid (nested lists or an int tensor); every rank passes the same grid.
        mesh_dim_names: optional unique names, one per axis.

    Example:
        >>> mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        >>> mesh["tp"].mesh  # on rank 2: tensor([2, 3])
    """

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _family: torch.Tensor | None = None,
        _root: "DeviceMesh | None" = None,
        _axis_dims: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        grid = torch.as_tensor(mesh, dtype=torch.int64, device="cpu").detach().clone()
        names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        _check_mesh(grid, names)
        self.device_type = device_type
        self.mesh = grid
        self.mesh_dim_names = names
        self._root = _root if _root is not None else self
        # For each axis of this mesh, the root axes it is made of (several if flattened).
        self._axis_dims = _axis_dims if _axis_dims is not None else tuple((i,) for i in range(grid.ndim))
        self._flattened: dict[str, tuple[int, ...]] = {}
        self._rank = _current_rank()
        coords = (grid == self._rank).nonzero()
        self._coordinate = tuple(int(c) for c in coords[0]) if len(coords) else None
        self._groups: list[dist.ProcessGroup] = []
        if dist.is_initialized():
            _ensure_backend_device(device_type)
            self._groups = self._init_groups(_family if _family is not None else grid)
            _LIVE_MESHES[id(self)] = self
        # A sub-mesh's identity includes its root's: equal-looking sub-meshes of different
        # roots slice and flatten differently, so cached specs must not swap one for the other.
        root_key = None if self._root is self else self._root._key
        self._key = (device_type, tuple(grid.flatten().tolist()), tuple(grid.shape), names, root_key)
        self._hash = hash(self._key)

    def _init_groups(self, family: torch.Tensor) -> list[dist.ProcessGroup]:
        """Create (or reuse) every slice group of every axis; return the ones containing us."""
        mine = []
        for axis, slices in enumerate(axis_slices(family, self.mesh.ndim)):
            own = None
            for ranks in slices:
                group = _group_for(ranks)
                if self._rank in ranks:
                    own = group
            mine.append(own)
        return mine

    # ------------------------------------------------------------------ queries
    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return self.mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each mesh axis."""
        return tuple(self.mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Ranks along one axis, or in the whole mesh when ``mesh_dim`` is None."""
        if mesh_dim is None:
            return self.mesh.numel()
        return self.mesh.shape[self._axis_index(mesh_dim)]

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along every axis, or None if this rank is not in the mesh."""
        return self._coordinate

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along one axis (the only axis if the mesh is 1-D)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"{self} has {self.ndim} axes; name the axis for get_local_rank")
            mesh_dim = 0
        self._require_member("get_local_rank")
        return self._coordinate[self._axis_index(mesh_dim)]

    def _require_member(self, what: str) -> None:
        """Raise, naming the rank and the rank grid, when this rank is not in the mesh."""
        if self._coordinate is None:
            raise RuntimeError(
                f"{what}: rank {self._rank} is not in {self.describe()}; only its ranks "
                f"{sorted(self._key[1])} hold a position, a group and blocks on it"
            )

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        """The process group of this rank's slice along one axis."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"{self} has {self.ndim} axes; name the axis for get_group")
            mesh_dim = 0
        axis = self._axis_index(mesh_dim)
        self._require_member(f"get_group({mesh_dim!r})")
        group = self._groups[axis] if self._groups else None
        if group is None:
            raise RuntimeError(f"rank {self._rank} has no group on axis {mesh_dim!r} of {self}")
        return group

    def get_all_groups(self) -> list[dist.ProcessGroup]:
        """One process group per axis."""
        return [self.get_group(i) for i in range(self.ndim)]

    def axis_name(self, mesh_dim: int) -> str:
        """The name of an axis, or ``dim<i>`` when the mesh is unnamed."""
        return self.mesh_dim_names[mesh_dim] if self.mesh_dim_names else f"dim{mesh_dim}"

    def _axis_index(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"{self} has no axis named {mesh_dim!r}")
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"{self} has no axis {mesh_dim}")
        return mesh_dim % self.ndim

    # ------------------------------------------------------------------ sub-meshes
    def __getitem__(self, names: str | tuple[str, ...]) -> "DeviceMesh":
        """The sub-mesh over the named axes, in the order given, that contains this rank."""
        names = (names,) if isinstance(names, str) else tuple(names)
        if self.mesh_dim_names is not None and names == self.mesh_dim_names:
            return self
        root = self._root
        dims = [self._root_dims_of(n) for n in names]
        flat = [d for group in dims for d in group]
        if len(set(flat)) != len(flat):
            raise ValueError(f"axes {names} of {self} overlap; each axis may be selected once")
        return root._submesh(names, dims)

    def _root_dims_of(self, name: str) -> tuple[int, ...]:
        """The root axes behind axis ``name`` of this mesh (or a flattened axis of the root)."""
        if not isinstance(name, str):
            raise TypeError(f"index a DeviceMesh by axis names, got {name!r}")
        if self.mesh_dim_names and name in self.mesh_dim_names:
            return self._axis_dims[self.mesh_dim_names.index(name)]
        if name in self._root._flattened:
            return self._root._flattened[name]
        known = list(self.mesh_dim_names or ()) + list(self._root._flattened)
        raise KeyError(f"{self} has no axis named {name!r}; known axes: {known}")

    def _submesh(
        self, names: tuple[str, ...], dims: list[tuple[int, ...]], grid: list | None = None
    ) -> "DeviceMesh":
        """Root-only: the mesh over groups of root axes ``dims`` (each group flattened).

        ``grid`` picks one slice of the family by its ranks (default: the slice holding this rank).
        """
        chosen = [d for group in dims for d in group]
        rest = [d for d in range(self.ndim) if d not in chosen]
        sub_shape = [math.prod(self.mesh.shape[d] for d in group) for group in dims]
        family = self.mesh.permute(rest + chosen)
        family = family.reshape([self.mesh.shape[d] for d in rest] + sub_shape)
        coord = self._coordinate
        mine = family[tuple(coord[d] for d in rest)] if coord is not None else family.reshape(-1, *sub_shape)[0]
        if grid is not None:
            mine = torch.as_tensor(grid, dtype=torch.int64)
        return DeviceMesh(
            self.device_type,
            mine,
            mesh_dim_names=names,
            _family=family,
            _root=self,
            _axis_dims=tuple(dims),
        )

    def flatten(self, mesh_dim_name: str | None = None) -> "DeviceMesh":
        """Merge all axes of this mesh into one named axis, registered on the root mesh.

        The flattened axis walks the axes row-major in this mesh's order, and is reachable
        afterwards as ``root[mesh_dim_name]``. Any set of root axes may be flattened, contiguous
        or not. Flattening again under the same name returns the same layout.
        """
        root = self._root
        dims = tuple(d for group in self._axis_dims for d in group)
        name = mesh_dim_name or "_".join(self.axis_name(i) for i in range(self.ndim))
        existing = root._flattened.get(name)
        if root.mesh_dim_names and name in root.mesh_dim_names:
            if dims != (root.mesh_dim_names.index(name),):
                raise ValueError(f"cannot flatten into {name!r}: {root} already has that axis")
        elif existing is not None and existing != dims:
            raise ValueError(
                f"{name!r} is already a flattened axis over root axes {existing}, not {dims}"
            )
        root._flattened[name] = dims
        return root[name]

    _flatten = flatten

    # ------------------------------------------------------------------ default mesh
    def __enter__(self) -> "DeviceMesh":
        """``with mesh:`` makes this mesh the default of from_local, distribute_tensor and the
        factories until the block ends (blocks nest; the innermost wins)."""
        _MESH_STACK.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if not _MESH_STACK or _MESH_STACK[-1] is not self:
            raise RuntimeError(f"leaving `with {self}:` but the innermost mesh entered is {current_mesh()}")
        _MESH_STACK.pop()

    # ------------------------------------------------------------------ pickling
    def __reduce__(self) -> tuple:
        """Pickle by identity (device type, rank grid, axis names, root), never the groups.

        Unpickling in the same world looks the groups up in the process's cache, with no
        collective; in a process that has not created them yet, every rank must unpickle the
        same meshes in the same order, since creating a group is collective. A sub-mesh is
        rebuilt from its root, so slicing and flattening work on the copy as on the original.
        """
        if self._root is self:
            return _rebuild_root, (self.device_type, self.mesh.tolist(), self.mesh_dim_names, dict(self._flattened))
        return _rebuild_submesh, (self._root, self.mesh_dim_names, self._axis_dims, self.mesh.tolist())

    # ------------------------------------------------------------------ identity
    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        axes = ", ".join(f"{self.axis_name(i)}={n}" for i, n in enumerate(self.shape))
        return f"mesh({axes})"

    def describe(self) -> str:
        """Long form with the rank grid, for error messages about layouts."""
        return f"DeviceMesh({self.device_type!r}, {self.rank_grid()}, names={self.mesh_dim_names})"

    def flat_ranks(self) -> tuple[int, ...]:
        """The ranks in row-major order of the grid (Python data, see ``rank_grid``)."""
        return self._key[1]

    def rank_grid(self) -> list:
        """The ranks as nested lists (``mesh.tolist()``), from Python data: it is also read
        while tracing under torch.compile, where a tensor read would be a fake-tensor op."""
        _, flat, shape, _, _ = self._key
        grid: list = list(flat)
        for size in reversed(shape[1:]):
            grid = [grid[i:i + size] for i in range(0, len(grid), size)]
        return grid


def _rebuild_root(
    device_type: str, grid: list, names: tuple[str, ...] | None, flattened: dict[str, tuple[int, ...]]
) -> DeviceMesh:
    """Unpickle a root mesh (see ``DeviceMesh.__reduce__``)."""
    mesh = DeviceMesh(device_type, grid, mesh_dim_names=names)
    for name, dims in flattened.items():
        mesh._flattened.setdefault(name, tuple(dims))
    return mesh


def _rebuild_submesh(
    root: DeviceMesh, names: tuple[str, ...], axis_dims: tuple[tuple[int, ...], ...], grid: list
) -> DeviceMesh:
    """Unpickle a sub-mesh: the same slice of the (unpickled) root."""
    return root._submesh(tuple(names), [tuple(d) for d in axis_dims], grid=grid)


def _check_mesh(grid: torch.Tensor, names: tuple[str, ...] | None) -> None:
    """Validate a rank grid and its axis names; every rank raises the same error."""
    ranks = grid.flatten().tolist()
    if grid.numel() == 0:
        raise ValueError(f"a DeviceMesh needs at least one rank, got grid of shape {tuple(grid.shape)}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"DeviceMesh grid {grid.tolist()} lists a rank twice")
    if dist.is_initialized():
        world = dist.get_world_size()
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise ValueError(f"DeviceMesh grid {grid.tolist()} has ranks {bad} outside world size {world}")
    if names is not None:
        if len(names) != grid.ndim:
            raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {grid.ndim}-D mesh")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh_dim_names {names} has duplicate names")


def _ensure_backend_device(device_type: str) -> None:
    _require_collective_backend(device_type)
    if device_type == "cuda" and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local % torch.cuda.device_count())


def _require_collective_backend(device_type: str) -> None:
    """Refuse a device type the default process group has no collectives for, naming it.

    Nothing else in shardwise assumes "cpu" or "cuda": another accelerator's device type works
    wherever its process-group backend is registered, and fails here, before any group or
    collective, where it is not.
    """
    try:
        dist.group.WORLD._get_backend(torch.device(device_type))
    except (RuntimeError, ValueError) as err:
        raise RuntimeError(
            f"DeviceMesh({device_type!r}): the default process group (backend {dist.get_backend()!r}) has no "
            f"collective backend for device type {device_type!r} ({err}); start it with one, e.g. "
            f"init_process_group(backend='cpu:gloo,{device_type}:<backend>')"
        ) from None


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """Build a mesh over the whole world, starting the default process group if needed.

    Args:
        device_type: "cpu" (gloo) or "cuda" (nccl); the local device is rank % GPUs per node.
        mesh_shape: size of each axis; their product must equal the world size.
        mesh_dim_names: optional unique name per axis.

    Returns:
        The mesh, ranks laid out row-major: ``init_device_mesh("cpu", (2, 2))`` is [[0, 1], [2, 3]].

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    if names is not None and len(names) != len(mesh_shape):
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names for mesh_shape {mesh_shape}")
    if names is not None and len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names {names} has duplicate names")
    if any(s <= 0 for s in mesh_shape):
        raise ValueError(f"mesh_shape {mesh_shape} must have positive sizes")
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=collective_timeout())
    world = dist.get_world_size()
    if math.prod(mesh_shape) != world:
        raise ValueError(
            f"mesh_shape {mesh_shape} has {math.prod(mesh_shape)} ranks but the world size is {world}"
        )
    grid = torch.arange(world).reshape(mesh_shape)
    return DeviceMesh(device_type, grid, mesh_dim_names=names)


# What ``DeviceMesh.__reduce__`` pickles meshes with: ``torch.load(weights_only=True)`` must allow
# them (``shardwise.tensor.serialization``). Their names are in saved files: never rename them.
UNPICKLE_FUNCTIONS = (_rebuild_root, _rebuild_submesh)
