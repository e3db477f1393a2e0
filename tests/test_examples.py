"""The examples in examples/, each run in its short mode (--smoke) on 2 ranks through ``phalanx launch``, as a user
runs them. Each example prints one ``result {json}`` line per rank; the tests read those lines and the files the
run wrote."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _launch(script: str, cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    env = {**os.environ, "PHALANX_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", "-n", "2", str(EXAMPLES / script), "--smoke", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Both ranks write to the one stdout, so a rank's line may land in the middle of the other's: decode each
    # "result {...}" wherever it starts.
    decoder, results = json.JSONDecoder(), []
    for piece in proc.stdout.split("result {")[1:]:
        results.append(decoder.raw_decode("{" + piece)[0])
    results.sort(key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], proc.stdout[-4000:]
    return proc, results


def test_text_classification_keeps_the_best_f1_checkpoint(tmp_path):
    out = tmp_path / "out"
    proc, (rank0, rank1) = _launch("text_classification.py", tmp_path, "--output-dir", str(out))
    for key in ("eval_accuracy", "eval_f1", "eval_loss", "best_metric", "epoch_f1", "train_loss"):
        assert rank0[key] == rank1[key], key  # every rank evaluated the same gathered predictions
    assert 0.0 <= rank0["eval_accuracy"] <= 1.0 and 0.0 <= rank0["eval_f1"] <= 1.0
    assert math.isfinite(rank0["eval_loss"]) and rank0["eval_loss"] > 0 and math.isfinite(rank0["train_loss"])
    # eval_strategy="epoch" over 2 epochs of 6 steps (16 reviews x 2 ranks per step, 192 reviews); loading the best
    # checkpoint at the end must not rewind the run's step count or its log.
    assert len(rank0["epoch_f1"]) == 2 and rank0["steps"] == 12
    # load_best_model_at_end: the final evaluation is the best epoch's, picked by F1.
    assert rank0["best_metric"] == max(rank0["epoch_f1"])
    assert rank0["eval_f1"] == pytest.approx(rank0["best_metric"], abs=1e-6)
    # save_strategy="epoch": a checkpoint per epoch, each with HF's trainer_state.json.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]
    state = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["global_step"] == 12 and state["best_metric"] == rank0["best_metric"]
    assert (out / state["best_model_checkpoint"]).is_dir()
    assert proc.stdout.count("final eval {") == 1  # the summary comes from rank 0 only
    final = json.loads(proc.stdout.split("final eval ", 1)[1].splitlines()[0])
    assert final["eval_f1"] == pytest.approx(rank0["eval_f1"], abs=1e-6)


def test_image_classification_engine_loop(tmp_path):
    proc, (rank0, rank1) = _launch("image_classification.py", tmp_path)
    assert rank0["history"] == rank1["history"]  # losses and accuracies are reduced or gathered over the ranks
    assert rank0["checksum"] == pytest.approx(rank1["checksum"], rel=0, abs=1e-9)  # one set of weights
    first, last = rank0["history"][0], rank0["history"][-1]
    # 100 held-out images in batches of 64 per rank: gather_for_metrics drops the padding of the short last batch.
    assert [h["eval_samples"] for h in rank0["history"]] == [100, 100]
    assert all(0.0 <= h["train_acc"] <= 1.0 and 0.0 <= h["eval_acc"] <= 1.0 for h in rank0["history"])
    assert last["train_loss"] < first["train_loss"]
    assert proc.stdout.count("Epoch [2/2]") == 1


def test_gpt_pipeline_trains_through_two_stages(tmp_path):
    proc, (rank0, rank1) = _launch("gpt_pipeline.py", tmp_path, "--output-dir", str(tmp_path / "out"))
    assert rank0["losses"] == rank1["losses"]  # the last stage's loss reaches the first stage too
    steps = [step for step, _ in rank0["losses"]]
    losses = [loss for _, loss in rank0["losses"]]
    assert steps == [1, 2, 4, 6, 8]  # logging_first_step, then every 2 optimizer steps
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # an untrained model guesses bytes uniformly
    assert losses[-1] < losses[0] - 0.3
    assert rank0["eval_loss"] == rank1["eval_loss"] and rank0["eval_loss"] < losses[0]
    assert "TinyGPT in 2 pipeline stages" in proc.stdout
