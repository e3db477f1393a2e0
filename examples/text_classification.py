"""Seed 000's BERT sentiment classifier on phalanx.Trainer: eval and a checkpoint every epoch, best model by F1.

    phalanx launch -n 2 examples/text_classification.py            # about a minute on 2 CPU cores
    phalanx launch -n 2 examples/text_classification.py --smoke    # a few seconds: a tiny run for the test suite
    python examples/text_classification.py --hf                    # transformers' BertForSequenceClassification

No weights or data can be downloaded here, so the model is built from a config with random weights and the reviews
are generated: short hotel-review-like sentences whose label is the sentiment of their opinion words. The Trainer
part is the seed's, argument for argument (``evaluation_strategy="epoch"`` as the seed spells it).
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import phalanx

POSITIVE = ["good", "great", "clean", "friendly", "quiet", "lovely", "excellent", "comfortable", "helpful", "tasty",
            "spacious", "perfect", "pleasant", "cosy", "charming"]  # fmt: skip
NEGATIVE = ["bad", "dirty", "rude", "noisy", "awful", "terrible", "cramped", "smelly", "broken", "cold", "slow",
            "expensive", "poor", "stale", "unhelpful"]  # fmt: skip
NEUTRAL = ["the", "room", "was", "and", "staff", "hotel", "breakfast", "bed", "view", "very", "really", "our", "a",
           "stay", "location", "bathroom", "service", "food", "with", "night", "it", "quite", "lobby",
           "pool"]  # fmt: skip
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "not"]
PAD, UNK, CLS = 0, 1, 2


# ------------------------------------------------------------------------------------------ data and tokenizer
class WhitespaceTokenizer:
    """Splits on spaces and maps each word to its id; ``[CLS]`` first, as BERT's tokenizer puts it."""

    def __init__(self, words: list[str]) -> None:
        self.vocab = {w: i for i, w in enumerate(SPECIAL + sorted(set(words)))}

    def __call__(self, text: str) -> dict[str, list[int]]:
        ids = [CLS] + [self.vocab.get(w, UNK) for w in text.lower().split()]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}


