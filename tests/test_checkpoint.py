"""Checkpoints: atomic commit, corruption detection, exact resume across processes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from _quiet import SERVICES_OFF
from hookloop import Callback, Config, DataConfig, TrainConfig, Trainer
from hookloop.callbacks import read_jsonl
from hookloop.checkpoint import FAULT_ENV, FAULT_POINTS, CheckpointError, SavePolicy
from hookloop.testing import TinyModel, ToyData, assert_same_checkpoint

# -- helpers ------------------------------------------------------------------------------

# A small run with shuffling, dropout and accumulation 3: 192 samples / 16 / 3 = 4 steps an
# epoch, 14 steps in all (3.5 epochs).
RUN_ARGS = [
    "--recipe", "mlp-regression",
    "train.max_steps=14", "train.grad_accum=3", "train.log_every=1", "train.eval_every=5",
    "data.batch_size=16", "data.train_samples=192", "data.eval_samples=64",
    "model.dropout=0.3", "checkpoint.every=3", "checkpoint.keep_last=null",
    "logging.progress=false", "seed=7", *SERVICES_OFF,
]  # fmt: skip


def hookloop(out: Path, *extra: str, env: dict | None = None, check: bool = True, start=zygote.run):
    """``hookloop train`` on the small run; ``start=subprocess.run`` for a real process
    (the default forks one from a zygote that has imported torch already)."""
    cmd = [sys.executable, "-m", "hookloop", "train", "--out", str(out), *RUN_ARGS, *extra]
    proc = start(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def train_losses(run: Path) -> dict[int, float]:
    """step -> logged train loss (log_every=1); each step must appear exactly once."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    steps = [s for s, _ in train]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return dict(train)


def final_checkpoint(run: Path) -> Path:
    root = run / "checkpoints"
    return root / (root / "latest").read_text().strip()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The reference every resumed run is compared with: a real process, so that the runs
    the tests stop and resume from a zygote are held to what ``hookloop train`` does."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    hookloop(run, start=subprocess.run)
    return run


# -- exact resume -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop_at", [1, 6, 8, 14], ids=["first-step", "mid-epoch", "epoch-boundary", "last-step"]
)
def test_resume_in_a_new_process_is_bitwise_identical(uninterrupted, tmp_path, stop_at):
    run = tmp_path / "run"
    first = hookloop(run, f"train.exit_interval={stop_at}")
    assert f"exit_interval at step {stop_at}" in first.stdout or stop_at == 14
    hookloop(run, "--resume", "auto", "train.exit_interval=null")  # the run's config keeps it
    assert_same_checkpoint(final_checkpoint(uninterrupted), final_checkpoint(run))
    assert train_losses(run) == train_losses(uninterrupted)


