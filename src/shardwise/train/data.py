"""Training data: the Python standard library's own source, as bytes.

Every machine with Python has this corpus offline. The files are the ``*.py`` files directly
in the standard library folder (``os.path.dirname(os.__file__)``; sub-folders are left out so
that installed packages never leak in), read in sorted order and joined into one byte string.
The tokenizer is the identity on bytes (vocabulary 256).

Batches are a pure function of (seed, step): step ``s`` draws ``global_batch`` start offsets
from a generator seeded with (seed, s), and sequence ``i`` is ``seq_len + 1`` bytes from offset
``i``. The global batch is therefore the same for every parallel layout; a data-parallel rank
takes its contiguous slice of it. The step counter is the whole data position, so resuming at
step ``s`` continues exactly where a run that never stopped would be.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch

__all__ = ["load_corpus", "corpus_files", "ByteTokenizer", "BatchSource"]


def corpus_files() -> list[str]:
    """The standard library's top-level ``*.py`` files, sorted."""
    root = os.path.dirname(os.__file__)
    return sorted(glob.glob(os.path.join(root, "*.py")))


def load_corpus() -> torch.Tensor:
    """All corpus files joined, as a uint8 tensor of bytes."""
    chunks = []
    for path in corpus_files():
        with open(path, "rb") as f:
            chunks.append(f.read())
    data = b"".join(chunks)
    if not data:
        raise RuntimeError(f"no Python source found in {os.path.dirname(os.__file__)!r}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (nothing to train, nothing to download)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class BatchSource:
    """Deterministic batches of ``seq_len + 1`` tokens (inputs and their next-token labels).

    Args:
        corpus: uint8 token tensor.
        global_batch: sequences per step over all data-parallel ranks.
        seq_len: model input length; each sequence holds one more token for the labels.
        seed: seeds the offsets (with the step).
        dp_degree / dp_rank: this rank takes sequences ``[dp_rank * b, (dp_rank + 1) * b)``
            with ``b = global_batch // dp_degree``.
    """

    corpus: torch.Tensor
    global_batch: int
    seq_len: int
    seed: int
    dp_degree: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if self.global_batch % self.dp_degree:
            raise ValueError(f"global batch {self.global_batch} is not divisible by dp degree {self.dp_degree}")
        if not 0 <= self.dp_rank < self.dp_degree:
            raise ValueError(f"dp_rank {self.dp_rank} is outside dp degree {self.dp_degree}")
        if self.corpus.numel() < self.seq_len + 1:
            raise ValueError(f"corpus has {self.corpus.numel()} tokens, fewer than seq_len + 1 = {self.seq_len + 1}")

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_degree

    def offsets(self, step: int) -> torch.Tensor:
        """Start offsets of the whole global batch at ``step`` (same on every rank)."""
        generator = torch.Generator().manual_seed((self.seed & 0xFFFFFFFF) << 32 | (step & 0xFFFFFFFF))
        high = self.corpus.numel() - self.seq_len  # last valid start + 1
        return torch.randint(0, high, (self.global_batch,), generator=generator)

    def global_batch_at(self, step: int) -> torch.Tensor:
        """The whole batch at ``step``: int64 [global_batch, seq_len + 1]."""
        index = self.offsets(step)[:, None] + torch.arange(self.seq_len + 1)
        return self.corpus[index].long()

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, labels) at ``step``, each int64 [local_batch, seq_len]."""
        start = self.dp_rank * self.local_batch
        offsets = self.offsets(step)[start:start + self.local_batch]
        tokens = self.corpus[offsets[:, None] + torch.arange(self.seq_len + 1)].long()
        return tokens[:, :-1], tokens[:, 1:]
