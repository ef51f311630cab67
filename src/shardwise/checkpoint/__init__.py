"""shardwise.checkpoint: save and load sharded state dicts, resharding on load.

    import shardwise.checkpoint as dcp
    state = {"model": model.state_dict(), "optim": dcp.optimizer_state_dict(model, opt),
             "train": {"step": step, "data_position": pos, "seed": seed}}
    dcp.save(state, f"ckpt/step-{step}")        # every rank; each writes only its own shards
    dcp.load(state, "ckpt/step-100")            # any mesh / placements / world size
    dcp.load_optimizer_state_dict(model, opt, state["optim"])
    dcp.consolidate("ckpt/step-100", "model.safetensors", prefix="model.")  # one process

``save`` and ``load`` are collective over the default process group, like
``torch.distributed.checkpoint``; without one they run in a single process (plain tensors).
No rank ever gathers a tensor: each writes the blocks it owns and reads the chunks it needs.
Every rank must see the same directory (one machine, or a shared file system).

Semantics:

* Leaves are DTensors, plain tensors and JSON scalars (None, bool, int, finite float, str) in
  nested dicts / lists / tuples; keys join with "." (``{"model": {"w": t}}`` -> ``"model.w"``).
  Anything else is rejected with an error naming its key.
* A DTensor block is written by the rank holding it with coordinate 0 on every non-Shard mesh
  axis; a block held by several ranks (plain tensors, DTensors on sub-meshes) by the lowest
  global rank. Plain tensors are thus written by rank 0; scalar values are rank 0's.
  Partial DTensors are rejected: reduce them first.
* ``load`` fills the target in place, in the target's layout (mesh, placements), whatever the
  saving layout. It validates everything (keys, shapes, dtypes, checksums) and reads into
  temporary buffers first; ranks then agree, and either every rank raises the same
  ``CheckpointError`` with nothing changed, or all copy. Keys of the checkpoint missing from
  the target are ignored (loading the model alone out of model + optimizer works).
* ``load`` also accepts a ``.safetensors`` file (e.g. ``safetensors.torch.save_file(
  model.state_dict(), f)``): pass the model state dict itself so the keys match.
* ``load`` also reads a ``torch.distributed.checkpoint`` directory (recognized by its
  ``.metadata``; torchtitan's and torch's FSDP/TP checkpoints) and a Hugging Face sharded
  checkpoint (a directory with ``model.safetensors.index.json``), resharding either into the
  target; ``save(..., format="dcp")`` writes one torch's ``dcp.load`` reads (``shardwise.interop``).
* ``async_save`` saves the same checkpoint while training goes on: it returns once this
  rank's blocks are copied to host buffers, and a thread writes and commits (``asynchronous``).
  One save is in flight at a time; the next save waits for it and raises its error.
* Saving is atomic (see ``commit``): files go to ``<path>.tmp-<token>``, are fsync'ed, rank 0
  writes ``metadata.json`` last and renames the directory into place; a previous checkpoint at
  ``path`` is moved aside just before and removed after. A crash at any point leaves the
  previous checkpoint loadable; a directory without ``metadata.json`` is never loaded.

On-disk format (version 1), readable without shardwise:

* ``<path>/__<rank>.safetensors``: one file per writing rank, standard safetensors (8-byte
  little-endian header size, JSON header, raw little-endian row-major data). Each stored
  tensor is one *chunk*: a box of a global tensor, a row slab (cut along dim 0, at most
  ``max_chunk_bytes``) of the block a rank owns, under the key ``"<tensor key>@<offsets>"``.
* ``<path>/metadata.json``::

    {"format": "shardwise-checkpoint", "version": 1, "checksum": "crc32",
     "tensors": {"model.w": {"dtype": "F32", "shape": [7, 5],
                             "chunks": [{"file": "__0.safetensors", "key": "model.w@0,0",
                                         "offsets": [0, 0], "sizes": [2, 5], "crc32": 123}, ...]}},
     "values": {"train.step": 100, "optim.param_groups.0.lr": 0.001}}

  ``dtype`` uses safetensors names (F32, BF16, I64, ...). The chunks of a tensor tile it
  exactly: to rebuild tensor T, allocate ``shape``, and for each chunk copy the tensor stored
  under ``key`` in ``file`` to ``T[offsets[d]:offsets[d]+sizes[d] for each d]``; ``crc32`` is
  ``zlib.crc32`` of that stored tensor's bytes. A tensor with no elements has no chunks.
"""

from shardwise.checkpoint.asynchronous import async_save
from shardwise.checkpoint.consolidation import consolidate
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import METADATA_FILE, Metadata
from shardwise.checkpoint.pending import AsyncSave, wait_for_pending_save
from shardwise.checkpoint.optimizer import load_optimizer_state_dict, optimizer_state_dict
from shardwise.checkpoint.reader import load
from shardwise.checkpoint.writer import DEFAULT_MAX_CHUNK_BYTES, save

__all__ = [
    "save", "async_save", "AsyncSave", "wait_for_pending_save", "load", "consolidate", "CheckpointError", "optimizer_state_dict",
    "load_optimizer_state_dict", "Metadata", "METADATA_FILE", "DEFAULT_MAX_CHUNK_BYTES",
]
