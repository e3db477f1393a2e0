"""Expert parallelism: the experts of mixture-of-experts layers split over ranks carved out of the data-parallel
ranks, tokens sent to their experts and back by all-to-all.

- ``params.py``      :class:`EPParam` (an ep rank's experts of a stacked weight) and the dense/expert split
- ``plan.py``        the model's ``base_model_ep_plan`` (or ``ep_plan()``) applied in place: experts cut by dim 0,
                     the experts module's forward wrapped
- ``dispatch.py``    the all-to-all dispatch and combine, dropless or with a capacity factor
- ``aux_loss.py``    the router's load-balancing loss over every data-parallel rank's tokens (an option)
- ``checkpoint.py``  :class:`EPCheckpointView`: whole expert tensors in checkpoints, any layout to any other

The data-parallel strategies reduce (and zero shards) expert parameters over the expert-replica ranks
(``Topology.expert_dp_group``, ``expert_shard_group``) and the rest over the dp ranks, as before.
"""

from .aux_loss import global_load_balancing_loss, use_global_aux_loss
from .dispatch import DispatchStats, ExpertGroup, dispatch_combine, dispatch_elements, dispatch_stats
from .params import EPParam, ep_param_info, is_expert, split_dense_experts
from .plan import EPPlanError, EPReport, apply_ep_plan, resolve_ep_plan

__all__ = [
    "DispatchStats", "EPParam", "EPPlanError", "EPReport", "ExpertGroup", "apply_ep_plan", "dispatch_combine",
    "dispatch_elements", "dispatch_stats", "ep_param_info", "global_load_balancing_loss", "is_expert",
    "resolve_ep_plan", "split_dense_experts", "use_global_aux_loss",
]  # fmt: skip
