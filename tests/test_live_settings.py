"""Live settings: `set` on a running job, recorded, and replayed exactly on resume."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

import _zygote as zygote
from hookloop import Callback, Trainer
from hookloop.app.cli import main
from hookloop.app.plot import make_figure
from hookloop.app.runs import format_table, summarize_run
from hookloop.callbacks import JsonLogger
from hookloop.callbacks.progress_log import ProgressLog, first_job_start
from hookloop.config import Config
from hookloop.control.client import JobClient
from hookloop.control.registry import list_jobs
from hookloop.loop.live import SettingError, read_changes

TESTS = Path(__file__).resolve().parent
QUIET = ["logging.progress=false", "callbacks.info=false"]


def _data():
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x.sum(1, keepdim=True))


class Steer(Callback):
    """Files `set`s at given steps, as the control server would (only once per process,
    and only past ``after``: a client that goes on steering a resumed run)."""

    def __init__(self, plan: dict[int, dict], after: int = 0) -> None:
        self.plan, self.after = plan, after

    def on_train_step_end(self, ctx) -> None:
        values = self.plan.get(ctx.state.step)
        if values is not None and ctx.state.step > self.after:
            ident = f"{ctx.state.step:020d}"
            ctx.control.request("set", **{ident: {"values": values, "client": "test"}})


class Crash(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, ctx) -> None:
        if ctx.state.step == self.step:
            raise RuntimeError("killed")


class RecordLR(Callback):
    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_train_step_end(self, ctx) -> None:
        self.lrs[ctx.state.step] = ctx.optimizer.param_groups[0]["lr"]


def make(out=None, callbacks=(), resume=None, *, steps=24, schedule="cosine", **train):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    cfg = Config()
    cfg.data.batch_size = 8
    cfg.train.max_steps, cfg.train.log_every, cfg.checkpoint.every = steps, 5, 5
    cfg.optimizer.lr, cfg.optimizer.weight_decay = 0.01, 0.1
    cfg.scheduler.name, cfg.scheduler.warmup_steps = schedule, 4 if schedule != "constant" else 0
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return Trainer(model, train_data=_data(), loss_fn=torch.nn.functional.mse_loss, config=cfg,
                   out_dir=out, resume=resume, callbacks=list(callbacks))  # fmt: skip


def weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


PLAN = {
    7: {"lr_scale": 3.0, "clip_grad_norm": 0.5, "weight_decay": 0.02},
    13: {"lr": 0.002, "save_every": 4, "betas": [0.8, 0.99]},
}


# -- checking ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"lr": -1}, "lr must be a finite number > 0, got -1"),
        ({"lr": "fast"}, "lr must be a number, got 'fast'"),
        ({"lr": float("nan")}, "lr must be a finite number"),
        ({"betas": [0.9]}, "betas must be a list of two numbers in [0, 1)"),
        ({"log_every": 2.5}, "log_every must be an int >= 1 (0: off), got 2.5"),
        ({"batch_size": 4}, "batch_size cannot change mid-run"),
        ({"seed": 1}, "seed cannot change mid-run"),
        ({"momentum": 0.5}, "this run's optimizer (AdamW) has no momentum"),
        ({"lr@7": 0.1}, "this optimizer has 2 parameter group(s); use lr@N with N < 2"),
        ({"lrr": 0.1}, "unknown setting 'lrr'; settable here: lr, lr_scale, weight_decay"),
        ({"lr": 0.1, "lr_scale": 2}, "give lr or lr_scale, not both"),
        ({}, "set needs at least one KEY=VALUE"),
        ({"lr": 0.1, "eps": 0}, "eps must be a finite number > 0, got 0"),
        ({"eval_every": 5}, "eval_every: this run has no evaluation data"),
        ({"save_every": 5}, "save_every: this run writes no checkpoints (no output directory)"),
    ],
)
def test_a_set_is_refused_whole_with_one_line_naming_the_key(values, message):
    trainer = make()
    before = trainer.parts.live.values()
    with pytest.raises(SettingError) as refused:
        trainer.parts.live.check(values)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert trainer.parts.live.values() == before


def test_lr_sets_the_schedules_peak_so_warmup_and_decay_keep_their_shape():
    plain, steered = RecordLR(), RecordLR()
    make(callbacks=[plain]).train()
    make(callbacks=[steered, Steer({6: {"lr": 0.03}})]).train()
    assert all(steered.lrs[s] == plain.lrs[s] for s in range(1, 7))
    for step in range(7, 25):  # from the next step on: three times the rate, same curve
        assert steered.lrs[step] == pytest.approx(3 * plain.lrs[step], rel=1e-12)


def test_weight_decay_changes_the_decaying_groups_and_lr_scale_multiplies_the_rate():
    trainer = make(callbacks=[Steer({3: {"weight_decay": 0.3, "lr_scale": 0.5}})], steps=4,
                   schedule="constant")  # fmt: skip
    trainer.train()
    decay, no_decay = trainer.optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.3, 0.0)
    assert decay["lr"] == no_decay["lr"] == 0.005
    assert [c["key"] for c in trainer.parts.live.history[0]["changes"]] == ["weight_decay", "lr"]


def test_a_callbacks_settable_attribute_is_changed_with_its_own_type():
    class Threshold(Callback):
        settable = ("limit", "patience")

        def __init__(self) -> None:
            self.limit, self.patience = 1.5, 3

    cb = Threshold()
    trainer = make(callbacks=[cb, Steer({2: {"Threshold.limit": 4, "Threshold.patience": 9}})],
                   steps=3)  # fmt: skip
    with pytest.raises(SettingError, match=r"Threshold.patience must be a int like its value 3"):
        trainer.parts.live.check({"Threshold.patience": 2.5})
    trainer.train()
    assert (cb.limit, cb.patience) == (4.0, 9) and isinstance(cb.limit, float)


# -- replay ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A steered run that was never stopped: its weights and its changes file."""
    out = tmp_path_factory.mktemp("whole") / "run"
    trainer = make(out, [Steer(PLAN)])
    trainer.train()
    return weights(trainer), out


