"""Horovod's own test/parallel/test_torch.py on phalanx.horovod, 2 gloo ranks, with only the import changed. Not part
of the suite: the file comes from a Horovod checkout outside this repository and is copied to a temporary folder.

    .venv/bin/python scripts/horovod_conformance.py HOROVOD_CHECKOUT          # every test, one launch each
    .venv/bin/python scripts/horovod_conformance.py HOROVOD_CHECKOUT -k allreduce
    .venv/bin/python scripts/horovod_conformance.py HOROVOD_CHECKOUT --examples   # Horovod's 4 PyTorch examples

``import horovod.torch as hvd`` becomes ``import phalanx.horovod as hvd``. Each rank sees the environment that
``horovodrun --gloo`` gives it (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ...), set from the
launcher's by a small runner (run_rank.py), so the tests that check for Horovod's gloo controller run, and every test
ends in ``hvd.barrier(); hvd.shutdown()`` as it does under horovodrun. Horovod's test helpers
(test/utils/common.py) import ``horovod.runner.util.threads.in_thread`` at module level; with Horovod not installed,
a stub of that one helper is put on the path (the tests themselves do not call it). Each test runs in its own
``phalanx launch -n 2 run_rank.py`` (pytest underneath) so that a hang costs that test alone. The helpers need
``cloudpickle`` and ``mock`` installed. The counts used in the docs came from Horovod's main branch at commit
2626dc87: 102 of 115 pass; 10 skip (a GPU, MPI, or skipped upstream) and 3 build torch 2.13's Muon on 1-D biases.

``--examples`` runs examples/pytorch/pytorch_synthetic_benchmark.py (also with ``--use-adasum``), pytorch_mnist.py,
pytorch_imagenet_resnet50.py and examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py on 2 ranks, with
``import horovod.torch as hvd`` (and mnist's ``import horovod``) swapped, small stand-ins for torchvision's models,
datasets and transforms when torchvision is not installed (and a silent SummaryWriter without tensorboard). The
elastic one runs under ``--max-restarts 1`` and rank 1 is killed at its 5th commit. Each run must end with every
rank's parameters equal (and the elastic one after one restart).
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


# Stand-ins for torchvision when it is not installed: a small CNN for every model name, generated images for the
# datasets, and the few transforms the examples use, on tensors.
TORCHVISION = {
    "__init__.py": "from . import datasets, models, transforms\n",
    "models.py": """import torch.nn as nn


def _small(num_classes=1000, **kwargs):
    return nn.Sequential(nn.Conv2d(3, 8, 5, stride=4), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, num_classes))


def __getattr__(name):
    return _small
""",
    "datasets.py": """import torch


class _Generated(torch.utils.data.Dataset):
    def __init__(self, n, shape, classes, seed, transform):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.rand(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)
        self.transform = transform

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        return (self.transform(x) if self.transform else x), int(self.y[i])


def MNIST(root, train=True, download=False, transform=None):
    return _Generated(256 if train else 128, (1, 28, 28), 10, 0 if train else 1, transform)


def ImageFolder(root, transform=None):
    return _Generated(64, (3, 72, 72), 10, len(str(root)), transform)


def FakeData(size=64, image_size=(3, 72, 72), num_classes=10, transform=None, **kwargs):
    return _Generated(size, image_size, num_classes, 2, transform)
""",
    "transforms.py": """import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, steps):
        self.steps = steps

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


def _resize(size):
    return lambda x: F.interpolate(x[None], size=(size, size), mode="bilinear", align_corners=False)[0]


def ToTensor():
    return lambda x: x


