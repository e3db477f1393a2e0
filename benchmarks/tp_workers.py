"""Worker functions for bench_tp.py: one training run of one tensor-parallel or hybrid-sharded configuration, in a
process started by phalanx.spawn (1 thread per rank, gloo).

The model is ``BenchGPT``: a GPT made only of plain ``nn.Embedding`` / ``nn.Linear`` / ``nn.LayerNorm`` layers (separate
q, k, v and output projections, an untied vocabulary head, no learned positions), so that torch's
``parallelize_module`` and phalanx's plan split exactly the same layers. Every configuration builds it with
``torch.manual_seed(seed)`` right before construction and feeds step ``s`` the same global batch of random token ids.
Under tensor parallelism (dp = 1) every rank takes the whole batch; under hybrid sharding (4 data-parallel ranks)
rank ``r`` takes its quarter.

After the timed loop (harness.train_loop: its memory figures are taken before anything below), one more step runs
under torch.profiler with ``record_shapes``: the c10d operations it records (the same dispatcher ops whether they
came from ``torch.distributed.*`` or from DTensor's functional collectives) give the bytes each rank handed to each
kind of collective, counted the same way on both sides; the same trace gives where the time went.

Every function here is module-level so that the spawn start method can import it by name.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import init_gloo, make_adamw, param_sum, train_loop, world
from torch import nn

# ------------------------------------------------------------------------------------------ the model


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.wq = nn.Linear(n_embd, n_embd)
        self.wk = nn.Linear(n_embd, n_embd)
        self.wv = nn.Linear(n_embd, n_embd)
        self.wo = nn.Linear(n_embd, n_embd)
        self.head_dim = n_embd // n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes come from q's output: under tensor parallelism it holds this rank's heads, under sequence
        # parallelism all of the sequence while x holds a chunk of it.
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class BenchGPT(nn.Module):
    def __init__(self, vocab: int, n_embd: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(spec: dict[str, Any]) -> BenchGPT:
    torch.manual_seed(spec["seed"])
    m = spec["model"]
    return BenchGPT(m["vocab"], m["n_embd"], m["n_head"], m["n_layer"])


def phalanx_plan(sequence_parallel: bool) -> dict[str, str]:
    """phalanx's plan of BenchGPT (transformers' style names): Megatron's split, the head's logits left split on the
    vocabulary for the vocab-parallel loss."""
    plan = {
        "tok": "embedding_rowwise",
        "blocks.*.attn.wq": "colwise",
        "blocks.*.attn.wk": "colwise",
        "blocks.*.attn.wv": "colwise",
        "blocks.*.attn.wo": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
        "head": "colwise",
    }
    if sequence_parallel:
        plan.update({"blocks.*.ln1": "sequence_parallel", "blocks.*.ln2": "sequence_parallel"})
        plan["ln_f"] = "sequence_parallel"
    return plan


def torch_parallelize(model: BenchGPT, mesh: Any, sequence_parallel: bool) -> None:
    """torch's own tensor parallelism on the same layers, as torch's TP tutorial (Llama) does it: Colwise/Rowwise on
    the projections, the embedding RowwiseParallel, the head ColwiseParallel with its logits left sharded on the
    vocabulary (for loss_parallel); with sequence parallelism, SequenceParallel on the norms and the row-parallel
    outputs reduce-scattered along the sequence. The attention module gets PrepareModuleInput so that q, k and v
    share one input DTensor: one collective for their input gradient (all-reduce, or reduce-scatter under SP)
    instead of one each."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()
    top: dict[str, Any] = {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "head": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.blocks:
        plan: dict[str, Any] = {
            "attn": PrepareModuleInput(
                input_layouts=(act,), desired_input_layouts=(Replicate(),), use_local_output=False
            ),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=act),
            "mlp.0": ColwiseParallel(input_layouts=act),
            "mlp.2": RowwiseParallel(output_layouts=act),
        }
        if sp:
            plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
        parallelize_module(block, mesh, plan)


