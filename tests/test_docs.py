"""The docs are tested, so that they cannot drift from the code: README.md and every page in docs/.

- Every relative link resolves, to a file and, with ``#anchor``, to a heading of that file.
- Every fenced Python block compiles; a block after a ``<!-- docs-test: run -->`` line also runs, as a script in a
  fresh directory (the README's complete example is one).
- Every ``phalanx ...`` command line (in shell blocks, and in inline code of three words or more) parses with the
  real command (``phalanx.launch.cli.check_command_line``): the command, its flags and their values.

Each check is also fed a page with a broken link, a block that does not compile and a bad command, and must catch it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from phalanx.launch.cli import check_command_line

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_MARK = "<!-- docs-test: run -->"
SHELLS = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    info: str  # the fence's language
    body: str
    line: int  # where its first line is in the page
    run: bool  # marked to run


def _blocks(text: str) -> list[Block]:
    """Fenced blocks, dedented by their fence's indent (a block inside a list item is indented)."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^( *)```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, info = m.group(1), m.group(2).strip()
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^{indent}```\s*$", lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        out.append(Block(info.split()[0] if info else "", "\n".join(body) + "\n", i + 2, before == RUN_MARK))
        i = j + 1
    return out


def _prose(text: str) -> str:
    """The page with its fenced blocks blanked out, line for line (links and commands in code are not prose)."""
    return re.sub(r"^( *)```.*?^\1```[^\n]*$", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(text: str) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", _prose(text), flags=re.M)}


def broken_links(text: str, page: Path) -> list[str]:
    """Relative links (and anchors) in ``text``, read as ``page``, that lead nowhere."""
    out = []
    prose = re.sub(r"`[^`\n]*`", "", _prose(text))
    for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:  # a heading of this page
            if anchor not in _anchors(text):
                out.append(f"{page.name}: link to {target}: this page has no heading #{anchor}")
            continue
        dest = (page.parent / path).resolve()
        if not dest.exists():
            out.append(f"{page.name}: link to {target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            out.append(f"{page.name}: link to {target}: {dest.name} has no heading #{anchor}")
    return out


def uncompiled_blocks(text: str, page: Path) -> list[str]:
    out = []
    for block in _blocks(text):
        if block.info not in ("python", "py"):
            continue
        try:
            compile(block.body, f"{page.name}:{block.line}", "exec")
        except SyntaxError as e:
            out.append(f"{page.name}:{block.line + (e.lineno or 1) - 1}: the Python block does not compile: {e.msg}")
    return out


def command_lines(text: str) -> list[tuple[int, list[str]]]:
    """Every ``phalanx`` command line in ``text``: (line in the page, its arguments after ``phalanx``)."""
    found: list[tuple[int, str]] = []
    for block in _blocks(text):
        if block.info in SHELLS:
            joined = block.body.replace("\\\n", " ")
            found += [(block.line + n, line) for n, line in enumerate(joined.splitlines())]
    for n, line in enumerate(_prose(text).splitlines(), 1):
        found += [(n, span) for span in re.findall(r"`([^`\n]+)`", line) if len(span.split()) >= 3]
    out = []
    for n, line in sorted(found):
        line = line.strip().removeprefix("$ ")
        if not re.match(r"^(\.venv/bin/)?phalanx\s", line):
            continue
        words = shlex.split(line, comments=True)
        if words and words[-1] == "&":
            words.pop()
        out.append((n, words[1:]))
    return out


def bad_commands(text: str, page: Path) -> list[str]:
    out = []
    for n, args in command_lines(text):
        problem = check_command_line(args)
        if problem is not None:
            out.append(f"{page.name}:{n}: phalanx {shlex.join(args)}: {problem}")
    return out


def runnable_blocks(text: str) -> list[Block]:
    return [b for b in _blocks(text) if b.run]


# ------------------------------------------------------------------------------------------------ the real docs
def test_the_pages_are_found():
    names = {p.name for p in PAGES}
    assert {"README.md", "architecture.md", "strategies.md", "configuration.md", "checkpoints.md"} <= names
    assert len(command_lines((ROOT / "docs" / "configuration.md").read_text())) >= 5, "commands are read"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    assert broken_links(page.read_text(), page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_compile(page):
    assert uncompiled_blocks(page.read_text(), page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_phalanx_commands_parse(page):
    assert bad_commands(page.read_text(), page) == []


_RUNNABLE = [(page, block) for page in PAGES for block in runnable_blocks(page.read_text())]


def test_the_readme_example_is_marked_to_run():
    assert any(page.name == "README.md" for page, _ in _RUNNABLE)


@pytest.mark.parametrize("page,block", _RUNNABLE, ids=[f"{p.name}:{b.line}" for p, b in _RUNNABLE])
def test_runnable_blocks_run(page, block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.body)
    env = {**os.environ, "PHALANX_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{page.name}:{block.line} failed:\n{proc.stdout}\n{proc.stderr}"


# ------------------------------------------------------------------------------- the checker catches mistakes
BROKEN_PAGE = """# A page

See [the strategies](strategies.md), [a missing page](nowhere.md) and [a missing heading](strategies.md#no-such).
Also [this page's own heading](#a-page), [one it lacks](#b-page), and `phalanx launch --nproc 2 train.py` inline.

```python
for x in range(3)
    print(x)
```

<!-- docs-test: run -->
```python
print("ran")
```

```bash
phalanx launch -n 2 --strategy zero3 train.py   # fine
phalanx launch -n 2 --stratgy zero3 train.py    # a misspelt flag
phalanx launch -n two train.py
```
"""


def test_the_link_check_finds_a_broken_link():
    problems = broken_links(BROKEN_PAGE, ROOT / "docs" / "broken.md")
    assert len(problems) == 3
    assert "nowhere.md" in problems[0] and "does not exist" in problems[0]
    assert "strategies.md has no heading #no-such" in problems[1]
    assert "this page has no heading #b-page" in problems[2]


def test_the_block_check_finds_a_block_that_does_not_compile():
    problems = uncompiled_blocks(BROKEN_PAGE, ROOT / "docs" / "broken.md")
    assert len(problems) == 1 and "broken.md:7" in problems[0] and "does not compile" in problems[0]


def test_the_command_check_finds_bad_command_lines():
    problems = bad_commands(BROKEN_PAGE, ROOT / "docs" / "broken.md")
    assert len(problems) == 3, problems
    assert "--nproc" in problems[0] and "did you mean --nproc-per-node" in problems[0]
    assert "--stratgy" in problems[1] and "did you mean --strategy" in problems[1]
    assert "-n" in problems[2] and "two" in problems[2]


def test_only_marked_blocks_run():
    blocks = runnable_blocks(BROKEN_PAGE)
    assert [b.body for b in blocks] == ['print("ran")\n']
