"""One loop, parts with narrow faces: checked on the source with :mod:`ast`.

- A dialect changes a part by giving a policy or a hook, not by subclassing an engine
  class and overriding most of it: no class under ``compat/`` overrides more than
  :data:`MAX_OVERRIDES` methods (its constructor aside) of a class defined outside it.
- Each part of the loop is built from what it needs: no constructor of a class under
  ``loop/`` or ``checkpoint/`` (or of a dialect's class derived from one) takes more
  than :data:`MAX_PART_ARGUMENTS` arguments, nor the whole parts record.
- One owner writes the run's counters: only :class:`hookloop.state.Progress`'s own
  methods assign them; everyone else calls those methods.
- There is one backward, one gradient clip and one optimizer update in ``src/``:
  ``Precision.backward`` / ``Precision.step`` and the Stepper's clip. DiLoCo's outer
  step is a different algorithm on its own optimizer (named in :data:`OWN_UPDATES`).

:data:`NOT_YET` names what still breaks a rule; it may only shrink.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "hookloop"

MAX_OVERRIDES = 3
MAX_PART_ARGUMENTS = 8

#: Where the parts of the loop are defined.
PART_FOLDERS = ("hookloop/loop/", "hookloop/checkpoint/")

#: Not parts: what a user builds a run from, one keyword per thing given.
USER_FACING = {"Trainer"}

#: The only places that back-propagate, clip, or update the weights.
BACKWARD_AT = {"hookloop/precision.py"}
CLIP_AT = {"hookloop/loop/stepper.py"}
UPDATE_AT = {"hookloop/precision.py"}
#: Updates that are an algorithm's own, on an optimizer it owns (not a training step).
OWN_UPDATES = {
    "hookloop/diloco/outer.py": "DiLoCo's outer Nesterov step on the global weights",
    "hookloop/diloco/rounds.py": "the DiLoCo server's outer step on the averaged deltas",
}

#: Where Progress is defined: its own methods are the counters' only writers.
COUNTERS_OWNER = "hookloop/state.py"

#: What still breaks a rule, and why; may only shrink.
NOT_YET: dict[str, str] = {}


@dataclass
class ClassInfo:
    path: str  # relative to src/, posix
    name: str
    bases: list[str]  # the last dotted part of each base
    methods: set[str]
    init_arguments: list[str]
    init_annotations: list[str]


def _classes() -> list[ClassInfo]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found.append(_info(rel, node))
    return found


def _info(rel: str, node: ast.ClassDef) -> ClassInfo:
    methods = {m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    arguments: list[str] = []
    annotations: list[str] = []
    for m in node.body:
        if isinstance(m, ast.FunctionDef) and m.name == "__init__":
            params = [*m.args.posonlyargs, *m.args.args, *m.args.kwonlyargs][1:]
            arguments = [a.arg for a in params]
            annotations = [ast.unparse(a.annotation) for a in params if a.annotation]
            if m.args.kwarg is not None:  # **parts: everything, by another name
                arguments.append("**" + m.args.kwarg.arg)
    bases = [ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases]
    return ClassInfo(rel, node.name, bases, methods, arguments, annotations)


def _engine(classes: list[ClassInfo]) -> dict[str, list[ClassInfo]]:
    engine: dict[str, list[ClassInfo]] = {}
    for c in classes:
        if not c.path.startswith("hookloop/compat/"):
            engine.setdefault(c.name, []).append(c)
    return engine


def _inherited(name: str, engine: dict[str, list[ClassInfo]], seen: set[str]) -> set[str]:
    """The methods an engine class ``name`` defines or inherits from engine classes."""
    if name in seen or name not in engine:
        return set()
    seen.add(name)
    methods: set[str] = set()
    for c in engine[name]:
        methods |= c.methods
        for base in c.bases:
            methods |= _inherited(base, engine, seen)
    return methods


def overrides(classes: list[ClassInfo]) -> dict[str, list[str]]:
    """``"override path:Class"`` -> the engine methods it redefines (constructor aside),
    for each class under compat/ redefining more than MAX_OVERRIDES."""
    engine = _engine(classes)
    found = {}
    for c in classes:
        if not c.path.startswith("hookloop/compat/"):
            continue
        base_methods: set[str] = set()
        for base in c.bases:
            base_methods |= _inherited(base, engine, set())
        redefined = sorted((c.methods & base_methods) - {"__init__"})
        if len(redefined) > MAX_OVERRIDES:
            found[f"override {c.path}:{c.name}"] = redefined
    return found


def wide_parts(classes: list[ClassInfo]) -> dict[str, list[str]]:
    """``"arguments path:Class"`` -> its constructor's arguments, for each part (or a
    dialect's class derived from one) taking too many, ``**`` everything, or ``Parts``."""
    parts = {c.name for c in classes if c.path.startswith(PART_FOLDERS)}
    found = {}
    for c in classes:
        is_part = c.path.startswith(PART_FOLDERS) or any(
            b in parts and b not in USER_FACING for b in c.bases
        )
        if not is_part or c.name in {"Parts", *USER_FACING}:
            continue
        takes_bag = any("Parts" in a.split("|")[0].split("[")[0] for a in c.init_annotations)
        too_many = len(c.init_arguments) > MAX_PART_ARGUMENTS
        takes_all = any(a.startswith("**") for a in c.init_arguments) and c.name != "Dialect"
        if too_many or takes_bag or takes_all:
            found[f"arguments {c.path}:{c.name}"] = c.init_arguments
    return found


