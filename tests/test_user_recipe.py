"""A user's own model from the command line: a recipe named by import path may bring
its own optimizer and scheduler, and the config may name any torch optimizer or
scheduler class (or one by import path) with keyword arguments."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hookloop.app.cli import main
from hookloop.callback import Callback
from hookloop.entry import build_trainer
from hookloop.recipes import resolve_config

RECIPE = '''
"""SGD and a step schedule, chosen by the recipe itself."""
import torch
from hookloop.config import Config
from hookloop.recipes import Recipe, RecipeParts
from hookloop.testing import TinyModel, ToyData


def default_config() -> Config:
    cfg = Config()
    cfg.train.max_steps, cfg.train.log_every, cfg.data.batch_size = 6, 1, 4
    cfg.train.device = "cpu"
    return cfg


def build(config: Config) -> RecipeParts:
    return RecipeParts(
        model=TinyModel(),
        train_data=ToyData(n=64),
        loss_fn=TinyModel.loss_fn,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    )


RECIPE = Recipe("stepped", "SGD and StepLR", default_config, build)
'''

QUIET = ["control.enabled=false", "logging.progress=false", "logging.tensorboard=false"]


def hookloop_train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), *sys.path])}
    return subprocess.run(
        [sys.executable, "-m", "hookloop", "train", *args, *QUIET],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def logged(run: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if r["kind"] == "train"}


def test_a_recipe_by_import_path_trains_with_its_own_optimizer_and_scheduler(tmp_path):
    (tmp_path / "stepped.py").write_text(textwrap.dedent(RECIPE))
    done = hookloop_train(tmp_path, "--recipe", "stepped:RECIPE", "--out", "run")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "optimizer             SGD" in done.stderr and "StepLR" in done.stderr
    lrs = logged(tmp_path / "run", "lr")
    assert lrs == {s: pytest.approx(0.1 * 0.5 ** (s // 2)) for s in range(1, 7)}


def test_the_config_names_any_torch_optimizer_and_scheduler_with_keyword_arguments():
    cfg = resolve_config(
        "mlp-regression",
        None,
        [
            "optimizer.name=RMSprop",
            "optimizer.kwargs={momentum: 0.5, alpha: 0.9}",
            "optimizer.lr=0.01",
            "scheduler.name=StepLR",
            "scheduler.kwargs={step_size: 3, gamma: 0.1}",
            "train.max_steps=6",
            "train.log_every=0",
        ],
    )
    trainer = build_trainer(cfg)
    opt = trainer.optimizer
    assert isinstance(opt, torch.optim.RMSprop)
    assert {g["momentum"] for g in opt.param_groups} == {0.5}
    assert {g["alpha"] for g in opt.param_groups} == {0.9}
    assert isinstance(trainer.scheduler, torch.optim.lr_scheduler.StepLR)
    trainer.train()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.1**2)


def test_an_optimizer_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "myoptim.py").write_text(
        "import torch\n\nclass Plain(torch.optim.SGD):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = resolve_config("mlp-regression", None, ["optimizer.name=myoptim:Plain"])
    assert type(build_trainer(cfg).optimizer).__name__ == "Plain"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.name=rmsprop", "a torch.optim class name (e.g. RMSprop) or an import path"),
        ("optimizer.name=Nope", "optimizer.name must be adamw | adam | sgd"),
        ("scheduler.name=Nope", "scheduler.name must be constant | cosine | linear"),
        ("optimizer.kwargs=3", "optimizer.kwargs must be a mapping"),
        ("optimizer.name=no_such_module:Opt", "cannot import 'no_such_module'"),
        ("scheduler.name=StepLR", "scheduler StepLR refuses its arguments"),
        ("optimizer.kwargs={betas_typo: 1}", "optimizer SGD refuses its arguments"),
    ],
)
def test_a_bad_optimizer_or_scheduler_is_one_line_from_the_cli(tmp_path, override, message):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(["train", "--recipe", "mlp-regression", "--out", str(tmp_path / "run"),
                     override, "train.max_steps=2", *QUIET])  # fmt: skip
    assert code == 2
    errors = [line for line in err.getvalue().splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], err.getvalue()
    assert "Traceback" not in err.getvalue()


class SetLr(Callback):
    """A live ``set lr=`` at step 2, as the control server files it."""

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == 2:
            ctx.control.request("set", **{"0" * 20: {"values": {"lr": 0.05}, "client": "t"}})


def test_live_set_lr_and_resume_with_a_torch_scheduler_match_an_uninterrupted_run(tmp_path):
    def run(out: Path, max_steps: int, resume: str | None = None):
        cfg = resolve_config(
            "mlp-regression",
            None,
            [
                "optimizer.name=RMSprop",
                "scheduler.name=StepLR",
                "scheduler.kwargs={step_size: 2, gamma: 0.5}",
                f"train.max_steps={max_steps}",
                "train.log_every=1",
                "checkpoint.async_save=false",
            ],
        )
        trainer = build_trainer(cfg, callbacks=[SetLr()], out_dir=out, resume=resume)
        lrs: list[float] = []
        trainer.callbacks.register(
            "on_train_step_end", lambda ctx: lrs.append(ctx.optimizer.param_groups[0]["lr"])
        )
        trainer.train()
        return trainer, lrs

    whole, whole_lrs = run(tmp_path / "whole", 6)
    _, first = run(tmp_path / "cut", 3)
    cut, second = run(tmp_path / "cut", 6, resume="auto")
    # steps 3 to 6: the set peak 0.05, halved every second step as StepLR goes on
    assert whole_lrs[2:] == pytest.approx([0.025, 0.0125, 0.0125, 0.00625])
    assert first + second == whole_lrs
    for a, b in zip(whole.model.parameters(), cut.model.parameters(), strict=True):
        assert torch.equal(a, b)