@pytest.mark.parametrize("killed_at", [6, 9, 12, 15, 21])
def test_a_steered_run_stopped_anywhere_and_resumed_ends_on_the_same_weights(
    tmp_path, uninterrupted, killed_at
):
    expected, _ = uninterrupted
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="killed"):
        make(out, [Steer(PLAN), Crash(killed_at)]).train()
    resumed = make(out, [Steer(PLAN, after=killed_at)], resume="auto")  # the client goes on
    resumed.train()
    assert all(torch.equal(a, b) for a, b in zip(expected, weights(resumed), strict=True))
    steps = [r["step"] for r in read_changes(out / "changes.jsonl")]
    assert steps == [7, 13]  # every change once, however the run was cut


def test_replay_reproduces_a_steered_run_from_scratch(tmp_path, uninterrupted):
    expected, source = uninterrupted
    replay = make(tmp_path / "replay")
    replay.parts.live.replay_from = type(replay.ctx.run.dir)(source)
    replay.train()
    assert all(torch.equal(a, b) for a, b in zip(expected, weights(replay), strict=True))
    assert [r["step"] for r in read_changes(tmp_path / "replay" / "changes.jsonl")] == [7, 13]


def test_a_fresh_run_in_the_same_directory_keeps_the_old_changes_aside(tmp_path):
    out = tmp_path / "run"
    make(out, [Steer({2: {"lr": 0.02}})], steps=3).train()
    (out / "checkpoints").rename(tmp_path / "old-checkpoints")
    fresh = make(out, steps=3)
    fresh.train()
    assert fresh.parts.live.history == []
    kept = [p.name for p in out.glob("changes-*.jsonl")]
    assert len(kept) == 1 and not (out / "changes.jsonl").exists()


def test_a_change_record_torn_by_a_kill_is_cut_before_the_next_is_written(tmp_path):
    out = tmp_path / "run"
    make(out, [Steer({2: {"lr": 0.02}})], steps=3).train()
    whole = (out / "changes.jsonl").read_text()
    (out / "changes.jsonl").write_text(whole + '{"id": "9", "step": 3, "val')  # killed mid-line
    assert [r["step"] for r in read_changes(out / "changes.jsonl")] == [2]
    resumed = make(out, [Steer({5: {"lr": 0.03}}, after=3)], resume="auto", steps=6)
    resumed.train()
    assert [r["step"] for r in read_changes(out / "changes.jsonl")] == [2, 5]


