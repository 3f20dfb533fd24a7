"""HF's ``compute_loss`` and its gradient-accumulation scaling.

``transformers.Trainer`` calls ``model(**batch)`` and takes ``outputs["loss"]``
(a dict or ``ModelOutput``) or ``outputs[0]`` (a tuple). When the model's
``forward`` takes ``**kwargs`` and the batch has ``labels``, it also passes
``num_items_in_batch`` (the label tokens of the whole accumulation group), so
the model's loss is already the group's token mean and is not divided again;
otherwise each micro-batch's loss is divided by the group's size (smaller for
an epoch's last, partial group). The step's logged loss is the sum of the
scaled micro-batch losses.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether HF passes ``num_items_in_batch`` to this model's ``forward``."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def shifts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's loss is transformers' causal-LM loss (labels shifted by one)."""
    if not type(model).__module__.startswith("transformers."):
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    config = getattr(model, "config", None)
    causal = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    return causal and not getattr(config, "is_encoder_decoder", False)


class HFLoss:
    """The loss of one micro-batch as ``transformers.Trainer`` computes it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.accepts_kwargs = accepts_loss_kwargs(model)
        self.shifts = shifts_labels(model)

    def items_in_batch(self, group: list[Any]) -> torch.Tensor | None:
        """The label tokens of a group (-100 excluded), when the model is given them."""
        if not (self.accepts_kwargs and group and _has_labels(group[0])):
            return None
        try:
            counted = [
                b["shift_labels"]
                if "shift_labels" in b
                else b["labels"][..., 1:]
                if self.shifts
                else b["labels"]
                for b in group
            ]
            count = sum(labels.ne(-100).sum() for labels in counted)
        except (TypeError, AttributeError):
            return None
        # HF divides the count by its parallel sizes (1 here): the model gets a float
        # tensor, and dividing by it rounds the gradients as HF's run does.
        return count / 1  # type: ignore[operator]

    def __call__(
        self, model: Any, batch: Mapping[str, Any], num_items: torch.Tensor | None
    ) -> tuple[torch.Tensor, Any]:
        """``(loss, outputs)`` for one batch."""
        inputs = dict(batch)
        if self.accepts_kwargs and num_items is not None:
            inputs["num_items_in_batch"] = num_items
        outputs = model(**inputs)
        if isinstance(outputs, Mapping):
            if "loss" not in outputs:
                raise ValueError(
                    "the model returned no loss, only the keys "
                    f"{', '.join(outputs)}; it received {', '.join(inputs)} (give it labels)"
                )
            return outputs["loss"], outputs
        if isinstance(outputs, (tuple, list)) and outputs:
            return outputs[0], outputs
        if isinstance(outputs, torch.Tensor):
            return outputs, outputs
        raise TypeError(
            "the model must return a dict or ModelOutput with 'loss', or a tuple with the "
            f"loss first; got {type(outputs).__name__}"
        )

    def scaled(self, loss: torch.Tensor, num_items: Any, group_size: int) -> torch.Tensor:
        """The loss to back-propagate: divided by the group's size unless the
        model already normalised it by the group's tokens."""
        if self.accepts_kwargs and num_items is not None:
            return loss
        return loss / group_size


def _has_labels(batch: Any) -> bool:
    return isinstance(batch, Mapping) and "labels" in batch
