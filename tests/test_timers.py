"""Named timers: the stopwatch itself, what the loop fills, what the logs show, and the
Megatron-Bridge dialect's ``context.state.timers``."""

from __future__ import annotations

import re
import time

import pytest
import torch

from hookloop import Callback, CallbackManager, Config, DataConfig, TrainConfig, Trainer
from hookloop.compat.megatron_bridge.recipes import small_gpt_pretrain_config
from hookloop.compat.megatron_bridge.training.callbacks import Callback as BridgeCallback
from hookloop.compat.megatron_bridge.training.gpt_step import forward_step
from hookloop.compat.megatron_bridge.training.pretrain import pretrain
from hookloop.config import apply_overrides
from hookloop.testing import TinyModel, ToyData
from hookloop.timers import LOOP_TIMERS, Timers, loop_clock

STEPS = 4


def _train(tmp_path=None, callbacks=(), **train) -> Trainer:
    cfg = Config(
        train=TrainConfig(max_steps=STEPS, log_every=2, eval_every=2, **train),
        data=DataConfig(batch_size=4),
    )
    cfg.checkpoint.every, cfg.checkpoint.save_on_end = 2, False
    trainer = Trainer(
        TinyModel(), train_data=ToyData(n=64), eval_data=ToyData(n=8, seed=1),
        loss_fn=TinyModel.loss_fn, config=cfg, callbacks=CallbackManager(list(callbacks)),
        out_dir=tmp_path,
    )  # fmt: skip
    trainer.train()
    return trainer


def test_a_timer_adds_up_its_intervals_and_resets_when_read():
    timers = Timers()
    timer = timers("work")
    for _ in range(2):
        timer.start()
        time.sleep(0.01)
        timer.stop()
    assert timer.count == 2
    assert timer.elapsed(reset=False) >= 0.02
    assert timer.elapsed() >= 0.02  # read and reset
    assert timer.elapsed() == 0.0 and timer.count == 0
    with timers("work") as same:
        assert same is timer and timer.active
    assert not timer.active and timers.names() == ["work"] and "work" in timers


def test_a_running_timer_counts_up_to_now_and_keeps_running():
    timer = Timers()("running")
    timer.start()
    time.sleep(0.01)
    assert timer.elapsed() >= 0.01 and timer.active  # reset restarts the count from now
    timer.stop()
    assert timer.elapsed() < 0.01


def test_an_interval_measured_elsewhere_adds_up_like_a_start_and_stop():
    timer = Timers()("fetch")
    timer.add(0.25)
    timer.add(0.5)
    assert timer.count == 2 and not timer.active
    assert timer.elapsed() == 0.75
    assert timer.count == 0


def test_the_loop_clock_reads_the_host_clock_or_nothing_when_timers_are_off():
    assert loop_clock("off")() == 0.0 == loop_clock("off")()
    for mode in ("on", "sync"):  # sync waits for a CUDA device first; on the CPU nothing to wait
        clock = loop_clock(mode, torch.device("cpu"))
        first = clock()
        time.sleep(0.01)
        assert clock() - first >= 0.01


def test_timer_misuse_names_the_timer_and_what_to_do():
    timers = Timers()
    with pytest.raises(RuntimeError, match="timer 'x' is not running; start"):
        timers("x").stop()
    timers("x").start()
    with pytest.raises(RuntimeError, match="timer 'x' is already running; stop"):
        timers("x").start()
    with pytest.raises(ValueError, match="a timer name must be a non-empty str"):
        timers("")
    with pytest.raises(TypeError, match="sync must be a bool"):
        Timers(sync="yes")  # type: ignore[arg-type]


def test_barrier_timing_without_a_process_group_still_times():
    timer = Timers(sync=True, device=None)("sync")
    timer.start(barrier=True)
    timer.stop(barrier=True)
    assert timer.count == 1


def test_the_loop_fills_its_named_timers(tmp_path):
    trainer = _train(tmp_path)
    timers = trainer.state.timers
    assert timers.names() == list(LOOP_TIMERS)
    counts = {name: timers(name).count for name in LOOP_TIMERS}
    # Two intervals a step for the optimizer: gradient preparation, then the update.
    assert counts == {
        "data-iterator": STEPS,
        "forward-backward": STEPS,
        "optimizer": 2 * STEPS,
        "eval": 2,
        "checkpoint-save": 2,
    }
    assert all(t > 0 for t in timers.elapsed().values())


def test_with_timers_off_the_loop_fills_none_but_callbacks_may_use_them():
    trainer = _train(timers="off")
    assert trainer.state.timers.names() == []
    trainer.state.timers("mine").start()
    assert trainer.state.timers.names() == ["mine"]


def test_log_timers_puts_milliseconds_per_step_in_each_log():
    logs: list[dict] = []
    _train(callbacks=[_Recorder(logs)], log_timers=True)
    assert len(logs) == 2
    for record in logs:
        assert record["timers/forward-backward"] > 0 and record["timers/optimizer"] > 0
        assert record["timers/data-iterator"] > 0
    assert "timers/eval" in logs[1]  # the evaluation at step 2 ran after that step's log


def test_log_timers_without_timers_is_refused():
    with pytest.raises(ValueError, match=r"train\.log_timers needs the timers"):
        Config(train=TrainConfig(timers="off", log_timers=True)).validate()
    with pytest.raises(ValueError, match=re.escape("train.timers expects 'off' | 'on' | 'sync'")):
        apply_overrides(Config(), ["train.timers=fast"])


class _Recorder(Callback):
    priority = 200

    def __init__(self, logs: list[dict]) -> None:
        self.logs = logs

    def on_log(self, ctx) -> None:
        self.logs.append(dict(ctx.logs))


def test_megatron_bridge_callbacks_read_the_loops_timers_from_context_state():
    """A callback in Megatron-Bridge's style reads ``context.state.timers`` and sees the
    loop's named timers with positive elapsed times."""
    seen: list[dict[str, float]] = []

    class TimerReport(BridgeCallback):
        def on_train_step_end(self, context):
            timers = context.state.timers
            seen.append(
                {
                    name: timers(name).elapsed(reset=False)
                    for name in ("forward-backward", "optimizer")
                }
            )

    config = small_gpt_pretrain_config(train_iters=2, eval_interval=None)
    pretrain(config, forward_step, callbacks=[TimerReport()])

    assert len(seen) == 2
    assert all(v > 0 for step in seen for v in step.values())
    assert seen[1]["forward-backward"] > seen[0]["forward-backward"]  # adds up over steps


def test_only_sync_mode_or_a_barrier_waits_for_the_device(monkeypatch):
    """``on`` never synchronises the device (no host-device sync in a step); ``sync``
    does at every start and stop, and ``barrier=True`` does in either mode."""
    waits: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    gpu = torch.device("cuda", 0)  # only its type is read: no GPU is needed

    on = Timers(device=gpu)("fb")
    on.start()
    on.stop()
    assert waits == []
    on.start(barrier=True)
    on.stop(barrier=True)
    assert waits == [gpu, gpu]

    synced = Timers(sync=True, device=gpu)("fb")
    synced.start()
    synced.stop()
    assert waits == [gpu] * 4
