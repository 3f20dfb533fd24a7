"""The ``hookloop`` command: recipes, config, train, and its usage errors (exit code 2)."""

from __future__ import annotations

import contextlib
import io
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _quiet import SERVICES_OFF
from hookloop.app.cli import main
from hookloop.callbacks import read_jsonl

# No progress bar, control server or TensorBoard: no test here checks them.
QUIET = ("logging.progress=false", *SERVICES_OFF)


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return int(code), out.getvalue(), err.getvalue()


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One short mlp-regression run, shared by the tests that read its outputs."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    code, out, err = _run(
        ["train", "--recipe", "mlp-regression", "--out", str(run_dir), "train.max_steps=30", *QUIET]
    )
    return run_dir, code, err, out


# -- listing -------------------------------------------------------------------------------


def test_recipes_lists_the_builtin_recipes():
    code, out, _ = _run(["recipes"])
    assert code == 0
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert {"gpt-stdlib", "mlp-regression"} <= set(names)


def test_config_prints_every_key_with_the_recipes_values():
    code, out, _ = _run(["config", "--recipe", "mlp-regression", "train.max_steps=7"])
    assert code == 0
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip()}
    assert rows["train.max_steps"] == "7"
    assert rows["optimizer.name"] == "sgd"
    assert rows["recipe"] == "mlp-regression"
    assert {"model.hidden", "data.train_samples", "train.grad_accum", "logging.json"} <= set(rows)


def test_no_command_prints_usage_and_exits_2():
    code, out, _ = _run([])
    assert code == 2
    assert "usage: hookloop" in out


# -- usage errors --------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["config", "train"])
def test_unknown_recipe_exits_2_listing_the_valid_names(command, tmp_path):
    out_dir = tmp_path / "never"
    argv = [command, "--recipe", "mlp-regresion"]
    if command == "train":
        argv += ["--out", str(out_dir)]
    code, _, err = _run(argv)
    assert code == 2
    assert "unknown recipe 'mlp-regresion'" in err
    assert "Did you mean 'mlp-regression'" in err
    assert "gpt-stdlib, mlp-regression" in err
    assert not out_dir.exists()  # nothing written for a bad command line


@pytest.mark.parametrize("command", ["config", "train"])
def test_unknown_key_exits_2_naming_the_key(command, tmp_path):
    argv = [command, "--recipe", "mlp-regression", "train.max_stepz=3"]
    if command == "train":
        argv[1:1] = ["--out", str(tmp_path / "never")]
    code, _, err = _run(argv)
    assert code == 2
    assert f"hookloop {command}: error:" in err
    assert "'train.max_stepz'" in err
    assert "Did you mean 'max_steps'" in err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.max_steps=abc", "train.max_steps expects int"),
        ("train.grad_accum=0", "train.grad_accum must be an int >= 1"),
        ("train.precision=fp8", "'fp32' | 'bf16' | 'fp16'"),
    ],
)
def test_bad_values_exit_2_with_the_reason(override, expected, tmp_path):
    code, _, err = _run(["train", "--recipe", "mlp-regression", "--out", str(tmp_path), override])
    assert code == 2
    assert expected in err
    assert list(tmp_path.iterdir()) == []


