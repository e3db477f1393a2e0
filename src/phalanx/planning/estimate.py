"""Per-rank memory and traffic of one layout: model states, activations, buffers, transients, bytes sent.

The model states are the ZeRO paper's accounting as phalanx holds them (``strategies/*/memory_report``'s
``predicted``), for Psi trainable elements, N ranks sharding them, p bytes a parameter, K bytes of optimizer state an
element (Adam: 8, and 4 more for the fp32 master of a 16-bit parameter), and the reduced gradient slices in fp32
(g = 4, so that accumulation does not round):

=========  ===============  =========================  ==========
layout     parameters       gradients                  optimizer
=========  ===============  =========================  ==========
ddp        p Psi            p Psi                      K Psi
zero1      p Psi            p Psi + g Psi / N          K Psi / N
zero2      p Psi            g Psi / N                  K Psi / N
zero3      p Psi / N        g Psi / N                  K Psi / N
=========  ===============  =========================  ==========

(zero1 keeps no separate fp32 slice when the parameters are fp32 and the gradients are all-reduced in place: gloo's
p2p collectives.) With ``offload`` the gradient slices and the optimizer state live in host memory, and zero3's
parameter shards too. A 16-bit model under ddp is planned with fp32 master weights, the paper's baseline.

Buffers are what the strategy allocates to move gradients and parameters (the largest buckets in flight under zero2,
zero3's gathered units and their gradients); transients are what a step allocates and frees beyond them: in backward,
beside the activations, autograd's fresh gradient of the largest parameter before it lands in its bucket; in the
optimizer step, when the activations are gone, Adam's temporaries (torch's single-tensor Adam on the CPU makes two of
the tensor it steps, the foreach Adam on CUDA one of every tensor of the call). The peak is the states and buffers
plus the larger of the two phases.

Traffic is what each rank sends per optimizer step, for a step of the same global batch on every layout (the
micro-batch size times the world size times the accumulation): ring all-reduce 2(n-1)/n of the buffer, reduce-scatter
and all-gather (n-1)/n each; zero3 gathers every unit in forward and again in backward; tensor parallelism all-reduces
each layer's activations twice in forward and twice in backward (Megatron-LM); a pipeline stage sends each
micro-batch's activations forward and their gradients back (each of its chunks, interleaved); ring attention passes K
and V around the context-parallel ranks (and dK, dV in backward); expert parallelism sends each token to its experts
and back, in forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from phalanx.config.general import PRECISIONS
from phalanx.config.strategy_options import SCHEDULES
from phalanx.planning.activations import POLICIES, activation_bytes
from phalanx.planning.model import ModelShape, PlanError
from phalanx.planning.schedules import bubble, check_schedule, in_flight
from phalanx.strategies._grads import build_buckets

__all__ = [
    "OPTIMIZER_STATE_BYTES",
    "PARAM_DTYPES",
    "BACKENDS",
    "STRATEGIES",
    "World",
    "Workload",
    "Layout",
    "Estimate",
    "estimate",
]

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4, "adagrad": 4, "rmsprop": 4}
"""Optimizer state per parameter element, in bytes (fp32 state), as ``strategies/_memory.state_bytes_per_element``."""
_ADAM = ("adamw", "adam")
PARAM_DTYPES = {"auto": 0, "fp32": 4, "bf16": 2, "fp16": 2}
BACKENDS = ("nccl", "gloo")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class World:
    """The machines: processes (one per device) per machine, machines, and each device's and host's memory."""

    nproc_per_node: int = 1
    nnodes: int = 1
    device_bytes: int | None = None
    """Memory of one device; None: not checked."""
    host_bytes: int | None = None
    """Memory of one machine's host, for what offload puts there; None: not checked."""
    backend: str = "nccl"
    """nccl: CUDA devices and native collectives; gloo: the CPU, where zero's collectives are point-to-point."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise PlanError(
                f"a world needs at least one process on one machine; got nproc_per_node={self.nproc_per_node}, "
                f"nnodes={self.nnodes}"
            )
        if self.backend not in BACKENDS:
            raise PlanError(f"backend={self.backend!r}: use one of {', '.join(BACKENDS)}")

    @property
    def size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def collectives(self) -> str:
        """What zero_collectives='auto' resolves to on this backend."""
        return "p2p" if self.backend == "gloo" else "native"


@dataclass(frozen=True)
class Workload:
    """What each step runs: micro-batches of sequences, in a precision, with an optimizer."""

    micro_batch_size: int = 1
    seq_len: int = 2048
    grad_accum: int = 1
    """Micro-batches each data-parallel replica accumulates per optimizer step (under ddp)."""
    precision: str = "bf16-mixed"
    param_dtype: str = "auto"
    """How the parameters are stored: auto is 16-bit with fp32 masters under a mixed precision (the ZeRO paper's
    mixed-precision training), fp32 otherwise; fp32 with bf16-mixed is autocast over an fp32 model."""
    optimizer: str = "adamw"
    bucket_mb: float = 25.0
    """The gradient bucket size (``bucket_mb``), which zero1/2's buffers are cut by."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "seq_len", "grad_accum"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be 1 or more; got {getattr(self, name)}")
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.param_dtype not in PARAM_DTYPES:
            raise PlanError(f"param_dtype={self.param_dtype!r}: use one of {', '.join(PARAM_DTYPES)}")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise PlanError(f"optimizer={self.optimizer!r}: use one of {', '.join(OPTIMIZER_STATE_BYTES)}")
        if self.bucket_mb <= 0:
            raise PlanError(f"bucket_mb must be above 0; got {self.bucket_mb}")

    @property
    def param_bytes(self) -> int:
        """p: bytes of a stored parameter (and of its gradient in the buckets)."""
        if self.param_dtype != "auto":
            return PARAM_DTYPES[self.param_dtype]
        return 4 if self.precision == "fp32" else 2

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def residual_bytes(self) -> int:
        """The residual stream's bytes: fp32 under autocast over an fp32 model (its adds and norms run in fp32)."""
        return 4 if self.param_bytes == 4 else self.act_bytes

    @property
    def state_bytes(self) -> int:
        """K: optimizer state an element, with the fp32 master of a 16-bit parameter."""
        return OPTIMIZER_STATE_BYTES[self.optimizer] + (4 if self.param_bytes < 4 else 0)


