"""Splitting a mixture-of-experts model's experts over the ep ranks, by the model's own expert-parallel plan.

transformers 5 gives every MoE config a ``base_model_ep_plan`` beside its ``base_model_tp_plan``, e.g. for
Qwen3-MoE and Mixtral::

    {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
     "layers.*.mlp.experts.down_proj": "grouped_gemm",
     "layers.*.mlp.experts": "ep_dispatch_experts"}

A module planned ``ep_dispatch_experts`` is an experts module in transformers' form: its forward takes
``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` and its weights stack the experts on dim 0.
Its parameters planned ``grouped_gemm`` (and any other of its parameters whose dim 0 is the expert count) are cut
along dim 0: ep rank r keeps experts ``[r * E/ep, (r + 1) * E/ep)`` (an :class:`EPParam` on each), its
``num_experts`` becomes ``E/ep``, and its forward is wrapped by the all-to-all dispatch and combine
(``dispatch.py``), which calls the model's own forward on the local experts. The router (``ep_router``, or no
entry) stays whole and replicated: every rank routes its own tokens over all E experts.

Any other module gives its plan as an ``ep_plan()`` method or an ``_ep_plan`` dict (the demo's MoE does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from phalanx.checkpoint.pretrained import is_transformers_model as transformers_model
from phalanx.logging import warn_once
from phalanx.strategies._plans import matches

from .dispatch import DispatchStats, ExpertGroup, dispatch_combine
from .params import ATTR, EPParam

__all__ = ["EPPlanError", "EPReport", "apply_ep_plan", "resolve_ep_plan", "EP_STYLES"]

EP_STYLES = {
    "ep_dispatch_experts": "the experts module: tokens go to the ranks that hold their experts and come back",
    "grouped_gemm": "an experts module's stacked weight, cut along dim 0 (the experts) over the ep ranks",
    "ep_router": "the router: kept whole on every rank, which routes its own tokens (nothing to split)",
}


_TP_STYLES_IN_EP_PLANS = {"colwise", "rowwise", "packed_colwise", "replicated_with_grad_allreduce"}
"""Tensor-parallel styles that transformers' own ep plans hold for dense layers (Gemma 4, Muse Spark)."""


class EPPlanError(ValueError):
    """An expert-parallel plan that cannot be applied to this model."""


@dataclass
class EPReport:
    """What :func:`apply_ep_plan` did."""

    ep: int
    rank: int
    experts: dict[str, int] = field(default_factory=dict)  # module name -> the layer's expert count
    params: dict[str, EPParam] = field(default_factory=dict)
    stats: DispatchStats = field(default_factory=DispatchStats)


def resolve_ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's own expert-parallel plan: a transformers model's ``config.base_model_ep_plan`` under its base
    model's name; any other module's ``ep_plan()`` or ``_ep_plan``."""
    name = type(model).__name__
    if transformers_model(model):
        config = getattr(model, "config", None)
        text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
        base_plan = getattr(config, "base_model_ep_plan", None) or getattr(text, "base_model_ep_plan", None) or {}
        if not base_plan:
            raise EPPlanError(
                f"ep_size > 1, but {name} has no expert-parallel plan (its config has no base_model_ep_plan): it is "
                "not a mixture-of-experts model that transformers can split by expert; train it with ep_size=1"
            )
        base = getattr(model, "base_model", model)
        prefix = "" if base is model else f"{getattr(model, 'base_model_prefix', 'model')}."
        return {prefix + k: v for k, v in base_plan.items()}
    method = getattr(model, "ep_plan", None)
    if callable(method):
        plan = dict(method())
    else:
        plan = dict(getattr(model, "_ep_plan", None) or {})
    if not plan:
        raise EPPlanError(
            f"ep_size > 1, but {name} has no expert-parallel plan: give it an ep_plan() method (or an _ep_plan dict) "
            "naming its experts modules, e.g. {'blocks.*.mlp.experts': 'ep_dispatch_experts'}, or train with ep_size=1"
        )
    return plan


class _EPExperts(nn.Module):
    """An experts module whose forward sends each (token, expert) pair to the expert's rank (see dispatch.py)."""

    _phalanx_ep_group: ExpertGroup

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        local_forward = super().forward  # the model's own, on this rank's experts
        params: list[torch.Tensor] = list(self.parameters(recurse=False))
        return dispatch_combine(
            self._phalanx_ep_group, local_forward, hidden_states, top_k_index, top_k_weights, params
        )


_CLASSES: dict[type, type] = {}


def _swap_class(module: nn.Module) -> None:
    base = type(module)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"EP{base.__name__}", (_EPExperts, base), {})
    module.__class__ = cls


