"""transformers' own Trainer tests, run twice: as transformers wrote them, and with the Trainer's names imported from
phalanx. Not part of the suite: the upstream files stay outside this repository.

    .venv/bin/python scripts/hf_trainer_conformance.py /work/hf-trainer-tests            # both runs, then the counts
    .venv/bin/python scripts/hf_trainer_conformance.py /work/hf-trainer-tests -k resume  # a selection (pytest -k)

The folder holds transformers' ``tests/trainer/`` files (``tests/trainer/test_trainer*.py`` and their helpers) from
one pinned commit; ``SOURCE.md`` there says which. The second run changes only the imports: every ``from transformers
... import`` of ``Trainer, TrainingArguments, TrainerCallback, EarlyStoppingCallback, TrainerState, TrainerControl``
or ``EvalPrediction`` (at the top of a file or inside a function) is followed by the same names from phalanx.

The files used for the counts in docs/trainer.md (transformers 5.24 installed; no single commit holds them all at
a 5.x version, so each is the latest reachable version that imports on 5.24), each from
``https://raw.githubusercontent.com/huggingface/transformers/<commit>/tests/trainer/<file>``:

    trainer_test_utils.py           fef6f3591b8998bd9ddd80b793b25e0c861ca3c7
    test_trainer_checkpointing.py   abee4b14abf32637fe72990d0c409eaba189b31a
    test_trainer_data.py            003432ac431659ea2564483634f35e4a2ee4c391
    test_trainer_optimizers.py      0d7e95d96b4e187c651e2b2406ed98ed40d74963
    test_trainer_callback.py        020a37d2264e60dc7beb9634c3e87ad870073e2c
    test_trainer_evaluation.py      0941546be77e98e3382d8467bbd98f892cfeda3d  (does not import on 5.24: GlueDataset)

with empty ``tests/__init__.py`` and ``tests/trainer/__init__.py``, and ``parameterized`` installed.

A test counts when it passes as transformers wrote it and builds one of those objects (the first run records which
tests do); the script prints how many of those pass with phalanx's names, and each failure's first line, grouped.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

SWAPPED = (
    "Trainer",
    "TrainingArguments",
    "TrainerCallback",
    "EarlyStoppingCallback",
    "TrainerState",
    "TrainerControl",
    "EvalPrediction",
)
FILES = (
    "test_trainer.py",
    "test_trainer_checkpointing.py",
    "test_trainer_evaluation.py",
    "test_trainer_data.py",
    "test_trainer_optimizers.py",
    "test_trainer_callback.py",
)

# Written into the first run's copy: records which tests build one of the swapped objects.
RECORDER = """
import json, os
import pytest
import transformers

_BUILT = set()
_CURRENT = [None]
_NAMES = {names!r}


def _wrap(cls):
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        if _CURRENT[0] is not None:
            _BUILT.add(_CURRENT[0])
        init(self, *args, **kwargs)

    cls.__init__ = __init__


for _name in _NAMES:
    _wrap(getattr(transformers, _name))


@pytest.fixture(autouse=True)
def _record_test(request):
    _CURRENT[0] = request.node.nodeid
    yield
    _CURRENT[0] = None


def pytest_sessionfinish(session):
    with open(os.environ["CONFORMANCE_BUILT"], "w") as f:
        json.dump(sorted(_BUILT), f)
"""


def swap_imports(source: str) -> str:
    """``source`` with ``from phalanx import ...`` after each transformers import of a swapped name."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    inserts: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers" and not node.level:
            names = [a for a in node.names if a.name in SWAPPED]
            if names:
                indent = lines[node.lineno - 1][: node.col_offset]
                spelled = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in names)
                inserts.append((node.end_lineno or node.lineno, f"{indent}from phalanx import {spelled}\n"))
    for line, text in sorted(inserts, reverse=True):
        lines.insert(line, text)
    return "".join(lines)


def run(copy: Path, files: list[str], select: str | None, built: Path | None, python: str) -> dict[str, str]:
    """pytest over ``files`` in ``copy``: each test id's outcome (passed, failed, error, skipped) and message."""
    report = copy / "report.xml"
    args = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "600", f"--junitxml={report}"]
    args.append("--continue-on-collection-errors")  # a file too old or too new for the installed transformers
    args += ["-k", select] if select else []
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if built is not None:
        env["CONFORMANCE_BUILT"] = str(built)
    subprocess.run([*args, *files], cwd=copy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    modules = sorted((f[: -len(".py")].replace("/", ".") for f in files), key=len, reverse=True)
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        classname = case.get("classname", "")
        module = next((m for m in modules if classname == m or classname.startswith(m + ".")), classname)
        inner = classname[len(module) + 1 :].replace(".", "::")
        test_id = "::".join(x for x in (module.replace(".", "/") + ".py", inner, case.get("name", "")) if x)
        failure = case.find("failure")
        error = case.find("error")
        skipped = case.find("skipped")
        if failure is not None or error is not None:
            bad = failure if failure is not None else error
            message = (bad.get("message") or (bad.text or "")).strip().splitlines()
            outcomes[test_id] = "failed: " + (message[0][:200] if message else "?")
        elif skipped is not None:
            outcomes[test_id] = "skipped"
        else:
            outcomes[test_id] = "passed"
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the folder that holds transformers' tests/trainer files")
    parser.add_argument("-k", dest="select", help="a pytest -k selection")
    parser.add_argument("--python", default=sys.executable, help="the Python that has transformers and phalanx")
    args = parser.parse_args()
    upstream = Path(args.folder) / "tests" / "trainer"
    files = [f"tests/trainer/{f}" for f in FILES if (upstream / f).exists()]
    if not files:
        parser.error(f"{upstream} holds none of {', '.join(FILES)}")
    with tempfile.TemporaryDirectory(prefix="hf-conformance-") as tmp:
        results = {}
        for name in ("transformers", "phalanx"):
            copy = Path(tmp) / name
            shutil.copytree(Path(args.folder), copy, ignore=shutil.ignore_patterns("*.xml", "*.log", "__pycache__"))
            built = None
            if name == "transformers":
                built = Path(tmp) / "built.json"
                conftest = copy / "tests" / "trainer" / "conftest.py"
                previous = conftest.read_text() if conftest.exists() else ""
                conftest.write_text(previous + RECORDER.format(names=SWAPPED))
            else:
                for path in copy.rglob("*.py"):
                    path.write_text(swap_imports(path.read_text()))
            print(f"running transformers' Trainer tests with the names from {name} ...", flush=True)
            results[name] = run(copy, files, args.select, built, args.python)
        builders = set(json.loads((Path(tmp) / "built.json").read_text()))
    hf, ours = results["transformers"], results["phalanx"]
    applicable = sorted(t for t, outcome in hf.items() if outcome == "passed" and t in builders)
    passed = [t for t in applicable if ours.get(t) == "passed"]
    print(f"\ntransformers: {sum(o == 'passed' for o in hf.values())} of {len(hf)} tests pass as written")
    print(f"applicable (they pass on transformers and build one of {', '.join(SWAPPED)}): {len(applicable)}")
    print(f"phalanx: {len(passed)} of the {len(applicable)} pass with the names imported from phalanx\n")
    reasons = collections.Counter(ours.get(t, "missing") for t in applicable if t not in passed)
    for reason, count in reasons.most_common():
        print(f"{count:4d}  {reason}")
    for t in applicable:
        if t not in passed:
            print(f"  {t}: {ours.get(t, 'missing')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