def checkpoint_step(run: Path) -> int | None:
    """The step of the checkpoint ``latest`` names (None: no complete checkpoint yet)."""
    root = run / "checkpoints"
    try:
        manifest = root / (root / "latest").read_text().strip() / "manifest.json"
        return json.loads(manifest.read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None  # none yet, or being replaced this instant


def own_records(run: Path, pid: int) -> list[dict]:
    """The metrics records the process ``pid`` wrote: those after its own start record."""
    records = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    starts = [i for i, r in enumerate(records) if r["kind"] == "start" and r.get("pid") == pid]
    return records[starts[-1] + 1 :] if starts else []


def kill_after_step(proc: subprocess.Popen, run: Path, step: int, timeout: float = 120) -> None:
    """SIGKILL ``proc`` as soon as it has logged ``step`` and a checkpoint exists.

    Polls the run directory (every few ms, parsing the log only when it changed) instead
    of guessing a time: start-up takes 2 s on an idle machine and 20 s on a loaded one.
    """
    log, seen = run / "metrics.jsonl", None
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before its kill after step {step}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run logged no step {step} within {timeout:.0f} s")
        stat = log.stat() if log.exists() else None
        now = stat and (stat.st_size, stat.st_mtime_ns)
        if now != seen:
            seen = now
            steps = [r["step"] for r in own_records(run, proc.pid) if r["kind"] == "train"]
            if steps and steps[-1] >= step and checkpoint_step(run) is not None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                return
        time.sleep(0.002)


@pytest.mark.slow
def test_sigkill_at_random_times_then_auto_resume_matches_uninterrupted(uninterrupted, tmp_path):
    # Ten SIGKILLs, each right after the process logged a randomly chosen step 1-6 steps past
    # the checkpoint it resumed from (and once some checkpoint exists), never later than
    # step 10: the run checkpoints at 3, 6, 9 and 12 and ends at 14, so every kill lands
    # after a checkpoint and well before the end, whatever the machine's speed; and the
    # processes killed resume from different checkpoints (seed 1234: 0, 3, 6 and 9).
    # Each killed run holds still once it has logged the step after the one aimed at
    # (tests/_held_train.py), so the kill lands between those two log records (in the
    # step, its evaluation or its save) however long this process takes to notice: the
    # resumes above do not depend on the machine's load, and no run reaches its end.
    rng = random.Random(1234)
    run = tmp_path / "run"
    args = ["train", "--out", str(run), *RUN_ARGS, "train.max_steps=14", "--resume", "auto"]
    cmd = [sys.executable, "-m", "hookloop", *args]
    held_train = [sys.executable, str(Path(__file__).with_name("_held_train.py"))]
    kills, landed = 0, []
    for kill in range(10):
        resumed_from = checkpoint_step(run) or 0
        target = min(resumed_from + rng.randint(1, 6), 10) if resumed_from < 10 else 13
        stderr = tmp_path / f"stderr-{kill}.txt"
        with stderr.open("wb") as err:
            held = [*held_train, str(max(target, 4) + 1), *args]  # 4: after step 3's save
            proc = zygote.Popen(held, stdout=subprocess.DEVNULL, stderr=err)
            kill_after_step(proc, run, target)
        kills += 1
        # Where it landed: killed (not exited), after a complete checkpoint, at or past the
        # step it was aimed at, and before the run's end.
        assert proc.returncode == -signal.SIGKILL, stderr.read_text()[-2000:]
        mine = own_records(run, proc.pid)
        steps = [r["step"] for r in mine if r["kind"] == "train"]
        assert not any(r["kind"] == "end" for r in mine)
        assert (checkpoint_step(run) or 0) >= 3
        assert target <= steps[-1] < 14, (target, steps)
        landed.append((resumed_from, steps[-1]))
    assert all(start > 0 for start, _ in landed[1:]), landed  # each later kill hit a resume
    assert len({start for start, _ in landed}) >= 3, landed
    final = zygote.run(cmd, capture_output=True, timeout=300)
    assert final.returncode == 0, final.stderr.decode()[-2000:]
    assert b"max_steps at step 14" in final.stdout  # the result line
    assert kills >= 10
    assert_same_checkpoint(final_checkpoint(uninterrupted), final_checkpoint(run))
    assert train_losses(run) == train_losses(uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", FAULT_POINTS)
def test_crash_inside_the_save_protocol_never_leaves_a_loadable_partial(
    uninterrupted, tmp_path, point, mode
):
    run = tmp_path / "run"
    async_save = f"checkpoint.async_save={str(mode == 'async').lower()}"
    crashed = hookloop(run, async_save, env={FAULT_ENV: f"{point}@6"}, check=False)
    assert crashed.returncode == 86, crashed.stderr[-2000:]
    root = run / "checkpoints"
    newest_intact = 6 if point in ("renamed", "latest_staged", "committed") else 3
    resumed = hookloop(run, "--resume", "auto")
    assert "skipping damaged" not in resumed.stderr
    assert not [p for p in root.iterdir() if p.name.startswith(".staging")]
    losses = train_losses(run)
    assert min(s for s in losses if s > newest_intact) == newest_intact + 1
    assert_same_checkpoint(final_checkpoint(uninterrupted), final_checkpoint(run))


@pytest.mark.slow
def test_sigterm_saves_at_the_current_step_exits_143_and_resume_is_exact(tmp_path):
    # The run holds still at step 2 until a signal reaches it (tests/_held_train.py), so the
    # SIGTERM sent after the first logged step lands in step 1 or 2 however long this
    # process takes to see that record: a whole small run takes ~0.1 s.
    args = ["train.max_steps=40", "checkpoint.every=null", "train.eval_every=1000"]
    ref = tmp_path / "ref"
    hookloop(ref, *args)
    run = tmp_path / "run"
    held = Path(__file__).with_name("_held_train.py")
    cmd = [sys.executable, str(held), "2", "train", "--out", str(run), *RUN_ARGS, *args]
    proc = zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (logged := [r for r in own_records(run, proc.pid) if r["kind"] == "train"]):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no train record before the SIGTERM: {proc.communicate()[1][-2000:]}")
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # right after the first logged step
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()[-2000:]
    assert b"signal SIGTERM" in out  # the result line
    saved = final_checkpoint(run)
    step = json.loads((saved / "manifest.json").read_text())["step"]
    assert 0 < logged[-1]["step"] <= step <= 3  # the step signalled in, or the one after
    assert max(train_losses(run)) == step  # the checkpoint is at the step it stopped on
    hookloop(run, *args, "--resume", "auto")
    assert_same_checkpoint(final_checkpoint(ref), final_checkpoint(run))
    assert train_losses(run) == train_losses(ref)


# -- corruption -----------------------------------------------------------------------------


def toy_trainer(out: Path, resume=None, callbacks=None, batch_size=4, **train) -> Trainer:
    cfg = Config(
        train=TrainConfig(**{"max_steps": 6, "log_every": 0, **train}),
        data=DataConfig(batch_size=batch_size),
    )
    cfg.checkpoint.every = 2
    cfg.checkpoint.keep_last = None
    return Trainer(
        TinyModel(), train_data=ToyData(n=32), loss_fn=TinyModel.loss_fn, config=cfg,
        out_dir=str(out), resume=resume, callbacks=callbacks,
    )  # fmt: skip


def damage(ckpt: Path, how: str) -> Path:
    target = ckpt / "model.safetensors"
    data = bytearray(target.read_bytes())
    if how == "flipped-byte":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif how == "truncated":
        target.write_bytes(bytes(data[:-10]))
    elif how == "missing":
        target.unlink()
    return target


@pytest.mark.parametrize("how", ["flipped-byte", "truncated", "missing"])
def test_auto_resume_skips_a_damaged_checkpoint_and_says_so(tmp_path, how):
    toy_trainer(tmp_path).train()
    root = tmp_path / "checkpoints"
    damage(root / "step-00000006", how)
    with pytest.warns(UserWarning, match="skipping damaged checkpoint") as caught:
        trainer = toy_trainer(tmp_path, resume="auto", max_steps=8)
        result = trainer.train()
    assert "model.safetensors" in str(caught[0].message)
    assert result.step == 8
    first_resumed = trainer.state.step  # continued from step 4, the previous intact one
    assert first_resumed == 8


@pytest.mark.parametrize(
    ("how", "problem"),
    [("flipped-byte", "checksum"), ("truncated", "truncated"), ("missing", "missing")],
)
def test_explicit_resume_of_a_damaged_checkpoint_fails_naming_file_and_problem(
    tmp_path, how, problem
):
    toy_trainer(tmp_path).train()
    ckpt = tmp_path / "checkpoints" / "step-00000006"
    damaged = damage(ckpt, how)
    trainer = toy_trainer(tmp_path, resume=str(ckpt))
    with pytest.raises(CheckpointError, match=problem) as err:
        trainer.train()
    assert str(damaged) in str(err.value)


def test_directory_without_manifest_is_never_loaded_and_next_save_removes_it(tmp_path):
    toy_trainer(tmp_path).train()
    root = tmp_path / "checkpoints"
    (root / "step-00000006" / "manifest.json").unlink()
    (root / ".staging-step-00000099-1").mkdir()
    trainer = toy_trainer(tmp_path, resume="auto", max_steps=8)
    loaded = []
    trainer.callbacks.register("on_checkpoint_load", lambda ctx: loaded.append(ctx.state.step))
    trainer.train()
    assert loaded == [4]
    names = sorted(p.name for p in root.iterdir())
    assert ".staging-step-00000099-1" not in names
    assert "step-00000006" in names  # re-saved by the resumed run, now complete
    assert (root / "step-00000006" / "manifest.json").is_file()


def test_a_new_run_into_a_directory_with_checkpoints_is_refused(tmp_path):
    toy_trainer(tmp_path).train()
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(ValueError, match="resume='auto'"):
        toy_trainer(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_cli_refuses_to_start_a_second_run_in_the_same_directory(tmp_path):
    from hookloop.app.cli import main

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *RUN_ARGS, "train.max_steps=2"]) == 0
    before = (out / "metrics.jsonl").read_bytes()
    assert main(["train", "--out", str(out), *RUN_ARGS, "train.max_steps=2"]) == 2
    assert (out / "metrics.jsonl").read_bytes() == before


# -- contents and policy ---------------------------------------------------------------------


class Patience(Callback):
    """Stops after `patience` evaluations without a new best (early-stopping-like state)."""

    def __init__(self, patience: int) -> None:
        self.patience, self.best, self.bad = patience, float("inf"), 0

    def on_eval_end(self, ctx):
        value = ctx.metrics["eval_loss"]
        if value < self.best - 1e-9:
            self.best, self.bad = value, 0
        else:
            self.bad += 1
            if self.bad >= self.patience:
                ctx.control.request_stop("no improvement")

    def state_dict(self):
        return {"best": self.best, "bad": self.bad}

    def load_state_dict(self, state):
        self.best, self.bad = state["best"], state["bad"]


def patience_trainer(out: Path, resume=None, **train) -> Trainer:
    cfg = Config(
        train=TrainConfig(**{"max_steps": 200, "log_every": 0, "eval_every": 1, **train}),
        data=DataConfig(batch_size=8),
    )
    cfg.optimizer.lr = 0.5  # too high: eval loss soon stops improving
    cfg.checkpoint.every = 1
    return Trainer(
        TinyModel(), train_data=ToyData(n=64), eval_data=ToyData(n=16, seed=3),
        loss_fn=TinyModel.loss_fn, config=cfg, out_dir=str(out), resume=resume,
        callbacks=[Patience(patience=3)],
    )  # fmt: skip


def test_a_patience_counter_survives_a_restart_and_stops_at_the_same_step(tmp_path):
    reference = patience_trainer(tmp_path / "a").train()
    assert reference.stop_reason == "no improvement"
    stop = reference.step
    # Interrupt two steps before the reference stopped, while the counter is part-way up.
    patience_trainer(tmp_path / "b", exit_interval=stop - 2).train()
    resumed = patience_trainer(tmp_path / "b", resume="auto").train()
    assert (resumed.step, resumed.stop_reason) == (stop, "no improvement")


def test_callback_state_mismatch_warns_by_default_and_raises_in_strict_mode(tmp_path):
    for run in ("lenient", "strict"):
        patience_trainer(tmp_path / run, exit_interval=2).train()
    with pytest.warns(UserWarning, match="'Patience' has no matching callback"):
        toy_trainer(tmp_path / "lenient", resume="auto", batch_size=8).train()
    strict = toy_trainer(tmp_path / "strict", resume="auto", batch_size=8)
    strict.checkpoints.strict = True  # what checkpoint.strict_resume=true sets up
    with pytest.raises(CheckpointError, match="Patience"):
        strict.train()


def test_user_state_that_cannot_be_loaded_safely_is_refused_at_save(tmp_path):
    trainer = toy_trainer(tmp_path)
    trainer.callbacks.user_state["handle"] = object()
    with pytest.raises(CheckpointError, match="user_state"):
        trainer.train()


def test_checkpoint_holds_every_piece_of_state(tmp_path):
    toy_trainer(tmp_path).train()
    ckpt = tmp_path / "checkpoints" / "step-00000006"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [
        "config.yaml", "manifest.json", "model.safetensors", "optimizer.pt", "trainer_state.pt",
    ]  # fmt: skip
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert set(state["rng"]) >= {"python", "numpy", "torch"}
    assert state["train_state"]["step"] == 6
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == set(names) - {"manifest.json"}


def test_retention_keeps_the_newest_and_the_best():
    policy = SavePolicy(keep_last=2, monitor="eval_loss", mode="min", keep_best=1)
    manifests = [
        {"name": f"step-{s}", "step": s, "metric": m}
        for s, m in [(1, 0.9), (2, 0.2), (3, 0.5), (4, 0.7), (5, 0.6)]
    ]
    assert policy.to_keep(manifests, latest="step-5") == {"step-4", "step-5", "step-2"}
    assert SavePolicy(keep_last=None).to_keep(manifests, None) == {f"step-{s}" for s in range(1, 6)}


def test_save_request_from_a_callback_writes_a_checkpoint_at_that_step(tmp_path):
    cfg = Config(train=TrainConfig(max_steps=5, log_every=0), data=DataConfig(batch_size=4))
    cfg.checkpoint.save_on_end = False
    trainer = Trainer(TinyModel(), train_data=ToyData(n=32), loss_fn=TinyModel.loss_fn,
                      config=cfg, out_dir=str(tmp_path))  # fmt: skip
    trainer.callbacks.register("on_train_step_end", lambda ctx: ctx.control.request_save(), once=3)
    saved = []
    trainer.callbacks.register("on_checkpoint_save", lambda ctx: saved.append(ctx.state.step))
    trainer.train()
    assert saved == [3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest", "step-00000003",
    ]  # fmt: skip


def test_a_save_asked_inside_a_step_before_its_update_resumes_that_step_again(tmp_path):
    def run(out: Path, resume: str | None = None, save_in_step: int | None = None) -> Trainer:
        cfg = Config(train=TrainConfig(max_steps=5, log_every=0), data=DataConfig(batch_size=4))
        trainer = Trainer(TinyModel(), train_data=ToyData(n=32), loss_fn=TinyModel.loss_fn,
                          config=cfg, out_dir=str(out), resume=resume)  # fmt: skip
        if save_in_step is not None:
            trainer.callbacks.register(
                "on_train_step_start",
                lambda ctx: trainer.save_checkpoint() if ctx.state.step == save_in_step else None,
            )
        trainer.train()
        return trainer

    whole = run(tmp_path / "whole", save_in_step=3)  # saved before step 3's update
    saved = tmp_path / "whole" / "checkpoints" / "step-00000002"
    assert json.loads((saved / "manifest.json").read_text())["step"] == 2
    run(tmp_path / "resumed", resume=str(saved))  # runs step 3 again, then 4 and 5
    assert_same_checkpoint(
        tmp_path / "whole" / "checkpoints" / "step-00000005",
        tmp_path / "resumed" / "checkpoints" / "step-00000005",
    )
    assert whole.state.step == 5


def test_on_checkpoint_save_says_how_long_the_save_took(tmp_path):
    trainer = toy_trainer(tmp_path, max_steps=4)
    seen = []

    def record(ctx):
        seen.append(ctx.checkpoint_timing)

    trainer.callbacks.register("on_checkpoint_save", record)
    trainer.callbacks.register("on_train_end", lambda ctx: seen.append(ctx.checkpoint_timing))
    trainer.train()
    *saves, after = seen
    assert saves and after is None
    for timing in saves:
        assert 0 < timing.blocked_seconds <= timing.seconds < 30


def test_abort_saves_nothing(tmp_path):
    trainer = toy_trainer(tmp_path, max_steps=50)
    trainer.config.checkpoint.every = None
    trainer.checkpoints.policy.every = None
    trainer.callbacks.register(
        "on_train_step_end", lambda ctx: ctx.control.request_abort("test"), once=2
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = trainer.train()
    assert result.exit_code == 3
    assert not (tmp_path / "checkpoints").exists() or not list(
        (tmp_path / "checkpoints").glob("step-*")
    )


# -- data position ------------------------------------------------------------------------


class ResumableStream:
    """An iterable source that knows its position (like torchdata's StatefulDataLoader)."""

    def __init__(self, n: int = 40) -> None:
        self.data, self.pos = ToyData(n=n, seed=5), 0

    def __iter__(self):
        while self.pos < len(self.data):
            x, y = self.data[self.pos]
            self.pos += 1
            yield x[None], y[None]
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def stream_run(out: Path, data, resume=None, **train):
    seen = []
    cfg = Config(train=TrainConfig(**{"max_steps": 30, "log_every": 0, **train}))
    trainer = Trainer(TinyModel(), train_data=data, loss_fn=TinyModel.loss_fn, config=cfg,
                      out_dir=str(out), resume=resume)  # fmt: skip
    trainer.callbacks.register(
        "on_micro_step_start", lambda ctx: seen.append(round(float(ctx.batch[1]), 6))
    )
    trainer.train()
    return seen, trainer


def test_a_source_with_state_dict_resumes_mid_epoch_through_it(tmp_path):
    reference, ref_trainer = stream_run(tmp_path / "a", ResumableStream())
    first, _ = stream_run(tmp_path / "b", ResumableStream(), exit_interval=13)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot be positioned" warning
        rest, trainer = stream_run(tmp_path / "b", ResumableStream(), resume="auto")
    assert first + rest == reference
    for a, b in zip(ref_trainer.model.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_source_that_cannot_be_positioned_is_reread_with_a_warning(tmp_path):
    batches = [(x[None], y[None]) for x, y in ToyData(n=40, seed=5)]
    reference, _ = stream_run(tmp_path / "a", batches)
    first, _ = stream_run(tmp_path / "b", batches, exit_interval=13)
    with pytest.warns(UserWarning, match="cannot be positioned mid-epoch"):
        rest, _ = stream_run(tmp_path / "b", batches, resume="auto")
    assert first + rest == reference  # a list has the same order every run, so still exact
