"""What ``torch.distributed.tensor.experimental`` exports, where shardwise has it.

``implicit_replication`` and ``register_sharding`` live in ``shardwise.dispatch`` (and at the top
level), ``local_map`` in ``shardwise.tensor.local_map``, ``context_parallel`` in ``shardwise.parallel``; this module lets ``from torch.distributed.tensor.experimental import ...`` switch to
``from shardwise.experimental import ...``. Names shardwise lacks raise an error saying so
(``shardwise.core.missing``).
"""

from shardwise.dispatch import implicit_replication, register_sharding
from shardwise.tensor.dtensor import DTensor
from shardwise.tensor.local_map import local_map
from shardwise.core.missing import missing_names
from shardwise.parallel.context_parallel.context import context_parallel

__all__ = ["DTensor", "context_parallel", "implicit_replication", "local_map", "register_sharding"]

__getattr__ = missing_names(__name__)
