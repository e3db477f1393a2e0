"""DeepSpeed's expert-parallel keys (the AutoEP block and the rank-order key) read as phalanx's ``ep_size``, noted,
or refused with the reason; deepspeed.py calls :func:`map_expert_parallel` for the whole file."""

from __future__ import annotations

import difflib
from typing import Any

from phalanx.config.dialects.mapping import Mapped
from phalanx.config.options import ConfigError

__all__ = ["EP_KEYS", "map_expert_parallel"]

# DeepSpeed's AutoEP block (deepspeed/module_inject/auto_ep_config.py, parse_autoep_config; the "Expert Parallel
# (AutoEP)" section of DeepSpeed's config-json page). AutoEP finds a Hugging Face model's MoE blocks (by a preset for
# the model family, or the patterns below) and swaps in its own layer, whose experts are split over autoep_size ranks.
# phalanx keeps the model's own MoE blocks (their router, their auxiliary loss) and splits the experts that the
# model's base_model_ep_plan names over ep_size ranks. These are the only MoE keys of a ds_config: DeepSpeed's own MoE
# layer (deepspeed.moe.layer.MoE) takes num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity,
# drop_tokens, use_rts, noisy_gate_policy, use_residual and enable_expert_tensor_parallelism as constructor arguments
# in the model's code, which a config file never holds (and a phalanx script does not build that layer); its
# capacity_factor with drop_tokens is phalanx's moe_capacity_factor, and AutoEP, like phalanx's default, is dropless.
_EP_NOTED = {
    "preset_model": "names the model family whose MoE layout AutoEP knows (mixtral, qwen3_moe, qwen3_5_moe, "
    "deepseek_v2, deepseek_v3); phalanx reads the layout from the model itself (its base_model_ep_plan)",
    "use_grouped_mm": "a DeepSpeed kernel choice for AutoEP's experts; phalanx runs the model's own expert code",
    "disable_triton_grouped_mm": "a DeepSpeed kernel choice for AutoEP's experts; phalanx runs the model's own expert "
    "code",
    "combine_impl": "how AutoEP's layer sums the experts' weighted outputs (a kernel choice); phalanx sums them as the "
    "model's own MoE block does",
    "validate_folding_routing": "a debugging check of DeepSpeed's AutoEP+AutoTP folding",
}
# Each overrides, in AutoEP's replacement layer, a part of the routing that the model's config already says; their
# default ("auto", or null) reads it from the preset and the model's config, which is what phalanx runs: the model's
# own router. Another value asks for a routing the model's code does not do, and is refused: (default, why, fix).
_EP_ROUTING: dict[str, tuple[Any, str, str]] = {
    "score_func": ("auto", "it overrides the router's scoring function (softmax or sigmoid), and phalanx runs the "
                   "model's own router, which scores as its code and config say (e.g. scoring_func)",
                   'remove it (or write "auto")'),
    "score_apply": ("auto", "it moves where the router's weights multiply (before or after the experts), and phalanx "
                    "runs the model's own MoE block, which applies them where its code does",
                    'remove it (or write "auto")'),
    "route_norm": (None, "it overrides whether the top-k weights are renormalised, and phalanx runs the model's own "
                   "router", "set norm_topk_prob in the model's config instead, and remove route_norm"),
    "route_scale": (1.0, "it scales the router's weights, and phalanx runs the model's own router",
                    "set routed_scaling_factor in the model's config instead, and remove route_scale"),
    "routed_scaling_factor": ("auto", "it overrides the routed experts' scale, and phalanx runs the model's own "
                              "router", "set routed_scaling_factor in the model's config instead, and remove it here"),
    "top_k": ("auto", "it overrides the number of experts per token, and phalanx runs the model's own router, which "
              "reads it from the model's config",
              "set it in the model's config (num_experts_per_tok for most models), and remove top_k"),
    "num_expert_groups": (None, "it overrides group-limited routing, and phalanx runs the model's own router",
                          "set n_group in the model's config instead, and remove num_expert_groups"),
    "num_limited_groups": (None, "it overrides group-limited routing, and phalanx runs the model's own router",
                           "set topk_group in the model's config instead, and remove num_limited_groups"),
    "load_balance_coeff": (None, "it asks for auxiliary-loss-free load balancing by an expert bias that the training "
                           "loop updates (DeepSpeed refuses any value but null too), and phalanx has none: the "
                           "model's own router loss balances the experts (router_aux_loss_coef, with "
                           "output_router_logits)", "remove it, or write null"),
}  # fmt: skip
# Where AutoEP's detection finds a model's MoE layers, router and expert weights without a preset (or overriding the
# preset's names). phalanx takes no such patterns: it splits the experts that the model's base_model_ep_plan names.
_EP_DETECTION = (
    "moe_layer_pattern", "router_pattern", "expert_pattern", "expert_w1", "expert_w2", "expert_w3",
    "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern", "shared_experts_gate_pattern",
)  # fmt: skip
EP_KEYS = frozenset({"enabled", "autoep_size", "expert_tensor_parallel_size", *_EP_NOTED, *_EP_ROUTING, *_EP_DETECTION})


