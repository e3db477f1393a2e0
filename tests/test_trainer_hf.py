"""phalanx.Trainer with transformers' model conventions, as a script written for transformers' Trainer uses them.

- ``compute_metrics`` gets an ``EvalPrediction`` that unpacks as ``predictions, labels = eval_pred``, with numpy
  arrays; ``include_for_metrics`` adds the inputs and the losses.
- A model may return a tuple that starts with its loss, a dict or ``ModelOutput`` with ``loss``, and several outputs;
  ``label_names`` may name one label or several.
- Evaluation batches of different lengths are padded with -100 to the longest (across ranks too), and ``predict`` runs
  on data without labels.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx

CLASSES, VOCAB = 3, 10


def _args(tmp: str, **kw) -> phalanx.TrainingArguments:
    base = dict(
        output_dir=tmp,
        learning_rate=0.01,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to=[],
        per_device_eval_batch_size=2,
    )
    return phalanx.TrainingArguments(**{**base, **kw})


class TupleNet(nn.Module):
    """transformers' tuple convention: ``(loss, logits)`` when given labels, ``(logits,)`` without."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        logits = self.fc(x)
        return (logits,) if labels is None else (F.cross_entropy(logits, labels), logits)


def _rows(n: int, with_labels: bool = True) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return [{"x": x[i], **({"labels": y[i]} if with_labels else {})} for i in range(n)]


