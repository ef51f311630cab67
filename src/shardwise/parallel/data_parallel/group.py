"""ParamGroup: the parameters of one fully_shard call, moved with ONE collective each way.

unshard: pack this rank's shards into a flat buffer, all_gather it over the shard axis, copy
each parameter's slots into its unsharded storage. reduce_grads: pack the whole-block
gradients rank-major, reduce_scatter (average) over the shard axis, on HSDP all_reduce
(average) the result over the replicate axis, add each shard into ``param.grad``.

Both can be split in two, so that compute runs while the collective is in flight:
``start_unshard`` (prefetch) / ``unshard``, and ``start_reduce`` / ``finish_reduce``.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.parallel.data_parallel import memory
from shardwise.parallel.data_parallel.dp_mesh import DataParallelMesh
from shardwise.parallel.data_parallel.layout import FlatLayout
from shardwise.parallel.data_parallel.param import FSDPParam

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
        self._gather: tuple | None = None  # (Pending all_gather, send buffer, staged bytes)
        self._reduction: tuple | None = None  # (Pending reduce_scatter, every gradient present here)
        self.divide_factor: float | None = None  # None: average over the data-parallel ranks

    def set_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel ranks' count.

        Expert parallelism needs it (docs/parallelism.md, "Mixture of experts and expert parallelism"): an expert's gradient on its
        owner already sums the ep peers' tokens, so it is divided by every data-parallel rank
        (ep ones included) to give the mean that dense gradients get from averaging.
        """
        if not factor > 0:
            raise ValueError(f"the gradient divide factor must be positive, got {factor!r}")
        self.divide_factor = float(factor)

    @property
    def num_requires_grad(self) -> int:
        return sum(p.requires_grad for p in self.params)

    # ------------------------------------------------------------------ parameters
    def unshard(self) -> None:
        """Gather every parameter of the group (one all_gather); no-op if already gathered.

        Finishes a gather ``start_unshard`` issued earlier (a prefetch), else issues one."""
        if self.is_unsharded:
            return
        if self.params:
            self.start_unshard()
            pending, send, staged = self._gather
            self._gather = None
            with torch.no_grad():
                gathered = pending.wait()  # [n * per_rank]
                for p in self.params:
                    p.allocate()
                self.layout.unpack_gathered(gathered, [p.padded_writer() for p in self.params])
            del send, gathered
            memory.note_free("staging", staged)
        self.is_unsharded = True

    def start_unshard(self) -> None:
        """Issue the group's all_gather and return at once (prefetch): the gathered parameters'
        storage is allocated only when ``unshard`` receives the data, so in the meantime the
        in-flight block costs its staging buffers alone."""
        if self.is_unsharded or self._gather is not None or not self.params:
            return
        n = self.dp.world
        with torch.no_grad():
            send = self.layout.pack_shards([p.local_shard() for p in self.params], self.compute_dtype)  # [per_rank]
            staged = send.numel() * send.element_size() * (1 + n)
            memory.note_alloc("staging", staged)
            self._gather = (comm.all_gather_async(send, self.dp.mesh, self.dp.shard_axis), send, staged)

    @property
    def gather_in_flight(self) -> bool:
        return self._gather is not None

    def reshard(self) -> None:
        """Free every gathered parameter's storage (a prefetch never used is received and dropped)."""
        if self._gather is not None:
            pending, _, staged = self._gather
            self._gather = None
            pending.wait()
            memory.note_free("staging", staged)
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
        self.start_reduce()
        self.finish_reduce()

    def keep_grads(self) -> None:
        """Gradient sync off: add the unsharded gradients into per-parameter sums (reduce dtype)
        that the next ``start_reduce`` includes; no collective."""
        for p in self.params:
            p.keep_unsharded_grad(self.reduce_dtype)

    @property
    def has_kept_grads(self) -> bool:
        return any(p.has_kept_grad for p in self.params)

    def start_reduce(self) -> None:
        """Pack the unsharded gradients, issue their reduce_scatter without waiting, drop them.

        ``finish_reduce`` adds the result into ``param.grad``; compute issued in between (the
        backward of earlier blocks) overlaps the transfer."""
        if not self.params:
            return
        self.finish_reduce()
        with torch.no_grad():
            grads = [p.unsharded_grad() for p in self.params]
            # each rank's shards, then one presence flag per parameter: [n * (per_rank + len(params))]
            full = self.layout.pack_grads(grads, self.reduce_dtype, presence=True)
            local = [g is not None for g in grads]
            everywhere = all(has for p, has in zip(self.params, local) if p.requires_grad)
            del grads
            for p in self.params:
                p.clear_unsharded_grad()
            self._reduction = (comm.reduce_scatter_async(full, self.dp.mesh, self.dp.shard_axis, "avg"), everywhere,
                               local)

    def finish_reduce(self) -> None:
        """Wait for the reduce_scatter ``start_reduce`` issued (if any) and accumulate the shards."""
        if self._reduction is None:
            return
        pending, everywhere, local = self._reduction
        self._reduction = None
        per_rank = self.layout.per_rank
        with torch.no_grad():
            mine = pending.wait()  # [per_rank + len(params)]
            if self.dp.replicate_axis is not None:
                mine = comm.all_reduce(mine, self.dp.mesh, self.dp.replicate_axis, "avg")
            if self.divide_factor is not None:  # averaged over dp.mesh.size() ranks: now over divide_factor
                mine[:per_rank] *= self.dp.mesh.size() / self.divide_factor
            # A parameter no rank produced a gradient for keeps grad None, as on one device (an
            # optimizer then skips it); one that some rank used gets the average, zeros included.
            # When this rank had every gradient, all were used: no need to read the flags (reading
            # them copies to the host and waits for the device, so only the rare case does).
            present = [True] * len(self.params) if everywhere else _presence(mine[per_rank:], local)
            for p, shard, used in zip(self.params, self.layout.unpack_shards(mine[:per_rank], self.dp.rank), present):
                if p.requires_grad and used:
                    p.accumulate_sharded_grad(shard)


def _presence(flags: torch.Tensor, local: list[bool]) -> list[bool]:
    """Which parameters some rank produced a gradient for (the reduced presence flags).

    On the meta device (a simulated step, ``shardwise.simulate``) the flags hold no data: every
    rank is taken to produce the gradients this rank produced, as in any program all ranks run alike.
    """
    if flags.is_meta:
        return local
    return (flags > 0).tolist()
