"""The plan's style names (transformers' ``ALL_PARALLEL_STYLES``, 5.24, and the older names of 4.5x) and their
arguments; the errors of a bad plan."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

__all__ = ["STYLES", "EXPERT_STYLES", "Style", "TPPlanError", "parse_style"]


class TPPlanError(ValueError):
    """A tensor-parallel plan that cannot be applied: the message names the module, the style and the numbers."""


STYLES: dict[str, str] = {
    "colwise": "Linear: weight and bias split on the out dim; input replicated, output this rank's features",
    "colwise_gather_output": "colwise, then the output features all-gathered (every rank gets all of them)",
    "colwise_rep": "the same as colwise_gather_output",
    "rowwise": "Linear: weight split on the in dim, bias replicated; input this rank's features, output all-reduced",
    "rowwise_split_input": "rowwise whose input is replicated: each rank takes its chunk of the features first",
    "rowwise_rep": "the same as rowwise_split_input",
    "packed_colwise": "colwise for a fused weight whose out dim packs equal blocks ([gate; up], [q; k; v]): "
    "each block split; argument packed=N (2 by default, as transformers)",
    "packed_rowwise": "rowwise for a weight whose in dim packs equal blocks, each split; argument packed=N (2)",
    "embedding_rowwise": "Embedding split on the vocabulary: out-of-range ids give zeros, the partial rows all-reduced",
    "embedding_colwise": "Embedding split on the hidden dim: each rank looks up its columns, then all-gathered",
    "sequence_parallel": "norm/dropout on sequence shards: parameters replicated with summed gradients under "
    "sequence parallelism, nothing otherwise; on an Embedding (positions) the ids are split along the sequence",
    "replicated_with_grad_allreduce": "parameters replicated, their gradients summed over tp (per-head norms)",
    "all_reduce": "the module's output (a partial sum) all-reduced over tp",
    "mla_kv_a_proj": "MLA's kv_a_proj_with_mqa: replicated, the rope part of its output gets its gradient all-reduced",
    "local_params": "the module computes on its parameters' local pieces (its parameter entries split them)",
    "moe_tp_experts": "an experts module (transformers' form) whose every expert is split by its parameter entries "
    "(packed_colwise gate_up_proj, rowwise down_proj): its input and routing weights enter the split region, its "
    "routed mixture (a partial sum) is all-reduced",
    "replicate": "every rank holds the whole module; nothing is split or reduced",
    "local_colwise": "transformers 4.5x: colwise weights with no collective of its own (inside a 'gather' module)",
    "local_rowwise": "transformers 4.5x: rowwise weights with no collective of its own (inside a 'gather' module)",
    "local_packed_rowwise": "transformers 4.5x: packed_rowwise weights with no collective of its own",
    "gather": "transformers 4.5x: the module's input gradient and its output all-reduced over tp (wraps local_*)",
}

EXPERT_STYLES: dict[str, str] = {
    "grouped_gemm": "shards experts' stacked weights by expert",
    "ep_dispatch_experts": "routes tokens to the ranks that hold their experts",
    "moe_identity_expert": "pre-divides an identity expert for moe_tp_experts' sum",
    "ep_router": "transformers' removed router style",
    "local": "transformers 4.5x IsolatedParallel: experts kept per rank",
    "isolated": "transformers 4.5x IsolatedParallel: experts kept per rank",
}

_ARGS: dict[str, set[str]] = {
    "colwise": {"heads"},
    "colwise_gather_output": {"heads"},
    "colwise_rep": {"heads"},
    "rowwise": {"heads"},
    "rowwise_split_input": {"heads"},
    "rowwise_rep": {"heads"},
    "packed_colwise": {"packed", "heads"},
    "packed_rowwise": {"packed", "heads"},
    "local_colwise": {"heads"},
    "local_rowwise": {"heads"},
    "local_packed_rowwise": {"packed", "heads"},
}

_SPEC = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$")


@dataclass(frozen=True)
class Style:
    """A parsed plan value: ``"colwise"`` or ``"packed_colwise(packed=3, heads=12)"``."""

    name: str
    args: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in sorted(self.args.items()))
        return f"{self.name}({inner})" if inner else self.name


def parse_style(value: object, where: str) -> Style:
    """Parse the plan value for ``where``; a name that is no style, an expert-parallel style or a bad argument is a
    :class:`TPPlanError`."""
    if not isinstance(value, str):
        raise TPPlanError(f"tp plan entry {where!r}: the style must be a string, got {value!r}")
    m = _SPEC.match(value)
    if m is None:
        raise TPPlanError(f"tp plan entry {where!r}: cannot read style {value!r} (write 'name' or 'name(key=int)')")
    name, inner = m.group(1), m.group(2)
    if name in EXPERT_STYLES:
        if name == "moe_identity_expert":
            raise TPPlanError(
                f"tp plan entry {where!r}: style 'moe_identity_expert' ({EXPERT_STYLES[name]}) is not implemented: "
                "phalanx's moe_tp_experts sums the experts it splits, and has no identity (null) expert to pre-divide; "
                "plan that module 'replicate', or run the model without tensor parallelism"
            )
        raise TPPlanError(
            f"tp plan entry {where!r}: style {name!r} ({EXPERT_STYLES[name]}) is expert parallelism, which belongs "
            "in the model's ep plan (base_model_ep_plan, applied with ep_size > 1), not its tp plan; drop the entry "
            "(plan the experts 'moe_tp_experts' to split each expert over tp, or 'replicate' to keep them whole)"
        )
    if name not in STYLES:
        close = difflib.get_close_matches(name, list(STYLES), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise TPPlanError(
            f"tp plan entry {where!r}: unknown style {name!r}{hint} (the styles: {', '.join(sorted(STYLES))})"
        )
    args: dict[str, int] = {}
    if inner and inner.strip():
        for part in inner.split(","):
            key, eq, raw = part.partition("=")
            key = key.strip()
            if not eq or key not in _ARGS.get(name, set()):
                allowed = sorted(_ARGS.get(name, set()))
                raise TPPlanError(
                    f"tp plan entry {where!r}: style {name!r} takes "
                    + (f"the arguments {allowed}" if allowed else "no arguments")
                    + f", not {part.strip()!r}"
                )
            try:
                args[key] = int(raw)
            except ValueError:
                raise TPPlanError(
                    f"tp plan entry {where!r}: argument {key} must be an integer, got {raw.strip()!r}"
                ) from None
            if args[key] < 1:
                raise TPPlanError(f"tp plan entry {where!r}: argument {key} must be >= 1, got {args[key]}")
    return Style(name, args)
