"""The cost report per callback: who slows the loop, by how much, at which event."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import time

import pytest
import torch
from torch import nn

from _quiet import SERVICES_OFF
from hookloop import Callback, CallbackManager, TrainConfig, Trainer
from hookloop.app.cli import main
from hookloop.profile import current_profile

SLOW_S = 0.003


class SlowStep(Callback):
    """Deliberately slow: sleeps at every step end."""

    def on_train_step_end(self, ctx):
        time.sleep(SLOW_S)


class CheapLog(Callback):
    def __init__(self):
        self.logs = 0

    def on_log(self, ctx):
        self.logs += 1


def _trainer(callbacks, steps=10):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(steps)]
    config = TrainConfig(max_steps=steps, log_every=2, handle_signals=False, device="cpu")
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=data,
        loss_fn=nn.MSELoss(),
        config=config,
        callbacks=callbacks,
    )


def test_the_report_puts_a_deliberately_slow_callback_first_with_its_event_and_cost():
    trainer = _trainer([CheapLog(), SlowStep()])
    profile = trainer.callbacks.profile()
    trainer.train()
    trainer.callbacks.profile(False)
    rows = profile.rows()
    slow = rows[0]
    assert (slow["callback"], slow["event"], slow["calls"]) == ("SlowStep", "on_train_step_end", 10)
    assert slow["us_per_call"] >= SLOW_S * 1e6
    assert slow["total_ms"] >= 10 * SLOW_S * 1e3
    assert 0.2 < slow["share"] <= 1.0  # 10 sleeps are most of 10 tiny steps
    cheap = next(r for r in rows if r["callback"] == "CheapLog")
    assert (cheap["event"], cheap["calls"]) == ("on_log", 5)
    assert cheap["us_per_call"] < slow["us_per_call"] / 10
    table = profile.table().splitlines()
    assert table[1].split() == ["callback", "event", "calls", "total", "ms", "us/call", "share"]
    assert table[3].split()[:3] == ["SlowStep", "on_train_step_end", "10"]


def test_profiling_off_leaves_the_bare_handlers_in_the_dispatch_index():
    cb = SlowStep()
    manager = CallbackManager([cb])
    bare = tuple(manager.index["on_train_step_end"])
    assert bare == (cb.on_train_step_end,)  # nothing wrapped: dispatch costs what it did
    running = manager.profile()
    assert tuple(manager.index["on_train_step_end"]) != bare
    assert manager.active_profile is running is current_profile()  # what the server serves
    stopped = manager.profile(False)
    assert tuple(manager.index["on_train_step_end"]) == bare
    assert manager.active_profile is None and stopped is running
    assert current_profile() is None
    assert manager.profile(False) is None  # stopping twice is harmless
    with pytest.raises(ValueError, match=r"profile\(\) takes True .* or False"):
        manager.profile("yes")


def test_a_failing_handler_is_still_named_while_profiling():
    class Broken(Callback):
        def on_train_step_end(self, ctx):
            raise RuntimeError("boom")

    trainer = _trainer([Broken()], steps=2)
    trainer.callbacks.profile()
    with pytest.raises(RuntimeError, match="boom") as info:
        trainer.train()
    assert any("'Broken'" in note for note in info.value.__notes__)
    assert trainer.callbacks.active_profile.cost("Broken", "on_train_step_end").calls == 1


def test_hookloop_train_prints_the_table_when_callbacks_profile_is_true(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = [
        "train",
        "--recipe",
        "mlp-regression",
        "--out",
        str(tmp_path / "run"),
        "train.max_steps=6",
        "train.log_every=2",
        "train.eval_every=null",
        "callbacks.profile=true",
        "logging.progress=false",
        *SERVICES_OFF,
    ]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0
    text = err.getvalue()
    assert "callback cost over" in text
    rows = {tuple(line.split()[:2]): line.split() for line in text.splitlines()}
    assert rows["JsonLogger", "on_log"][2] == "3"  # calls: one per log event (steps 2, 4, 6)
    assert rows["JsonLogger", "on_train_start"][2] == "1"


def test_the_control_status_serves_the_cost_report(tmp_path):
    from hookloop.control import ControlServer

    seen: dict = {}

    class AskStatus(Callback):
        """At step 6, read the status over HTTP as a dashboard would."""

        def on_train_step_end(self, ctx):
            if ctx.state.step != 6:
                return
            host, port = server.url.split("//")[1].split(":")
            conn = http.client.HTTPConnection(host, int(port.rstrip("/")), timeout=10)
            conn.request(
                "GET",
                f"/jobs/{server.job_id}/status",
                headers={"Authorization": f"Bearer {server.token}"},
            )
            seen.update(json.loads(conn.getresponse().read()))
            conn.close()

    server = ControlServer(port=0, jobs_dir=tmp_path / "jobs", announce=False)
    trainer = _trainer([SlowStep(), AskStatus(), server], steps=8)
    trainer.callbacks.profile()
    trainer.train()
    rows = {(r["callback"], r["event"]): r for r in seen["callback_profile"]}
    slow = rows["SlowStep", "on_train_step_end"]
    assert slow["calls"] >= 5 and slow["us_per_call"] >= SLOW_S * 1e6
    assert ("ControlServer", "on_train_start") in rows  # starting the server is a cost too
