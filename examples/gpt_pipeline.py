"""The demo's byte-level GPT, split into two pipeline stages on two ranks, trained by phalanx.Trainer.

    phalanx launch -n 2 examples/gpt_pipeline.py              # about a minute on 2 CPU cores
    phalanx launch -n 2 examples/gpt_pipeline.py --smoke      # a few seconds: the test suite's run

The model and the data are ``phalanx demo``'s (``phalanx.demo``): a small GPT over bytes, trained on the Python
standard library's own source, with the tail held out for evaluation. ``strategy="pipeline"`` splits the model's
``pipeline_blocks()`` (an ``nn.Sequential``: embedding, blocks, head) into one stage per rank, and the Trainer runs
each optimizer step through the pipeline's schedule, ``pp_microbatches`` micro-batches deep. The loss is
``compute_loss_func``'s, normalised by the true token count of the whole step.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import phalanx
from phalanx.demo import ByteChunks, GPTConfig, TinyGPT, load_stdlib_bytes


def next_byte_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean cross-entropy of every next-byte prediction in the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", default="checkpoints/gpt_pipeline")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step (split into micro-batches)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step in the pipeline's schedule")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="bytes of standard library source to load")
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="a tiny run of a few seconds (the test suite's)")
    a = p.parse_args()
    if a.smoke:
        a.steps, a.layers, a.d_model, a.max_bytes, a.logging_steps = 8, 2, 64, 100_000, 2

    data = load_stdlib_bytes(a.max_bytes)
    n_eval = len(data) // 20
    train_set, eval_set = ByteChunks(data[:-n_eval], a.block_size), ByteChunks(data[-n_eval:], a.block_size)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(block_size=a.block_size, n_layer=a.layers, n_head=4, n_embd=a.d_model)).pipeline_blocks()

    args = phalanx.TrainingArguments(
        output_dir=a.output_dir,
        strategy="pipeline",
        strategy_options={"pp_microbatches": a.microbatches},
        per_device_train_batch_size=a.batch_size,
        per_device_eval_batch_size=a.batch_size,
        max_steps=a.steps,
        learning_rate=a.lr,
        adam_beta2=0.95,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
        logging_steps=a.logging_steps,
        logging_first_step=True,
        eval_strategy="no",
        save_strategy="no",
        dataloader_drop_last=True,  # every step's batch must split into equal micro-batches
        disable_tqdm=a.smoke,
    )
    trainer = phalanx.Trainer(
        model, args, train_dataset=train_set, eval_dataset=eval_set, compute_loss_func=next_byte_loss
    )
    out = trainer.train()
    metrics = trainer.evaluate()

    engine = trainer.engine
    engine.print(
        f"TinyGPT in {engine.topology.pp_size} pipeline stages, {out.global_step} steps of {a.batch_size} "
        f"sequences x {a.block_size} bytes"
    )
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    for step, loss in losses:
        engine.print(f"step {step:4d}  loss {loss:.4f}")
    engine.print(
        f"train loss {out.training_loss:.4f}  eval loss {metrics['eval_loss']:.4f} ({len(eval_set)} held-out sequences)"
    )
    print(
        "result " + json.dumps({"rank": engine.rank, "losses": losses, "eval_loss": metrics["eval_loss"]}), flush=True
    )


if __name__ == "__main__":
    main()