def test_replay_on_the_command_line_refuses_what_it_cannot_do(tmp_path, capsys):
    assert main(["train", "--replay", str(tmp_path), "--out", str(tmp_path / "b")]) == 2
    assert "no config.yaml there" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("recipe: mlp-regression\n")
    (tmp_path / "changes.jsonl").write_text('{"not": "a change"}\n{"id": "1"}\n')
    assert main(["train", "--replay", str(tmp_path), "--resume", "auto"]) == 2
    assert "cannot be combined with --resume" in capsys.readouterr().err
    assert main(["train", "--replay", str(tmp_path), "--out", str(tmp_path / "b")]) == 2
    assert "changes.jsonl:1 is not a change record" in capsys.readouterr().err


def test_in_transformers_trainer_a_set_changes_the_arguments_and_the_state_too(tmp_path):
    from hookloop.compat.hf import Trainer as HFTrainer
    from hookloop.compat.hf import TrainingArguments

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 1)

        def forward(self, x, labels=None):
            out = self.linear(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = [{"x": row, "labels": row.sum(0, keepdim=True)} for row in x]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=12, logging_steps=4,
                             per_device_train_batch_size=4, learning_rate=0.01,
                             report_to=[], save_strategy="no")  # fmt: skip
    steer = Steer({5: {"lr": 0.05, "log_every": 2, "clip_grad_norm": 0.3, "eps": 1e-6}})
    trainer = HFTrainer(model=Regression(), args=args, train_dataset=data, callbacks=[steer])
    with pytest.raises(SettingError, match="eval_every: eval_strategy is 'no'"):
        trainer.loop.parts.live.check({"eval_every": 5})
    trainer.train()
    assert (args.learning_rate, args.logging_steps, args.max_grad_norm) == (0.05, 2, 0.3)
    assert args.adam_epsilon == 1e-6 and trainer.state.logging_steps == 2
    logged = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == [4, 6, 8, 10, 12]  # every 4 steps, then every 2
    assert logged[6] == pytest.approx(0.05 * 7 / 12)  # linear decay, from the new peak


# -- records -----------------------------------------------------------------------------


