"""Seed 000's BERT sentiment script (tests/data/blog/bert_sentiment.py: the blog's code, the import changed) trains
under ddp and under zero3 on 2 ranks through ``phalanx launch``, and ends on the weights of one process that trains
on the same global batch (the script run with per_device_train_batch_size=128 in place of 2 ranks x 64).

The test writes what the blog downloads: ``./model``, a tiny BERT (dropout off) and its tokenizer saved with
save_pretrained, which the script loads with from_pretrained as the blog does; and ``./ChnSentiCorp_htl_all.csv``,
284 short hotel reviews and one empty row (the blog's ``dropna`` drops it).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pandas", reason="the blog's script reads its CSV with pandas (the test extra installs it)")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "data" / "blog" / "bert_sentiment.py"
GOOD = ["干净", "方便", "舒适", "热情", "安静", "不错", "满意", "推荐"]
BAD = ["很脏", "吵闹", "失望", "破旧", "冷漠", "潮湿", "很差", "难吃"]
FILLER = ["酒店", "房间", "服务", "早餐", "位置", "前台", "我们", "这次", "还是", "比较", "非常", "的", "了"]


def _reference(where: str) -> None:
    """The 1-process reference: the script itself, its batch of 64 per device doubled to the 2 ranks' global batch.
    It runs in one process forked from the tests' forkserver, which has torch and transformers imported already (a
    fresh interpreter spends about 10 s of CPU importing them)."""
    import runpy

    import phalanx

    os.chdir(where)
    made = phalanx.TrainingArguments
    phalanx.TrainingArguments = lambda **kw: made(**{**kw, "per_device_train_batch_size": 128})
    runpy.run_path(str(SCRIPT), run_name="__main__")


def _write_inputs(where: Path) -> None:
    chars = sorted({c for w in GOOD + BAD + FILLER for c in w})
    vocab = where / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars]) + "\n", encoding="utf-8")
    tokenizer = transformers.BertTokenizer(vocab_file=str(vocab))
    tokenizer.save_pretrained(where / "model")
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(where / "model")
    rng = random.Random(0)
    rows = ["label,review"]
    for _ in range(284):
        label = rng.random() < 0.5
        words = [rng.choice(FILLER) for _ in range(rng.randint(2, 6))]
        words.insert(rng.randint(0, len(words)), rng.choice(GOOD if label else BAD))
        rows.append(f"{int(label)},{''.join(words)}")
    rows.insert(100, "1,")  # a review that is missing: dropna() drops it
    (where / "ChnSentiCorp_htl_all.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")


def _inputs(where: Path, inputs: Path) -> Path:
    where.mkdir()
    for name in ("model", "ChnSentiCorp_htl_all.csv"):
        os.symlink(inputs / name, where / name)
    return where


def _run(where: Path, inputs: Path, *command: str) -> dict:
    env = {**os.environ, "PHALANX_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, *command],
        cwd=_inputs(where, inputs),
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _ended_on(where)


def _ended_on(where: Path) -> dict:
    # load_best_model_at_end: the run ends on the best checkpoint's weights, which its model.safetensors holds
    last = max(where.glob("checkpoints/checkpoint-*"), key=lambda p: int(p.name.rpartition("-")[2]))
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["global_step"] == 6, state["global_step"]  # 3 epochs of 256 reviews in global batches of 128
    best = where / state["best_model_checkpoint"]
    return {
        "best": best.name,
        "at_best": load_file(best / "model.safetensors"),
        "at_end": load_file(last / "model.safetensors"),
    }


def test_the_blogs_bert_script_trains_the_same_weights_on_two_ranks(tmp_path, run_ranks):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    _write_inputs(inputs)
    start = load_file(inputs / "model" / "model.safetensors")
    run_ranks(_reference, 1, str(_inputs(tmp_path / "one", inputs)), timeout=240)
    one = _ended_on(tmp_path / "one")
    for strategy in ("ddp", "zero3"):
        two = _run(
            tmp_path / strategy, inputs, "-m", "phalanx", "launch", "-n", "2", "--strategy", strategy, str(SCRIPT)
        )
        assert two["best"] == one["best"], strategy
        for when in ("at_best", "at_end"):  # the weights the run ends on, and those of its last step
            moved = max(float((one[when][k] - start[k]).abs().max()) for k in start)
            for k in start:
                gap = float((two[when][k] - one[when][k]).abs().max())
                # within 1e-5, and far inside what training moved the weights (about 2e-5 per Adam step)
                assert gap <= 1e-5 and gap <= 0.01 * moved, (strategy, when, k, gap, moved)
