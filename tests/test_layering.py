"""The package's layering, read from the source: the engine never imports what sits above
it, nothing imports the application layer (``hookloop.app``), no module of the package is
in an import cycle, and no file that lands on ``sys.path`` takes a standard-library name.

Every ``import`` and ``from ... import`` counts wherever it stands: at the top, inside a
function, or under ``if TYPE_CHECKING:`` (a type-only import still ties the modules
together for a reader, a type checker and the next refactor). Nothing is imported here:
the modules are parsed with :mod:`ast`, so a lazy import cannot hide.
"""

from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = "hookloop"

#: The engine: the loop and what it is built from.
ENGINE = tuple(
    f"{PACKAGE}.{name}"
    for name in ("events", "manager", "state", "requests", "callback", "step", "data",
                 "config", "config_sections", "distributed", "loop", "loop.trainer", "loop.parts", "loop.stepper",
                 "loop.schedule", "loop.logbook", "loop.evaluation", "loop.actions",
                 "checkpoint", "checkpoint.storage", "checkpoint.state", "checkpoint.manager",
                 "checkpoint.weights", "checkpoint.background", "checkpoint.local",
                 "checkpoint.rewind", "checkpoint.checkpointer")
)  # fmt: skip
#: What sits above the engine; the engine imports none of it.
ABOVE = tuple(f"{PACKAGE}.{name}" for name in ("callbacks", "compat", "control", "cli", "app"))
#: The application layer: the command line and the tools around run directories.
APP = f"{PACKAGE}.app"
#: The one module outside the application layer that may import it: ``python -m hookloop``.
APP_ENTRY = f"{PACKAGE}.__main__"


def module_file(module: str) -> Path | None:
    """The source file of ``module`` under src/ (a package's ``__init__.py``), or None."""
    base = SRC.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def is_package(module: str) -> bool:
    return (SRC.joinpath(*module.split(".")) / "__init__.py").is_file()


def imports_of(module: str, source: str) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import statement anywhere in ``source``.

    ``from X import a`` yields ``X`` and, when ``X.a`` is a module of this package,
    ``X.a`` too; relative imports are resolved against ``module``.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".")
                if not is_package(module):
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((base, node.lineno))
            for alias in node.names:
                if alias.name != "*" and module_file(f"{base}.{alias.name}") is not None:
                    found.append((f"{base}.{alias.name}", node.lineno))
    return sorted(found, key=lambda item: item[1])


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def ours(module: str) -> str | None:
    """The module of this package that importing ``module`` runs (None: not ours)."""
    if not within(module, PACKAGE) or module == PACKAGE:
        return None  # the package root runs before any of its modules anyway
    while module_file(module) is None and "." in module:
        module = module.rsplit(".", 1)[0]  # `import hookloop.x.name` where name is no module
    return module if module != PACKAGE else None


def import_graph(roots: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Module -> {imported module of ours: line} for ``roots`` and every module of ours
    they reach, except those above the engine (reported, not followed)."""
    graph: dict[str, dict[str, int]] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in graph:
            continue
        path = module_file(module)
        assert path is not None, f"{module} has no source file under {SRC}"
        edges: dict[str, int] = {}
        for target, line in imports_of(module, path.read_text(encoding="utf-8")):
            target = ours(target)
            if target is None or target == module:
                continue
            edges.setdefault(target, line)
            parent = target.rsplit(".", 1)[0]
            # Importing a submodule runs its package, unless the importer lives in that
            # package: the package is then already running (it was imported first).
            if parent != PACKAGE and parent != module and not within(module, parent):
                edges.setdefault(parent, line)
        graph[module] = edges
        todo += [t for t in edges if not any(within(t, above) for above in ABOVE)]
    return graph


def all_modules() -> tuple[str, ...]:
    """Every module and package under src/hookloop, the package root included."""
    found = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return tuple(found)


def where(module: str, line: int) -> str:
    """``src/hookloop/x.py:12``: the file and line of an import, as an editor opens it."""
    return f"{module_file(module).relative_to(SRC.parent)}:{line}"


def cycles_in(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Import cycles of ``graph`` (only its keys count as nodes), each as the modules
    ``[a, b, ..., a]`` along it; a depth-first search reports one per edge that closes
    a cycle."""
    cycles, state = [], {}  # state: 1 on the current path, 2 finished

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(t for t in graph[module] if t in graph):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_the_analysis_sees_every_kind_of_import():
    # Guards the two tests below against passing because the parser saw nothing.
    source = "\n".join([
        "from __future__ import annotations",
        "from typing import TYPE_CHECKING",
        "import hookloop.events",
        "from hookloop.manager import CallbackManager",
        "from . import step",
        "from .control import server",
        "if TYPE_CHECKING:",
        "    from hookloop.loop.trainer import Trainer",
        "def later():",
        "    from hookloop.callbacks.jsonlog import JsonLogger",
        "    import hookloop.app.cli",
    ])  # fmt: skip
    found = {ours(name) for name, _ in imports_of("hookloop.state", source)} - {None}
    assert found >= {
        "hookloop.events", "hookloop.manager", "hookloop.step", "hookloop.control",
        "hookloop.control.server", "hookloop.loop.trainer", "hookloop.callbacks.jsonlog",
        "hookloop.app.cli",
    }  # fmt: skip
    trainer = import_graph(("hookloop.loop.trainer",))["hookloop.loop.trainer"]
    assert {"hookloop.manager", "hookloop.loop.parts", "hookloop.loop.actions"} <= trainer.keys()


@pytest.mark.parametrize("module", ENGINE)
def test_an_engine_module_imports_nothing_from_callbacks_compat_control_or_cli(module):
    assert module_file(module) is not None, f"{module} is gone: update ENGINE in this test"
    graph = import_graph((module,))

    def path_to(target: str) -> list[str]:
        """The import chain from ``module`` to ``target`` (breadth-first: shortest)."""
        came_from: dict[str, str | None] = {module: None}
        queue = [module]
        for current in queue:
            for nxt in graph.get(current, {}):
                if nxt not in came_from:
                    came_from[nxt] = current
                    queue.append(nxt)
        chain, node = [], target
        while node is not None:
            chain.append(node)
            node = came_from[node]
        return chain[::-1]

    problems = []
    for importer, edges in graph.items():
        for target, line in edges.items():
            if any(within(target, above) for above in ABOVE):
                where = module_file(importer).relative_to(SRC.parent)
                chain = " -> ".join(path_to(target))
                problems.append(f"{where}:{line} imports {target} ({chain})")
    assert not problems, f"{module} reaches the layers above the engine:\n" + "\n".join(problems)


def test_the_engine_import_graph_has_no_cycle():
    graph = import_graph(ENGINE)
    engine = {m: {t: line for t, line in edges.items() if t in graph} for m, edges in graph.items()}
    cycles = []
    for loop in cycles_in(engine):
        steps = [f"{a} (line {engine[a][b]})" for a, b in itertools.pairwise(loop)]
        cycles.append(" -> ".join([*steps, loop[-1]]))
    assert not cycles, "import cycles (type-only imports count):\n" + "\n".join(cycles)


def test_the_cycle_search_finds_a_cycle_and_the_package_list_is_whole():
    # Guards the tests below against passing because they looked at nothing.
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7, "d": 1}, "d": {}}
    assert cycles_in(graph) == [["a", "b", "c", "a"]]
    assert cycles_in({"a": {"b": 1}, "b": {}}) == []
    modules = all_modules()
    expected = {PACKAGE, APP, f"{APP}.cli", "hookloop.loop.trainer", "hookloop.tune.study"}
    assert expected <= set(modules)
    assert all(module_file(m) is not None for m in modules)


