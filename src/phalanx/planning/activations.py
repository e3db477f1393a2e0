"""Activation memory of a decoder stack: what each layer's forward keeps for its backward, per rank, under each
checkpointing policy.

The count is Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), section 4,
tensor by tensor, widened to the layers trained now: grouped-query attention (K and V of ``kv_heads``), a gated MLP
(SwiGLU keeps the gate's and the up projection's outputs, the activation's output and the product), attention that
recomputes its scores (SDPA/flash keeps its output and the log-sum-exp instead of the ``a*s^2*b`` scores), dropout
masks only where dropout is on, and the residual stream in fp32 under autocast (a model kept in fp32 and trained in
bf16-mixed: the embedding, the residual adds and the norms run in fp32). For the paper's own layer (multi-head,
4h GELU MLP, eager attention, dropout, everything 16-bit) :func:`layer_terms` sums to its ``sbh(34 + 5as/h)`` bytes,
which ``tests/test_plan.py`` checks.

Policies, as phalanx's ``activation_checkpointing`` runs them (``engine/activation.py``):

- ``none``: every layer keeps all of its terms.
- ``selective``: each layer keeps its input and the outputs of its matmuls and of attention; the rest (norms,
  activations, dropout, the copies between them) is recomputed in backward, one layer at a time.
- ``full``: each layer keeps only its input; in backward one layer at a time recomputes everything.

Above the layers sit the final norm, the head and the loss: the logits in the compute dtype and the fp32 log-probs
that cross-entropy keeps, and in backward their fp32 gradient and its cast, alive together.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.planning.model import ModelShape

__all__ = ["POLICIES", "LayerTerm", "layer_terms", "deferred_bytes", "ActivationBytes", "activation_bytes"]

POLICIES = ("none", "selective", "full")


@dataclass(frozen=True)
class LayerTerm:
    """One tensor a layer keeps for backward: its bytes per rank, and under which policies it is kept."""

    name: str
    nbytes: float
    selective: bool
    """Kept under ``selective``: the output of a matmul or of attention."""
    none: bool = True
    """Kept without checkpointing (a matmul output that only feeds a residual add is not)."""


def _norm_terms(where: str, norm: str, elements: float, res: int) -> list[LayerTerm]:
    """What a norm keeps: its input, and for transformers' RMSNorm (computed in fp32) the fp32 input and the
    normalized tensor it multiplies the weight by. Its output is the next matmul's input, counted there."""
    if norm == "rmsnorm":
        return [
            LayerTerm(f"{where} norm fp32 input", elements * 4, False),
            LayerTerm(f"{where} norm normalized", elements * res, False),
        ]
    return [LayerTerm(f"{where} norm input", elements * res, False)]


