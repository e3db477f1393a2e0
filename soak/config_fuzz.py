"""Fuzz the configuration front door: generated configs, valid and invalid, through every source at once.

    .venv/bin/python soak/config_fuzz.py --cases 1000 --seed 0

Each case mixes a phalanx YAML file (with a ``launch:`` section), an Accelerate YAML file or a DeepSpeed JSON file,
``PHALANX_*`` environment variables and command-line flags (ours, torchrun's and Accelerate's spellings), with values
drawn from each setting's declaration, and about half the cases carry one bad value (a wrong type, out of range, a
choice that does not exist, a misspelt key). Every case goes through ``phalanx config``, which resolves exactly what
``phalanx launch`` would start. Outcomes:

- ran: exit code 0;
- clear error: exit code 2 with one message that names the bad key or value (the case knows which it injected);
- unclear: exit code 2, but the message names neither;
- traceback: anything else (an exception escaped). The goal is 0 tracebacks and 0 unclear errors.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from phalanx.config.settings import engine_fields
from phalanx.launch import cli

BAD_TEXT = ["banana", "-3", "1e999", "", "[1, 2]", "0x10", "true", "None", "ddp;rm -rf /", "é"]
ACCELERATE_TYPES = ["NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA", "TPU"]


def good_value(rng: random.Random, name: str, typ: Any, choices: Any) -> Any:
    if choices:
        return rng.choice([c for c in choices if c is not None])
    special = {
        "strategy": ["ddp", "zero1", "zero2", "zero3", "pipeline"], "precision": ["fp32", "bf16-mixed", "fp16-mixed"],
        "pp_partition": ["parameters", "uniform", "time", "2,4"], "zero3_unit_classes": ["Linear", "Block,Embedding"],
    }  # fmt: skip
    if name in special:
        return rng.choice(special[name])
    text = str(typ)
    if "bool" in text:
        return rng.choice([True, False])
    if "int" in text:
        return rng.randint(1, 8)
    if "float" in text:
        return round(rng.uniform(0.5, 100.0), 2)
    return f"/tmp/fuzz-{rng.randint(0, 99)}"


def bad_value(rng: random.Random, name: str, typ: Any, choices: Any) -> Any:
    text = str(typ)
    if "int" in text or "float" in text:
        return rng.choice(
            [-rng.randint(1, 5), "banana", 0 if name != "seed" else "x", "1e999" if "int" in text else "abc"]
        )
    if "bool" in text:
        return rng.choice(["maybe", "2", "yes please"])
    if choices or name in ("strategy", "precision"):
        return rng.choice(["zero4", "fp8", "bogus", "DDP ", "none-at-all"])
    return None  # free text: nothing is invalid


def make_case(rng: random.Random, tmp: Path, i: int) -> dict[str, Any]:
    fields = [(f.name, f.type, f.metadata.get("choices")) for _, f in engine_fields()]
    fields = [f for f in fields if f[0] not in ("deepspeed", "device", "resume_from", "offload_dir")]
    picked = rng.sample(fields, rng.randint(0, 5))
    values = {name: good_value(rng, name, typ, ch) for name, typ, ch in picked}
    bad: tuple[str, Any] | None = None
    if rng.random() < 0.5:
        name, typ, ch = rng.choice(fields)
        if rng.random() < 0.15:
            name = name[:-1] + ("x" if name[-1] != "x" else "y")  # a misspelt key
            bad = (name, 1)
        else:
            value = bad_value(rng, name, typ, ch)
            if value is not None:
                bad = (name, value)
        if bad:
            values[bad[0]] = bad[1]
    case: dict[str, Any] = {"argv": ["config"], "env": {}, "bad": bad, "values": values}
    launch: dict[str, Any] = {}
    if rng.random() < 0.4:
        launch["nproc_per_node"] = rng.choice([1, 2, 4, 0, -1, "two"]) if rng.random() < 0.2 else rng.choice([1, 2, 4])
    if rng.random() < 0.1:
        launch["nnodes"] = rng.choice(["1:2", "2", "3:1", "a:b"])
        launch["rdzv_endpoint"] = rng.choice(["127.0.0.1:29500", None])
    for name, value in values.items():
        where = rng.choice(["yaml", "env", "flag"])
        if where == "yaml":
            case.setdefault("yaml", {})[name] = value
        elif where == "env":
            case["env"][f"PHALANX_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        else:
            flag = "--" + name.replace("_", "-") if rng.random() < 0.7 else "--" + name
            case["argv"] += [flag, str(value)]
    if launch:
        case.setdefault("yaml", {})["launch"] = {k: v for k, v in launch.items() if v is not None}
    dialect = rng.random()
    if dialect < 0.15:
        acc = {
            "compute_environment": "LOCAL_MACHINE",
            "distributed_type": rng.choice(ACCELERATE_TYPES),
            "num_processes": rng.choice([1, 2, 3, 4]),
            "mixed_precision": rng.choice(["no", "bf16", "fp16", "fp8"]),
            "num_machines": rng.choice([1, 2]),
            "machine_rank": 0,
        }
        if rng.random() < 0.3:
            acc["deepspeed_config"] = {
                "zero_stage": rng.choice([0, 1, 2, 3, 4]),
                "gradient_accumulation_steps": rng.choice([1, 2, "x"]),
            }
        path = tmp / f"acc{i}.yaml"
        path.write_text(yaml.safe_dump(acc))
        case["argv"] += ["--config_file" if rng.random() < 0.5 else "--config", str(path)]
        case.pop("yaml", None)
    elif dialect < 0.3:
        ds = {
            "train_micro_batch_size_per_gpu": rng.choice([1, 4, "auto", 0]),
            "gradient_accumulation_steps": rng.choice([1, 2, "auto"]),
            "zero_optimization": {
                "stage": rng.choice([0, 1, 2, 3, 5]),
                "offload_optimizer": {"device": rng.choice(["cpu", "nvme", "none", "gpu"])},
            },
            "bf16": {"enabled": rng.choice([True, False, "auto"])},
            "gradient_clipping": rng.choice([1.0, "auto", -1]),
        }
        if rng.random() < 0.3:
            ds["optimizer"] = {
                "type": rng.choice(["AdamW", "SGD", "Lamb", "Nope"]),
                "params": {"lr": rng.choice([1e-3, "auto", "fast"])},
            }
        path = tmp / f"ds{i}.json"
        path.write_text(json.dumps(ds))
        case["argv"] += ["--deepspeed", str(path)]
    if "yaml" in case:
        path = tmp / f"phalanx{i}.yaml"
        path.write_text(yaml.safe_dump(case["yaml"]))
        case["argv"] += ["--config", str(path)]
    return case


def run_case(case: dict[str, Any]) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in case["env"]}
    os.environ.update(case["env"])
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(case["argv"])
    except SystemExit as e:  # argparse on a malformed flag: usage and exit code 2, no traceback
        rc = e.code if isinstance(e.code, int) else 2
    except Exception:  # noqa: BLE001 - that is the finding
        return "traceback", traceback.format_exc()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    message = err.getvalue()
    if rc == 0:
        return "ran", ""
    if rc == 2 and message.strip():
        bad = case["bad"]
        if bad is None or bad[0] in message or bad[0].replace("_", "-") in message or str(bad[1]) in message:
            return "clear error", message
        return "other error", message  # another value of the case was refused (a rule between settings)
    return "traceback", f"exit code {rc}: {message}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=3, help="print this many examples of each outcome")
    args = p.parse_args()
    rng = random.Random(args.seed)
    counts: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.cases):
            case = make_case(rng, Path(tmp), i)
            outcome, text = run_case(case)
            counts[outcome] += 1
            if len(examples.setdefault(outcome, [])) < args.show:
                examples[outcome].append(
                    f"argv={case['argv'][1:]} env={case['env']} bad={case['bad']}\n    {text.strip()[-600:]}"
                )
    for outcome in ("ran", "clear error", "other error", "traceback"):
        print(f"{outcome:12} {counts[outcome]:5}")
        for ex in examples.get(outcome, []) if outcome != "ran" else []:
            print("   ", ex.replace("\n", "\n    "))
    return 1 if counts["traceback"] else 0


if __name__ == "__main__":
    sys.exit(main())
