"""Modules meet through public names: nothing reaches into another module's privates,
and nothing patches torch, transformers, TensorBoard or Optuna.

Read from the source with :mod:`ast` (nothing of hookloop is imported; the package is
the one on ``sys.path``, so ``PYTHONPATH=other/src`` checks another tree). A leading
underscore is a module's own business: ``x._name`` is allowed only where ``_name`` is an
attribute the same file defines (a method, a class attribute, ``self._name = ...``); a
module-level function or variable of that name does not count, so a local
``def _storage`` does not excuse ``study._storage``. Names are followed through local
aliases: a name bound to an import, or assigned from anything reached through one
(``rw = record_writer``, ``x = torch.load(f)``, ``m = importlib.import_module(...)``),
is third party, and so is ``getattr(x, "_name")``. A private attribute of hookloop's own
used on another object, when torch, transformers, TensorBoard or Optuna also has a name
so spelt, is listed with a reason (the object might be theirs). Third-party privates
(``torch._foreach_*``, a library object's ``_attr``, ``from torch._x import``) are
allowed only where listed below, each with its reason; the loop's own parts use none,
so a torch release can change its internals without changing what the loop does.
Assigning or deleting an attribute of one of those four libraries' modules, classes or
functions (``rw.masked_crc32c = ...``, ``setattr(torch.nn.Module, ...)``) changes them
for the whole process, and is refused outright.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

PACKAGE = Path(importlib.util.find_spec("hookloop").origin).parent

#: The libraries hookloop must neither patch nor reach into (their version moves under us).
GUARDED = ("torch", "transformers", "tensorboard", "optuna")

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
    ("checkpoint/storage.py", "os._exit"): "documented in the standard library (crash tests)",
    ("tune/worker.py", "os._exit"): "documented in the standard library",
    ("watchdog.py", "os._exit"):
        "documented in the standard library: a thread ends a process whose main thread is stuck",
    ("watchdog.py", "sys._current_frames"):
        "documented in the standard library: the one way to read another thread's stack",
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
    ("compat/hpo/faces.py", "trainer._total_epochs"):
        "the HPO trainer's own epoch count, read (if there) on the user's own trainer",
}  # fmt: skip

#: Private attributes of hookloop's own, used on another object, that one of GUARDED also
#: spells so: (file, the name as written) -> whose attribute it is.
SHARED_SPELLING: dict[tuple[str, str], str] = {
    ("callbacks/_writer.py", "_WRITER._after_fork"): "the method of hookloop's own LogWriter",
    ("checkpoint/manager.py", "self.manager._write"):
        "the method of hookloop's own CheckpointManager",
    ("compat/hf/adapter.py", "session._predictions"): "the field of hookloop's own HFSession",
}  # fmt: skip

#: Attributes of GUARDED modules, classes or functions that hookloop assigns: none.
PATCHES: dict[tuple[str, str], str] = {}


#: Underscored names that are documented public API: namedtuple's (the underscore keeps
#: them apart from field names).
DOCUMENTED = {"_fields", "_field_defaults", "_asdict", "_replace", "_make"}


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in DOCUMENTED


def _ours(module: str | None) -> bool:
    return (module or "").split(".")[0] == "hookloop"


def _origin(node: ast.AST) -> ast.AST:
    """The name an expression is reached from: ``a`` of ``a.b(c)[d].e``."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript, ast.Starred)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _chain(node: ast.AST) -> bool:
    """``a`` or ``a.b.c``: a name for the thing itself, not for something made from it."""
    return isinstance(_origin(node), ast.Name) and all(
        isinstance(n, (ast.Name, ast.Attribute, ast.Load)) for n in ast.walk(node)
    )


