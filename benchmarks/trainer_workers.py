"""Worker of bench_trainer.py: one training run of one configuration, on every rank that torch.distributed.run starts.

    python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port P \
        benchmarks/trainer_workers.py --kind phalanx_trainer --spec '{"seed": 1234, ...}' --out DIR

Every configuration runs under the same launcher (torch.distributed.run, which the Hugging Face Trainer needs for its
env:// world) and trains the same workload: the model is built with ``torch.manual_seed(seed)`` right before its
construction, the data set is generated from ``seed``, the batch size, accumulation, AdamW, linear schedule, gradient
clipping (1.0) and logging cadence are the same. A step's time is the interval between two consecutive
``on_step_end`` events (the Trainers' callback, the same class in both; the Engine loop records the clock at the same
point of its loop), so it covers the whole optimizer step: batch fetch, forward, backward, clipping, optimizer and
scheduler step, the loop's own bookkeeping and, every ``logging_steps``, the log. Each rank writes its figures to
``DIR/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from harness import memory_now, param_sum  # noqa: E402

# ------------------------------------------------------------------------------------------ workload


class MLPRegressor(nn.Module):
    """8 x Linear(d, d) with ReLU between (PEERS.md's MLP); takes a dict batch and returns {"loss", "logits"}, so that
    both Trainers run it unchanged."""

    def __init__(self, d: int = 1024, layers: int = 8) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks.append(nn.Linear(d, d))
            if i < layers - 1:
                blocks.append(nn.ReLU())
        self.net = nn.Sequential(*blocks)

    def forward(self, input: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:  # noqa: A002
        logits = self.net(input)
        loss = F.mse_loss(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class RandomRegression(Dataset):
    """``n`` samples {"input": randn(d), "labels": randn(d)} generated once from ``seed``."""

    def __init__(self, n: int, d: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed * 1_000_003)
        self.x = torch.randn(n, d, generator=g)
        self.y = torch.randn(n, d, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input": self.x[i], "labels": self.y[i]}


def build_model(spec: dict[str, Any]) -> nn.Module:
    torch.manual_seed(spec["seed"])
    return MLPRegressor(spec["d"], spec["layers"])


def dataset_size(spec: dict[str, Any], world_size: int) -> int:
    """Enough samples for every step in one epoch (no epoch boundary inside the timed steps)."""
    per_step = spec["batch"] * spec["grad_accum"] * world_size
    return per_step * (spec["warmup"] + spec["steps"] + 1)


def total_steps(spec: dict[str, Any]) -> int:
    return spec["warmup"] + spec["steps"]


# ------------------------------------------------------------------------------------------ timing


class StepClock:
    """The clock at each on_step_end, and a cProfile of the timed steps on rank 0 when asked."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.stamps: list[float] = []
        self.warmup = spec["warmup"]
        self.gpu = bool(spec.get("gpu"))
        # CPU time, not wall time: the shared machine's other processes then do not inflate what a function costs.
        self.profiler = cProfile.Profile(time.process_time) if spec.get("profile") and rank == 0 else None
        self.cpu0 = 0.0

    def step_end(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()  # the step's GPU work is done: every row is timed alike
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == self.warmup:  # the timed steps start here
            self.cpu0 = time.process_time()
            if self.profiler is not None:
                self.profiler.enable()

    def finish(self) -> None:
        if self.profiler is not None:
            self.profiler.disable()

    def step_times(self) -> list[float]:
        """The timed steps: intervals between on_step_end events after the warm-up steps."""
        s = self.stamps
        return [s[i] - s[i - 1] for i in range(self.warmup, len(s))]


def make_timing_callback(base: type, clock: StepClock) -> Any:
    """A callback class on ``base`` (phalanx's or transformers' TrainerCallback): the same in both Trainers."""

    class TimingCallback(base):  # type: ignore[misc, valid-type]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step_end()

    return TimingCallback()


# ------------------------------------------------------------------------------------------ configurations


def run_phalanx_trainer(spec: dict[str, Any], rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """phalanx.Trainer with its defaults (AdamW sparing biases, linear schedule, clipping at 1.0), strategy ddp."""
    import phalanx
    from phalanx.trainer.callbacks import TrainerCallback

    clock = StepClock(spec, rank)
    model = build_model(spec)
    args = phalanx.TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=spec["grad_accum"],
        learning_rate=spec["lr"],
        weight_decay=0.01,
        max_steps=total_steps(spec),
        logging_steps=spec["logging_steps"],
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec["seed"],
        strategy="ddp",
        bf16=bool(spec.get("bf16")),
        optim=spec["optim"],
    )
    trainer = phalanx.Trainer(
        model,
        args,
        train_dataset=RandomRegression(dataset_size(spec, world_size), spec["d"], spec["seed"]),
        callbacks=[make_timing_callback(TrainerCallback, clock)],
    )
    trainer.train()
    clock.finish()
    logged = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    out = _result(clock, spec, rank, logged, trainer.model)
    out["optimizer"] = _describe_optimizer(trainer.optimizer)
    out["describe"] = trainer.engine.strategy.describe()
    trainer.engine.wait_for_everyone()
    return out


def run_engine_loop(spec: dict[str, Any], rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """The same work written as an Engine loop: prepare, accumulate, backward of the item-normalised loss, optimizer
    and scheduler step (the Engine clips to max_grad_norm), zero_grad, and the mean loss over every item of the logging
    window every ``logging_steps``; the optimizer groups and schedule are the Trainer's defaults."""
    import phalanx

    clock = StepClock(spec, rank)
    model = build_model(spec)
    engine = phalanx.Engine(
        strategy="ddp",
        grad_accum_steps=spec["grad_accum"],
        seed=spec["seed"],
        max_grad_norm=1.0,
        precision="bf16-mixed" if spec.get("bf16") else "fp32",
    )
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec["lr"],
        fused=spec["optim"] == "adamw_torch_fused" or None,
    )
    n_steps = total_steps(spec)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (n_steps - s) / max(1, n_steps)))
    data = RandomRegression(dataset_size(spec, world_size), spec["d"], spec["seed"])
    loader = DataLoader(data, batch_size=spec["batch"], shuffle=True)
    model, opt, loader, sched = engine.prepare(model, opt, loader, sched)

    logged: list[tuple[int, float]] = []
    window_sum, window_items = torch.zeros((), dtype=torch.float64), 0
    step = 0
    model.train()
    for batch in loader:
        with engine.accumulate(model):
            out = model(**batch)
            n = batch["labels"].numel()  # float labels: every element counts (the Trainer's item count)
            engine.backward(out["loss"] * n, items=n)
            if engine.sync_gradients:
                opt.step()
                sched.step()
                opt.zero_grad()
        window_sum = window_sum + out["loss"].detach().double() * n
        window_items += n
        if not engine.sync_gradients:
            continue
        step += 1
        clock.step_end()
        if step % spec["logging_steps"] == 0:
            sums = engine.reduce(torch.tensor([float(window_sum), float(window_items)]), "sum")
            logged.append((step, (sums[0] / sums[1]).item()))
            window_sum, window_items = torch.zeros((), dtype=torch.float64), 0
        if step >= n_steps:
            break
    clock.finish()
    res = _result(clock, spec, rank, logged, model)
    res["optimizer"] = _describe_optimizer(opt)
    res["describe"] = engine.strategy.describe()
    engine.wait_for_everyone()
    return res


