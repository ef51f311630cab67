"""The built-in model families, one folder each; importing this package registers them.

``shardwise.train`` imports it, so the built-in families are registered before any other. A family of your own registers
itself the same way (docs/trainer.md, "Adding a model family").
"""

from shardwise.train.models import llama  # noqa: F401  (registers "llama")
from shardwise.train.models import moe  # noqa: F401  (registers "moe")