def test_no_module_of_the_package_is_in_an_import_cycle():
    """Any module of hookloop imports, alone and first, without a half-initialised module
    on the way, and each can be understood (and moved) without the ones that import it:
    across the whole package, not only the engine.

    A module's import of a package that contains it (``hookloop.tune.study`` importing a
    sibling runs ``hookloop.tune``) is no edge here: Python runs a package's
    ``__init__`` before any of its modules, so that import never decides an order, and a
    package that re-exports its modules' names would otherwise be a cycle by definition.
    """
    graph = {
        module: {t: line for t, line in edges.items() if not within(module, t)}
        for module, edges in import_graph(all_modules()).items()
    }
    cycles = [
        " -> ".join(f"{where(a, graph[a][b])} imports {b}" for a, b in itertools.pairwise(loop))
        for loop in cycles_in(graph)
    ]
    assert not cycles, "import cycles (type-only imports count):\n" + "\n".join(cycles)


def test_nothing_outside_the_app_layer_imports_it():
    """The command line and the run-directory tools (``hookloop.app``) can change, or be
    left out, without touching the engine, the callbacks, control, tune or DiLoCo:
    only ``python -m hookloop`` (``hookloop/__main__.py``) starts it."""
    problems = []
    for module, edges in import_graph(all_modules()).items():
        if within(module, APP) or module == APP_ENTRY:
            continue
        for target, line in edges.items():
            if within(target, APP):
                problems.append(f"{where(module, line)} imports {target}")
    assert not problems, f"only {APP} itself and {APP_ENTRY} import {APP}:\n" + "\n".join(problems)


#: Folders whose files are importable by bare name: src/ (the installed package's top
#: level), bench/ (a bench script's own folder, sys.path[0] when it runs), tests/ and
#: gpu_tests/ (pytest's default import mode puts a test file's folder, which has no
#: __init__.py, on sys.path).
ON_SYS_PATH = ("src", "bench", "tests", "gpu_tests")


def importable_names(folder: Path) -> dict[str, Path]:
    """The names ``import NAME`` finds in ``folder``: its .py files and its packages (a
    folder with ``__init__.py``; one without is a namespace portion, which any module
    of the same name elsewhere on sys.path wins over)."""
    names = {path.stem: path for path in folder.glob("*.py")}
    names.update({p.name: p for p in folder.iterdir() if (p / "__init__.py").is_file()})
    return names


def test_no_file_on_sys_path_has_the_name_of_a_standard_library_module():
    """``import queue`` (or ``gc``, ``profile`` ...) in any script, test or library means the
    standard library's module, whatever folder the script runs from.

    Only names that land on sys.path are checked: a bench script's neighbours, the files
    of tests/ and gpu_tests/, the package's top-level name. A module inside the package, such as
    ``hookloop.profile`` or ``hookloop.compat.hf.types``, cannot shadow anything: Python 3
    has no implicit relative imports, so ``import profile`` never finds it, and the
    package's folders are not put on sys.path (its commands run as ``python -m``).
    """
    stdlib = sys.stdlib_module_names
    seen, clashes = {}, []
    for folder in ON_SYS_PATH:
        names = importable_names(ROOT / folder)
        seen[folder] = names
        clashes += [
            f"{path.relative_to(ROOT)} is importable as {name!r}, a standard-library module"
            for name, path in sorted(names.items())
            if name in stdlib
        ]
    assert PACKAGE in seen["src"] and "_timing" in seen["bench"]  # it looked somewhere
    assert "conftest" in seen["tests"] and "_zygote" in seen["tests"]
    assert not clashes, "rename them (say what they measure or hold):\n" + "\n".join(clashes)
