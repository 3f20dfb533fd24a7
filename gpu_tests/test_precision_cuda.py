"""Mixed precision on CUDA through ``hookloop train``: the default recipe learns in bf16
and in fp16 (GradScaler), and a bf16 checkpoint resumes to the same bits as a run that
was never interrupted (tests/test_checkpoint.py's exact-resume test, on the GPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _cuda import hookloop_train
from safetensors.torch import load_file

from hookloop.testing import assert_same_checkpoint

assert torch.cuda.is_available(), "gpu_tests/ needs a CUDA device"


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def final_checkpoint(run: Path) -> Path:
    root = run / "checkpoints"
    return root / (root / "latest").read_text().strip()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_default_recipe_learns_on_cuda(tmp_path, precision):
    run = tmp_path / "run"
    proc = hookloop_train(
        run, "train.device=cuda", f"train.precision={precision}", "train.max_steps=150"
    )
    assert "max_steps at step 150" in proc.stderr, proc.stderr[-2000:]
    train = records(run, "train")
    assert [r["step"] for r in train] == list(range(10, 151, 10))
    first, last = train[0]["loss"], train[-1]["loss"]
    assert math.log(256) - 1.0 < first < math.log(256) + 0.5  # near uniform over bytes
    assert last < 0.6 * first, [r["loss"] for r in train]
    evals = [r["eval_loss"] for r in records(run, "eval") if "eval_loss" in r]
    assert evals and evals[-1] < 0.6 * first
    assert train[-1]["skipped_steps"] <= (10 if precision == "fp16" else 0)
    weights = load_file(str(final_checkpoint(run) / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}  # autocast: fp32 weights


# A small run with dropout (the CUDA RNG must be restored), two evaluations and three
# checkpoints; stopped at step 6 (mid-way between checkpoints 4 and 8, so the stop saves).
RESUME_ARGS = (
    "train.device=cuda", "train.precision=bf16", "train.max_steps=12", "train.log_every=1",
    "train.eval_every=5", "train.eval_max_batches=2", "checkpoint.every=4",
    "checkpoint.keep_last=null", "model.n_layer=2", "model.dropout=0.1", "seed=7",
    "callbacks.textgen=false",
)  # fmt: skip


def losses(run: Path) -> dict[int, float]:
    train = [(r["step"], r["loss"]) for r in records(run, "train")]
    assert len(train) == len({s for s, _ in train}), f"a step was logged twice: {train}"
    return dict(train)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    hookloop_train(run, *RESUME_ARGS)
    return run


def test_two_bf16_cuda_runs_are_bitwise_identical(uninterrupted, tmp_path):
    """The premise of the resume test: the GPU computes the same bits twice."""
    again = tmp_path / "again"
    hookloop_train(again, *RESUME_ARGS)
    assert_same_checkpoint(final_checkpoint(uninterrupted), final_checkpoint(again))
    assert losses(again) == losses(uninterrupted)


def test_a_bf16_cuda_checkpoint_resumes_bitwise_identically(uninterrupted, tmp_path):
    run = tmp_path / "run"
    first = hookloop_train(run, *RESUME_ARGS, "train.exit_interval=6")
    assert "exit_interval at step 6" in first.stderr, first.stderr[-2000:]
    hookloop_train(run, "--resume", "auto", "train.exit_interval=null")
    assert_same_checkpoint(final_checkpoint(uninterrupted), final_checkpoint(run))
    assert losses(run) == losses(uninterrupted)
    assert sorted(losses(run)) == list(range(1, 13))