@dataclass(frozen=True)
class Layout:
    """A data-parallel strategy over the dp ranks, with tensor, pipeline, context and expert parallel degrees."""

    strategy: str
    offload: bool = False
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    """The pipeline's ``pp_schedule`` (when pp > 1): 1f1b, gpipe, interleaved_1f1b or zb_h1."""
    virtual_stages: int = 1
    """``pp_virtual_stages``: model chunks a pipeline rank holds (2 or more for interleaved_1f1b, else 1)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PlanError(f"strategy={self.strategy!r}: use one of {', '.join(STRATEGIES)}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"pp_schedule={self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if (self.schedule == "interleaved_1f1b") != (self.virtual_stages > 1) or self.virtual_stages < 1:
            raise PlanError(
                f"pp_schedule={self.schedule!r} with pp_virtual_stages={self.virtual_stages}: interleaved_1f1b "
                "takes 2 or more chunks a rank, the other schedules one"
            )
        if self.offload and self.strategy not in ("zero1", "zero2", "zero3"):
            raise PlanError(f"offload is for the zero strategies; got {self.strategy} with offload")

    @property
    def name(self) -> str:
        degrees = [f"{axis}{n}" for axis, n in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))]
        schedule = []
        if self.pp > 1 and self.schedule != "1f1b":
            schedule = [self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")]
        return " ".join(
            [d for d in degrees if not d.endswith("p1")]
            + [self.strategy + ("+offload" if self.offload else "")]
            + schedule
        )

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def settings(self) -> dict[str, Any]:
        """The phalanx settings that run this layout."""
        out: dict[str, Any] = {"strategy": "pipeline" if self.pp > 1 else self.strategy}
        if self.pp > 1:
            out["pp_size"] = self.pp
            out["pp_zero_stage"] = 1 if self.strategy == "zero1" else 0
            out["pp_schedule"] = self.schedule
            if self.virtual_stages > 1:
                out["pp_virtual_stages"] = self.virtual_stages
        for axis in ("tp", "cp", "ep"):
            if getattr(self, axis) > 1:
                out[f"{axis}_size"] = getattr(self, axis)
        if self.offload:
            out["offload"] = "cpu"
        return out


@dataclass
class Estimate:
    """One layout's bytes per rank (device memory unless named host) and its traffic."""

    layout: Layout
    dp: int
    """Data-parallel replicas."""
    shard: int
    """Ranks that share a parameter's replicas, and over which zero shards it (dp x cp)."""
    micro_batches: int
    """Micro-batches each replica runs per step, for the same global batch on every layout."""
    params: float
    grads: float
    optimizer: float
    activations: dict[str, float]
    buffers: float
    grad_transient: float
    """Allocated and freed during backward, beside the activations: autograd's fresh gradient of the largest
    parameter before it lands in its bucket."""
    step_transient: float
    """Allocated and freed during the optimizer step, when the activations are gone: Adam's temporaries."""
    host: float
    """Host memory per rank: what offload puts there (and the optimizer's temporaries while it steps there)."""
    sent: float
    """Bytes this rank sends per optimizer step."""
    host_link: float = 0.0
    """Bytes copied between device and host per step under offload (gradient slices down, parameters up)."""
    bubble: float = 0.0
    """The share of a step a pipeline's stages idle under its schedule (``schedules.bubble``): (pp - 1) / (m + pp - 1)
    for 1F1B and GPipe, (pp - 1) / (v m + pp - 1) interleaved, (pp - 1) / (3 m + pp - 1) for ZB-H1 (m >= pp)."""
    policy: str | None = None
    """The least recomputation under which it fits (none, selective, full); None: it does not fit."""
    counted: bool = True
    """False where part of its cost is not counted: a pipeline of a model that is not a decoder stack (its
    activations and the messages between its stages are unknown). The recommendation passes over it."""
    notes: list[str] = field(default_factory=list)

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def transient(self) -> float:
        return max(self.grad_transient, self.step_transient)

    def total(self, policy: str | None = None) -> float:
        """Peak device bytes per rank under ``policy`` (default the chosen one, else none): the states and buffers,
        and the larger of backward's peak (activations and their transient) and the optimizer step's."""
        acts = self.activations[policy or self.policy or "none"]
        return self.states + self.buffers + max(acts + self.grad_transient, self.step_transient)

    @property
    def fits(self) -> bool:
        return self.policy is not None

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.name,
            "settings": self.layout.settings(),
            "dp": self.dp,
            "micro_batches": self.micro_batches,
            "params": int(self.params),
            "grads": int(self.grads),
            "optimizer": int(self.optimizer),
            "activations": {k: int(v) for k, v in self.activations.items()},
            "buffers": int(self.buffers),
            "grad_transient": int(self.grad_transient),
            "step_transient": int(self.step_transient),
            "total": {p: int(self.total(p)) for p in POLICIES},
            "host_per_rank": int(self.host),
            "sent_per_step": int(self.sent),
            "host_link_per_step": int(self.host_link),
            "bubble": round(self.bubble, 4),
            "fits": self.fits,
            "policy": self.policy,
            "counted": self.counted,
            "notes": list(self.notes),
        }


