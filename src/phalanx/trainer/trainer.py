"""``phalanx.Trainer``: Hugging Face's Trainer shape on every phalanx strategy, a client of the Engine only.

    args = phalanx.TrainingArguments(output_dir="out", per_device_train_batch_size=16, eval_strategy="epoch",
                                      save_strategy="epoch", load_best_model_at_end=True, metric_for_best_model="f1")
    trainer = phalanx.Trainer(model, args, train_dataset=train, eval_dataset=val, compute_metrics=f1)
    trainer.train()

A *step* is an optimizer step everywhere. Losses are normalised by the true item count (labels that are not -100)
of the whole accumulation window over every rank, never per micro-batch; the logged training loss is the mean over
the logging window; resume continues at the next sample without replaying batches; evaluation gathers each sample
exactly once and moves predictions to the CPU batch by batch.
"""

from __future__ import annotations

import inspect
import math
import signal
import sys
import time
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from phalanx.config.dialects.dummies import DummyScheduler
from phalanx.engine.activation import checkpoint_blocks
from phalanx.engine.engine import Engine
from phalanx.logging import get_logger, warn_once
from phalanx.runtime.collective_log import watched
from phalanx.runtime.world import seed_everything as phalanx_seed
from phalanx.trainer.arguments import TrainingArguments, optimizer_cls_and_kwargs, settle_for_trainer
from phalanx.trainer.callbacks import CallbackHandler, TrainerCallback
from phalanx.trainer.checkpointing import resume_trainer, save_trainer_checkpoint
from phalanx.trainer.conventions import (
    decay_parameter_names,
    find_labels,
    get_learning_rates,
    get_num_trainable_parameters,
    get_optimizer_group,
    loss_of,
)
from phalanx.trainer.evaluation import evaluation_loop
from phalanx.trainer.loaders import build_loader, eval_set, loader_from
from phalanx.trainer.loss import as_sum, check_cut_loss, items_of, shift_labels_of, whole_prediction
from phalanx.trainer.nested import nested_map
from phalanx.trainer.optimization import create_optimizer, create_optimizer_and_scheduler, create_scheduler
from phalanx.trainer.outputs import EvalPrediction, PredictionOutput, TrainOutput
from phalanx.trainer.reporting import JsonlLoggingCallback, default_callbacks
from phalanx.trainer.state import (
    TrainerControl,
    TrainerState,
    TrainerStateHolder,
    record_best_metric,
)

__all__ = ["Trainer", "EvalPrediction", "TrainOutput", "PredictionOutput"]


