"""Worker functions for bench_context_parallel.py: one run of one context-parallel configuration, in processes
started by phalanx.spawn (1 thread per rank, gloo).

The model is a transformers ``LlamaForCausalLM`` (``attn_implementation="sdpa"``, grouped-query attention, dropout
off), built with ``torch.manual_seed(seed)`` right before construction; every step trains on the same sequence of
random token ids (``{"input_ids", "labels"}``, batch 1, no attention mask), so every configuration starts from the
same loss. Kinds (``run(kind, spec)``):

- ``single``: plain torch in one process on the whole sequence (no phalanx): ``model(**batch).loss``,
  ``loss.backward()``, AdamW. The reference of every ratio.
- ``phalanx``: ``phalanx.Engine(cp_size=N)`` (ring attention) or ``Engine(sp_size=N)`` (Ulysses) on N ranks, a
  prepared DataLoader (it cuts the sequence), ``engine.backward(loss)``, the same AdamW.
- ``torch_cp``: torch's own ``torch.distributed.tensor.experimental.context_parallel`` on the same model, to see
  whether it runs on CPU/gloo at all (it records the error when it does not).

A ``time`` run (``spec["mode"]``) is ``harness.train_loop`` (warm-up, timed steps), then one *measured* step: the
forward under ``torch.autograd.graph.saved_tensors_hooks`` (the bytes saved for backward, by module), and the
whole step with phalanx's collective log on (every collective's label, op, elements and dtype, forward and backward
apart). A ``memory`` run is one step on a long sequence: the resident memory over the rank's own baseline
(``VmHWM`` reset after setup through ``/proc/self/clear_refs``, and ``ru_maxrss``), then, on rank 0, one more step
under ``torch.profiler`` with ``profile_memory``: which allocations are alive at the peak, and which op and which
module or backward node made them.

Every function here is module-level so that the spawn start method can import it by name.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import resource
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch
from harness import init_gloo, make_adamw, memory_now, param_sum, train_loop, world
from torch import nn

# ------------------------------------------------------------------------------------------ model and data


def build_model(spec: dict[str, Any]) -> nn.Module:
    """A small Llama: ``spec["model"]`` gives vocab, hidden, intermediate, layers, heads and kv heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = spec["model"]
    torch.manual_seed(spec["seed"])
    cfg = LlamaConfig(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["intermediate"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        max_position_embeddings=max(spec["seq"], 16),
        attention_dropout=0.0,
        attn_implementation="sdpa",
        use_cache=False,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def sample(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The one training sequence (token ids from the seed), ``labels`` = ``input_ids`` (the model shifts them)."""
    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + spec["seq"])
    ids = torch.randint(spec["model"]["vocab"], (spec["seq"],), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


# ------------------------------------------------------------------------------------------ module scopes


def _scope_of(name: str) -> str | None:
    """The bucket a module's work is counted in: ``layer<i>.attention`` / ``.mlp`` / ``.norms`` / ``.other`` per
    decoder layer, ``embedding``, ``rotary``, ``final_norm``, ``lm_head``; None for modules not tracked apart."""
    parts = name.split(".")
    if name.endswith("embed_tokens"):
        return "embedding"
    if name.endswith("rotary_emb"):
        return "rotary"
    if name == "lm_head":
        return "lm_head"
    if name == "model.norm":
        return "final_norm"
    if "layers" not in parts:
        return None
    idx = parts.index("layers")
    rest = parts[idx + 2 :]
    layer = f"layer{parts[idx + 1]}" if idx + 1 < len(parts) else None
    if layer is None:
        return None
    if not rest:
        return f"{layer}.other"
    kinds = {"self_attn": "attention", "mlp": "mlp", "input_layernorm": "norms", "post_attention_layernorm": "norms"}
    return f"{layer}.{kinds[rest[0]]}" if len(rest) == 1 and rest[0] in kinds else None


class Scopes:
    """Forward pre/post hooks that keep a stack of the module scopes being run (``_scope_of``); with ``profile``,
    each scope is also a ``record_function`` range (``module: <scope>``) in the profiler's trace."""

    def __init__(self, model: nn.Module, profile: bool = False) -> None:
        self.stack = ["loss and the rest"]
        self.handles: list[Any] = []
        self.ranges: list[Any] = []
        for name, mod in model.named_modules():
            scope = _scope_of(name)
            if scope is None:
                continue
            self.handles.append(mod.register_forward_pre_hook(self._enter(scope, profile)))
            self.handles.append(mod.register_forward_hook(self._exit(profile)))

    def _enter(self, scope: str, profile: bool) -> Any:
        def hook(mod: nn.Module, args: Any) -> None:
            self.stack.append(scope)
            if profile:
                r = torch.autograd.profiler.record_function(f"module: {scope}")
                r.__enter__()
                self.ranges.append(r)

        return hook

    def _exit(self, profile: bool) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            self.stack.pop()
            if profile and self.ranges:
                self.ranges.pop().__exit__(None, None, None)

        return hook

    @property
    def current(self) -> str:
        return self.stack[-1]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class SavedBytes:
    """Bytes saved for backward during a forward, by scope: ``unique_bytes`` counts each storage once (its whole
    ``nbytes``, at the scope that saved it first: what the saved tensors hold in memory), ``tensor_bytes`` sums
    every saved tensor's ``numel * element_size`` (a tensor saved twice counts twice). Parameters (a Linear saves its
    weight) are left out and counted apart."""

    def __init__(self, model: nn.Module, scopes: Scopes, detail: str = "layer1.") -> None:
        self.scopes = scopes
        self.detail_prefix = detail
        self.detail: list[dict[str, Any]] = []
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.unique: dict[str, int] = collections.Counter()
        self.tensor: dict[str, int] = collections.Counter()
        self.count: dict[str, int] = collections.Counter()
        self.param_tensors = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.params:
            self.param_tensors += 1
            return t
        scope = self.scopes.current
        self.tensor[scope] += t.numel() * t.element_size()
        self.count[scope] += 1
        new = bool(key) and key not in self.seen
        if new:
            self.seen.add(key)
            self.unique[scope] += st.nbytes()
        if scope.startswith(self.detail_prefix):
            self.detail.append(
                {
                    "scope": scope,
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "grad_fn_of_saved": type(t.grad_fn).__name__ if t.grad_fn is not None else None,
                    "new_storage_bytes": st.nbytes() if new else 0,
                }
            )
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def result(self) -> dict[str, Any]:
        scopes = sorted(set(self.unique) | set(self.tensor))
        return {
            "by_scope": {
                s: {
                    "unique_bytes": self.unique.get(s, 0),
                    "tensor_bytes": self.tensor.get(s, 0),
                    "saved": self.count[s],
                }
                for s in scopes
            },
            "unique_bytes_total": sum(self.unique.values()),
            "tensor_bytes_total": sum(self.tensor.values()),
            "parameter_tensors_left_out": self.param_tensors,
            f"detail_{self.detail_prefix.rstrip('.')}": self.detail,
        }


# ------------------------------------------------------------------------------------------ the collective log


def _log_on() -> tuple[Any, bool, Any]:
    """Turn phalanx's collective log on with an unbounded ``recent`` (its default keeps the last 64 entries; one
    step of ring attention over 4 layers has more). Returns what ``_log_off`` restores."""
    from phalanx.runtime.collective_log import LOG

    old = (LOG.recent, LOG.on)
    LOG.recent = collections.deque()
    LOG.on = True
    return LOG, old[1], old[0]


def _log_off(state: tuple[Any, bool, Any]) -> list[Any]:
    log, was_on, recent = state
    entries = list(log.recent)
    log.on = was_on
    log.recent = recent
    return entries


def _entries(entries: list[Any], phase: str) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        item = torch.empty(0, dtype=e.dtype).element_size() if isinstance(e.dtype, torch.dtype) else 0
        out.append(
            {
                "phase": phase,
                "label": e.label,
                "op": e.op,
                "numel": int(e.numel),
                "dtype": str(e.dtype),
                "bytes": int(e.numel) * item,
                "group_size": len(e.group),
                "peer": e.peer,
            }
        )
    return out


# ------------------------------------------------------------------------------------------ runs


def _loss_value(loss: torch.Tensor, weight: torch.Tensor | None) -> float:
    """This rank's share of the whole sequence's mean loss, times the cp size (the mean over ranks is the loss)."""
    return float(loss.detach() * (weight if weight is not None else 1.0))


class _Setup:
    """A configuration ready to step: ``step(batch)`` returns this rank's loss value (see ``_loss_value``);
    ``next_batch()`` the batch of the next step; ``model`` the user's model (unwrapped) for hooks."""

    def __init__(self, kind: str, spec: dict[str, Any], rank: int, size: int, steps: int) -> None:
        self.kind, self.spec, self.rank, self.size = kind, spec, rank, size
        self.engine: Any = None
        if kind == "single":
            model = build_model(spec)
            opt = make_adamw(model.parameters(), spec)
            s = sample(spec)
            whole = {k: v.unsqueeze(0) for k, v in s.items()}

            def batches() -> Any:
                while True:
                    yield whole

            self.it = batches()
            self.wrapped, self.model, self.opt = model, model, opt
        else:
            import phalanx

            self.engine = phalanx.Engine(**{spec["setting"]: size}, seed=spec["seed"])
            model = build_model(spec)
            opt = make_adamw(model.parameters(), spec)
            loader = torch.utils.data.DataLoader([sample(spec)] * steps, batch_size=1)
            self.wrapped, self.opt, loader = self.engine.prepare(model, opt, loader)
            self.model = self.engine.unwrap_model(self.wrapped)
            self.it = iter(loader)

    def next_batch(self) -> Any:
        return next(self.it)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.wrapped(**batch).loss

    def backward_and_step(self, loss: torch.Tensor) -> None:
        if self.engine is None:
            loss.backward()
        else:
            self.engine.backward(loss)
        self.opt.step()
        self.opt.zero_grad()

    def weight(self) -> torch.Tensor | None:
        cp = self.engine.context_parallel if self.engine is not None else None
        return cp.weight() if cp is not None else None

    def step(self, batch: Any) -> float:
        loss = self.forward(batch)
        self.backward_and_step(loss)
        return _loss_value(loss, self.weight())

    def state_bytes(self) -> int:
        """Parameters + gradients + AdamW moments on this rank (bytes)."""
        p = sum(t.numel() * t.element_size() for t in self.model.parameters())
        s = sum(
            v.numel() * v.element_size()
            for st in self.opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        return 2 * p + s


def run_time(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Warm-up and timed steps (harness.train_loop), then the measured step: saved-for-backward bytes and the
    collectives of one whole step."""
    rank, size = world()
    total = spec["warmup"] + spec["steps"] + 1
    st = _Setup(kind, spec, rank, size, total)

    def batch(s: int) -> tuple[Any, None]:
        return st.next_batch(), None

    def step(b: Any, _: Any) -> float:
        return st.step(b)

    out = train_loop(spec, rank, batch, step, lambda: param_sum(st.model.parameters()))

    # the measured step
    b = st.next_batch()
    scopes = Scopes(st.model)
    saved = SavedBytes(st.model, scopes)
    log = _log_on()
    try:
        with saved.hooks():
            loss = st.forward(b)
        n_forward = len(log[0].recent)
        st.backward_and_step(loss)
    finally:
        entries = _log_off(log)
        scopes.remove()
    out["measured_loss"] = _loss_value(loss, st.weight())
    out["saved"] = saved.result()
    out["collectives"] = _entries(entries[:n_forward], "forward") + _entries(entries[n_forward:], "backward")
    out["n_params"] = sum(p.numel() for p in st.model.parameters())
    out["state_bytes"] = st.state_bytes()
    return out


def _reset_hwm() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_memory(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One step on ``spec["seq"]`` tokens: the peak resident memory over this rank's baseline (after setup and the
    first batch, before the step); then, with ``spec["profile_memory"]``, one more step with rank 0 under the
    profiler and the saved-for-backward bytes of its forward."""
    rank, size = world()
    st = _Setup(kind, spec, rank, size, 2)
    b = st.next_batch()
    gc.collect()
    base = memory_now()
    reset = _reset_hwm()
    after_reset = memory_now()
    t0, cpu0 = time.perf_counter(), time.process_time()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    loss = st.step(b)
    step_s = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    end = memory_now()
    out: dict[str, Any] = {
        "rank": rank,
        "loss": loss,
        "step_s": step_s,
        "step_cpu_s": time.process_time() - cpu0,
        "step_user_s": ru1.ru_utime - ru0.ru_utime,
        "step_sys_s": ru1.ru_stime - ru0.ru_stime,  # the kernel: mostly page faults of fresh allocations
        "step_minor_faults": ru1.ru_minflt - ru0.ru_minflt,
        "baseline": base,
        "hwm_reset": reset,
        "after_reset": after_reset,
        "end": end,
        # the figures: VmHWM since the reset, and ru_maxrss (whole life), over the baseline's VmRSS
        "peak_over_baseline_mib": (end["vm_hwm_mib"] - after_reset["vm_rss_mib"]) if reset else None,
        "ru_maxrss_over_baseline_mib": end["ru_maxrss_mib"] - base["vm_rss_mib"],
        "baseline_hwm_mib": base["vm_hwm_mib"],
        "state_bytes": st.state_bytes(),
        "n_params": sum(p.numel() for p in st.model.parameters()),
        "phalanx_file": getattr(__import__("sys").modules.get("phalanx"), "__file__", None),
    }
    if spec.get("profile_memory"):
        b = st.next_batch()
        gc.collect()
        scopes = Scopes(st.model, profile=rank == 0)
        saved = SavedBytes(st.model, scopes)
        if rank == 0:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                with saved.hooks():
                    loss_t = st.forward(b)
                st.backward_and_step(loss_t)
            out["profile"] = live_at_peak(prof)
        else:
            with saved.hooks():
                loss_t = st.forward(b)
            st.backward_and_step(loss_t)
        scopes.remove()
        out["saved"] = saved.result()
    return out


# ------------------------------------------------------------------------------------------ the memory profile


def live_at_peak(prof: Any, top: int = 25) -> dict[str, Any]:
    """From a ``profile_memory`` trace: the running sum of the bytes allocated minus freed during the profiled step
    (allocations made before it and freed during it count negative), its peak, and the allocations of the step
    still alive at that peak, each attributed to the innermost op that made it and to its innermost named range
    (``module: <scope>`` in the forward, autograd's ``evaluate_function: <Node>`` in the backward)."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="bench_cp_trace_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    ops = [e for e in events if e.get("ph") == "X" and "dur" in e]
    running, peak, peak_i = 0, 0, -1
    for i, e in enumerate(mem):
        running += int(e["args"]["Bytes"])
        if running > peak:
            peak, peak_i = running, i
    live: dict[int, dict[str, Any]] = {}
    for e in mem[: peak_i + 1]:
        a = e["args"]
        if a["Bytes"] > 0:
            live[a["Addr"]] = {"bytes": int(a["Bytes"]), "ts": e["ts"], "tid": e.get("tid")}
        else:
            live.pop(a["Addr"], None)

    def where(ts: float, tid: Any) -> tuple[str, str]:
        inner, outer = None, None
        for o in ops:
            if o.get("tid") != tid or not (o["ts"] <= ts <= o["ts"] + o["dur"]):
                continue
            name = o["name"]
            if inner is None or o["dur"] < inner["dur"]:
                inner = o
            if name.startswith(("module: ", "autograd::engine::evaluate_function: ", "Optimizer.")) and (
                outer is None or o["dur"] < outer["dur"]
            ):
                outer = o  # the innermost named range: the module (or backward node) that made it
        return (
            outer["name"].replace("autograd::engine::evaluate_function: ", "backward: ") if outer else "(none)",
            inner["name"] if inner else "(none)",
        )

    groups: dict[tuple[str, str, int], int] = collections.Counter()
    by_context: dict[str, int] = collections.Counter()
    for a in live.values():
        ctx, op = where(a["ts"], a["tid"])
        groups[(ctx, op, a["bytes"])] += 1
        by_context[ctx] += a["bytes"]
    rows = sorted(groups.items(), key=lambda kv: -kv[0][2] * kv[1])
    peak_ts = mem[peak_i]["ts"] if peak_i >= 0 else None
    at_peak = where(peak_ts, mem[peak_i].get("tid")) if peak_i >= 0 else ("(none)", "(none)")
    return {
        "peak_bytes_over_step_start": peak,
        "end_bytes_over_step_start": running,
        "peak_in": {"context": at_peak[0], "op": at_peak[1]},
        "live_at_peak_bytes": sum(a["bytes"] for a in live.values()),
        "live_at_peak_allocations": len(live),
        "live_at_peak_by_context": dict(sorted(by_context.items(), key=lambda kv: -kv[1])),
        "live_at_peak_top": [
            {"context": c, "op": o, "bytes_each": n, "count": k, "bytes": n * k} for (c, o, n), k in rows[:top]
        ],
    }


# ------------------------------------------------------------------------------------------ torch's own


def run_torch_cp(spec: dict[str, Any]) -> dict[str, Any]:
    """One forward + backward of the model under ``torch.distributed.tensor.experimental.context_parallel`` on a
    CPU DeviceMesh, with SDPA's backend ``spec["backend"]`` (``default``: SDPA's own choice; ``math``: the math
    backend forced); records what happened (the error, when it fails)."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rank, size = init_gloo()
    mesh = init_device_mesh("cpu", (size,))
    out: dict[str, Any] = {"rank": rank, "backend": spec["backend"]}
    model = build_model(spec)
    s = sample(spec)
    ids, labels = s["input_ids"].unsqueeze(0), s["labels"].unsqueeze(0)
    pos = torch.arange(spec["seq"]).unsqueeze(0)
    try:
        backend = sdpa_kernel(SDPBackend.MATH) if spec["backend"] == "math" else contextlib.nullcontext()
        with backend, context_parallel(mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1]):
            loss = model(input_ids=ids, labels=labels, position_ids=pos).loss
            loss.backward()
        out.update(ok=True, loss=float(loss))
    except Exception as e:  # noqa: BLE001 - the error is the result
        out.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], traceback_tail=traceback.format_exc()[-1500:])
    with contextlib.suppress(Exception):  # the group may be broken after a failure
        dist.destroy_process_group()
    return out


def run(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The one entry point phalanx.spawn calls."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if kind == "torch_cp":
        return run_torch_cp(spec)
    return run_memory(kind, spec) if spec["mode"] == "memory" else run_time(kind, spec)
