"""Planning a training run before it starts: will the model fit, on which layout, at what traffic.

    phalanx plan --model tests/data/plan/llama3-8b/config.json --nproc-per-node 8 --device-memory 80GB

``model.py`` reads a model's sizes without allocating it (a factory, a transformers config or weights on disk, built
on the meta device); ``activations.py`` counts what a decoder layer keeps for backward under each checkpointing
policy; ``estimate.py`` gives one layout's bytes per rank (model states, activations, buffers, transients) and its
traffic; ``schedules.py`` gives each pipeline schedule's bubble and what each rank holds; ``layouts.py`` lists the
layouts a world allows (pipelines under each schedule) and recommends one; ``reference.py`` holds the ZeRO paper's
and DeepSpeed's model-state formulas; ``cli.py`` is the command. docs/plan.md has the formulas and their sources.
"""

from phalanx.planning.estimate import Estimate, Layout, Workload, World, estimate
from phalanx.planning.layouts import candidate_layouts, plan, recommend
from phalanx.planning.model import ModelShape, PlanError, load_shape, shape_of

__all__ = [
    "Estimate",
    "Layout",
    "ModelShape",
    "PlanError",
    "Workload",
    "World",
    "candidate_layouts",
    "estimate",
    "load_shape",
    "plan",
    "recommend",
    "shape_of",
]
