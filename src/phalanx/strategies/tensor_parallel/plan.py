"""Plans: which module gets which style, checked whole before anything is split, then applied in place.

    report = apply_tp_plan(model, None, tp_group)         # the model's own plan (transformers' or tp_plan())
    report = apply_tp_plan(model, {"layers.*.attn.q_proj": "colwise", ...}, tp_group, sequence_parallel=True)

A plan maps module (or parameter) name patterns to styles, in transformers' syntax: ``*`` matches one name component
(a layer number). Every check runs before the first parameter is replaced, so a :class:`TPPlanError` leaves the
model as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.checkpoint.pretrained import is_transformers_model as transformers_model
from phalanx.strategies._plans import matches

from .layers import MIXINS, InputCache, swap_class
from .params import ATTR, TPParam, tp_slice_of
from .rng import TPRngTracker
from .styles import Style, TPPlanError, parse_style

__all__ = ["TPReport", "apply_tp_plan", "last_planned", "resolve_plan"]

_Q = {"q_proj", "query", "wq", "q", "q_b_proj"}
_KV = {"k_proj", "v_proj", "key", "value", "wk", "wv", "k", "v"}
_FUSED = {"qkv", "qkv_proj", "query_key_value", "c_attn", "wqkv", "Wqkv", "W_pack"}
_OUT = {"o_proj", "out_proj", "wo"}
_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
_HEAD_NAMES = {"lm_head", "head", "output", "embed_out"}
_COLWISE = {"colwise", "colwise_gather_output", "colwise_rep", "packed_colwise", "local_colwise"}
_ROWWISE = {"rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise", "local_rowwise", "local_packed_rowwise"}
_WHOLE = {"colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep"}
_PARAM_STYLES = _COLWISE | _ROWWISE | {"embedding_rowwise", "embedding_colwise", "replicate"}
_PARAM_STYLES |= {"replicated_with_grad_allreduce"}


@dataclass
class TPReport:
    """What :func:`apply_tp_plan` did. ``params``: every parameter's :class:`TPParam` by name; ``styles``: the style
    of each planned module or parameter; ``forked``: the modules whose forward draws from ``tracker``'s per-rank
    stream; ``grad_synced``: the parameters whose gradients the layers sum over their holders; ``attributes``: the
    head-count attributes changed on attention modules; ``vocab_size``: the full vocabulary of a vocab-parallel head
    (what :func:`loss_parallel` expects), or None."""

    group: Any
    tp_size: int
    tp_rank: int
    sequence_parallel: bool
    tracker: TPRngTracker
    styles: dict[str, str] = field(default_factory=dict)
    params: dict[str, TPParam] = field(default_factory=dict)
    forked: list[str] = field(default_factory=list)
    grad_synced: list[str] = field(default_factory=list)
    attributes: list[str] = field(default_factory=list)
    vocab_size: int | None = None


_LAST: list[TPReport] = []


def last_planned() -> TPReport | None:
    """The report of the last :func:`apply_tp_plan` in this process (what :func:`loss_parallel` uses)."""
    return _LAST[-1] if _LAST else None


# ------------------------------------------------------------------------------------------ the plan
def resolve_plan(model: nn.Module, plan: dict[str, str] | None) -> dict[str, str]:
    """The plan to apply: ``plan`` itself, or (``None``) the model's own. A transformers model's own plan is its
    ``tp_plan`` (transformers 5 composes the class's ``_tp_plan``, e.g. ``{"lm_head": "colwise_gather_output"}``,
    the base model's ``config.base_model_tp_plan`` under the base model's name, and ``embed_tokens``); any other
    module's is its ``tp_plan()`` method or ``_tp_plan`` attribute. Style names are checked here."""
    if plan is None:
        plan = _own_plan(model)
    if not isinstance(plan, dict):
        raise TPPlanError(f"a tp plan is a dict of name pattern -> style, got {type(plan).__name__}")
    for key, value in plan.items():
        parse_style(value, key)
    return dict(plan)


