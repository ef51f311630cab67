"""Training a model with shardwise parallelism: ``python -m shardwise.train``.

Layout (torchtitan's): ``spec`` (model families: what the trainer knows of a model, registered
by name), ``models/<family>/`` (one folder per family: its single-device model, configs and
tensor-parallel plan; ``models/llama`` is built in), ``config`` (the job and its validation),
``data`` (the standard library's source as bytes, deterministic batches), ``parallelize`` (the
family's TP/SP -> activation checkpointing -> compile -> FSDP/HSDP/DDP, from outside),
``trainer`` (the per-rank loop), ``metrics`` / ``plot`` (progress, summary, loss curve),
``checkpointing`` (where checkpoints plug in), ``cli`` (flags, validation, launching).
"""

from shardwise.train.config import ConfigError, JobConfig, get_model_args
from shardwise.train.spec import ModelFamily, family_names, get_family, register_family
from shardwise.train import models  # noqa: F401  (registers the built-in families, first)

__all__ = ["ConfigError", "JobConfig", "get_model_args", "ModelFamily", "register_family", "get_family",
           "family_names"]
