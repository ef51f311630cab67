"""Expert parallelism: routed experts split over a mesh axis, tokens exchanged by all_to_all.

``ExpertParallel`` (``style.py``) shards a stacked-experts module and installs the dispatch and
combine around it; ``TensorParallel`` and ``ExpertTensorParallel`` (``tensor_parallel.py``) split
each expert over tp, alone or with ep; ``dispatch.py`` is the pure arithmetic of where the rows go;
``all_to_all.py`` the differentiable exchange; ``TopKExpertParallel`` (``top_k.py``) the same
expert parallelism for experts called with the router's top-k choices (Hugging Face transformers'
MoE models). docs/parallelism.md, "Mixture of experts and expert parallelism"; docs/expert_parallel.md.
"""

from shardwise.parallel.expert_parallel.all_to_all import all_to_all_rows
from shardwise.parallel.expert_parallel.dispatch import DispatchPlan, plan_dispatch
from shardwise.parallel.expert_parallel.style import ExpertParallel
from shardwise.parallel.expert_parallel.tensor_parallel import ExpertTensorParallel, TensorParallel
from shardwise.parallel.expert_parallel.top_k import TopKExpertParallel

__all__ = ["ExpertParallel", "TopKExpertParallel", "TensorParallel", "ExpertTensorParallel", "DispatchPlan",
           "plan_dispatch", "all_to_all_rows"]
