"""Training a Llama-style model with shardwise parallelism: ``python -m shardwise.train``.

Layout (torchtitan's): ``config`` (named model shapes, the job and its validation), ``model``
(single-device decoder), ``data`` (the standard library's source as bytes, deterministic
batches), ``parallelize`` (TP/SP -> activation checkpointing -> FSDP/HSDP/DDP from outside),
``trainer`` (the per-rank loop), ``metrics`` / ``plot`` (progress, summary, loss curve),
``checkpointing`` (where checkpoints plug in), ``cli`` (flags, validation, launching).
"""

from shardwise.train.config import CONFIGS, ConfigError, JobConfig, ModelArgs, get_model_args
from shardwise.train.model import Transformer

__all__ = ["CONFIGS", "ConfigError", "JobConfig", "ModelArgs", "get_model_args", "Transformer"]
