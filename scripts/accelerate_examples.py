"""Accelerate's NLP examples, run twice on 2 CPU ranks, on Accelerate as written and on phalanx.accelerate with only
the imports changed, and their losses, learning rates and metrics compared. Not part of the suite.

    # the examples, from Accelerate's repository at a pinned commit, in a folder outside this one:
    git --git-dir=<accelerate.git> archive 16cb6eb80dd9aa8b4df1a63ef57863e455d53b83 examples | tar -x -C /tmp/acc
    .venv/bin/python scripts/accelerate_examples.py --examples /tmp/acc/examples
    .venv/bin/python scripts/accelerate_examples.py --examples /tmp/acc/examples nlp_example.py    # one script

The examples download bert-base-cased, GLUE MRPC and the GLUE metric, which cannot happen here. Both runs get the
same stand-ins, from modules put first on PYTHONPATH: ``datasets.load_dataset`` gives a generated MRPC-like set
(sentence pairs over a small vocabulary, labelled by their overlap; 230 training pairs, 75 for validation, so that
the last batches are short), ``evaluate.load`` an accuracy/F1 metric (with the number of predictions it saw), and
``from_pretrained("bert-base-cased")`` a tokenizer over that vocabulary and a tiny BERT made from a config with a
fixed seed (without touching the global RNG). The stand-ins record each training loss and each optimizer step's
learning rate, per rank. Accelerate runs under torchrun with ACCELERATE_USE_CPU (``accelerate launch --cpu`` starts
one process only), phalanx under ``phalanx launch -n 2``; both with ``--cpu``.

checkpointing.py runs straight through twice on each, saving every epoch and every 4 steps, and is resumed from
``epoch_0`` and from ``step_4`` (mid-epoch, through ``skip_first_batches``). A resumed run is compared with the other
front's, and with its own front's straight run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import textwrap
from pathlib import Path

from accelerate_conformance import launch_command, run_launch, swap_imports

SCRIPTS = {
    "nlp_example.py": [],
    "by_feature/gradient_accumulation.py": ["--gradient_accumulation_steps", "2"],
    "by_feature/multi_process_metrics.py": [],
    "by_feature/checkpointing.py": ["--checkpointing_steps", "epoch"],
    "by_feature/checkpointing.py@4": ["--checkpointing_steps", "4"],
}
RESUME_FROM = {"by_feature/checkpointing.py": "epoch_0", "by_feature/checkpointing.py@4": "step_4"}

STAND_INS = {
    "datasets.py": '''
        """A stand-in for Hugging Face datasets: an in-memory, generated MRPC-like set (the conformance harness)."""
        import random
        import _conformance

        class Dataset:
            def __init__(self, columns):
                self.columns = columns
            @property
            def column_names(self):
                return list(self.columns)
            def __len__(self):
                return len(next(iter(self.columns.values())))
            def __getitem__(self, i):
                return {k: v[i] for k, v in self.columns.items()}
            def map(self, fn, batched=True, remove_columns=()):
                assert batched
                out = dict(self.columns)
                out.update({k: list(v) for k, v in fn(dict(self.columns)).items()})
                return Dataset({k: v for k, v in out.items() if k not in remove_columns})
            def rename_column(self, old, new):
                return Dataset({(new if k == old else k): v for k, v in self.columns.items()})

        class DatasetDict(dict):
            def map(self, *args, **kwargs):
                return DatasetDict({k: v.map(*args, **kwargs) for k, v in self.items()})
            def rename_column(self, old, new):
                return DatasetDict({k: v.rename_column(old, new) for k, v in self.items()})

        def _split(n, rng):
            cols = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
            for i in range(n):
                a = rng.choices(_conformance.WORDS, k=rng.randint(4, 12))
                same = rng.random() < 0.5
                b = [w if (same or rng.random() < 0.3) else rng.choice(_conformance.WORDS) for w in a]
                rng.shuffle(b)
                cols["sentence1"].append(" ".join(a))
                cols["sentence2"].append(" ".join(b))
                cols["label"].append(int(same))
                cols["idx"].append(i)
            return Dataset(cols)

        def load_dataset(*args, **kwargs):
            rng = random.Random(1234)
            return DatasetDict(train=_split(230, rng), validation=_split(75, rng))
    ''',
    "evaluate.py": '''
        """A stand-in for Hugging Face evaluate: GLUE MRPC's accuracy and F1 (the conformance harness)."""
        import _conformance

        class _Metric:
            def __init__(self):
                self.predictions, self.references = [], []
            def add_batch(self, predictions, references):
                self.predictions += [int(p) for p in predictions]
                self.references += [int(r) for r in references]
            def compute(self):
                p, r = self.predictions, self.references
                self.predictions, self.references = [], []
                tp = sum(1 for a, b in zip(p, r) if a == b == 1)
                fp = sum(1 for a, b in zip(p, r) if a == 1 and b == 0)
                fn = sum(1 for a, b in zip(p, r) if a == 0 and b == 1)
                f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
                acc = sum(a == b for a, b in zip(p, r)) / len(p)
                out = {"accuracy": acc, "f1": f1, "n": len(p)}
                _conformance.record(metric=out)
                return out

        def load(*args, **kwargs):
            return _Metric()
    ''',
    "_conformance.py": '''
        """The conformance harness's stand-ins for bert-base-cased, and its records of losses and learning rates."""
        import json
        import os

        import torch
        import transformers

        WORDS = [f"w{i}" for i in range(200)]

        def record(**item):
            path = os.environ["CONFORMANCE_LOG"] + "." + os.environ.get("RANK", "0")
            with open(path, "a") as f:
                f.write(json.dumps(item) + "\\n")

        def _tokenizer(*args, **kwargs):
            words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
            vocab = {w: i for i, w in enumerate(words)}
            return transformers.BertTokenizer(vocab=vocab, do_lower_case=False, model_max_length=128)

        def _model(*args, **kwargs):
            config = transformers.BertConfig(
                vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=128, num_labels=2, initializer_range=0.3,
            )
            with torch.random.fork_rng():  # the same weights in every run, and the global RNG left alone
                torch.manual_seed(0)
                return transformers.BertForSequenceClassification(config)

        transformers.AutoTokenizer.from_pretrained = _tokenizer
        transformers.AutoModelForSequenceClassification.from_pretrained = _model

        _forward = transformers.BertForSequenceClassification.forward

        def _logged_forward(self, *args, **kwargs):
            out = _forward(self, *args, **kwargs)
            if self.training and out.loss is not None:
                record(loss=float(out.loss))
            return out

        transformers.BertForSequenceClassification.forward = _logged_forward
        _step = torch.optim.AdamW.step

        def _logged_step(self, *args, **kwargs):
            record(lr=self.param_groups[0]["lr"])
            return _step(self, *args, **kwargs)

        torch.optim.AdamW.step = _logged_step
    ''',
}


def run(script: Path, front: str, args: list[str], log: Path, stand_ins: Path, python: str, timeout: float) -> dict:
    env = {**os.environ, "CONFORMANCE_LOG": str(log), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env["ACCELERATE_USE_CPU"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(stand_ins), env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    ok, tail = run_launch([*launch_command(script, front, python), "--cpu", *args], script.parent, env, timeout)
    ranks = []
    for r in (0, 1):
        path = Path(f"{log}.{r}")
        items = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        ranks.append({
            "loss": [i["loss"] for i in items if "loss" in i],
            "lr": [i["lr"] for i in items if "lr" in i],
            "metric": [i["metric"] for i in items if "metric" in i],
        })  # fmt: skip
    return {"ok": ok, "tail": tail, "ranks": ranks}


def _differ(a: list[float], b: list[float], rtol: float = 1e-4) -> str:
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} values"
    for i, (x, y) in enumerate(zip(a, b)):
        if not math.isclose(x, y, rel_tol=rtol, abs_tol=1e-7):
            return f"first differs at #{i}: {x:.6g} vs {y:.6g}"
    worst = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    return f"same ({len(a)} values, largest difference {worst:.2g})"


def compare(name: str, theirs: dict, ours: dict) -> None:
    print(f"\n{name}: accelerate {'ran' if theirs['ok'] else 'FAILED'}, phalanx {'ran' if ours['ok'] else 'FAILED'}")
    for label, res in (("accelerate", theirs), ("phalanx", ours)):
        if not res["ok"]:
            print(textwrap.indent(res["tail"][-1500:], f"  {label}| "))
    for r in (0, 1):
        a, b = theirs["ranks"][r], ours["ranks"][r]
        print(f"  rank {r} losses: {_differ(a['loss'], b['loss'])}")
        print(f"  rank {r} lrs:    {_differ(a['lr'], b['lr'], 1e-9)}")
    for i, (ma, mb) in enumerate(zip(theirs["ranks"][0]["metric"], ours["ranks"][0]["metric"])):
        same = "same" if all(math.isclose(ma[k], mb[k], rel_tol=1e-9) for k in ma) else "DIFFERENT"
        print(f"  epoch {i} metric: accelerate {ma}  phalanx {mb}  {same}")
    if len(theirs["ranks"][0]["metric"]) != len(ours["ranks"][0]["metric"]):
        print(f"  metrics: {len(theirs['ranks'][0]['metric'])} vs {len(ours['ranks'][0]['metric'])} epochs")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scripts", nargs="*", default=list(SCRIPTS))
    p.add_argument("--examples", required=True, help="Accelerate's examples/ folder (see the docstring)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="accelerate-examples-") as tmp:
        stand_ins = Path(tmp) / "stand_ins"
        stand_ins.mkdir()
        for file, text in STAND_INS.items():
            (stand_ins / file).write_text(textwrap.dedent(text).lstrip())
        for name in args.scripts:
            file = name.split("@")[0]
            original = (Path(args.examples) / file).read_text()
            results = {}
            for front in ("accelerate", "phalanx"):
                folder = Path(tmp) / front / re.sub(r"\W", "_", name)
                folder.mkdir(parents=True)
                script = folder / Path(file).name
                script.write_text(original if front == "accelerate" else swap_imports(original))
                extra = SCRIPTS.get(name, [])
                if file.endswith("checkpointing.py"):
                    extra = [*extra, "--output_dir", str(folder / "ckpt")]
                results[front] = run(script, front, extra, folder / "log", stand_ins, args.python, args.timeout)
                point = RESUME_FROM.get(name)
                if point and results[front]["ok"]:
                    resume = ["--resume_from_checkpoint", str(folder / "ckpt" / point)]
                    log = folder / f"log-{point}"
                    results[f"{front} from {point}"] = run(
                        script, front, resume, log, stand_ins, args.python, args.timeout
                    )
            compare(name, results["accelerate"], results["phalanx"])
            for key in [k for k in results if " from " in k and k.startswith("accelerate")]:
                point = key.split(" from ")[1]
                if f"phalanx from {point}" in results:
                    compare(f"{name} resumed from {point}", results[key], results[f"phalanx from {point}"])
                for front in ("accelerate", "phalanx"):  # a resumed run against the tail of its own straight run
                    straight, resumed = results[front]["ranks"], results.get(f"{front} from {point}", {}).get("ranks")
                    for r in (0, 1) if resumed else ():
                        tail = straight[r]["loss"][len(straight[r]["loss"]) - len(resumed[r]["loss"]) :]
                        print(f"  {front} rank {r}, resumed vs its straight run: {_differ(tail, resumed[r]['loss'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
