"""``Trainer.get_optimizer_cls_and_kwargs``, transformers' static helper that names the
optimizer class and keywords ``TrainingArguments.optim`` implies: the dialect answers as
transformers answers for each optimizer it builds, and a subclass overriding it chooses
the optimizer the loop trains with, as with transformers' Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hookloop.compat import hf  # noqa: E402
from hookloop.compat.hf.optim import OPTIMIZERS  # noqa: E402
from hookloop.testing import TinyModel, ToyData  # noqa: E402

OPTIM_ARGS = {"sgd": "momentum=0.9,nesterov=True", "rmsprop": "alpha=0.8,centered=True"}


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_the_static_helper_answers_as_transformers_answers(optim: str, tmp_path: Path):
    given = dict(output_dir=str(tmp_path), optim=optim, optim_args=OPTIM_ARGS.get(optim),
                 learning_rate=3e-3, adam_beta2=0.95, use_cpu=True)  # fmt: skip
    theirs = transformers.Trainer.get_optimizer_cls_and_kwargs(
        transformers.TrainingArguments(**given)
    )
    assert hf.Trainer.get_optimizer_cls_and_kwargs(hf.TrainingArguments(**given)) == theirs


def test_an_override_of_the_helper_picks_the_optimizer_trained_with(tmp_path: Path):
    class MomentumTrainer(hf.Trainer):
        @staticmethod
        def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[type, dict]:
            return torch.optim.SGD, {"lr": args.learning_rate, "momentum": 0.5}

    args = hf.TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to="none",
                                use_cpu=True, learning_rate=0.1, save_strategy="no")  # fmt: skip
    trainer = MomentumTrainer(
        TinyModel(), args, train_dataset=ToyData(n=8), loss_fn=TinyModel.loss_fn
    )
    trainer.train()
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    assert [g["momentum"] for g in trainer.optimizer.param_groups] == [0.5, 0.5]