def run_hf_trainer(spec: dict[str, Any], rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """transformers.Trainer with use_cpu=True on the torch.distributed.run world (Accelerate MULTI_CPU on gloo);
    ``spec["optim"]``: the same optim as the phalanx rows (torch's AdamW, fused or foreach). On ``spec["gpu"]``, the
    GPU with ``use_cpu=False``."""
    import torch.distributed as dist
    import transformers
    from accelerate.utils import DistributedType

    clock = StepClock(spec, rank)
    model = build_model(spec)
    optim = {"optim": spec["optim"]}
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        use_cpu=not spec.get("gpu"),
        per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=spec["grad_accum"],
        learning_rate=spec["lr"],
        weight_decay=0.01,
        max_steps=total_steps(spec),
        logging_steps=spec["logging_steps"],
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec["seed"],
        dataloader_pin_memory=bool(spec.get("gpu")),
        bf16=bool(spec.get("bf16")),
        **optim,
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=RandomRegression(dataset_size(spec, world_size), spec["d"], spec["seed"]),
        callbacks=[make_timing_callback(transformers.TrainerCallback, clock)],
    )
    dtype = trainer.accelerator.distributed_type
    backend = dist.get_backend() if dist.is_initialized() else None
    if (
        world_size > 1
        and not spec.get("gpu")
        and (dtype != DistributedType.MULTI_CPU or trainer.args.world_size != world_size or backend != "gloo")
    ):
        raise RuntimeError(
            f"the HF Trainer runs {dtype} with world_size={trainer.args.world_size}, backend={backend}, "
            f"not MULTI_CPU x {world_size} on gloo: the comparison would be void"
        )
    trainer.train()
    clock.finish()
    logged = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    out = _result(clock, spec, rank, logged, model)
    out.update(
        optimizer=_describe_optimizer(trainer.optimizer),
        distributed_type=str(dtype),
        backend=backend,
        hf_world_size=trainer.args.world_size,
        transformers=transformers.__version__,
    )
    dist.barrier()
    return out