def test_eval_pred_unpacks_to_numpy_predictions_and_labels(tmp_path):
    seen = {}

    def metrics(eval_pred):
        predictions, labels = eval_pred  # the idiom of transformers' examples
        seen["types"] = (type(predictions), type(labels))
        seen["shapes"] = (predictions.shape, labels.shape)
        return {"accuracy": float((predictions.argmax(-1) == labels).mean())}

    rows = _rows(7)
    trainer = phalanx.Trainer(TupleNet(), _args(str(tmp_path)), train_dataset=rows, compute_metrics=metrics)
    trainer.train()  # a tuple that starts with the loss trains
    out = trainer.evaluate(rows)
    assert seen["types"] == (np.ndarray, np.ndarray) and seen["shapes"] == ((7, CLASSES), (7,))
    assert 0.0 <= out["eval_accuracy"] <= 1.0 and isinstance(out["eval_accuracy"], float)
    assert {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"} <= set(out)


def test_include_for_metrics_adds_inputs_and_losses(tmp_path):
    seen = {}

    def metrics(eval_pred):
        predictions, labels, inputs, losses = eval_pred
        seen.update(inputs=inputs, losses=losses, predictions=predictions)
        return {}

    rows = _rows(5)
    trainer = phalanx.Trainer(
        TupleNet(), _args(str(tmp_path), include_for_metrics=["inputs", "loss"]), compute_metrics=metrics
    )
    trainer.model.main_input_name = "x"  # as a transformers model names its main input
    trainer.evaluate(rows)
    assert np.array_equal(seen["inputs"], torch.stack([r["x"] for r in rows]).numpy())
    assert seen["losses"].shape == (5,) and np.isfinite(seen["losses"]).all()
    assert seen["predictions"].shape == (5, CLASSES)


class DictNet(nn.Module):
    """A dict output with several entries, and two labels: a class and a regression target."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, CLASSES + 1)

    def forward(self, x, labels=None, score_labels=None):  # type: ignore[no-untyped-def]
        out = self.fc(x)
        result = {"logits": out[:, :CLASSES], "score": out[:, CLASSES], "hidden": out}
        if labels is not None:
            result["loss"] = F.cross_entropy(result["logits"], labels) + F.mse_loss(result["score"], score_labels)
        return result


def test_several_outputs_and_several_label_names(tmp_path):
    g = torch.Generator().manual_seed(2)
    rows = [
        {"x": torch.randn(4, generator=g), "labels": torch.tensor(i % CLASSES), "score_labels": torch.tensor(0.5 * i)}
        for i in range(6)
    ]
    seen = {}

    def metrics(eval_pred):
        seen["predictions"], seen["labels"] = eval_pred.predictions, eval_pred.label_ids
        return {}

    args = _args(str(tmp_path), label_names=["labels", "score_labels"])
    trainer = phalanx.Trainer(DictNet(), args, train_dataset=rows, compute_metrics=metrics)
    trainer.train()
    trainer.evaluate(rows, ignore_keys=["hidden"])
    logits, score = seen["predictions"]  # every output but the loss and the ignored keys, in order
    assert logits.shape == (6, CLASSES) and score.shape == (6,)
    classes, scores = seen["labels"]  # one array per label name
    assert classes.tolist() == [i % CLASSES for i in range(6)] and scores.tolist() == [0.5 * i for i in range(6)]


class Tagger(nn.Module):
    """A token classifier: one prediction per position, as for named entities."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, CLASSES)

    def forward(self, input_ids, labels=None):  # type: ignore[no-untyped-def]
        logits = self.head(self.emb(input_ids))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return out


def _pad_batch(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Pads each batch to its own longest row: batches differ in length."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        labels[i, : len(r["labels"])] = r["labels"]
    return {"input_ids": ids, "labels": labels}


def _sequences(lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {
            "input_ids": torch.randint(1, VOCAB, (n,), generator=g),
            "labels": torch.randint(0, CLASSES, (n,), generator=g),
        }
        for n in lengths
    ]


def test_eval_batches_of_different_lengths_are_padded_with_minus_100(tmp_path):
    rows = _sequences([2, 3, 5, 4, 1])  # batches of 2: lengths 3, 5 and 1
    trainer = phalanx.Trainer(Tagger(), _args(str(tmp_path)), data_collator=_pad_batch)
    out = trainer.predict(rows)
    assert out.predictions.shape == (5, 5, CLASSES) and out.label_ids.shape == (5, 5)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert out.label_ids[i, :n].tolist() == row["labels"].tolist() and (out.label_ids[i, n:] == -100).all()
    # a row of the first batch (padded to 3) is padded on to 5 with -100, as transformers pads predictions
    assert (out.predictions[0, 3:] == -100).all() and (out.predictions[0, :3] != -100).all()
    expected = Tagger()(rows[2]["input_ids"][None])["logits"][0].detach().numpy()
    np.testing.assert_allclose(out.predictions[2], expected, rtol=1e-6, atol=1e-6)


def _predict_on_ranks(tmp: str) -> dict:
    trainer = phalanx.Trainer(Tagger(), _args(tmp), data_collator=_pad_batch)
    out = trainer.predict(_sequences([2, 3, 5, 4, 1, 2]))  # rank 0 gets lengths 2, 3 and 1; rank 1: 5, 4 and 2
    return {"predictions": out.predictions, "labels": out.label_ids}


def test_predictions_of_different_lengths_line_up_across_ranks(run_ranks, tmp_path):
    one = _predict_on_ranks(str(tmp_path / "one"))
    for res in run_ranks(_predict_on_ranks, 2, str(tmp_path / "two")):
        # every sample once, in dataset order, padded to the longest on any rank
        assert res["labels"].shape == one["labels"].shape == (6, 5)
        np.testing.assert_array_equal(res["labels"], one["labels"])
        # Where a row has tokens the predictions agree; beyond, a rank's own batch may be shorter than the one
        # process's (a collator pads each rank's batch), so that there they are -100 or the padding token's.
        real = one["labels"] != -100
        np.testing.assert_allclose(res["predictions"][real], one["predictions"][real], rtol=1e-6, atol=1e-6)
        assert (res["predictions"][:, :, 0][~real] == -100).any()  # padded across the ranks, with -100


def test_predict_on_data_without_labels(tmp_path):
    rows = _rows(5, with_labels=False)
    trainer = phalanx.Trainer(TupleNet(), _args(str(tmp_path)), compute_metrics=lambda p: {"never": 1.0})
    out = trainer.predict(rows)
    assert out.predictions.shape == (5, CLASSES) and out.label_ids is None
    assert "test_loss" not in out.metrics and "test_never" not in out.metrics  # no labels: no metrics, as HF


def test_prediction_loss_only_gathers_no_predictions(tmp_path):
    called = []
    rows = _rows(4)
    args = _args(str(tmp_path), prediction_loss_only=True)
    trainer = phalanx.Trainer(TupleNet(), args, compute_metrics=lambda p: called.append(1) or {})
    out = trainer.evaluate(rows)
    assert called == [] and "eval_loss" in out


def test_a_tuple_that_does_not_start_with_a_loss_is_named(tmp_path):
    class LogitsFirst(TupleNet):
        def forward(self, x, labels=None):  # type: ignore[no-untyped-def]
            logits = self.fc(x)
            return (logits, F.cross_entropy(logits, labels))

    trainer = phalanx.Trainer(LogitsFirst(), _args(str(tmp_path)), train_dataset=_rows(4))
    with pytest.raises(ValueError, match=r"a tuple output must start with the loss .*got|first element has shape"):
        trainer.train()


# ------------------------------------------------------------------------------------------ logs and the summary
def _lr_run(tmp: str, **kw) -> phalanx.Trainer:
    args = _args(
        tmp,
        learning_rate=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_steps=6,
        per_device_train_batch_size=2,
        **kw,
    )
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(12))
    trainer.out = trainer.train()  # type: ignore[attr-defined]
    return trainer


def test_the_logged_learning_rate_is_the_rate_the_step_used(tmp_path):
    trainer = _lr_run(str(tmp_path))
    logged = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    # warmup over 2 steps from 0, then cosine over the 4 left: the rate of steps 0..5, as transformers logs it
    import math

    expected = [0.0, 0.05] + [0.1 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert logged == pytest.approx(expected, abs=1e-12)
    norms = [h["grad_norm"] for h in trainer.state.log_history if "loss" in h]
    assert len(norms) == 6 and all(n > 0 for n in norms)  # the global norm, logged as HF logs it


def test_the_run_ends_with_hf_s_summary_log(tmp_path):
    seen = []

    class Recorder(phalanx.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(dict(logs))

    args = _args(str(tmp_path), max_steps=6, per_device_train_batch_size=2)
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(12), callbacks=[Recorder()])
    out = trainer.train()
    summary = trainer.state.log_history[-1]
    keys = ["train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss", "epoch"]
    assert list(summary) == [*keys, "step"] and seen[-1] == {k: summary[k] for k in keys}
    assert list(out.metrics) == keys and out.metrics["train_loss"] == out.training_loss
    assert summary["train_samples_per_second"] == pytest.approx(12 / summary["train_runtime"], rel=0.01)


def test_best_without_a_metric_and_eval_without_data_are_refused_at_once(tmp_path):
    with pytest.raises(ValueError, match="needs metric_for_best_model"):
        phalanx.Trainer(TupleNet(), _args(str(tmp_path), save_strategy="best", eval_strategy="epoch"), eval_dataset=[])
    with pytest.raises(ValueError, match="no eval_dataset was given"):
        phalanx.Trainer(TupleNet(), _args(str(tmp_path), eval_strategy="steps", eval_steps=1))


# ------------------------------------------------------------------------------------------ model_init, arguments
def test_model_init_builds_a_fresh_seeded_model_for_each_train(tmp_path):
    built = []

    def model_init():
        built.append(1)
        return nn.Linear(4, CLASSES)  # initialised from the seed the Trainer sets first

    args = _args(str(tmp_path), max_steps=3, per_device_train_batch_size=2, seed=5)
    trainer = phalanx.Trainer(
        model_init=model_init,
        args=args,
        train_dataset=[(r["x"], r["labels"]) for r in _rows(6)],
        compute_loss_func=lambda out, labels, num_items_in_batch=None: F.cross_entropy(out, labels),
    )
    first = trainer.train().training_loss
    weights = {k: v.clone() for k, v in trainer.engine.get_state_dict(trainer.model).items()}
    again = phalanx.Trainer(model_init=model_init, args=args, train_dataset=trainer.train_dataset)
    again.compute_loss_func = trainer.compute_loss_func
    assert again.train().training_loss == first and len(built) == 4  # one at each __init__ and each train()
    for k, v in again.engine.get_state_dict(again.model).items():
        assert torch.equal(v, weights[k]), k
    with pytest.raises(ValueError, match="needs a model or a model_init"):
        phalanx.Trainer(args=args)


def test_script_flags_and_hf_optimizers_are_accepted(tmp_path):
    args = _args(
        str(tmp_path),
        do_train=True,
        do_eval=True,
        do_predict=False,
        optim="sgd",
        optim_args="momentum=0.9,nesterov=True",
    )
    cls, kwargs = phalanx.Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is torch.optim.SGD and kwargs == {"lr": 0.01, "momentum": 0.9, "nesterov": True}
    for optim, expected in (("adagrad", torch.optim.Adagrad), ("rmsprop", torch.optim.RMSprop)):
        assert phalanx.Trainer.get_optimizer_cls_and_kwargs(_args(str(tmp_path), optim=optim))[0] is expected
    with pytest.raises(phalanx.config.options.ConfigError, match="'nesterov' is not one of optim='adagrad'"):
        _args(str(tmp_path), optim="adagrad", optim_args="nesterov=True")
    with pytest.raises(phalanx.config.options.ConfigError, match="optim='adafactor' is not built in"):
        _args(str(tmp_path), optim="adafactor")


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.ln = nn.LayerNorm(4)
        self.final_norm = nn.Linear(4, 4)
        self.out = nn.Linear(4, CLASSES, bias=False)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.out(self.final_norm(self.ln(self.bn(self.fc(x)))))


def test_weight_decay_spares_what_transformers_spares(tmp_path):
    trainer = phalanx.Trainer(NormNet(), _args(str(tmp_path), weight_decay=0.1))
    # LayerNorm's parameters, every bias, and names with a "_norm" part; a BatchNorm's weight decays, as in HF
    assert trainer.get_decay_parameter_names(trainer.model) == ["fc.weight", "bn.weight", "out.weight"]
    optimizer = trainer.create_optimizer()
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in optimizer.param_groups] == [3, 6]


def test_dataloader_drop_last_applies_to_evaluation_too(tmp_path):
    seen = {}

    def metrics(eval_pred):
        seen["rows"] = len(eval_pred.label_ids)
        return {}

    args = _args(str(tmp_path), dataloader_drop_last=True, per_device_eval_batch_size=4, dataloader_num_workers=1)
    trainer = phalanx.Trainer(TupleNet(), args, compute_metrics=metrics)
    assert trainer.get_eval_dataloader(_rows(9)).num_workers == 1
    trainer.evaluate(_rows(9))
    assert seen["rows"] == 8  # the last, incomplete batch of 1 is dropped, as transformers drops it


def test_progress_in_a_log_file_is_plain_lines_and_disable_tqdm_silences_it(tmp_path, capsys):
    # Beyond transformers: its nested evaluation bar writes cursor escapes into a log file (ESC[A). stderr here is
    # not a terminal, as a CI log is not: the progress is plain lines, one at the end of each bar at least.
    args = _args(str(tmp_path), disable_tqdm=False, eval_strategy="steps", eval_steps=2, max_steps=4)
    phalanx.Trainer(TupleNet(), args, train_dataset=_rows(16), eval_dataset=_rows(6)).train()
    err = capsys.readouterr().err
    assert "\x1b[" not in err and "\r" not in err
    assert "train: 4/4 steps" in err and "eval: 3/3 batches" in err
    quiet = _args(str(tmp_path / "quiet"), disable_tqdm=True, max_steps=2)
    phalanx.Trainer(TupleNet(), quiet, train_dataset=_rows(8)).train()
    assert "train:" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ streams
class Stream(torch.utils.data.IterableDataset):
    """A stream of rows, as a datasets IterableDataset gives them: the same on every rank, with set_epoch."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows, self.epochs = rows, []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.rows)


def _stream_run(tmp: str, per_device: int) -> dict:
    rows = _rows(10)
    args = _args(
        tmp, max_steps=4, per_device_train_batch_size=per_device, learning_rate=0.1, lr_scheduler_type="constant"
    )
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=Stream(rows), compute_metrics=lambda p: {})
    trainer.train()
    out = trainer.predict(Stream(rows))
    return {
        "state": trainer.engine.get_state_dict(trainer.model),
        "labels": out.label_ids,
        "epochs": trainer.train_dataset.epochs,
    }


def test_an_iterable_dataset_trains_evaluates_and_predicts_on_one_and_two_ranks(run_ranks, tmp_path):
    # Global batches of 4 rows: 4 per process on one, 2 per rank on two. 4 steps read 16 rows of a stream of 10:
    # batches of 4, 4 and 2 rows, then the stream again from its start (its second epoch).
    one = _stream_run(str(tmp_path / "one"), 4)
    assert one["labels"].tolist() == [r["labels"].item() for r in _rows(10)]  # every row once, in order
    assert one["epochs"][:2] == [0, 1]
    for res in run_ranks(_stream_run, 2, str(tmp_path / "two"), 2):
        assert res["labels"].tolist() == one["labels"].tolist()  # the last global batch's padding dropped
        assert res["epochs"][:2] == [0, 1]
        for k, v in one["state"].items():
            torch.testing.assert_close(res["state"][k], v, rtol=1e-5, atol=1e-6)


def test_an_iterable_dataset_needs_max_steps(tmp_path):
    trainer = phalanx.Trainer(TupleNet(), _args(str(tmp_path)), train_dataset=Stream(_rows(4)))
    with pytest.raises(ValueError, match="IterableDataset .* has no length to count epochs by; set max_steps"):
        trainer.train()


# -------------------------------------------------------------------------------- more of transformers' arguments
def test_label_smoothing_is_transformers_formula(tmp_path):
    rows = _rows(6)
    trainer = phalanx.Trainer(TupleNet(), _args(str(tmp_path), label_smoothing_factor=0.2))
    batch = {"x": torch.stack([r["x"] for r in rows]), "labels": torch.stack([r["labels"] for r in rows])}
    loss = trainer.compute_loss(trainer.model, batch)
    log_probs = -F.log_softmax(trainer.model.fc(batch["x"]), dim=-1)
    nll = log_probs.gather(1, batch["labels"][:, None]).mean()
    expected = 0.8 * nll + 0.2 * log_probs.mean()  # (1 - eps) x nll + eps x the mean over the classes
    torch.testing.assert_close(loss, expected)


def test_batch_eval_metrics_sees_each_batch_and_says_which_is_last(tmp_path):
    calls = []

    def metrics(eval_pred, compute_result):
        calls.append((len(eval_pred.label_ids), compute_result))
        return {"batches": float(len(calls))}

    trainer = phalanx.Trainer(TupleNet(), _args(str(tmp_path), batch_eval_metrics=True), compute_metrics=metrics)
    out = trainer.evaluate(_rows(5))  # batches of 2, 2 and 1
    assert calls == [(2, False), (2, False), (1, True)] and out["eval_batches"] == 3.0


class Counter(phalanx.TrainerCallback):
    """A callback with state (transformers' ExportableState): it counts the steps it has seen."""

    def __init__(self, name: str = "steps") -> None:
        self.name, self.count = name, 0

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.count += 1

    def state(self) -> dict:
        return {"args": {"name": self.name}, "attributes": {"count": self.count}}


def test_callback_states_come_back_on_resume_when_asked(tmp_path):
    args = _args(str(tmp_path), save_strategy="steps", save_steps=2, max_steps=2, per_device_train_batch_size=2)
    phalanx.Trainer(TupleNet(), args, train_dataset=_rows(8), callbacks=[Counter()]).train()
    saved = (tmp_path / "checkpoint-2" / "trainer_state.json").read_text()
    assert '"Counter"' in saved and '"count": 2' in saved  # saved with the checkpoint, as HF saves it
    for restore, expected in ((True, 3), (False, 1)):
        resumed = dataclasses.replace(args, restore_callback_states_from_checkpoint=restore, max_steps=3)
        trainer = phalanx.Trainer(TupleNet(), resumed, train_dataset=_rows(8), callbacks=[Counter()])
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
        (counter,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, Counter)]
        assert counter.count == expected  # 2 restored + the one step after the resume, or that step only


class _Preempt(phalanx.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == 2:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)  # what a preemption sends


def test_a_sigterm_saves_a_checkpoint_at_the_step_and_stops(tmp_path):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    args = _args(str(tmp_path), enable_jit_checkpoint=True, max_steps=6, per_device_train_batch_size=2)
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(12), callbacks=[_Preempt()])
    out = trainer.train()
    assert out.global_step == 2 and (tmp_path / "checkpoint-2" / "trainer_state.json").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is given back
    resumed = phalanx.Trainer(TupleNet(), _args(str(tmp_path), max_steps=6, per_device_train_batch_size=2))
    resumed.train_dataset = _rows(12)
    assert resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2")).global_step == 6