def apply_ep_plan(
    model: nn.Module,
    group: Any,
    ep: int,
    rank: int,
    *,
    plan: dict[str, str] | None = None,
    capacity_factor: float | None = None,
    agree: Any = None,
) -> EPReport:
    """Cut ``model``'s experts in place over the ep process ``group`` (``ep`` ranks; this is ``rank``), as ``plan``
    (default: the model's own) says. Every rank of the group must hold the same whole experts before the call.
    Nothing changes until every entry has been checked; then ``agree(tensors)``, when given, makes the whole expert
    weights equal on the group's ranks (the Engine broadcasts the first ep rank's) before each keeps its piece."""
    own_plan = plan is None
    plan = resolve_ep_plan(model) if plan is None else dict(plan)
    if own_plan:
        # transformers' ep mode spans the whole world, so some models' ep plans also split dense layers over it
        # (Gemma 4's MLP: colwise/rowwise). Here the ep ranks are data-parallel ranks and the dense layers stay
        # replicated over them: those entries are tensor parallelism, which tp_size does.
        dense = {k: v for k, v in plan.items() if v not in EP_STYLES and v in _TP_STYLES_IN_EP_PLANS}
        if dense:
            entries = ", ".join(f"{k}: {v}" for k, v in dense.items())
            warn_once(
                f"the ep plan of {type(model).__name__} also splits dense layers ({entries}); phalanx's ep ranks are "
                "data-parallel ranks, over which the dense layers stay replicated, so those entries are left out "
                "(split dense layers with tp_size)"
            )
            plan = {k: v for k, v in plan.items() if k not in dense}
    for key, value in plan.items():
        if value not in EP_STYLES:
            raise EPPlanError(
                f"ep plan entry {key!r}: style {value!r} is not an expert-parallel style phalanx knows (the styles: "
                + "; ".join(f"{k}: {v}" for k, v in EP_STYLES.items())
                + ")"
            )
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    experts = [n for n in modules if n and any(matches(k, n) for k, v in plan.items() if v == "ep_dispatch_experts")]
    for key, value in plan.items():
        if not any(matches(key, n) for n in [*modules, *params] if n):
            raise EPPlanError(
                f"ep plan entry {key!r} ({value}) matches no module or parameter of {type(model).__name__}"
            )
    if not experts:
        raise EPPlanError(f"the ep plan of {type(model).__name__} names no experts module ('ep_dispatch_experts')")
    cuts: list[tuple[str, nn.Module, int, list[str]]] = []
    for name in experts:
        module = modules[name]
        own = dict(module.named_parameters(recurse=False))
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int):
            stacked = [p.shape[0] for p in own.values() if p.dim() >= 3]  # [E, out, in]: a Linear's are 2-D
            count = stacked[0] if stacked and len(set(stacked)) == 1 else None
        if count is None:
            raise EPPlanError(
                f"{name} is planned 'ep_dispatch_experts', but it has no num_experts and no stacked expert weights "
                "(3-D parameters whose dim 0 is the expert count): phalanx splits experts in transformers' form only"
            )
        if count % ep:
            raise EPPlanError(
                f"{name} has {count} experts, which do not divide over ep_size={ep}: use an ep_size that divides "
                f"{count}"
            )
        named = [p for p in own if any(matches(k, f"{name}.{p}") for k, v in plan.items() if v == "grouped_gemm")]
        stacked_names = [p for p, t in own.items() if t.dim() >= 1 and t.shape[0] == count]
        odd = [p for p in own if p not in stacked_names]
        if odd:
            raise EPPlanError(
                f"{name} is planned 'ep_dispatch_experts', but its parameter(s) {odd} are not stacked by expert (dim 0 "
                f"is not its {count} experts), so they cannot be split by expert"
            )
        bad = [p for p in named if p not in stacked_names]
        if bad:
            raise EPPlanError(f"{name}.{bad[0]} is planned 'grouped_gemm' but its dim 0 is not the {count} experts")
        inner = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
        if inner:
            raise EPPlanError(
                f"{name} is planned 'ep_dispatch_experts' but has submodules with weights ({', '.join(inner)}): "
                "phalanx splits an experts module whose weights are its own stacked parameters"
            )
        cuts.append((name, module, count, stacked_names))

    # ---- from here on the model changes
    if agree is not None:
        agree([module._parameters[n].data for _, module, _, names in cuts for n in names])  # type: ignore[union-attr]
    report = EPReport(ep, rank)
    for name, module, count, names in cuts:
        local = count // ep
        for pname in names:
            p = module._parameters[pname]
            assert p is not None
            info = EPParam(tuple(p.shape), ep, rank)
            piece = p.detach()[rank * local : (rank + 1) * local].clone()
            new = nn.Parameter(piece, requires_grad=p.requires_grad)
            tp_info = getattr(p, "_phalanx_tp", None)
            if tp_info is not None:
                new._phalanx_tp = tp_info  # type: ignore[attr-defined]
            setattr(new, ATTR, info)
            module._parameters[pname] = new
            report.params[f"{name}.{pname}"] = info
        if isinstance(getattr(module, "num_experts", None), int):
            module.num_experts = local  # type: ignore[assignment]
        _swap_class(module)
        module._phalanx_ep_group = ExpertGroup(  # type: ignore[assignment]
            group, ep, rank, count, capacity_factor, report.stats, label=f"ep {name}"
        )
        report.experts[name] = count
    return report
