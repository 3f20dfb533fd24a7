"""Pause and resume (hookloop.loop.pause): every rank holds at the same step and goes on
together, the weights end as if never paused, the watchdog takes no pause for a hang, and
the control server's ``pause`` / ``resume`` commands work over HTTP.

Run as a script (``python -m torch.distributed.run ... tests/test_pause.py MODE OUT``), this
file is the two-rank job the tests launch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
#: A pause held longer than the watchdog's deadline (seconds): a hang if it were one.
WATCHDOG_S, HOLD_S = 2, 6.0
#: Every wait below is bounded by this (seconds).
BOUND_S = 120.0


# -- the two-rank job ------------------------------------------------------------------
def job(mode: str, out: str, *overrides: str) -> None:
    from hookloop.config import apply_overrides
    from hookloop.distributed import init_from_env, leave_process_group, rank_info
    from hookloop.entry import build_trainer
    from hookloop.recipes import default_config
    from hookloop.watchdog import rank_beats

    init_from_env()
    rank = rank_info()[0]
    cfg = default_config("mlp-regression")
    apply_overrides(cfg, ["train.log_every=1", "data.batch_size=16", "train.max_steps=12",
                          "model.dropout=0.3", *overrides])  # fmt: skip
    trainer = build_trainer(cfg, out_dir=out)
    seen: dict = {"paused_at": None, "states": []}
    if mode != "plain":
        trainer.callbacks.register(  # asked on rank 1 alone: rank 0 pauses at the same step
            "on_train_step_end",
            lambda ctx: ctx.control.request("pause", client="test") if rank == 1 else None,
            once=4,
        )
        pauses = trainer.parts.live.pauses

        def watch() -> None:
            deadline = time.monotonic() + BOUND_S
            while not pauses.state.paused and time.monotonic() < deadline:
                time.sleep(0.02)
            seen["paused_at"] = pauses.state.step
            held = time.monotonic() + (HOLD_S if mode == "pause" else 0.5)
            while time.monotonic() < held:
                seen["states"] += [row["state"] for row in rank_beats() or []]
                time.sleep(0.2)
            if rank == 0:  # the control server's rank files the way out
                if mode == "pause":
                    trainer.control.request("resume", client="test")
                else:
                    trainer.control.request_stop("stopped while paused")

        threading.Thread(target=watch, daemon=True).start()
    result = trainer.train()
    record = {
        "step": result.step,
        "stop_reason": result.stop_reason,
        "params": [p.detach().flatten().tolist() for p in trainer.model.parameters()],
        "paused_at": seen["paused_at"],
        "states": sorted(set(seen["states"])),
        "checkpoints": sorted(p.name for p in (Path(out) / "checkpoints").glob("step-*")),
    }
    (Path(out) / f"result-rank{rank}.json").write_text(json.dumps(record))
    leave_process_group()
    sys.stdout.flush()
    import os

    os._exit(0)


def launch(mode: str, out: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE), mode, str(out), *overrides]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Rank hung" not in proc.stderr and "hangs" not in proc.stderr, proc.stderr[-3000:]
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def paused_and_plain(tmp_path_factory) -> tuple[list[dict], list[dict], Path]:
    root = tmp_path_factory.mktemp("pause")
    watchdog = f"train.watchdog_seconds={WATCHDOG_S}"
    plain = launch("plain", root / "plain", watchdog)
    paused = launch("pause", root / "paused", watchdog)
    return plain, paused, root / "paused"


def test_a_pause_holds_every_rank_at_the_same_step_and_ends_on_unpaused_weights(
    paused_and_plain,
):
    plain, paused, _ = paused_and_plain
    assert [r["paused_at"] for r in paused] == [4, 4]
    assert [r["step"] for r in paused] == [12, 12] == [r["step"] for r in plain]
    assert paused[0]["params"] == plain[0]["params"]  # bitwise: nothing moved while paused
    assert paused[1]["params"] == plain[1]["params"]


def test_the_watchdog_takes_a_pause_longer_than_its_deadline_for_no_hang(paused_and_plain):
    _, paused, _ = paused_and_plain
    for rank in paused:  # each rank saw both ranks' beats say paused, none hung
        assert "paused" in rank["states"] and "hung" not in rank["states"]


def test_pause_and_resume_are_recorded_in_changes_jsonl_and_not_replayed(paused_and_plain):
    from hookloop.loop.changes import read_replayable

    _, _, run = paused_and_plain
    records = read_replayable(run / "changes.jsonl")  # the chain holds
    assert [(r["event"], r["step"]) for r in records] == [("pause", 4), ("resume", 4)]


def test_a_stop_during_a_pause_ends_the_run_there_and_saves(tmp_path):
    stopped = launch("stop", tmp_path)
    assert [r["step"] for r in stopped] == [4, 4]
    assert all(r["stop_reason"] == "stopped while paused" for r in stopped)
    assert stopped[0]["checkpoints"] == ["step-00000004"]  # saved where it stopped


@pytest.mark.parametrize("with_it", ["stop", "resume"])
def test_a_pause_agreed_with_a_stop_or_a_resume_holds_nothing(with_it):
    from _control_support import train_in_background
    from hookloop.config import apply_overrides
    from hookloop.entry import build_trainer
    from hookloop.recipes import default_config

    cfg = default_config("mlp-regression")
    overrides = ["train.max_steps=8", "train.device=cpu", "train.handle_signals=false"]
    apply_overrides(cfg, [*overrides, "logging.progress=false"])
    trainer = build_trainer(cfg)

    def both(ctx) -> None:
        ctx.control.request("pause", client="test")
        ctx.control.request_stop("stopped") if with_it == "stop" else ctx.control.request("resume")

    trainer.callbacks.register("on_train_step_end", both, once=3)
    thread, outcome = train_in_background(trainer)
    thread.join(BOUND_S)  # bounded: a pause held here would never end
    assert not thread.is_alive() and "error" not in outcome
    assert outcome["result"].step == (3 if with_it == "stop" else 8)
    assert trainer.parts.live.pauses.state.paused is False


def test_ctl_status_shows_a_pause_and_the_scheduled_changes():
    from hookloop.control.cli import format_status

    shown = format_status(
        {"job_id": "j", "pid": 1, "phase": "training", "step": 4, "epoch": 0, "paused": True,
         "paused_since": time.time(), "paused_at_step": 4,
         "scheduled": [{"id": "0042", "step": 50, "values": {"lr": 0.0001}, "client": "me"}]}
    )  # fmt: skip
    lines = shown.splitlines()
    assert any(line.startswith("paused      true, since ") and line.endswith(" at step 4")
               for line in lines)  # fmt: skip
    assert "scheduled   step 50: lr=0.0001   (id 0042)" in lines


def test_a_pause_refused_before_training_leaves_none_asked():
    """A pause the server refuses after checking it (the job was not training) asks nothing:
    the next pause, once the job trains again, is filed, not refused as a second one."""
    from types import SimpleNamespace

    from hookloop.control.commands import CommandError
    from hookloop.control.job import LiveJob
    from hookloop.loop.pause import Pauses
    from hookloop.requests import Control
    from hookloop.state import Progress, TrainState

    control = Control()
    job = LiveJob("j", TrainState(Progress()), control, settings=SimpleNamespace(pauses=Pauses()))
    assert job.snapshot.phase == "starting"
    with pytest.raises(CommandError, match=r"the job is not training \(it is starting\)"):
        job.file("pause", {}, "me")
    assert not control.pending
    job.snapshot.phase = "training"
    assert job.file("pause", {}, "me") == 0 and control.pending
    with pytest.raises(CommandError, match="already paused"):
        job.file("pause", {}, "me")


# -- over HTTP, one rank ----------------------------------------------------------------
def test_pause_and_resume_over_http_hold_the_step_and_show_in_the_status(tmp_path):
    from _control_support import Job

    job = Job(tmp_path, tmp_path / "jobs", "pausing").ready()
    try:
        job.wait_step(3)
        assert job.command("pause")["command"] == "pause"
        paused = job.wait_for("a pause", lambda: (s := job.status())["paused"] and s)
        assert paused["paused_at_step"] == paused["step"] and paused["paused_since"] > 0
        code, body, _ = job.request(  # a second pause is refused, in one line
            "POST", job.api("control"), json.dumps({"command": "pause"}).encode()
        )
        assert code == 400 and body["error"] == "pause: the job is already paused (resume it first)"
        assert job.status()["step"] == paused["step"]  # still held (the loop polls 5 times a s)
        job.command("resume")
        job.wait_step(paused["step"] + 3)  # training goes on
        assert job.status()["paused"] is False
        code, body, _ = job.request(
            "POST", job.api("control"), json.dumps({"command": "resume"}).encode()
        )
        assert code == 400 and body["error"] == "resume: the job is not paused"
        events = [json.loads(line) for line in (job.out / "changes.jsonl").read_text().split("\n")
                  if line]  # fmt: skip
        assert [(e["event"], e["step"]) for e in events] == [
            ("pause", paused["step"]),
            ("resume", paused["step"]),
        ]
        job.command("graceful_stop")
        assert job.wait_exit() == 0
    finally:
        job.kill()


if __name__ == "__main__":
    job(*sys.argv[1:])


def test_transformers_dialect_pauses_at_a_step_and_ends_on_unpaused_weights(tmp_path):
    """A pause inside transformers' Trainer dialect: its flow passes the request kind on, the
    loop holds at the step, and the run ends as one never paused."""
    from hookloop.compat.hf import Trainer, TrainingArguments
    from hookloop.testing import TinyModel, ToyData

    def run(pause: bool) -> tuple[int | None, list[torch.Tensor]]:
        args = TrainingArguments(output_dir=str(tmp_path / str(pause)), max_steps=8,
                                 per_device_train_batch_size=4, logging_strategy="no",
                                 save_strategy="no", use_cpu=True, report_to="none")  # fmt: skip
        trainer = Trainer(TinyModel(), args, train_dataset=ToyData(n=64),
                          loss_fn=TinyModel.loss_fn)  # fmt: skip
        seen: dict = {"at": None}
        if pause:
            pauses = trainer.loop.parts.live.pauses
            trainer.loop.callbacks.register(
                "on_train_step_end", lambda ctx: ctx.control.request("pause", client="t"), once=3
            )

            def resume_when_held() -> None:
                deadline = time.monotonic() + BOUND_S
                while not pauses.state.paused and time.monotonic() < deadline:
                    time.sleep(0.02)
                seen["at"] = pauses.state.step
                trainer.loop.control.request("resume", client="t")

            threading.Thread(target=resume_when_held, daemon=True).start()
        trainer.train()
        assert trainer.state.global_step == 8
        return seen["at"], [p.detach().clone() for p in trainer.model.parameters()]

    (paused_at, paused), (_, plain) = run(True), run(False)
    assert paused_at == 3
    assert all(torch.equal(a, b) for a, b in zip(paused, plain, strict=True))