def _own_plan(model: nn.Module) -> dict[str, str]:
    name = type(model).__name__
    if transformers_model(model):
        own = getattr(model, "tp_plan", None)
        if isinstance(own, dict) and own:
            return dict(own)
        composed: dict[str, str] = dict(getattr(type(model), "_tp_plan", None) or {})
        base = getattr(model, "base_model", model)
        prefix = "" if base is model else f"{getattr(model, 'base_model_prefix', 'model')}."
        base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        composed.update({prefix + k: v for k, v in base_plan.items()})
        if composed:
            return composed
        raise TPPlanError(
            f"{name} has no tensor-parallel plan (its config has no base_model_tp_plan); pass tp_plan={{...}}"
        )
    method = getattr(model, "tp_plan", None)
    if callable(method):
        return dict(method())
    attr = getattr(model, "_tp_plan", None)
    if isinstance(attr, dict) and attr:
        return dict(attr)
    raise TPPlanError(f"{name} has no tensor-parallel plan (no tp_plan() method or _tp_plan); pass tp_plan={{...}}")


def _expand(
    plan: dict[str, str], modules: dict[str, nn.Module], params: dict[str, nn.Parameter], strict: bool = True
) -> tuple[dict[str, Style], dict[str, Style]]:
    """Each module and parameter name with its style (the most specific pattern wins). ``strict``: an entry that
    matches nothing is an error (a plan the user gave); the model's own plan may name layers this configuration
    lacks (Qwen3-MoE's plan names the dense MLP of its mlp_only_layers), as transformers allows."""
    chosen: dict[str, tuple[int, str, Style]] = {}
    for pattern, value in plan.items():
        style = parse_style(value, pattern)
        hits = [n for n in list(modules) + list(params) if n and matches(pattern, n)]
        if not hits and not strict:
            continue
        if not hits:
            import difflib

            close = difflib.get_close_matches(pattern, [n for n in modules if n], n=3, cutoff=0.6)
            hint = f"; close names: {', '.join(close)}" if close else ""
            raise TPPlanError(f"tp plan entry {pattern!r} ({value}) matches no module or parameter of the model{hint}")
        for n in hits:
            rank = pattern.count("*")
            if n in chosen:
                old_rank, old_pattern, old_style = chosen[n]
                if old_rank == rank and old_style != style:
                    raise TPPlanError(
                        f"{n} matches tp plan entries {old_pattern!r} ({old_style}) and {pattern!r} ({style}) "
                        "equally: make one more specific"
                    )
                if old_rank <= rank:
                    continue
            chosen[n] = (rank, pattern, style)
    module_styles = {n: s for n, (_, _, s) in chosen.items() if n in modules}
    param_styles = {n: s for n, (_, _, s) in chosen.items() if n not in modules}
    return module_styles, param_styles


# ----------------------------------------------------------------------------------- the head counts
@dataclass
class _Heads:
    q: int | None
    kv: int | None
    head_dim: int | None


def _text_config(model: nn.Module) -> Any:
    """The model's config (its text part for a multimodal transformers config), or None."""
    cfg = getattr(model, "config", None)
    return cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg


def _heads_from_config(model: nn.Module) -> _Heads:
    cfg = _text_config(model)
    q = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or q
    head_dim = getattr(cfg, "head_dim", None)
    hidden = getattr(cfg, "hidden_size", None)
    if head_dim is None and isinstance(q, int) and isinstance(hidden, int) and q:
        head_dim = hidden // q
    return _Heads(q if isinstance(q, int) else None, kv if isinstance(kv, int) else None, head_dim)


@dataclass
class _Split:
    """How one module's parameters are split, decided before anything changes."""

    name: str
    module: nn.Module
    style: Style
    dim: int  # of the weight; the bias follows on the out dim only
    packed: int
    parts: int
    replicas: int
    role: str  # "q", "kv", "out", "fused" or "" (no heads)
    heads: int | None


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise TPPlanError(msg)


def _plain_forward(module: nn.Module, cls: type[nn.Module]) -> bool:
    return isinstance(module, cls) and type(module).forward is cls.forward


