"""What ``torch.distributed.tensor.experimental`` exports, where shardwise has it.

``implicit_replication`` and ``register_sharding`` live in ``shardwise.dispatch`` (and at the top
level), ``local_map`` in ``shardwise.local_map``, ``context_parallel`` in ``shardwise.parallel``; this module lets ``from torch.distributed.tensor.experimental import ...`` switch to
``from shardwise.experimental import ...``. Names shardwise lacks raise an error saying so
(``shardwise.missing``).
"""

from shardwise.dispatch import implicit_replication, register_sharding
from shardwise.dtensor import DTensor
from shardwise.local_map import local_map
from shardwise.missing import missing_names
from shardwise.parallel.context import context_parallel

__all__ = ["DTensor", "context_parallel", "implicit_replication", "local_map", "register_sharding"]

__getattr__ = missing_names(__name__)