def make_batch(spec: dict[str, Any], step: int, rank: int, nranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of step ``step``'s global batch (all of them when ``nranks`` is 1), token ids and their
    next-token targets."""
    gb, seq, vocab = spec["global_batch"], spec["model"]["seq"], spec["model"]["vocab"]
    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + step)
    ids = torch.randint(vocab, (gb, seq + 1), generator=g)
    lb = gb // nranks
    ids = ids[rank * lb : (rank + 1) * lb]
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the parameters the optimizer steps, their gradients (the same size) and the
    optimizer state (AdamW: two moments), local pieces only."""
    params = [p for g in opt.param_groups for p in g["params"]]
    p_bytes = sum(_local(p).numel() * p.element_size() for p in params)
    s_bytes = sum(
        _local(v).numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {"params": p_bytes, "grads": p_bytes, "optimizer_state": s_bytes, "total": 2 * p_bytes + s_bytes}


def reference_loss(spec: dict[str, Any]) -> float:
    """Step 0's loss of the whole model in this process, before anything is split (the single-process truth)."""
    model = build_model(spec)
    x, y = make_batch(spec, 0, 0, 1)
    with torch.no_grad():
        out = model(x)
        return float(F.cross_entropy(out.flatten(0, 1), y.flatten()))


# ------------------------------------------------------------------------------------------ counting collectives

_ELEM = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8, "long int": 8, "int": 4, "bool": 1}
_ELEM.update({"c10::BFloat": 2, "long": 8, "unsigned char": 1, "signed char": 1})


def _numel(dims: Any) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _tensors(dims: Any, types: Any) -> list[int]:
    """Bytes of each tensor of one profiler argument (a tensor or a TensorList)."""
    if types == "TensorList":
        return [_numel(d) * 4 for d in dims]  # the trace gives no dtype inside a list; every payload here is fp32
    if isinstance(dims, list) and (not dims or isinstance(dims[0], (int, float))) and types in _ELEM:
        return [_numel(dims) * _ELEM[types]]
    return []


def count_collectives(trace_events: list[dict[str, Any]], ar_group: int) -> dict[str, Any]:
    """The c10d operations of one profiled step: per kind, calls, payload bytes (all-reduce and broadcast: the
    tensor; all-gather: the full output; reduce-scatter: the full input; send: the tensor) and the bytes this rank
    sends in a ring over N ranks (all-reduce 2S(N-1)/N, all-gather and reduce-scatter S(N-1)/N, send S): the units of
    phalanx's CommStats. N of all-gather and reduce-scatter is read off their shapes; N of all-reduce is
    ``ar_group`` (every all-reduce of these layouts runs over groups of that size)."""
    calls: dict[str, int] = defaultdict(int)
    payload: dict[str, float] = defaultdict(float)
    wire: dict[str, float] = defaultdict(float)
    sizes: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for e in trace_events:
        name = e.get("name", "")
        if not name.startswith("c10d::"):
            continue
        op = name[len("c10d::") :]
        a = e.get("args", {})
        dims, types = a.get("Input Dims", []), a.get("Input type", [])
        args = [_tensors(d, t) for d, t in zip(dims, types, strict=False)]
        kind, s, w = None, 0.0, 0.0
        if op in ("allreduce_", "allreduce_coalesced_"):
            kind, s = "all_reduce", float(sum(args[0]))
            w = 2 * s * (ar_group - 1) / ar_group
        elif op in ("_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_"):
            out, inp = sum(args[0]), sum(args[1]) if len(args) > 1 else 0
            if op == "allgather_":  # (list of lists of outputs, inputs): the trace flattens poorly; use the input
                out = inp * ar_group
            kind, s = "all_gather", float(out)
            n = round(out / inp) if inp else 1
            w = s * (n - 1) / max(n, 1)
        elif op in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_"):
            out, inp = sum(args[0]), sum(args[1]) if len(args) > 1 else 0
            kind, s = "reduce_scatter", float(inp)
            n = round(inp / out) if out else 1
            w = s * (n - 1) / max(n, 1)
        elif op == "send":
            kind, s = "send", float(sum(args[0]))
            w = s
        elif op == "recv_":
            kind, s = "recv", float(sum(args[0]))
        elif op == "broadcast_":
            kind, s = "broadcast", float(sum(args[0]))
            w = s * (ar_group - 1) / ar_group
        elif op in ("barrier", "monitored_barrier_"):
            kind = "barrier"
        else:
            kind = op
        calls[kind] += 1
        sizes[kind][int(s)] += 1
        payload[kind] += s
        wire[kind] += w
    return {
        "calls": dict(calls),
        "payload_bytes": dict(payload),
        "wire_bytes": dict(wire),
        "wire_bytes_total": sum(wire.values()),
        "payload_bytes_total": sum(payload.values()),
        "payload_sizes": {k: {str(b): n for b, n in sorted(v.items())} for k, v in sizes.items()},
    }


_COMM_PREFIX = ("c10d::", "gloo:", "_c10d_functional::", "record_param_comms")

# Where a profiled step's self CPU time went, by the operation's name (first matching prefix wins). On gloo, a
# blocking collective's self time is mostly waiting for the other ranks; phalanx waits on the work inside its
# autograd functions (their self time), torch's DTensor inside _c10d_functional::wait_tensor.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("collective ops (c10d, gloo, functional wait)", _COMM_PREFIX),
    (
        "phalanx tp collective wrappers (wait + bookkeeping)",
        ("_ReduceFromTP", "_CopyToTP", "_GatherSeq", "_ReduceScatterSeq", "_SumGrad", "_GatherLast", "_SplitLast"),
    ),
    ("FSDP2 collective record functions", ("FSDP::all_gather", "FSDP::post_backward_reduce", "FSDP::pre_backward")),
    (
        "DTensor dispatch and redistribution",
        ("PythonSubclass", "NestedRedistribute", "Redistribute", "_FromTorchTensor", "_ToTorchTensor", "DTensor"),
    ),
    ("matmul and attention", ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot", "aten::linear")),
    ("optimizer step", ("Optimizer.", "aten::_fused_adamw", "aten::_foreach")),
]


def profile_one_step(step: Any, batch: tuple[torch.Tensor, torch.Tensor], ar_group: int, top: int) -> dict[str, Any]:
    """Run ``step(*batch)`` once under torch.profiler: the collectives it issued (count_collectives) and where its
    time went (the ``top`` operations by self CPU time; the self CPU time of the collective ops, which on gloo is
    mostly waiting for the other ranks; the whole step's wall time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        step(*batch)
        wall = time.perf_counter() - t0
    fd, path = tempfile.mkstemp(suffix=".json", prefix="bench_tp_trace_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    comm = count_collectives(events, ar_group)
    avgs = prof.key_averages()
    rows = sorted(avgs, key=lambda a: a.self_cpu_time_total, reverse=True)
    total_self = sum(a.self_cpu_time_total for a in avgs)
    comm_self = sum(a.self_cpu_time_total for a in avgs if a.key.startswith(_COMM_PREFIX))
    by_category: dict[str, float] = defaultdict(float)
    for a in avgs:
        cat = next((name for name, prefixes in CATEGORIES if a.key.startswith(prefixes)), "other ops")
        by_category[cat] += a.self_cpu_time_total / 1e3
    return {
        "collectives": comm,
        "profiled_step_ms": 1e3 * wall,
        "self_cpu_ms_total": total_self / 1e3,
        "self_cpu_ms_collectives": comm_self / 1e3,
        "self_cpu_ms_by_category": {k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "top_ops": [
            {"op": a.key, "self_cpu_ms": round(a.self_cpu_time_total / 1e3, 2), "calls": a.count} for a in rows[:top]
        ],
    }


# ------------------------------------------------------------------------------------------ configurations


def _finish(
    spec: dict[str, Any], rank: int, nranks: int, step: Any, checksum: Any, opt: torch.optim.Optimizer
) -> dict[str, Any]:
    data_ranks = 1 if spec["layout"] == "tp" else nranks
    data_rank = 0 if spec["layout"] == "tp" else rank
    out = train_loop(spec, rank, lambda s: make_batch(spec, s, data_rank, data_ranks), step, checksum)
    out["state_bytes"] = state_bytes(opt)
    if spec.get("profile_step"):
        batch = make_batch(spec, spec["warmup"] + spec["steps"], data_rank, data_ranks)
        out["profile"] = profile_one_step(step, batch, spec["ar_group"], spec.get("top_ops", 15))
    if rank == 0 and spec.get("reference"):
        out["reference_first_loss"] = reference_loss(spec)
    return out


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    return _local(loss.detach())


def run_torch_tp(spec: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed.tensor.parallel on a 1-D DeviceMesh of every rank; loss_parallel on the sharded logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    rank, size = init_gloo()
    mesh = init_device_mesh("cpu", (size,))
    model = build_model(spec)
    torch_parallelize(model, mesh, spec["sequence_parallel"])
    opt = make_adamw(model.parameters(), spec)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        return _scalar(loss)

    def checksum() -> float:
        return param_sum(p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters())

    out = _finish(spec, rank, size, step, checksum, opt)
    dist.barrier()
    dist.destroy_process_group()
    return out


def run_phalanx_tp(spec: dict[str, Any]) -> dict[str, Any]:
    """phalanx.Engine(strategy="ddp", tp_size=N) (dp = 1) with BenchGPT's plan; loss_parallel on the sharded
    logits."""
    import phalanx
    from phalanx.strategies.tensor_parallel import loss_parallel

    rank, size = world()
    engine = phalanx.Engine(
        strategy="ddp",
        tp_size=size,
        tp_plan=phalanx_plan(spec["sequence_parallel"]),
        sequence_parallel=spec["sequence_parallel"],
        seed=spec["seed"],
    )
    model = build_model(spec)  # after Engine(), which reseeds
    opt = make_adamw(model.parameters(), spec)
    model, opt = engine.prepare(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def checksum() -> float:
        return param_sum(engine.unwrap_model(model).parameters())  # this rank's pieces (informative only)

    out = _finish(spec, rank, size, step, checksum, opt)
    out["describe"] = engine.strategy.describe()
    return out


def run_phalanx_hybrid(spec: dict[str, Any]) -> dict[str, Any]:
    """phalanx.Engine(strategy="zero3", dp_replicate_size=R): R replicas x (world / R) shards."""
    import phalanx

    rank, size = world()
    engine = phalanx.Engine(strategy="zero3", dp_replicate_size=spec["replicas"], seed=spec["seed"])
    model = build_model(spec)
    opt = make_adamw(model.parameters(), spec)
    names = [n for n, _ in model.named_parameters()]
    model, opt = engine.prepare(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def checksum() -> float:
        sd = engine.get_state_dict(model)
        return param_sum(sd[n] for n in names)

    stats = getattr(engine.strategy, "stats", None)
    out = _finish(spec, rank, size, step, checksum, opt)
    out["describe"] = engine.strategy.describe()
    if stats is not None:
        out["phalanx_comm_stats_all_steps"] = {
            "bytes": dict(stats.bytes),
            "calls": dict(stats.calls),
            "wire_bytes": dict(stats.wire_bytes),
        }
    return out


def run_fsdp2_hybrid(spec: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 HSDP: fully_shard on each block, then the root, over a (replicate, shard) DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, size = init_gloo()
    r = spec["replicas"]
    mesh = init_device_mesh("cpu", (r, size // r), mesh_dim_names=("replicate", "shard"))
    model = build_model(spec)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_adamw(model.parameters(), spec)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def checksum() -> float:
        return param_sum(p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters())

    out = _finish(spec, rank, size, step, checksum, opt)
    dist.barrier()
    dist.destroy_process_group()
    return out


RUNNERS = {
    "torch_tp": run_torch_tp,
    "phalanx_tp": run_phalanx_tp,
    "phalanx_hybrid": run_phalanx_hybrid,
    "fsdp2_hybrid": run_fsdp2_hybrid,
}


def run(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    out = RUNNERS[kind](spec)
    out["n_params"] = sum(p.numel() for p in build_model(spec).parameters()) if out.get("rank") == 0 else None
    return out
