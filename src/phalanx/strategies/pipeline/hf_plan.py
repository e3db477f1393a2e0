"""A transformers model as a sequence of pipeline blocks, read from its ``base_model_pp_plan``.

transformers 5 models declare how they split for pipelining: the base model's config has ``base_model_pp_plan``,
the module names in forward order with their inputs and outputs (Llama: ``embed_tokens``, ``layers``, ``norm``), and
a head model adds its own ``_pp_plan`` (``lm_head``). This file turns such a model into the ``nn.Sequential`` the
pipeline splits: the first planned module (with the rotary position embedding, which the plan does not name),
each decoder layer of the planned ``nn.ModuleList``, then the remaining planned modules and the head's.

Between blocks travel the hidden states and the rotary ``(cos, sin)``, which need no gradient. Each layer builds
the causal mask itself, as the base model's forward would for a batch without padding. The pipelined model is
called as ``model(input_ids)`` and returns the logits (a tensor, not a ``ModelOutput``); ``loss_fn`` computes the
loss from them. Padding masks and caches are not taken.

The blocks keep the model's own modules, so parameters are shared with it (not copied). The sequence also records
where each block's modules sit in the model (``PlannedSequential.homes``): the pipeline stage registers them there,
so that state dicts and checkpoints carry the model's own names (``"model.layers.0.self_attn.q_proj.weight"``,
``"lm_head.weight"``), as under ddp, and ``save_model`` writes what ``from_pretrained`` loads. The stage also takes
the model's config (``PlannedSequential.config``, with ``architectures`` set), which ``save_model`` writes as
``config.json``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["PlannedSequential", "block_homes", "has_pp_plan", "sequential_from_pp_plan"]


def _base_of(model: nn.Module) -> nn.Module | None:
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else None


def _plan_of(model: nn.Module) -> dict[str, Any] | None:
    base = _base_of(model)
    config = getattr(base if base is not None else model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    return plan if isinstance(plan, dict) and plan else None


def has_pp_plan(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model that declares ``base_model_pp_plan``."""
    return _plan_of(model) is not None


class PlannedSequential(nn.Sequential):
    """The blocks of a transformers model, with ``homes``: for each block's name, its modules and their qualified
    names in the model; and ``config``: the model's config, for ``config.json``."""

    homes: dict[str, list[tuple[str, nn.Module]]]
    config: Any


def block_homes(model: nn.Sequential) -> dict[str, list[tuple[str, nn.Module]]]:
    """Where the modules of each block of ``model`` sit in the model the user built: a transformers model's blocks
    wrap its modules (``"3"`` -> ``[("model.layers.2", layer)]``); any other block is its own, under its name."""
    homes = getattr(model, "homes", None)
    return dict(homes) if isinstance(homes, dict) else {n: [(n, b)] for n, b in model.named_children()}


class _Embed(nn.Module):
    """The first planned module, and the rotary (cos, sin) for the layers."""

    def __init__(self, embed: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.embed, self.rotary = embed, rotary

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.embed(input_ids)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        cos, sin = self.rotary(h, position_ids=positions)
        return h, cos, sin


class _Layer(nn.Module):
    """One decoder layer: (hidden, cos, sin) in and out, with the causal mask built as the base model builds it."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "_config", config)  # not a submodule

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        from transformers.masking_utils import create_causal_mask

        h, cos, sin = xs
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self._config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions
        )
        out = self.layer(h, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out, cos, sin


class _Tail(nn.Module):
    """A planned module after the layers (the final norm, the head): it takes the hidden states only."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, xs: tuple[torch.Tensor, ...] | torch.Tensor) -> torch.Tensor:
        h = xs[0] if isinstance(xs, tuple) else xs
        return self.module(h)  # type: ignore[no-any-return]


def sequential_from_pp_plan(model: nn.Module) -> nn.Sequential:
    """The blocks of a transformers model with ``base_model_pp_plan``, for the pipeline to split."""
    plan = _plan_of(model)
    base = _base_of(model) or model
    name = type(model).__name__
    if plan is None:
        raise TypeError(f"{name} has no base_model_pp_plan in its config")
    rotary = getattr(base, "rotary_emb", None)
    names = list(plan)
    lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if rotary is None or len(lists) != 1 or names.index(lists[0]) != 1:
        raise TypeError(
            f"{name}'s base_model_pp_plan {names} is not one phalanx can pipeline: it takes decoder models whose plan "
            "is an embedding, one nn.ModuleList of layers, then modules of the hidden states, with a rotary "
            "embedding at base_model.rotary_emb (Llama, Mistral, Qwen2/3 and others). Write the model as "
            "nn.Sequential(block0, block1, ...) instead"
        )
    config = base.config  # type: ignore[union-attr]
    layers = getattr(base, lists[0])
    n_layers = getattr(config, "num_hidden_layers", len(layers))
    blocks: list[nn.Module] = [_Embed(getattr(base, names[0]), rotary)]
    blocks += [_Layer(layer, config) for layer in list(layers)[:n_layers]]
    blocks += [_Tail(getattr(base, n)) for n in names[2:]]
    # The head's own entries (an instance's _pp_plan also lists the base model's, under its prefix).
    head_plan = getattr(model, "_pp_plan", None) or {}
    if model is not base:
        blocks += [_Tail(getattr(model, n)) for n in head_plan if "." not in n and n not in plan]
    planned = PlannedSequential(*blocks)
    # Each wrapped module's place in the model; a block's modules are its direct children.
    where = {id(m): n for n, m in model.named_modules()}
    planned.homes = {n: [(where[id(m)], m) for m in b.children()] for n, b in planned.named_children()}
    planned.config = copy.deepcopy(getattr(model, "config", config))
    planned.config.architectures = [name]
    return planned
