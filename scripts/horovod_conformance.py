"""Horovod's own test/parallel/test_torch.py on phalanx.horovod, 2 gloo ranks, with only the import changed. Not part
of the suite: the file comes from a Horovod checkout outside this repository and is copied to a temporary folder.

    .venv/bin/python scripts/horovod_conformance.py HOROVOD_CHECKOUT          # every test, one launch each
    .venv/bin/python scripts/horovod_conformance.py HOROVOD_CHECKOUT -k allreduce

``import horovod.torch as hvd`` becomes ``import phalanx.horovod as hvd``. Each rank sees the environment that
``horovodrun --gloo`` gives it (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ...), set from the
launcher's by a small runner (run_rank.py), so the tests that check for Horovod's gloo controller run, and every test
ends in ``hvd.barrier(); hvd.shutdown()`` as it does under horovodrun. Horovod's test helpers
(test/utils/common.py) import ``horovod.runner.util.threads.in_thread`` at module level; with Horovod not installed,
a stub of that one helper is put on the path (the tests themselves do not call it). Each test runs in its own
``phalanx launch -n 2 -m pytest`` so that a hang costs that test alone. The helpers need ``cloudpickle`` and
``mock`` installed. The counts used in the docs came from Horovod's main branch at commit 2626dc87.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

STUB = """import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    t = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    t.start()
    return t
"""


RUNNER = """import os
import sys

import pytest

# What horovodrun --gloo sets for each rank, from the launcher's torchrun variables.
for ours, theirs in (("RANK", "RANK"), ("WORLD_SIZE", "SIZE"), ("LOCAL_RANK", "LOCAL_RANK"),
                     ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")):
    os.environ["HOROVOD_" + theirs] = os.environ[ours]
os.environ["HOROVOD_CROSS_RANK"] = str(int(os.environ["RANK"]) // int(os.environ["LOCAL_WORLD_SIZE"]))
os.environ["HOROVOD_CROSS_SIZE"] = str(int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]))
sys.exit(pytest.main(sys.argv[1:]))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", help="a Horovod checkout (it holds test/parallel/test_torch.py)")
    p.add_argument("-k", dest="select", help="only tests whose name contains this")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds for one test's launch")
    args = p.parse_args()
    source = Path(args.checkout) / "test"
    with tempfile.TemporaryDirectory(prefix="horovod-conformance-") as tmp:
        root = Path(tmp)
        shutil.copytree(source / "utils", root / "utils")
        (root / "parallel").mkdir()
        text = (source / "parallel" / "test_torch.py").read_text()
        text = re.sub(r"^import horovod\.torch as hvd$", "import phalanx.horovod as hvd", text, flags=re.M)
        (root / "parallel" / "test_torch.py").write_text(text)
        stub = root / "stubs" / "horovod" / "runner" / "util"
        stub.mkdir(parents=True)
        for folder in (stub.parent.parent, stub.parent, stub):
            (folder / "__init__.py").touch()
        (stub / "threads.py").write_text(STUB)
        (root / "parallel" / "run_rank.py").write_text(RUNNER)
        env = {**os.environ, "PYTHONPATH": f"{root / 'utils'}{os.pathsep}{root / 'stubs'}", "CUDA_VISIBLE_DEVICES": ""}
        env["OMP_NUM_THREADS"] = "1"
        cwd = root / "parallel"
        listed = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "test_torch.py"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
        ).stdout
        tests = [line for line in listed.splitlines() if "::" in line and (not args.select or args.select in line)]
        outcomes: dict[str, str] = {}
        for test in tests:
            cmd = [sys.executable, "-m", "phalanx", "launch", "-n", "2", "run_rank.py", "-q", "-p", "no:cacheprovider"]
            try:
                run = subprocess.run(
                    [*cmd, test], cwd=cwd, env=env, capture_output=True, text=True, timeout=args.timeout
                )
                out = run.stdout + run.stderr
                if run.returncode == 0 and "1 passed" in out:
                    outcomes[test] = "passed"
                elif run.returncode == 0 and "1 skipped" in out:
                    outcomes[test] = "skipped"
                else:
                    first = next((x for x in out.splitlines() if re.match(r"(\[rank\d\]: )?E  ", x)), "?")
                    outcomes[test] = "failed: " + first[:150]
            except subprocess.TimeoutExpired:
                outcomes[test] = "failed: timeout (a hang)"
            print(f"{test}: {outcomes[test]}", flush=True)
    counts = collections.Counter(o.split(":")[0] for o in outcomes.values())
    print(f"\n{len(outcomes)} tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
