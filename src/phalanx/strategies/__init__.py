"""The strategies: how work and state are spread over ranks. Each is a :class:`~phalanx.strategies.base.Strategy`,
named in ``phalanx/config/registry.py`` with the settings it reads; the Engine looks it up there by name.

- ``base.py``           the Strategy interface
- ``ddp.py``            bucketed, overlapped all-reduce (GradReducer): the gradient path starts here
- ``zero/``             ZeRO stages 1-3, with offload
- ``pipeline/``         GPipe and 1F1B over stages, with data parallelism inside each stage
- ``context_parallel/`` long sequences over the cp ranks: ring attention, Ulysses, the batch cut, attention routing
- ``tensor_parallel/``  Megatron-style layers split in place by a plan
- ``expert_parallel/``  mixture-of-experts layers' experts over the ep ranks: the plan, the all-to-all dispatch
- ``_grads.py``         the gradient scale contract, the bucket builder, the gradient errors
- ``_replicas.py``      replica checks and broadcast from the first replica
- ``_memory.py``        memory_report helpers
- ``_plans.py``         the plans' name patterns (tensor- and expert-parallel)
- ``_views.py``         the checkpoint view both use: whole tensors from each parameter's placement
- ``deferred_init.py``  a model built on the meta device, given its values at prepare (zero3: unit by unit)
"""
