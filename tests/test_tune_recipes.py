"""A user's own recipe, named by import path (``package.module:object``), everywhere a
built-in one goes: ``hookloop config``, ``train``, ``--resume auto`` (recorded in
config.yaml), ``tune`` with worker processes; and ``hookloop.tune.run`` from Python."""

from __future__ import annotations

import sqlite3
import textwrap

import pytest
import yaml

from _quiet import SERVICES_OFF
from hookloop.app.cli import main
from hookloop.app.runs import summarize_run
from hookloop.tune import run

optuna = pytest.importorskip("optuna")

#: A recipe as a user writes it: its own model section, data and build.
USER_RECIPE = '''
"""A user's recipe: a linear model on y = 3x."""
from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

from hookloop.config import Config, ModelConfig, opt
from hookloop.recipes import Recipe, RecipeParts


@dataclass
class LineConfig(ModelConfig):
    width: int = opt(4, "Hidden width.")


def default_config():
    cfg = Config(model=LineConfig())
    cfg.data.batch_size = 16
    cfg.optimizer.lr = 0.05
    cfg.train.max_steps = 12
    cfg.train.eval_every = 4
    return cfg


def build(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 1, generator=g)
    data = TensorDataset(x, 3 * x)
    width = cfg.model.width
    model = torch.nn.Sequential(torch.nn.Linear(1, width), torch.nn.Linear(width, 1))
    return RecipeParts(model, data, data, loss_fn=torch.nn.functional.mse_loss)


RECIPE = Recipe("line", "a linear model on y = 3x", default_config, build)
'''
QUIET = ["logging.progress=false", "callbacks.info=false", *SERVICES_OFF]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """The user's project: their module in the current directory (not installed)."""
    (tmp_path / "my_line_recipe.py").write_text(textwrap.dedent(USER_RECIPE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_recipe_by_import_path_trains_resumes_configures_and_tunes_in_workers(user_dir, capsys):
    recipe = "my_line_recipe:RECIPE"
    assert main(["config", "--recipe", recipe]) == 0
    assert "model.width" in capsys.readouterr().out
    out = user_dir / "run"
    argv = ["train", "--recipe", recipe, "--out", str(out), *QUIET]
    assert main([*argv, "train.max_steps=8"]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["recipe"] == recipe
    # --resume auto reads the recipe back from config.yaml
    resume = ["train", "--out", str(out), "--resume", "auto", "train.max_steps=12"]
    assert main([*resume, *QUIET]) == 0
    assert "max_steps at step 12" in capsys.readouterr().out  # the result line
    assert summarize_run(out).step == 12

    space = user_dir / "space.yaml"
    space.write_text("model.width: {low: 2, high: 8}\noptimizer.lr: {low: 0.01, high: 0.1}\n")
    study = user_dir / "study"
    tune = ["tune", "--recipe", recipe, "--space", str(space), "--out", str(study), "--no-plots"]
    assert main([*tune, "--trials", "3", "--workers", "2", *QUIET]) == 0  # imported by each
    assert main([*tune, "--trials", "4", *QUIET]) == 0  # the study continued, one trial more
    with sqlite3.connect(study / "study.db") as conn:
        states = conn.execute("SELECT state FROM trials").fetchall()
    assert len(states) == 4 and all(s in (("COMPLETE",), ("PRUNED",)) for s in states)
    best = yaml.safe_load((study / "best_config.yaml").read_text())
    assert best["recipe"] == recipe and 2 <= best["model"]["width"] <= 8


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ("no_such_module_xyz:R", "cannot import 'no_such_module_xyz'"),
        ("my_line_recipe:NOPE", "my_line_recipe has no attribute 'NOPE'"),
        ("my_line_recipe:LineConfig", "LineConfig is not a recipe (no callable default_config"),
        ("my_line_recipe:", "an import path is package.module:object"),
    ],
)
def test_a_bad_import_path_is_one_line_naming_it(user_dir, capsys, recipe, message):
    assert main(["train", "--recipe", recipe, *QUIET]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_run_tunes_a_user_objective_to_exactly_n_trials_across_restarts(tmp_path):
    def objective(trial):
        x = trial.params["x"]  # drawn from the space before the call
        if x > 4.5:
            raise optuna.TrialPruned("too far")
        return (x - 2.0) ** 2

    space = {"x": {"low": -5.0, "high": 5.0}}
    study = run(objective, space, trials=6, out=tmp_path / "fn", seed=3)
    assert sum(t.state.name in ("COMPLETE", "PRUNED") for t in study.trials) == 6
    again = run(objective, space, trials=8, out=tmp_path / "fn", seed=3)  # two more
    assert sum(t.state.name in ("COMPLETE", "PRUNED") for t in again.trials) == 8
    assert again.best_value == min(t.value for t in again.trials if t.value is not None)

    def suggests_itself(trial):
        return trial.suggest_float("y", 0.0, 1.0)

    assert len(run(suggests_itself, trials=2, out=tmp_path / "own").trials) == 2
    with pytest.raises(ValueError, match="trials must be an int >= 1, got 0"):
        run(objective, space, trials=0, out=tmp_path / "bad")
    with pytest.raises(ValueError, match="space is required to tune a recipe"):
        run("mlp-regression", trials=1, out=tmp_path / "bad2")
