"""phalanx.Trainer next to the real transformers.Trainer, on one process, on the same model, data and arguments.

- A whole run, differentially: shuffled data (the order from HF's ``data_seed``), accumulation, warmup and cosine,
  evaluation with a metric, early stopping and the best model loaded at the end. The weights, the logs, the metrics,
  the predictions, the best checkpoint and every callback event, in order, are transformers'.
- Resuming: phalanx goes on from a ``checkpoint-N/`` that transformers wrote (weights, optimizer moments, schedule,
  RNG, trainer state, the next batch) and reaches the weights transformers reaches by resuming there itself.

transformers and accelerate come with the test extra (scripts/setup.sh), so CI runs these.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (the test extra installs it)")

TOL = 1e-6


class Regressor(nn.Module):
    """Two layers (weights and biases: both weight-decay groups are used), HF's dict output with the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(4, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pred = self.out(torch.tanh(self.hidden(x))).squeeze(-1)
        return {"logits": pred} if labels is None else {"loss": F.mse_loss(pred, labels), "logits": pred}


def _rows(n: int = 32, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([0.5, -1.0, 2.0, 0.25]) + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def _arguments(module, output_dir: Path, **kw):
    """The same arguments for both Trainers: shuffled data, accumulation over equal micro-batches, warmup + cosine,
    both weight-decay groups."""
    base = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=0.05,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        num_train_epochs=3,  # 32 rows / (4 x 2) = 4 optimizer steps an epoch, 12 in all
        logging_steps=1,
        save_strategy="steps",
        save_steps=6,  # step 6 is in the middle of the second epoch
        report_to="none",
        disable_tqdm=True,
        seed=7,
    )
    return module.TrainingArguments(**{**base, **kw})


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _recorder(base: type) -> type:
    """A callback class on ``base`` that records every event transformers' TrainerCallback has, in order."""
    events = [name for name in vars(transformers.TrainerCallback) if name.startswith("on_")]

    def event(name: str):
        return lambda self, args, state, control, **kwargs: self.seen.append(name)

    return type("Recorder", (base,), {"seen": None, **{name: event(name) for name in events}})


def _mse(prediction) -> dict[str, float]:
    predictions, labels = prediction  # HF's idiom: numpy arrays
    return {"mse": float(((predictions - labels) ** 2).mean())}


def _run(module, output_dir: Path) -> dict:
    recorder = _recorder(module.TrainerCallback)()
    recorder.seen = []
    args = _arguments(
        module,
        output_dir,
        learning_rate=0.2,  # high enough for the metric to turn: the best (step 8) is not the last (step 12)
        num_train_epochs=4,  # 16 steps unless early stopping ends the run first
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="mse",
        greater_is_better=False,
        data_seed=11,
        per_device_eval_batch_size=3,  # batches of 3, 3, 2: uneven, as the last batch of an eval set often is
    )
    trainer = module.Trainer(
        Regressor(),
        args,
        train_dataset=_rows(),
        eval_dataset=_rows(8, seed=2),
        compute_metrics=_mse,
        callbacks=[module.EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.02), recorder],
    )
    trainer.train()
    weights = _weights(trainer.model if module is transformers else trainer.engine.unwrap_model(trainer.model))
    predictions = trainer.predict(_rows(5, seed=3))
    return {
        "weights": weights,
        "logs": trainer.state.log_history,
        "predictions": predictions.predictions,
        "metrics": predictions.metrics,
        "best": Path(trainer.state.best_model_checkpoint).name,
        "step": trainer.state.global_step,
        "events": recorder.seen,
    }


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL


def test_the_same_run_as_transformers_trainer(tmp_path):
    theirs, ours = _run(transformers, tmp_path / "hf"), _run(phalanx, tmp_path / "ph")
    assert theirs["step"] < 16 and theirs["best"] != f"checkpoint-{theirs['step']}", (theirs["step"], theirs["best"])
    assert ours["step"] == theirs["step"] and ours["best"] == theirs["best"]
    for k in theirs["weights"]:
        torch.testing.assert_close(ours["weights"][k], theirs["weights"][k], rtol=0, atol=TOL, msg=k)
    np.testing.assert_allclose(ours["predictions"], theirs["predictions"], rtol=0, atol=TOL)
    assert _close(ours["metrics"]["test_mse"], theirs["metrics"]["test_mse"])
    assert _close(ours["metrics"]["test_loss"], theirs["metrics"]["test_loss"])

    def kind(log: dict) -> str:
        return "train" if "loss" in log else "eval" if "eval_loss" in log else "summary"

    assert [kind(h) for h in ours["logs"]] == [kind(h) for h in theirs["logs"]]
    for a, b in zip(ours["logs"], theirs["logs"]):
        assert a["step"] == b["step"] and _close(a["epoch"], b["epoch"]), (a, b)
        if kind(b) == "train":
            assert _close(a["loss"], b["loss"]) and _close(a["learning_rate"], b["learning_rate"]), (a, b)
            assert _close(a["grad_norm"], b["grad_norm"]), (a, b)
        elif kind(b) == "eval":
            assert _close(a["eval_loss"], b["eval_loss"]) and _close(a["eval_mse"], b["eval_mse"]), (a, b)
        else:
            assert _close(a["train_loss"], b["train_loss"]), (a, b)
    assert ours["events"] == theirs["events"]


