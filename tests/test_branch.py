"""``hookloop train --branch RUN@STEP --out NEW``: a new run from one checkpoint of another,
and how ``hookloop runs`` and ``hookloop plot`` show it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _quiet import SERVICES_OFF
from hookloop.app.branch import parent_problem, read_origin
from hookloop.app.cli import main
from hookloop.loop.changes import read_changes

QUIET = ("logging.progress=false", "callbacks.info=false", *SERVICES_OFF)
#: Every run here: 20 steps of mlp-regression, a checkpoint every 5 (all kept).
RECIPE = ("--recipe", "mlp-regression")
SETTINGS = ("checkpoint.every=5", "checkpoint.keep_last=null", "train.log_every=5",
            "train.eval_every=10", *QUIET)  # fmt: skip
FINAL = Path("checkpoints") / "step-00000020" / "model.safetensors"


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return int(code), out.getvalue(), err.getvalue()


def _train(*argv: str) -> str:
    code, _, err = _run(["train", *argv])
    assert code == 0, err
    return err


def _same_weights(a: Path, b: Path) -> bool:
    left, right = load_file(a / FINAL), load_file(b / FINAL)
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """``plain``: 20 steps at lr 0.05. ``steered``: the same run, with ``lr=0.02`` recorded at
    step 10 by a real resume (10 steps, then ``--resume auto optimizer.lr=0.02``); its
    checkpoint at step 10 was written before the change."""
    root = tmp_path_factory.mktemp("branch")
    plain, steered = root / "plain", root / "steered"
    _train(*RECIPE, "--out", str(plain), "train.max_steps=20", *SETTINGS)
    _train(*RECIPE, "--out", str(steered), "train.max_steps=10", *SETTINGS)
    _train("--out", str(steered), "--resume", "auto", "train.max_steps=20", "optimizer.lr=0.02",
           *QUIET)  # fmt: skip
    assert [r["step"] for r in read_changes(steered / "changes.jsonl")] == [10]
    assert not _same_weights(plain, steered)  # the change made a difference
    return {"root": root, "plain": plain, "steered": steered}


# -- what a branch trains -------------------------------------------------------------------


@pytest.mark.parametrize("step", [10, 15])
def test_a_branch_without_changes_ends_bitwise_on_its_parents_weights(runs, step):
    new = runs["root"] / f"same-{step}"
    _train("--branch", f"{runs['steered']}@{step}", "--out", str(new), *QUIET)
    assert _same_weights(new, runs["steered"])
    origin = read_origin(new)
    assert origin is not None and (origin.run, origin.step) == (str(runs["steered"]), step)
    records = read_changes(new / "changes.jsonl")
    assert records[0]["branch"]["step"] == step and records[0]["values"] == {}
    # the parent's change at step 10 is carried over (at 10 it was made after the save)
    assert [r["values"] for r in records[1:]] == [{"lr": 0.02}]


def test_changes_recorded_after_the_branch_step_are_not_applied(runs):
    new = runs["root"] / "before-change"
    err = _train("--branch", f"{runs['steered']}@5", "--out", str(new), *QUIET)
    assert "0 recorded change(s)" in err
    assert _same_weights(new, runs["plain"])  # the lr change at step 10 never happened
    assert [r["client"] for r in read_changes(new / "changes.jsonl")] == ["branch"]


def test_a_branch_with_a_new_lr_equals_a_replay_of_that_change_recorded_at_the_step(runs):
    new = runs["root"] / "lr-branch"
    err = _train("--branch", f"{runs['plain']}@10", "--out", str(new), "optimizer.lr=0.02",
                 *QUIET)  # fmt: skip
    assert "optimizer.lr changed: 0.05 -> 0.02 (a recorded change at step 10)" in err
    replay = runs["root"] / "replay-steered"
    _train("--replay", str(runs["steered"]), "--out", str(replay), *QUIET)
    assert [r["step"] for r in read_changes(replay / "changes.jsonl")] == [10]
    assert _same_weights(new, replay)
    assert not _same_weights(new, runs["plain"])
    # the change is a record at step 10, not config: config.yaml keeps the parent's lr
    (record,) = read_changes(new / "changes.jsonl")[1:]
    assert (record["step"], record["values"]) == (10, {"lr": 0.02})
    assert "lr: 0.05" in (new / "config.yaml").read_text()
    # the branch's changes.jsonl is its whole story: a replay of it from scratch lands there
    again = runs["root"] / "replay-branch"
    _train("--replay", str(new), "--out", str(again), *QUIET)
    assert _same_weights(again, new)


def test_a_branch_killed_before_its_first_save_resumes_onto_the_same_weights(runs):
    new = runs["root"] / "lr-branch-2"
    _train("--branch", f"{runs['plain']}@10", "--out", str(new), "optimizer.lr=0.02", *QUIET)
    cut = runs["root"] / "cut"  # as if killed before its first checkpoint of its own
    shutil.copytree(new, cut)
    for later in ("step-00000015", "step-00000020"):
        shutil.rmtree(cut / "checkpoints" / later)
    (cut / "checkpoints" / "latest").write_text("step-00000010")
    _train("--out", str(cut), "--resume", "auto", *QUIET)  # replays the change, not the branch
    assert _same_weights(cut, new)


def test_the_copy_shares_no_file_with_the_parent(runs):
    new = runs["root"] / "copy"
    _train("--branch", f"{runs['plain']}@15", "--out", str(new), *QUIET)
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.pt", "manifest.json"):
        a = runs["plain"] / "checkpoints" / "step-00000015" / name
        b = new / "checkpoints" / "step-00000015" / name
        assert a.read_bytes() == b.read_bytes()
        assert not os.path.samefile(a, b) and b.stat().st_nlink == 1


def test_an_edit_of_the_parents_changes_after_the_branch_is_found_out(runs, tmp_path):
    parent = tmp_path / "parent"
    shutil.copytree(runs["steered"], parent)
    new = tmp_path / "new"
    _train("--branch", f"{parent}@15", "--out", str(new), *QUIET)
    origin = read_origin(new)
    assert origin is not None and parent_problem(origin) is None
    path = parent / "changes.jsonl"
    path.write_text(path.read_text().replace('"lr": 0.02', '"lr": 0.03'))
    assert "edited after it was written" in (parent_problem(origin) or "")
    code, out, _ = _run(["runs", str(tmp_path), "--json"])
    assert code == 0
    rows = {Path(r["path"]).name: r for r in map(json.loads, out.splitlines())}
    assert "edited" in rows["new"]["branched_from"]["parent_altered"]


# -- what is refused ------------------------------------------------------------------------


def _damaged(runs, tmp_path) -> Path:
    parent = tmp_path / "damaged"
    shutil.copytree(runs["plain"], parent)
    weights = parent / "checkpoints" / "step-00000010" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    return parent


def _tampered(runs, tmp_path) -> Path:
    parent = tmp_path / "tampered"
    shutil.copytree(runs["steered"], parent)
    path = parent / "changes.jsonl"
    path.write_text(path.read_text().replace('"lr": 0.02', '"lr": 0.5'))
    return parent


@pytest.mark.parametrize(
    ("spec", "extra", "words"),
    [
        ("{plain}", (), "give RUN@STEP"),
        ("{plain}@x", (), "give RUN@STEP"),
        ("{plain}@-5", (), "give RUN@STEP"),
        ("{plain}@7", (), "no checkpoint at step 7; steps available: 5, 10, 15, 20"),
        ("{plain}@40", (), "step 40 is beyond the run, which reached step 20; steps available"),
        ("{damaged}@10", (), "damaged (checkpoint file"),
        ("{damaged}@10", (), "steps available: 5, 15, 20"),
        ("{plain}@10", ("model.hidden=8",), "model.hidden cannot change on a branch"),
        ("{plain}@10", ("--resume", "auto"), "leave out --resume/--replay"),
        ("{tampered}@15", (), "edited after it was written"),
        ("{root}@10", (), "holds no run"),
    ],
)
def test_a_refused_branch_is_one_line_and_changes_nothing(runs, tmp_path, spec, extra, words):
    paths = {"plain": runs["plain"], "root": runs["root"], "damaged": _damaged(runs, tmp_path),
             "tampered": _tampered(runs, tmp_path)}  # fmt: skip
    before = {name: _snapshot(path) for name, path in paths.items() if name != "root"}
    new = tmp_path / "new"
    code, _, err = _run(["train", "--branch", spec.format(**paths), "--out", str(new), *extra,
                         *QUIET])  # fmt: skip
    assert code == 2
    assert words in err and len(err.strip().splitlines()) == 1, err
    assert not new.exists()
    assert before == {name: _snapshot(paths[name]) for name in before}


def test_a_used_out_directory_or_a_value_the_run_cannot_take_is_refused(runs, tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    code, _, err = _run(["train", "--branch", f"{runs['plain']}@10", "--out", str(used), *QUIET])
    assert code == 2 and "not an empty directory" in err
    assert [p.name for p in used.iterdir()] == ["notes.txt"]
    code, _, err = _run(["train", "--branch", f"{runs['plain']}@10", *QUIET])
    assert code == 2 and "--branch needs --out NEW" in err
    inside = runs["plain"] / "fork"
    code, _, err = _run(["train", "--branch", f"{runs['plain']}@10", "--out", str(inside), *QUIET])
    assert code == 2 and "lies inside the run directory" in err and not inside.exists()
    new = tmp_path / "new"
    code, _, err = _run(["train", "--branch", f"{runs['plain']}@10", "--out", str(new),
                         "optimizer.lr=1e9", *QUIET])  # fmt: skip
    assert code == 2 and "optimizer.lr on the command line: lr=1e+09 is out of range" in err
    assert not new.exists()


def test_a_start_that_fails_after_the_copy_removes_the_new_run(runs, tmp_path):
    new = tmp_path / "new"  # another global batch: refused when the copy is loaded
    code, _, err = _run(["train", "--branch", f"{runs['plain']}@10", "--out", str(new),
                         "data.batch_size=64", *QUIET])  # fmt: skip
    assert code == 2 and "the global batch was 32" in err, err
    assert "branch of" in err  # the copy was made before the refusal
    assert not new.exists()


# -- hookloop runs and hookloop plot -----------------------------------------------------------


def test_runs_lists_a_branch_under_its_parent_with_where_it_came_from(runs, tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    parent = root / "base"
    shutil.copytree(runs["plain"], parent)
    _train("--branch", f"{parent}@10", "--out", str(root / "fork"), *QUIET)
    code, out, _ = _run(["runs", str(root)])
    lines = out.splitlines()
    assert code == 0 and "FROM" in lines[0]
    assert lines[1].startswith("base ") and lines[1].rstrip().endswith("-")
    assert lines[2].startswith("└ fork") and "base@10" in lines[2]
    code, out, _ = _run(["runs", str(root), "--json"])
    rows = {r["name"]: r for r in map(json.loads, out.splitlines())}
    assert rows["base"]["branched_from"] is None
    came = rows["fork"]["branched_from"]
    assert (came["run"], came["step"], came["parent_altered"]) == (str(parent), 10, None)


def test_plot_overlays_a_branch_from_its_step_with_a_marker_there(runs, tmp_path):
    pytest.importorskip("matplotlib")
    from hookloop.app.plot import branch_marks, load_run, make_figure

    new = tmp_path / "fork"
    _train("--branch", f"{runs['plain']}@10", "--out", str(new), "optimizer.lr=0.02", *QUIET)
    parent, branch = load_run(runs["plain"]), load_run(new)
    assert min(r["step"] for r in branch.train) == 15  # its own log begins after the branch
    marks = branch_marks([parent, branch])
    assert marks[0] is None
    assert marks[1] is not None and (marks[1].step, marks[1].parent_plotted) == (10, True)
    assert branch.series("loss")[0] == [10, 15, 20]  # drawn from the branch point
    assert branch.series("loss")[1][0] == parent.series("loss")[1][1]  # the parent's value
    assert parent.series("loss")[0] == [5, 10, 15, 20]  # the parent's whole curve
    fig = make_figure([runs["plain"], new])
    gids = {line.get_gid() for ax in fig.axes for line in ax.lines}
    assert "fork: branch of plain at step 10" in gids
    code, out, _ = _run(["plot", str(runs["plain"]), str(new), "--out", str(tmp_path / "p.png")])
    assert code == 0 and out.strip() == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
