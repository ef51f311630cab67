"""Host copies of the blocks an asynchronous save writes, kept from one save to the next.

``async_save`` returns once this rank's blocks are copied here; training may then change the
live tensors while a thread writes the copies. The buffers are allocated at the first save and
reused by the next ones while each block keeps its shape and dtype (the state of a training
run does), so a steady run allocates nothing per save. Copies of GPU blocks go to pinned
memory without blocking the host: a CUDA event recorded after them is what the writing thread
waits for, and the training stream's later kernels run after the copies in stream order.
See docs/checkpoints.md, "Asynchronous saves, retention and bad storage".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Staged", "HostBuffers"]


@dataclass(frozen=True)
class Staged:
    """Blocks copied to host memory (by key), and the event their GPU copies complete at."""

    blocks: dict[str, torch.Tensor]
    ready: "torch.cuda.Event | None"

    def wait(self) -> None:
        """Block until every copy has landed (a no-op for CPU blocks)."""
        if self.ready is not None:
            self.ready.synchronize()


class HostBuffers:
    """One host buffer per saved key, reused between saves while its shape and dtype hold."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, blocks: dict[str, torch.Tensor]) -> Staged:
        """Copy ``blocks`` (this rank's local blocks) into the buffers; buffers of keys no
        longer saved are released. The caller must not stage again before the previous
        ``Staged`` was written (``async_save`` allows one save in flight)."""
        staged: dict[str, torch.Tensor] = {}
        on_gpu = False
        with torch.no_grad():
            for key, block in blocks.items():
                buffer = self._buffer(key, block)
                on_gpu |= block.device.type == "cuda"
                buffer.copy_(block, non_blocking=block.device.type == "cuda")
                staged[key] = buffer
        self._buffers = staged
        return Staged(staged, _recorded_event() if on_gpu else None)

    def _buffer(self, key: str, block: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is not None and buffer.shape == block.shape and buffer.dtype == block.dtype:
            return buffer
        return torch.empty(block.shape, dtype=block.dtype, pin_memory=block.device.type == "cuda")


def _recorded_event() -> "torch.cuda.Event":
    event = torch.cuda.Event()
    event.record()
    return event
