"""Multi-process runs on gloo: DDP equivalence, agreed decisions, exact resume."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from _dist_launch import JOB, run_job, torchrun

BASE = ["data.train_samples=512", "data.eval_samples=64", "train.max_steps=24",
        "train.eval_every=8", "checkpoint.every=4"]  # fmt: skip

pytestmark = pytest.mark.slow


def launch(mode: str, out: Path, *overrides: str, ranks: int = 2) -> list[dict]:
    return run_job(mode, out, *BASE, *overrides, ranks=ranks)


def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path):
    # 2 ranks x 16 samples == 1 process x 32 samples: the same samples each step (the
    # sampler deals rank r every other index of the same shuffled order). The results
    # differ only by float summation order (DDP averages two per-rank means), which over
    # 24 SGD-momentum steps stays far below 1e-5.
    single = launch("plain", tmp_path / "one", "data.batch_size=32", ranks=1)[0]
    ranks = launch("plain", tmp_path / "two", "data.batch_size=16")
    for r in ranks:
        for a, b in zip(single["params"], r["params"], strict=True):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-4)
    assert ranks[0]["params"] == ranks[1]["params"]  # DDP keeps ranks bitwise identical
    for step, loss in single["losses"].items():
        assert ranks[0]["losses"][step] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # logged losses are reduced over ranks


@pytest.fixture(scope="module")
def asked_on_rank_1(tmp_path_factory) -> list[dict]:
    """One two-rank run in which rank 1 alone asks: a valued request at step 4, a stop at 7."""
    return launch("stop-on-rank-1", tmp_path_factory.mktemp("asked"), "data.batch_size=16")


def test_a_stop_asked_on_one_rank_stops_every_rank_at_the_same_step(asked_on_rank_1):
    results = asked_on_rank_1
    assert [r["step"] for r in results] == [7, 7]
    assert all(r["stop_reason"] == "asked on rank 1" for r in results)


def test_a_request_with_a_value_filed_on_one_rank_acts_on_every_rank_at_the_same_step(
    asked_on_rank_1,
):
    results = asked_on_rank_1
    assert [r["applied"] for r in results] == [[[4, 0.25]], [[4, 0.25]]]
    assert results[0]["lr"] == results[1]["lr"]
    assert results[0]["params"] == results[1]["params"]  # the ranks stayed in step


def test_a_live_set_filed_on_rank_0_lands_at_the_same_step_on_every_rank(asked_on_rank_1):
    results = asked_on_rank_1
    seen = [r["settings"] for r in results]
    assert seen[0] == seen[1] and len(seen[0]) == 1
    step, changes, _lr, clip = seen[0][0]
    assert step == 5 and changes == [["lr", 0.02], ["clip_grad_norm", 0.3]] and clip == 0.3


def test_a_request_kind_registered_on_one_rank_is_the_same_error_on_every_rank(tmp_path):
    results = launch("kind-on-rank-1", tmp_path, "data.batch_size=16")
    errors = [r.get("error") for r in results]
    assert (
        errors[0]
        == errors[1]
        == (
            "KindsDiffer: request kinds differ across ranks: 'only_on_rank_1' on rank 1 only; "
            "every rank must register the same kinds (import the module that registers them "
            "on every rank, before training)"
        )
    )


def test_an_update_skipped_on_one_rank_is_the_same_error_on_every_rank(tmp_path):
    # skip_step() is not agreed before the update (that would be a second collective on
    # every step); the step's one agreement finds the ranks out of step and says so.
    results = launch("skip-on-rank-1", tmp_path, "data.batch_size=16")
    errors = [r.get("error") for r in results]
    assert (
        errors[0]
        == errors[1]
        == (
            "SkipsDiffer: the ranks skipped different optimizer updates (skipped so far: "
            "rank 0: 0, rank 1: 1); with several ranks, call skip_step() on every rank alike, "
            "deciding from values every rank shares (the grad norm, an all-reduced loss)"
        )
    )


def test_a_nan_on_one_rank_skips_the_step_on_both(tmp_path):
    results = launch("nan-on-rank-1", tmp_path, "data.batch_size=16")
    assert [r["skipped"] for r in results] == [1, 1]
    assert results[0]["params"] == results[1]["params"]
    assert all(all(map(lambda v: v == v, p)) for p in results[0]["params"])  # no NaN weights
    assert 3 not in {int(s) for s in results[0]["losses"]}  # the skipped step is not logged


def test_kill_and_resume_of_a_two_rank_run_is_exact(tmp_path):
    args = ["data.batch_size=16", "model.dropout=0.3"]
    reference = launch("plain", tmp_path / "ref", *args)
    launch("train", tmp_path / "run", *args, "train.exit_interval=10")
    resumed = launch("resume", tmp_path / "run", *args)
    assert [r["step"] for r in resumed] == [24, 24]
    for ref, res in zip(reference, resumed, strict=True):
        assert ref["params"] == res["params"]
        later = {s: v for s, v in ref["losses"].items() if int(s) > 10}
        assert res["losses"] == later


def test_diloco_with_two_workers_lowers_the_loss_and_keeps_workers_identical_after_syncs(
    tmp_path,
):
    args = ["data.batch_size=16", "train.parallel=local", "train.eval_every=1000"]
    results = launch("diloco", tmp_path, *args)
    assert [r["outer_steps"] for r in results] == [6, 6]  # 24 steps / sync_every 4
    assert results[0]["synced"] == results[1]["synced"]  # identical after every outer step
    assert results[0]["params"] == results[1]["params"]
    ordered = [v for _, v in sorted(results[0]["losses"].items(), key=lambda kv: int(kv[0]))]
    # Per-step losses on 16 samples are noisy: compare the mean of the first two with the
    # mean of the last eight (steps 17-24, after four outer steps).
    assert sum(ordered[-8:]) / 8 < 0.5 * sum(ordered[:2]) / 2


def test_diloco_refuses_per_step_gradient_sync(tmp_path):
    cmd = [*torchrun(2), JOB, "diloco", str(tmp_path), *BASE, "data.batch_size=16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "train.parallel='local'" in proc.stderr


def test_an_auto_batch_size_that_fails_on_one_rank_fails_on_both(tmp_path):
    # Rank 1 runs out of memory above 16 rows; 64 and 32 fail there, so both ranks
    # train with 16 and stay in step.
    results = launch("auto-batch", tmp_path, "data.batch_size=auto", "data.auto_batch_start=64")
    assert [r["batch_size"] for r in results] == [16, 16]
    assert [r["step"] for r in results] == [24, 24]
    assert results[0]["params"] == results[1]["params"]
