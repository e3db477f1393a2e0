"""The settings every strategy reads (the Engine's general group): strategy, precision, accumulation, seeds, the
runtime, the watchdog and resuming. Declared like each strategy's own group (see ``options.py``); ``settings.py``
composes them.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from phalanx.config.options import Options, option
from phalanx.config.registry import DEFAULT_STRATEGY

__all__ = ["GeneralOptions", "PRECISIONS", "CHECKPOINTING_SPELLINGS", "checkpointing_policy"]

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
"""The precisions phalanx trains in (``engine/precision.py`` runs them)."""

CHECKPOINTING_SPELLINGS = "full, every:k (k >= 1, e.g. every:2) or selective"
"""The values ``activation_checkpointing`` takes (``engine/activation.py`` applies them), for help and errors."""


def checkpointing_policy(value: str) -> tuple[str, int]:
    """``activation_checkpointing`` as (kind, every): ``full`` -> ("full", 1), ``every:k`` -> ("full", k): every
    k-th block, the first included; ``selective`` -> ("selective", 1). Another spelling raises ValueError."""
    text = value.strip().lower() if isinstance(value, str) else ""
    if text in ("full", "selective"):
        return text, 1
    head, _, k = text.partition(":")
    if head == "every" and k.strip().isdigit() and int(k) >= 1:
        return "full", int(k)
    raise ValueError(f"activation_checkpointing={value!r} is not one of: {CHECKPOINTING_SPELLINGS}")


def _is_policy(value: str) -> bool:
    try:
        checkpointing_policy(value)
    except ValueError:
        return False
    return True


@dataclass
class GeneralOptions(Options):
    """What every strategy reads: which strategy, precision, accumulation, seeds and the runtime."""

    title: typing.ClassVar[str] = "engine"
    applies_to: typing.ClassVar[str] = "every strategy"

    strategy: str = option(
        DEFAULT_STRATEGY, "How work is spread over ranks (see phalanx launch --help for each strategy)."
    )
    precision: str = option(
        "fp32", "fp32, bf16-mixed (autocast to bfloat16) or fp16-mixed (autocast to float16, dynamic loss scaling)."
    )
    grad_accum_steps: int = option(
        1,
        "Micro-batches per optimizer step (the accumulation window) under engine.accumulate().",
        check=lambda v: v >= 1,
        fix="use 1 for no accumulation",
    )
    seed: int = option(
        0, "Seed for model init helpers and the data order; the sample order depends only on seed and epoch."
    )
    max_grad_norm: float | None = option(
        None,
        "optimizer.step() first clips the global gradient norm to this value, unless the script clipped in "
        "this step (as DeepSpeed's gradient_clipping).",
        check=lambda v: v > 0,
        fix="use a positive norm, or leave it unset to not clip",
    )
    on_nonfinite: str = option(
        "raise",
        "A NaN or inf loss or gradient at an optimizer step (fp32, bf16): raise (name the step, the ranks and "
        "the parameters; nothing is stepped), skip (do not apply the step, warn) or ignore (no check). fp16 keeps its "
        "loss scaler.",
        choices=("raise", "skip", "ignore"),
    )
    device: str = option(
        "auto",
        "auto (a GPU when there is one: the only GPU a process sees, else the one of its local rank; else the CPU), "
        "cpu or cuda.",
        choices=("auto", "cpu", "cuda"),
    )
    timeout_s: float = option(
        1800.0,
        "Timeout of collectives and of process-group start-up, in seconds.",
        check=lambda v: v > 0,
        fix="use a positive number of seconds",
    )
    hang_timeout_s: float | None = option(
        None,
        "A rank that waits this long in one collective ends the job with a report naming the missing rank and "
        "where it is (its Python stack). Default (unset): 300 on CPU, 600 on CUDA; 0 turns the watchdog off. Must be "
        "below timeout_s.",
        check=lambda v: v >= 0,
        fix="use a positive number of seconds, or 0 to turn it off",
    )
    debug_collectives: bool = option(
        False,
        "Before every collective, the ranks compare what they are about to call (op, size, dtype, label, line) "
        "and stop at once when they differ, naming each rank's call: one more small all-gather per collective.",
    )
    nccl_rules: bool = option(
        False,
        "Check on the CPU that every collective would run on NCCL: a host tensor made by phalanx, a dtype NCCL "
        "lacks (int16, uint16, uint32, uint64) or a call from outside the group stops the run with the place it came "
        "from (phalanx/runtime/nccl_rules.py). A Python call per torch op: for tests and debugging.",
    )
    resume_from: str | None = option(
        None,
        "A directory the script saves checkpoints into: engine.prepare loads the newest complete one as soon as "
        "everything it holds is prepared (none there: a fresh start), so that a job restarted by phalanx launch "
        "--max-restarts continues where it was. The Trainer resumes from its output_dir this way.",
    )
    host_mmap_threshold_mb: float = option(
        0.0,
        "CPU (Linux, glibc): host blocks of at least this many MiB are mapped and given back to the system when "
        "freed, so that resident memory follows what the process holds instead of keeping freed room (see "
        "phalanx/runtime/memory.py). Measured under zero2/zero3: 20-25% less peak RSS, but steps 1.5-1.7x slower "
        "(page faults on every large allocation), so 0 (glibc's own) is the default; 1 when memory is what binds.",
        check=lambda v: v >= 0,
        fix="use a size in MiB such as 1, or 0 for glibc's default",
    )
    activation_checkpointing: str | None = option(
        None,
        "Recompute activations in backward instead of keeping them (engine/activation.py, docs/activation-"
        "checkpointing.md): full (every block), every:k (every k-th block, the first included) or selective (each "
        "block keeps its matmul and attention outputs and recomputes the rest). The blocks are zero3's units: a "
        "transformers model's decoder layers (_no_split_modules), else each child module with parameters, or "
        "zero3_unit_classes under zero3. Unset: nothing is recomputed.",
        check=_is_policy,
        fix=f"use {CHECKPOINTING_SPELLINGS}, or leave it unset",
    )
    activation_offload: bool = option(
        False,
        "Keep what autograd saves during the prepared model's forward in pinned host memory, copied back in "
        "backward (torch.autograd.graph.save_on_cpu), the copies overlapped with compute; on CUDA only (on a CPU "
        "there is no device memory to free, and it does nothing). With activation_checkpointing, a recomputed "
        "block's inputs move too; selective's saved matmul outputs stay on the device.",
    )
    log_all_ranks: bool = option(False, "Log from every rank, not only rank 0.")
    deepspeed: str | None = option(
        None,
        "A DeepSpeed JSON config (ds_config.json): its settings are read as phalanx's, and engine.prepare builds "
        "its optimizer and scheduler blocks when the script passes none.",
    )
    micro_batch_size: int | None = option(
        None,
        "The batch size of each rank's DataLoader (DeepSpeed's train_micro_batch_size_per_gpu); checked at "
        "engine.prepare.",
        check=lambda v: v >= 1,
        fix="use 1 or more",
    )
    global_batch_size: int | None = option(
        None,
        "Samples per optimizer step over all ranks (DeepSpeed's train_batch_size): micro_batch_size x "
        "grad_accum_steps x the data-parallel size, checked.",
        check=lambda v: v >= 1,
        fix="use 1 or more",
    )
    loss_scale: float | None = option(
        None,
        "fp16-mixed: a static loss scale (DeepSpeed's fp16.loss_scale); default dynamic.",
        check=lambda v: v > 0,
        fix="use a positive scale, or leave it unset for dynamic scaling",
    )
    loss_scale_init: float = option(
        65536.0,
        "fp16-mixed: the first dynamic loss scale (DeepSpeed's 2**initial_scale_power).",
        check=lambda v: v > 0,
        fix="use a positive scale such as 65536",
    )
    loss_scale_window: int = option(
        2000,
        "fp16-mixed: steps without an overflow before the scale doubles (DeepSpeed's loss_scale_window).",
        check=lambda v: v >= 1,
        fix="use 1 or more",
    )
    loss_scale_hysteresis: int = option(
        1,
        "fp16-mixed: overflows that the scale survives before it halves (DeepSpeed's hysteresis).",
        check=lambda v: v >= 1,
        fix="use 1 (halve at every overflow) or more",
    )
    loss_scale_min: float | None = option(
        None,
        "fp16-mixed: the scale never falls below this (DeepSpeed's min_loss_scale).",
        check=lambda v: v > 0,
        fix="use a positive scale such as 1",
    )