def test_hf_s_trainer_helpers(tmp_path):
    trainer = phalanx.Trainer(TupleNet(), _args(str(tmp_path), max_steps=1, per_device_train_batch_size=2))
    assert trainer.get_num_trainable_parameters() == 4 * CLASSES + CLASSES
    with pytest.raises(ValueError, match="no optimizer yet"):
        trainer.get_learning_rates()
    trainer.train_dataset = _rows(2)
    trainer.train()
    assert trainer.get_learning_rates() == [0.0, 0.0]  # linear decay to 0 over the one step, in both groups
    weight = trainer.engine.unwrap_model(trainer.model).fc.weight
    assert trainer.get_optimizer_group(weight)["weight_decay"] == 0.0  # weight_decay defaults to 0.0
    assert len(trainer.get_optimizer_group()) == 2
    assert trainer.accelerator is trainer.engine and trainer.model_wrapped is trainer.model
    with pytest.raises(phalanx.config.options.ConfigError, match="auto_find_batch_size=True"):
        _args(str(tmp_path), auto_find_batch_size=True)


def test_torch_compile_compiles_the_prepared_model(tmp_path):
    args = _args(str(tmp_path), torch_compile_backend="eager", max_steps=2, per_device_train_batch_size=2)
    assert args.torch_compile  # naming a backend turns it on, as in transformers
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(4))
    trainer.train()
    assert type(trainer.model).__name__ == "OptimizedModule"


