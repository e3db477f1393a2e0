"""What the planner needs to know of a model, read without allocating it: a factory, a transformers config, or the
weights on disk, built on the meta device.

    shape = load_shape("tests/data/plan/llama3-8b/config.json")   # transformers AutoConfig + from_config, on meta
    shape = load_shape("my_pkg.models:build")                      # a factory: called with no arguments, on meta
    shape = load_shape("ckpt/step-1000")                           # a phalanx checkpoint or a save_pretrained dir
    shape.params, shape.layers, shape.hidden                       # 8030261248, 32, 4096

Counts come from the module tree (tied parameters once); zero3's units are the modules the strategy itself would
gather (``unit_modules_of``), and the transformer dimensions come from the model's config where it has one (a
transformers config, or a ``cfg``/``config`` dataclass with the usual names), else from the parameters' names and
shapes (a checkpoint without ``config.json``).
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.strategies.zero.zero3 import unit_modules_of

__all__ = ["PlanError", "ModelShape", "shape_of", "load_shape", "human_count"]


class PlanError(ValueError):
    """A model, world or workload the planner cannot plan: the message names the value and the fix."""


@dataclass(frozen=True)
class ModelShape:
    """A model's sizes, in elements, as the planner uses them. Transformer dimensions are 0 where unknown."""

    source: str
    """What it was read from, and how (``config.json (LlamaForCausalLM)``, ``factory pkg.mod:fn``, ...)."""
    params: int
    """Trainable elements (Psi), tied parameters counted once."""
    frozen: int = 0
    """Elements of parameters that do not train (held, with no gradient or optimizer state)."""
    param_numels: tuple[int, ...] = ()
    """Each trainable parameter's elements, in registration order (buckets are cut from it, last first)."""
    largest_param: int = 0
    """Elements of the largest parameter: autograd's fresh gradient and the optimizer's temporaries."""
    largest_layer: int = 0
    """DeepSpeed's ``largest_layer_params``: the most elements one module holds directly (its own parameters)."""
    units: tuple[int, ...] = ()
    """Elements of each zero3 unit (the modules zero3 gathers one at a time), in order."""
    root: int = 0
    """Elements outside every unit (zero3's root unit: embeddings, final norm, head, tied parameters)."""
    vector_params: int = 0
    """Elements of 1-D parameters (norms, biases): replicated under tensor parallelism."""
    embed_params: int = 0
    head_params: int = 0
    """The input embedding's and the output head's elements (0 for a head tied to the embedding)."""
    expert_params: int = 0
    """Elements of mixture-of-experts expert weights (parameters under an ``experts`` module)."""
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    intermediate: int = 0
    vocab: int = 0
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    gated_mlp: bool = False
    """A gated MLP (SwiGLU: gate, up and down projections) rather than two matmuls around an activation."""
    tied_embeddings: bool = False
    dropout: float = 0.0
    attention: str = "sdpa"
    """``eager`` keeps the attention scores for backward (the s^2 term); ``sdpa``/``flash`` recompute them."""
    norm: str = "layernorm"
    """``rmsnorm``: transformers' RMSNorm, computed in fp32, which keeps an fp32 copy of its input and the normalized
    tensor; ``layernorm``: a norm that keeps its input (torch's LayerNorm and RMSNorm)."""
    max_positions: int = 0
    built_dtype: str = "float32"
    notes: tuple[str, ...] = field(default=())

    @property
    def is_decoder(self) -> bool:
        """Whether the activation model applies: a stack of transformer layers with known widths."""
        return self.layers > 0 and self.hidden > 0 and self.vocab > 0

    @property
    def dense_params(self) -> int:
        return self.params - self.expert_params

    @property
    def layer_params(self) -> float:
        """Elements of one of the model's blocks (zero3's units: a decoder layer), on average."""
        return sum(self.units) / len(self.units) if self.units else 0.0


# ------------------------------------------------------------------------------------------- from a module
_ALIASES = {
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"),
    "head_dim": ("head_dim", "kv_channels"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab": ("vocab_size", "padded_vocab_size"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts", "n_experts", "moe_num_experts"),
    "experts_per_token": ("num_experts_per_tok", "top_k", "moe_top_k", "moe_topk"),
    "expert_intermediate": ("moe_intermediate_size", "expert_intermediate_size", "expert_width"),
    "max_positions": ("max_position_embeddings", "n_positions", "block_size", "max_seq_len", "seq_length"),
}
_DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "dropout", "hidden_dropout_prob")


def _first(config: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _dims_from_config(config: Any) -> dict[str, Any]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dims: dict[str, Any] = {}
    for key, names in _ALIASES.items():
        value = _first(text, names)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            dims[key] = int(value)
    if getattr(text, "moe", True) is False:  # phalanx's demo GPTConfig: n_experts is set, but the MLP is dense
        for key in ("experts", "experts_per_token", "expert_intermediate"):
            dims.pop(key, None)
    drops = [float(v) for name in _DROPOUTS if isinstance(v := getattr(text, name, None), (int, float))]
    dims["dropout"] = max(drops, default=0.0)
    attention = getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)
    if isinstance(attention, str):
        dims["attention"] = "eager" if attention == "eager" else "sdpa"
    tie = getattr(text, "tie_word_embeddings", None)
    if isinstance(tie, bool):
        dims["tied_embeddings"] = tie
    return dims


