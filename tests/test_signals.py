"""SIGTERM / SIGINT on a real ``hookloop train`` process: finish the step, save, exit 128+N."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _zygote as zygote
from _quiet import SERVICES_OFF
from hookloop.callbacks import read_jsonl

pytestmark = pytest.mark.slow

WAIT_S = 60


def _wait_for_train_records(proc: subprocess.Popen, metrics: Path, count: int) -> int:
    """Poll until ``count`` train records are logged; returns the newest record's step."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"training exited early with code {proc.returncode}")
        records = read_jsonl(metrics) if metrics.is_file() else []
        steps = [r["step"] for r in records if r.get("kind") == "train"]
        if len(steps) >= count:
            return steps[-1]
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    pytest.fail(f"no {count} train records in {metrics} within {WAIT_S} s")


@pytest.mark.parametrize(
    ("signum", "exit_code"),
    [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
    ids=["SIGTERM", "SIGINT"],
)
def test_signal_stops_training_gracefully_with_128_plus_signal(tmp_path, signum, exit_code):
    run_dir = tmp_path / "run"
    stderr_path = tmp_path / "stderr.txt"
    command = [
        sys.executable,
        "-m",
        "hookloop",
        "train",
        "--recipe",
        "mlp-regression",
        "--out",
        str(run_dir),
        "train.max_steps=100000",
        "train.log_every=5",
        "logging.progress=false",
        *SERVICES_OFF,
    ]
    with stderr_path.open("w") as stderr:
        proc = zygote.Popen(command, stdout=stderr, stderr=stderr)  # the result line too
        try:
            observed = _wait_for_train_records(proc, run_dir / "metrics.jsonl", count=3)
            proc.send_signal(signum)
            returncode = proc.wait(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    err = stderr_path.read_text()
    assert returncode == exit_code, err
    assert f"signal {signal.Signals(signum).name} at step" in err
    assert (run_dir / "checkpoints" / "latest").is_file()  # stopped, not killed: it saved
    # It landed where it was sent: after the observed step, long before max_steps, and the
    # run saved at the very step it stopped on.
    stopped = int(re.search(rf"signal {signal.Signals(signum).name} at step (\d+)", err)[1])
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert json.loads((latest / "manifest.json").read_text())["step"] == stopped
    assert observed >= 15 and observed <= stopped < 100_000, (observed, stopped)
