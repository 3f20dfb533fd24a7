"""``trainer.compute_metrics`` set or cleared after the Trainer is built applies at the
next evaluation and prediction, as in transformers' Trainer (which reads the attribute
each time; scripts swap it between evaluations, e.g. one function per task).
Both Trainers run side by side on a tiny GPT-2 and give the same metrics."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hookloop.compat import hf  # noqa: E402
from test_hf_training_differential import (  # noqa: E402
    gpt2,
    one_thread,  # noqa: F401 - the module's autouse fixture: tiny models, one thread
    token_accuracy,
    token_rows,
    tokenizer,
)

FACTORIES = {"hf": transformers.Trainer, "hookloop": hf.Trainer}
TIMING = ("runtime", "per_second", "preparation_time")


def first_token(pred: Any) -> dict[str, float]:
    logits, _ = pred
    return {"first": float(logits[:, 0].argmax(-1).mean())}


def metrics_of(kind: str, out: Path) -> list[dict[str, float]]:
    """Evaluate and predict with no ``compute_metrics``, then one set later, another
    swapped in, and none again; the metrics each time, timings left out."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(
            output_dir=str(out), use_cpu=True, report_to="none", per_device_eval_batch_size=4,
            disable_tqdm=True,
        )  # fmt: skip
        trainer = FACTORIES[kind](
            gpt2(),
            args,
            eval_dataset=[{"input_ids": r} for r in token_rows(10, seed=2)],
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
        )
        test = [{"input_ids": r} for r in token_rows(6, seed=3)]
        seen = []
        for metric in (None, token_accuracy, first_token, None):
            trainer.compute_metrics = metric
            seen.append(trainer.evaluate())
            seen.append(trainer.predict(test).metrics)
    return [{k: v for k, v in m.items() if not k.endswith(TIMING)} for m in seen]


def test_compute_metrics_set_after_construction_applies_as_in_transformers(tmp_path):
    theirs = metrics_of("hf", tmp_path / "hf")
    ours = metrics_of("hookloop", tmp_path / "hookloop")
    assert len(ours) == len(theirs) == 8
    for mine, want in zip(ours, theirs, strict=True):
        assert mine.keys() == want.keys()
        for key, value in want.items():
            assert mine[key] == pytest.approx(value, rel=1e-5), key
    assert "eval_accuracy" in theirs[2] and "eval_first" in theirs[4]
    assert "eval_accuracy" not in theirs[6] and "test_first" in theirs[5]
