"""A readable checkpoint (``Source``) and the file names that tell the formats apart.

Apart from ``checkpoint/source.py`` so that the readers of other formats
(``shardwise.interop.dcp``, ``shardwise.interop.huggingface``), which ``open_source`` calls, can
build a Source without importing the module that calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shardwise.checkpoint.format import Metadata
from shardwise.checkpoint.safetensors_io import open_file

__all__ = ["Source", "DCP_METADATA_FILE", "HF_INDEX_FILE", "HF_SINGLE_FILE"]

DCP_METADATA_FILE = ".metadata"  # what marks a torch.distributed.checkpoint directory
HF_INDEX_FILE = "model.safetensors.index.json"  # Hugging Face's index of a sharded checkpoint
HF_SINGLE_FILE = "model.safetensors"  # ... and its one file when the model fits in one


@dataclass(frozen=True)
class Source:
    """A readable checkpoint: its metadata, the directory of its files, a label for messages.

    ``opener`` opens one of its files as a context manager with safetensors' ``get_tensor`` /
    ``get_slice``; another format (a ``torch.distributed.checkpoint`` directory) brings its own.
    """

    metadata: Metadata
    directory: str
    label: str
    opener: Callable[[str], Any] = open_file