class Trainer:
    """Trains, evaluates and checkpoints a model with :class:`TrainingArguments`, on the strategy they (or the
    launcher) choose. ``compute_loss`` and ``training_step`` may be overridden as in Hugging Face's Trainer."""

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable[[EvalPrediction], dict] | None = None,
        callbacks: list[TrainerCallback | type[TrainerCallback]] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
    ) -> None:
        self.args = args if args is not None else TrainingArguments()
        # The Engine seeds every generator (args.seed) first, so that model_init builds the same model each run.
        self.engine = Engine(**self.args.engine_options())
        self.model_init = model_init
        if model is None:
            if model_init is None:
                raise ValueError("Trainer needs a model or a model_init: Trainer(model, args, train_dataset=...)")
            model = self.call_model_init()
        elif model_init is not None:
            warn_once(
                "Trainer got both a model and a model_init: model_init builds a fresh model at each train(), in place "
                "of the one given (as in transformers); pass one of them"
            )
        if optimizer_cls_and_kwargs is not None and optimizers != (None, None):
            raise ValueError(
                "Trainer got both optimizers=(optimizer, scheduler) and optimizer_cls_and_kwargs: they both say which "
                "optimizer to use; pass one of them"
            )
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        staged = self.engine.strategy.name if self.engine.strategy.drives_backward else None
        self.label_smoother = settle_for_trainer(self.args, model, eval_dataset, self.engine.is_main_process, staged)
        self._auto_resume = self.engine._resumer.hand_over(self.output_dir)  # resume_from: see train()
        self.model, self._raw_model = model, model
        self.data_collator, self.processing_class = data_collator, processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.state = TrainerState(
            is_local_process_zero=self.engine.is_local_main_process, is_world_process_zero=self.engine.is_main_process
        )
        self.control, self._log_file = TrainerControl(), JsonlLoggingCallback()  # log.jsonl: phalanx's, not a callback
        self.callback_handler = CallbackHandler(
            [*default_callbacks(self.args), *(callbacks or [])],
            model,
            processing_class,
            self.optimizer,
            self.lr_scheduler,
        )
        self._causal = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
        self._label_names = self.args.label_names if self.args.label_names is not None else find_labels(model)
        self._window = torch.zeros(2, dtype=torch.float64)  # the pipeline's last stage adds to train()'s window
        self._checkpoint_activations(model)
        if not self.args.average_tokens_across_devices:
            warn_once(
                "average_tokens_across_devices=False is not honoured: phalanx always normalises the loss by the items "
                "of the whole window over every rank, which is what makes the gradient equal one process's on the full "
                "batch (leave it True)"
            )
        if self.args.save_only_model:
            warn_once(
                "save_only_model=True is not honoured: a phalanx checkpoint always holds what resuming needs "
                "(optimizer, schedule, data position); call trainer.save_model(dir) for the weights alone"
            )
        self._forward_params = self._forward_parameters(model)
        self._trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._jit_requested = False  # enable_jit_checkpoint: a SIGTERM arrived
        self._scheduler: Any = None  # the prepared lr_scheduler, through which it steps
        self._train_loader: Any = None
        self._train_loader_raw: Any = None
        self._last_log = (0.0, 0)  # (time, optimizer step) of the last training log, for steps_per_second
        self._log_extra: dict[str, float] = {}  # what log.jsonl gets beyond the log itself
        self._plateau_of: tuple[Any, bool] | None = None  # (scheduler, whether it steps on a metric)
        self._persistent_eval: dict[int, tuple[Any, DataLoader]] = {}  # eval loaders kept for persistent workers
        self._grad_norm: torch.Tensor | None = None  # the last step's global gradient norm, read when logged
        self._learning_rate = self.args.learning_rate  # the rate the last step used
        self._eval_loader: Any = None
        self._eval_loaders: dict[str, Any] = {}  # prepared once per named eval set (eval_dataset a dict)
        self._prepared = False
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """A fresh model from ``model_init``, which takes no argument or the trial (None here), as transformers'."""
        assert self.model_init is not None
        takes = len(inspect.signature(self.model_init).parameters)
        if takes > 1:
            raise ValueError(f"model_init should take no argument or one (the trial); it takes {takes}")
        model = self.model_init() if takes == 0 else self.model_init(trial)
        if model is None:
            raise ValueError("model_init returned None: it should return the model to train")
        return model

    def _checkpoint_activations(self, model: nn.Module) -> None:
        """``gradient_checkpointing``: a transformers model checkpoints its layers itself (its own method); any other
        module is checkpointed as ``activation_checkpointing="full"`` does (``engine/activation.py``). When the
        Engine's ``activation_checkpointing`` is set, the Engine checkpoints, as that setting says."""
        if not self.args.gradient_checkpointing or self.engine.config.activation_checkpointing is not None:
            return
        # transformers 5 renamed it activation_checkpointing_enable (the old name warns).
        enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
            model, "gradient_checkpointing_enable", None
        )
        if enable is not None:
            enable()
            return
        warn_once(
            f"gradient_checkpointing=True: {type(model).__name__} has no gradient_checkpointing_enable() (not a "
            "transformers model), so phalanx checkpoints its blocks, as activation_checkpointing='full' does"
        )
        checkpoint_blocks(model, "full", self.engine.config.zero3_unit_classes)

    def _fresh_model(self) -> None:
        """``model_init``: a new model for this train(), built after seeding, as transformers does."""
        if self._prepared:
            raise RuntimeError(
                "model_init builds a fresh model at train(), but this Trainer already prepared its model (an "
                "evaluate() or predict() came first); call train() first, or build a new Trainer for the new run"
            )
        phalanx_seed(self.args.seed)
        model = self.call_model_init()
        self.model = self._raw_model = model
        self.optimizer, self.lr_scheduler = None, None
        self._causal = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
        if self.args.label_names is None:
            self._label_names = find_labels(model)
        self._checkpoint_activations(model)
        self._forward_params = self._forward_parameters(model)
        self._trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.callback_handler.model = model

    @property
    def accelerator(self) -> Engine:
        """The Engine, where transformers' Trainer has its Accelerator (``gather_for_metrics``, ``num_processes``,
        ``is_main_process``, ``unwrap_model``, ... have Accelerate's names there)."""
        return self.engine

    @property
    def model_wrapped(self) -> nn.Module:
        """The model as the strategy wraps it (transformers' name): the prepared model once training started."""
        return self.model

    # transformers' helpers, bound here as transformers binds its own (trainer_pt_utils)
    get_num_trainable_parameters = get_num_trainable_parameters
    get_learning_rates = get_learning_rates
    get_optimizer_group = get_optimizer_group

    @property
    def output_dir(self) -> str:
        return str(self.args.output_dir or "trainer_output")

    # ------------------------------------------------------------------------------------------- callbacks
    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callback_handler.remove_callback(callback)

    # ------------------------------------------------------------------------------------------------- data
    @staticmethod
    def _forward_parameters(model: nn.Module) -> set[str] | None:
        params = inspect.signature(model.forward).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return None  # takes anything
        return {p.name for p in params}

    def _collate(self, samples: list[Any]) -> Any:
        batch = self.data_collator(samples) if self.data_collator is not None else default_collate(samples)
        if isinstance(batch, Mapping):
            batch = dict(batch)
            if "label" in batch and "labels" not in batch:
                batch["labels"] = batch.pop("label")  # as transformers' default collator
            if self.args.remove_unused_columns and self._forward_params is not None:
                keep = self._forward_params | set(self._label_names)
                batch = {k: v for k, v in batch.items() if k in keep}
        return batch

    def _loader(self, dataset: Dataset, batch_size: int, shuffle: bool) -> DataLoader:
        return build_loader(self.args, self.engine, self._collate, dataset, batch_size, shuffle)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer.train needs a train_dataset: Trainer(model, args, train_dataset=...)")
        return self._loader(self.train_dataset, self.args.per_device_train_batch_size, shuffle=True)

    def get_eval_dataloader(self, eval_dataset: Dataset | dict[str, Dataset] | str | None = None) -> DataLoader:
        """A loader over ``eval_dataset``, or the Trainer's eval set, or (a name) one of its named eval sets."""
        dataset = eval_set(self.eval_dataset, eval_dataset)
        if not self.args.dataloader_persistent_workers or self.args.dataloader_num_workers == 0:
            return self._loader(dataset, self.args.per_device_eval_batch_size, shuffle=False)
        # Persistent workers outlive an evaluation only if the loader does: one loader per eval set, as in HF (which
        # keys it by name, so that another dataset would get the eval set's loader; here it is keyed by the set).
        cached = self._persistent_eval.get(id(dataset))
        if cached is None or cached[0] is not dataset:
            loader = self._loader(dataset, self.args.per_device_eval_batch_size, shuffle=False)
            cached = self._persistent_eval[id(dataset)] = (dataset, loader)
        return cached[1]

    # ----------------------------------------------------------------------------------- optimizer, schedule
    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """The parameters that weight decay applies to, by transformers' rule: none inside a ``LayerNorm``, and none
        whose name holds ``bias``, ``layernorm``, ``rmsnorm`` or a ``norm`` part."""
        return decay_parameter_names(model)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: TrainingArguments, model: nn.Module | None = None) -> tuple[type, dict]:
        """The optimizer class and keywords that ``args.optim`` (and ``optim_args``) name, as transformers'."""
        return optimizer_cls_and_kwargs(args)

    # transformers' three builders (trainer/optimization.py), methods here so that a subclass may override them
    create_optimizer = create_optimizer
    create_optimizer_and_scheduler = create_optimizer_and_scheduler
    create_scheduler = create_scheduler

    def _prepare(self, max_steps: int) -> None:
        """Prepare the model, optimizer, loaders and schedule once, in a fixed order (resume needs the same)."""
        if self._prepared:
            return
        optimizer = self.optimizer if self.optimizer is not None else self.create_optimizer()
        names = {id(p): n for n, p in self.model.named_parameters()}  # transformers' optimizer.pt numbers them so
        groups = getattr(optimizer, "param_groups", [])  # a DeepSpeed block's DummyOptim has none yet
        self._optimizer_order = [[names.get(id(p), "") for p in g["params"]] for g in groups]
        self.model, self.optimizer, self._train_loader = self.engine.prepare(
            self.model, optimizer, self._train_loader_raw
        )
        if self.args.data_seed is not None and hasattr(self._train_loader, "global_sampler"):
            self._train_loader.global_sampler.seed = self.args.data_seed  # the order of epoch e: seed + e, as HF's
        if self.args.torch_compile:  # the prepared model, as transformers compiles the one Accelerate prepared
            backend, mode = self.args.torch_compile_backend or "inductor", self.args.torch_compile_mode
            self.model = typing.cast(nn.Module, torch.compile(self.model, backend=backend, mode=mode))
        # The schedule is built on the prepared optimizer: a DeepSpeed optimizer block exists only from here on.
        # self.lr_scheduler stays the user's (or the built) object, as in transformers; it steps through the engine's
        # wrapper, which counts only the optimizer steps that happened.
        self._scheduler = self.engine.prepare(self.create_scheduler(max_steps, self.optimizer))
        if isinstance(self.lr_scheduler, DummyScheduler):
            self.lr_scheduler = self._scheduler.scheduler  # the DeepSpeed block's schedule, made real by prepare
        if self.eval_dataset is not None:
            if isinstance(self.eval_dataset, dict):  # every named set prepared now: a resume finds them all
                self._eval_loaders = {
                    n: self.engine.prepare(loader_from(self.get_eval_dataloader(n), "get_eval_dataloader"))
                    for n in self.eval_dataset
                }
            else:
                self._eval_loader = self.engine.prepare(loader_from(self.get_eval_dataloader(), "get_eval_dataloader"))
        self.engine.register_for_checkpointing(TrainerStateHolder(self))
        for name in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, name, getattr(self, name))
        self.callback_handler.train_dataloader, self.callback_handler.eval_dataloader = (
            self._train_loader,
            self._eval_loader,
        )
        self._prepared = True

    # ------------------------------------------------------------------------------------------------ train
    def _optimizer_step(self) -> None:
        """The step at a window's end, as HF orders it: clip (or, with max_grad_norm 0, only measure the global
        norm), the two optimizer events around ``optimizer.step()``, then the schedule. The norm and the rate this
        step used are what the next log reports."""
        max_norm = self.args.max_grad_norm
        self._grad_norm = self.engine.clip_grad_norm_(max_norm if max_norm else float("inf"))
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
        self.optimizer.step()
        self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
        self._learning_rate = self.optimizer.param_groups[0]["lr"]  # before the schedule moves it, as HF logs it
        if not self._plateau():
            self._scheduler.step()  # a prepared scheduler does not count a skipped step
        self.optimizer.zero_grad()

    # ------------------------------------------------- one micro-batch's loss
    def compute_loss(
        self,
        model: nn.Module,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> Any:
        """The mean loss of one micro-batch, as Hugging Face's Trainer finds it: ``compute_loss_func(outputs, labels,
        num_items_in_batch=...)`` when given (the labels are then taken out of the batch, as HF does), else the
        model's own: ``outputs["loss"]`` of a dict or ``ModelOutput``, the first element of a tuple. A batch that is a
        pair ``(inputs, labels)`` calls ``model(inputs)``. ``num_items_in_batch`` is this micro-batch's item count
        (phalanx normalises the whole window over every rank itself). A batch cut under context parallelism carries
        ``shift_labels``: the model's loss, the label smoother and ``compute_loss_func`` read those (see loss.py)."""
        labels, shift, smoother = self._labels(inputs), shift_labels_of(inputs), self.label_smoother
        if shift is not None and (cp := self.engine.context_parallel) is not None:  # labels shifted before the cut
            own = self.compute_loss_func is None and smoother is None
            check_cut_loss(
                model, self._forward_params if own else None, self.compute_loss_func, f"{cp.setting}={cp.size}"
            )
        if isinstance(inputs, Mapping):
            if (self.compute_loss_func is not None or smoother is not None) and "labels" in inputs:
                inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
            outputs = model(**inputs)
        elif isinstance(inputs, (tuple, list)) and len(inputs) == 2:
            outputs = model(inputs[0])
        else:
            outputs = model(inputs)
        if self.compute_loss_func is not None:
            extra = {"shift_labels": shift} if shift is not None else {}
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch, **extra)
        elif smoother is not None and labels is not None:
            causal = self._causal and shift is None  # shift_labels are aligned with the logits already
            loss = smoother(outputs, labels if shift is None else shift, causal, num_items_in_batch=num_items_in_batch)
        else:
            loss = loss_of(outputs)
        return (loss, outputs) if return_outputs else loss

    def _labels(self, inputs: Any) -> Any:
        """The batch's labels: one tensor, or a tuple of them with several ``label_names``; None when absent."""
        if isinstance(inputs, Mapping):
            found = tuple(inputs.get(name) for name in self._label_names)
            if not found or any(x is None for x in found):
                return None
            return found[0] if len(found) == 1 else found
        if isinstance(inputs, (tuple, list)) and len(inputs) == 2:
            return inputs[1]
        return None

    def _items(self, inputs: Any) -> torch.Tensor | None:
        """The items one micro-batch's loss averages over: the labels that are not -100 (HF counts ``labels``)."""
        if (shift := shift_labels_of(inputs)) is not None:  # shifted over the whole sequence (context parallelism)
            return items_of(shift, causal=False)
        if isinstance(inputs, Mapping):
            name = "labels" if "labels" in self._label_names else self._label_names[0] if self._label_names else None
            return items_of(inputs.get(name) if name is not None else None, self._causal)
        return items_of(self._labels(inputs), self._causal)

    def training_step(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        """Backward of one micro-batch; returns ``[loss sum, items]`` on the device (for the logged mean)."""
        n = self._items(inputs)
        loss = self.compute_loss(model, inputs, num_items_in_batch=n)
        if n is None:  # no labels to count: each micro-batch's mean weighs the same
            self.engine.backward(loss)
            return torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=loss.device)])
        # The mean over this micro-batch's n items, as a sum: the engine divides by the window's items on all ranks.
        self.engine.backward(as_sum(loss, n), items=n)
        return torch.stack([as_sum(loss.detach(), n).double(), n.double()])

    def _stage_loss(self, model: nn.Module, inputs: Any) -> Any:
        """One micro-batch's loss under the pipeline, as (sum, items) when labels can be counted. It returns on the
        last stage only (the model call ends the others' turn), so only there does it add to the logging window:
        summed over all ranks, the window holds every data-parallel replica's items once."""
        n = self._items(inputs)
        loss = self.compute_loss(model, inputs, num_items_in_batch=n)
        one = torch.ones((), dtype=torch.float64, device=loss.device)
        if n is None:  # no labels to count: each micro-batch's mean weighs the same
            self._window += torch.stack([loss.detach().double(), one])
            return loss
        self._window += torch.stack([as_sum(loss.detach(), n).double(), n.double()])
        return as_sum(loss, n), n

    def _reduce_window(self, window: torch.Tensor) -> torch.Tensor:
        """The window summed over the data-parallel ranks; under the pipeline over every rank (only the last stages
        hold a loss, and each replica's once)."""
        if self.engine.strategy.drives_backward and dist.is_initialized():
            total = window.clone()
            watched(dist.all_reduce, total)
            return total
        return self.engine.reduce(window, "sum")

    # ------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> TrainOutput:
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {', '.join(sorted(kwargs))}")
        if trial is not None:
            raise ValueError("train(trial=...) is for hyperparameter search, which phalanx does not run; drop trial")
        args = self.args
        if self.model_init is not None:
            self._fresh_model()
        self._train_loader_raw = loader_from(self.get_train_dataloader(), "get_train_dataloader")
        streamed = isinstance(self._train_loader_raw.dataset, IterableDataset)
        if streamed:
            # A stream has no length: the run is counted in steps, and an "epoch" is the whole run (as HF counts it).
            if args.max_steps <= 0:
                raise ValueError(
                    f"the train_dataset is an IterableDataset ({type(self.train_dataset).__name__}), which has no "
                    f"length to count epochs by; set max_steps (got max_steps={args.max_steps})"
                )
            per_epoch = max_steps = args.max_steps
        else:
            per_epoch = max(
                1,
                math.ceil(
                    len(self._train_loader_raw) / self.engine.topology.data_size / args.gradient_accumulation_steps
                ),
            )
            max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
        self._prepare(max_steps)
        if not streamed:
            per_epoch = max(1, math.ceil(len(self._train_loader) / args.gradient_accumulation_steps))
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        auto = self._auto_resume
        if not resume and auto is not None:  # resume_from (phalanx launch --resume-from): the newest, if there is one
            auto.look(self.engine.rank, self.engine._share_from_rank0)
            resume = str(auto.pending) if auto.pending is not None else None
        if resume:
            self._resume(resume, per_epoch)
            if auto is not None and auto.pending is not None:
                auto.loaded(self.engine.rank, self.engine.world_size, self.engine.global_step)
        # These follow the arguments of this run, also on resume (a longer max_steps trains on), as in HF.
        self.state.max_steps = max_steps
        self.state.num_train_epochs = sys.maxsize if streamed else math.ceil(max_steps / per_epoch)  # as HF's
        self.state.train_batch_size = args.per_device_train_batch_size
        self.state.compute_steps(args, max_steps)
        self.control._new_training()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and self.state.global_step == 0:
            self.evaluate()  # a baseline before the first step, as HF's eval_on_start
        # Loss sum and items since the last log, on the device: read (one host sync) only when a log reduces it.
        window = self._window = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        total: list[Any] = [0.0, 0]
        started = time.perf_counter()
        first_step = self.state.global_step
        self._last_log = (started, self.state.global_step)
        previous_handler = None
        if args.enable_jit_checkpoint:
            self._jit_requested = False
            previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._train_loop(window, total)
        finally:
            if previous_handler is not None:
                signal.signal(signal.SIGTERM, previous_handler)
        # The steps since the last log count in train_loss too. Every rank reduces, whatever its own window holds.
        loss_sum, items = self._reduce_window(window).tolist()
        total[0], total[1] = total[0] + loss_sum, total[1] + int(items)
        mean = total[0] / total[1] if total[1] else float("nan")
        # The run's summary, logged as HF logs it: before the best model is loaded and train ends.
        runtime = time.perf_counter() - started
        trained = self.state.global_step - first_step
        samples = self._train_samples(max_steps) * trained / max(self.state.max_steps, 1)
        metrics = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(samples / max(runtime, 1e-9), 3),
            "train_steps_per_second": round(trained / max(runtime, 1e-9), 3),
            "total_flos": self.state.total_flos,
            "train_loss": mean,
        }
        self.log(dict(metrics))
        if args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self.engine.load_model(self.state.best_model_checkpoint)  # the weights only, as HF
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self._log_file.on_train_end(args, self.state, self.control)
        metrics["epoch"] = self.state.epoch
        return TrainOutput(self.state.global_step, mean, metrics)

    def _train_loop(self, window: torch.Tensor, total: list[Any]) -> None:
        """Epochs of optimizer steps until max_steps or a callback stops it, logging, saving and evaluating."""
        args = self.args
        while self.engine.epoch < self.state.num_train_epochs and not self.control.should_training_stop:
            self.control._new_epoch()
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            micro = 0
            for batch in self._train_loader:
                if micro % args.gradient_accumulation_steps == 0:
                    self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                micro += 1
                if self.engine.strategy.drives_backward:
                    # The pipeline's schedule runs forward and backward of the whole step (its micro-batches are
                    # pp_microbatches); the last stage adds each micro-batch's loss sum and items to the window.
                    self.engine.train_step(batch, self._stage_loss, optimizer_step=False)
                    self._optimizer_step()
                else:
                    with self.engine.accumulate(self.model):
                        window += self.training_step(self.model, batch)
                        if self.engine.sync_gradients:
                            self._optimizer_step()
                if not self.engine.sync_gradients:
                    self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
                    continue
                micro = 0
                self.state.global_step += 1
                self.state.epoch = self.engine.epoch + self._position_in_epoch()
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                if args.enable_jit_checkpoint and self._any_rank(self._jit_requested):
                    # A preemption: this step's checkpoint on every rank, then stop (the regular save would repeat it).
                    self._save_checkpoint(new_best=False)
                    self.control.should_save, self.control.should_training_stop = False, True
                self._log_save_evaluate(window, total)
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break
            self.state.epoch = float(self.engine.epoch) if not self.control.should_training_stop else self.state.epoch
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._log_save_evaluate(window, total)
            if self.state.global_step >= self.state.max_steps:
                break
        if self.args.save_async:  # train() returns with its checkpoints in place (or raises, naming the rank)
            self.engine.wait_for_checkpoint()

    def _plateau(self) -> bool:
        """A schedule that steps on the evaluation's metric (ReduceLROnPlateau, GreedyLR), not on each step."""
        # Asked at every optimizer step: the signature is read once per scheduler object, not each time.
        scheduler = self.lr_scheduler
        if self._plateau_of is None or self._plateau_of[0] is not scheduler:
            step = getattr(scheduler, "step", None)
            self._plateau_of = (scheduler, step is not None and "metrics" in inspect.signature(step).parameters)
        return self._plateau_of[1]

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """enable_jit_checkpoint: a preemption's SIGTERM asks for a checkpoint at the end of this optimizer step."""
        if not self._jit_requested:
            get_logger().warning(
                f"SIGTERM at step {self.state.global_step}: saving a checkpoint at the end of this step, then stopping"
            )
        self._jit_requested = True

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank: every rank calls it at the same point, and all get the same answer."""
        value = torch.tensor(float(flag), device=self.engine.device)
        if dist.is_initialized():
            watched(dist.all_reduce, value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _train_samples(self, max_steps: int) -> float:
        """The samples of the whole schedule, as HF counts them: max_steps x the global batch when max_steps is set,
        else the dataset's length x num_train_epochs."""
        args = self.args
        if args.max_steps > 0:
            global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
            return float(max_steps * global_batch * self.engine.topology.data_size)
        return float(len(self.train_dataset)) * args.num_train_epochs  # type: ignore[arg-type]

    def _position_in_epoch(self) -> float:
        loader = self._train_loader
        done = loader.state_dict()["samples_done"]
        if isinstance(loader.dataset, IterableDataset):  # as HF: the share of the run's micro-batches read
            batches = done / max(1, loader.global_batch_size)
            return min(1.0, batches / max(1, self.state.max_steps * self.args.gradient_accumulation_steps))
        size = max(1, len(loader.dataset)) if hasattr(loader, "dataset") else 1
        return min(1.0, float(done) / size)

    def _resume(self, resume: str | bool, per_epoch: int) -> None:
        resume_trainer(self, resume, per_epoch)

    def _log_save_evaluate(self, window: torch.Tensor, total: list[Any]) -> None:
        if self.control.should_log and self.state.global_step > self._last_log[1]:
            # Every rank reduces (should_log follows the step count, the same everywhere), even one whose window
            # holds no item: a rank that skipped the collective would leave the others waiting.
            loss_sum, items = self._reduce_window(window).tolist()
            loss = loss_sum / items if items else float("nan")  # the mean over every item of the window, all ranks
            total[0], total[1] = total[0] + loss_sum, total[1] + int(items)
            window.zero_()
            now, (since, at) = time.perf_counter(), self._last_log
            rate = (self.state.global_step - at) / (now - since) if now > since else 0.0
            self._last_log = (now, self.state.global_step)
            logs = {"loss": loss}
            if self._grad_norm is not None:
                logs["grad_norm"] = float(self._grad_norm)
            logs["learning_rate"] = self._learning_rate
            self._log_extra = {"steps_per_second": rate}  # log.jsonl only: log_history stays HF's, and replayable
            self.log(logs)
        metrics = None
        if self.control.should_evaluate:
            metrics = self.evaluate()
            if self._plateau():  # ReduceLROnPlateau steps on the evaluation's metric, as in HF
                key = f"eval_{(self.args.metric_for_best_model or 'loss').removeprefix('eval_')}"
                if key not in metrics:
                    raise KeyError(
                        f"{type(self.lr_scheduler).__name__} steps on {key!r} (metric_for_best_model), which the "
                        "evaluation did not "
                        f"return; it returned {sorted(metrics)}"
                    )
                self._scheduler.step(metrics[key])
        if self.control.should_save:
            self._save_checkpoint(
                new_best=metrics is not None and self.state.best_global_step == self.state.global_step
            )
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _save_checkpoint(self, new_best: bool) -> None:
        save_trainer_checkpoint(self, new_best)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        extra, self._log_extra = self._log_extra, {}
        self._log_file.on_log(self.args, self.state, self.control, logs={**logs, **extra})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs=logs)

    # ----------------------------------------------------------------------------------- evaluate, predict
    def prediction_step(
        self, model: nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """One evaluation batch, as Hugging Face's: ``(loss, logits, labels)``. With labels, the loss and the model's
        other outputs (a dict's or ``ModelOutput``'s values but ``loss`` and ``ignore_keys``, a tuple's elements after
        the loss); without, no loss and all the outputs. Several outputs stay a tuple, one is the tensor itself."""
        labels = self._labels(inputs)
        if ignore_keys is None:
            config = getattr(self.engine.unwrap_model(model), "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", None) or []) if config is not None else []
        with torch.no_grad():
            if labels is not None:
                loss, outputs = self.compute_loss(
                    model, inputs, return_outputs=True, num_items_in_batch=self._items(inputs)
                )
                loss = loss.detach().mean()
            else:
                loss = None
                if isinstance(inputs, Mapping):
                    outputs = model(**inputs)
                elif isinstance(inputs, (tuple, list)) and len(inputs) == 2:
                    outputs = model(inputs[0])
                else:
                    outputs = model(inputs)
        if self.engine.context_parallel is not None:  # each cp rank holds a chunk of every sequence
            loss, outputs, labels = whole_prediction(
                self.engine.context_parallel, loss, self._items(inputs), outputs, labels
            )
        if prediction_loss_only:
            return loss, None, None
        if isinstance(outputs, torch.Tensor):
            logits: Any = outputs  # a module that returns its logits (its loss from compute_loss_func)
        elif isinstance(outputs, Mapping):
            logits = tuple(v for k, v in outputs.items() if k not in [*ignore_keys, "loss"])
        else:
            logits = tuple(outputs[1:] if loss is not None else outputs)  # a tuple starts with its loss, as in HF
        if isinstance(logits, tuple) and len(logits) == 1:
            logits = logits[0]
        return loss, nested_map(logits, torch.Tensor.detach), labels

    def _loop(
        self,
        loader: Any,
        prefix: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        predicting: bool = False,
    ) -> PredictionOutput:
        return evaluation_loop(self, loader, prefix, prediction_loss_only, ignore_keys, predicting)

    def evaluate(
        self,
        eval_dataset: Dataset | dict[str, Dataset] | str | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Loss and ``compute_metrics`` over every sample of the eval set exactly once; logs them and returns them.
        Named eval sets (a dict) are evaluated one by one, each under ``{metric_key_prefix}_{name}``, as in HF."""
        named = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(named, dict):
            metrics = {}
            for name, dataset in named.items():
                which = dataset if eval_dataset is not None else name
                metrics.update(self.evaluate(which, ignore_keys, f"{metric_key_prefix}_{name}"))
            if metric_key_prefix == "eval":
                record_best_metric(self.args, self.state, metrics)
            return metrics
        if eval_dataset is None and self._eval_loader is not None:
            loader = self._eval_loader
        elif isinstance(eval_dataset, str) and eval_dataset in self._eval_loaders:
            loader = self._eval_loaders[eval_dataset]
        else:
            loader = self.engine.prepare(loader_from(self.get_eval_dataloader(eval_dataset), "get_eval_dataloader"))
            if not self._prepared:
                self.model = self.engine.prepare(self.model)
                self._prepared = True
        metrics = self._loop(loader, metric_key_prefix, ignore_keys=ignore_keys).metrics
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        if metric_key_prefix == "eval":
            record_best_metric(self.args, self.state, metrics)
        return metrics

    def predict(
        self, test_dataset: Dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        """Predictions (and, where the data has labels, the labels and metrics) of every sample once, in order, as
        numpy arrays."""
        if not self._prepared:
            self.model = self.engine.prepare(self.model)
            self._prepared = True
        loader = self.engine.prepare(loader_from(self.get_eval_dataloader(test_dataset), "get_eval_dataloader"))
        out = self._loop(
            loader, metric_key_prefix, prediction_loss_only=False, ignore_keys=ignore_keys, predicting=True
        )
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics=out.metrics)
        return out

    def save_model(self, output_dir: str | None = None) -> Path:
        """The whole model as a directory ``from_pretrained`` loads (weights gathered under every strategy)."""
        target = self.model if self._prepared else self.engine.prepare(self.model)
        return self.engine.save_model(target, output_dir or self.output_dir)
