"""Expert parallelism: routed experts split over a mesh axis, tokens exchanged by all_to_all.

``ExpertParallel`` (``style.py``) shards a stacked-experts module and installs the dispatch and
combine around it; ``dispatch.py`` is the pure arithmetic of where the rows go;
``all_to_all.py`` the differentiable exchange. README, "Expert parallelism".
"""

from shardwise.parallel.expert_parallel.all_to_all import all_to_all_rows
from shardwise.parallel.expert_parallel.dispatch import DispatchPlan, plan_dispatch
from shardwise.parallel.expert_parallel.style import ExpertParallel

__all__ = ["ExpertParallel", "DispatchPlan", "plan_dispatch", "all_to_all_rows"]