def Normalize(mean, std):
    return lambda x: (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


RandomResizedCrop = Resize = _resize


def CenterCrop(size):
    def crop(x):
        top, left = (x.shape[1] - size) // 2, (x.shape[2] - size) // 2
        return x[:, top:top + size, left:left + size]
    return crop


def RandomHorizontalFlip():
    return lambda x: x
""",
}

RUN_EXAMPLE = """import os
import runpy
import sys
import types

import torch

try:
    import torchvision  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand-ins"))
try:
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401
except ImportError:  # no tensorboard: a writer that writes nothing
    stub = types.ModuleType("torch.utils.tensorboard")
    stub.SummaryWriter = type("SummaryWriter", (), {"__init__": lambda self, *a, **k: None,
                                                    "__getattr__": lambda self, name: lambda *a, **k: None})
    sys.modules["torch.utils.tensorboard"] = stub

import phalanx.horovod as hvd

optimizers = []
_wrap = hvd.DistributedOptimizer


def _recording(*args, **kwargs):
    optimizers.append(_wrap(*args, **kwargs))
    return optimizers[-1]


hvd.DistributedOptimizer = _recording
kill_at = int(os.environ.get("HVD_EXAMPLE_KILL_AT_COMMIT", "0"))
if kill_at and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
    _commit, commits = hvd.elastic.State.commit, []

    def _dying_commit(self):
        _commit(self)
        commits.append(1)
        if len(commits) == kill_at:
            os._exit(3)

    hvd.elastic.State.commit = _dying_commit
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
for opt in optimizers:
    w = torch.cat([p.detach().reshape(-1).double() for g in opt.param_groups for p in g["params"]])
    print(f"example-final rank {hvd.rank()} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')} "
          f"params {w.sum().item():.10f} {w.square().sum().item():.10f}", flush=True)
"""

EXAMPLES = [
    ("synthetic", "pytorch/pytorch_synthetic_benchmark.py", [], "--model resnet50 --batch-size 4 "
     "--num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 2"),
    ("synthetic --use-adasum", "pytorch/pytorch_synthetic_benchmark.py", [], "--model resnet50 --batch-size 4 "
     "--num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 2 --use-adasum"),
    ("mnist", "pytorch/pytorch_mnist.py", [], "--epochs 1 --batch-size 32 --test-batch-size 64 --data-dir data"),
    ("imagenet resnet50", "pytorch/pytorch_imagenet_resnet50.py", [], "--epochs 1 --batch-size 8 --val-batch-size 8 "
     "--warmup-epochs 1 --train-dir train --val-dir val --log-dir logs --checkpoint-format ckpt-{epoch}.pth.tar"),
    ("synthetic elastic, rank 1 lost at its 5th commit", "elastic/pytorch/pytorch_synthetic_benchmark_elastic.py",
     ["--max-restarts", "1"], "--model resnet50 --batch-size 4 --num-warmup-batches 2 --num-batches-per-iter 2 "
     "--num-iters 3"),
]  # fmt: skip


def run_examples(checkout: Path, timeout: float) -> int:
    """Horovod's PyTorch examples, only the import changed, on 2 ranks; each must end with identical replicas."""
    failed = 0
    with tempfile.TemporaryDirectory(prefix="horovod-examples-") as tmp:
        root = Path(tmp)
        (root / "stand-ins" / "torchvision").mkdir(parents=True)
        for name, text in TORCHVISION.items():
            (root / "stand-ins" / "torchvision" / name).write_text(text)
        (root / "run_example.py").write_text(RUN_EXAMPLE)
        for label, path, launch_args, args in EXAMPLES:
            text = (checkout / "examples" / path).read_text()
            text = re.sub(r"^import horovod\.torch as hvd$", "import phalanx.horovod as hvd", text, flags=re.M)
            text = re.sub(r"^import horovod$", "import phalanx.horovod as horovod", text, flags=re.M)
            script = root / Path(path).name
            script.write_text(text)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
            if "elastic" in path:
                env["HVD_EXAMPLE_KILL_AT_COMMIT"] = "5"
            cmd = [sys.executable, "-m", "phalanx", "launch", "-n", "2", *launch_args, "run_example.py", str(script)]
            try:
                run = subprocess.run([*cmd, *args.split()], cwd=root, env=env, capture_output=True, text=True,
                                     timeout=timeout)  # fmt: skip
                finals = re.findall(r"example-final rank (\d) restart (\d+) params (\S+ \S+)", run.stdout)
                ranks = {r: p for r, _, p in finals}
                restarts = sorted({x for _, x, _ in finals})
                ok = run.returncode == 0 and sorted(ranks) == ["0", "1"] and len(set(ranks.values())) == 1
                if "elastic" in path:
                    ok = ok and restarts == ["1"]
                verdict = f"ok (identical replicas, restarts {restarts})" if ok else "FAILED"
                if not ok:
                    failed += 1
                    verdict += "\n" + (run.stdout + run.stderr)[-2500:]
            except subprocess.TimeoutExpired:
                failed, verdict = failed + 1, "FAILED: timeout (a hang)"
            print(f"{label}: {verdict}", flush=True)
    print(f"\n{len(EXAMPLES) - failed} of {len(EXAMPLES)} example runs ok")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", help="a Horovod checkout (it holds test/parallel/test_torch.py)")
    p.add_argument("-k", dest="select", help="only tests whose name contains this")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds for one test's launch")
    p.add_argument("--examples", action="store_true", help="run Horovod's PyTorch examples instead of test_torch.py")
    args = p.parse_args()
    if args.examples:
        return run_examples(Path(args.checkout), max(args.timeout, 300.0))
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
