"""The engine's layering, read from the source: it never imports what sits above it, and
its own modules import one another without a cycle.

Every ``import`` and ``from ... import`` counts wherever it stands: at the top, inside a
function, or under ``if TYPE_CHECKING:`` (a type-only import still ties the modules
together for a reader, a type checker and the next refactor). Nothing is imported here:
the modules are parsed with :mod:`ast`, so a lazy import cannot hide.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "hookloop"

#: The engine: the loop and what it is built from.
ENGINE = tuple(
    f"{PACKAGE}.{name}"
    for name in ("events", "manager", "state", "callback", "trainer", "checkpoint", "step",
                 "data", "config", "distributed", "local_checkpoints", "rewind",
                 "trainer_checkpoints", "trainer_evaluation")
)  # fmt: skip
#: What sits above the engine; the engine imports none of it.
ABOVE = tuple(f"{PACKAGE}.{name}" for name in ("callbacks", "compat", "control", "cli", "app"))


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
            if parent != PACKAGE and parent != module:
                edges.setdefault(parent, line)  # importing a submodule runs its package
        graph[module] = edges
        todo += [t for t in edges if not any(within(t, above) for above in ABOVE)]
    return graph


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
        "    from hookloop.trainer import Trainer",
        "def later():",
        "    from hookloop.callbacks.jsonlog import JsonLogger",
        "    import hookloop.app.cli",
    ])  # fmt: skip
    found = {ours(name) for name, _ in imports_of("hookloop.state", source)} - {None}
    assert found >= {
        "hookloop.events", "hookloop.manager", "hookloop.step", "hookloop.control",
        "hookloop.control.server", "hookloop.trainer", "hookloop.callbacks.jsonlog",
        "hookloop.app.cli",
    }  # fmt: skip
    trainer = import_graph(("hookloop.trainer",))["hookloop.trainer"]
    assert {"hookloop.manager", "hookloop.state", "hookloop.checkpoint"} <= trainer.keys()


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
    cycles, state = [], {}  # state: 1 on the current path, 2 finished

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(engine[module]):
            if state.get(target) == 1:
                loop = [*path[path.index(target) :], target]
                steps = [f"{a} (line {engine[a][b]})" for a, b in itertools.pairwise(loop)]
                cycles.append(" -> ".join([*steps, target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(engine):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles (type-only imports count):\n" + "\n".join(cycles)
