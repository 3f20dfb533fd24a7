"""A thousand steps of random requests on random ranks: every rank acts alike, every time.

One run on three gloo ranks (tests/_agreement_fuzz_job.py): at each moment of each step
every rank may file a request of a random kind, a thread on every rank files one at
moments of its own, and the last rank asks to stop at the end. The loop agrees them
in its one collective per step.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from _dist_launch import torchrun

pytestmark = pytest.mark.slow

STEPS = 1000
RANKS = 3
JOB = str(Path(__file__).with_name("_agreement_fuzz_job.py"))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fuzz")
    proc = subprocess.run([*torchrun(RANKS), JOB, str(out), str(STEPS)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-8000:]
    return [json.loads((out / f"fuzz-rank{r}.json").read_text()) for r in range(RANKS)]


def test_every_rank_acts_on_the_same_requests_at_the_same_steps(fuzzed):
    first = fuzzed[0]["acted"]
    for other in fuzzed[1:]:
        assert other["acted"] == first
    assert all(r["step"] == STEPS and r["stop_reason"] == f"stop from rank {RANKS - 1}"
               for r in fuzzed)  # fmt: skip


def test_the_fuzz_filed_every_kind_on_every_rank_at_every_moment(fuzzed):
    for record in fuzzed:
        filed = record["filed"]
        assert len(filed) > 100
        kinds = {kind for _, _, kind, _ in filed}
        moments = {moment for _, moment, _, _ in filed}
        assert {"log", "evaluate", "save", "fuzz_valued", "fuzz_plain"} <= kinds
        assert len(moments) == 6
    assert any(kind == "fuzz_thread" for _, kind, _ in fuzzed[0]["acted"])


def test_a_request_filed_during_a_step_is_acted_on_at_that_step(fuzzed):
    acted = {(step, kind) for step, kind, _ in fuzzed[0]["acted"]}
    for record in fuzzed:
        for step, _moment, kind, _ in record["filed"]:
            if kind in ("log", "evaluate", "fuzz_valued", "fuzz_plain"):
                assert (step, kind) in acted, (record["rank"], step, kind)


def test_a_valued_request_carries_the_lowest_asking_ranks_values(fuzzed):
    asked: dict[int, list[dict]] = {}
    for record in fuzzed:  # in rank order
        for step, _moment, kind, values in record["filed"]:
            if kind == "fuzz_valued":
                asked.setdefault(step, []).append(values)
    got = {step: values for step, kind, values in fuzzed[0]["acted"] if kind == "fuzz_valued"}
    assert got.keys() == asked.keys()
    for step, values in got.items():
        assert values == asked[step][0]  # the first filing of the lowest asking rank


def test_no_step_was_skipped(fuzzed):
    assert [r["skipped"] for r in fuzzed] == [0] * RANKS