def test_each_change_is_recorded_in_metrics_progress_tensorboard_runs_and_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hookloop.callbacks.tensorboard import TBLogger

    out = tmp_path / "run"
    loggers = [JsonLogger(out / "metrics.jsonl"), ProgressLog(), TBLogger(out / "tb")]
    make(out, [*loggers, Steer({8: {"lr": 0.02, "log_every": 2}})], steps=12).train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sets = [r for r in records if r["kind"] == "set"]
    assert [(r["step"], r["key"], r["old"], r["new"], r["client"]) for r in sets] == [
        (8, "lr", 0.01, 0.02, "test"),
        (8, "log_every", 5, 2, "test"),
    ]
    assert [r["step"] for r in records if r["kind"] == "train"] == [5, 10, 12]  # then every 2
    lines = [line for line in (out / "progress.txt").read_text().splitlines() if "Changed" in line]
    assert lines[0].split("\t")[3:] == [
        "Changed setting", "Iteration: 8", "Key: lr", "Old: 0.01", "New: 0.02", "Client: test",
    ]  # fmt: skip
    assert first_job_start(out / "progress.txt", 1) is not None  # the reader passes them by
    events = EventAccumulator(str(out / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    texts = [
        e.tensor_proto.string_val[0].decode()
        for e in events.Tensors("settings/changes/text_summary")
    ]
    assert texts == ["`lr`: 0.01 -> 0.02 (test)", "`log_every`: 5 -> 2 (test)"]
    summary = summarize_run(out)
    assert [(c["step"], c["key"], c["new"]) for c in summary.changes] == [
        (8, "lr", 0.02), (8, "log_every", 2),
    ]  # fmt: skip
    assert "step 8: lr=0.02; step 8: log_every=2" in format_table([summary])
    figure = make_figure([out])
    marks = {line.get_gid() for ax in figure.axes for line in ax.get_lines() if line.get_gid()}
    assert marks == {"live change at step 8: lr=0.02, log_every=2"}


# -- a real job, steered over HTTP, killed and resumed ----------------------------------------


def _cli(args: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-m", "hookloop", *args]
    return zygote.Popen(command, cwd=TESTS, env=env, stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True, **kwargs)  # fmt: skip


def _client(jobs_dir: Path, pid: int, timeout: float = 90.0) -> JobClient:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in list_jobs(jobs_dir) if r.pid == pid]
        if found:
            return JobClient.from_record(found[0])
        time.sleep(0.1)
    raise AssertionError("the job never announced itself")


def _wait(client: JobClient, predicate, what: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.status()
        if predicate(status):
            return status
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_steered_job_killed_at_random_moments_resumes_onto_its_replay(tmp_path, capsys):
    jobs = tmp_path / "jobs"
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(HOOKLOOP_JOBS_DIR=str(jobs), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONDONTWRITEBYTECODE="1", STEER_SLEEP="0.03")  # fmt: skip
    run, replay = tmp_path / "run", tmp_path / "replay"
    common = ["train.max_steps=150", "checkpoint.every=20", "train.log_every=5", *QUIET]
    job = _cli(["train", "--recipe", "_steer_recipe:RECIPE", "--out", str(run), *common], env)
    try:
        client = _client(jobs, job.pid)
        _wait(client, lambda s: s["step"] >= 5, "step 5")
        job_id = client.job_id
        ctl = ["ctl", "--jobs-dir", str(jobs), job_id, "set"]
        assert (
            main(["ctl", "--jobs-dir", str(jobs), "set", job_id, "lr=0.02", "clip_grad_norm=0.5"])
            == 0
        )
        for refused in (["lr=0.01", "batch_size=4"], ["momentum=1.5"], ["lr=fast"]):
            assert main([*ctl, *refused]) == 2  # refused whole: the lr above is not applied
        err = capsys.readouterr().err
        assert (
            "batch_size cannot change mid-run" in err
            and "momentum must be a number in [0, 1)" in err
        )
        first = _wait(client, lambda s: len(s["changes"]) == 1, "the first change")
        assert first["settings"]["lr"] == 0.02 and first["settings"]["clip_grad_norm"] == 0.5
        _wait(client, lambda s: s["step"] >= first["changes"][0]["step"] + 25, "25 more steps")
        assert main([*ctl, "lr_scale=0.5", "momentum=0.5"]) == 0
        _wait(client, lambda s: len(s["changes"]) == 2, "the second change")
        time.sleep(random.Random(os.getpid()).uniform(0.0, 0.8))  # then a kill, anywhere
        job.send_signal(signal.SIGKILL)
        job.wait(30)
    finally:
        if job.poll() is None:
            job.kill()
    changes = read_changes(run / "changes.jsonl")
    assert len(changes) == 2 and changes[1]["values"] == {"lr_scale": 0.5, "momentum": 0.5}
    # a second kill, at a random moment of the resumed run (which replays what it must)
    resume = ["train", "--out", str(run), "--resume", "auto", *QUIET]
    second = _cli(resume, env)
    try:
        _client(jobs, second.pid)
        time.sleep(random.Random(os.getpid() + 1).uniform(0.0, 1.5))
        with contextlib.suppress(ProcessLookupError):  # (it may have finished: no harm)
            second.send_signal(signal.SIGKILL)
        second.wait(30)
    finally:
        if second.poll() is None:
            second.kill()
    quiet_env = {**env, "STEER_SLEEP": "0"}
    resumed = _cli(resume, quiet_env)
    assert resumed.wait(120) == 0, resumed.stderr.read()
    again = _cli(["train", "--replay", str(run), "--out", str(replay), *QUIET], quiet_env)
    assert again.wait(120) == 0, again.stderr.read()
    final = "checkpoints/step-00000150/model.safetensors"
    a, b = load_file(run / final), load_file(replay / final)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_changes(run / "changes.jsonl") == changes  # replayed, not recorded twice
    sets = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "set"]  # fmt: skip
    assert [(r["step"], r["key"]) for r in sets] == [
        (changes[0]["step"], "lr"), (changes[0]["step"], "clip_grad_norm"),
        (changes[1]["step"], "lr"), (changes[1]["step"], "momentum"),
    ]  # fmt: skip
