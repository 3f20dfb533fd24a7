"""HF's evaluation results: the loss per sample, and ``compute_metrics(EvalPrediction)``.

As ``transformers.Trainer.evaluation_loop``: each batch's loss counts once per
sample (``eval_loss`` is the mean over samples, not over batches); the
predictions are the model's outputs other than the loss (and the keys the
model's config ignores at inference), the labels are the batch's
``label_names``; both are concatenated over the evaluation (padded with -100
where lengths differ) and handed to ``compute_metrics`` as numpy arrays. Every
key gets the ``metric_key_prefix``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch


class PredictionOutput(NamedTuple):
    """What ``Trainer.predict`` returns, as transformers' ``PredictionOutput``."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None


class EvalLoopOutput(NamedTuple):
    """transformers' ``EvalLoopOutput``: a prediction pass and how many samples it saw."""

    predictions: Any
    label_ids: Any
    metrics: dict[str, float] | None
    num_samples: int | None


class EvalPrediction:
    """What ``compute_metrics`` receives: ``predictions`` and ``label_ids`` (numpy),
    plus ``inputs`` / ``losses`` when ``include_for_metrics`` asks; unpacks as a
    pair (or more, with those), as HF's does."""

    def __init__(
        self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None
    ) -> None:
        self.predictions, self.label_ids = predictions, label_ids
        self.inputs, self.losses = inputs, losses
        extra = tuple(x for x in (inputs, losses) if x is not None)
        self._items = (predictions, label_ids, *extra)

    def __iter__(self) -> Any:
        return iter(self._items)

    def __getitem__(self, i: int) -> Any:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)


def ignored_keys(model: torch.nn.Module) -> list[str]:
    """Output keys left out of the predictions (HF reads them from the model's config)."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    return list(getattr(config, "keys_to_ignore_at_inference", ["past_key_values"]))


class Evaluation:
    """Collects one evaluation, batch by batch, as HF's loop does."""

    def __init__(
        self,
        label_names: list[str],
        ignore_keys: list[str],
        compute_metrics: Callable[[EvalPrediction], dict[str, Any]] | None,
        include_for_metrics: list[str],
        nan_filter: bool,
        keep_predictions: bool = False,
        preprocess: Callable[[Any, Any], Any] | None = None,
        batch_metrics: bool = False,
    ) -> None:
        self.label_names, self.ignore = label_names, ignore_keys
        self.compute_metrics, self.include = compute_metrics, set(include_for_metrics or ())
        self.nan_filter = nan_filter
        self.preprocess = preprocess  # preprocess_logits_for_metrics(logits, labels)
        #: ``batch_eval_metrics``: compute_metrics(batch, compute_result=last) on each batch;
        #: only predict() keeps the predictions then
        self.batch_metrics = batch_metrics
        self.batch_result: Any = None
        self.keep = keep_predictions or (compute_metrics is not None and not batch_metrics)
        self.logits_needed = self.keep or (batch_metrics and compute_metrics is not None)
        self.samples = self.batches = 0
        self.losses: list[np.ndarray] = []
        self.preds: Any = None
        self.labels: Any = None
        self.inputs: Any = None

    def has_labels(self, batch: Mapping[str, Any]) -> bool:
        return bool(self.label_names) and all(batch.get(k) is not None for k in self.label_names)

    def add(
        self,
        batch: Mapping[str, Any],
        loss: torch.Tensor | None,
        logits: Any,
        labels: Any,
        *,
        last: bool = False,
    ) -> None:
        """One batch, as ``prediction_step`` returned it: its mean loss, and, when
        predictions are kept, its logits (through ``preprocess_logits_for_metrics``)
        and labels; ``last``: the evaluation's last batch."""
        size = _batch_size(batch)
        self.samples += size
        self.batches += 1
        losses = None
        if loss is not None:
            losses = loss.detach().reshape(1).repeat(size)
            self.losses.append(losses.float().cpu().numpy())
        if not self.logits_needed:
            return
        if logits is not None and self.preprocess is not None:
            logits = self.preprocess(logits, labels)
        main = batch.get("input_ids", next(iter(batch.values())))
        if self.batch_metrics and logits is not None and labels is not None:
            self.batch_result = self.compute_metrics(  # type: ignore[misc, call-arg]  # set with batch_metrics, then takes compute_result
                EvalPrediction(
                    predictions=logits,
                    label_ids=labels,
                    inputs=main if "inputs" in self.include else None,
                    losses=losses if "loss" in self.include else None,
                ),
                compute_result=last,
            )
        if not self.keep:
            return
        if logits is not None:
            self.preds = _concat(self.preds, logits)
        if labels is not None:
            self.labels = _concat(self.labels, labels)
        if "inputs" in self.include:
            self.inputs = _concat(self.inputs, main.detach())

    def predictions(self) -> tuple[Any, Any]:
        """``(predictions, label_ids)`` as numpy arrays (or tuples of them; None where
        there were none), as ``predict()`` returns them."""
        return _numpy(self.preds), _numpy(self.labels)

    def metrics(self, prefix: str) -> dict[str, Any]:
        """The evaluation's metrics, every key starting with ``prefix_``."""
        metrics: dict[str, Any] = {}
        losses = np.concatenate(self.losses) if self.losses else None
        if self.batch_metrics:
            metrics.update({k: _plain(v) for k, v in (self.batch_result or {}).items()})
        elif (
            self.compute_metrics is not None and self.preds is not None and self.labels is not None
        ):
            computed = self.compute_metrics(
                EvalPrediction(
                    predictions=_numpy(self.preds),
                    label_ids=_numpy(self.labels),
                    inputs=_numpy(self.inputs) if "inputs" in self.include else None,
                    losses=losses if "loss" in self.include else None,
                )
            )
            if not isinstance(computed, Mapping):
                raise TypeError(
                    f"compute_metrics must return a dict of metrics, got {type(computed).__name__}"
                )
            metrics.update({k: _plain(v) for k, v in computed.items()})
        if losses is not None:
            finite = np.isfinite(losses)
            if self.nan_filter and finite.any():
                losses = losses[finite]
            metrics[f"{prefix}_loss"] = losses.mean().item()
        # transformers prefixes a key by popping it: the unprefixed ones move to the end
        mine = {k: v for k, v in metrics.items() if k.startswith(f"{prefix}_")}
        return {**mine, **{f"{prefix}_{k}": v for k, v in metrics.items() if k not in mine}}