# ------------------------------------------------------------------------------------------------------ schedules
def test_more_of_transformers_schedules_follow_its_formulas(tmp_path):
    transformers = pytest.importorskip("transformers")
    from phalanx.trainer.schedules import get_scheduler

    for name, kwargs in (
        ("cosine_with_restarts", {"num_cycles": 2}),
        ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
        ("cosine_warmup_with_min_lr", {"min_lr": 0.01, "warmup_lr_rate": 0.2}),
    ):
        ours_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        theirs_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        ours = get_scheduler(name, ours_opt, 3, 12, kwargs)
        theirs = transformers.get_scheduler(name, theirs_opt, 3, 12, scheduler_specific_kwargs=dict(kwargs))
        for _ in range(12):
            assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), abs=1e-12), name
            ours_opt.step()
            theirs_opt.step()
            ours.step()
            theirs.step()


def test_reduce_lr_on_plateau_steps_on_the_evaluation_metric(tmp_path):
    # A metric that never improves: from the second evaluation on, each halves the rate (patience 0).
    flat = {"compute_metrics": lambda p: {"flat": 1.0}}
    args = _args(
        str(tmp_path),
        lr_scheduler_type="reduce_lr_on_plateau",
        lr_scheduler_kwargs={"patience": 0, "factor": 0.5},
        eval_strategy="steps",
        eval_steps=1,
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=0.1,
    )
    assert args.metric_for_best_model == "loss"  # its default, as in transformers
    args = dataclasses.replace(args, metric_for_best_model="flat", greater_is_better=False)
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(6), eval_dataset=_rows(4), **flat)
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    assert lrs == pytest.approx([0.1, 0.1, 0.05])  # stepped after each evaluation, not at each optimizer step
    # One given through optimizers= steps the same way (its step() without the metric used to crash).
    model = TupleNet()
    custom = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(custom, patience=0, factor=0.5)
    args2 = dataclasses.replace(args, output_dir=str(tmp_path / "given"))
    given = phalanx.Trainer(
        model, args2, train_dataset=_rows(6), eval_dataset=_rows(4), optimizers=(custom, plateau), **flat
    )
    given.train()
    assert custom.param_groups[0]["lr"] == pytest.approx(0.025)  # halved at the 2nd and 3rd evaluations
    assert isinstance(given.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)  # the user's object, as in HF


