"""Count the checks in the test suite: assert statements, pytest.raises, and assert_* helper calls, per file.

    .venv/bin/python scripts/count_checks.py                 # the working tree
    .venv/bin/python scripts/count_checks.py --rev e6137de   # the suite at a commit, read from git

A change that merges or speeds up tests must not lower these counts (a check dropped is a check lost).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def count(source: str) -> dict[str, int]:
    tree = ast.parse(source)
    out = {"assert": 0, "pytest.raises": 0, "assert_* calls": 0}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            out["assert"] += 1
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "raises":
                out["pytest.raises"] += 1
            elif name.startswith("assert_"):
                out["assert_* calls"] += 1
    return out


def sources(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "tests").glob("*.py"))}
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "tests/"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {
        n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        for n in names
        if n.endswith(".py")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a git revision to read tests/ from (default: the working tree)")
    parser.add_argument("--per-file", action="store_true", help="one line per file")
    args = parser.parse_args()
    total = {"assert": 0, "pytest.raises": 0, "assert_* calls": 0}
    for name, text in sources(args.rev).items():
        counts = count(text)
        for k, v in counts.items():
            total[k] += v
        if args.per_file:
            print(f"{name:40} " + "  ".join(f"{k} {v}" for k, v in counts.items()))
    print(f"tests/ at {args.rev or 'the working tree'}: " + ", ".join(f"{v} {k}" for k, v in total.items()))


if __name__ == "__main__":
    main()
