"""The Trainer's evaluation and prediction loop, as transformers' ``evaluation_loop``: every sample once, in dataset
order, batch by batch to the CPU; batches padded with -100 to the longest on any rank and across batches; the
predictions, labels, inputs and losses handed to ``compute_metrics`` as numpy arrays."""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from phalanx.engine.engine import Engine
from phalanx.trainer.nested import concat, first_tensor, nested_map, numpify, pad_dim1
from phalanx.trainer.outputs import EvalPrediction, PredictionOutput, plain

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

__all__ = ["evaluation_loop"]


def _pad_across_ranks(engine: Engine, t: torch.Tensor) -> torch.Tensor:
    if t.dim() < 2 or engine.world_size == 1:
        return t
    return pad_dim1(t, int(engine.reduce(torch.tensor(t.shape[1]), "max").item()))


def evaluation_loop(
    trainer: Trainer,
    loader: Any,
    prefix: str,
    prediction_loss_only: bool | None = None,
    ignore_keys: list[str] | None = None,
    predicting: bool = False,
) -> PredictionOutput:
    """Every sample once, in dataset order, batch by batch to the CPU. Batches are padded with -100 along their
    second dimension to the longest on any rank, then to the longest so far, as HF pads them. With
    ``batch_eval_metrics`` (in evaluation), ``compute_metrics`` sees each batch and predictions are not kept."""
    args = trainer.args
    per_batch = args.batch_eval_metrics and not predicting and trainer.compute_metrics is not None
    batch_result: Any = None
    only_loss = args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
    keep_inputs = "inputs" in args.include_for_metrics
    main_input = getattr(trainer.engine.unwrap_model(trainer.model), "main_input_name", "input_ids")
    trainer.model.eval()
    found: dict[str, Any] = {"preds": None, "labels": None, "inputs": None, "losses": None}
    started = time.perf_counter()
    seen = batches = 0
    for batch in loader:
        batches += 1
        is_last = trainer.engine.end_of_dataloader
        loss, logits, labels = trainer.prediction_step(trainer.model, batch, only_loss, ignore_keys)
        inputs = None
        if keep_inputs:  # the batch's main input: a transformers model names it (main_input_name)
            inputs = (
                batch[main_input]
                if isinstance(batch, Mapping)
                else batch[0]
                if isinstance(batch, (tuple, list))
                else batch
            )
        first = first_tensor(batch)
        size = 1 if first is None or first.dim() == 0 else first.shape[0]
        seen += size
        # Each tensor is padded to its longest on any rank, so that the gathered batches line up (as HF does).
        labels, logits, inputs = (
            nested_map(x, partial(_pad_across_ranks, trainer.engine)) for x in (labels, logits, inputs)
        )
        if logits is not None and trainer.preprocess_logits_for_metrics is not None:
            logits = trainer.preprocess_logits_for_metrics(logits, labels)
        # Each sample carries its batch's mean loss, so that dropping the padding counts each sample once.
        losses = loss.float().expand(size) if loss is not None else None
        now: dict[str, Any] = {}
        for key, value in (("preds", logits), ("labels", labels), ("inputs", inputs), ("losses", losses)):
            if value is not None:
                now[key] = nested_map(value, lambda x: trainer.engine.gather_for_metrics(x).cpu())
                if not per_batch or key == "losses":
                    found[key] = concat(found[key], now[key])
        trainer.control = trainer.callback_handler.on_prediction_step(args, trainer.state, trainer.control)
        if per_batch and now.get("preds") is not None and now.get("labels") is not None:
            extra = {
                "inputs": now.get("inputs") if keep_inputs else None,
                "losses": now.get("losses") if "loss" in args.include_for_metrics else None,
            }
            pred = EvalPrediction(now["preds"], now["labels"], **extra)
            batch_result = trainer.compute_metrics(pred, compute_result=is_last)  # type: ignore[misc, call-arg]
    trainer.model.train()
    predictions, label_ids = numpify(found["preds"]), numpify(found["labels"])
    losses_np = numpify(found["losses"])
    metrics: dict[str, Any] = dict(batch_result or {}) if per_batch else {}
    if not per_batch and trainer.compute_metrics is not None and predictions is not None and label_ids is not None:
        extra = {
            "inputs": numpify(found["inputs"]) if keep_inputs else None,
            "losses": losses_np if "loss" in args.include_for_metrics else None,
        }
        metrics = dict(trainer.compute_metrics(EvalPrediction(predictions, label_ids, **extra)))
    metrics = {k: plain(v) for k, v in metrics.items()}
    if losses_np is not None:
        finite = np.isfinite(losses_np)
        if args.logging_nan_inf_filter and finite.any():
            losses_np = losses_np[finite]
        metrics[f"{prefix}_loss"] = float(losses_np.mean())
    metrics = {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in metrics.items()}
    runtime = time.perf_counter() - started
    # Counted, as a stream has no length: the samples gathered (every rank's), else this rank's times the ranks.
    counted = next((first_tensor(found[k]) for k in ("losses", "preds", "labels") if found[k] is not None), None)
    samples = len(counted) if counted is not None and counted.dim() else seen * trainer.engine.topology.data_size
    steps = batches
    metrics |= {
        f"{prefix}_runtime": round(runtime, 4),
        f"{prefix}_samples_per_second": round(samples / max(runtime, 1e-9), 3),
        f"{prefix}_steps_per_second": round(steps / max(runtime, 1e-9), 3),
    }
    return PredictionOutput(predictions, label_ids, metrics)