def test_greedy_schedule_steps_on_the_metric_and_resumes(tmp_path):
    # A metric that improves at every evaluation: with patience 0 each evaluation doubles the rate (factor 0.5).
    calls = []

    def falling(p):
        calls.append(1)
        return {"score": 1.0 / len(calls)}

    args = _args(
        str(tmp_path),
        lr_scheduler_type="greedy",
        lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "max_lr": 0.3},
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=2,
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=0.05,
        metric_for_best_model="score",
        greater_is_better=False,
    )
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(8), eval_dataset=_rows(4), compute_metrics=falling)
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    assert lrs == pytest.approx([0.05, 0.1, 0.2, 0.3])  # doubled after each evaluation, up to max_lr
    weights = trainer.model.fc.weight.detach().clone()
    # Resumed at step 2, the schedule's state (best metric, counters, rate) comes back with the checkpoint.
    calls[:] = [1, 1]  # the metric continues from where the first run was at step 2
    again = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(8), eval_dataset=_rows(4), compute_metrics=falling)
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert [h["learning_rate"] for h in again.state.log_history if "loss" in h] == pytest.approx(lrs)
    torch.testing.assert_close(again.model.fc.weight, weights, rtol=0, atol=0)


def test_a_transformers_greedy_lr_given_through_optimizers_steps_on_the_metric(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (a test extra)")
    model = TupleNet()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    greedy = transformers.optimization.GreedyLR(sgd, patience=0, factor=0.5, min_lr=0.01)
    args = _args(str(tmp_path), eval_strategy="steps", eval_steps=1, max_steps=3, per_device_train_batch_size=2)
    flat = {"compute_metrics": lambda p: {"flat": 1.0}}
    args = dataclasses.replace(args, metric_for_best_model="flat", greater_is_better=False)
    trainer = phalanx.Trainer(
        model, args, train_dataset=_rows(6), eval_dataset=_rows(4), optimizers=(sgd, greedy), **flat
    )
    trainer.train()
    assert trainer.lr_scheduler is greedy  # the user's object, as in transformers
    # The first evaluation beats the initial best (inf) and doubles the rate; the flat ones after it halve it.
    assert [h["learning_rate"] for h in trainer.state.log_history if "loss" in h] == pytest.approx([0.1, 0.2, 0.1])
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.05)
    assert greedy.last_epoch == 3  # stepped once per evaluation, never at an optimizer step