def make_reviews(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` sentences of filler words around 1-3 opinions, some negated ("not clean"); the label is the sign of
    their sum, so the model has to read word order, not only count words."""
    rng = random.Random(seed)
    reviews = []
    while len(reviews) < n:
        phrases, score = [], 0
        for _ in range(rng.randint(1, 3)):
            positive = rng.random() < 0.5
            negated = rng.random() < 0.3
            word = rng.choice(POSITIVE if positive else NEGATIVE)
            phrases.append(f"not {word}" if negated else word)
            score += 1 if positive != negated else -1
        if score == 0:
            continue  # a tie has no label
        phrases += [rng.choice(NEUTRAL) for _ in range(rng.randint(3, 10))]
        rng.shuffle(phrases)
        reviews.append((" ".join(phrases), int(score > 0)))
    return reviews


class ReviewDataset(Dataset):
    """Tokenized reviews as dicts, like a tokenized ``datasets`` column: input_ids, attention_mask, label."""

    def __init__(self, reviews: list[tuple[str, int]], tokenizer: WhitespaceTokenizer) -> None:
        self.items = [{**tokenizer(text), "label": label} for text, label in reviews]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def pad_collator(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """What ``DataCollatorWithPadding`` does: pad each batch to its longest sequence, and stack the labels."""
    longest = max(len(s["input_ids"]) for s in samples)
    batch = {
        key: torch.tensor([s[key] + [PAD] * (longest - len(s[key])) for s in samples])
        for key in ("input_ids", "attention_mask")
    }
    batch["labels"] = torch.tensor([s["label"] for s in samples])
    return batch


# -------------------------------------------------------------------------------------------------- model
class TinyBertClassifier(nn.Module):
    """A BERT-shaped encoder (token + position embeddings, post-norm encoder layers) with BERT's pooler on the
    [CLS] position and a linear head. Like a transformers model, it returns ``loss`` when given ``labels``."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int = 64,
        layers: int = 2,
        heads: int = 2,
        ffn: int = 128,
        max_len: int = 64,
        num_labels: int = 2,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, hidden, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu", batch_first=True)
            for _ in range(layers)
        )
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.norm(self.tok(input_ids) + self.pos(positions))
        padding = attention_mask == 0 if attention_mask is not None else None
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=padding)
        logits = self.classifier(torch.tanh(self.pooler(x[:, 0])))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def hf_model(vocab_size: int) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=2,
        pad_token_id=PAD,
    )
    return BertForSequenceClassification(config)


# ------------------------------------------------------------------------------------------------ metrics
def compute_metrics(pred: phalanx.EvalPrediction) -> dict[str, float]:
    """Accuracy and the positive class's F1, counted by hand (the seed uses ``evaluate``'s)."""
    predicted = torch.as_tensor(pred.predictions).argmax(dim=-1)
    labels = torch.as_tensor(pred.label_ids)
    tp = int(((predicted == 1) & (labels == 1)).sum())
    fp = int(((predicted == 1) & (labels == 0)).sum())
    fn = int(((predicted == 0) & (labels == 1)).sum())
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return {"accuracy": float((predicted == labels).float().mean()), "f1": f1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", default="checkpoints/text_classification")
    p.add_argument("--train-size", type=int, default=4000)
    p.add_argument("--eval-size", type=int, default=400)
    p.add_argument("--epochs", type=float, default=5)
    p.add_argument("--lr", type=float, default=1e-3, help="higher than the seed's 2e-5: these weights start random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf", action="store_true", help="use transformers' BertForSequenceClassification")
    p.add_argument("--smoke", action="store_true", help="a tiny run of a few seconds (the test suite's)")
    a = p.parse_args()
    if a.smoke:
        a.train_size, a.eval_size, a.epochs = 192, 64, 2

    reviews = make_reviews(a.train_size + a.eval_size, a.seed)  # the same on every rank: generated from the seed
    tokenizer = WhitespaceTokenizer(POSITIVE + NEGATIVE + NEUTRAL)
    train_set = ReviewDataset(reviews[: a.train_size], tokenizer)
    eval_set = ReviewDataset(reviews[a.train_size :], tokenizer)
    torch.manual_seed(a.seed)
    model = hf_model(len(tokenizer.vocab)) if a.hf else TinyBertClassifier(len(tokenizer.vocab))

    args = phalanx.TrainingArguments(
        output_dir=a.output_dir,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        logging_steps=10,
        evaluation_strategy="epoch",  # as seed 000 spells it (eval_strategy today): a FutureWarning, then the same
        save_strategy="epoch",
        save_total_limit=3,
        learning_rate=a.lr,
        weight_decay=0.01,
        num_train_epochs=a.epochs,
        metric_for_best_model="f1",
        load_best_model_at_end=True,
        disable_tqdm=a.smoke,
        seed=a.seed,
    )
    trainer = phalanx.Trainer(
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=pad_collator,
        compute_metrics=compute_metrics,
    )
    out = trainer.train()
    per_epoch = [h for h in trainer.state.log_history if "eval_f1" in h]
    final = trainer.evaluate()  # of the best epoch's weights, loaded again at the end (load_best_model_at_end)

    engine = trainer.engine
    engine.print(f"train loss {out.training_loss:.4f} over {out.global_step} steps")
    for h in per_epoch:
        engine.print(
            f"epoch {h['epoch']:.0f}: eval_loss {h['eval_loss']:.4f}  accuracy {h['eval_accuracy']:.4f}  "
            f"f1 {h['eval_f1']:.4f}"
        )
    engine.print(f"best checkpoint {trainer.state.best_model_checkpoint} (f1 {trainer.state.best_metric:.4f})")
    engine.print(
        "final eval "
        + json.dumps({k: round(v, 6) for k, v in final.items() if k in ("eval_loss", "eval_accuracy", "eval_f1")})
    )
    record = {
        "rank": engine.rank,
        "steps": out.global_step,
        "train_loss": out.training_loss,
        "epoch_f1": [h["eval_f1"] for h in per_epoch],
        "best_metric": trainer.state.best_metric,
        **final,
    }
    print("result " + json.dumps(record), flush=True)  # every rank: the test checks that they agree


if __name__ == "__main__":
    main()
