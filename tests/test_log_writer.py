"""Logging off the training loop's critical path: one background writer, one host read.

What a user relies on: the loggers' records arrive in order; a write that fails
stops the run instead of vanishing; a SIGKILL after a checkpoint leaves every step
up to it in metrics.jsonl, and the resume then writes every step exactly once; a
log step reads its values back from the device once; the progress table can be
limited by wall time.
"""

from __future__ import annotations

import io
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import _zygote as zygote
from _quiet import SERVICES_OFF
from hookloop import CallbackContext, TrainConfig, Trainer
from hookloop.callbacks import JsonLogger, ProgressBar, read_jsonl
from hookloop.callbacks._writer import LogWriter, LogWriterError, log_writer
from hookloop.state import Progress, TrainState
from hookloop.step import read_back

WAIT_S = 60


def _tiny_trainer(callbacks, *, steps=6, log_every=1, clip=None, out_dir=None):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(steps)]
    config = TrainConfig(
        max_steps=steps,
        log_every=log_every,
        clip_grad_norm=clip,
        handle_signals=False,
        device="cpu",
    )
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=data,
        loss_fn=nn.MSELoss(),
        config=config,
        callbacks=callbacks,
        out_dir=out_dir,
    )


@pytest.fixture
def held_writer():
    """The shared writer thread, blocked until the test lets it go."""
    release = threading.Event()
    log_writer().submit(release.wait, 10.0)
    yield release
    release.set()
    log_writer().flush()


# -- the writer ------------------------------------------------------------------------------


def test_tasks_run_in_the_order_given_on_one_background_thread():
    writer = LogWriter(name="test-writer")
    seen: list[tuple[int, str]] = []
    for i in range(200):
        writer.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    assert writer.flush(timeout=10)
    assert [i for i, _ in seen] == list(range(200))
    assert {name for _, name in seen} == {"test-writer"}


def test_a_failed_write_is_raised_on_the_loops_thread_naming_the_task():
    writer = LogWriter()

    def write_to_a_full_disk() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(write_to_a_full_disk)
    with pytest.raises(LogWriterError, match=r"write_to_a_full_disk.*No space left"):
        writer.flush(timeout=10)
    writer.submit(lambda: None)  # reported once; the writer goes on serving
    assert writer.flush(timeout=10)


def test_tasks_keep_their_order_when_a_handover_lands_as_the_threads_wait_runs_out():
    """The thread takes the tasks not handed over yet when its wait for a handover runs
    out; a handover in between (the loop's, every 0.25 s: the same period) comes first.
    A run once wrote a TensorBoard event file that began with step 22, before steps 2-20."""
    writer = LogWriter(name="test-writer")
    seen: list[str] = []
    raced = threading.Event()

    class RacingQueue(queue.SimpleQueue):
        def get(self, block=True, timeout=None):
            if not raced.is_set() and self.empty():
                writer._next_handover = 0.0  # the loop, between the time-out and the lock:
                writer.submit(seen.append, "first")  # handed over
                writer.submit(seen.append, "second")  # left for the next handover
                raced.set()
                raise queue.Empty
            return super().get(block, timeout)

    writer._queue = RacingQueue()
    writer.submit(seen.append, "start")  # starts the thread
    assert raced.wait(10)
    assert writer.flush(timeout=10)
    assert seen == ["start", "first", "second"]


def test_a_logger_waits_for_its_own_writes_not_for_a_slow_task_handed_over_after_them():
    """What lets one logger drain at a checkpoint without waiting for the fsync another
    logger handed over after its records."""
    writer = LogWriter(name="test-writer")
    seen: list[str] = []
    mine = writer.submit(seen.append, "mine")
    slow_sync = threading.Event()
    writer.submit(slow_sync.wait, 10.0)
    assert writer.wait(mine, timeout=10)
    assert seen == ["mine"] and not slow_sync.is_set()
    assert not writer.flush(timeout=0.2)  # everything: the slow task still runs
    slow_sync.set()
    assert writer.flush(timeout=10)


def test_a_log_event_returns_before_the_record_is_written(tmp_path, held_writer):
    path = tmp_path / "metrics.jsonl"
    logger = JsonLogger(path)
    ctx = CallbackContext()
    ctx.logs = {"loss": 0.5, "lr": 0.1, "bad": float("nan")}
    logger.on_log(ctx)  # the writer thread is held: this must not wait for it
    assert not path.exists() or path.read_text() == ""
    held_writer.set()
    logger.flush()
    (record,) = read_jsonl(path)
    assert record["kind"] == "train" and record["loss"] == 0.5 and record["bad"] == "nan"


