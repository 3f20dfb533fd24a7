"""Modules meet through public names: nothing reaches into another module's privates.

Read from the source with :mod:`ast` (nothing is imported). A leading underscore is a
module's own business: ``x._name`` is allowed only where ``_name`` is defined in the
same file (its own classes, functions and attributes), and a class never uses or
overrides a private name of a base class that another module defines. Third-party
privates (``torch._foreach_*``, a library object's ``_attr``, ``from torch._x import``)
are allowed only where listed below, each with its reason; the loop's own parts use
none at all, so a torch release can change its internals without changing what the
loop does.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "hookloop"

#: The loop and its parts: no third-party private name at all.
ENGINE_PARTS = ("loop/", "checkpoint/", "step.py", "requests.py", "state.py", "precision.py",
                "data.py", "manager.py", "events.py", "callback.py")  # fmt: skip

#: Third-party private names still used, where, and why (file, the name as written).
THIRD_PARTY = {
    ("callbacks/memory.py", "torch.cuda.memory._record_memory_history"):
        "torch documents the memory snapshot API under this name",
    ("callbacks/memory.py", "torch.cuda.memory._dump_snapshot"):
        "torch documents the memory snapshot API under this name",
    ("compat/forgather/callbacks/memory.py", "torch.cuda.memory._record_memory_history"):
        "torch documents the memory snapshot API under this name",
    ("compat/forgather/callbacks/memory.py", "torch.cuda.memory._dump_snapshot"):
        "torch documents the memory snapshot API under this name",
    ("callbacks/tensorboard.py", "event_file_writer._global_uid"):
        "TensorBoard's own event-file name counter, so files are named as TensorBoard names them",
    ("checkpoint/storage.py", "os._exit"): "documented in the standard library (crash tests)",
    ("tune/worker.py", "os._exit"): "documented in the standard library",
    ("compat/megatron_bridge/training/megatron_core.py",
     "inner._copy_main_params_to_param_buffer"):
        "Megatron-Core's DistributedOptimizer refreshes its mxfp8 buffer only under this name",
    ("compile.py", "torch._dynamo"): "torch.compile's capability probe has no public name",
    ("compile.py", "torch._inductor"): "the C++ compiler probe of torch.compile's backend",
    ("compile.py", "torch.utils._triton"): "torch.compile's Triton probe has no public name",
    ("compile.py", "model._orig_mod"):
        "the eager module inside torch.compile's wrapper; torch names it so in every state_dict",
    ("distributed.py", "dist.distributed_c10d._get_default_store"):
        "the default store must outlive every rank's teardown; torch gives no public handle",
}  # fmt: skip


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.Module) -> set[str]:
    """Private names a file defines: functions, classes, names and attributes it
    assigns, and string constants such as ``__slots__`` entries."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for sub in (s for t in targets for s in ast.walk(t)):
                if isinstance(sub, ast.Name):
                    names.add(sub.id)
                elif isinstance(sub, ast.Attribute):
                    names.add(sub.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return {n for n in names if _private(n)}


def _third_party_roots(tree: ast.Module) -> set[str]:
    """Names bound to a module or object imported from outside hookloop."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not _ours(node.module):
            roots |= {a.asname or a.name for a in node.names}
    return roots - {"hookloop"}


def _ours(module: str | None) -> bool:
    return (module or "").startswith("hookloop")


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _accesses() -> list[tuple[str, int, str, bool]]:
    """``(file, line, expression, third party?)`` for every ``x._name`` the file does
    not define, every private name imported from another module of hookloop, and every
    import of a private module from outside hookloop."""
    found = []
    for rel, tree in _modules():
        own, roots = _defined(tree), _third_party_roots(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                root = _root(node)
                third = isinstance(root, ast.Name) and root.id in roots
                if third or node.attr not in own:
                    found.append((rel, node.lineno, ast.unparse(node), third))
            elif isinstance(node, ast.ImportFrom) and _ours(node.module) and node.level == 0:
                found += [
                    (rel, node.lineno, f"{node.module}.{a.name}", False)
                    for a in node.names
                    if _private(a.name)
                ]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                for module in modules:
                    parts = module.split(".")
                    if parts[0] != "hookloop" and any(_private(p) for p in parts):
                        private = next(i for i, p in enumerate(parts) if _private(p))
                        found.append((rel, node.lineno, ".".join(parts[: private + 1]), True))
    return found


def test_the_scan_sees_private_access_of_each_kind():
    # Guards the tests below against passing because the scan saw nothing.
    tree = ast.parse(
        "import torch\nfrom torch._dynamo import config\nclass A:\n    def f(self, other):\n"
        "        self._mine = 1\n        return other._theirs, torch._foreach_norm, self._mine\n"
    )
    assert _defined(tree) == {"_mine"}
    assert _third_party_roots(tree) == {"torch", "config"}
    exprs = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert {"other._theirs", "torch._foreach_norm", "self._mine"} <= exprs


def test_no_module_reaches_into_a_private_name_another_hookloop_module_defines():
    problems = [
        f"src/hookloop/{rel}:{line} uses {expr}"
        for rel, line, expr, third in _accesses()
        if not third and (rel, expr) not in THIRD_PARTY
    ]
    assert not problems, "private names used across modules:\n" + "\n".join(problems)


def test_no_class_uses_or_overrides_a_private_of_a_base_class_in_another_module():
    classes: dict[tuple[str, str], tuple[list[str], set[str]]] = {}
    imported: dict[str, dict[str, tuple[str, str]]] = {}
    for rel, tree in _modules():
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        imported[module] = {
            a.asname or a.name: (node.module.removeprefix("hookloop."), a.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hookloop.")
            for a in node.names
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                used = {
                    sub.name
                    for sub in ast.walk(node)
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))
                } | {
                    sub.attr
                    for sub in ast.walk(node)
                    if isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id in ("self", "cls")
                }
                bases = [ast.unparse(b) for b in node.bases]
                classes[(module, node.name)] = (bases, {n for n in used if _private(n)})
    problems = []
    for (module, name), (bases, used) in classes.items():
        for base in bases:
            where = imported[module].get(base)
            if where is None or where not in classes:
                continue
            shared = sorted(used & classes[where][1])
            if shared:
                problems.append(f"{module}.{name} (base {where[0]}.{where[1]}): {shared}")
    assert not problems, "private names shared with a base class elsewhere:\n" + "\n".join(problems)


def test_third_party_private_names_are_the_listed_ones_and_the_loop_uses_none():
    used = {(rel, expr) for rel, _, expr, third in _accesses() if third}
    unlisted = sorted(used - THIRD_PARTY.keys())
    assert not unlisted, "third-party private names used without a reason listed here: " + str(
        unlisted
    )
    in_the_loop = sorted(k for k in used if k[0].startswith(ENGINE_PARTS))
    listed_there = sorted(k for k in THIRD_PARTY if k[0].startswith(ENGINE_PARTS))
    assert in_the_loop == listed_there == [("checkpoint/storage.py", "os._exit")]
    stale = sorted(THIRD_PARTY.keys() - {(rel, expr) for rel, _, expr, _ in _accesses()})
    assert not stale, f"listed but no longer used (remove them): {stale}"
