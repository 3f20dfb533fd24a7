"""Rewind: a divergence rolls the run back to a checkpoint from before it, the data
skips a window past where it began, and training goes on in the same process."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from _dist_launch import torchrun
from _quiet import SERVICES_OFF
from _rewind_job import KILL_AT, SPIKE, build
from hookloop import Callback, Config, Control, ExitCode
from hookloop.app.cli import main
from hookloop.callbacks import DefaultMetrics, NaNDetection, ProgressBar, read_jsonl
from hookloop.callbacks.defaults import default_callbacks
from hookloop.callbacks.divergence import DivergenceDetector
from hookloop.config import apply_overrides
from hookloop.state import RewindRequest
from test_logging import tb_scalars

JOB = str(Path(__file__).with_name("_rewind_job.py"))


def records(out: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == kind]


def assert_each_step_logged_once(out: Path, last: int) -> None:
    steps = [r["step"] for r in records(out, "train")]
    assert steps == list(range(1, last + 1)), steps


def expected_timeline(skip: int, last: int = 14) -> dict[int, int]:
    """step -> batch position: 0..SPIKE-1, then SPIKE + skip onwards."""
    return {s: s - 1 if s <= SPIKE else s - 1 + skip for s in range(1, last + 1)}


@pytest.fixture(scope="module")
def rewound(tmp_path_factory):
    out = tmp_path_factory.mktemp("rewound")
    trainer, step = build(out)
    result = trainer.train()
    return out, trainer, step, result


def test_a_loss_spike_rewinds_to_the_checkpoint_before_it_and_skips_the_window(rewound):
    out, trainer, step, result = rewound
    assert result.stop_reason == "max_steps" and result.exit_code == ExitCode.OK
    # Steps 1-8 trained positions 0-7 (8 = SPIKE diverged); rewound to step 6, steps 7
    # and 8 replayed position 6 and then, 3 batches skipped, position 10.
    assert step.seen[:8] == [(s, s - 1) for s in range(1, 9)]
    assert step.seen[8:10] == [(7, 6), (8, 10)]
    assert step.timeline() == expected_timeline(skip=3)
    (rewind,) = trainer.state.rewinds
    assert (rewind.from_step, rewind.to_step, rewind.since_step) == (8, 6, 8)
    assert rewind.batches_skipped == 3 and rewind.count == 1
    assert rewind.checkpoint == str(out / "checkpoints" / "step-00000006")


def test_every_step_is_logged_once_and_the_rewind_is_recorded(rewound):
    out = rewound[0]
    assert_each_step_logged_once(out, 14)
    assert max(r["loss"] for r in records(out, "train")) < 100  # the spike's record is gone
    (record,) = records(out, "rewind")
    assert record["step"] == 6
    assert {k: record[k] for k in ("from_step", "to_step", "since_step", "batches_skipped")} == {
        "from_step": 8,
        "to_step": 6,
        "since_step": 8,
        "batches_skipped": 3,
    }
    assert "divergence: loss" in record["reason"]


@pytest.mark.slow  # W&B runs its own writer process
def test_tensorboard_and_wandb_rewind_with_the_run_and_hold_each_step_once(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    from hookloop.callbacks.tensorboard import TBLogger
    from hookloop.callbacks.wandb_logger import WandbLoggingCallback, offline_history

    loggers = [TBLogger(tmp_path / "tb"), WandbLoggingCallback(project="p", mode="offline")]
    trainer, _ = build(tmp_path, callbacks=loggers)
    trainer.train()
    assert len(trainer.state.rewinds) == 1
    tb = tb_scalars(tmp_path / "tb", "train/loss")
    assert [s for s, _ in tb] == list(range(1, 15)) and max(v for _, v in tb) < 100
    rows = offline_history(tmp_path / "wandb", wait_s=30)
    steps = [r["_step"] for r in rows if "train/loss" in r]
    assert steps == list(range(1, 15)) and max(r["train/loss"] for r in rows) < 100


def test_the_progress_bar_follows_the_rewind(tmp_path):
    bar = ProgressBar(stream=io.StringIO(), use_tqdm=True)
    counts: list[int] = []

    class BarCount(Callback):
        priority = 200  # after the bar's own update

        def on_train_step_end(self, ctx):
            counts.append(bar._bar.n)

    build(tmp_path, callbacks=[bar, BarCount()])[0].train()
    # 8 steps, then back to 6: 7 and 8 again (one count each), ... 14 of 14 at the end.
    assert counts[:10] == [*range(1, 9), 7, 8]
    assert (counts[-1] == 14 and bar._bar is None) or counts[-1] == 14


def test_throughput_after_a_rewind_counts_from_the_restored_step(tmp_path):
    build(tmp_path, callbacks=[DefaultMetrics(memory=False)])[0].train()
    rates = {r["step"]: r["samples_per_sec"] for r in records(tmp_path, "train")}
    assert len(rates) == 14 and all(rate > 0 for rate in rates.values()), rates


def test_the_progress_log_has_a_rewound_line(tmp_path):
    from hookloop.callbacks.progress_log import ProgressLog, first_job_start

    build(tmp_path, callbacks=[ProgressLog(tmp_path / "progress.txt", job="7")])[0].train()
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    (rewound,) = [line.split("\t") for line in lines if "\tRewound\t" in line]
    assert rewound[1:] == ["Job ID: 7", "# GPUs: 1", "Rewound", "Iteration: 8",
                           "To iteration: 6", "Diverged from: 8", "Batches skipped: 3"]  # fmt: skip
    saves = [line.split("\t")[4] for line in lines if "\tSaved checkpoint\t" in line]
    assert saves == ["Iteration: 3", "Iteration: 6", "Iteration: 9", "Iteration: 12",
                     "Iteration: 14"]  # fmt: skip
    assert first_job_start(tmp_path / "progress.txt", 1) is not None  # still parses


def test_the_control_status_lists_the_rewinds(tmp_path):
    from hookloop.control import ControlServer

    seen: dict = {}

    class AskStatus(Callback):
        """At step 12, after the rewind, read the status over HTTP as a dashboard would."""

        def on_train_step_end(self, ctx):
            if ctx.state.step != 12 or seen:
                return
            host, port = server.url.split("//")[1].rstrip("/").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            headers = {"Authorization": f"Bearer {server.token}"}
            conn.request("GET", f"/jobs/{server.job_id}/status", headers=headers)
            seen.update(json.loads(conn.getresponse().read()))
            conn.close()

    server = ControlServer(port=0, jobs_dir=tmp_path / "jobs", announce=False)
    trainer, _ = build(tmp_path, callbacks=[server, AskStatus()])
    trainer.train()
    (rewind,) = seen["rewinds"]
    assert (rewind["from_step"], rewind["to_step"], rewind["batches_skipped"]) == (8, 6, 3)
    assert rewind == trainer.state.rewinds[0].to_json()


def test_checkpoints_of_the_abandoned_branch_are_deleted(rewound):
    out, *_ = rewound
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved == ["step-00000003", "step-00000006", "step-00000009", "step-00000012",
                     "step-00000014"]  # fmt: skip
    manifest = json.loads((out / "checkpoints" / "step-00000009" / "manifest.json").read_text())
    assert manifest["step"] == 9


def test_a_newer_local_checkpoint_from_before_the_divergence_is_the_one_restored(tmp_path):
    trainer, step = build(tmp_path, local_every=1)
    trainer.train()
    (rewind,) = trainer.state.rewinds
    assert rewind.to_step == 7
    assert rewind.checkpoint == str(tmp_path / "local_checkpoints" / "step-00000007")
    assert step.timeline() == expected_timeline(skip=3)
    assert_each_step_logged_once(tmp_path, 14)


def test_a_checkpoint_taken_before_the_skip_resumes_with_the_skip_still_ahead(tmp_path, rewound):
    """Rewound to step 5, a save at replayed step 7, then a crash: the resumed run still
    skips at step 8 and ends where the run rewound to step 6 ended (the same batches)."""

    class SaveAt7ThenCrashAt8(Callback):
        def on_train_step_end(self, ctx):
            if ctx.state.rewinds and ctx.state.step == 7:
                ctx.control.request_save()

        def on_train_step_start(self, ctx):
            if ctx.state.rewinds and ctx.state.step == 8:
                raise RuntimeError("crash after the save, before the skip")

    first, _ = build(tmp_path, every=5, callbacks=[SaveAt7ThenCrashAt8()])
    with pytest.raises(RuntimeError, match="before the skip"):
        first.train()
    assert first.state.rewinds[0].to_step == 5
    resumed, step = build(tmp_path, every=5, resume="auto")
    resumed.train()
    assert resumed.ctx.run.resumed_from == tmp_path / "checkpoints" / "step-00000007"
    assert step.seen[0] == (8, SPIKE + 3)  # the skip planned before the save, done after it
    assert len(resumed.state.rewinds) == 1
    whole = rewound[1]
    for a, b in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert_each_step_logged_once(tmp_path, 14)


def test_a_window_longer_than_the_epoch_goes_on_into_the_next(tmp_path):
    # Steps 1-7 trained positions 0-6 of epoch 0 (32 batches); of the 40 skipped, 25 end
    # epoch 0 and 15 open epoch 1, whose step 1 (the run's step 8) trains position 15.
    trainer, step = build(tmp_path, skip_batches=40)
    trainer.train()
    later = {s: s + 7 for s in range(8, 15)}
    assert step.timeline() == {**{s: s - 1 for s in range(1, 8)}, **later}
    (record,) = [r for r in records(tmp_path, "train") if r["step"] == 8]
    assert record["epoch"] == pytest.approx(1 + 1 / 32)
    assert len(trainer.state.rewinds) == 1

    # Killed at step 10 and resumed from step 9: epoch 1 restarts past its skipped 15.
    class CrashAt10(Callback):
        def on_train_step_start(self, ctx):
            if ctx.state.step == 10:
                raise RuntimeError("crash at step 10")

    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError, match="crash at step 10"):
        build(cut, skip_batches=40, callbacks=[CrashAt10()])[0].train()
    resumed, step = build(cut, skip_batches=40, resume="auto")
    resumed.train()
    assert step.seen[0] == (10, 17)
    for a, b in zip(resumed.model.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_nan_loss_rewinds_too_and_nan_detection_yields_to_it(tmp_path):
    # The NaN step is skipped and its loss kept out of the logs: the detector counts it.
    nan = NaNDetection()
    trainer, step = build(tmp_path, spike=float("nan"), callbacks=[nan])
    result = trainer.train()
    assert result.exit_code == ExitCode.OK and result.stop_reason == "max_steps"
    (rewind,) = trainer.state.rewinds
    assert (rewind.from_step, rewind.to_step, rewind.since_step) == (8, 6, 8)
    assert "non-finite" in rewind.reason
    assert step.timeline() == expected_timeline(skip=3)
    assert trainer.state.skipped_steps == 0  # the skipped step was rolled back with the rest
    assert not nan.nan_detected  # it watches afresh after the rewind (a later NaN still stops)
    assert_each_step_logged_once(tmp_path, 14)


def test_the_learning_rate_is_scaled_for_the_steps_asked(tmp_path):
    lrs: dict[int, float] = {}

    class LRSeen(Callback):
        def on_train_step_start(self, ctx):
            optimizer = ctx.optimizer
            original = optimizer.step

            def step(*args, **kwargs):
                lrs[ctx.state.step] = optimizer.param_groups[0]["lr"]
                optimizer.step = original
                return original(*args, **kwargs)

            optimizer.step = step

    trainer, _ = build(tmp_path, callbacks=[LRSeen()], lr_factor=0.25, lr_steps=2)
    trainer.train()
    base = trainer.optimizer.param_groups[0]["lr"]
    assert lrs[6] == base and lrs[9] == base  # before the rewind, and after its 2 steps
    assert lrs[7] == pytest.approx(base * 0.25) and lrs[8] == pytest.approx(base * 0.25)


def test_after_max_rewinds_the_run_fails_with_exit_code_4(tmp_path):
    # No batches skipped: the spike comes back each time; the second time it is given up.
    trainer, _ = build(tmp_path, skip_batches=0, max_rewinds=1)
    result = trainer.train()
    assert result.exit_code == ExitCode.FAILED == 4
    assert result.failed and "gave up after 1 rewinds (max_rewinds=1)" in result.stop_reason
    assert result.step == 8 and len(trainer.state.rewinds) == 1
    (end,) = records(tmp_path, "end")
    assert end["status"] == "failed"


def test_with_no_checkpoint_before_the_divergence_the_run_fails_saying_so(tmp_path):
    trainer, _ = build(tmp_path, every=10)
    result = trainer.train()
    assert result.exit_code == ExitCode.FAILED
    assert "no checkpoint before step 8 to rewind to" in result.stop_reason


def test_a_stop_that_is_not_a_failure_wins_over_a_rewind(tmp_path):
    class StopAt8(Callback):
        def on_log(self, ctx):
            if ctx.state.step == 8:
                ctx.control.request_stop("operator asked")

    trainer, _ = build(tmp_path, callbacks=[StopAt8()])
    result = trainer.train()
    assert result.stop_reason == "operator asked" and trainer.state.rewinds == ()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"action": "rollback"}, r"action must be 'stop', 'abort' or 'rewind', got 'rollback'"),
        ({"skip_batches": -1}, r"skip_batches must be an int >= 0 or None, got -1"),
        ({"lr_factor": 0.0}, r"lr_factor must be a finite number > 0, got 0.0"),
        ({"lr_steps": 1.5}, r"lr_steps must be an int >= 0, got 1.5"),
        ({"max_rewinds": None}, r"max_rewinds must be an int >= 0, got None"),
    ],
)
def test_bad_rewind_settings_are_refused_naming_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DivergenceDetector(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"since_step": 0}, r"since_step must be a step number >= 1, got 0"),
        ({"since_step": 3, "skip_batches": True}, r"skip_batches must be an int >= 0"),
        ({"since_step": 3, "lr_factor": float("inf")}, r"lr_factor must be a finite number"),
    ],
)
def test_bad_rewind_requests_are_refused_when_filed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Control().request_rewind(**kwargs)
    assert RewindRequest(5, "x").skip_batches is None


# -- the command line --------------------------------------------------------------------

# SGD at lr 0.3 without clipping makes mlp-regression diverge from step 7 on; the default
# detector (warmup 10, patience 3) confirms it at step 13. The same run every time (CPU).
DIVERGING = [
    "train", "--recipe", "mlp-regression", "train.max_steps=30", "train.log_every=1",
    "optimizer.name=sgd", "optimizer.lr=0.3", "train.clip_grad_norm=null", "checkpoint.every=5",
    "callbacks.divergence_action=rewind", "logging.progress=false", "callbacks.info=false",
    *SERVICES_OFF,
]  # fmt: skip


def hookloop_train(out: Path, *overrides: str) -> tuple[int, str]:
    """The exit code, and stderr then stdout (where the result line goes)."""
    err, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(stdout):
        code = main([*DIVERGING, "--out", str(out), *overrides])
    return int(code), err.getvalue() + stdout.getvalue()


def test_hookloop_train_rewinds_with_a_lower_learning_rate_and_recovers(tmp_path):
    code, err = hookloop_train(
        tmp_path, "callbacks.rewind_lr_factor=0.2", "callbacks.rewind_lr_steps=30"
    )
    assert code == 0, err[-2000:]
    (rewind,) = records(tmp_path, "rewind")
    assert (rewind["from_step"], rewind["to_step"], rewind["since_step"]) == (13, 10, 11)
    assert rewind["batches_skipped"] == 3 and rewind["lr_factor"] == 0.2
    assert_each_step_logged_once(tmp_path, 30)
    assert records(tmp_path, "train")[-1]["loss"] < 0.5


def test_hookloop_train_gives_up_after_max_rewinds_with_exit_code_4(tmp_path):
    code, err = hookloop_train(tmp_path, "callbacks.max_rewinds=1")
    assert code == ExitCode.FAILED == 4
    assert "gave up after 1 rewinds (max_rewinds=1)" in err
    assert len(records(tmp_path, "rewind")) == 1
    (end,) = records(tmp_path, "end")
    assert end["status"] == "failed" and end["step"] == 13


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["callbacks.divergence_action=undo"], "expects 'stop' | 'abort' | 'rewind', got 'undo'"),
        (["callbacks.rewind_lr_factor=0"], "callbacks.rewind_lr_factor must be a number > 0"),
        (["callbacks.max_rewinds=-1"], "callbacks.max_rewinds must be an int >= 0, got -1"),
        (["checkpoint.every=null"], "set checkpoint.every or checkpoint.local_every"),
    ],
)
def test_bad_rewind_options_are_a_usage_error_naming_what_is_allowed(tmp_path, overrides, message):
    code, err = hookloop_train(tmp_path / "run", *overrides)
    assert code == ExitCode.USAGE and message in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_options_reach_the_detector(tmp_path):
    cfg = Config()
    apply_overrides(
        cfg,
        ["callbacks.divergence_action=rewind", "callbacks.max_rewinds=5",
         "callbacks.rewind_skip_batches=64", "checkpoint.local_every=10"],
    )  # fmt: skip
    callbacks = default_callbacks(cfg.validate(), tmp_path)
    (detector,) = [c for c in callbacks if isinstance(c, DivergenceDetector)]
    assert (detector.action, detector.max_rewinds, detector.skip_batches) == ("rewind", 5, 64)


# -- across processes ---------------------------------------------------------------------


def job(mode: str, out: Path, *settings: str, ranks: int = 1, code: int = 0) -> list[dict]:
    cmd = [*torchrun(ranks), JOB, mode, str(out), *settings]
    start = zygote.run if ranks == 1 else subprocess.run  # torchrun's ranks are its own
    proc = start(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stderr[-4000:]
    if code:
        return []
    return [json.loads((out / f"result-{mode}-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow
def test_sigkill_after_a_rewind_then_resume_auto_ends_on_the_same_weights(tmp_path, rewound):
    trainer = rewound[1]
    job("kill", tmp_path, code=-9)  # killed at the end of step KILL_AT, after the rewind
    assert [r["step"] for r in records(tmp_path, "rewind")] == [6]
    resumed, step = build(tmp_path, resume="auto")  # in this process
    resumed.train()
    for a, b in zip(resumed.model.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(a, b)
    (rewind,) = resumed.state.rewinds  # the history came back with the checkpoint
    assert rewind.checkpoint == str(tmp_path / "checkpoints" / "step-00000006")
    assert replace(rewind, checkpoint="") == replace(trainer.state.rewinds[0], checkpoint="")
    # It resumed after the rewind (from step 9, or 12 if its save had committed): no second
    # rewind, the skip stands.
    first, position = step.seen[0]
    assert first in (10, KILL_AT) and position == first - 1 + 3
    assert_each_step_logged_once(tmp_path, 14)
    assert len(records(tmp_path, "rewind")) == 1


@pytest.mark.slow
def test_two_gloo_ranks_rewind_at_the_same_step_and_stay_in_step(tmp_path):
    # Only rank 1's detector fires: the request is agreed, and rank 0 rewinds with it.
    ranks = job("plain", tmp_path, "detect_on_rank=1", ranks=2)
    assert ranks[0]["rewinds"] == ranks[1]["rewinds"]
    (rewind,) = ranks[0]["rewinds"]
    assert (rewind["from_step"], rewind["to_step"], rewind["batches_skipped"]) == (8, 6, 3)
    for rank in ranks:  # each rank skipped its own 3 batches from the spike on
        timeline = dict((s, p) for s, p in rank["seen"])
        assert timeline == expected_timeline(skip=3)
    assert ranks[0]["params"] == ranks[1]["params"]
    assert_each_step_logged_once(tmp_path, 14)
