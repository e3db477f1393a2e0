"""Trackers: the Trainer's ``report_to`` and the Accelerate front's ``log_with`` write Weights & Biases offline runs
and MLflow file stores that hold exactly the metrics logged, at their steps, from the main process only; an unknown
name or a missing library is a clear error that names the pip extra. No network: W&B runs offline, MLflow writes a
file store under the test's folder."""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.accelerate import Accelerator
from phalanx.engine.trackers import make_tracker, tracker_names
from phalanx.trainer.reporting import reporting_callbacks

FEATURES = 5


def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """W&B offline and quiet, MLflow's file store under tmp_path; returns the tracking URI."""
    monkeypatch.chdir(tmp_path)
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONSOLE": "off",  # no capture of stdout/stderr
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_X_DISABLE_STATS": "true",  # no system-metrics sampler
        "WANDB_PROJECT": "trackers-test",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 asks for it to write a file store
        "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
        "MLFLOW_EXPERIMENT_NAME": "trackers-test",
    }.items():
        monkeypatch.setenv(key, value)
    for key in ("MLFLOW_RUN_ID", "MLFLOW_TAGS", "MLFLOW_NESTED_RUN", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(key, raising=False)
    return f"file:{tmp_path / 'mlruns'}"


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    import mlflow
    import wandb

    uri = _offline(monkeypatch, tmp_path)
    yield uri
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)  # type: ignore[arg-type]
    wandb.finish()
    wandb.teardown()  # stops the wandb-core service this process started, so nothing lingers after the test


# ----------------------------------------------------------------------------------------- reading what was written
def _wandb_records(path: Path) -> list[Any]:
    """The records of a .wandb file, read with wandb's own protobuf message: the file is a LevelDB-style log (a
    7-byte header ':W&B', 0xBEE1, version 0; then 32 KiB blocks of chunks, each a CRC-32, a length and a kind)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), f"not a .wandb log of a known version: {path}"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += room
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos} of {path}"
        pending, pos = pending + chunk, pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _wandb_run(run_dir: Path) -> dict[str, Any]:
    """An offline run's history rows, config, summary, name and project, as the .wandb file holds them."""
    (log,) = run_dir.glob("run-*.wandb")
    run: dict[str, Any] = {"history": [], "config": {}, "summary": {}, "exit": None}
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(name=record.run.display_name, project=record.run.project, id=record.run.run_id)
            run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run["history"].append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
        elif kind == "summary":
            run["summary"].update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update}
            )
        elif kind == "exit":
            run["exit"] = record.exit.exit_code
    return run


def _wandb_runs(root: Path) -> list[dict[str, Any]]:
    return [_wandb_run(d) for d in sorted((root / "wandb").glob("offline-run-*"))]


def _mlflow_runs(uri: str, experiment: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} in {uri}"
    return client.search_runs([found.experiment_id])


def _metric(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


# ----------------------------------------------------------------------------------------- the Trainer
def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randn(n, 1, generator=g))


