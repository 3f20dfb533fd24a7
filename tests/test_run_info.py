"""Callbacks learn the run's facts from ``ctx.run`` and the log schedule from ``ctx.state``.

A callback needs no Trainer: the same facts in a hand-built context give the same
files, and a bare ``CallbackContext()`` (a run that writes no files) gets what a
run without ``out_dir`` got. Producers that prepare values during a step check
``ctx.state.will_log``, so a log requested before the step began gets them too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from _reference import GradsSeen
from hookloop import Callback, Config, Trainer
from hookloop.callbacks.checkpoint_policy import CheckpointPolicy
from hookloop.callbacks.defaults import default_callbacks
from hookloop.callbacks.info import InfoCallback
from hookloop.callbacks.jsonlog import JsonLogger
from hookloop.callbacks.norms import GradNormLogger
from hookloop.callbacks.profiler import ProfilerCallback
from hookloop.callbacks.textgen import TextgenCallback
from hookloop.compat.hf import HFSession
from hookloop.compat.hpo import HpoTrainer
from hookloop.rundir import RunDir
from hookloop.state import CallbackContext, RunInfo
from hookloop.testing import TinyModel, ToyData

SRC = Path(__file__).resolve().parent.parent / "src" / "hookloop"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(callbacks, **train) -> Trainer:
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device, cfg.train.handle_signals, cfg.train.log_every = "cpu", False, 0
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return Trainer(
        TinyModel(),
        train_data=ToyData(n=32),  # 8 steps an epoch
        config=cfg,
        callbacks=list(callbacks),
        loss_fn=TinyModel.loss_fn,
    )


class LogsSeen(Callback):
    priority = 200

    def __init__(self):
        self.logs: list[dict] = []
        self.will_log: dict[int, bool] = {}

    def on_train_step_start(self, ctx):
        self.will_log[ctx.state.step] = ctx.state.will_log

    def on_log(self, ctx):
        self.logs.append({"step": ctx.state.step, **ctx.logs})


class AskToLog(Callback):
    """Files one log request at ``event``, outside any step (it waits for the next one)."""

    def __init__(self, event: str):
        self.event, self.asked = event, False

    def on_train_start(self, ctx):
        self._ask("on_train_start", ctx)

    def on_epoch_end(self, ctx):
        self._ask("on_epoch_end", ctx)

    def _ask(self, event, ctx):
        if event == self.event and not self.asked:
            self.asked = True
            ctx.control.request_log()


# -- will_log: a requested log gets the per-parameter gradient norms --------------------


@pytest.mark.parametrize(
    ("event", "logged_step"),
    [("on_train_start", 1), ("on_epoch_end", 9)],
    ids=["before the first step", "between epochs"],
)
def test_a_log_requested_before_a_step_gets_the_grad_norms(event, logged_step):
    seen, reference = LogsSeen(), GradsSeen()
    asker = AskToLog(event)
    _trainer([GradNormLogger(), reference, seen, asker], max_steps=12).train()
    assert [logs["step"] for logs in seen.logs] == [logged_step]  # log_every=0: only asked
    assert seen.will_log[logged_step] and sum(seen.will_log.values()) == 1
    logs = seen.logs[0]
    got = {k[len("grad_norm/") :]: v for k, v in logs.items() if k.startswith("grad_norm/")}
    assert "total" in got
    got.pop("total")
    assert got == pytest.approx(reference.norms[logged_step], rel=1e-5)


def test_scheduled_and_requested_logs_both_get_the_grad_norms():
    seen = LogsSeen()
    _trainer([GradNormLogger(), seen, AskToLog("on_epoch_end")], max_steps=12, log_every=5).train()
    steps = [logs["step"] for logs in seen.logs]
    assert steps == [5, 9, 10]
    assert all("grad_norm/total" in logs for logs in seen.logs)


# -- the run directory comes from ctx.run.dir --------------------------------------------


def _echo(model, prompt):
    return "!"


def test_the_samples_file_is_the_run_directorys(tmp_path):
    run = RunDir(tmp_path / "run")
    ctx = CallbackContext(run=RunInfo(dir=run), model=TinyModel())
    textgen = TextgenCallback(["a"], generate_fn=_echo, print_samples=False)
    textgen.on_train_start(ctx)
    textgen.on_eval_end(ctx)
    assert run.samples.read_text().startswith("=== step 0 ===")
    assert textgen.state_dict()["file"] == str(run.samples)


def test_without_a_run_directory_textgen_keeps_samples_in_user_state_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ctx = CallbackContext(model=TinyModel())  # bare: ctx.run.dir is None
    textgen = TextgenCallback(["a"], generate_fn=_echo, print_samples=False)
    textgen.on_train_start(ctx)
    textgen.on_eval_end(ctx)
    assert ctx.user_state["samples"] == [{"step": 0, "prompt": "a", "text": "!"}]
    assert list(tmp_path.iterdir()) == []
    assert textgen.state_dict() == {"file": None, "offset": 0}


@pytest.mark.parametrize("has_dir", [True, False], ids=["run dir", "bare"])
def test_the_profiler_writes_under_the_run_directory_or_else_dot_profile(
    tmp_path, monkeypatch, has_dir
):
    monkeypatch.chdir(tmp_path)
    run = RunDir(tmp_path / "run")
    ctx = CallbackContext(run=RunInfo(dir=run) if has_dir else None)
    profiler = ProfilerCallback(wait=0, warmup=1, active=1)
    profiler.on_train_start(ctx)
    for _ in range(2):
        torch.ones(2).sum()
        profiler.on_train_step_end(ctx)
    profiler.on_train_end(ctx)
    where = run.profile if has_dir else tmp_path / "profile"
    assert profiler.files and all(f.parent.resolve() == where for f in profiler.files)
    assert all(f.is_file() for f in profiler.files)


def test_default_callbacks_write_where_the_layout_says(tmp_path):
    cfg = Config()
    cfg.logging.progress = False
    run = RunDir(tmp_path)
    callbacks = default_callbacks(cfg, tmp_path)
    json_logger = next(cb for cb in callbacks if isinstance(cb, JsonLogger))
    assert json_logger.path == run.metrics
    assert not any(isinstance(cb, JsonLogger) for cb in default_callbacks(cfg, None))


# -- other facts: device, capabilities -------------------------------------------------


def test_info_reports_the_device_and_directory_of_ctx_run(tmp_path):
    run = RunInfo(dir=RunDir(tmp_path), device=torch.device("cpu"))
    info = InfoCallback(stream=None)
    info.on_train_start(CallbackContext(run=run, model=TinyModel()))
    assert info.info["device"] == "cpu" and info.info["out_dir"] == str(tmp_path)
    bare = InfoCallback(stream=None)
    bare.on_train_start(CallbackContext(model=TinyModel()))
    assert "device" not in bare.info and "out_dir" not in bare.info
    assert bare.info["parameters"] == 49


def test_checkpoint_policy_warns_when_the_run_cannot_checkpoint():
    with pytest.warns(UserWarning, match="no out_dir"):
        CheckpointPolicy(every_n_steps=1).on_train_start(CallbackContext())
    able = CallbackContext(run=RunInfo(can_checkpoint=True))
    CheckpointPolicy(every_n_steps=1).on_train_start(able)  # no warning (errors are warnings)


def test_hf_arguments_follow_ctx_run(tmp_path):
    session = HFSession()
    run = RunInfo(dir=RunDir(tmp_path), has_eval_data=False)
    session.bind(CallbackContext(run=run, config=Config()))
    assert session.args.output_dir == str(tmp_path)
    assert session.args.eval_strategy == "no"
    assert session.kwargs["train_dataloader"] is None and session.kwargs["trainer"] is None
    bare = HFSession()
    bare.bind(CallbackContext(config=Config()))
    assert bare.args.output_dir is None


def test_the_hpo_trainer_view_reads_the_device_from_ctx_run():
    view = HpoTrainer(CallbackContext(run=RunInfo(device=torch.device("cpu"))))
    assert view.device == torch.device("cpu")
    bare = HpoTrainer(CallbackContext())
    assert bare.device is None
    assert not hasattr(bare, "_max_grad_norm")  # no trainer: its producer is not registered


# -- the source: no Trainer attributes, no spelled-out layout ----------------------------

LAYOUT_FILES = {"config.yaml", "metrics.jsonl", "samples.txt"}
LAYOUT_DIRS = {"tb", "checkpoints", "plots", "profile", "wandb"}


def _sources():
    for folder in ("callbacks", "control", "compat", "app"):
        yield from sorted((SRC / folder).rglob("*.py"))


def _is_trainer(node: ast.AST) -> bool:
    """``trainer`` or ``<anything>.trainer``."""
    return (isinstance(node, ast.Name) and node.id == "trainer") or (
        isinstance(node, ast.Attribute) and node.attr == "trainer"
    )


#: Where ``trainer`` is the user's own trainer, not hookloop's: the HPO trainer's callbacks
#: called by hand from a hand-written loop read ``trainer.model`` / ``.optimizer`` as the
#: original does (docs/hpo-trainer.md, "In your own loop").
USERS_OWN_TRAINER = {Path("compat/hpo/faces.py")}


def _offences(path: Path) -> list[str]:
    found = []
    users_own = path.relative_to(SRC) in USERS_OWN_TRAINER
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and not users_own
            and node.args
            and _is_trainer(node.args[0])
        ):
            found.append(f"{where}: {node.func.id}(trainer, …)")
        if (
            isinstance(node, ast.Attribute)
            and _is_trainer(node.value)
            and node.attr.startswith("_")
        ):
            found.append(f"{where}: .trainer.{node.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "Path"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in LAYOUT_DIRS
        ):
            found.append(f"{where}: Path({node.args[0].value!r})")
        if isinstance(node, ast.Constant) and node.value in LAYOUT_FILES:
            found.append(f"{where}: {node.value!r}")
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant)
            and node.right.value in LAYOUT_DIRS
        ):
            found.append(f"{where}: / {node.right.value!r}")
    return found


def test_callbacks_read_no_trainer_attributes_and_spell_out_no_layout():
    offences = [o for path in _sources() for o in _offences(path)]
    assert offences == [], "use ctx.run (ctx.run.dir.<part>) instead:\n" + "\n".join(offences)