def _imported_module(node: ast.AST) -> str | None:
    """The top package of ``importlib.import_module("x.y")``, ``__import__("x")`` or
    ``sys.modules["x.y"]`` (``"?"`` when the name is not a constant)."""
    if isinstance(node, ast.Call) and ast.unparse(node.func) in (
        "importlib.import_module", "import_module", "__import__", "sys.modules.get",
    ):  # fmt: skip
        arg = node.args[0] if node.args else None
    elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
        arg = node.slice
    else:
        return None
    is_name = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    return arg.value.split(".")[0] if is_name else "?"


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _scopes(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    """Each node's scope: the function (or lambda) it is in, else the module."""
    scope_of: dict[ast.AST, ast.AST] = {}
    pending = [(tree, tree)]
    while pending:
        node, scope = pending.pop()
        for child in ast.iter_child_nodes(node):
            scope_of[child] = scope
            pending.append((child, child if isinstance(child, _SCOPES) else scope))
    return scope_of


def _bindings(tree: ast.Module) -> list[tuple[ast.AST, list[str], ast.AST]]:
    """``(the node, names bound, the expression they are bound from)`` for every
    assignment, ``for``, ``with ... as`` and ``:=`` in the file."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            pairs = [(node.target, node.value)]
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            pairs = [(node.target, node.iter)]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            pairs = [(i.optional_vars, i.context_expr) for i in node.items if i.optional_vars]
        else:
            continue
        for target, value in pairs:
            names = [
                n.id
                for n in ast.walk(target)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            ]
            found.append((value, names, value))
    return found


class FileNames:
    """What one file's names are, scope by scope (a function's own names hide the
    module's): imports of other packages and their aliases, names holding something
    reached through them, and the private attributes the file defines."""

    def __init__(self, tree: ast.Module) -> None:
        self.scope_of = _scopes(tree)
        self.scope_of[tree] = tree
        self._bound = self._bound_names(tree)
        #: (scope, name) -> the top package of the module, class or function it names
        self.aliases: dict[tuple[ast.AST, str], str] = {}
        #: (scope, name) of names assigned from anything reached through an alias
        self.derived: set[tuple[ast.AST, str]] = set()
        for node in ast.walk(tree):
            scope = self.scope_of[node]
            if isinstance(node, ast.Import):
                for a in node.names:
                    if not _ours(a.name):
                        name = a.asname or a.name.split(".")[0]
                        self.aliases[(scope, name)] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and not _ours(node.module):
                top = (node.module or "").split(".")[0]
                self.aliases.update({(scope, a.asname or a.name): top for a in node.names})
        self._follow(_bindings(tree))
        self.attributes = _attributes(tree, self)

    def _bound_names(self, tree: ast.Module) -> dict[ast.AST, set[str]]:
        """The names each scope binds (its parameters, assignments, imports, defs)."""
        bound: dict[ast.AST, set[str]] = {tree: set()}
        declared: dict[ast.AST, set[str]] = {}  # ``global``/``nonlocal``: bound elsewhere
        for node in ast.walk(tree):
            scope = self.scope_of[node]
            names: list[str] = []
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names = [node.id]
            elif isinstance(node, ast.arg):
                names = [node.arg]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [(a.asname or a.name).split(".")[0] for a in node.names]
            elif isinstance(node, (*_SCOPES[:2], ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                declared.setdefault(scope, set()).update(node.names)
            bound.setdefault(scope, set()).update(names)
        for scope, names in declared.items():
            bound[scope] -= names
        return bound

    def resolve(self, name: str, node: ast.AST) -> tuple[ast.AST, str] | None:
        """``(scope, name)`` of the binding ``name`` means at ``node``."""
        scope = self.scope_of[node]
        while True:
            if name in self._bound.get(scope, ()):
                return (scope, name)
            if scope not in self.scope_of or self.scope_of[scope] is scope:
                return None
            scope = self.scope_of[scope]

    def _follow(self, bindings: list[tuple[ast.AST, list[str], ast.AST]]) -> None:
        changed = True
        while changed:  # until no binding adds a name: ``a = b`` may come before ``b = torch``
            changed = False
            for where, names, value in bindings:
                origin = _origin(value)
                key = self.resolve(origin.id, origin) if isinstance(origin, ast.Name) else None
                top = _imported_module(value)
                if top is None and _chain(value) and key in self.aliases:
                    top = self.aliases[key]
                for name in names:
                    target = self.resolve(name, where)
                    if target is None or name in ("self", "cls") or target in self.aliases:
                        continue
                    if top is not None and len(names) == 1:
                        self.aliases[target], changed = top, True
                    elif self.third(origin) and target not in self.derived:
                        self.derived.add(target)
                        changed = True

    def third(self, origin: ast.AST) -> bool:
        """Whether a name is another package's, or something reached through one."""
        if not isinstance(origin, ast.Name):
            return False
        key = self.resolve(origin.id, origin)
        return key in self.aliases or key in self.derived

    def guarded_thing(self, node: ast.AST) -> bool:
        """Whether ``node`` names a module, class or function of torch, transformers,
        TensorBoard or Optuna (``rw``, ``torch.nn.Module``), not an object made by one."""
        while isinstance(node, ast.Attribute):
            node = node.value
        top = _imported_module(node)
        if top is None and isinstance(node, ast.Name):
            top = self.aliases.get(self.resolve(node.id, node))
        return top in (*GUARDED, "?")


def _attributes(tree: ast.Module, names: FileNames) -> set[str]:
    """Private attributes the file defines: its classes' methods and class attributes,
    attributes it assigns on anything not third party, and ``__slots__`` entries."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.add(stmt.name)
                elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    found |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for sub in (s for t in targets for s in ast.walk(t)):
                if isinstance(sub, ast.Attribute) and not names.third(_origin(sub)):
                    found.add(sub.attr)
            slots = any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets)
            if slots and node.value is not None:
                found |= {
                    c.value for c in ast.walk(node.value)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }  # fmt: skip
    return {n for n in found if _private(n)}


def _attribute_uses(tree: ast.Module) -> list[tuple[int, ast.AST, str]]:
    """``(line, object, name)`` for each ``x._name`` and ``getattr``/``hasattr``/
    ``setattr``/``delattr`` of a private name given as a string."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            uses.append((node.lineno, node.value, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            uses.append((node.lineno, node.args[0], node.args[1].value))
    return uses


def _accesses(rel: str, tree: ast.Module) -> list[tuple[str, int, str, str]]:
    """``(file, line, expression, kind)`` for each private name the file reaches that is not
    its own. ``kind``: ``"third"`` (reached through another package), ``"foreign"`` (not
    defined here: another module's, or a library object's held under a plain name),
    ``"shared"`` (defined here, used on another object, and a name torch, transformers,
    TensorBoard or Optuna also has)."""
    names = FileNames(tree)
    found = []
    for line, obj, attr in _attribute_uses(tree):
        expr = f"{ast.unparse(obj)}.{attr}"
        if names.third(_origin(obj)):
            found.append((rel, line, expr, "third"))
        elif attr not in names.attributes:
            found.append((rel, line, expr, "foreign"))
        elif not (isinstance(obj, ast.Name) and obj.id in ("self", "cls")):
            found.append((rel, line, expr, "shared?"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _ours(node.module) and node.level == 0:
            found += [
                (rel, node.lineno, f"{node.module}.{a.name}", "foreign")
                for a in node.names
                if _private(a.name)
            ]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            )
            for parts in ((m or "").split(".") for m in modules):
                if not _ours(parts[0]) and any(_private(p) for p in parts):
                    private = next(i for i, p in enumerate(parts) if _private(p))
                    found.append((rel, node.lineno, ".".join(parts[: private + 1]), "third"))
    spelt = _spelt_by_guarded(
        frozenset(e.rsplit(".", 1)[1] for *_, e, k in found if k == "shared?")
    )
    return [
        (rel, line, expr, "shared") if kind == "shared?" else (rel, line, expr, kind)
        for rel, line, expr, kind in found
        if kind != "shared?" or expr.rsplit(".", 1)[1] in spelt
    ]


@cache
def _spelt_by_guarded(candidates: frozenset[str]) -> frozenset[str]:
    """Which of ``candidates`` appear as a word in the installed sources of GUARDED."""
    if not candidates:
        return frozenset()
    words = {name: re.compile(rf"\b{re.escape(name)}\b") for name in candidates}
    seen: set[str] = set()
    for top in GUARDED:
        spec = importlib.util.find_spec(top)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for path in Path(folder).rglob("*.py"):
                text = path.read_text(encoding="utf-8", errors="replace")
                seen |= {n for n in candidates - seen if n in text and words[n].search(text)}
                if seen == candidates:
                    return frozenset(seen)
    return frozenset(seen)


def _patches(rel: str, tree: ast.Module) -> list[tuple[str, int, str]]:
    """``(file, line, target)`` for each attribute of a GUARDED module, class or function
    that the file assigns, deletes, ``setattr``s or writes through ``vars()``/``__dict__``."""
    names = FileNames(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in _unpacked(targets):
                owner = None
                if isinstance(target, ast.Attribute):
                    owner = target.value
                elif isinstance(target, ast.Subscript):
                    held = target.value  # vars(m)[k] = ... or m.__dict__[k] = ...
                    if isinstance(held, ast.Call) and ast.unparse(held.func) == "vars":
                        owner = held.args[0] if held.args else None
                    elif isinstance(held, ast.Attribute) and held.attr == "__dict__":
                        owner = held.value
                if owner is not None and names.guarded_thing(owner):
                    found.append((rel, node.lineno, ast.unparse(target)))
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("setattr", "delattr")
            and node.args
            and names.guarded_thing(node.args[0])
        ):
            found.append((rel, node.lineno, ast.unparse(node)))
    return found


def _unpacked(targets: list[ast.expr]) -> list[ast.expr]:
    """The targets of ``a, (b.c, *d) = ...`` one by one."""
    found = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets = [*targets, *target.elts]
        else:
            found.append(target.value if isinstance(target, ast.Starred) else target)
    return found


@cache
def _tree_accesses() -> list[tuple[str, int, str, str]]:
    return [access for rel, tree in _modules() for access in _accesses(rel, tree)]


def _scan(source: str) -> tuple[set[tuple[str, str]], set[str]]:
    """``({(expression, kind)}, {patched targets})`` of a piece of source, as a file."""
    tree = ast.parse(source)
    return (
        {(expr, kind) for _, _, expr, kind in _accesses("x.py", tree)},
        {target for _, _, target in _patches("x.py", tree)},
    )


def test_the_scan_sees_private_access_of_each_kind():
    # Guards the tests below against passing because the scan saw nothing.
    accesses, patches = _scan(
        "import torch\nfrom torch._dynamo import config\nclass A:\n    def f(self, other):\n"
        "        self._mine = 1\n        return other._theirs, torch._foreach_norm, self._mine\n"
    )
    assert accesses == {
        ("torch._dynamo", "third"), ("other._theirs", "foreign"),
        ("torch._foreach_norm", "third"),
    }  # fmt: skip
    assert patches == set()


def test_the_scan_sees_through_local_aliases_and_refuses_patches():
    # A module bound under another name, then patched: by assignment, setattr, vars().
    _, patches = _scan(
        "from tensorboard.summary.writer import record_writer as rw\n"
        "rw.masked_crc32c = len\n"
        "import importlib, sys, torch\n"
        "m = importlib.import_module('optuna.study')\nsetattr(m, 'Study', None)\n"
        "nn = torch.nn\nnn.Module.forward = None\ndel sys.modules['transformers'].Trainer\n"
        "vars(torch)['load'] = None\nt = torch.zeros(3)\nt.grad = None\n"
    )
    assert patches == {
        "rw.masked_crc32c",
        "setattr(m, 'Study', None)",
        "nn.Module.forward",
        "sys.modules['transformers'].Trainer",
        "vars(torch)['load']",
    }  # t.grad is an attribute of a tensor, not of torch: not a patch
    # A private name reached through a local name, a string, or an object made by a library.
    accesses, _ = _scan(
        "import optuna\ndef _storage():\n    pass\n"  # a local function of the same name
        "def f(study):\n    x = study\n    return x._storage, getattr(study, '_storage')\n"
        "s = optuna.load_study(study_name='a', storage='sqlite://')\nrows = s._storage\n"
    )
    assert accesses == {
        ("x._storage", "foreign"),
        ("study._storage", "foreign"),
        ("s._storage", "third"),
    }
    # An attribute this file's class also has, on another object: Optuna spells it too.
    # A function's own ``s`` (a Box) is not the module's ``s`` (a study).
    accesses, _ = _scan(
        "import optuna\ns = optuna.load_study(study_name='a', storage='sqlite://')\n"
        "class Box:\n    def __init__(self):\n        self._storage = {}\n"
        "    def _hookloop_only_name(self):\n        pass\n"
        "def f(study, box):\n    return study._storage, box._hookloop_only_name\n"
        "def g():\n    s = Box()\n    return s._hookloop_only_name\n"
    )
    assert accesses == {("study._storage", "shared")}


def test_no_module_reaches_into_a_private_name_it_does_not_define():
    problems = [
        f"src/hookloop/{rel}:{line} uses {expr}"
        for rel, line, expr, kind in _tree_accesses()
        if kind == "foreign" and (rel, expr) not in THIRD_PARTY
    ]
    assert not problems, "private names this file does not define:\n" + "\n".join(problems)


def test_no_module_patches_torch_transformers_tensorboard_or_optuna():
    patched = [
        f"src/hookloop/{rel}:{line} assigns {target}"
        for rel, tree in _modules()
        for rel, line, target in _patches(rel, tree)
        if (rel, target) not in PATCHES
    ]
    assert not patched, "changes another library for the whole process:\n" + "\n".join(patched)


def test_own_private_names_that_a_guarded_library_also_spells_are_listed():
    shared = {(rel, expr) for rel, _, expr, kind in _tree_accesses() if kind == "shared"}
    assert not shared - SHARED_SPELLING.keys(), (
        "a private attribute used on another object, spelt as in torch, transformers, "
        f"TensorBoard or Optuna; list whose it is: {sorted(shared - SHARED_SPELLING.keys())}"
    )
    assert not SHARED_SPELLING.keys() - shared, "listed but no longer used (remove them)"
    assert all(reason.strip() for reason in SHARED_SPELLING.values())


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
    used = {(rel, expr) for rel, _, expr, kind in _tree_accesses() if kind == "third"}
    unlisted = sorted(used - THIRD_PARTY.keys())
    assert not unlisted, f"third-party private names used without a reason listed here: {unlisted}"
    in_the_loop = sorted(k for k in used if k[0].startswith(ENGINE_PARTS))
    listed_there = sorted(k for k in THIRD_PARTY if k[0].startswith(ENGINE_PARTS))
    assert in_the_loop == listed_there == [("checkpoint/storage.py", "os._exit")]
    stale = sorted(THIRD_PARTY.keys() - {(rel, expr) for rel, _, expr, _ in _tree_accesses()})
    assert not stale, f"listed but no longer used (remove them): {stale}"
    assert all(reason.strip() for reason in THIRD_PARTY.values())
