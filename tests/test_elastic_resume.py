"""Resume on another number of ranks: the same samples, in the same order, the same numbers.

A run on 4 gloo ranks (4 samples each) stopped at step 4, resumed on 2 ranks (8 samples
each: the same global batch of 16) to step 8, then on 4 ranks again to the end, against
an uninterrupted 4-rank run. The ledger (``data.ledger=true``) says which samples each
step took; fp32 and no dropout, so the numbers differ only by summation order.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _dist_launch import JOB, run_job, torchrun
from hookloop.ledger import LEDGER_DIR, verify_ledger

pytestmark = pytest.mark.slow

BASE = ["data.train_samples=128", "data.eval_samples=16", "train.max_steps=12",
        "train.eval_every=100", "checkpoint.every=100", "model.dropout=0.0",
        "data.ledger=true"]  # fmt: skip
FOUR = ["data.batch_size=4"]
TWO = ["data.batch_size=8"]


def steps_taken(run: Path) -> dict[int, tuple[int, list[int]]]:
    """Step -> (epoch, the global positions its ranks took, sorted), from the ledger."""
    out: dict[int, tuple[int, list[int]]] = {}
    for path in sorted((run / LEDGER_DIR).glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "first" not in record:
                continue
            positions = [record["first"] + record["world"] * i for i in range(record["count"])]
            epoch, taken = out.setdefault(record["step"], (record["epoch"], []))
            assert epoch == record["epoch"]
            taken.extend(positions)
    return {step: (epoch, sorted(taken)) for step, (epoch, taken) in out.items()}


@pytest.fixture(scope="module")
def legs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("elastic")
    reference = run_job("train", root / "ref", *BASE, *FOUR, ranks=4)
    run_job("train", root / "run", *BASE, *FOUR, "train.exit_interval=4", ranks=4)
    run_job("resume", root / "run", *BASE, *TWO, "train.exit_interval=8", ranks=2)
    resumed = run_job("resume", root / "run", *BASE, *FOUR, ranks=4)
    return {"root": root, "reference": reference, "resumed": resumed}


def test_four_then_two_then_four_ranks_take_the_uninterrupted_runs_samples(legs):
    root = legs["root"]
    assert verify_ledger(root / "run").summary() == (
        "ledger ok: 12 steps, 192 samples, 0 lost, 0 repeated"
    )
    assert steps_taken(root / "run") == steps_taken(root / "ref")
    assert verify_ledger(root / "ref").ok


def test_the_resized_run_ends_on_the_uninterrupted_runs_numbers(legs):
    ref, res = legs["reference"][0], legs["resumed"][0]
    assert [r["step"] for r in legs["resumed"]] == [12] * 4
    for a, b in zip(ref["params"], res["params"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-4)
    later = {s: v for s, v in ref["losses"].items() if int(s) > 8}
    assert later.keys() == res["losses"].keys()
    for step, loss in later.items():
        assert res["losses"][step] == pytest.approx(loss, rel=1e-4, abs=1e-6)


def test_a_resume_that_changes_the_global_batch_is_refused_in_one_line(legs, tmp_path):
    run = tmp_path / "run"
    run_job("train", run, *BASE, *FOUR, "train.exit_interval=4", ranks=2)  # global batch 8
    proc = subprocess.run([*torchrun(4), JOB, "resume", str(run), *BASE, *FOUR],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode != 0
    assert (
        "resuming on 4 ranks a run saved on 2: the global batch was 8 (2 ranks x 4 per rank "
        "x 1 micro-batches), now 16; keep it with data.batch_size=2 with train.grad_accum=1"
    ) in proc.stderr


def test_fsdp_shards_saved_on_four_ranks_load_on_two(legs, tmp_path):
    # torch.distributed.checkpoint reshards on load: no offline step. fp32, so FSDP's
    # numbers equal DDP's uninterrupted run's up to summation order.
    fsdp = [*BASE, "train.parallel=fsdp"]
    run_job("train", tmp_path / "run", *fsdp, *FOUR, "train.exit_interval=4", ranks=4)
    resumed = run_job("resume", tmp_path / "run", *fsdp, *TWO, ranks=2)
    assert [r["step"] for r in resumed] == [12, 12]
    for a, b in zip(legs["reference"][0]["params"], resumed[0]["params"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-4)
    assert verify_ledger(tmp_path / "run").ok
    assert steps_taken(tmp_path / "run") == steps_taken(legs["root"] / "ref")