def _auto(value: Any) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def map_expert_parallel(data: dict[str, Any], out: Mapped, where: str) -> None:
    """DeepSpeed's AutoEP: ``autoep_size`` is phalanx's ep_size, the experts split over ranks carved out of the
    data-parallel ranks. The split is the model's own (its base_model_ep_plan) and so is the routing; the keys that
    describe the model to AutoEP are noted or, where they would change what the model computes, refused."""
    block = data.get("expert_parallel")
    layout = data.get("use_data_before_expert_parallelism")
    size = 1
    if block is not None:
        size = _read_expert_parallel(block, out, where)
    if "use_data_before_expert_parallelism" not in data:
        return
    name = "use_data_before_expert_parallelism"
    if not isinstance(layout, bool):
        raise ConfigError(f"DeepSpeed config {where}: {name} is true or false; got {layout!r}")
    if size <= 1:
        out.ignore(name, "read only with expert parallelism (expert_parallel with autoep_size above 1)")
    elif not layout:
        out.ignore(name, "false: each expert-parallel group is consecutive data-parallel ranks, as phalanx lays them")
    else:
        out.ignore(name, "true: DeepSpeed's D + E rank order (see the note)")
        out.notes.append(
            f"{name}=true: DeepSpeed then strides each expert-parallel group across the data-parallel ranks and "
            "keeps the ranks that hold the same experts consecutive; phalanx always lays the expert-parallel groups "
            f"on consecutive data-parallel ranks (DeepSpeed's default, false), so that the all-to-alls of "
            f"ep_size={size} stay within a machine. The update is the same (every expert's gradient is averaged "
            "over every data-parallel rank); which ranks exchange tokens differs"
        )


def _read_expert_parallel(block: Any, out: Mapped, where: str) -> int:
    """The ``expert_parallel`` block; returns the ep degree it sets (1 for none)."""
    if not isinstance(block, dict):
        raise ConfigError(
            f'DeepSpeed config {where}: expert_parallel must be an object such as {{"enabled": true, "autoep_size": 2}}'
            f"; got {block!r}"
        )
    known = EP_KEYS
    for key in block:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"DeepSpeed config {where}: unknown key 'expert_parallel.{key}'; {hint}known: "
                + ", ".join(sorted(known))
            )
    enabled = block.get("enabled", False)
    if _auto(enabled):
        out.ignore("expert_parallel", "enabled auto: ep_size comes from the other settings (--ep-size)")
        return 1
    if not isinstance(enabled, bool):
        raise ConfigError(f"DeepSpeed config {where}: expert_parallel.enabled is true or false; got {enabled!r}")
    if not enabled:  # DeepSpeed reads none of the block's other keys then
        out.ignore("expert_parallel", "enabled false: no expert parallelism (DeepSpeed reads none of its other keys)")
        return 1
    size = block.get("autoep_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(
            f"DeepSpeed config {where}: expert_parallel.autoep_size must be a whole number of at least 1 (1 for every "
            f"expert on every rank); got {size!r}"
        )
    if size > 1:
        out.set("ep_size", size, "expert_parallel.autoep_size")
        out.notes.append(
            f"expert_parallel.autoep_size={size}: phalanx splits the experts of every MoE layer over {size} ranks and "
            "sends each token to its experts' ranks and back by all-to-all, as AutoEP does, and drops no token, as "
            "AutoEP drops none (moe_capacity_factor unset). The experts are the ones the model's own "
            "base_model_ep_plan names (AutoEP finds them by its preset or patterns instead), and the routing and "
            "auxiliary loss are the model's own (AutoEP swaps in its own layer). The ep ranks are carved out of the "
            "data-parallel ranks, so ep_size divides dp_replicate x dp_shard x cp (DeepSpeed's AutoEP+AutoTP folding "
            "may also lay an expert group across tensor-parallel ranks, which phalanx does not)"
        )
    else:
        out.ignore("expert_parallel.autoep_size", "1: every rank holds every expert (no all-to-all), as ep_size=1")
    for key, value in block.items():
        name = f"expert_parallel.{key}"
        if key in ("enabled", "autoep_size"):
            continue
        if key == "expert_tensor_parallel_size":
            if value != 1 or isinstance(value, bool):
                raise ConfigError(
                    f"DeepSpeed config {where}: {name}={value!r} cannot be honoured: it splits each expert over "
                    "ranks (expert tensor parallelism), which phalanx does not do (DeepSpeed refuses any value but 1 "
                    "too); use 1 or leave it out"
                )
            out.ignore(name, "1: each expert whole on its rank, as phalanx keeps it")
        elif key in _EP_NOTED:
            out.ignore(name, _EP_NOTED[key])
        elif key in _EP_ROUTING:
            default, why, fix = _EP_ROUTING[key]
            if value != default or isinstance(value, bool):
                raise ConfigError(f"DeepSpeed config {where}: {name}={value!r} cannot be honoured: {why}; {fix}")
            shown = "null" if value is None else repr(value)
            out.ignore(name, f"{shown}: the model's own routing, as phalanx runs it")
        elif value is None:
            out.ignore(name, "null: not used (phalanx reads the layout from the model)")
        else:
            raise ConfigError(
                f"DeepSpeed config {where}: {name}={value!r} cannot be honoured: it tells AutoEP's detection where a "
                "model's MoE layers, router or expert weights are, and phalanx takes no such patterns: it splits the "
                "experts that the model's own base_model_ep_plan names. Remove it, and use a model whose config "
                "class has a base_model_ep_plan (most of transformers' MoE models carry one)"
            )
    return size