def test_a_tensor_in_the_logs_is_read_at_the_log_event_and_plain_values_later(
    tmp_path, held_writer
):
    """Plain numbers are converted on the writer thread; a tensor a callback put in the
    logs is read at once, so a later in-place change does not reach the files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hookloop.callbacks.tensorboard import TBLogger

    path, tb_dir = tmp_path / "metrics.jsonl", tmp_path / "tb"
    json_logger, tb_logger = JsonLogger(path), TBLogger(tb_dir, log_config=False)
    progress = Progress()
    ctx = CallbackContext(state=TrainState(progress))
    progress.step = 7
    value = torch.tensor(2.5)
    ctx.logs = {"loss": 0.5, "custom": value, "note": "text", "inf": float("inf")}
    json_logger.on_log(ctx)
    tb_logger.on_log(ctx)
    value.fill_(-1.0)  # after the event: too late to show
    held_writer.set()
    json_logger.close()
    tb_logger.writer.close()
    (record,) = read_jsonl(path)
    assert (record["step"], record["loss"], record["custom"]) == (7, 0.5, 2.5)
    assert (record["note"], record["inf"]) == ("text", "inf")
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/custom", "train/inf", "train/loss"]
    assert [(e.step, e.value) for e in events.Scalars("train/custom")] == [(7, 2.5)]


def test_a_checkpoint_offset_counts_every_record_handed_over_before_it(tmp_path, held_writer):
    path = tmp_path / "metrics.jsonl"
    logger = JsonLogger(path)
    progress = Progress()
    ctx = CallbackContext(state=TrainState(progress))
    for step in range(1, 4):
        progress.step = step
        ctx.logs = {"loss": float(step)}
        logger.on_log(ctx)
    threading.Timer(0.2, held_writer.set).start()  # state_dict() must wait for the writer
    offset = logger.state_dict()["offset"]
    assert offset == path.stat().st_size
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    logger.close()


def test_json_records_follow_the_loop_in_order_across_a_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    result = _tiny_trainer([JsonLogger(path)], steps=20, log_every=1).train()
    records = read_jsonl(path)  # on_train_end drained the writer: nothing is pending
    assert [r["kind"] for r in records] == ["start"] + ["train"] * 20 + ["end"]
    assert [r["step"] for r in records[1:-1]] == list(range(1, 21))
    assert records[-2]["loss"] == result.logs["loss"]


# -- one host read per log -------------------------------------------------------------------


def test_read_back_equals_reading_each_value_alone():
    loss = torch.tensor([0.1234567, 2.5], dtype=torch.float32)
    norm = torch.tensor(3.3, dtype=torch.float64)
    tokens = torch.tensor(2**25 + 1, dtype=torch.int64)  # past float32's exact integers
    got = read_back([loss, None, norm, tokens, 7])
    assert got[0] == loss.tolist()
    assert got[1] is None
    assert got[2] == [norm.float().item()]
    assert got[3] == [float(2**25 + 1)]
    assert got[4] == [7.0]


def test_a_log_step_reads_the_device_once(monkeypatch):
    calls = {"tolist": 0, "item": 0}
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def counting_tolist(self):
        calls["tolist"] += 1
        return tolist(self)

    def counting_item(self):
        calls["item"] += 1
        return item(self)

    trainer = _tiny_trainer([], steps=8, log_every=4, clip=1.0)
    trainer.config.train.skip_nonfinite = False  # its per-step check is not a log read
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    result = trainer.train()
    assert calls == {"tolist": 2, "item": 0}  # two log steps: loss and grad norm together
    assert result.logs["grad_norm"] > 0


# -- the progress line -----------------------------------------------------------------------


def test_the_progress_table_is_limited_by_wall_time():
    out = io.StringIO()
    bar = ProgressBar(stream=out, use_tqdm=False, min_interval=3600)
    _tiny_trainer([bar], steps=7, log_every=1).train()
    rows = [line for line in out.getvalue().splitlines() if line.lstrip()[:1].isdigit()]
    assert [r.split()[0] for r in rows] == ["1/7"]  # the first is shown, the rest fall inside
    assert out.getvalue().splitlines()[-1] == "training ended at step 7: max_steps"
    with pytest.raises(ValueError, match="min_interval must be a number of seconds >= 0"):
        ProgressBar(min_interval=-1)


# -- a killed run ----------------------------------------------------------------------------


def _train_command(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hookloop",
        "train",
        "--recipe",
        "mlp-regression",
        "--out",
        str(run_dir),
        "train.log_every=1",
        "logging.progress=false",
        "callbacks.info=false",
        *SERVICES_OFF,
        *extra,
    ]


def _latest_step(run_dir: Path) -> int | None:
    latest = run_dir / "checkpoints" / "latest"
    try:
        name = latest.read_text().strip()
        return json.loads((latest.parent / name / "manifest.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_keeps_every_step_up_to_it_and_resume_logs_each_once(
    tmp_path,
):
    run_dir = tmp_path / "run"
    command = _train_command(run_dir, "train.max_steps=100000", "checkpoint.every=20")
    proc = zygote.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + WAIT_S
        while (saved := _latest_step(run_dir)) is None or saved < 40:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no checkpoint at step >= 40 in time"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    saved = _latest_step(run_dir)  # a later save may have committed before the kill landed
    killed = read_jsonl(run_dir / "metrics.jsonl")
    logged = [r["step"] for r in killed if r["kind"] == "train"]
    assert logged[:saved] == list(range(1, saved + 1))  # every step up to the checkpoint
    assert not any(r["kind"] == "end" for r in killed)  # killed: no end record

    stop = saved + 5
    resumed = zygote.run(
        [*_train_command(run_dir, f"train.max_steps={stop}"), "--resume", "auto"],
        capture_output=True,
        text=True,
        timeout=WAIT_S * 2,
    )
    assert resumed.returncode == 0, resumed.stderr
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, stop + 1))
    assert [r["kind"] for r in records].count("start") == 2
    assert records[-1]["kind"] == "end" and records[-1]["status"] == "finished"
