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
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hookloop.compat.hf.optim import arg


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
        self.accepts_kwargs = accepts_loss_kwargs(model)  # Trainer.model_accepts_loss_kwargs
        self.shifts = shifts_labels(model)
        #: The Trainer's ``compute_loss`` when a subclass overrides it or a
        #: ``compute_loss_func`` is given (None: the model's own loss, computed here).
        self.compute_loss: Callable[..., Any] | None = None
        self.has_loss_func = False  # a compute_loss_func: its loss is the group's already
        self.scaled_for_ga: bool | None = None  # Trainer.loss_is_scaled_for_ga
        #: The Trainer's ``floating_point_ops(inputs)``, counted for each micro-batch
        self.floating_point_ops: Callable[[Any], float] | None = None
        #: A subclass's ``training_step(model, inputs, num_items_in_batch)``: it computes,
        #: scales and back-propagates the loss and returns it detached (None: done here).
        self.training_step: Callable[..., torch.Tensor] | None = None
        self.group_size = 1  # the micro-batches of the step being run (HF's current GA steps)

    def items_in_batch(self, group: list[Any]) -> torch.Tensor | None:
        """The label tokens of a group (-100 excluded), when the model or a
        ``compute_loss_func`` is given them."""
        counted_for = self.accepts_kwargs or self.has_loss_func
        if not (counted_for and group and _has_labels(group[0])):
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
        return count / 1

    def __call__(
        self, model: Any, batch: Mapping[str, Any], num_items: torch.Tensor | None
    ) -> tuple[torch.Tensor, Any]:
        """``(loss, outputs)`` for one batch (outputs are None when a subclass's
        ``compute_loss`` computed the loss: HF's ``training_step`` asks it for the loss alone)."""
        if self.compute_loss is not None:
            return self.compute_loss(model, dict(batch), num_items_in_batch=num_items), None
        inputs = dict(batch)
        if self.accepts_kwargs and num_items is not None:
            inputs["num_items_in_batch"] = num_items
        outputs = model(**inputs)
        return loss_of(outputs, inputs), outputs

    def with_outputs(
        self, model: Any, batch: Mapping[str, Any], num_items: torch.Tensor | None
    ) -> tuple[torch.Tensor, Any]:
        """``(loss, outputs)`` for one evaluation batch, as HF's ``prediction_step`` asks."""
        if self.compute_loss is not None:
            return self.compute_loss(
                model, dict(batch), return_outputs=True, num_items_in_batch=num_items
            )
        inputs = dict(batch)
        if self.accepts_kwargs and num_items is not None:
            inputs["num_items_in_batch"] = num_items
        outputs = model(**inputs)
        return loss_of(outputs, inputs), outputs

    def scaled(self, loss: torch.Tensor, num_items: Any, group_size: int) -> torch.Tensor:
        """The loss to back-propagate: divided by the group's size unless it is the
        group's already (the model normalised it by the group's tokens, a
        ``compute_loss_func`` computed it, or ``loss_is_scaled_for_ga`` says so)."""
        if self.scaled_for_ga is not None:
            already = self.scaled_for_ga
        else:
            already = (self.accepts_kwargs and num_items is not None) or self.has_loss_func
        return loss if already else loss / group_size


def loss_of(outputs: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The loss a model returned: ``outputs["loss"]`` (a dict or ``ModelOutput``), the
    first of a tuple, or the tensor itself."""
    if isinstance(outputs, Mapping):
        if "loss" not in outputs:
            raise ValueError(
                "the model returned no loss, only the keys "
                f"{', '.join(outputs)}; it received {', '.join(inputs)} (give it labels)"
            )
        return outputs["loss"]
    if isinstance(outputs, (tuple, list)) and outputs:
        return outputs[0]
    if isinstance(outputs, torch.Tensor):
        return outputs
    raise TypeError(
        "the model must return a dict or ModelOutput with 'loss', or a tuple with the "
        f"loss first; got {type(outputs).__name__}"
    )


def _has_labels(batch: Any) -> bool:
    return isinstance(batch, Mapping) and "labels" in batch


def is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether transformers lists the model's class as a causal LM (its label smoothing then
    shifts the labels by one)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def label_smoother_for(args: Any, model: torch.nn.Module) -> Any:
    """transformers' ``LabelSmoother`` for ``label_smoothing_factor`` (None when 0, or, with a
    warning as transformers gives, for a multi-label classifier)."""
    epsilon = float(arg(args, "label_smoothing_factor", 0.0) or 0.0)
    if not epsilon:
        return None
    problem = getattr(getattr(model, "config", None), "problem_type", None)
    if problem == "multi_label_classification":
        warnings.warn(
            "Label smoothing is not compatible with multi-label classification: training "
            "this run without it (label_smoothing_factor ignored, as transformers does)",
            UserWarning,
            stacklevel=6,  # Trainer.__init__ -> _build -> hf_step -> here
        )
        return None
    try:
        from transformers.trainer_pt_utils import LabelSmoother
    except ImportError:
        raise ValueError(
            "label_smoothing_factor uses transformers' LabelSmoother: install transformers, "
            "or leave label_smoothing_factor=0"
        ) from None
    return LabelSmoother(epsilon=epsilon)


def compute_loss(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    num_items_in_batch: Any,
    *,
    loss_func: Callable[..., Any] | None,
    label_smoother: Any,
    accepts_kwargs: bool,
) -> tuple[Any, Any]:
    """``(loss, outputs)`` of one batch as transformers' ``Trainer.compute_loss`` computes
    them: ``loss_func(outputs, labels, num_items_in_batch=)`` when given, else the label
    smoother's loss with ``label_smoothing_factor``, else the model's own loss."""
    inputs = dict(inputs)
    labels = None
    if (loss_func is not None or label_smoother is not None) and "labels" in inputs:
        labels = inputs.pop("labels")
    if accepts_kwargs and num_items_in_batch is not None:
        inputs["num_items_in_batch"] = num_items_in_batch
    outputs = model(**inputs)
    if loss_func is not None:
        loss = loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
    elif labels is not None:  # label_smoothing_factor: transformers' LabelSmoother
        shift = is_causal_lm(model)
        loss = label_smoother(
            outputs, labels, shift_labels=shift, num_items_in_batch=num_items_in_batch
        )
    else:
        loss = loss_of(outputs, inputs)
    return loss, outputs
