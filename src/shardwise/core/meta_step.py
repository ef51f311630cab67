"""Whether a step runs on meta tensors on purpose (``shardwise.simulate``).

Code that refuses meta tensors because a real step needs data (fully_shard's and replicate's
forward, ``full_tensor``) lets them through while ``META_STEP`` is set: a simulation wants the
shapes and the collectives, not the values.
"""

from __future__ import annotations

import contextvars

__all__ = ["META_STEP"]

META_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("shardwise_meta_step", default=False)
