"""The house rules that keep phalanx easy to change, checked on the source itself.

- No import cycle anywhere in src/phalanx. Every explicit import counts, also one inside a function (an import
  moved into a function to dodge a cycle is still a cycle); imports under ``if TYPE_CHECKING:`` do not run and
  do not count, nor do those under ``if __name__ == "__main__":``, which runs only as a program. Strategies loaded
  by name through the registry (``importlib``) are not edges.
- The layers form a ladder (``LADDER``, written out in docs/architecture.md): a module imports its own package and
  the floors below it, never a floor above it or a sibling package on its own floor.
- No module over 800 lines: a backstop, not a target. Modules are cut by idea, not by a line count.
- config/settings.py names no strategy: it composes the strategies' option groups from the registry.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "phalanx"
MAX_LINES = 800

# The ladder, from the ground up: each floor's packages (or top-level modules) under src/phalanx. Settings are the
# ground floor, so every layer may read them; the process world sits on them, then the checkpoint format (which the
# strategies hand their shards to), the strategies, the Engine (and big-model inference, beside it), its clients
# (the Trainer, the API fronts for other libraries' users, and the planner, which reads models as inference does and
# the strategies' layouts), the demo, and the launcher with the phalanx command.
LADDER: list[tuple[str, ...]] = [
    ("config",),
    ("runtime",),
    ("checkpoint",),
    ("strategies",),
    ("engine", "inference"),
    ("trainer", "compat", "planning"),
    ("demo",),
    ("launch",),
]
# Under every floor: the rank-aware logger and the version. Over all of them: the public names.
BASEMENT = {"phalanx.logging", "phalanx._version"}
ROOF = {"phalanx", "phalanx.__main__", "phalanx.horovod", "phalanx.accelerate", "phalanx.accelerate.utils"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _is_main_block(test: ast.expr) -> bool:
    """``if __name__ == "__main__":`` runs only when the file is the program, never on import."""
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The phalanx modules that ``path`` imports when it runs (its own package for relative imports)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and (_is_type_checking(node.test) or _is_main_block(node.test)):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base in modules:
                found.add(base)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(1000, 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _floor(module: str) -> tuple[int, str]:
    """The floor of ``module`` on the ladder and the package (or top-level module) that puts it there."""
    top = module.split(".")[1]
    for level, floor in enumerate(LADDER):
        if top in floor:
            return level, top
    raise KeyError(f"{module} is on no floor of the ladder: add its package to LADDER (and to docs/architecture.md)")


def _against_the_ladder(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up the ladder or sideways to a sibling package on the same floor."""
    out = []
    for importer in sorted(graph):
        if importer in ROOF or importer in BASEMENT:
            if importer in BASEMENT and graph[importer] - BASEMENT:
                out.append(f"{importer} (basement) imports {sorted(graph[importer] - BASEMENT)}")
            continue
        level, package = _floor(importer)
        for imported in sorted(graph[importer]):
            if imported in BASEMENT:
                continue
            if imported in ROOF:
                out.append(f"{importer} imports {imported}, a public front over every floor")
                continue
            their_level, their_package = _floor(imported)
            if their_package != package and their_level >= level:
                where = "a sibling on its floor" if their_level == level else f"floor {their_level}, above its {level}"
                out.append(f"{importer} (floor {level}) imports {imported} ({where})")
    return out