def test_named_eval_sets_are_evaluated_each_under_its_name(tmp_path):
    """eval_dataset as a dict, as in transformers: each set evaluated under eval_<name>_..., the best model chosen by
    one of them, and get_eval_dataloader(name) gives one set's loader."""
    first, second = _rows(6), _rows(10)[4:]
    args = _args(
        str(tmp_path),
        eval_strategy="epoch",
        save_strategy="epoch",
        num_train_epochs=2,
        metric_for_best_model="second_loss",  # "eval_" is added, as HF adds it
        greater_is_better=False,
    )
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(8), eval_dataset={"first": first, "second": second})
    assert len(trainer.get_eval_dataloader("second").dataset) == 6
    with pytest.raises(KeyError, match="no eval set named 'third'"):
        trainer.get_eval_dataloader("third")
    trainer.train()
    evals = [h for h in trainer.state.log_history if any(k.startswith("eval_") for k in h)]
    assert [sorted(k for k in h if k.endswith("_loss")) for h in evals] == [
        ["eval_first_loss"],
        ["eval_second_loss"],
    ] * 2
    seconds = [h["eval_second_loss"] for h in evals if "eval_second_loss" in h]
    assert trainer.state.best_metric == min(seconds)
    alone = trainer.evaluate(second, metric_key_prefix="again")  # one set given: evaluated alone, as given
    assert alone["again_loss"] == pytest.approx(trainer.evaluate()["eval_second_loss"], abs=1e-6)


