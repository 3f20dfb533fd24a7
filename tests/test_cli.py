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
    code, _, err = _run(
        ["train", "--recipe", "mlp-regression", "--out", str(run_dir), "train.max_steps=30", *QUIET]
    )
    return run_dir, code, err


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
    run_dir, code, err = first_run
    assert code == 0, err
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["recipe"] == "mlp-regression"
    assert saved["train"]["max_steps"] == 30
    assert saved["model"]["hidden"] == 64  # recipe sections are resolved too
    assert saved["optimizer"]["name"] == "sgd"


def test_train_writes_metrics_with_a_finite_loss(first_run):
    run_dir, code, err = first_run
    assert code == 0, err
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [20]  # the recipe logs every 20 steps
    assert all(isinstance(r["loss"], float) and math.isfinite(r["loss"]) for r in train)
    assert "max_steps at step 30" in err


def test_second_train_into_the_same_directory_is_refused_and_touches_nothing(first_run):
    run_dir, code, _ = first_run
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
        "hookloop: max_steps at step 2 (SIGTERM came after the last step: exit code 143); "
        "outputs in runs/x"
    )
