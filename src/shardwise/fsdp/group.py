"""ParamGroup: the parameters of one fully_shard call, moved with ONE collective each way.

unshard: pack this rank's shards into a flat buffer, all_gather it over the shard axis, copy
each parameter's slots into its unsharded storage. reduce_grads: pack the whole-block
gradients rank-major, reduce_scatter (average) over the shard axis, on HSDP all_reduce
(average) the result over the replicate axis, add each shard into ``param.grad``.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.fsdp import memory
from shardwise.fsdp.dp_mesh import DataParallelMesh
from shardwise.fsdp.layout import FlatLayout
from shardwise.fsdp.param import FSDPParam

__all__ = ["ParamGroup"]


class ParamGroup:
    """The FSDPParams of one module group, their flat layout and their collectives."""

    def __init__(
        self,
        params: list[FSDPParam],
        dp: DataParallelMesh,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
    ) -> None:
        self.params = params
        self.dp = dp
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.layout = FlatLayout.build([p.block_shape for p in params], dp.world)
        self.is_unsharded = False

    @property
    def num_requires_grad(self) -> int:
        return sum(p.requires_grad for p in self.params)

    # ------------------------------------------------------------------ parameters
    def unshard(self) -> None:
        """Gather every parameter of the group (one all_gather); no-op if already gathered."""
        if self.is_unsharded:
            return
        for p in self.params:
            p.allocate()
        if self.params:
            self._gather_into([p.padded_writer() for p in self.params])
        self.is_unsharded = True

    def _gather_into(self, outs: list[torch.Tensor]) -> None:
        n, per_rank = self.dp.world, self.layout.per_rank
        with torch.no_grad():
            send = self.layout.pack_shards([p.local_shard() for p in self.params], self.compute_dtype)  # [per_rank]
            staged = send.numel() * send.element_size() * (1 + n)
            memory.note_alloc("staging", staged)
            gathered = comm.all_gather(send, self.dp.mesh, self.dp.shard_axis, 0, [per_rank] * n)  # [n * per_rank]
            self.layout.unpack_gathered(gathered, outs)
            memory.note_free("staging", staged)

    def reshard(self) -> None:
        """Free every gathered parameter's storage."""
        for p in self.params:
            p.free()
        self.is_unsharded = False

    def use_unsharded(self) -> None:
        for p in self.params:
            p.use_unsharded()

    def use_sharded(self) -> None:
        for p in self.params:
            p.use_sharded()

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self) -> None:
        """Average the unsharded gradients over all data-parallel ranks into the sharded ``.grad``."""
        if not self.params:
            return
        n, per_rank = self.dp.world, self.layout.per_rank
        width = per_rank + len(self.params)  # each rank's shards, then one presence flag per parameter
        with torch.no_grad():
            grads = [p.unsharded_grad() for p in self.params]
            full = self.layout.pack_grads(grads, self.reduce_dtype, presence=True)  # [n * width]
            mine = comm.reduce_scatter(full, self.dp.mesh, self.dp.shard_axis, 0, "avg", [width] * n)  # [width]
            del full
            if self.dp.replicate_axis is not None:
                mine = comm.all_reduce(mine, self.dp.mesh, self.dp.replicate_axis, "avg")
            # A parameter no rank produced a gradient for keeps grad None, as on one device (an
            # optimizer then skips it); one that some rank used gets the average, zeros included.
            present = _presence(mine[per_rank:], grads)
            for p, shard, used in zip(self.params, self.layout.unpack_shards(mine[:per_rank], self.dp.rank), present):
                if p.requires_grad and used:
                    p.accumulate_sharded_grad(shard)
                p.clear_unsharded_grad()


def _presence(flags: torch.Tensor, grads: list) -> list[bool]:
    """Which parameters some rank produced a gradient for (the reduced presence flags).

    On the meta device (a simulated step, ``shardwise.simulate``) the flags hold no data: every
    rank is taken to produce the gradients this rank produced, as in any program all ranks run alike.
    """
    if flags.is_meta:
        return [g is not None for g in grads]
    return (flags > 0).tolist()

