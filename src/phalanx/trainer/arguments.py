"""TrainingArguments: Hugging Face's names and defaults for what a Trainer run is, plus phalanx's strategy.

    args = TrainingArguments("out", per_device_train_batch_size=16, eval_strategy="epoch", bf16=True,
                             strategy="zero3", strategy_options={"offload": "cpu"})
    engine = phalanx.Engine(**args.engine_options())

Defaults and derived values follow transformers 5 (``training_args.py``). Where transformers would accept a
contradiction or a misspelt keyword, phalanx refuses with an error that names the values and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.config.dialects.deepspeed import from_deepspeed, read_deepspeed
from phalanx.config.dialects.parallelism import object_spelling, read_parallelism, values_of
from phalanx.config.general import PRECISIONS
from phalanx.config.options import ConfigError
from phalanx.config.registry import strategy_names
from phalanx.config.settings import engine_fields
from phalanx.engine.trackers import tracker_names
from phalanx.logging import get_logger, warn_once
from phalanx.trainer.loss import LabelSmoother
from phalanx.trainer.schedules import check_schedule_kwargs

__all__ = ["TrainingArguments", "UnknownArgumentError", "optimizer_cls_and_kwargs", "settle_for_trainer"]

_INTERVALS = ("no", "steps", "epoch")
_SAVES = ("no", "steps", "epoch", "best")
# transformers' optim names that build a torch optimizer (AdamW's default since torch 2.8 is the fused kernel), and
# the optim_args each reads, as floats and as booleans.
OPTIMS = ("adamw_torch_fused", "adamw_torch", "sgd", "adagrad", "rmsprop")
_OPTIM_ARGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sgd": (("momentum", "dampening", "weight_decay"), ("nesterov",)),
    "adagrad": (("lr_decay", "weight_decay", "eps"), ()),
    "rmsprop": (("momentum", "alpha", "eps", "weight_decay"), ("centered",)),
}
_PRECISION_OF = {"bf16": "bf16-mixed", "fp16": "fp16-mixed"}
# Engine settings that a TrainingArguments field already says; a knob of the same name would say it twice.
_OWNED = {
    "strategy": "strategy", "precision": "precision (or bf16 / fp16)",
    "grad_accum_steps": "gradient_accumulation_steps",
    "seed": "seed", "max_grad_norm": "max_grad_norm", "deepspeed": "deepspeed",
    "micro_batch_size": "per_device_train_batch_size", "global_batch_size": "per_device_train_batch_size",
    "tp_size": "tp_size (or parallelism_config)", "dp_shard_size": "dp_shard_size (or parallelism_config)",
    "dp_replicate_size": "dp_replicate_size (or parallelism_config)",
    "cp_size": "parallelism_config (its cp_size)", "sp_size": "parallelism_config (its sp_size)",
    "ep_size": "ep_size",
}  # fmt: skip
# transformers' fsdp words: the strategy each sharding word is, and whether it is FSDP's hybrid (shards within a
# machine, replicas across machines); "offload" and "auto_wrap" go with one of them.
_FSDP_WORDS = {"full_shard": ("zero3", False), "shard_grad_op": ("zero2", False), "no_shard": ("ddp", False),
               "hybrid_shard": ("zero3", True), "hybrid_shard_zero2": ("zero2", True)}  # fmt: skip
_MESH = ("tp_size", "dp_shard_size", "dp_replicate_size", "ep_size")
# transformers fields that phalanx does not take, with what to do instead.
_HF_ELSEWHERE = {
    "fsdp_config": "use fsdp (or strategy='zero3') and strategy_options",
    "ddp_bucket_cap_mb": "use strategy_options={'bucket_mb': ...}",
    "ddp_timeout": "use strategy_options={'timeout_s': ...}",
    "use_cpu": "use strategy_options={'device': 'cpu'}", "no_cuda": "use strategy_options={'device': 'cpu'}",
    "local_rank": "phalanx reads the rank from the launcher",
    "overwrite_output_dir": "remove it (phalanx never deletes output_dir)",
    "logging_dir": "phalanx logs to output_dir (JSONL, and TensorBoard with report_to)",
    "activation_checkpointing": "use gradient_checkpointing, or strategy_options={'activation_checkpointing': "
    "'full'} (or 'every:2', 'selective')", "push_to_hub": "push the saved directory yourself",
}  # fmt: skip
_WARNED: set[str] = set()


def optimizer_cls_and_kwargs(args: TrainingArguments) -> tuple[type, dict[str, Any]]:
    """The torch optimizer class that ``args.optim`` names and its keywords, as transformers builds them: the
    learning rate; AdamW's betas and eps (and the fused kernel for adamw_torch_fused); ``optim_args`` for the others."""
    import torch

    kwargs: dict[str, Any] = {"lr": args.learning_rate}
    if args.optim in ("adamw_torch", "adamw_torch_fused"):
        kwargs |= {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
        if args.optim == "adamw_torch_fused":
            kwargs["fused"] = True
        return torch.optim.AdamW, kwargs
    floats, flags = _OPTIM_ARGS[args.optim]
    given = {}
    for item in (args.optim_args or "").replace(" ", "").split(","):
        if item:
            key, sep, value = item.partition("=")
            if not sep or key not in floats + flags:
                raise ConfigError(
                    f"TrainingArguments: optim_args={args.optim_args!r}: {key!r} is not one of optim={args.optim!r}'s "
                    f"keywords ({', '.join(floats + flags)}), each written key=value"
                )
            given[key] = value
    for key, value in given.items():
        kwargs[key] = value.lower() in ("true", "1", "yes") if key in flags else float(value)
    cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}[args.optim]
    return cls, kwargs