RUNNERS = {"phalanx_trainer": run_phalanx_trainer, "engine_loop": run_engine_loop, "hf_trainer": run_hf_trainer}


# ------------------------------------------------------------------------------------------ results


def _describe_optimizer(opt: Any) -> str:
    inner = getattr(opt, "optimizer", opt)
    while hasattr(inner, "optimizer") and inner is not inner.optimizer:
        inner = inner.optimizer
    d = getattr(inner, "defaults", {})
    impl = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "default"
    return f"{type(inner).__name__}({impl}, groups={len(getattr(inner, 'param_groups', []))})"


def _result(
    clock: StepClock, spec: dict[str, Any], rank: int, logged: list[tuple[int, float]], model: nn.Module
) -> dict[str, Any]:
    times = clock.step_times()
    res: dict[str, Any] = {
        "rank": rank,
        "times": times,
        "steps_recorded": len(clock.stamps),
        "cpu_per_step": (time.process_time() - clock.cpu0) / max(1, len(times)),
        "logged_losses": logged,
        "param_checksum": param_sum(model.parameters()),
        "peak_hwm_mib": memory_now()["vm_hwm_mib"],
        "threads": torch.get_num_threads(),
        "phalanx_file": getattr(sys.modules.get("phalanx"), "__file__", None),
    }
    if clock.profiler is not None:
        stats_path = Path(spec["profile"]) / f"{spec['kind']}.rank{rank}.prof"
        stats_path.parent.mkdir(parents=True, exist_ok=True)
        clock.profiler.dump_stats(str(stats_path))
        text = io.StringIO()
        st = pstats.Stats(clock.profiler, stream=text)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumulative").print_stats(45)
        stats_path.with_suffix(".txt").write_text(text.getvalue())
        res["profile"] = str(stats_path)
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=sorted(RUNNERS), required=True)
    p.add_argument("--spec", required=True, help="the workload as JSON")
    p.add_argument("--out", required=True, help="directory for rank<r>.json")
    a = p.parse_args()
    spec = dict(json.loads(a.spec), kind=a.kind)
    torch.set_num_threads(spec["threads"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with tempfile.TemporaryDirectory(prefix=f"bench-trainer-{a.kind}-") as tmp:
        # Each rank its own output_dir: nothing is saved, but the phalanx Trainer's JSONL log lives there.
        res = RUNNERS[a.kind](spec, rank, world_size, os.path.join(tmp, f"rank{rank}"))
    if res["steps_recorded"] != total_steps(spec):
        raise RuntimeError(f"{a.kind}: {res['steps_recorded']} optimizer steps recorded, expected {total_steps(spec)}")
    Path(a.out, f"rank{rank}.json").write_text(json.dumps(res))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # then a clean teardown (PEERS.md: gloo may abort at exit otherwise)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
