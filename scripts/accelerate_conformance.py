"""Accelerate's own multi-process test scripts, run twice on 2 CPU ranks: on Accelerate as written, and on
phalanx.accelerate with only the imports changed. Not part of the suite: the scripts come from the installed
accelerate package (accelerate/test_utils/scripts/) and are copied to a temporary folder, never into this repository.

    .venv/bin/python scripts/accelerate_conformance.py                    # test_sync.py, test_distributed_data_loop.py
    .venv/bin/python scripts/accelerate_conformance.py test_sync.py       # one script

"Only the imports changed": every ``from accelerate... import`` becomes ``from phalanx.accelerate... import``
(``accelerate.utils...`` -> ``phalanx.accelerate.utils``, the rest -> ``phalanx.accelerate``), except
``accelerate.test_utils``, whose models and datasets come from the real package. To count each test, every call of a
``test_*`` function inside the script's ``main()`` is wrapped so that an exception is recorded and the next test
runs; each test runs on its own (the script's other tests become ``pass``), so that a hang costs one test; it passes
when it returns on every rank. Accelerate runs under torchrun (with ACCELERATE_USE_CPU), phalanx under phalanx
launch.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = ("test_sync.py", "test_distributed_data_loop.py")
NOT_RUN = "not run (the script runs it only on another setup, e.g. GPUs)"

RECORD = """
def _conformance_record(name, fn):
    import json, os, traceback
    path = os.environ["CONFORMANCE_OUT"] + "." + os.environ.get("RANK", "0")
    try:
        fn()
        outcome = "passed"
    except BaseException as e:  # noqa: BLE001 - every failure is a result here
        outcome = "failed: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    with open(path, "a") as f:
        f.write(json.dumps([name, outcome]) + "\\n")
"""


def swap_imports(source: str) -> str:
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "accelerate":
            if node.module.startswith("accelerate.test_utils"):
                continue
            target = "phalanx.accelerate.utils" if node.module.startswith("accelerate.utils") else "phalanx.accelerate"
            i = node.lineno - 1
            lines[i] = lines[i].replace(f"from {node.module} import", f"from {target} import", 1)
    return "".join(lines)


def _test_call(node: ast.AST) -> bool:
    call = getattr(node, "value", None)
    return (
        isinstance(node, ast.Expr)
        and isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and (call.func.id.startswith("test_"))
    )


class _WrapTests(ast.NodeTransformer):
    """Inside main(): ``test_x(args)`` -> ``_conformance_record("test_x:LINE", lambda: test_x(args))``; with ``only``,
    every other test call becomes ``pass`` (one test per run, so that a hang or a crash costs that test alone)."""

    def __init__(self, only: int | None = None) -> None:
        self.only = only

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        call = node.value
        if _test_call(node):
            assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            if self.only is not None and node.lineno != self.only:
                return ast.copy_location(ast.Pass(), node)
            name = ast.Constant(f"{call.func.id}:{node.lineno}")
            thunk = ast.Lambda(args=ast.arguments([], [], None, [], [], None, []), body=call)
            wrapped = ast.Call(ast.Name("_conformance_record", ast.Load()), [name, thunk], [])
            return ast.copy_location(ast.Expr(wrapped), node)
        return node


def test_lines(source: str) -> list[int]:
    """The lines of main()'s test calls."""
    main = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return [n.lineno for n in ast.walk(main) if _test_call(n)]


def instrument(source: str, only: int | None = None) -> str:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            _WrapTests(only).visit(node)
    # The recorder goes before the script's `if __name__ == "__main__":`, which calls main().
    at = next((i for i, n in enumerate(tree.body) if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)), None)
    tree.body[at if at is not None else len(tree.body) : at] = ast.parse(RECORD).body
    return ast.unparse(tree) + "\n"


def _free_port() -> int:
    """A port nobody listens on now (a fixed one clashes with a run still closing, or another job's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(script: Path, front: str, python: str) -> list[str]:
    """2 CPU ranks: torchrun for Accelerate (accelerate launch --cpu starts one process only), phalanx launch."""
    if front == "accelerate":
        torchrun = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
        return [*torchrun, str(script)]
    return [python, "-m", "phalanx", "launch", "-n", "2", str(script)]


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def run_launch(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[bool, str]:
    """(whether it exited with 0, its output's tail); on a timeout the launcher and every process under it are
    killed (torchrun starts its ranks in sessions of their own, which a plain kill of the launcher leaves behind)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode == 0, output[-3000:]
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()
        return False, "timed out"


def run(script: Path, front: str, out: Path, python: str, timeout: float) -> dict[str, str]:
    env = {**os.environ, "CONFORMANCE_OUT": str(out), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env["ACCELERATE_USE_CPU"] = "1"  # Accelerate runs on CPU processes only when told (accelerate launch --cpu)
    # what was recorded before a hang counts; the rest did not pass
    finished, _ = run_launch(launch_command(script, front, python), script.parent, env, timeout)
    ranks = []
    for r in (0, 1):
        path = Path(f"{out}.{r}")
        ranks.append(dict(json.loads(line) for line in path.read_text().splitlines()) if path.exists() else {})
    names = list(dict.fromkeys([*ranks[0], *ranks[1]]))
    if not names and finished:
        return {"": NOT_RUN}
    return {
        n: next((o for o in (ranks[0].get(n, "missing"), ranks[1].get(n, "missing")) if o != "passed"), "passed")
        for n in names
    }


def _name_at(source: str, line: int) -> str:
    main = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    node = next(n for n in ast.walk(main) if _test_call(n) and n.lineno == line)
    return node.value.func.id  # type: ignore[attr-defined]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scripts", nargs="*", default=list(SCRIPTS))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for one test's run")
    args = p.parse_args()
    import accelerate

    source_dir = Path(accelerate.__file__).parent / "test_utils" / "scripts"
    print(f"accelerate {accelerate.__version__}: {source_dir}")
    with tempfile.TemporaryDirectory(prefix="accelerate-conformance-") as tmp:
        for name in args.scripts:
            original = (source_dir / name).read_text()
            results: dict[str, dict[str, str]] = {"accelerate": {}, "phalanx": {}}
            for line in test_lines(original):  # imports are swapped line for line, so the lines hold in both
                for front in ("accelerate", "phalanx"):
                    folder = Path(tmp) / front / f"{name}-{line}"
                    folder.mkdir(parents=True)
                    text = original if front == "accelerate" else swap_imports(original)
                    (folder / name).write_text(instrument(text, only=line))
                    got = run(folder / name, front, folder / (name + ".out"), args.python, args.timeout)
                    label = f"{_name_at(original, line)}:{line}"
                    results[front][label] = next(iter(got.values()), "failed: no result (a crash or a hang)")
            theirs, ours = results["accelerate"], results["phalanx"]
            names = [n for n in theirs if theirs[n] != NOT_RUN]  # the tests this setup runs
            passed = {front: sum(results[front].get(n) == "passed" for n in names) for front in results}
            print(f"\n{name}: {len(names)} tests run on 2 CPU ranks; accelerate passes {passed['accelerate']}, "
                  f"phalanx {passed['phalanx']}")  # fmt: skip
            for n in names:
                print(f"  {n:55s} accelerate: {theirs.get(n, 'missing')[:60]:60s} phalanx: {ours.get(n, 'missing')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