def layer_terms(
    shape: ModelShape,
    batch: int,
    seq: int,
    act_bytes: int,
    tp: int = 1,
    residual_bytes: int | None = None,
    weight_casts: bool = False,
) -> list[LayerTerm]:
    """What one decoder layer keeps for backward, for ``batch`` sequences of ``seq`` tokens on this rank, in
    ``act_bytes`` per element (``residual_bytes`` for the residual stream; default the same). Under tensor
    parallelism (``tp``) the attention heads and the MLP's width are split; the norms' inputs and the inputs of the
    first matmuls are whole on every rank (no sequence parallelism). ``weight_casts``: autocast over fp32 weights
    keeps each matmul's 16-bit copy of its weight for backward (zero3 keeps a marker instead and casts again)."""
    s, b, t = seq, batch, tp
    res = act_bytes if residual_bytes is None else residual_bytes
    sb = s * b
    h = shape.hidden
    a = shape.heads or 1
    hq = a * (shape.head_dim or h // a)
    hkv = (shape.kv_heads or a) * (shape.head_dim or h // a)
    mask = 1 if shape.dropout > 0 else 0  # dropout masks: one byte an element
    out = _norm_terms("attention", shape.norm, sb * h, res)
    out += [
        LayerTerm("qkv input", sb * h * act_bytes, False),
        LayerTerm("q", sb * hq * act_bytes / t, True),
        LayerTerm("k", sb * hkv * act_bytes / t, True),
        LayerTerm("v", sb * hkv * act_bytes / t, True),
    ]
    if shape.attention == "eager":
        scores = a * s * s * b / t
        out.append(LayerTerm("attention scores", scores * act_bytes, True, none=False))  # QK^T, a matmul output
        out.append(LayerTerm("softmax output", scores * act_bytes, False))
        if mask:
            out.append(LayerTerm("softmax dropout mask", scores, False))
            out.append(LayerTerm("softmax dropout output", scores * act_bytes, False))
        out.append(LayerTerm("output projection input", sb * hq * act_bytes / t, True))  # the PV matmul's output
    else:
        # SDPA's output is laid out [b, s, heads, d], so the output projection's input is the same storage.
        out.append(LayerTerm("attention output", sb * hq * act_bytes / t, True))
        out.append(LayerTerm("attention log-sum-exp", a * sb * 4 / t, True))
    out.append(LayerTerm("output projection output", sb * h * act_bytes, True, none=False))
    if mask:
        out.append(LayerTerm("attention dropout mask", sb * h * mask, False))
    out += _norm_terms("mlp", shape.norm, sb * h, res)
    out.append(LayerTerm("mlp input", sb * h * act_bytes, False))
    if shape.experts:
        # Each token's routed experts run the expert MLP on it: top-k copies of the token (the dispatched input)
        # and each expert's intermediate tensors.
        k, width = shape.experts_per_token or 1, shape.expert_intermediate or shape.intermediate
        out.append(LayerTerm("dispatched tokens", k * sb * h * act_bytes, False))
        out += _mlp_terms(shape.gated_mlp, k * sb, width, act_bytes, t)
    else:
        out += _mlp_terms(shape.gated_mlp, sb, shape.intermediate, act_bytes, t)
    out.append(LayerTerm("down projection output", sb * h * act_bytes, True, none=False))
    if mask:
        out.append(LayerTerm("mlp dropout mask", sb * h * mask, False))
    if weight_casts:
        out.append(LayerTerm("16-bit weight copies", shape.layer_params * act_bytes / t, False))
    return out


def _mlp_terms(gated: bool, tokens: int, width: int, act_bytes: int, t: int) -> list[LayerTerm]:
    n = tokens * width * act_bytes / t
    if gated:  # gate(x), up(x): matmul outputs; act(gate) and the product are recomputed under selective
        return [
            LayerTerm("gate output", n, True),
            LayerTerm("up output", n, True),
            LayerTerm("activation output", n, False),
            LayerTerm("down input", n, False),
        ]
    return [LayerTerm("activation input", n, True), LayerTerm("down input", n, False)]


def deferred_bytes(
    shape: ModelShape,
    batch: int,
    seq: int,
    act_bytes: int,
    tp: int = 1,
    residual_bytes: int | None = None,
    layers: int | None = None,
    with_head: bool = True,
) -> float:
    """What one micro-batch keeps between its input gradient (B) and its weight gradient (W) under zb_h1, beside the
    activations it already holds: the gradient that reached each node with a weight (``split_backward.py``), the
    size of that node's output. Per layer: Q, K and V, the output projection's output, the MLP's first matmuls'
    outputs (top-k copies for experts, and the router's scores) and the down projection's, and each norm's output
    (its weight); with the head, the logits' gradient and the final norm's."""
    if not shape.is_decoder:
        return 0.0
    sb, t, h = batch * seq, tp, shape.hidden
    res = act_bytes if residual_bytes is None else residual_bytes
    a = shape.heads or 1
    hq = a * (shape.head_dim or h // a)
    hkv = (shape.kv_heads or a) * (shape.head_dim or h // a)
    k, width = 1, shape.intermediate
    if shape.experts:
        k, width = shape.experts_per_token or 1, shape.expert_intermediate or shape.intermediate
    first = (2 if shape.gated_mlp else 1) * k * sb * width / t + (sb * shape.experts if shape.experts else 0)  # router
    layer = ((hq + 2 * hkv) * sb / t + h * sb + first + k * h * sb) * act_bytes + 2 * sb * h * res
    n = shape.layers if layers is None else layers
    head = (sb * shape.vocab / t * act_bytes + sb * h * res) if with_head else 0.0
    return n * layer + head


@dataclass(frozen=True)
class ActivationBytes:
    """Peak activation bytes on one rank under each policy, and the parts they are made of."""

    layer: float
    """One layer's terms, all of them (``none``)."""
    layer_selective: float
    """What ``selective`` keeps of one layer: its input and its matmul and attention outputs."""
    layer_input: float
    """What ``full`` keeps of one layer: its input."""
    head: float
    """The final norm, the head and the loss: kept logits and log-probs, and their gradients in backward."""
    layers: int
    in_flight: int
    """Micro-batches whose activations are alive at once on this rank (a pipeline's first stage holds several)."""
    peak: dict[str, float]
    """Policy -> peak bytes."""


def activation_bytes(
    shape: ModelShape,
    batch: int,
    seq: int,
    act_bytes: int,
    tp: int = 1,
    cp: int = 1,
    layers: int | None = None,
    in_flight: int = 1,
    with_head: bool = True,
    residual_bytes: int | None = None,
    weight_casts: bool = False,
    heads_in_flight: int = 1,
    deferred: int = 0,
) -> ActivationBytes:
    """Peak activation bytes per rank of ``layers`` decoder layers (default all) with ``in_flight`` micro-batches of
    ``batch`` x ``seq`` tokens alive at once, the sequence split over ``cp`` ranks and the heads over ``tp``.

    A pipeline's schedule sets the last two: ``heads_in_flight``, the micro-batches whose head and loss outputs are
    kept at once (``with_head``; gpipe and zb_h1 keep several), and ``deferred``, the micro-batches whose weight
    gradients wait (zb_h1), each keeping the gradient that reached every weight's node (:func:`deferred_bytes`)."""
    if not shape.is_decoder:
        return ActivationBytes(0, 0, 0, 0, 0, in_flight, {p: 0.0 for p in POLICIES})
    s = -(-seq // cp)
    res = act_bytes if residual_bytes is None else residual_bytes
    n = shape.layers if layers is None else layers
    terms = layer_terms(shape, batch, s, act_bytes, tp, res, weight_casts)
    layer = sum(x.nbytes for x in terms if x.none)
    block_in = batch * s * shape.hidden * res  # what a checkpointed layer keeps: its input
    kept = block_in + sum(x.nbytes for x in terms if x.selective)
    head = 0.0
    if with_head:
        tokens = batch * s
        logits = tokens * shape.vocab / tp
        # The final norm and the head's input; cross-entropy's fp32 log-probs, and the logits in the compute dtype
        # when they are not fp32 themselves (the model's output holds them); in backward, the gradients of both.
        norm = sum(x.nbytes for x in _norm_terms("final", shape.norm, tokens * shape.hidden, res))
        per_logit = 4 + (act_bytes if act_bytes != 4 else 0)
        # kept per micro-batch in flight; the gradients only for the one in backward
        head_kept = norm + tokens * shape.hidden * act_bytes + logits * per_logit
        if weight_casts:
            head_kept += shape.vocab * shape.hidden * act_bytes / tp
        head = heads_in_flight * head_kept + logits * per_logit
    stack = in_flight * n
    waiting = deferred * deferred_bytes(shape, batch, s, act_bytes, tp, res, n, with_head) if deferred else 0.0
    peak = {
        "none": stack * layer + head + waiting,
        "selective": stack * kept + (max(layer - kept, 0) if n else 0) + head + waiting,
        "full": stack * block_in + (layer if n else 0) + head + waiting,
    }
    return ActivationBytes(layer, kept, block_in, head, n, in_flight, peak)