def test_a_train_loader_that_is_not_a_dataloader_is_refused_with_the_way_out(tmp_path):
    class Chained:
        def __init__(self, loaders):
            self.loaders = loaders

        def __iter__(self):
            for loader in self.loaders:
                yield from loader

        def __len__(self):
            return sum(len(loader) for loader in self.loaders)

    class TwoLoaders(phalanx.Trainer):
        def get_train_dataloader(self):
            return Chained([super().get_train_dataloader(), super().get_train_dataloader()])

    trainer = TwoLoaders(TupleNet(), _args(str(tmp_path)), train_dataset=_rows(8))
    with pytest.raises(
        TypeError, match=r"get_train_dataloader\(\) returned a Chained, not a torch DataLoader.*Return a"
    ):
        trainer.train()


def test_persistent_workers_keep_one_eval_loader_per_eval_set(tmp_path):
    # transformers keeps the loader (and so its workers) across evaluations; it keys it by name, so that another
    # dataset passed to evaluate() gets the eval set's loader. Here each set keeps its own.
    args = _args(str(tmp_path), dataloader_num_workers=1, dataloader_persistent_workers=True)
    eval_rows, other = _rows(4), _rows(6)
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(8), eval_dataset=eval_rows)
    first = trainer.get_eval_dataloader()
    assert trainer.get_eval_dataloader(eval_rows) is first and first.persistent_workers
    assert trainer.get_eval_dataloader(other) is not first and trainer.get_eval_dataloader(other).dataset is other
    plain = phalanx.Trainer(TupleNet(), _args(str(tmp_path)), train_dataset=_rows(8), eval_dataset=eval_rows)
    assert plain.get_eval_dataloader() is not plain.get_eval_dataloader()  # without workers nothing is kept


def test_a_second_callback_of_a_class_and_an_unused_saved_state_are_said(tmp_path, monkeypatch):
    # transformers warns on its own logger; phalanx says the same once, on phalanx's.
    import phalanx.logging as plog

    said: list[str] = []
    monkeypatch.setattr(plog, "_WARNED", set())
    monkeypatch.setattr(plog.get_logger(), "warning", lambda msg, *a: said.append(msg % a if a else msg))
    args = _args(str(tmp_path), save_strategy="steps", save_steps=2, max_steps=2, per_device_train_batch_size=2)
    trainer = phalanx.Trainer(TupleNet(), args, train_dataset=_rows(8), callbacks=[Counter()])
    trainer.add_callback(Counter)
    assert any("adding a second Counter" in m for m in said)
    trainer.train()
    said.clear()
    asked = dataclasses.replace(args, restore_callback_states_from_checkpoint=True, max_steps=3)
    phalanx.Trainer(TupleNet(), asked, train_dataset=_rows(8)).train(str(tmp_path / "checkpoint-2"))
    assert any("callbacks this run does not have; not used: Counter" in m for m in said), said