def _linear_split(name: str, module: nn.Module, style: Style, tp: int, heads: _Heads) -> _Split:
    _check(
        _plain_forward(module, nn.Linear),
        f"{name}: style {style.name!r} splits an nn.Linear (its weight by rows or columns); "
        f"{type(module).__name__} is not one (or overrides its forward): plan it 'replicate' or split its own layers",
    )
    assert isinstance(module, nn.Linear)
    col = style.name in _COLWISE
    dim = 0 if col else 1
    size = module.out_features if col else module.in_features
    what = "out_features" if col else "in_features"
    packed = style.args.get("packed", 2 if style.name.startswith(("packed", "local_packed")) else 1)
    leaf = name.rsplit(".", 1)[-1]
    role, n_heads = "", style.args.get("heads")
    if style.name in _WHOLE:
        pass  # the output (or input) is whole on every rank: the heads are not split, attention runs replicated
    elif col and leaf in _KV:
        role = "kv"
    elif col and leaf in _Q:
        role = "q"
    elif col and leaf in _FUSED:
        role = "fused"
    elif not col and leaf in _OUT:
        role = "out"
    if n_heads is None and role and heads.head_dim:
        count = heads.kv if role == "kv" else heads.q
        if count and size == packed * count * heads.head_dim:
            n_heads = count
    if n_heads is None or style.name in _WHOLE:
        role, n_heads = "", None  # not an attention projection split by heads: split by features
    elif not role:
        role = "q" if col else "out"  # heads=N given on a name we do not know
    if n_heads is not None:
        _check(
            size % (packed * n_heads) == 0,
            f"{name}: {what}={size} is not {packed} x {n_heads} heads of equal size",
        )
        if n_heads % tp == 0:
            return _Split(name, module, style, dim, packed, tp, 1, role, n_heads)
        if role == "kv" and tp % n_heads == 0 and style.name in ("colwise", "local_colwise"):
            return _Split(name, module, style, dim, 1, n_heads, tp // n_heads, role, n_heads)
        extra = (
            f" (kv heads are replicated only when tp is a multiple of their count: {tp} is not a multiple of {n_heads})"
            if role == "kv"
            else ""
        )
        raise TPPlanError(
            f"{name}: style {style.name!r} splits {n_heads} attention heads over tp={tp} ranks: {n_heads} is not a "
            f"multiple of {tp}{extra}; use a tp size that divides the head count"
        )
    _check(
        size % (packed * tp) == 0,
        f"{name}: style {style.name!r} splits {what}={size}"
        + (f" (as {packed} packed blocks)" if packed > 1 else "")
        + f" over tp={tp} ranks: {size} is not a multiple of {packed * tp}",
    )
    return _Split(name, module, style, dim, packed, tp, 1, role, None)


def _embedding_split(name: str, module: nn.Module, style: Style, tp: int) -> _Split:
    _check(
        _plain_forward(module, nn.Embedding),
        f"{name}: style {style.name!r} splits an nn.Embedding; {type(module).__name__} is not one",
    )
    assert isinstance(module, nn.Embedding)
    _check(
        module.max_norm is None and not module.scale_grad_by_freq and not module.sparse,
        f"{name}: a split nn.Embedding cannot use max_norm, scale_grad_by_freq or sparse (each rank sees part of it)",
    )
    dim = 0 if style.name == "embedding_rowwise" else 1
    size = module.weight.shape[dim]
    what = "num_embeddings (the vocabulary)" if dim == 0 else "embedding_dim"
    _check(size % tp == 0, f"{name}: style {style.name!r} splits {what}={size} over tp={tp}: not a multiple of {tp}")
    return _Split(name, module, style, dim, 1, tp, 1, "", None)


# ------------------------------------------------------------------------------------------ apply
def apply_tp_plan(
    model: nn.Module,
    plan: dict[str, str] | None,
    group: Any,
    *,
    sequence_parallel: bool = False,
    seed: int = 0,
) -> TPReport:
    """Split ``model`` in place over the tp process ``group`` as ``plan`` says (None: the model's own plan).

    Every rank of the group must call it, on a model with the same full weights (each rank keeps its pieces of
    them). ``seed`` seeds the per-rank RNG stream of :class:`TPRngTracker` (seed + 2718 + tp rank). With
    ``sequence_parallel`` the activations outside the split layers hold 1/tp of the sequence (dim 1).
    """
    if group is None:
        raise TypeError("apply_tp_plan needs the tp process group (got None): phalanx never uses the world implicitly")
    tp, rank = int(dist.get_world_size(group)), int(dist.get_rank(group))
    own_plan = plan is None
    plan = resolve_plan(model, plan)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    module_styles, param_styles = _expand(plan, modules, params, strict=not own_plan)
    heads = _heads_from_config(model)
    if sequence_parallel and transformers_model(model):
        raise TPPlanError(
            f"sequence_parallel=True: {type(model).__name__} is a transformers model, whose forward reads positions "
            "and the attention mask from the embedding output's length, which sequence parallelism shortens to "
            "1/tp; run it with sequence_parallel=False"
        )

    # ---- decide every split, checking as we go; nothing changes until all pass
    splits: list[_Split] = []
    for name, style in module_styles.items():
        module = modules[name]
        s = style.name
        _check(
            not (sequence_parallel and s in ("rowwise_split_input", "rowwise_rep")),
            f"{name}: style {s!r} takes a replicated input (after a 'colwise_gather_output' layer), whose region's "
            "parameters see the whole sequence; sequence parallelism needs every activation outside the split "
            "layers to be a sequence shard: plan the pair 'colwise'/'rowwise', or set sequence_parallel=False",
        )
        if s in _COLWISE or s in _ROWWISE:
            splits.append(_linear_split(name, module, style, tp, heads))
        elif s in ("embedding_rowwise", "embedding_colwise"):
            splits.append(_embedding_split(name, module, style, tp))
        elif s == "sequence_parallel" and isinstance(module, nn.Embedding):
            _check(_plain_forward(module, nn.Embedding), f"{name}: 'sequence_parallel' on a custom embedding")
        elif s == "moe_tp_experts":
            stacked = [p for p in module.parameters(recurse=False) if p.dim() >= 3]
            inner = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
            _check(
                bool(stacked) and not inner,
                f"{name}: style 'moe_tp_experts' applies to an experts module in transformers' form, whose weights are "
                "its own parameters stacked by expert (gate_up_proj [E, 2I, H], down_proj [E, H, I]); "
                f"{type(module).__name__} has "
                + (f"submodules with weights ({', '.join(inner)})" if inner else "no 3-D weights")
                + ": plan its layers one by one (colwise/rowwise) instead",
            )
            _check(
                not sequence_parallel,
                f"{name}: style 'moe_tp_experts' takes whole tokens (routing is per token), and sequence parallelism "
                "leaves each rank a shard of them; set sequence_parallel=False",
            )
        elif s == "mla_kv_a_proj":
            cfg = _text_config(model)
            _check(
                isinstance(getattr(cfg, "qk_rope_head_dim", None), int),
                f"{name}: style 'mla_kv_a_proj' needs the model config's qk_rope_head_dim; "
                f"{type(model).__name__} has none",
            )
            _check(not sequence_parallel, f"{name}: style 'mla_kv_a_proj' does not support sequence parallelism")
    owners_local = {n for n, st in module_styles.items() if st.name in ("local_params", "moe_tp_experts")}
    for pname, style in param_styles.items():
        owner = pname.rpartition(".")[0]
        _check(
            style.name in _PARAM_STYLES,
            f"tp plan entry for parameter {pname}: style {style.name!r} applies to modules, not to a parameter",
        )
        if style.name not in ("replicate", "replicated_with_grad_allreduce"):
            _check(
                owner in owners_local,
                f"tp plan entry for parameter {pname}: a split parameter needs its module {owner or '(root)'} "
                f"planned 'local_params' (its forward must compute on the local piece)",
            )
    for name in modules:
        if name in module_styles and module_styles[name].name not in ("replicate", "local_params", "moe_tp_experts"):
            if any(name.startswith(p + ".") for p in module_styles if module_styles[p].name == "replicate"):
                raise TPPlanError(f"{name} is planned {module_styles[name]} inside a module planned 'replicate'")

    # ---- the parameters each split replaces, tied ones once
    new_params: dict[int, tuple[nn.Parameter, TPParam, str]] = {}
    replace: list[tuple[nn.Module, str, int]] = []

    def plan_param(owner_name: str, module: nn.Module, pname: str, info: TPParam) -> None:
        p = module._parameters[pname]
        if p is None:
            return
        known = new_params.get(id(p))
        if known is not None:
            _check(
                dataclasses.replace(known[1], style="") == dataclasses.replace(info, style=""),
                f"{owner_name}.{pname} is tied to {known[2]} but the plan splits them differently "
                f"({info.style} on dim {info.dim} vs {known[1].style} on dim {known[1].dim}): plan them alike",
            )
        else:
            local = tp_slice_of(p.detach(), info)
            new = nn.Parameter(local.clone(), requires_grad=p.requires_grad)
            new_params[id(p)] = (new, info, f"{owner_name}.{pname}")
        replace.append((module, pname, id(p)))

    def index_of(parts: int, replicas: int) -> int:
        return rank // replicas

    kv_groups: dict[int, Any] = {}
    for sp in splits:
        idx = index_of(sp.parts, sp.replicas)
        weight = sp.module._parameters["weight"]
        assert weight is not None
        shape = tuple(weight.shape)
        w_info = TPParam(shape, sp.dim, idx, sp.parts, sp.replicas, sp.replicas > 1, sp.packed, str(sp.style))
        plan_param(sp.name, sp.module, "weight", w_info)
        bias = sp.module._parameters.get("bias")
        if bias is not None:
            if sp.dim == 0:
                b_info = TPParam(
                    tuple(bias.shape), 0, idx, sp.parts, sp.replicas, sp.replicas > 1, sp.packed, str(sp.style)
                )
            else:
                sync = sequence_parallel or sp.style.name.startswith("local_")
                b_info = TPParam(tuple(bias.shape), None, 0, 1, tp, sync, 1, str(sp.style))
            plan_param(sp.name, sp.module, "bias", b_info)
        if sp.replicas > 1:
            kv_groups[sp.replicas] = None
    for pname, style in param_styles.items():
        owner_name, _, leaf = pname.rpartition(".")
        owner = modules[owner_name]
        p = owner._parameters[leaf]
        assert p is not None
        if style.name in ("replicate", "replicated_with_grad_allreduce"):
            continue
        nd = p.dim()
        if style.name in _COLWISE:
            dim = max(nd - 2, 0)
        elif style.name == "embedding_rowwise":
            dim = 0
        elif style.name == "embedding_colwise":
            dim = min(1, nd - 1)
        else:
            dim = nd - 1
        packed = style.args.get("packed", 2) if style.name.endswith("packed_colwise") and nd > 1 else 1
        if style.name.endswith("packed_rowwise"):
            packed = style.args.get("packed", 2)
        if leaf == "bias" and style.name in _ROWWISE:
            continue  # a row-split layer's bias is replicated
        _check(
            p.shape[dim] % (packed * tp) == 0,
            f"tp plan entry for parameter {pname}: style {style.name!r} splits dim {dim} of size {p.shape[dim]} "
            f"over tp={tp}" + (f" as {packed} packed blocks" if packed > 1 else "") + ": not a multiple",
        )
        plan_param(owner_name, owner, leaf, TPParam(tuple(p.shape), dim, rank, tp, 1, False, packed, str(style)))

    # a split parameter must not be left in a module that computes with it as if whole
    split_ids = set(new_params)
    planned_for: dict[int, set[int]] = {}
    for module, _, pid in replace:
        planned_for.setdefault(pid, set()).add(id(module))
    for mname, module in modules.items():
        for pname, p in module._parameters.items():
            if p is not None and id(p) in split_ids and id(module) not in planned_for[id(p)]:
                raise TPPlanError(
                    f"{mname}.{pname} is the same parameter as {new_params[id(p)][2]}, which the plan splits "
                    f"({new_params[id(p)][1].style}), but {mname or '(root)'} is not planned: add it to the plan "
                    "(a tied head is 'colwise' like its 'embedding_rowwise' embedding)"
                )

    # ---- the attention modules: parents of layers split by heads
    attention: dict[str, tuple[nn.Module, list[_Split]]] = {}
    for sp in splits:
        if sp.role:
            parent = sp.name.rpartition(".")[0]
            attention.setdefault(parent, (modules[parent], []))[1].append(sp)

    # ---- collectives: the sub-groups of ranks that share replicated kv heads
    for replicas in sorted(kv_groups):
        kv_groups[replicas] = _kv_group(group, replicas)

    # ---- from here on the model changes
    tracker = TPRngTracker(seed, rank)
    report = TPReport(group, tp, rank, sequence_parallel, tracker)
    cache = InputCache()
    for module, pname, pid in replace:
        module._parameters[pname] = new_params[pid][0]
    for new, info, _ in new_params.values():
        setattr(new, ATTR, info)

    def set_layer(module: nn.Module, kind: str, **attrs: Any) -> None:
        if not isinstance(module, MIXINS[kind]):
            swap_class(module, MIXINS[kind])
        module._tp_group = group  # type: ignore[assignment]
        module._tp_sp = sequence_parallel  # type: ignore[assignment]
        module._tp_inputs = cache  # type: ignore[assignment]
        for k, v in attrs.items():
            setattr(module, k, v)

    for sp in splits:
        s, m = sp.style.name, sp.module
        if s in _COLWISE:
            set_layer(
                m,
                "colwise",
                _tp_local=s == "local_colwise",
                _tp_gather_output=s in ("colwise_gather_output", "colwise_rep"),
                _tp_kv_group=kv_groups[sp.replicas] if sp.replicas > 1 else None,
            )
            assert isinstance(m, nn.Linear)
            m.out_features = m.weight.shape[0]
        elif s in _ROWWISE:
            set_layer(
                m,
                "rowwise",
                _tp_local=s.startswith("local_"),
                _tp_split_input=s in ("rowwise_split_input", "rowwise_rep"),
            )
            assert isinstance(m, nn.Linear)
            m.in_features = m.weight.shape[1]
        elif s == "embedding_rowwise":
            assert isinstance(m, nn.Embedding)
            start = rank * m.weight.shape[0]
            pad = m.padding_idx
            local_pad = pad - start if pad is not None and start <= pad < start + m.weight.shape[0] else None
            set_layer(m, "vocab", _tp_start=start, _tp_stop=start + m.weight.shape[0], _tp_padding=local_pad)
            m.num_embeddings = m.weight.shape[0]
        else:
            assert isinstance(m, nn.Embedding)
            set_layer(m, "column_embedding")
            m.embedding_dim = m.weight.shape[1]
        report.styles[sp.name] = str(sp.style)

    synced: dict[nn.Module, list[str]] = {}
    sequence_embeddings: list[nn.Module] = []
    for name, style in module_styles.items():
        m = modules[name]
        s = style.name
        if s not in _COLWISE | _ROWWISE | {"embedding_rowwise", "embedding_colwise"}:
            report.styles[name] = str(style)
        if s == "sequence_parallel" and isinstance(m, nn.Embedding):
            set_layer(m, "sequence_embedding")
            sequence_embeddings.append(m)
        elif s == "replicated_with_grad_allreduce":
            synced.setdefault(m, []).extend(n for n, p in m._parameters.items() if p is not None and p.requires_grad)
        elif s == "all_reduce":
            set_layer(m, "all_reduce")
        elif s == "gather":
            set_layer(m, "gather")
        elif s == "mla_kv_a_proj":
            set_layer(m, "mla", _tp_rope=int(_text_config(model).qk_rope_head_dim))
        elif s == "moe_tp_experts":
            set_layer(m, "moe_experts")
    for pname, style in param_styles.items():
        report.styles[pname] = str(style)
        if style.name == "replicated_with_grad_allreduce":
            owner_name, _, leaf = pname.rpartition(".")
            synced.setdefault(modules[owner_name], []).append(leaf)

    # Under sequence parallelism every other replicated parameter acts on sequence shards: sum its gradient too
    # (modules planned 'replicate' say they act on whole, replicated activations, and are left alone).
    replicated_scope = [n for n, st in module_styles.items() if st.name == "replicate"]
    if sequence_parallel:
        for mname, m in modules.items():
            if isinstance(m, tuple(MIXINS[k] for k in ("colwise", "rowwise", "vocab", "column_embedding"))):
                continue
            if isinstance(m, MIXINS["sequence_embedding"]):
                continue
            if any(mname == r or mname.startswith(r + ".") for r in replicated_scope):
                continue
            own = [n for n, p in m._parameters.items() if p is not None and p.requires_grad and id(p) not in split_ids]
            if own:
                synced.setdefault(m, []).extend(n for n in own if n not in synced.get(m, []))
    for m, names in synced.items():
        set_layer(m, "grad_synced", _tp_synced=tuple(dict.fromkeys(names)), _tp_sync_group=group)

    # ---- forks: attention on local heads, local_params modules, and dropout on sequence shards
    fork_names = list(attention) + [n for n in owners_local if n not in attention]
    if sequence_parallel:
        fork_names += [
            n
            for n, m in modules.items()
            if isinstance(m, nn.modules.dropout._DropoutNd) and not any(n.startswith(a + ".") for a in fork_names)
        ]
    for n in fork_names:
        set_layer(modules[n], "forked", _tp_tracker=tracker)
    report.forked = fork_names

    # ---- head counts kept as attributes on attention modules
    for aname, (m, members) in attention.items():
        q = next((sp.heads for sp in members if sp.role in ("q", "fused", "out") and sp.heads), None)
        kv = next((sp.heads for sp in members if sp.role == "kv" and sp.heads), None)
        local_q = q // tp if q else None
        local_kv = (kv // tp if kv % tp == 0 else 1) if kv else None
        changes: dict[str, int] = {}
        for attr in _HEADS_ATTRS:
            if q and getattr(m, attr, None) == q:
                changes[attr] = local_q  # type: ignore[assignment]
        for attr in _KV_ATTRS:
            if kv and getattr(m, attr, None) == kv:
                changes[attr] = local_kv  # type: ignore[assignment]
        if q and kv and getattr(m, "num_key_value_groups", None) == q // kv:
            changes["num_key_value_groups"] = local_q // local_kv  # type: ignore[operator]
        for attr, value in changes.items():
            report.attributes.append(f"{aname}.{attr}: {getattr(m, attr)} -> {value}")
            setattr(m, attr, value)

    # ---- every parameter's TPParam (replicated ones too); the report
    synced_ids = {id(m._parameters[n]) for m, names in synced.items() for n in names}
    if sequence_parallel:
        synced_ids |= {
            id(m.weight) for m in modules.values() if isinstance(m, nn.Embedding) and m in sequence_embeddings
        }
    for pname, p in model.named_parameters():
        found = getattr(p, ATTR, None)
        info = found if isinstance(found, TPParam) else TPParam(tuple(p.shape), None, 0, 1, tp, False)
        if id(p) in synced_ids and info.dim is None:
            info = dataclasses.replace(info, grad_sync=True)
        setattr(p, ATTR, info)
        report.params[pname] = info
    report.grad_synced = [n for n, info in report.params.items() if info.grad_sync]
    report.vocab_size = _vocab_size(splits, tp)
    model.register_forward_hook(_clear(cache))
    _LAST[:] = [report]
    return report


def _clear(cache: InputCache) -> Callable[..., None]:
    def hook(*_: Any) -> None:
        cache.clear()

    return hook


def _vocab_size(splits: list[_Split], tp: int) -> int | None:
    """The full vocabulary of the head whose output stays split on the vocabulary (what loss_parallel expects)."""

    def weight(sp: _Split) -> torch.Tensor:
        w = sp.module._parameters["weight"]
        assert w is not None
        return w

    embedding_weights = {id(weight(sp)) for sp in splits if sp.style.name == "embedding_rowwise"}
    heads = [sp for sp in splits if sp.style.name == "colwise" and not sp.role]
    for sp in heads:
        if id(weight(sp)) in embedding_weights:  # tied to the vocab-parallel embedding
            return int(weight(sp).shape[0]) * tp
    for sp in heads:
        if sp.name.rsplit(".", 1)[-1] in _HEAD_NAMES:
            return int(weight(sp).shape[0]) * tp
    return None


_KV_GROUPS: dict[tuple[tuple[int, ...], int], Any] = {}


def _kv_group(group: Any, replicas: int) -> Any:
    """The process group of the tp ranks that hold the same kv heads as this one (``replicas`` consecutive tp
    ranks). Only the members of each sub-group create it (``use_local_synchronization``), so tp groups of other
    data-parallel replicas need not take part; made once per set of ranks."""
    ranks = dist.get_process_group_ranks(group)
    mine = dist.get_rank(group) // replicas
    members = tuple(ranks[mine * replicas : (mine + 1) * replicas])
    key = (members, id(dist.group.WORLD))
    if key not in _KV_GROUPS:
        _KV_GROUPS[key] = dist.new_group(list(members), use_local_synchronization=True)
    return _KV_GROUPS[key]
