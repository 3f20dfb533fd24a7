"""Scheduled changes (hookloop.loop.schedule_changes): a ``set`` for a later step lands at
exactly that step on every rank, even across a SIGKILL and ``--resume auto`` between filing
and applying; ``unset`` cancels one; refused inputs (a past step, an unknown or applied id,
``max_steps`` below the current step) change nothing; ``max_steps`` is settable live.

Run as a script under ``torch.distributed.run``, this file is the two-rank job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
#: Filed (on rank 0 alone, as the control server files) at the end of step 3, for step 9.
FILED_AT, AT_STEP, NEW_LR = 3, 9, 0.02


# -- the two-rank job ------------------------------------------------------------------
def job(mode: str, out: str) -> None:
    from hookloop.config import apply_overrides
    from hookloop.distributed import init_from_env, leave_process_group, rank_info
    from hookloop.entry import build_trainer
    from hookloop.recipes import default_config

    init_from_env()
    rank = rank_info()[0]
    cfg = default_config("mlp-regression")
    apply_overrides(cfg, ["train.log_every=1", "data.batch_size=16", "train.max_steps=12",
                          "model.dropout=0.3", "checkpoint.every=5"])  # fmt: skip
    trainer = build_trainer(cfg, out_dir=out, resume="auto" if mode == "resume" else None)
    applied: list = []
    trainer.callbacks.register(
        "on_settings_change",
        lambda ctx: applied.append([ctx.state.step, [[c.key, c.new] for c in ctx.changes]]),
    )
    if mode != "resume":
        entry = {"values": {"lr": NEW_LR}, "client": "test", "at_step": AT_STEP}
        trainer.callbacks.register(
            "on_train_step_end",
            lambda ctx: ctx.control.request("set", **{"7": entry}) if rank == 0 else None,
            once=FILED_AT,
        )
    if mode == "cancel":  # cancelled on rank 1 alone at step 5
        trainer.callbacks.register(
            "on_train_step_end",
            lambda ctx: ctx.control.request("unset", id="7") if rank == 1 else None,
            once=5,
        )
    if mode == "killed":  # killed at step 7, after the checkpoint of step 5, before step 9
        trainer.callbacks.register(
            "on_train_step_end", lambda ctx: os.kill(os.getpid(), signal.SIGKILL), once=7
        )
    result = trainer.train()
    record = {
        "step": result.step,
        "applied": applied,
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "params": [p.detach().flatten().tolist() for p in trainer.model.parameters()],
    }
    (Path(out) / f"result-{mode}-rank{rank}.json").write_text(json.dumps(record))
    leave_process_group()
    sys.stdout.flush()
    os._exit(0)


def launch(mode: str, out: Path, *, ok: bool = True) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE), mode, str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if not ok:
        assert proc.returncode != 0  # killed
        return []
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((out / f"result-{mode}-rank{r}.json").read_text()) for r in range(2)]


def records(run: Path) -> list[dict]:
    from hookloop.loop.changes import read_replayable

    return read_replayable(run / "changes.jsonl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return launch("scheduled", tmp_path_factory.mktemp("reference"))


def test_a_scheduled_change_applies_at_exactly_its_step_on_every_rank(reference):
    assert [r["applied"] for r in reference] == [[[AT_STEP, [["lr", NEW_LR]]]]] * 2
    assert reference[0]["params"] == reference[1]["params"]


def test_a_kill_between_filing_and_applying_then_resume_applies_it_at_its_step(reference, tmp_path):
    launch("killed", tmp_path, ok=False)
    filed = records(tmp_path)  # recorded when filed, at its step
    assert [(r["id"], r["step"], r["filed_at"], r["values"]) for r in filed] == [
        ("7", AT_STEP, FILED_AT, {"lr": NEW_LR})
    ]
    resumed = launch("resume", tmp_path)
    assert [r["applied"] for r in resumed] == [[[AT_STEP, [["lr", NEW_LR]]]]] * 2
    assert [r["step"] for r in resumed] == [12, 12]
    for ref, res in zip(reference, resumed, strict=True):
        assert res["params"] == ref["params"]  # bitwise, as if never killed


def test_an_unset_filed_on_one_rank_cancels_it_on_every_rank(tmp_path):
    cancelled = launch("cancel", tmp_path)
    assert [r["applied"] for r in cancelled] == [[], []]
    assert all(r["lr"] != NEW_LR for r in cancelled)
    assert [r.get("cancels") for r in records(tmp_path)] == [None, "7"]


# -- refused over HTTP (one rank): one line, 400, nothing changed -----------------------
def test_refused_schedules_unsets_and_max_steps_change_nothing(tmp_path):
    from _control_support import Job
    from hookloop.control.cli import main_ctl

    job = Job(tmp_path, tmp_path / "jobs", "scheduling").ready()

    def post(command: str, values: dict) -> tuple[int, dict]:
        body = json.dumps({"command": command, "values": values}).encode()
        code, answer, _ = job.request("POST", job.api("control"), body)
        return code, answer

    try:
        step = job.wait_step(3)
        before = job.status()["settings"]
        code, body = post("set", {"lr": 0.5, "at_step": 1})
        assert code == 400 and body["error"].startswith("set: at_step=1 is not after the current")
        code, body = post("set", {"max_steps": 1})
        assert code == 400 and "max_steps must be a whole number of steps at least" in body["error"]
        code, body = post("unset", {"id": "nope"})
        assert (
            code == 400
            and body["error"] == "unset: no scheduled change 'nope'; scheduled now: none"
        )
        later = step + 1_000_000
        scheduled = job.command("set", {"lr": 0.05, "at_step": later})
        assert (
            scheduled["message"] == f"set {scheduled['id']} scheduled for the end of step {later}"
        )
        shown = job.status()["scheduled"]
        assert shown == [{"id": scheduled["id"], "step": later, "values": {"lr": 0.05},
                          "client": shown[0]["client"]}]  # fmt: skip
        applied = job.command("set", {"log_every": 7})
        code, body = post("unset", {"id": applied["id"]})
        assert code == 400 and body["error"].startswith(
            f"unset: change {applied['id']} was already"
        )
        cli = ["--jobs-dir", str(tmp_path / "jobs")]
        assert main_ctl(["scheduling", "unset", "nope", *cli]) == 2  # the CLI: exit code 2
        assert main_ctl(["scheduling", "unset", scheduled["id"], *cli]) == 0
        job.wait_for("the unset", lambda: job.status()["scheduled"] == [])
        status = job.status()
        assert {**before, "log_every": 7} == status["settings"]  # lr, max_steps as they were
        assert main_ctl(["set", "scheduling", "max_steps=5000000", "--at-step", "2", *cli]) == 2
        assert main_ctl(["set", "scheduling", f"max_steps={status['step'] + 40}", *cli]) == 0
        assert job.wait_exit() == 0  # the new budget ends the run
        assert "max_steps" in job.stderr()
    finally:
        job.kill()


if __name__ == "__main__":
    job(*sys.argv[1:])
