"""Peak tensor memory of a region of code, counted from the tensors themselves.

``MemoryTracker`` is a dispatch mode: every storage an op produces inside it is counted from
its creation until it is freed (a weak reference to the storage tells), storages resized in
place (fully_shard frees gathered parameters with ``untyped_storage().resize_``) at their new
size, and storages that already exist are counted once ``hold`` names them (the training state
at the start of a step). The peak is the highest total seen after any op.

It counts the same on real tensors and on meta tensors (which have sizes but no data), which is
what lets a simulated step (``shardwise.simulate``) and a real CPU step report the same figure:
the bytes of live tensor storage, not what an allocator rounds them to or what the process
holds besides (CUDA runs report ``torch.cuda.max_memory_allocated`` next to it).

A storage is counted from the op that allocates it: outputs of views and in-place ops (which
return their input's storage) add nothing. So storage a process-group backend allocates
itself and only views through ops (gloo stages its reductions on CPU that way) is not
counted: it is the backend's working memory, as NCCL's buffers are on GPU, and a simulated
collective has none.

Tensor subclasses (DTensor) are let through: the mode counts the plain local blocks their
handlers produce, so a DTensor's bytes are its block's bytes on this rank. The meta tensors the
dispatcher runs an op on to decide its layouts (on a miss of its bounded cache) are not counted:
whether a step misses depends on what ran before it in the process, not on the step.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardwise.comm import awaiting_release
from shardwise.dispatch.dispatcher import deciding

__all__ = ["MemoryTracker"]



class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storage while open.

    Example:
        >>> with MemoryTracker() as mem:
        ...     mem.hold(model.parameters())
        ...     model(x).sum().backward()
        >>> mem.peak_bytes, mem.live_bytes
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # id(storage object) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._orig_resize = None
        # A real step's collectives return only once gloo has released their buffers: otherwise a
        # buffer freed by the step could be counted a moment longer, at random (comm.awaiting_release).
        self._release = awaiting_release()

    # ------------------------------------------------------------------ counting
    def hold(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count these tensors' storages (their local blocks for DTensors) from now on."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(_block(t))
        self._observe()

    def _add(self, t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._drop(key))
        self.live_bytes += size

    def _drop(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes:
            size = storage.nbytes()
            self.live_bytes += size - self._sizes[key]
            self._sizes[key] = size
            self._observe()

    def _observe(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    # ------------------------------------------------------------------ the mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
            return NotImplemented  # a subclass's handler runs, its local ops come back here
        out = func(*args, **(kwargs or {}))
        if _allocates(func) and not deciding():  # a dispatch-cache miss's meta scratch is not the step's
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._add(t)
            self._observe()
        return out

    def __enter__(self) -> "MemoryTracker":
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int):
            result = orig(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._release.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        self._release.__exit__(*exc)
        super().__exit__(*exc)


_ALLOCATES: dict = {}


def _allocates(func) -> bool:
    """Whether ``func`` returns fresh storage (no return aliases an input: not a view, not in place)."""
    known = _ALLOCATES.get(func)
    if known is None:
        known = _ALLOCATES[func] = all(r.alias_info is None for r in func._schema.returns)
    return known


def _block(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s data on this rank (a DTensor's local block)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t