def _calls(attr_names: set[str]) -> list[tuple[str, int, str]]:
    """``(path, line, receiver)`` of each call ``<receiver>.<attr>(...)`` in src/."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in attr_names
            ):
                found.append((rel, node.lineno, ast.unparse(node.func.value)))
    return found


def _progress_fields() -> set[str]:
    tree = ast.parse((SRC / COUNTERS_OWNER).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Progress":
            for item in node.body:
                if isinstance(item, ast.Assign) and ast.unparse(item.targets[0]) == "__slots__":
                    return set(ast.literal_eval(item.value))
    raise AssertionError("Progress.__slots__ not found")


def counter_writes(sources: dict[str, str], fields: set[str]) -> dict[str, list[str]]:
    """``"counters path"`` -> the counter assignments in it, for each file but the owner's.
    A counter is a Progress field assigned on ``st``/``progress``/``<x>.progress``."""
    found: dict[str, list[str]] = {}
    for rel, source in sources.items():
        if rel == COUNTERS_OWNER:
            continue
        for node in ast.walk(ast.parse(source)):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for target in targets:
                for part in ast.walk(target):
                    if not (isinstance(part, ast.Attribute) and part.attr in fields):
                        continue
                    receiver = ast.unparse(part.value)
                    if receiver == "st" or receiver.split(".")[-1].lstrip("_") == "progress":
                        found.setdefault(f"counters {rel}", []).append(
                            f"{node.lineno}: {ast.unparse(part)}"
                        )
    return found


def _sources() -> dict[str, str]:
    return {
        path.relative_to(SRC).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_the_checks_see_what_they_look_for():
    writes = {"hookloop/x.py": "st.step += 1\nself.progress.epoch = 2\nts.step = 3\n"}
    assert counter_writes(writes, {"step", "epoch"}) == {
        "counters hookloop/x.py": ["1: st.step", "2: self.progress.epoch"]
    }
    assert "step" in _progress_fields()
    # Guards the tests below against passing because they measured nothing.
    engine_src = "class Base:\n" + "".join(f"    def m{i}(self): pass\n" for i in range(5))
    compat_src = "class Mine(Base):\n    def __init__(self): pass\n" + "".join(
        f"    def m{i}(self): pass\n" for i in range(4)
    )
    part_src = "class Wide:\n    def __init__(self, a, b, c, d, e, f, g, h, i): pass\n"
    bag_src = "class Bagged:\n    def __init__(self, parts: Parts): pass\n"
    classes = [
        _info("hookloop/loop/base.py", ast.parse(engine_src).body[0]),  # type: ignore[arg-type]
        _info("hookloop/compat/x.py", ast.parse(compat_src).body[0]),  # type: ignore[arg-type]
        _info("hookloop/loop/wide.py", ast.parse(part_src).body[0]),  # type: ignore[arg-type]
        _info("hookloop/loop/bag.py", ast.parse(bag_src).body[0]),  # type: ignore[arg-type]
    ]
    assert overrides(classes) == {"override hookloop/compat/x.py:Mine": ["m0", "m1", "m2", "m3"]}
    assert set(wide_parts(classes)) == {
        "arguments hookloop/loop/wide.py:Wide",
        "arguments hookloop/loop/bag.py:Bagged",
    }
    assert any(path == "hookloop/precision.py" for path, _, _ in _calls({"backward"}))
    assert len(_classes()) > 100


def test_no_dialect_class_overrides_most_of_an_engine_class():
    found = overrides(_classes())
    listed = {k for k in NOT_YET if k.startswith("override ")}
    assert set(found) - listed == set(), {k: v for k, v in found.items() if k not in listed}
    assert listed - set(found) == set(), (
        f"now within the rule, take off NOT_YET: {listed - set(found)}"
    )


def test_each_part_is_built_from_what_it_needs():
    found = wide_parts(_classes())
    listed = {k for k in NOT_YET if k.startswith("arguments ")}
    assert set(found) - listed == set(), {k: v for k, v in found.items() if k not in listed}
    assert listed - set(found) == set(), (
        f"now within the rule, take off NOT_YET: {listed - set(found)}"
    )


def test_one_backward_one_clip_one_update_in_src():
    backward = {
        (path, line, receiver)
        for path, line, receiver in _calls({"backward"})
        if path not in BACKWARD_AT and not receiver.endswith("precision")
    }
    assert backward == set(), "a backward outside Precision.backward"
    clips = {c for c in _calls({"clip_grad_norm_", "clip_grad_value_"}) if c[0] not in CLIP_AT}
    assert clips == set(), "a gradient clip outside the Stepper"
    updates = {
        (path, line, receiver)
        for path, line, receiver in _calls({"step"})
        if "optim" in receiver.lower() or receiver.endswith("_sgd")
    }
    stray = {u for u in updates if u[0] not in UPDATE_AT | set(OWN_UPDATES)}
    assert stray == set(), "an optimizer update outside Precision.step"


def test_only_progress_writes_the_counters():
    found = counter_writes(_sources(), _progress_fields())
    listed = {k for k in NOT_YET if k.startswith("counters ")}
    assert set(found) - listed == set(), {k: v for k, v in found.items() if k not in listed}
    assert listed - set(found) == set(), (
        f"now within the rule, take off NOT_YET: {listed - set(found)}"
    )
