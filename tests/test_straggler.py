"""StragglerDetection: a rank made slower on purpose is named, with its host, in the logs
and in the control server's status."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from _dist_launch import torchrun
from hookloop.callbacks import StragglerDetection, default_callbacks
from hookloop.config import Config, apply_overrides
from hookloop.entry import build_trainer
from hookloop.recipes import default_config

JOB = str(Path(__file__).with_name("_straggler_job.py"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, "every must be an int >= 1"),
        ({"every": 2.5}, "every must be an int >= 1"),
        ({"threshold": 1.0}, "threshold must be > 1"),
        ({"threshold": "2"}, "threshold must be a number > 1"),
    ],
)
def test_bad_parameters_are_refused_with_the_allowed_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StragglerDetection(**kwargs)


def test_config_switch_is_off_by_default_and_validated():
    cfg = Config()
    assert not any(isinstance(cb, StragglerDetection) for cb in default_callbacks(cfg, None))
    apply_overrides(cfg, ["callbacks.straggler_every=50", "callbacks.straggler_threshold=2"])
    [detector] = [cb for cb in default_callbacks(cfg.validate(), None)
                  if isinstance(cb, StragglerDetection)]  # fmt: skip
    assert (detector.every, detector.threshold) == (50, 2.0)
    apply_overrides(cfg, ["callbacks.straggler_threshold=0.5"])
    with pytest.raises(ValueError, match=r"callbacks\.straggler_threshold must be a number > 1"):
        cfg.validate()


def test_one_process_reports_itself_and_leaves_no_hook_on_the_model():
    cfg = default_config("mlp-regression")
    apply_overrides(cfg, ["train.max_steps=6", "train.log_every=0", "train.eval_every=null"])
    trainer = build_trainer(cfg)
    detector = StragglerDetection(every=3)
    trainer.callbacks.add(detector)
    trainer.train()
    report = trainer.ctx.user_state["stragglers"]
    assert report is detector.report and report["step"] == 6
    [me] = report["ranks"]
    assert me["rank"] == 0 and me["host"] == socket.gethostname()
    assert me["step_s"] == pytest.approx(me["data_wait_s"] + me["compute_s"], abs=1e-5)
    assert report["stragglers"] == []
    assert not trainer.model._forward_hooks  # the timing hook is removed at the end


@pytest.mark.slow
def test_a_rank_slowed_on_purpose_is_named_with_its_host_in_logs_and_status(tmp_path):
    proc = subprocess.run([*torchrun(2), JOB, str(tmp_path)],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    host = socket.gethostname()
    zero, one = (json.loads((tmp_path / f"straggler-rank{r}.json").read_text()) for r in (0, 1))
    for record in (zero, one):  # every rank holds the same report
        assert [(s["rank"], s["host"]) for s in record["report"]["stragglers"]] == [(1, host)]
        assert record["report"]["stragglers"][0]["ratio"] > 1.4
    assert [s["stragglers"]["step"] for s in zero["statuses"]] == [4, 8]
    for status in zero["statuses"]:
        assert [(s["rank"], s["host"]) for s in status["stragglers"]["stragglers"]] == [(1, host)]
    assert f"rank 1 on host {host}" in proc.stderr
    assert "rank 0 on host" not in proc.stderr
