"""What a script sets on a transformers Trainer after building it applies, as in
transformers, which reads these attributes each time it uses them: ``compute_metrics``
(scripts swap it between evaluations, one function per task),
``preprocess_logits_for_metrics``, ``train_dataset``, ``eval_dataset``,
``data_collator`` and the arguments an evaluation's loader is built from. Both
Trainers run side by side on a tiny GPT-2 and agree."""

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


def set_later(kind: str, out: Path, name: str) -> Any:
    """A Trainer built with one value of ``name``, given another before it is used: what
    it then does (losses trained on, metrics, or the prediction's shape)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(
            output_dir=str(out), use_cpu=True, report_to="none", per_device_train_batch_size=4,
            per_device_eval_batch_size=4, disable_tqdm=True, max_steps=3, logging_steps=1,
            save_strategy="no",
        )  # fmt: skip
        trainer = FACTORIES[kind](
            gpt2(),
            args,
            train_dataset=[{"input_ids": r} for r in token_rows(8, seed=1)],
            eval_dataset=[{"input_ids": r} for r in token_rows(8, seed=2)],
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
            compute_metrics=token_accuracy,
        )
        if name == "train_dataset":
            trainer.train_dataset = [{"input_ids": r} for r in token_rows(40, seed=5)]
            trainer.train()
            return [e["loss"] for e in trainer.state.log_history if "loss" in e]
        if name == "eval_dataset":
            trainer.eval_dataset = [{"input_ids": r} for r in token_rows(12, seed=6)]
            return trainer.evaluate()["eval_loss"]
        if name == "args.per_device_eval_batch_size":  # batches of 2: another mean loss
            trainer.args.per_device_eval_batch_size = 2
            return trainer.evaluate()["eval_loss"]
        if name == "preprocess_logits_for_metrics":
            trainer.preprocess_logits_for_metrics = lambda logits, labels: logits[..., :5]
            return trainer.evaluate()["eval_accuracy"]
        trainer.data_collator = transformers.DataCollatorForLanguageModeling(
            tokenizer(), mlm=False, pad_to_multiple_of=16
        )
        return trainer.predict([{"input_ids": r} for r in token_rows(4, seed=3)]).predictions.shape


@pytest.mark.parametrize(
    "name",
    [
        "train_dataset",
        "eval_dataset",
        "preprocess_logits_for_metrics",
        "data_collator",
        "args.per_device_eval_batch_size",
    ],
)
def test_a_dataset_collator_or_logits_hook_set_after_construction_is_used(tmp_path, name):
    theirs = set_later("hf", tmp_path / "hf", name)
    assert set_later("hookloop", tmp_path / "hookloop", name) == pytest.approx(theirs, rel=1e-5)
