"""An ordinary sequence-classification script written for transformers' Trainer, as a
function of the Trainer class it runs with (the only thing that differs):
a tokenizer that pads, ``compute_metrics``, early stopping with the best model loaded
at the end, ``predict()`` on held-out data, then a small ``hyperparameter_search``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    DataCollatorWithPadding,
    EarlyStoppingCallback,
    GPT2Config,
    GPT2ForSequenceClassification,
    PreTrainedTokenizerFast,
    TrainingArguments,
)

VOCAB = 30


def tokenizer() -> Any:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def sentences(n: int, seed: int) -> list[dict[str, Any]]:
    """Label 1 when the sentence holds more high words (w15..) than low ones."""
    rng = np.random.default_rng(seed)
    tok, rows = tokenizer(), []
    for _ in range(n):
        words = rng.integers(2, VOCAB, size=rng.integers(3, 9))
        label = int((words >= 15).sum() > (words < 15).sum())
        rows.append({**tok(" ".join(f"w{w}" for w in words)), "labels": label})
    return rows


def model_init() -> Any:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        pad_token_id=0, num_labels=2)  # fmt: skip
    return GPT2ForSequenceClassification(config)


def accuracy(prediction: Any) -> dict[str, float]:
    logits, labels = prediction
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def run(trainer_class: type, output_dir: Path) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    args = TrainingArguments(
        output_dir=str(output_dir),
        num_train_epochs=4,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        logging_steps=3,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = trainer_class(
        model=None,
        args=args,
        data_collator=DataCollatorWithPadding(tokenizer()),
        train_dataset=sentences(24, seed=1),
        eval_dataset=sentences(8, seed=2),
        processing_class=tokenizer(),
        model_init=model_init,
        compute_metrics=accuracy,
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    trained = trainer.train()
    predicted = trainer.predict(sentences(6, seed=3))
    best = trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2)},
        n_trials=2,
        direction="maximize",
        backend="optuna",
        sampler=__import__("optuna").samplers.TPESampler(seed=0),
    )
    return {
        "log_history": trainer.state.log_history,
        "train_metrics": trained.metrics,
        "best_model_checkpoint": Path(trainer.state.best_model_checkpoint).name,
        "predictions": predicted.predictions,
        "label_ids": predicted.label_ids,
        "predict_metrics": predicted.metrics,
        "best_run": (best.run_id, best.objective, best.hyperparameters),
        "folders": sorted(p.name for p in output_dir.glob("checkpoint-*")),
        "trial_dirs": sorted(p.name for p in output_dir.glob("run-*")),
    }