def test_resume_auto_without_a_run_directory_exits_2(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(["train", "--recipe", "mlp-regression", "--resume", "auto", *QUIET])
    assert code == 2
    assert "--resume auto needs --out" in err
    assert list(tmp_path.iterdir()) == []


# -- training ------------------------------------------------------------------------------


def test_train_writes_the_resolved_config(first_run):
    run_dir, code, err, _ = first_run
    assert code == 0, err
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["recipe"] == "mlp-regression"
    assert saved["train"]["max_steps"] == 30
    assert saved["model"]["hidden"] == 64  # recipe sections are resolved too
    assert saved["optimizer"]["name"] == "sgd"


def test_train_writes_metrics_with_a_finite_loss(first_run):
    run_dir, code, err, out = first_run
    assert code == 0, err
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [20]  # the recipe logs every 20 steps
    assert all(isinstance(r["loss"], float) and math.isfinite(r["loss"]) for r in train)
    # progress on stderr, the result alone on stdout (`hookloop train > log.txt`)
    assert out == f"hookloop: max_steps at step 30 (exit 0), run directory {run_dir}\n"
    assert "at step 30 (exit" not in err


def test_second_train_into_the_same_directory_is_refused_and_touches_nothing(first_run):
    run_dir, code, _, _ = first_run
    assert code == 0
    before = _snapshot(run_dir)

    code, _, err = _run(
        ["train", "--recipe", "mlp-regression", "--out", str(run_dir), "train.max_steps=5", *QUIET]
    )

    assert code == 2
    assert "--resume auto" in err
    assert _snapshot(run_dir) == before


def test_config_file_then_command_line_overrides(tmp_path):
    config_file = tmp_path / "exp.yaml"
    config_file.write_text("recipe: mlp-regression\ntrain:\n  max_steps: 5\n  log_every: 1\n")
    out_dir = tmp_path / "run"

    code, _, err = _run(
        ["train", "--config", str(config_file), "--out", str(out_dir), "train.max_steps=3", *QUIET]
    )

    assert code == 0, err
    saved = yaml.safe_load((out_dir / "config.yaml").read_text())
    assert saved["recipe"] == "mlp-regression"  # taken from the file
    assert saved["train"]["max_steps"] == 3  # the command line wins
    assert saved["train"]["log_every"] == 1
    steps = [r["step"] for r in read_jsonl(out_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_python_dash_m_hookloop_runs_the_command():
    done = subprocess.run(
        [sys.executable, "-m", "hookloop", "recipes"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "mlp-regression" in done.stdout and "gpt-stdlib" in done.stdout


def test_a_sigterm_after_the_last_step_keeps_exit_143_and_the_closing_line_says_why(
    make_config,
):
    import os
    import signal

    from hookloop import Trainer
    from hookloop.app.cli import closing_line
    from hookloop.testing import TinyModel, ToyData

    trainer = Trainer(
        TinyModel(), train_data=ToyData(n=16), loss_fn=TinyModel.loss_fn,
        config=make_config(max_steps=2, handle_signals=True),
    )  # fmt: skip

    def terminate(ctx) -> None:
        # Only into hookloop's own handler: without it the signal would end pytest itself.
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler) and handler not in (signal.SIG_DFL, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGTERM)

    trainer.callbacks.register("on_train_end", terminate)
    result = trainer.train()  # the handler only sets a flag; the run had already finished
    assert (result.stop_reason, result.step, result.exit_code) == ("max_steps", 2, 143)
    line = closing_line(result, "runs/x")
    assert line == (
        "hookloop: max_steps at step 2 (exit 143), SIGTERM came after the last step, "
        "run directory runs/x"
    )


# -- the user's own bugs: a traceback and exit 1; hookloop's refusals: one line and exit 2 ---

#: A recipe of the user's, in a file of its own; USER_BUG says where it fails.
USER_RECIPE = """\
import os
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from hookloop import Callback
from hookloop.recipes import Recipe, RecipeParts
from hookloop.recipes.mlp import default_config as mlp_config

BUG = os.environ.get("USER_BUG", "")


def default_config():
    if BUG == "recipe":
        return mlp_config().not_a_method()  # line 16
    return mlp_config()


def wrong_target_loss(outputs, targets):
    if BUG == "loss":
        return torch.nn.functional.cross_entropy(outputs, targets[:16].argmax(-1))  # line 22
    return torch.nn.functional.mse_loss(outputs, targets)


class UserCallback(Callback):
    def on_train_step_end(self, ctx):
        if BUG == "callback":
            raise ValueError(f"my callback cannot take step {ctx.state.step}")  # line 29


def build(config):
    if BUG == "data":
        Path(__file__).with_name("missing.csv").read_text()  # line 34
    x = torch.randn(64, config.model.inputs)
    y = torch.randn(64, config.model.outputs)
    model = torch.nn.Linear(config.model.inputs, config.model.outputs)
    return RecipeParts(
        model=model,
        train_data=TensorDataset(x, y),
        loss_fn=wrong_target_loss,
        callbacks=[UserCallback()],
    )


RECIPE = Recipe("user", "a user's recipe", default_config, build)
"""

USER_BUG_LINES = {"recipe": 16, "loss": 22, "callback": 29, "data": 34}


def _hookloop(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``hookloop ARGV`` as a user runs it: a process of its own, stdout and stderr apart."""
    import os

    return subprocess.run(
        [sys.executable, "-m", "hookloop", *map(str, argv)],
        cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, **env},
    )  # fmt: skip


@pytest.mark.parametrize("bug", sorted(USER_BUG_LINES))
def test_a_bug_in_the_users_code_shows_its_traceback_and_exits_1(bug, tmp_path):
    (tmp_path / "userrecipe.py").write_text(USER_RECIPE)
    argv = ["train", "--recipe", "userrecipe:RECIPE", "--out", "run", "train.max_steps=2", *QUIET]

    done = _hookloop(argv, tmp_path, USER_BUG=bug)

    assert done.returncode == 1, done.stderr
    assert "Traceback (most recent call last)" in done.stderr
    user_frame = f'{tmp_path / "userrecipe.py"}", line {USER_BUG_LINES[bug]}'
    assert user_frame in done.stderr
    assert ": error: " not in done.stderr  # not dressed up as a bad command line
    assert done.stdout == ""


def test_the_reported_wrong_target_shape_is_a_traceback_naming_torchs_message(tmp_path):
    (tmp_path / "userrecipe.py").write_text(USER_RECIPE)
    argv = ["train", "--recipe", "userrecipe:RECIPE", "--out", "run", "train.max_steps=2", *QUIET]

    done = _hookloop(argv, tmp_path, USER_BUG="loss")

    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: Expected input batch_size (32) to match target batch_size")
    assert done.returncode == 1


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["train", "--out", "run", "train.max_stepz=3"], ["hookloop train: error:", "max_stepz"]),
        (["train", "--config", "nowhere.yaml"], ["hookloop train: error:", "nowhere.yaml"]),
        (["train", "--recipe", "userrecipe:NOPE"], ["hookloop train: error:", "NOPE"]),
        (["train", "--recipe", "nomodule:R"], ["hookloop train: error:", "cannot import"]),
        (["config", "optimizer.lr=fast"], ["hookloop config: error:", "optimizer.lr"]),
        (["recipes", "extra"], ["hookloop: error:", "unrecognized arguments: extra"]),
        (["runs", "nowhere"], ["hookloop runs: error:", "nowhere is not a directory"]),
        (["plot", "nowhere"], ["hookloop plot: error:", "nowhere has no metrics.jsonl"]),
        (["ctl", "nosuchjob", "status", "--jobs-dir", "."], ["hookloop ctl: error:", "nosuchjob"]),
        (["ctl", "somejob", "set", "lr"], ["hookloop ctl: error:", "KEY=VALUE", "'lr'"]),
        (["jobs", "--timeout", "soon"], ["hookloop jobs: error:", "--timeout", "soon"]),
    ],
    ids=lambda v: "-".join(v[:2]) if isinstance(v, list) and v[0] in ("train", "ctl") else None,
)
def test_hookloops_own_refusals_are_one_line_and_exit_2(argv, words, tmp_path):
    (tmp_path / "userrecipe.py").write_text(USER_RECIPE)

    done = _hookloop(argv, tmp_path)

    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    error_lines = [line for line in lines if ": error: " in line]
    assert len(error_lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(word in error_lines[0] for word in words), error_lines[0]
    assert "HOOKLOOP_DEBUG" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_hookloop_debug_shows_the_traceback_of_a_refusal(tmp_path):
    done = _hookloop(["config", "optimizer.lr=fast"], tmp_path, HOOKLOOP_DEBUG="1")
    assert done.returncode == 1
    assert "Traceback" in done.stderr
    assert "hookloop.errors.ConfigError: optimizer.lr" in done.stderr


def test_a_bug_in_the_users_recipe_defaults_is_a_traceback_in_hookloop_config(tmp_path):
    (tmp_path / "userrecipe.py").write_text(USER_RECIPE)

    done = _hookloop(["config", "--recipe", "userrecipe:RECIPE"], tmp_path, USER_BUG="recipe")

    assert done.returncode == 1
    assert f'{tmp_path / "userrecipe.py"}", line 16' in done.stderr
    assert "AttributeError" in done.stderr.strip().splitlines()[-1]


def test_the_nan_stop_names_its_step_once_and_the_result_line_is_on_stdout(tmp_path):
    run = tmp_path / "run"
    argv = ["train", "--recipe", "mlp-regression", "--out", str(run), "train.max_steps=20"]
    code, out, err = _run([*argv, "optimizer.lr=1e3", "train.log_every=1", *QUIET])

    assert code == 4, err
    (line,) = out.splitlines()
    step = int(line.split(" at step ")[1].split()[0])
    assert line == (
        "hookloop: NaNDetection: non-finite loss (inf) (the step's update was skipped) "
        f"at step {step} (exit 4), run directory {run}"
    )
    assert line.count(f"step {step}") == 1


def test_resuming_a_finished_run_says_there_is_nothing_to_do(first_run):
    run_dir, code, _, _ = first_run
    assert code == 0
    before = _snapshot(run_dir)

    code, out, err = _run(["train", "--out", str(run_dir), "--resume", "auto", *QUIET])

    assert code == 0, err
    assert out == (
        f"hookloop: nothing to do: {run_dir} already finished at step 30 "
        f"(train.max_steps=30); to train on, raise it: hookloop train --out {run_dir} "
        "--resume auto train.max_steps=60\n"
    )
    assert _snapshot(run_dir) == before  # no new start record, no checkpoint touched


def test_resuming_a_finished_run_with_a_raised_budget_trains_on(tmp_path):
    run = tmp_path / "run"
    base = ["train", "--recipe", "mlp-regression", "--out", str(run), *QUIET]
    assert _run([*base, "train.max_steps=2"])[0] == 0

    code, out, err = _run([*base, "--resume", "auto", "train.max_steps=4", "train.eval_every=2"])

    assert code == 0, err
    evals = [r["eval_loss"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals
    assert out == (
        f"hookloop: max_steps at step 4 (exit 0), best eval_loss {min(evals):.4g}, "
        f"run directory {run}\n"
    )


def test_the_result_line_reads_with_the_pattern_docs_cli_md_gives(first_run):
    import re

    run_dir, code, _, out = first_run
    docs = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    (pattern,) = re.findall(r"`(\^hookloop: .*?\$)`", docs)
    reason, step, exit_code, _, where = re.match(pattern, out.strip()).groups()
    assert (reason, step, exit_code, where) == ("max_steps", "30", str(code), str(run_dir))