def prediction_step(
    compute: Callable[..., tuple[torch.Tensor, Any]],
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    prediction_loss_only: bool,
    ignore_keys: list[str],
    label_names: list[str],
    can_return_loss: bool = False,
) -> tuple[torch.Tensor | None, Any, Any]:
    """``(loss, logits, labels)`` for one batch, as transformers' ``prediction_step``:
    with labels, ``compute(model, inputs)`` gives the loss and the outputs, and the
    logits are the outputs but the loss; without, the model's outputs are the logits
    (all of a tuple; a dict's but ``ignore_keys``). A model whose ``forward`` returns
    its loss without labels (``return_loss=True``) is asked for it when there are no
    ``label_names``."""
    has_labels = bool(label_names) and all(inputs.get(k) is not None for k in label_names)
    return_loss = inputs.get("return_loss")
    loss_without_labels = not label_names and bool(
        can_return_loss if return_loss is None else return_loss
    )
    with torch.no_grad():
        if has_labels or loss_without_labels:
            loss, outputs = compute(model, inputs)
            loss = loss.detach().mean()
            if isinstance(outputs, Mapping):
                dropped = [*ignore_keys, "loss"]
                logits: Any = tuple(v for k, v in outputs.items() if k not in dropped)
            elif isinstance(outputs, (tuple, list)):
                logits = tuple(outputs[1:])
            else:
                logits = ()
        else:
            loss = None
            outputs = model(**inputs)
            if isinstance(outputs, Mapping):
                logits = tuple(v for k, v in outputs.items() if k not in ignore_keys)
            elif isinstance(outputs, (tuple, list)):
                logits = tuple(outputs)
            else:
                logits = (outputs,)
    if prediction_loss_only:
        return loss, None, None
    logits = _detach(logits)
    if isinstance(logits, tuple) and len(logits) == 1:
        logits = logits[0]
    elif isinstance(logits, tuple) and not logits:
        logits = None
    labels = None
    if has_labels or loss_without_labels:
        found = _detach(tuple(inputs.get(k) for k in label_names))
        labels = found[0] if len(found) == 1 else found
    return loss, logits, labels


def can_return_loss(model: torch.nn.Module) -> bool:
    """Whether the model's ``forward`` takes ``return_loss`` defaulting to True (as
    transformers' ``can_return_loss`` reads it)."""
    try:
        param = inspect.signature(model.forward).parameters.get("return_loss")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is True


def _batch_size(batch: Any) -> int:
    """The leading size of the batch's first tensor, as HF's ``find_batch_size``."""
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    return 1


def _detach(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return type(x)(_detach(v) for v in x)
    return x.detach() if isinstance(x, torch.Tensor) else x


def _concat(kept: Any, new: Any) -> Any:
    """Concatenate along the batch, padding a second dimension with -100 where it differs."""
    if kept is None:
        return new
    if isinstance(new, (tuple, list)):
        return type(new)(_concat(k, n) for k, n in zip(kept, new, strict=True))
    if kept.dim() < 2 or kept.shape[1] == new.shape[1]:
        return torch.cat((kept, new.reshape(-1, *kept.shape[1:]) if not new.dim() else new))
    width = max(kept.shape[1], new.shape[1])
    shape = (kept.shape[0] + new.shape[0], width, *kept.shape[2:])
    out = kept.new_full(shape, -100)
    out[: kept.shape[0], : kept.shape[1]] = kept
    out[kept.shape[0] :, : new.shape[1]] = new
    return out


def _numpy(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, (tuple, list)):
        return type(x)(_numpy(v) for v in x)
    return x.cpu().float().numpy() if x.dtype == torch.bfloat16 else x.cpu().numpy()


def _plain(value: Any) -> Any:
    """Numpy scalars and 0-dim tensors as Python numbers (JSON-ready, as HF makes them)."""
    if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
        return value.item()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value