def test_every_top_level_entry_is_on_the_ladder():
    placed = {name for floor in LADDER for name in floor} | {m.split(".")[1] for m in BASEMENT | ROOF if "." in m}
    entries = {
        p.stem if p.suffix == ".py" else p.name
        for p in SRC.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert entries - {"__init__"} - placed == set(), "put each new package on the ladder (LADDER, docs/architecture.md)"
    assert placed - entries == set(), "the ladder names packages that are gone"


def test_imports_go_down_the_ladder():
    graph = _graph()
    assert "phalanx.config.registry" in graph["phalanx.engine.engine"], "edges are read"
    assert _against_the_ladder(graph) == [], "imports that go up the ladder, or sideways between sibling packages"


def test_the_ladder_check_finds_an_upward_import():
    graph = {
        "phalanx.config.settings": {"phalanx.logging"},
        "phalanx.strategies.ddp": {"phalanx.config.settings", "phalanx.engine.guards"},  # up, from floor 3 to 4
        "phalanx.engine.guards": {"phalanx.inference.plan"},  # sideways, to a sibling on floor 4
        "phalanx.engine.engine": {"phalanx.engine.guards", "phalanx.strategies.ddp"},  # its own package, and down
        "phalanx.runtime.comm": {"phalanx.horovod"},  # a public front
        "phalanx.inference.plan": set(),
    }
    assert _against_the_ladder(graph) == [
        "phalanx.engine.guards (floor 4) imports phalanx.inference.plan (a sibling on its floor)",
        "phalanx.runtime.comm imports phalanx.horovod, a public front over every floor",
        "phalanx.strategies.ddp (floor 3) imports phalanx.engine.guards (floor 4, above its 3)",
    ]


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 30, "the walk found the package"
    assert "phalanx.strategies.zero.base" in graph["phalanx.strategies.zero.bucketed"], "edges are read"
    assert _cycles(graph) == [], "import cycles (each list is one strongly connected group of modules)"


def test_the_cycle_check_finds_a_cycle():
    # The checker itself: a graph with a cycle through a function-level import must be reported.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_module_over_800_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines probably hold two ideas: split them by idea"


def test_config_names_no_strategy():
    from phalanx.config.registry import strategy_names

    tree = ast.parse((SRC / "config" / "settings.py").read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names = set(strategy_names())
    literals = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]
    named = [s for s in literals if s in names or any(s.startswith(n) for n in ("zero", "pipeline", "pp_"))]
    assert named == [], (
        "config/settings.py must compose the strategies' option groups, not name strategies or their knobs"
    )


def test_help_and_errors_list_the_real_strategies_and_their_knobs():
    from phalanx.config.registry import strategy_names
    from phalanx.config.settings import ConfigError, EngineConfig

    names = strategy_names()
    assert {"ddp", "zero1", "zero2", "zero3", "pipeline"} <= set(names)
    with pytest.raises(ConfigError) as info:
        EngineConfig(strategy="nope")
    assert ", ".join(names) in str(info.value)
    out = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in names:
        assert name in out, f"launch --help does not list strategy {name}"
    for knob in ("--bucket-mb", "--offload", "--zero3-unit-classes", "--pp-schedule", "--pp-zero-stage"):
        assert knob in out, f"launch --help does not list {knob}"
    assert "1f1b" in out and "gpipe" in out, "the help lists each knob's choices"


# c10d collectives: every call in phalanx goes through collective_log.watched, so that the hang watchdog and the
# desync check see it. runtime/world.py's bounded teardown barrier is the one call left out: the script has ended there.
_C10D = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier", "isend",
         "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "gather", "scatter", "reduce",
         "send", "recv", "all_to_all", "all_to_all_single", "monitored_barrier"}  # fmt: skip
_UNWATCHED = {
    "phalanx.runtime.collective_log": set(),
    "phalanx.runtime.watchdog": {"all_gather"},
    "phalanx.runtime.world": {"monitored_barrier"},
}


def _direct_collectives(tree: ast.AST) -> list[tuple[str, int]]:
    return [
        (node.func.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _C10D
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "dist"
    ]


def test_every_collective_goes_through_the_log():
    found = {
        name: [
            (op, line)
            for op, line in _direct_collectives(ast.parse(path.read_text()))
            if op not in _UNWATCHED.get(name, set())
        ]
        for name, path in _modules().items()
    }
    found = {k: v for k, v in found.items() if v}
    assert found == {}, (
        "call these through phalanx.runtime.collective_log.watched(dist.<op>, ...), or the watchdog cannot see them"
    )


def test_the_collective_check_finds_a_direct_call():
    tree = ast.parse("import torch.distributed as dist\nwatched(dist.all_reduce, t)\ndist.all_reduce(t)\n")
    assert _direct_collectives(tree) == [("all_reduce", 3)]
