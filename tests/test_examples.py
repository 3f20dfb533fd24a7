"""Each script in examples/ runs as a user would run it, and does what its docstring says.

Every example takes its output directory as its one argument; it must write nothing
anywhere else (the working directory here stays empty).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

import _zygote as zygote

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, tmp_path: Path) -> tuple[str, Path]:
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    done = zygote.run(  # a python that has imported torch already: each example in ~1 s
        [sys.executable, str(EXAMPLES / name), str(out)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(cwd.iterdir()), "the example wrote outside its output directory"
    return done.stdout, out


def test_every_example_is_tested_and_short():
    tested = {
        "native.py",
        "transformers_trainer.py",
        "megatron_bridge.py",
        "forgather.py",
        "hpo_trainer.py",
        "ema_and_lr_find.py",
    }
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested
    for path in EXAMPLES.glob("*.py"):
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 80, path.name


def test_native(tmp_path):
    stdout, out = run_example("native.py", tmp_path)
    assert re.search(r"^step 10: loss \d", stdout, re.M)
    assert re.search(r"^stopped at step \d+: eval_loss .* < 0\.05 \(exit code 0\)$", stdout, re.M)
    assert (out / "checkpoints" / "latest").exists()


def test_ema_and_lr_find(tmp_path):
    stdout, out = run_example("ema_and_lr_find.py", tmp_path)
    found = re.search(r"^lr-find: suggested (\S+) after \d+ steps \(diverged\)$", stdout, re.M)
    assert found and 1e-3 < float(found.group(1)) < 1.0, stdout
    trained = re.search(
        r"^trained 60 steps: eval_loss with the EMA weights (\S+) \(60 ", stdout, re.M
    )
    assert trained and float(trained.group(1)) < 0.1, stdout  # it learned at that rate
    assert (out / "lr_find.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "checkpoints" / "latest").exists()
    from mlflow.tracking import MlflowClient  # what the run logged, read back

    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(run.info.run_id, "eval/loss")
    assert [m.step for m in history] == [20, 32, 40, 60]  # every 20 steps, and the epoch's end
    assert history[-1].value == pytest.approx(float(trained.group(1)), abs=5e-5)  # printed .4f


def test_transformers_trainer(tmp_path):
    stdout, out = run_example("transformers_trainer.py", tmp_path)
    assert "step 10: eval_loss" in stdout
    assert "'train_runtime'" in stdout  # PrinterCallback's summary line
    step = int(re.search(r"^global_step (\d+),", stdout, re.M).group(1))
    assert 10 < step < 60  # StopBelow ended it before max_steps
    assert (out / "checkpoint-20" / "trainer_state.json").exists()


def test_megatron_bridge(tmp_path):
    stdout, out = run_example("megatron_bridge.py", tmp_path)
    lines = stdout.splitlines()
    assert lines[0] == "training starts at step 0"
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == [
        f"step {i}" for i in range(6)
    ]
    assert stdout.count("validation: lm loss") == 3  # at steps 3 and 6, then after the end
    assert "Starting job" in (out / "progress.txt").read_text()
    assert (out / "checkpoints" / "step-00000006").is_dir()


def test_forgather(tmp_path):
    stdout, out = run_example("forgather.py", tmp_path)
    assert re.search(r"^ +30/30 ", stdout, re.M)  # Forgather's progress table
    assert "eval @ step 15" in stdout
    records = json.loads((out / "logs" / "trainer_logs.json").read_text())
    logs = [r for r in records if "loss" in r]
    assert len(logs) == 6 and all(r["loss_x10"] == pytest.approx(10 * r["loss"]) for r in logs)


def test_hpo_trainer(tmp_path):
    stdout, out = run_example("hpo_trainer.py", tmp_path)
    assert re.search(r"^epoch 0: train_loss \S+ val_loss \S+ best \S+$", stdout, re.M)
    assert re.search(r"^ended after epoch \d+ \(step \d+\): EarlyStopping", stdout, re.M)
    assert (out / "checkpoints" / "latest").exists()


@pytest.mark.parametrize(
    ("page", "example"),
    [
        ("README.md", "examples/"),
        ("docs/training.md", "../examples/native.py"),
        ("docs/megatron-bridge.md", "../examples/megatron_bridge.py"),
        ("docs/transformers-trainer.md", "../examples/transformers_trainer.py"),
        ("docs/forgather.md", "../examples/forgather.py"),
        ("docs/callbacks.md", "../examples/hpo_trainer.py"),
        ("docs/hpo-trainer.md", "../examples/hpo_trainer.py"),
    ],
)
def test_the_docs_link_the_examples(page, example):
    text = (EXAMPLES.parent / page).read_text(encoding="utf-8")
    assert f"]({example})" in text
