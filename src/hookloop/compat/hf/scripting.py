"""What transformers' example scripts call on a Trainer around the run itself: the model
card they write last and the count of examples a loader holds.

The card is transformers' own (``transformers.modelcard.TrainingSummary``) written from
the dialect Trainer's model, datasets, arguments and log history, as transformers'
``Trainer.create_model_card`` writes it; nothing is fetched or pushed.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

#: The dialect names these keywords as transformers' ``create_model_card`` does.
CARD_FIELDS = ("language", "license", "tags", "model_name", "finetuned_from", "tasks",
               "dataset_tags", "dataset", "dataset_args")  # fmt: skip


def _transformers_args(args: Any) -> Any:
    """``args`` as transformers' class reads them (a plain dialect object is rebuilt)."""
    import dataclasses

    import transformers

    if isinstance(args, transformers.TrainingArguments):
        return args
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name in names}
    return transformers.TrainingArguments(**given)


def _existing_tags(path: str, tags: Any) -> tuple[Any, bool]:
    """Tags of a card already at ``path`` added to ``tags`` (as transformers keeps
    them), and whether that card is PEFT's."""
    if not os.path.exists(path):
        return tags, False
    from huggingface_hub import ModelCard

    data = ModelCard.load(path).data
    existing = data.tags
    if tags is not None and existing is not None:
        tags = [tags] if isinstance(tags, str) else tags
        tags.extend(tag for tag in existing if tag not in tags)
    return tags, data.get("library_name") == "peft"


class ScriptMethods:
    """transformers' Trainer methods the example scripts call besides the run."""

    def create_model_card(self, **card: Any) -> None:
        """Write ``README.md`` in ``args.output_dir``: transformers' draft model card
        (its metadata, the hyper-parameters, the evaluation results of the log history).
        The keywords are transformers' (:data:`CARD_FIELDS`)."""
        unknown = sorted(set(card) - set(CARD_FIELDS))
        if unknown:
            raise TypeError(
                f"create_model_card() got {', '.join(unknown)}; it takes {', '.join(CARD_FIELDS)}"
            )
        trainer: Any = self  # a hookloop.compat.hf.Trainer
        if not trainer.is_world_process_zero():
            return
        try:
            from transformers.modelcard import TrainingSummary
        except ImportError:
            raise ValueError(
                "create_model_card writes transformers' model card: install transformers"
            ) from None
        path = os.path.join(trainer.args.output_dir, "README.md")
        card["tags"], is_peft = _existing_tags(path, card.get("tags"))
        source = SimpleNamespace(
            model=trainer.model,
            args=_transformers_args(trainer.args),
            state=trainer.state,
            train_dataset=trainer.train_dataset,
            eval_dataset=trainer.eval_dataset,
        )
        summary = TrainingSummary.from_trainer(source, **card)
        os.makedirs(trainer.args.output_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(summary.to_model_card())
        if is_peft:
            trainer.model.create_or_update_model_card(trainer.args.output_dir)

    def num_examples(self, dataloader: Any) -> int:
        """The examples ``dataloader`` holds: its dataset's length, else the batches it
        yields times the training batch size (transformers' estimate)."""
        try:
            return len(dataloader.dataset)
        except (AttributeError, TypeError, NameError):
            per_device: int = getattr(self, "args").per_device_train_batch_size  # noqa: B009
            return len(dataloader) * per_device
