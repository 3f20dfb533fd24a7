"""A run interrupted after a checkpoint and started again with
``resume_from_checkpoint=True`` logs what transformers' Trainer logs: the first loss
after the resume is the mean of the steps run since (transformers' running loss starts
at zero), ``train_loss`` is this run's, and the restored log entries have their keys
sorted, as transformers reads them back (the model card's table takes its columns from
that order).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hookloop.compat import hf  # noqa: E402
from test_hf_training_differential import (  # noqa: E402
    BASE,
    RegressionDataset,
    RegressionModel,
)

FACTORIES = {"hf": transformers.Trainer, "hookloop": hf.Trainer}


def _trainer(kind: str, out: Path) -> Any:
    # the loss logged at step 4 covers steps 3 and 4: the resume at 3 splits its window
    args = transformers.TrainingArguments(
        output_dir=str(out), **{**BASE, "max_steps": 6, "logging_steps": 2,
        "save_strategy": "steps", "save_steps": 3, "eval_strategy": "steps", "eval_steps": 3,
        "per_device_train_batch_size": 4, "learning_rate": 0.05},
    )  # fmt: skip
    return FACTORIES[kind](
        RegressionModel(), args, train_dataset=RegressionDataset(40),
        eval_dataset=RegressionDataset(8, seed=7),
    )  # fmt: skip


def _interrupted_then_resumed(kind: str, out: Path) -> tuple[Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(kind, out).train()
        shutil.rmtree(out / "checkpoint-6")  # as if stopped after the save at step 3
        trainer = _trainer(kind, out)
        result = trainer.train(resume_from_checkpoint=True)
    return trainer, result


def test_a_resumed_run_logs_and_reports_what_transformers_does(tmp_path: Path):
    (theirs, their_result), (ours, our_result) = (
        _interrupted_then_resumed(kind, tmp_path / kind) for kind in FACTORIES
    )
    assert ours.state.global_step == theirs.state.global_step == 6
    for mine, their in zip(ours.state.log_history, theirs.state.log_history, strict=True):
        timings = [k for k in their if k.endswith(("_runtime", "_per_second"))]
        assert {k: v for k, v in mine.items() if k not in timings} == pytest.approx(
            {k: v for k, v in their.items() if k not in timings}
        )
    assert our_result.training_loss == pytest.approx(their_result.training_loss)
    # the order of each entry's keys: the columns of the model card's table
    assert [list(e) for e in ours.state.log_history] == [list(e) for e in theirs.state.log_history]