def _layer_index_runs(names: list[str]) -> int:
    """The longest run of numbered children under one prefix (``model.layers.0`` .. ``model.layers.31``: 32)."""
    found: dict[str, set[int]] = {}
    for name in names:
        for m in re.finditer(r"(?:^|\.)(\d+)\.", name):
            found.setdefault(name[: m.start(1)], set()).add(int(m.group(1)))
    return max((len(v) for v in found.values()), default=0)


def _dims_from_tensors(model: nn.Module) -> dict[str, Any]:
    """Transformer widths guessed from names and shapes, for a model that carries no config."""
    named = list(model.named_parameters())
    dims: dict[str, Any] = {"layers": _layer_index_runs([n for n, _ in named])}
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    table = embeds[0].weight if embeds else None
    if table is None:
        table = next((p for n, p in named if p.dim() == 2 and re.search(r"embed|wte|tok", n)), None)
    if table is not None:
        dims["vocab"], dims["hidden"] = int(table.shape[0]), int(table.shape[1])
        h = dims["hidden"]
        widths = [max(p.shape) for n, p in named if p.dim() == 2 and h in p.shape and p is not table]
        wider = [w for w in widths if w > h and w != dims["vocab"]]
        if wider:
            dims["intermediate"] = max(set(wider), key=wider.count)
    return dims


def _gated(model: nn.Module, units: list[nn.Module], intermediate: int) -> bool:
    """A gated MLP has three matrices with the intermediate width per layer (gate, up, down), a plain one two."""
    if not intermediate:
        return False
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    if names & {"gate_proj", "w1", "w3", "gate_up_proj", "fc1_g"}:
        return True
    block = units[0] if units else model
    wide = [p for p in block.parameters() if p.dim() == 2 and intermediate in p.shape]
    return len(wide) >= 3


def _module_call(model: nn.Module, method: str) -> nn.Module | None:
    """``model.<method>()`` (transformers' get_input_embeddings, say) when the model has it and it gives a module."""
    fn = getattr(model, method, None)
    try:
        found = fn() if callable(fn) else None
    except NotImplementedError:  # transformers' base class, for a model that does not say
        return None
    return found if isinstance(found, nn.Module) else None


def _norm_kind(model: nn.Module) -> str:
    """``rmsnorm`` for a model whose norms are transformers' RMSNorm classes (computed in fp32), else ``layernorm``."""
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm") and type(m) is not getattr(nn, "RMSNorm", None):
            return "rmsnorm"
    return "layernorm"


def shape_of(model: nn.Module, source: str, config: Any = None) -> ModelShape:
    """The :class:`ModelShape` of ``model`` (any device, meta included); ``config`` gives the transformer widths
    (default: the model's own ``config`` or ``cfg``)."""
    seen: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    params = list(seen.values())
    trainable = [p for p in params if p.requires_grad]
    if not params:
        raise PlanError(f"{source}: the model has no parameters; give a model to plan (see phalanx plan --help)")
    largest_layer = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    units = unit_modules_of(model, None)
    owners: dict[int, set[int]] = {}
    for i, (_, m) in enumerate(units):
        for p in m.parameters():
            owners.setdefault(id(p), set()).add(i)
    unit_sizes = [0] * len(units)
    root = 0
    for p in params:
        where = owners.get(id(p), set())
        if len(where) == 1:
            unit_sizes[next(iter(where))] += p.numel()
        else:
            root += p.numel()
    config = config if config is not None else getattr(model, "config", None) or getattr(model, "cfg", None)
    dims = _dims_from_tensors(model)
    if config is not None:
        dims.update(_dims_from_config(config))
    notes: list[str] = []
    if config is None and dims.get("hidden"):
        notes.append("transformer widths guessed from parameter names and shapes (no config)")
    if not (dims.get("layers") and dims.get("hidden") and dims.get("vocab")):
        notes.append("activations not counted: not a decoder stack with known widths (give its transformers config)")
    heads = dims.get("heads", 0)
    hidden = dims.get("hidden", 0)
    dims.setdefault("kv_heads", heads)
    if heads and hidden:
        dims.setdefault("head_dim", hidden // heads)
    if hidden and not dims.get("intermediate"):
        dims["intermediate"] = 4 * hidden
    embed = _module_call(model, "get_input_embeddings")
    if embed is None:
        embed = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    head = _module_call(model, "get_output_embeddings")
    if head is None:
        head = next((m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("head", "lm_head")), None)
    embed_weight = getattr(embed, "weight", None)
    head_weight = getattr(head, "weight", None)
    tied = embed_weight is not None and head_weight is embed_weight
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}" and p.requires_grad)
    unit_modules = [m for _, m in units]
    dtype = str(params[0].dtype).removeprefix("torch.")
    return ModelShape(
        source=source,
        params=sum(p.numel() for p in trainable),
        frozen=sum(p.numel() for p in params if not p.requires_grad),
        param_numels=tuple(p.numel() for p in trainable),
        largest_param=max(p.numel() for p in params),
        largest_layer=largest_layer,
        units=tuple(unit_sizes),
        root=root,
        vector_params=sum(p.numel() for p in params if p.dim() <= 1),
        embed_params=embed_weight.numel() if isinstance(embed_weight, torch.Tensor) else 0,
        head_params=0 if tied or not isinstance(head_weight, torch.Tensor) else head_weight.numel(),
        expert_params=expert_params,
        layers=dims.get("layers", 0),
        hidden=hidden,
        heads=heads,
        kv_heads=dims.get("kv_heads", 0),
        head_dim=dims.get("head_dim", 0),
        intermediate=dims.get("intermediate", 0),
        vocab=dims.get("vocab", 0),
        experts=dims.get("experts", 0) if expert_params else 0,
        experts_per_token=dims.get("experts_per_token", 0) if expert_params else 0,
        expert_intermediate=dims.get("expert_intermediate", 0) if expert_params else 0,
        gated_mlp=_gated(model, unit_modules, dims.get("intermediate", 0)),
        tied_embeddings=tied or bool(dims.get("tied_embeddings", False) and head_weight is None),
        dropout=dims.get("dropout", 0.0),
        attention=dims.get("attention", "sdpa"),
        norm=_norm_kind(model),
        max_positions=dims.get("max_positions", 0),
        built_dtype=dtype,
        notes=tuple(notes),
    )


