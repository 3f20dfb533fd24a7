"""The docs stay honest: links resolve, the README stays short and runs, systems by name."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SCRIPTS = ROOT / "scripts"
PAGES = [
    README,
    ROOT / "CONTRIBUTING.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) (.+)$", re.M)


def _prose(text: str) -> str:
    """The text with fenced code blocks blanked (their lines kept, for line numbers)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, title in HEADING.findall(_prose(path.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    prose = _prose(path.read_text(encoding="utf-8"))
    return [
        (prose.count("\n", 0, m.start()) + 1, m.group(1))
        for m in LINK.finditer(prose)
        if not re.match(r"[a-z][a-z0-9+.-]*:", m.group(1))  # http:, mailto: ...
    ]


def test_the_pages_exist():
    names = {p.name for p in PAGES}
    for page in (
        "training.md",
        "callbacks.md",
        "checkpoints.md",
        "cli.md",
        "distributed.md",
        "control.md",
        "tune.md",
        "performance.md",
        "megatron-bridge.md",
        "transformers-trainer.md",
        "forgather.md",
        "hpo-trainer.md",
    ):
        assert page in names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_an_existing_file_and_heading(page):
    broken = []
    for line, target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page
        if not dest.exists():
            broken.append(f"line {line}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"line {line}: {target} (no such heading in {dest.name})")
    assert not broken, "\n".join(broken)


def test_the_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200


def test_the_readme_second_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()[-1]
    assert ci in README.read_text(encoding="utf-8").splitlines()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_systems_are_called_by_their_names(page):
    # each system by its name, never by a document number; the deprecated module path
    # hookloop.compat.hf.seed004 (still importable for one release) is not prose.
    found = re.findall(r"\bseed[ -]\d{3}\b", page.read_text(encoding="utf-8"), re.I)
    assert not found


def _python_blocks(page: Path) -> list[str]:
    return [
        m.group(2)
        for m in FENCE.finditer(page.read_text(encoding="utf-8"))
        if m.group(1) == "python"
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_parses(page):
    for block in _python_blocks(page):
        ast.parse(block)


def test_the_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks(README)
    assert blocks
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(block, str(README), "exec"), {"__name__": "__readme__"})
    assert "step 20: loss" in out.getvalue()


# Python blocks of docs/ that are not run, each with the reason; a block is named by its
# page and a piece of its text. Every other block runs (test below).
NOT_RUN = {
    ("architecture.md", "schedule.at_step_end()"): "pseudocode: `schedule` is the loop's own",
    ("distributed.md", 'parallel="fsdp"'): "FSDP2 needs ranks started by torchrun",
    ("forgather.md", "DiLoCoCallback(server_addr"): "needs a DiLoCo server and its fleet",
    ("hpo-trainer.md", "runner.native()).train()"): "a fragment: `model` and the data are yours",
    ("performance.md", "trainer.callbacks.profile()"): "a fragment: `trainer` is yours",
}

_RUN_BLOCKS = """
import os, sys, tempfile
for path, name in zip(sys.argv[1::2], sys.argv[2::2]):
    os.chdir(tempfile.mkdtemp())
    exec(compile(open(path, encoding="utf-8").read(), name, "exec"), {"__name__": "__docs__"})
    print("ran", name, file=sys.stderr, flush=True)
"""


def test_the_docs_python_blocks_run_or_say_why_not(tmp_path):
    # One fresh interpreter for all of them: a block may register request kinds or
    # actions, which must not leak into the other tests.
    args, used = [], set()
    for page in sorted((ROOT / "docs").glob("*.md")):
        for i, block in enumerate(_python_blocks(page)):
            skips = [key for key in NOT_RUN if key[0] == page.name and key[1] in block]
            assert len(skips) <= 1, skips
            if skips:
                used.add(skips[0])
                continue
            path = tmp_path / f"{page.stem}-{i}.py"
            path.write_text(block, encoding="utf-8")
            args += [str(path), f"docs/{page.name} block {i}"]
    assert used == set(NOT_RUN), f"skips that match no block: {set(NOT_RUN) - used}"
    done = subprocess.run(
        [sys.executable, "-c", _RUN_BLOCKS, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("ran docs/") == len(args) // 2


def _docs_reference():
    spec = importlib.util.spec_from_file_location("docs_reference", SCRIPTS / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_page_is_what_the_code_generates():
    page = ROOT / "docs" / "config.md"
    assert page.read_text(encoding="utf-8") == _docs_reference().config_reference(), (
        "docs/config.md is stale: run .venv/bin/python scripts/docs_reference.py"
    )


def test_the_priority_table_is_what_the_code_generates():
    text = (ROOT / "docs" / "callbacks.md").read_text(encoding="utf-8")
    assert text == _docs_reference().with_priority_table(text), (
        "docs/callbacks.md's priority table is stale: run .venv/bin/python "
        "scripts/docs_reference.py"
    )


def test_the_priority_list_has_one_copy_in_the_code():
    # the bands live in hookloop.callback.PRIORITY_BANDS, each priority on its class
    from hookloop.callback import PRIORITY_BANDS

    for path in (ROOT / "src" / "hookloop" / "callback.py", *PAGES):
        text = path.read_text(encoding="utf-8")
        if path.name == "callbacks.md":
            text = text.replace(_docs_reference().priority_table(), "")
        assert "90\u201394" not in text and "90-94" not in text, path
    init = (ROOT / "src" / "hookloop" / "callbacks" / "__init__.py").read_text(encoding="utf-8")
    assert "NaNDetection 5" not in init and "PRIORITY_BANDS" in init
    assert [band[0] for band in PRIORITY_BANDS] == sorted(band[0] for band in PRIORITY_BANDS)


def test_the_builtin_callbacks_table_lists_each_with_its_real_keys():
    text = (ROOT / "docs" / "callbacks.md").read_text(encoding="utf-8")
    start = text.index("| callback | what it does |")
    table = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    from hookloop.config import Config, describe

    keys = {key for key, _, _ in describe(Config())}
    listed = []
    for row in table:
        names, _, config = [c.strip() for c in row.strip("|").split("|")]
        listed += re.findall(r"`(\w+)`", names)
        assert set(re.findall(r"`([\w.]+)`", config)) <= keys, row
    # every built-in once, in priority order
    priorities = dict(_docs_reference().builtin_priorities())
    assert sorted(listed) == sorted(priorities)
    assert [priorities[n] for n in listed] == sorted(priorities[n] for n in listed)