def test_resumes_from_a_transformers_checkpoint_where_transformers_itself_would(tmp_path):
    hf_dir = tmp_path / "hf"
    hf = transformers.Trainer(Regressor(), _arguments(transformers, hf_dir), train_dataset=_rows())
    hf.train()
    checkpoint = hf_dir / "checkpoint-6"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= {
        p.name for p in checkpoint.iterdir()
    }

    # transformers resuming from its own checkpoint: the reference
    again = transformers.Trainer(Regressor(), _arguments(transformers, tmp_path / "hf2"), train_dataset=_rows())
    again.train(resume_from_checkpoint=str(checkpoint))
    reference = _weights(again.model)

    # phalanx resuming from transformers' checkpoint, with a freshly initialised model of another seed
    torch.manual_seed(123)
    model = Regressor()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # far from the checkpoint's weights: only a real load can reach the reference
    ours = phalanx.Trainer(model, _arguments(phalanx, tmp_path / "ph"), train_dataset=_rows())
    ours.train(resume_from_checkpoint=str(checkpoint))

    assert ours.state.global_step == again.state.global_step == 12
    got = _weights(ours.engine.unwrap_model(ours.model))
    assert got.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(got[k], reference[k], rtol=0, atol=TOL, msg=k)
    # the logs after the resume: the same losses and rates, step for step
    theirs_logs = [h for h in again.state.log_history if "loss" in h and h["step"] > 6]
    our_logs = [h for h in ours.state.log_history if "loss" in h and h["step"] > 6]
    assert [h["step"] for h in our_logs] == [h["step"] for h in theirs_logs] == list(range(7, 13))
    for a, b in zip(our_logs, theirs_logs):
        assert abs(a["loss"] - b["loss"]) <= TOL and abs(a["learning_rate"] - b["learning_rate"]) <= 1e-12, (a, b)
    # the state came from trainer_state.json: the history before the resume is transformers' own
    before = [h["loss"] for h in ours.state.log_history if "loss" in h and h["step"] <= 6]
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    assert before == [h["loss"] for h in saved if "loss" in h]


def _resume_sharded(checkpoint: str, output_dir: str, strategy: str) -> dict[str, torch.Tensor]:
    args = _arguments(phalanx, Path(output_dir), per_device_train_batch_size=2, strategy=strategy)  # 2 x 2 ranks = 4
    trainer = phalanx.Trainer(Regressor(), args, train_dataset=_rows())
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer.engine.get_state_dict(trainer.model)


@pytest.mark.parametrize("strategy", ["zero3"])
def test_a_transformers_checkpoint_resumes_sharded_on_two_ranks(run_ranks, tmp_path, strategy):
    """The optimizer moments of transformers' optimizer.pt, by parameter, split over zero3's shards."""
    hf = transformers.Trainer(Regressor(), _arguments(transformers, tmp_path / "hf"), train_dataset=_rows())
    hf.train()
    again = transformers.Trainer(Regressor(), _arguments(transformers, tmp_path / "hf2"), train_dataset=_rows())
    again.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-6"))
    reference = _weights(again.model)
    for got in run_ranks(_resume_sharded, 2, str(tmp_path / "hf" / "checkpoint-6"), str(tmp_path / "ph"), strategy):
        for k in reference:  # the two ranks sum the gradient in another order than one process: 1e-5
            torch.testing.assert_close(got[k], reference[k], rtol=0, atol=1e-5, msg=k)


def test_a_transformers_checkpoint_with_another_grouping_is_refused(tmp_path):
    hf = transformers.Trainer(
        Regressor(), _arguments(transformers, tmp_path / "hf", num_train_epochs=1, save_steps=2), train_dataset=_rows()
    )
    hf.train()
    model = Regressor()
    optimizer = torch.optim.AdamW([{"params": list(model.parameters())}], lr=0.05)  # one group, not two
    ours = phalanx.Trainer(
        model, _arguments(phalanx, tmp_path / "ph"), train_dataset=_rows(), optimizers=(optimizer, None)
    )
    with pytest.raises(phalanx.checkpoint.CheckpointError, match=r"groups of \[4, 0\]|groups of \[2, 2\]"):
        ours.train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-2"))