# ------------------------------------------------------------------------------------------- one rank's piece
@dataclass
class _Piece:
    """What one rank holds of the model, in elements."""

    dense: float
    experts: float
    frozen: float
    largest: float
    units: list[float]
    root: float
    layers: int
    numels: list[float]


def _piece(shape: ModelShape, layout: Layout) -> _Piece:
    t = layout.tp
    vec = min(shape.vector_params, shape.dense_params)
    piece = _Piece(
        dense=(shape.dense_params - vec) / t + vec,
        experts=shape.expert_params / t / layout.ep,
        frozen=shape.frozen / t,
        largest=shape.largest_param / t,
        units=[u / t for u in shape.units],
        root=shape.root / t,
        layers=shape.layers or len(shape.units),
        numels=[n / t for n in shape.param_numels],
    )
    if layout.pp > 1:
        _stage(shape, layout, piece)
    return piece


def _stage(shape: ModelShape, layout: Layout, piece: _Piece) -> None:
    """Narrow ``piece`` to the pipeline's largest rank: pp x v chunks of ceil(L/(pp v)) layers, rank r holding chunks
    r, r + pp, ... (v = 1: one stage of ceil(L/pp) layers), with the embedding on the first rank and the final norm
    and head on the last (a tied head gets its own copy there)."""
    pp, v = layout.pp, layout.virtual_stages
    per = -(-len(piece.units) // (pp * v)) if piece.units else 0
    embed = shape.embed_params / layout.tp
    rest = piece.root - embed + (embed if shape.tied_embeddings else 0)
    stages = []
    for i in range(pp):
        units = [u for c in range(i, pp * v, pp) for u in piece.units[c * per : (c + 1) * per]]
        extra = (embed if i == 0 else 0) + (rest if i == pp - 1 else 0)
        stages.append((sum(units) + extra, units, extra))
    total, units, extra = max(stages, key=lambda s: s[0])
    whole = sum(piece.units) + piece.root or 1
    scale = total / whole
    piece.dense, piece.experts, piece.frozen = piece.dense * scale, piece.experts * scale, piece.frozen * scale
    piece.units, piece.root = units, extra
    piece.layers = v * -(-(shape.layers or len(shape.units)) // (pp * v))
    piece.numels = [n * scale for n in piece.numels]


def _buckets(numels: list[float], elem_bytes: int, bucket_mb: float) -> list[int]:
    """Elements of each gradient bucket, cut as the strategies cut them (``build_buckets``: last parameter first)."""
    dtype = {4: torch.float32, 2: torch.bfloat16}[elem_bytes]
    params = [nn.Parameter(torch.empty(max(1, int(n)), dtype=dtype, device="meta")) for n in reversed(numels)]
    return [sum(p.numel() for p in b) for b in build_buckets(params, int(bucket_mb * 2**20))]


# ------------------------------------------------------------------------------------------- the estimate
def _states(layout: Layout, work: Workload, world: World, piece: _Piece, n: int, ne: int) -> tuple[float, ...]:
    """(device params, grads, optimizer; host bytes) per rank: dense elements sharded over n, experts over ne."""
    p, g, k = work.param_bytes, 4, work.state_bytes
    params = grads = opt = 0.0
    for psi, ranks in ((piece.dense, n), (piece.experts, ne)):
        if layout.strategy == "ddp":
            params, grads, opt = params + p * psi, grads + p * psi, opt + k * psi
            continue
        sharded = g * psi / ranks
        if layout.strategy == "zero1":
            in_place = p == 4 and world.collectives == "p2p"  # the fp32 slice is a view of the all-reduced whole
            grads += p * psi + (0 if in_place else sharded)
        else:
            grads += sharded
        params += p * psi / ranks if layout.strategy == "zero3" else p * psi
        opt += k * psi / ranks
    params += p * piece.frozen / (n if layout.strategy == "zero3" else 1)
    host = 0.0
    if layout.offload:
        # The reduced gradient slices and the optimizer state live beside each other on the host; zero3's at-rest
        # parameter shards too. zero1 still fills whole gradients on the device.
        whole = p * (piece.dense + piece.experts) if layout.strategy == "zero1" else 0.0
        host = (grads - whole) + opt
        grads, opt = whole, 0.0
        if layout.strategy == "zero3":
            host, params = host + params, 0.0
    return params, grads, opt, host


def _buffers_and_transients(
    layout: Layout, work: Workload, world: World, piece: _Piece, n: int
) -> tuple[float, float, float, float]:
    """(device buffers, backward's transient, the step's transient on the device, on the host) per rank."""
    p = work.param_bytes
    buckets = sorted(_buckets(piece.numels, p, work.bucket_mb), reverse=True) if piece.numels else [0]
    units = sorted(piece.units, reverse=True) or [0.0]
    landing = (n - 1) / n if world.collectives == "p2p" else 0.0  # p2p's slices received from each peer
    buffers = 0.0
    if layout.strategy == "zero2":
        # Two full-size bucket gradients alive at once: the one filling and the one being reduced.
        buffers = p * sum(buckets[:2]) * (1 + landing)
    elif layout.strategy == "zero3":
        # Gathered: the root (through forward and backward), the unit computing and the one prefetched. Reducing a
        # unit's gradients (the root's last, at the end of backward): autograd's gradients of the unit, the flat
        # buffer they are copied into, and under p2p the slices received from the peers.
        reduced = max(units[0], piece.root)
        buffers = p * (piece.root + sum(units[:2]) + reduced * (2 + landing))
    fresh = p * piece.largest if layout.strategy != "zero3" else 0.0
    adam = work.optimizer in _ADAM
    if layout.strategy == "ddp":
        stepped, per_call = piece.largest, piece.dense + piece.experts
    elif layout.strategy == "zero3":
        stepped, per_call = units[0] / n, (piece.dense + piece.experts) / n
    else:
        stepped = per_call = buckets[0] / n
    # torch's Adam: single-tensor on the CPU (two temporaries of the tensor it steps), foreach on CUDA (one of every
    # tensor in the call); fp32 state.
    temps = (2 * 4 * stepped if world.backend == "gloo" else 4 * per_call) if adam else 0.0
    if layout.offload:
        return buffers, fresh, 0.0, 2 * 4 * stepped if adam else 0.0  # the host steps single-tensor
    return buffers, fresh, temps, 0.0


def _sent(
    shape: ModelShape, layout: Layout, work: Workload, world: World, piece: _Piece, n: int, ne: int, m: int
) -> float:
    """Bytes one rank sends per optimizer step."""
    p, a = work.param_bytes, work.act_bytes
    ring = (n - 1) / n if n > 1 else 0.0
    ring_e = (ne - 1) / ne if ne > 1 else 0.0
    psi = [(piece.dense, ring), (piece.experts, ring_e)]
    s = layout.strategy
    if s == "ddp":
        sent = sum(2 * r * p * x for x, r in psi)
    elif s == "zero1":  # reduce-scatter (an all-reduce in place, under p2p) and all-gather, once per step
        sent = sum((3 if world.collectives == "p2p" else 2) * r * p * x for x, r in psi)
    elif s == "zero2":  # reduce-scatter after every backward; all-gather after the step
        sent = sum((m + 1) * r * p * x for x, r in psi)
    else:  # every micro-batch gathers each unit in forward and in backward, and reduce-scatters its gradients
        whole = sum(piece.units) + piece.root or 1
        units = sum(piece.units) / whole
        sent = sum(m * (3 * units + 2 * (1 - units)) * r * p * x for x, r in psi)
    if not shape.is_decoder:
        return sent
    tokens = work.micro_batch_size * (-(-work.seq_len // layout.cp))
    act = tokens * shape.hidden * a
    layers = piece.layers
    if layout.tp > 1:
        t = layout.tp
        all_reduce = 2 * (t - 1) / t
        # 4 all-reduces a layer (2 forward, 2 backward), the embedding's and the head input's gradient, and the
        # logits gathered over the vocabulary.
        sent += m * ((4 * layers + 2) * all_reduce * act + (t - 1) / t * tokens * shape.vocab * a)
    if layout.pp > 1:
        # Each of a rank's v chunks sends its output on and its input's gradient back, but for the first chunk's
        # gradient and the last chunk's output; with two ranks, each holds one of those.
        v = layout.virtual_stages
        sent += m * act * (2 * v if layout.pp > 2 else 2 * v - 1)
    if layout.cp > 1:
        c = layout.cp
        kv = 2 * tokens * (shape.kv_heads or shape.heads) * (shape.head_dim or shape.hidden // max(shape.heads, 1)) * a
        sent += m * layers * 3 * (c - 1) * kv / layout.tp
    if layout.ep > 1 and shape.experts:
        e, k = layout.ep, shape.experts_per_token or 1
        sent += m * layers * 4 * (e - 1) / e * k * act
    return sent


def estimate(shape: ModelShape, world: World, work: Workload, layout: Layout) -> Estimate:
    """The bytes per rank of ``layout`` for ``shape`` on ``world`` running ``work``, and whether it fits."""
    if world.size % layout.model_parallel:
        raise PlanError(
            f"{layout.name}: tp x pp x cp = {layout.model_parallel} must divide the world size {world.size}"
        )
    dp = world.size // layout.model_parallel
    if dp % layout.ep:
        raise PlanError(f"{layout.name}: ep={layout.ep} must divide the data-parallel ranks ({dp})")
    shard = dp * layout.cp
    n, ne = shard, max(1, shard // layout.ep)
    m = work.grad_accum * layout.model_parallel
    if layout.pp > 1:
        check_schedule(layout.schedule, layout.pp, m, layout.virtual_stages)
        chunks = layout.pp * layout.virtual_stages
        if chunks > (shape.layers or len(shape.units) or chunks):
            raise PlanError(
                f"{layout.name}: {chunks} pipeline chunks (pp x pp_virtual_stages) need a layer each, and the model "
                f"has {shape.layers or len(shape.units)} (use fewer stages or virtual stages)"
            )
    piece = _piece(shape, layout)
    params, grads, opt, host = _states(layout, work, world, piece, n, ne)
    buffers, grad_transient, step_transient, host_transient = _buffers_and_transients(layout, work, world, piece, n)
    acts = _activations(shape, work, layout, piece, m)
    notes = []
    if layout.strategy == "ddp" and work.param_bytes < 4:
        notes.append("planned with fp32 master weights; phalanx's ddp steps a 16-bit model's weights in 16 bits")
    host_link = 0.0
    if layout.offload:
        host_link = 4 * (piece.dense + piece.experts) / n + work.param_bytes * (piece.dense + piece.experts) / n
    est = Estimate(
        layout=layout,
        dp=dp,
        shard=shard,
        micro_batches=m,
        params=params,
        grads=grads,
        optimizer=opt,
        activations=acts,
        buffers=buffers,
        grad_transient=grad_transient,
        step_transient=step_transient,
        host=host + host_transient,
        sent=_sent(shape, layout, work, world, piece, n, ne, m),
        host_link=host_link,
        bubble=bubble(layout.schedule, layout.pp, m, layout.virtual_stages) if layout.pp > 1 else 0.0,
        counted=shape.is_decoder or layout.model_parallel == 1,
        notes=notes,
    )
    est.policy = _fitting_policy(est, world)
    return est


def _activations(shape: ModelShape, work: Workload, layout: Layout, piece: _Piece, m: int) -> dict[str, float]:
    common = dict(
        batch=work.micro_batch_size,
        seq=work.seq_len,
        act_bytes=work.act_bytes,
        tp=layout.tp,
        cp=layout.cp,
        layers=piece.layers,
        residual_bytes=work.residual_bytes,
        # autocast over fp32 weights keeps each matmul's 16-bit weight copy; zero3 saves a marker instead
        weight_casts=work.param_bytes == 4 and work.act_bytes < 4 and layout.strategy != "zero3",
    )
    if layout.pp == 1:
        return dict(activation_bytes(shape, **common).peak)  # type: ignore[arg-type]
    # Each rank's peak under the schedule (1F1B: the first rank holds min(m, pp) micro-batches, the last one with
    # the head); the counts are of chunks, piece.layers / v layers each.
    common["layers"] = piece.layers // layout.virtual_stages
    peaks = [
        activation_bytes(
            shape,
            in_flight=held.chunks,
            with_head=held.heads > 0,
            heads_in_flight=held.heads,
            deferred=held.deferred,
            **common,  # type: ignore[arg-type]
        ).peak
        for held in in_flight(layout.schedule, layout.pp, m, layout.virtual_stages)
    ]
    return {k: max(p[k] for p in peaks) for k in POLICIES}


def _fitting_policy(est: Estimate, world: World) -> str | None:
    if world.host_bytes is not None and est.host * world.nproc_per_node > world.host_bytes:
        return None
    for policy in POLICIES:
        if world.device_bytes is None or est.total(policy) <= world.device_bytes:
            return policy
    return None