# ------------------------------------------------------------------------------------------- from a spec
def _from_factory(spec: str) -> ModelShape:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PlanError(f"--model {spec}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PlanError(f"--model {spec}: {module_name} has no callable {attr!r} (write pkg.module:function)")
    try:
        with torch.device("meta"):
            model = fn()
    except TypeError as e:
        raise PlanError(f"--model {spec}: {attr}() must build the model with no arguments ({e})") from e
    if not isinstance(model, nn.Module):
        raise PlanError(f"--model {spec}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module")
    return shape_of(model, f"factory {spec}")


def _from_config(config: Any, source: str) -> ModelShape:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - transformers is a test dependency here
        raise PlanError(f"{source}: reading a transformers config needs transformers (pip install transformers)") from e
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM (an encoder, say): its base model
            from transformers import AutoModel

            try:
                model = AutoModel.from_config(config)
            except ValueError as e:
                raise PlanError(f"{source}: transformers builds no model from this config ({e})") from e
    arch = type(model).__name__
    return shape_of(model, f"{source} ({arch})", config)


def _read_config(path: Path) -> Any:
    from transformers import AutoConfig

    if not json.loads(path.read_text()).get("model_type"):
        raise PlanError(f'{path}: a transformers config.json names its model_type (e.g. "llama"); this one does not')
    return AutoConfig.from_pretrained(str(path))


def load_shape(spec: str) -> ModelShape:
    """The :class:`ModelShape` of ``--model``: ``pkg.module:function`` (a factory, called on the meta device), a
    ``config.json`` or a directory holding one (transformers' ``from_config``, on meta), a phalanx checkpoint or a
    directory of safetensors weights, or a transformers config name (``AutoConfig.from_pretrained``, from its cache or
    the Hub)."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        return _from_config(_read_config(path), str(spec))
    if path.is_dir():
        if (path / "config.json").is_file():
            return _from_config(_read_config(path / "config.json"), str(path / "config.json"))
        from phalanx.inference.plan import DispatchError
        from phalanx.inference.plan_cli import _model_at

        try:
            model, what = _model_at(path)
        except (DispatchError, OSError, KeyError, ValueError) as e:
            raise PlanError(
                f"--model {spec}: not a phalanx checkpoint or a directory of safetensors weights ({e})"
            ) from e
        shape = shape_of(model, f"{spec} ({what})")
        # Weights on disk carry no requires_grad: every parameter trains.
        numels = tuple(p.numel() for p in model.parameters())
        return replace(shape, params=shape.params + shape.frozen, frozen=0, param_numels=numels)
    if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", spec):
        return _from_factory(spec)
    if path.exists():
        raise PlanError(
            f"--model {spec}: give a config.json, a directory with one, a phalanx checkpoint, a directory of "
            "safetensors weights, a factory pkg.module:function or a transformers config name"
        )
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(spec)
    except (OSError, ValueError, ImportError) as e:
        raise PlanError(
            f"--model {spec}: not a file, a directory, a factory (pkg.module:function) or a transformers config that "
            f"could be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); without network, give "
            "the path of its config.json"
        ) from e
    return _from_config(config, spec)


def human_count(n: float) -> str:
    """``8030261248`` -> ``8.03B``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))