def _mse(outputs: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    return F.mse_loss(outputs, labels)


def test_the_trainer_reports_to_a_wandb_offline_run_and_an_mlflow_file_store(offline, tmp_path):
    torch.manual_seed(0)
    args = phalanx.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to=["wandb", "mlflow"],
        run_name="tiny",
        per_device_train_batch_size=8,
        max_steps=4,
        logging_steps=1,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = phalanx.Trainer(
        nn.Linear(FEATURES, 1), args, train_dataset=_data(), eval_dataset=_data(16), compute_loss_func=_mse
    )
    out = trainer.train()
    evaluated = trainer.evaluate()  # after train(): the same runs are reopened for it
    logged = [(h["step"], h["loss"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]
    assert [s for s, _, _ in logged] == [1, 2, 3, 4]

    # W&B: the training run, then the same run (same id) reopened for evaluate(); transformers' names and x axis
    first, reopened = _wandb_runs(tmp_path)
    assert first["id"] == reopened["id"] and first["exit"] == reopened["exit"] == 0
    assert (first["name"], first["project"]) == ("tiny", "trackers-test")
    rows = [r for r in first["history"] if "train/loss" in r]
    assert [(r["train/global_step"], r["train/loss"], r["train/learning_rate"]) for r in rows] == logged
    assert first["summary"]["train_loss"] == out.training_loss  # the run's totals go to the summary
    assert "train/train_runtime" not in {k for r in first["history"] for k in r}
    assert first["config"]["learning_rate"] == 0.05 and first["config"]["run_name"] == "tiny"
    assert first["config"]["model/num_parameters"] == FEATURES + 1
    (eval_row,) = [r for r in reopened["history"] if "eval/loss" in r]
    assert (eval_row["train/global_step"], eval_row["eval/loss"]) == (4, evaluated["eval_loss"])

    # MLflow: one run, finished, with every logged value at its optimizer step, and the arguments as parameters
    (run,) = _mlflow_runs(offline, "trackers-test")
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert _metric(offline, run.info.run_id, "loss") == [(s, v) for s, v, _ in logged]
    assert _metric(offline, run.info.run_id, "learning_rate") == [(s, lr) for s, _, lr in logged]
    assert _metric(offline, run.info.run_id, "train_loss") == [(4, out.training_loss)]
    assert _metric(offline, run.info.run_id, "eval_loss") == [(4, evaluated["eval_loss"])]
    assert run.data.params["learning_rate"] == "0.05" and run.data.params["max_steps"] == "4"

    # log.jsonl is written as before, with the same values
    jsonl = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in jsonl if "loss" in r] == [(s, v) for s, v, _ in logged]


# ----------------------------------------------------------------------------------------- the Accelerate front
def _accelerate_run(tmp: str, steps: int) -> dict[str, Any]:
    """Accelerate's tracker calls, on every rank: only the main process starts runs and logs."""
    import wandb

    accelerator = Accelerator(log_with=["wandb", "mlflow"], cpu=True)
    accelerator.init_trackers(
        "acc-project",
        config={"lr": 0.1, "batch_size": 4},
        init_kwargs={"wandb": {"name": "acc", "dir": tmp}, "mlflow": {"run_name": "acc"}},
    )
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_data(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, (x, y) in enumerate(loader, start=1):
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = accelerator.reduce(loss.detach(), "mean").item()
        losses.append((step, mean))
        accelerator.log({"train_loss": mean, "epoch": 0}, step=step)
        if step == steps:
            break
    run = accelerator.get_tracker("wandb", unwrap=True)
    tracker = accelerator.get_tracker("mlflow")
    seen = {
        "wandb_run": type(run).__name__,
        "wandb_id": run.id if accelerator.is_main_process else None,  # a blank tracker answers any attribute
        "mlflow_run": getattr(getattr(tracker, "tracker", None), "info", None) is not None,
    }
    if accelerator.is_main_process:
        with pytest.raises(ValueError, match="no started tracker has that name"):
            accelerator.get_tracker("tensorboard")
    accelerator.end_training()
    wandb.teardown()
    return {"losses": losses, "seen": seen, "rank": accelerator.process_index}


def test_the_accelerate_front_logs_to_wandb_and_mlflow_from_the_main_process_only(
    offline, tmp_path, run_ranks, monkeypatch
):
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")  # it would win over the project name, as in Accelerate
    main, other = run_ranks(_accelerate_run, 2, str(tmp_path), 3)
    assert main["losses"] == other["losses"] and len(main["losses"]) == 3
    assert main["seen"]["wandb_run"] == "Run" and main["seen"]["mlflow_run"]
    assert other["seen"] == {"wandb_run": "BlankTracker", "wandb_id": None, "mlflow_run": False}

    (run,) = _wandb_runs(tmp_path)  # one run: the other process started none
    assert (run["name"], run["project"], run["id"], run["exit"]) == ("acc", "acc-project", main["seen"]["wandb_id"], 0)
    assert [(r["_step"], r["train_loss"]) for r in run["history"]] == main["losses"]
    assert run["config"]["lr"] == 0.1 and run["config"]["batch_size"] == 4

    (mlrun,) = _mlflow_runs(offline, "acc-project")
    assert mlrun.info.run_name == "acc" and mlrun.info.status == "FINISHED"
    assert _metric(offline, mlrun.info.run_id, "train_loss") == main["losses"]
    assert _metric(offline, mlrun.info.run_id, "epoch") == [(s, 0.0) for s, _ in main["losses"]]
    assert mlrun.data.params == {"lr": "0.1", "batch_size": "4"}


# ----------------------------------------------------------------------------------------- bad input
class _Args:
    def __init__(self, report_to: Any) -> None:
        self.report_to = report_to


def test_an_unknown_tracker_and_a_missing_library_are_clear_errors(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"'wandbb', a tracker phalanx does not report to; did you mean 'wandb'"):
        reporting_callbacks(_Args(["tensorboard", "wandbb"]))
    with pytest.raises(ValueError, match=r"log_with=.*'comet_ml', a tracker phalanx does not report to"):
        Accelerator(log_with="comet_ml", cpu=True)
    assert tracker_names("none", "report_to") == tracker_names(None, "report_to") == []
    assert tracker_names(["mlflow", "jsonl", "mlflow"], "report_to") == ["mlflow"]

    # A library that is not installed: its import fails, as in an environment without the extra.
    for module in ("wandb", "mlflow", "tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"report_to includes 'mlflow', but the mlflow package is not installed "):
        reporting_callbacks(_Args("mlflow"))
    with pytest.raises(ImportError, match=r"pip install phalanx\[wandb\], or drop 'wandb' from Accelerator\(log_with"):
        Accelerator(log_with=["wandb"], cpu=True)
    with pytest.raises(ImportError, match=r"pip install phalanx\[mlflow\]"):
        make_tracker("mlflow", "project")
    assert tracker_names("all", "report_to") == [] and reporting_callbacks(_Args("all")) == []


def test_mlflow_s_environment_is_read_and_bad_tags_are_refused(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    uri = _offline(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_TAGS", "{not json")
    with pytest.raises(ValueError, match=r"MLflow tags '\{not json' \(MLFLOW_TAGS, or tags=\) are not a JSON object"):
        make_tracker("mlflow", "project")
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "phalanx"}')
    tracker = make_tracker("mlflow", "ignored: MLFLOW_EXPERIMENT_NAME wins", run_name="tags")
    tracker.start()
    tracker.log({"loss": torch.tensor(0.5), "note": "text is not a metric", "bad(name)": 2}, step=7)
    tracker.finish()
    (run,) = _mlflow_runs(uri, "trackers-test")
    assert run.data.tags["team"] == "phalanx" and run.info.status == "FINISHED"
    assert sorted(run.data.metrics) == ["bad_name_", "loss"] and _metric(uri, run.info.run_id, "loss") == [(7, 0.5)]
