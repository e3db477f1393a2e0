"""The peers' own config files through phalanx's dialects, against what each file means in its own tool. Not part of
the suite: the files come from the peers' repositories at the commits that scripts/config_manifest.json names, and
are put in a folder outside this repository.

    .venv/bin/python scripts/config_conformance.py --extract /tmp/peer-configs   # from the fetched snapshots
    .venv/bin/python scripts/config_conformance.py /tmp/peer-configs             # check each file, print the counts
    .venv/bin/python scripts/config_conformance.py /tmp/peer-configs --draft     # what phalanx does with each file

``--extract`` reads each file from a snapshot of its repository (the ``fetch`` tool puts them under
/work/.mirror/<owner>+<name>/repo; ``--mirrors`` names another folder). transformers is too large to fetch: put its
files (``tests/deepspeed/ds_config_zero*.json`` at the named commit) under ``<folder>/huggingface+transformers/``
by hand.

An entry with ``local`` instead of ``repo``, ``commit`` and ``path`` is a file of this repository (a fixture written
from a peer's documentation where no peer repository holds such a file); it is read from here, not extracted.

Each manifest entry says what the file means in its own tool (``means``) and the outcome that is right for phalanx:
``{"maps": {setting: value, ...}}`` (the file is read, and those settings come out), or ``{"refuses": "text"}`` (a
clear error naming the feature phalanx lacks, which must contain the text). A file "mishandled" is one whose outcome
differs: an error where it should map, a value other than its tool's, or an error that does not name the feature.
The expectations were drafted by a reading of each file written apart from phalanx's dialect code (DeepSpeed's stage,
precision, offload, clipping and batch rules; Accelerate's distributed types and its fills of "auto"), and reviewed
file by file. Optimizer and scheduler blocks are resolved as engine.prepare would resolve them, with the values
Accelerate's DummyOptim / DummyScheduler or the HF Trainer fill their "auto"s with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MANIFEST = Path(__file__).with_name("config_manifest.json")
ROOT = Path(__file__).resolve().parents[1]
# The settings a manifest entry may expect.
SETTINGS = ("strategy", "precision", "offload", "grad_accum_steps", "max_grad_norm", "launch.nproc_per_node",
            "launch.nnodes", "tp_size", "dp_shard_size", "dp_replicate_size", "ep_size")  # fmt: skip
# What Accelerate's DummyOptim / DummyScheduler and the HF Trainer fill a block's "auto" values with.
AUTO = {"lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "warmup_num_steps": 10,
        "total_num_steps": 100, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3}  # fmt: skip


def _extract(entries: list[dict[str, Any]], folder: Path, mirrors: Path) -> int:
    missing = 0
    entries = [e for e in entries if "local" not in e]  # read from this repository, never extracted
    for e in entries:
        owner_name = e["repo"].replace("/", "+")
        target = folder / owner_name / e["path"]
        git_dir = mirrors / owner_name / "repo"
        if not git_dir.exists():
            print(f"no snapshot of {e['repo']} under {mirrors}: put {e['path']} at {target} by hand")
            missing += 1
            continue
        shown = subprocess.run(
            ["git", "--git-dir", str(git_dir), "show", f"{e['commit']}:{e['path']}"], capture_output=True
        )
        if shown.returncode:
            print(f"{e['repo']}@{e['commit'][:10]}:{e['path']}: {shown.stderr.decode().strip()}")
            missing += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(shown.stdout)
    print(f"{len(entries) - missing} files written under {folder}; {missing} missing")
    return 0


def _outcome(path: Path, world: int) -> tuple[str, dict[str, Any]]:
    """("maps", settings) or ("refuses", {"error": message}) for one file, as phalanx launch would read it."""
    from phalanx.config.dialects.deepspeed_blocks import describe_blocks
    from phalanx.config.options import ConfigError
    from phalanx.config.settings import resolve_config

    here = Path.cwd()
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("ACCELERATE_")}
    try:
        os.chdir(path.parent)  # Accelerate opens deepspeed_config_file from the working directory
        resolved = resolve_config(file=path, env={"WORLD_SIZE": str(world)})
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            describe_blocks(data.get("optimizer"), data.get("scheduler"), total_num_steps=100, auto_values=AUTO)
    except ConfigError as e:
        return "refuses", {"error": str(e)}
    finally:
        os.chdir(here)
        os.environ.update(saved)
    settings = {k: getattr(resolved.engine, k, None) for k in SETTINGS if not k.startswith("launch.")}
    settings.update({k: getattr(resolved.launch, k.split(".", 1)[1]) for k in SETTINGS if k.startswith("launch.")})
    return "maps", settings


def _judge(entry: dict[str, Any], kind: str, got: dict[str, Any]) -> str | None:
    """None when the outcome is right, else what is wrong."""
    expect = entry["expect"]
    if "refuses" in expect:
        if kind != "refuses":
            return f"mapped, where it should be refused naming {expect['refuses']!r}"
        if expect["refuses"].lower() not in got["error"].lower():
            return f"refused without naming {expect['refuses']!r}: {got['error']}"
        if "unknown key" not in expect["refuses"] and ("unknown key" in got["error"] or "did you mean" in got["error"]):
            return f"refused as a typo: {got['error']}"
        return None
    if kind != "maps":
        return f"refused, where it should map: {got['error']}"
    wrong = {k: (v, got.get(k)) for k, v in expect["maps"].items() if got.get(k) != v}
    return None if not wrong else "; ".join(f"{k}: expected {v!r}, got {g!r}" for k, (v, g) in wrong.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="where the peers' files are (or go, with --extract)")
    p.add_argument("--extract", action="store_true", help="write the manifest's files into the folder first")
    p.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"), help="the fetched snapshots")
    p.add_argument("--draft", action="store_true", help="print phalanx's outcome for each file instead of judging")
    args = p.parse_args()
    entries = json.loads(MANIFEST.read_text())["files"]
    if args.extract:
        return _extract(entries, args.folder, args.mirrors)
    counts = {"right": 0, "mishandled": 0, "absent": 0}
    by_kind = {"maps": 0, "refuses": 0}
    for e in entries:
        if "local" in e:
            path, name = ROOT / e["local"], f"phalanx:{e['local']}"
        else:
            path = args.folder.resolve() / e["repo"].replace("/", "+") / e["path"]
            name = f"{e['repo']}:{e['path']}"
        if not path.is_file():
            counts["absent"] += 1
            print(f"ABSENT      {name}")
            continue
        kind, got = _outcome(path, int(e.get("world", 1)))
        if args.draft:
            shown = got["error"] if kind == "refuses" else got
            print(f"{kind:8} {name}\n         {shown}")
            continue
        problem = _judge(e, kind, got)
        if problem is None:
            counts["right"] += 1
            by_kind["maps" if "maps" in e["expect"] else "refuses"] += 1
            print(f"ok          {name}")
        else:
            counts["mishandled"] += 1
            print(f"MISHANDLED  {name}\n            {problem}\n            ({e['means']})")
    if not args.draft:
        print(
            f"\n{len(entries)} files: {counts['right']} right ({by_kind['maps']} mapped as their tool means them, "
            f"{by_kind['refuses']} refused naming a feature phalanx lacks), {counts['mishandled']} mishandled, "
            f"{counts['absent']} absent"
        )
    return 1 if counts["mishandled"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.exit(main())