class UnknownArgumentError(ConfigError, TypeError):
    """A keyword that TrainingArguments does not have. A TypeError (as a dataclass raises) and a ConfigError."""


def _deprecated(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(
            message, FutureWarning, stacklevel=5
        )  # _deprecated < _read_deprecated < __post_init__ < __init__ < the caller


@dataclass
class TrainingArguments:
    """What a Trainer run does, with transformers' names and defaults; ``engine_options()`` gives the Engine's."""

    output_dir: str | None = None
    """Where checkpoints, logs and the saved model go; None means ``trainer_output`` (as transformers)."""
    do_train: bool = False
    """A flag for your script (as in transformers, the Trainer does not read it)."""
    do_eval: bool = False
    """A flag for your script (as in transformers, the Trainer does not read it)."""
    do_predict: bool = False
    """A flag for your script (as in transformers, the Trainer does not read it)."""
    per_device_train_batch_size: int = 8
    """Samples per process per micro-batch in training."""
    per_device_eval_batch_size: int = 8
    """Samples per process per batch in evaluation."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (the Engine's grad_accum_steps)."""
    learning_rate: float = 5e-5
    """The initial learning rate of the default AdamW."""
    weight_decay: float = 0.0
    """AdamW's weight decay, applied to every parameter except biases and norm weights."""
    adam_beta1: float = 0.9
    """AdamW's beta1."""
    adam_beta2: float = 0.999
    """AdamW's beta2."""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon."""
    optim: str = "adamw_torch_fused"
    """The optimizer the Trainer builds: adamw_torch_fused (torch's AdamW, fused kernel; transformers' default),
    adamw_torch (its foreach kernel), sgd, adagrad or rmsprop (torch's). Any other: pass
    ``Trainer(optimizers=(optimizer, None))`` or ``optimizer_cls_and_kwargs``."""
    optim_args: str | None = None
    """More keywords of sgd, adagrad or rmsprop, as "momentum=0.9,nesterov=True" (transformers' format)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; 0 (or None) does not clip."""
    num_train_epochs: float = 3.0
    """Epochs to train when max_steps is not positive; a fraction stops inside the last epoch."""
    max_steps: int = -1
    """Optimizer steps to train; when positive it overrides num_train_epochs."""
    lr_scheduler_type: str = "linear"
    """linear, cosine, cosine_with_min_lr, cosine_warmup_with_min_lr, cosine_with_restarts, constant,
    constant_with_warmup, polynomial, inverse_sqrt, warmup_stable_decay, or reduce_lr_on_plateau and greedy
    (these two step on each evaluation's metric_for_best_model)."""
    lr_scheduler_kwargs: dict[str, Any] | str | None = None
    """The schedule's own keywords (e.g. ``{"min_lr_rate": 0.1}``); a JSON object as a string is read."""
    warmup_steps: float = 0
    """Linear warmup: 1 or more is a number of steps, below 1 a ratio of the run's steps."""
    warmup_ratio: float | None = None
    """Deprecated in transformers 5 (removed in 5.2): use ``warmup_steps`` below 1. Read into warmup_steps."""
    logging_strategy: str = "steps"
    """When to log the training loss: no, steps or epoch."""
    logging_steps: float = 500
    """Optimizer steps between logs; below 1 a ratio of the run's steps."""
    logging_first_step: bool = False
    """Also log after the first optimizer step."""
    eval_strategy: str = "no"
    """When to evaluate: no, steps or epoch."""
    evaluation_strategy: str | None = None
    """Deprecated spelling of eval_strategy (removed in transformers 5); read into eval_strategy with a warning."""
    eval_steps: float | None = None
    """Optimizer steps between evaluations under eval_strategy='steps'; unset means logging_steps."""
    eval_delay: float = 0
    """Epochs (eval_strategy='epoch') or steps (eval_strategy='steps') to wait before the first evaluation."""
    eval_accumulation_steps: int | None = None
    """transformers moves predictions to the host every this many batches; phalanx moves every batch (to keep none
    on the device), so any value behaves as 1."""
    eval_on_start: bool = False
    """Evaluate once before the first step, as a sanity check."""
    save_strategy: str = "steps"
    """When to save a checkpoint: no, steps, epoch, or best (whenever the metric improves)."""
    save_steps: float = 500
    """Optimizer steps between checkpoints under save_strategy='steps'; below 1 a ratio of the run's steps."""
    save_total_limit: int | None = None
    """Checkpoints to keep in output_dir; the best and the newest are never deleted. None keeps all."""
    save_only_model: bool = False
    """Checkpoints hold the model only (no optimizer, scheduler or RNG state), so they cannot be resumed."""
    save_async: bool = False
    """phalanx's own: write each checkpoint on a thread while training goes on (``engine.save_state(...,
    async_save=True)``); training stops only while the state is copied to host memory. One save is written at a
    time, a failure is raised at the next save, and ``train()`` returns once the last one is in place."""
    load_best_model_at_end: bool = False
    """Load the best checkpoint (by metric_for_best_model) when training ends."""
    metric_for_best_model: str | None = None
    """The evaluation metric that picks the best checkpoint (``eval_`` prefix optional); 'loss' by default when
    load_best_model_at_end or save_strategy='best'."""
    greater_is_better: bool | None = None
    """Whether a higher metric_for_best_model is better; by default False for names ending in 'loss', else True."""
    seed: int = 42
    """Seed of the model's initialisation helpers and, unless data_seed is set, of the data order."""
    data_seed: int | None = None
    """Seed of the data order only; None uses seed."""
    bf16: bool = False
    """Mixed precision with bfloat16 autocast (precision='bf16-mixed')."""
    fp16: bool = False
    """Mixed precision with float16 autocast and dynamic loss scaling (precision='fp16-mixed')."""
    dataloader_num_workers: int = 0
    """DataLoader worker processes; 0 loads in the training process."""
    dataloader_drop_last: bool = False
    """Drop each epoch's last incomplete batch."""
    dataloader_pin_memory: bool = True
    """Pin host memory of batches (used when training on a GPU)."""
    remove_unused_columns: bool = True
    """Drop dataset columns that the model's forward does not take."""
    label_names: list[str] | None = None
    """Batch keys that hold labels; None means the model forward's parameters named like a label (``labels``, a
    question-answering model's ``start_positions`` and ``end_positions``), else ``labels``."""
    include_for_metrics: list[str] = field(default_factory=list)
    """What ``compute_metrics`` receives besides predictions and labels: "inputs" (the batch's main input) and
    "loss" (each sample's batch loss), as ``EvalPrediction.inputs`` and ``.losses``."""
    prediction_loss_only: bool = False
    """Evaluation computes the loss only: no predictions are gathered and ``compute_metrics`` is not called."""
    logging_nan_inf_filter: bool = True
    """Leave NaN and inf losses out of the logged means (when some are finite), as transformers does."""
    report_to: str | list[str] | None = "none"
    """Trackers besides the JSONL log: 'tensorboard', 'wandb', 'mlflow', a list, 'all' (those installed) or
    'none'."""
    run_name: str | None = None
    """A name for the run in logs and trackers."""
    disable_tqdm: bool | None = None
    """Hide the progress bar; None shows it (transformers' default at its default log level)."""
    resume_from_checkpoint: str | None = None
    """A checkpoint directory for your script to pass to ``trainer.train(resume_from_checkpoint=...)``."""
    deepspeed: str | dict[str, Any] | None = None
    """A DeepSpeed JSON config: a path, a dict, or a JSON object as a string. "auto" values come from these
    arguments."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in backward to save memory: a transformers model's own ``gradient_checkpointing_enable``;
    any other module's blocks as phalanx's ``activation_checkpointing="full"`` (``strategy_options={
    "activation_checkpointing": "every:2"}`` or ``"selective"`` choose another policy, on any model). None is False."""
    dataloader_persistent_workers: bool = False
    """Keep the DataLoader's worker processes between epochs (with dataloader_num_workers > 0)."""
    dataloader_prefetch_factor: int | None = None
    """Batches each worker loads ahead (with dataloader_num_workers > 0)."""
    label_smoothing_factor: float = 0.0
    """Label smoothing of the loss (transformers' LabelSmoother over the model's logits), 0 for none."""
    batch_eval_metrics: bool = False
    """Call ``compute_metrics(eval_pred, compute_result=...)`` after every evaluation batch instead of once at the end,
    with ``compute_result=True`` on the last batch (so that predictions need not all be held)."""
    eval_use_gather_object: bool = False
    """Gather Python objects in predictions too (phalanx gathers lists of objects in any case)."""
    log_level: str = "passive"
    """The level of phalanx's log on the main process: debug, info, warning, error, critical, or passive (info)."""
    log_level_replica: str = "warning"
    """The level of phalanx's log on the other processes."""
    skip_memory_metrics: bool = True
    """transformers' memory metrics are not reported: phalanx's ``engine.memory_report()`` gives each rank's bytes."""
    torch_compile: bool = False
    """Compile the model with ``torch.compile`` once it is prepared."""
    torch_compile_backend: str | None = None
    """The backend of ``torch.compile`` (default: inductor); setting it turns torch_compile on, as in transformers."""
    torch_compile_mode: str | None = None
    """The mode of ``torch.compile``; setting it turns torch_compile on, as in transformers."""
    restore_callback_states_from_checkpoint: bool = False
    """On resume, give the callbacks that save state (``ExportableState``) their state from the checkpoint."""
    auto_find_batch_size: bool = False
    """transformers halves the batch size after an out-of-memory error; phalanx refuses it (set the batch size)."""
    enable_jit_checkpoint: bool = False
    """On SIGTERM (a preemption), save a checkpoint at the end of the current optimizer step on every rank, and stop."""
    average_tokens_across_devices: bool = True
    """Normalise the loss by the item count of the whole window over all ranks (phalanx always does)."""
    fsdp: str | list[str] | bool | None = None
    """transformers' FSDP words: full_shard (zero3), shard_grad_op (zero2), no_shard (ddp), hybrid_shard and
    hybrid_shard_zero2 (zero3 / zero2 sharded within each machine and replicated across machines, as FSDP's
    HYBRID_SHARD), with offload (offload='cpu') and auto_wrap (zero3's units, always); True is full_shard."""
    parallelism_config: Any = None
    """Accelerate's ParallelismConfig (or phalanx.accelerate's, or a dict of its names): tp_size, dp_shard_size and
    dp_replicate_size are read into the fields of those names; cp_size (ring attention) and sp_size (Ulysses,
    DeepSpeed's ALST) go to the Engine; their backends and handlers' options are read as every front reads them
    (``config/dialects/parallelism.py``). Kept as a plain dict of what was given."""
    tp_size: int | None = None
    """Tensor-parallel degree (transformers 4.5x's tp_size; the Engine's tp_size): the model's own plan is split over
    this many ranks. The plan and sequence_parallel go in strategy_options."""
    ep_size: int | None = None
    """Expert-parallel degree (the Engine's ep_size): the experts of every mixture-of-experts layer, as the model's
    base_model_ep_plan names them, are split over this many ranks carved out of the data-parallel ranks. phalanx's own
    field: transformers' TrainingArguments has none, and Accelerate's ParallelismConfig has no expert size (DeepSpeed's
    expert_parallel.autoep_size says the same, and must agree)."""
    dp_shard_size: int | None = None
    """Data-parallel ranks that shard the model under zero (the Engine's dp_shard_size)."""
    dp_replicate_size: int | None = None
    """Data-parallel replicas (the Engine's dp_replicate_size); with dp_shard_size under zero2/zero3, hybrid
    sharding."""
    strategy: str | None = None
    """phalanx's strategy (ddp, zero1, zero2, zero3, pipeline); None leaves it to the launcher, a config or ddp."""
    precision: str | None = None
    """phalanx's precision (fp32, bf16-mixed, fp16-mixed); None follows bf16/fp16, else the launcher or fp32."""
    strategy_options: dict[str, Any] = field(default_factory=dict)
    """The strategy's knobs by their Engine names, e.g. ``{"bucket_mb": 50, "offload": "cpu"}``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainingArguments:
        # The dataclass __init__ would raise a bare TypeError for a misspelt keyword; say which and what was meant.
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        for key in kwargs:
            if key not in names:
                raise _unknown_argument(key, names)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.path.expanduser(str(self.output_dir))
        self.lr_scheduler_kwargs = _json_object(self.lr_scheduler_kwargs, "lr_scheduler_kwargs")
        self.deepspeed = _json_object(self.deepspeed, "deepspeed")
        if self.gradient_checkpointing is None:
            self.gradient_checkpointing = False
        if self.disable_tqdm is None:
            self.disable_tqdm = False
        self._read_deprecated()
        for name in ("lr_scheduler_type", "logging_strategy", "eval_strategy", "save_strategy", "optim"):
            setattr(self, name, str(getattr(getattr(self, name), "value", getattr(self, name))))  # an HF enum too
        _choice("logging_strategy", self.logging_strategy, _INTERVALS)
        _choice("eval_strategy", self.eval_strategy, _INTERVALS)
        _choice("save_strategy", self.save_strategy, _SAVES)
        if self.optim not in OPTIMS:
            raise ConfigError(
                f"TrainingArguments: optim={self.optim!r} is not built in; phalanx builds {', '.join(OPTIMS)}. For "
                "another optimizer (bitsandbytes, GaLore, Adafactor, ...), build it and pass "
                "Trainer(optimizers=(optimizer, None)), or Trainer(optimizer_cls_and_kwargs=(cls, kwargs))"
            )
        optimizer_cls_and_kwargs(self)  # optim_args are read now, so that a bad one fails here
        kwargs = self.lr_scheduler_kwargs
        check_schedule_kwargs(self.lr_scheduler_type, kwargs if isinstance(kwargs, dict) else {})
        self._check_counts()
        self._check_hf_switches()
        self._resolve_steps()
        on_metric = self.lr_scheduler_type in ("reduce_lr_on_plateau", "greedy")
        if on_metric and self.eval_strategy == "no":
            raise ConfigError(
                f"lr_scheduler_type={self.lr_scheduler_type!r} steps on each evaluation's metric, and eval_strategy="
                "'no' never evaluates: set eval_strategy='steps' (with eval_steps) or 'epoch'"
            )
        if (self.load_best_model_at_end or on_metric) and self.metric_for_best_model is None:
            self.metric_for_best_model = (
                "loss"  # as transformers; save_strategy='best' has no default (the Trainer says)
            )
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        self._check_best_model()
        self.report_to = _report_to(self.report_to)
        self._resolve_precision()
        self._read_parallelism_config()
        self._read_fsdp()
        self._check_strategy()
        if self.deepspeed is not None:
            self._check_deepspeed()

    # ------------------------------------------------------------------ checks in __post_init__
    def _read_deprecated(self) -> None:
        if self.evaluation_strategy is not None:
            _deprecated(
                "TrainingArguments: evaluation_strategy is deprecated (transformers 5 removed it); use eval_strategy"
            )
            if self.eval_strategy not in ("no", self.evaluation_strategy):
                raise ConfigError(
                    f"evaluation_strategy={self.evaluation_strategy!r} and eval_strategy="
                    f"{self.eval_strategy!r} disagree; they are one setting (keep eval_strategy)"
                )
            self.eval_strategy, self.evaluation_strategy = self.evaluation_strategy, None
        if self.warmup_ratio is not None:
            _deprecated(
                "TrainingArguments: warmup_ratio is deprecated (transformers 5.2 removed it); use warmup_steps "
                "below 1, e.g. warmup_steps=0.1 for 10% of the steps"
            )
            if not 0 <= self.warmup_ratio < 1:
                raise ConfigError(f"invalid warmup_ratio: got {self.warmup_ratio!r} (use a ratio in [0, 1))")
            if self.warmup_steps and self.warmup_ratio:
                raise ConfigError(
                    f"warmup_ratio={self.warmup_ratio!r} and warmup_steps={self.warmup_steps!r} both "
                    "set the warmup; keep one (warmup_steps below 1 is a ratio)"
                )
            if self.warmup_ratio:
                self.warmup_steps = self.warmup_ratio
            self.warmup_ratio = None

    def _check_hf_switches(self) -> None:
        if self.auto_find_batch_size:
            raise ConfigError(
                "auto_find_batch_size=True: transformers retries with half the batch after an out-of-memory error; "
                "phalanx does not (a silent change of the batch changes the run). Set per_device_train_batch_size to "
                "what fits, or shard the model (strategy='zero3')"
            )
        levels = ("passive", "debug", "info", "warning", "error", "critical")
        for name in ("log_level", "log_level_replica"):
            _choice(name, getattr(self, name), levels)
        if not 0.0 <= self.label_smoothing_factor < 1.0:
            raise ConfigError(f"invalid label_smoothing_factor: got {self.label_smoothing_factor!r} (use [0, 1))")
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True  # as transformers: naming a backend or a mode turns compilation on

    def _check_counts(self) -> None:
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"invalid {name}: got {getattr(self, name)!r} (use 1 or more)")
        if self.dataloader_num_workers < 0:
            raise ConfigError(f"invalid dataloader_num_workers: got {self.dataloader_num_workers!r} (use 0 or more)")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ConfigError(
                f"invalid max_grad_norm: got {self.max_grad_norm!r} (use a positive norm, or 0 not to clip)"
            )
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ConfigError(
                f"max_steps={self.max_steps!r} and num_train_epochs={self.num_train_epochs!r} give no "
                "training; set max_steps > 0 or num_train_epochs > 0"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"invalid warmup_steps: got {self.warmup_steps!r} (use 0 or more; below 1 is a ratio)")

    def _resolve_steps(self) -> None:
        """transformers' step rules: eval_steps falls back to logging_steps; a count of 1 or more is whole."""
        if self.eval_strategy == "steps" and not self.eval_steps:
            if self.logging_steps <= 0:
                raise ConfigError(
                    f"eval_strategy='steps' needs eval_steps > 0, or logging_steps > 0 to fall back on; "
                    f"got eval_steps={self.eval_steps!r}, logging_steps={self.logging_steps!r}"
                )
            self.eval_steps = self.logging_steps
        for name, strategy in (
            ("logging_steps", self.logging_strategy),
            ("eval_steps", self.eval_strategy),
            ("save_steps", self.save_strategy),
            ("warmup_steps", "steps"),
        ):
            value = getattr(self, name)
            if strategy == "steps" and name != "warmup_steps" and not value > 0:
                raise ConfigError(
                    f"{name.split('_')[0]}_strategy='steps' needs {name} > 0; got {name}={value!r} "
                    "(a count of steps, or a ratio of the run below 1)"
                )
            if value is not None and value >= 1:
                if value != int(value):  # transformers truncates warmup_steps=2.5 to 2 without a word
                    raise ConfigError(
                        f"invalid {name}: got {value!r} (a count of 1 or more must be whole; below 1 it "
                        "is a ratio of the run's steps)"
                    )
                setattr(self, name, int(value))

    def _check_best_model(self) -> None:
        if self.save_strategy == "best" and self.eval_strategy == "no":
            raise ConfigError(
                "save_strategy='best' saves when an evaluation improves metric_for_best_model; got "
                "eval_strategy='no' (set eval_strategy to 'steps' or 'epoch')"
            )
        if not self.load_best_model_at_end or self.save_strategy == "best":
            return
        if self.eval_strategy != self.save_strategy:
            raise ConfigError(
                f"load_best_model_at_end=True needs eval_strategy and save_strategy to match (or "
                f"save_strategy='best'); got eval_strategy={self.eval_strategy!r}, save_strategy="
                f"{self.save_strategy!r}"
            )
        if self.eval_strategy == "steps":
            save, every = float(self.save_steps), float(self.eval_steps or 0)
            if (save < 1) != (every < 1):
                raise ConfigError(
                    f"load_best_model_at_end=True needs save_steps to be a multiple of eval_steps, which "
                    f"a count and a ratio cannot promise; got save_steps={self.save_steps!r}, eval_steps="
                    f"{self.eval_steps!r} (give both as counts, or both as ratios)"
                )
            if round(save * 1_000_000) % round(every * 1_000_000):
                raise ConfigError(
                    f"load_best_model_at_end=True needs save_steps to be a multiple of eval_steps, so "
                    f"that every checkpoint has an evaluation; got save_steps={self.save_steps!r}, "
                    f"eval_steps={self.eval_steps!r}"
                )

    def _resolve_precision(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("bf16=True and fp16=True ask for two precisions; set one of them")
        from_flags = _PRECISION_OF["bf16"] if self.bf16 else _PRECISION_OF["fp16"] if self.fp16 else None
        if self.precision is None:
            self.precision = from_flags
            return
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; valid precisions: {', '.join(PRECISIONS)}")
        if from_flags is not None and from_flags != self.precision:
            flag = "bf16" if self.bf16 else "fp16"
            raise ConfigError(
                f"precision={self.precision!r} and {flag}=True disagree; say it once (precision="
                f"{from_flags!r}, or drop {flag})"
            )
        self.bf16, self.fp16 = self.precision == "bf16-mixed", self.precision == "fp16-mixed"

    def _check_strategy(self) -> None:
        names = strategy_names()
        if self.strategy is not None and self.strategy not in names:
            close = difflib.get_close_matches(self.strategy, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"unknown strategy {self.strategy!r}; {hint}valid strategies: {', '.join(names)}")
        if not isinstance(self.strategy_options, dict):
            raise ConfigError(f"strategy_options must be a dict of Engine knobs; got {self.strategy_options!r}")
        knobs = [f.name for _, f in engine_fields() if f.name not in _OWNED]
        for key in self.strategy_options:
            if key in _OWNED:
                raise ConfigError(
                    f"strategy_options[{key!r}] is set by the TrainingArguments field {_OWNED[key]}; use that field"
                )
            if key not in knobs:
                close = difflib.get_close_matches(key, knobs, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(f"strategy_options: unknown Engine knob {key!r}; {hint}valid: {', '.join(knobs)}")
        if self.strategy is not None:
            # The knobs' values and the strategy's rules; with no strategy here, the Engine checks them at start.
            from phalanx.config.settings import EngineConfig

            precision = self.precision or (
                "fp16-mixed" if any(k.startswith("loss_scale") for k in self.strategy_options) else "fp32"
            )
            sizes = {k: getattr(self, k) for k in _MESH if getattr(self, k) is not None} | self._sequence_split()
            EngineConfig(strategy=self.strategy, precision=precision, **sizes, **self.strategy_options)

    def _read_parallelism_config(self) -> None:
        """Accelerate's ParallelismConfig (or a dict of its names) into tp_size, dp_shard_size, dp_replicate_size and
        the Engine's cp_size and sp_size; kept as a plain dict of what was given, so that the arguments stay JSON."""
        pc = self.parallelism_config
        if pc is None:
            return
        values = values_of(pc, "parallelism_config")
        spell = (
            (lambda key: f"parallelism_config[{key!r}]") if isinstance(pc, dict) else object_spelling(type(pc).__name__)
        )
        reading = read_parallelism(values, spell)
        for note in reading.notes:
            warn_once(f"TrainingArguments: {note}")
        self.parallelism_config = values
        if not reading.asks_for_a_mesh:
            return  # Accelerate's all-ones config asks for nothing beyond the strategy's own layout
        settings = reading.settings()
        for key in _MESH:
            value, ours = settings.get(key), getattr(self, key)
            if value is None:
                continue
            if ours is not None and ours != value:
                raise ConfigError(
                    f"TrainingArguments: parallelism_config says {key}={value} and the field {key}={ours}; they are "
                    "one setting (give one of them)"
                )
            setattr(self, key, value)

    def _sequence_split(self) -> dict[str, int]:
        """cp_size or sp_size above 1, from parallelism_config (the Engine's settings of those names)."""
        pc = self.parallelism_config if isinstance(self.parallelism_config, dict) else {}
        return {k: pc[k] for k in ("cp_size", "sp_size") if isinstance(pc.get(k), int) and pc[k] > 1}

    def _read_fsdp(self) -> None:
        """transformers' fsdp words as the strategy (and offload); kept as one space-separated string."""
        value = self.fsdp
        if value is None or value is False or value in ("", []):
            self.fsdp = None
            return
        words = ["full_shard"] if value is True else value.split() if isinstance(value, str) else list(value)
        words = [str(getattr(w, "value", w)).lower() for w in words]  # transformers' FSDPOption members too
        for word in words:
            if word not in (*_FSDP_WORDS, "offload", "auto_wrap"):
                close = difflib.get_close_matches(word, [*_FSDP_WORDS, "offload", "auto_wrap"], n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(
                    f"invalid fsdp: got {word!r}; {hint}use {', '.join(_FSDP_WORDS)}, with offload or auto_wrap"
                )
        sharding = [w for w in words if w in _FSDP_WORDS] or ["full_shard"]
        if len(sharding) > 1:
            raise ConfigError(f"fsdp={value!r} names {' and '.join(sharding)}; give one sharding strategy")
        strategy, hybrid = _FSDP_WORDS[sharding[0]]
        if self.strategy is not None and self.strategy != strategy:
            raise ConfigError(
                f"fsdp={value!r} is strategy {strategy!r}, and strategy={self.strategy!r}; give one of them"
                + (" (FSDP's hybrid sharding is zero3, or zero2 with hybrid_shard_zero2)" if hybrid else "")
            )
        self.strategy = strategy
        if hybrid and (self.dp_shard_size is not None or self.dp_replicate_size is not None):
            raise ConfigError(
                f"fsdp={value!r} shards within each machine and replicates across machines, and dp_shard_size="
                f"{self.dp_shard_size}, dp_replicate_size={self.dp_replicate_size} say another layout; give one of "
                f"them (fsdp='{sharding[0].replace('hybrid_shard', 'full_shard').replace('_zero2', '')}' with the "
                "sizes is the same strategy)"
            )
        if "offload" in words:
            if strategy == "ddp":
                raise ConfigError(f"fsdp={value!r}: offload needs sharding; use full_shard or shard_grad_op with it")
            if self.strategy_options.get("offload", "cpu") != "cpu":
                raise ConfigError(
                    f"fsdp={value!r} offloads to the CPU, and strategy_options says offload="
                    f"{self.strategy_options['offload']!r}; give one of them"
                )
            self.strategy_options = {**self.strategy_options, "offload": "cpu"}
        self.fsdp = " ".join(dict.fromkeys(words))

    def _hybrid_shard_size(self) -> int | None:
        """Under fsdp='hybrid_shard': the processes of this machine (over tp_size), as FSDP's intra-node groups."""
        if not isinstance(self.fsdp, str) or "hybrid_shard" not in self.fsdp:
            return None
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if not local:
            return None  # no launcher: one process, one machine
        tp = self.tp_size or 1
        if int(local) % tp:
            raise ConfigError(
                f"fsdp={self.fsdp!r} shards within each machine, and its {local} processes (LOCAL_WORLD_SIZE) do not "
                f"divide by tp_size={tp}; launch a multiple of {tp} processes per machine"
            )
        return int(local) // tp

    def _check_deepspeed(self) -> None:
        """Read the DeepSpeed config now, and refuse a value that contradicts these arguments (as transformers does);
        "auto" values are left out of the mapping, so these arguments fill them."""
        data = self.deepspeed if isinstance(self.deepspeed, dict) else read_deepspeed(str(self.deepspeed))
        where = "deepspeed (dict)" if isinstance(self.deepspeed, dict) else str(self.deepspeed)
        ours = self._engine_values()
        if self.max_grad_norm == 0:
            ours["max_grad_norm"] = 0.0  # "do not clip" is a value too: a gradient_clipping in the file contradicts it
        for key, value, source in from_deepspeed(data, where).values:
            if ours.get(key) is not None and ours[key] != value:
                raise ConfigError(
                    f"the DeepSpeed config {where} says {source} -> {key}={value!r}, but TrainingArguments "
                    f'says {key}={ours[key]!r} (from {_OWNED[key]}); make them agree, or write "auto" '
                    "in the DeepSpeed config"
                )

    # ------------------------------------------------------------------ derived values
    @property
    def train_batch_size(self) -> int:
        """Samples per process per micro-batch in training (phalanx runs one device per process)."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Samples per process per batch in evaluation."""
        return self.per_device_eval_batch_size

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """The warmup in optimizer steps for a run of ``num_training_steps`` (transformers' method name)."""
        from phalanx.trainer.schedules import warmup_steps_for

        return warmup_steps_for(self, num_training_steps)

    def _engine_values(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "strategy": self.strategy,
            "precision": self.precision,
            "grad_accum_steps": self.gradient_accumulation_steps,
            "seed": self.seed,
            "max_grad_norm": float(self.max_grad_norm) if self.max_grad_norm else None,
        }
        for key in _MESH:
            out[key] = getattr(self, key)
        out |= self._sequence_split()
        if out["dp_shard_size"] is None:
            out["dp_shard_size"] = self._hybrid_shard_size()
        return out

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for ``phalanx.Engine(**args.engine_options())``.

        strategy and precision appear only when these arguments say them, so that ``phalanx launch --strategy`` or
        ``--precision`` decides otherwise; accumulation, clipping and the seed always appear, as transformers' own
        values. A dict ``deepspeed`` is written to ``output_dir/ds_config.json`` (the Engine reads a path).
        """
        out = {k: v for k, v in self._engine_values().items() if v is not None or k == "max_grad_norm"}
        if self.deepspeed is not None:
            out["deepspeed"] = self._deepspeed_path()
        out.update(self.strategy_options)
        return out

    def _deepspeed_path(self) -> str:
        if not isinstance(self.deepspeed, dict):
            return str(self.deepspeed)
        path = Path(str(self.output_dir)) / "ds_config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.deepspeed, indent=2, sort_keys=True)
        if not path.is_file() or path.read_text() != text:
            # Every rank may write it at once: each writes its own temporary file and renames it into place.
            tmp = path.with_name(f".ds_config.{os.getpid()}.json")
            tmp.write_text(text)
            os.replace(tmp, path)
        return str(path)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, as plain values (transformers' ``to_dict``)."""
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)


def _unknown_argument(key: str, names: list[str]) -> UnknownArgumentError:
    if key in _HF_ELSEWHERE:
        return UnknownArgumentError(
            f"TrainingArguments: {key!r} is a transformers argument that phalanx does not take; {_HF_ELSEWHERE[key]}"
        )
    knobs = {f.name for _, f in engine_fields()} - set(_OWNED)
    if key in knobs:
        return UnknownArgumentError(
            f"TrainingArguments: {key!r} is an Engine knob; pass it as strategy_options={{{key!r}: ...}}"
        )
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return UnknownArgumentError(
        f"TrainingArguments: unknown argument {key!r}; {hint}(see the fields of phalanx.TrainingArguments)"
    )


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"invalid {name}: got {value!r}; {hint}use one of: {', '.join(choices)}")


def _json_object(value: Any, name: str) -> Any:
    """A string holding a JSON object becomes the dict (transformers reads command-line dicts this way)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"invalid {name}: {value!r} is not a JSON object ({e})") from None
    if name == "lr_scheduler_kwargs" and value is not None and not isinstance(value, dict):
        raise ConfigError(f"invalid lr_scheduler_kwargs: got {value!r} (use a dict such as {{'num_cycles': 0.5}})")
    return value


def _report_to(value: str | list[str] | None) -> list[str]:
    """transformers' normalisation: 'none' -> [], 'all' -> the trackers installed, a name -> [name]; an unknown
    name is refused here, when the arguments are built, naming the trackers phalanx knows."""
    return tracker_names(value, "report_to")


def settle_for_trainer(
    args_: TrainingArguments, model: Any, eval_dataset: Any, is_main: bool, staged_by: str | None
) -> LabelSmoother | None:
    """What transformers' Trainer settles from its arguments when it is built: the label smoother, the log levels,
    and the combinations it refuses at once (said here with the fix); returns the label smoother, if any.
    ``staged_by``: the strategy's name when it runs the model in pipeline stages (None otherwise)."""
    smoother: LabelSmoother | None = None
    if args_.label_smoothing_factor:
        if getattr(getattr(model, "config", None), "problem_type", None) == "multi_label_classification":
            warn_once(
                "label_smoothing_factor does not apply to multi-label classification (problem_type="
                "'multi_label_classification'): this run trains without label smoothing, as transformers does"
            )
        else:
            smoother = LabelSmoother(epsilon=args_.label_smoothing_factor)
    for level, here in ((args_.log_level, is_main), (args_.log_level_replica, True)):
        if here and level != "passive":
            get_logger().setLevel(level.upper())
            break
    if args_.torch_compile and staged_by is not None:
        raise ValueError(
            f"torch_compile=True under strategy={staged_by!r}: the pipeline runs its stages "
            "itself; compile the blocks before the Trainer gets the model, or leave torch_compile off"
        )
    if not args_.skip_memory_metrics:
        warn_once(
            "skip_memory_metrics=False: phalanx does not add transformers' *_mem_* metrics to the logs; "
            "trainer.engine.memory_report() gives each rank's bytes by kind, and its peak"
        )
    if args_.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(
            f"eval_strategy={args_.eval_strategy!r} evaluates during training, but no eval_dataset was given to "
            "the Trainer: pass eval_dataset=..., or set eval_strategy='no'"
        )
    if (args_.save_strategy == "best" or args_.load_best_model_at_end) and args_.metric_for_best_model is None:
        raise ValueError(
            "save_strategy='best' (or load_best_model_at_end) needs metric_for_best_model: the metric that says "
            "which checkpoint is best, e.g. metric_for_best_model='loss' or 'accuracy'"
        )
    return smoother
