"""The source tree's shape: no import cycles, no module too long to read without a reason, and
dependencies that point the way docs/architecture.md says."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
#: A module longer than this says why in its docstring (a line starting "Why one module:").
LONG_MODULE_LINES = 650


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]


def _import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Every import between src modules, function-level (lazy) ones included; imports under
    ``if TYPE_CHECKING:`` only with ``type_only`` (they never run, but a cycle through them is
    still two modules that need each other to be read)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        deps: set[str] = set()
        todo: list[ast.AST] = [ast.parse(path.read_text())]
        while todo:
            node = todo.pop()
            for child in ast.iter_child_nodes(node):
                if (
                    not type_only
                    and isinstance(child, ast.If)
                    and "TYPE_CHECKING" in ast.dump(child.test)
                ):
                    continue
                if isinstance(child, ast.Import | ast.ImportFrom):
                    deps.update(
                        n for n in _imported(name, is_package, child) if n in modules and n != name
                    )
                todo.append(child)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    """No two modules import each other, directly or through others, even inside functions: a
    package's submodules do not import from the package's own __init__; none through
    type-only imports either."""
    assert _cycles(_import_graph()) == []
    assert _cycles(_import_graph(type_only=True)) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_dependencies_point_one_way() -> None:
    """The core never imports an adapter; the planner imports nothing else of coci but errors
    and knobs; codecs and storage never import the engine; the save path's modules import
    down it only (manager -> writer -> persist; the worker threads know none of them)."""
    graph = _import_graph()
    allowed_for_planner = ("coci_core.planner", "coci_core.errors", "coci_core.knobs")
    for module, deps in graph.items():
        if module.startswith("coci_core"):
            assert not {d for d in deps if d.startswith("coci_") and d.split(".")[0] != "coci_core"}
        if module.startswith("coci_core.planner"):
            assert {
                d
                for d in deps
                if d.startswith("coci_core") and not d.startswith(allowed_for_planner)
            } == set(), module
        if module.startswith(("coci_core.codecs", "coci_core.storage")):
            assert {d for d in deps if d.startswith("coci_core.engine")} == set(), module
    # the save hand-off (tests/engine/test_save_path.py checks its frames at run time)
    assert {d for d in graph["coci_core.engine.save.workers"] if d.startswith("coci_core")} == set()
    save_path = ("coci_core.engine.manager", "coci_core.engine.save.writer")
    assert not graph["coci_core.engine.save.writer"] & {save_path[0]}
    assert not graph["coci_core.engine.save.persist"] & set(save_path)


#: The public line (docs/architecture.md): the modules whose ``__all__`` an adapter, or any
#: package outside coci_core, may import from. Everything else of coci_core is internal.
PUBLIC_MODULES = (
    "coci_core",
    "coci_core.training",
    "coci_core.errors",
    "coci_core.planner",
    "coci_core.preemption",
    "coci_core.storage",
    "coci_core.codecs",
    "coci_core.telemetry",
    "coci_core.hpo",
    "coci_core.hpo.optuna",
    "coci_core.hpo.ray",
)


def _past_the_line(source: str) -> list[str]:
    """The coci_core imports of a module's source (type-only and function-level ones too)
    that are not a public module or a name in a public module's ``__all__``."""
    crossed = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            crossed += [
                a.name
                for a in node.names
                if a.name.startswith("coci_core") and a.name not in PUBLIC_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("coci_core"):
            module = node.module or ""
            if module not in PUBLIC_MODULES:
                crossed.append(module)
                continue
            public = set(importlib.import_module(module).__all__)
            crossed += [
                f"{module}.{a.name}"
                for a in node.names
                if a.name not in public and f"{module}.{a.name}" not in PUBLIC_MODULES
            ]
    return crossed


def test_adapters_import_only_the_public_line() -> None:
    """Every ``coci_*`` package other than coci_core (the three adapters, and any added
    later) imports from coci_core only public modules and the names in their ``__all__``."""
    crossed = {}
    for package in sorted(p for p in SRC.iterdir() if p.name.startswith("coci_")):
        if package.name == "coci_core" or not (package / "__init__.py").exists():
            continue
        for path in sorted(package.rglob("*.py")):
            found = _past_the_line(path.read_text())
            if found:
                crossed[str(path.relative_to(SRC))] = found
    assert crossed == {}


def test_the_public_line_check_finds_a_crossing() -> None:
    source = (
        "from coci_core.training import Checkpointer\n"
        "from coci_core.engine.format.tree import flatten_state\n"
        "from coci_core import CheckpointManager, _LAZY\n"
        "from coci_core.hpo import optuna\n"
        "import coci_core.engine.manager\n"
        "def f():\n    from coci_core.telemetry.report import render\n"
    )
    assert sorted(_past_the_line(source)) == [
        "coci_core._LAZY",
        "coci_core.engine.format.tree",
        "coci_core.engine.manager",
        "coci_core.telemetry.report",
    ]


def test_long_modules_say_why() -> None:
    """A module over LONG_MODULE_LINES lines gives the reason in its docstring."""
    unexplained = []
    for name, (path, _) in _modules().items():
        if len(path.read_text().splitlines()) > LONG_MODULE_LINES:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            if "Why one module:" not in doc:
                unexplained.append(name)
    assert unexplained == []
