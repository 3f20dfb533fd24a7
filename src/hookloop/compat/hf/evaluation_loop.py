"""transformers' ``evaluation_loop`` as the loop's evaluation part (:class:`HFEvaluation`),
which :mod:`hookloop.compat.hf.parts` hands the loop when ``TrainingArguments`` decide
the run and the model computes its own loss.

Each batch goes through the Trainer's ``prediction_step`` (a subclass's override
included); the loss counts once per sample and ``compute_metrics(EvalPrediction)``
runs at the end (:mod:`hookloop.compat.hf.evaluation`). A subclass's ``evaluate``
runs training's evaluations, a dict of evaluation datasets is evaluated set by set,
and a ``ReduceLROnPlateau`` steps after each evaluation in training, as transformers
does all three.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from hookloop.compat.hf import console, flow, switches
from hookloop.compat.hf import data as hf_data
from hookloop.compat.hf import evaluation as hf_evaluation
from hookloop.compat.hf import optim as hf_optim
from hookloop.compat.hf.evaluation import Evaluation as Collected
from hookloop.compat.hf.evaluation import ignored_keys
from hookloop.compat.hf.loss import HFLoss
from hookloop.compat.hf.types import eval_key
from hookloop.loop.evaluation import Evaluation
from hookloop.loop.records import Compute, Events
from hookloop.loop.stepper import steps_on_a_metric
from hookloop.state import Progress
from hookloop.step import move_to


class HFEvaluation(Evaluation):
    """HF's ``evaluation_loop``: ``prediction_step`` on each batch, the loss per sample,
    then ``compute_metrics``. ``prefix`` and ``ignore_keys`` are ``evaluate()``'s
    ``metric_key_prefix`` and ``ignore_keys`` for the pass being run (None: ``"eval"``
    and, in training, ``train(ignore_keys_for_eval=)``, else the model config's)."""

    def __init__(
        self,
        *,
        session: Any,
        hf_loss: HFLoss,
        compute_metrics: Any,
        model: torch.nn.Module,
        compute: Compute,
        events: Events,
        progress: Progress,
        max_batches: int | None,
    ) -> None:
        super().__init__(
            model=model, compute=compute, events=events, progress=progress, max_batches=max_batches
        )
        self.session, self.hf_loss, self.compute_metrics = session, hf_loss, compute_metrics
        self.prefix: str | None = None
        self.ignore_keys: list[str] | None = None
        self.ignore_keys_in_training: list[str] | None = None
        self.keep_predictions = False  # predict(): predictions also without compute_metrics
        self.scheduler: Any = None  # a ReduceLROnPlateau is stepped after evaluations
        self.last: Collected | None = None  # the latest pass's predictions and labels
        #: ``(model, inputs, prediction_loss_only, ignore_keys) -> (loss, logits, labels)``:
        #: the Trainer's ``prediction_step`` (a subclass's override included).
        self.prediction_step: Any = self.default_prediction_step
        self.preprocess_logits = None  # preprocess_logits_for_metrics(logits, labels)
        self.log_hook: Any = None  # a subclass's Trainer.log: it sees evaluate()'s metrics
        #: A subclass's ``Trainer.evaluate``: training's evaluations go through it (its
        #: ``super().evaluate()`` runs the pass), as transformers' loop calls it.
        self.evaluate_hook: Any = None
        self._delegated = False
        #: A dict of evaluation datasets: name -> loader; training evaluates each in turn
        #: (keys ``eval_<name>_*``), as transformers does.
        self.eval_sets: dict[str, Any] = {}

    @property
    def compute_metrics(self) -> Any:
        """The Trainer's ``compute_metrics`` as it is now: transformers reads the attribute
        at each evaluation, so one set (or cleared) after construction applies."""
        trainer = self.session.trainer
        return self._compute_metrics if trainer is None else trainer.compute_metrics

    @compute_metrics.setter
    def compute_metrics(self, value: Any) -> None:
        self._compute_metrics = value

    @property
    def preprocess_logits(self) -> Any:
        """The Trainer's ``preprocess_logits_for_metrics`` as it is now (as transformers)."""
        trainer = self.session.trainer
        return self._preprocess if trainer is None else trainer.preprocess_logits_for_metrics

    @preprocess_logits.setter
    def preprocess_logits(self, value: Any) -> None:
        self._preprocess = value

    def default_prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple[Any, Any, Any]:
        """transformers' ``prediction_step`` on HF's loss."""
        hf_loss, args = self.hf_loss, self.session.args
        if ignore_keys is None:
            ignore_keys = ignored_keys(self.model)
        inputs = move_to(inputs, self.device)

        def compute(model: Any, inputs: Any) -> Any:
            return hf_loss.with_outputs(model, inputs, hf_loss.items_in_batch([inputs]))

        with self.precision.autocast():
            return hf_evaluation.prediction_step(
                compute,
                model,
                inputs,
                prediction_loss_only,
                list(ignore_keys),
                hf_data.label_names(self.model, args),
                can_return_loss=hf_evaluation.can_return_loss(self.model),
            )

    def run(self, loader: Any, kind: str) -> dict[str, float]:
        training = kind == "eval" and self.progress.in_training and not self._delegated
        try:
            return self._run(loader, kind, training)
        except RuntimeError as error:
            if training:  # not a reason for auto_find_batch_size to shrink the training batch
                switches.refuse_evaluation_out_of_memory(self.session.args, error)
            raise

    def _run(self, loader: Any, kind: str, training: bool) -> dict[str, float]:
        if self.evaluate_hook is not None and training:
            return self._through_evaluate_hook()
        if training and self.eval_sets and self.prefix is None:
            return self._each_set(kind)
        return self._one_pass(loader, kind)

    def _through_evaluate_hook(self) -> dict[str, float]:
        """An evaluation in training run by a subclass's ``Trainer.evaluate``."""
        self._delegated = True  # the override's super().evaluate() comes back here
        try:
            return self.evaluate_hook(ignore_keys=self.ignore_keys_in_training)
        finally:
            self._delegated = False

    def _each_set(self, kind: str) -> dict[str, float]:
        """An evaluation in training of each named evaluation dataset (keys
        ``eval_<name>_*``), merged."""
        merged: dict[str, float] = {}
        self._delegated = True  # each set's pass is a plain one
        try:
            for name, one in self.eval_sets.items():
                self.prefix = f"eval_{name}"
                merged.update(self.run(one, kind))
        finally:
            self.prefix, self._delegated = None, False
        self.step_metric_scheduler(merged)
        return merged

    def _one_pass(self, loader: Any, kind: str) -> dict[str, float]:
        """One pass of ``evaluation_loop`` over ``loader``: its metrics, under ``prefix``."""
        model, args = self.model, self.session.args
        prefix = self.prefix if self.prefix is not None else kind
        ignore_keys = self.ignore_keys
        if ignore_keys is None and self.progress.in_training:
            ignore_keys = self.ignore_keys_in_training
        # As transformers: evaluate() without compute_metrics asks for the loss alone;
        # otherwise args.prediction_loss_only decides.
        loss_only = bool(hf_optim.arg(args, "prediction_loss_only", False)) or (
            self.compute_metrics is None and not self.keep_predictions
        )
        console.start_pass(self.session, self.ctx, loader, kind)
        started = time.monotonic()
        collected = self._collector(ignore_keys)
        if not self.progress.in_training:  # as transformers: outside training, cast for good
            if hf_optim.arg(args, "fp16_full_eval", False):
                model.to(dtype=torch.float16)
            elif hf_optim.arg(args, "bf16_full_eval", False):
                model.to(dtype=torch.bfloat16)
        was_training = model.training
        model.eval()
        self._predict_batches(loader, kind, collected, loss_only, ignore_keys)
        metrics = self._metrics(collected, prefix, started)
        self.last = collected
        self._report(kind, metrics)
        self.finish(kind, metrics)
        model.train(was_training)
        if kind == "eval" and self.progress.in_training and not self.eval_sets:
            self.step_metric_scheduler(metrics)
        return metrics

    def _collector(self, ignore_keys: list[str] | None) -> Collected:
        """What collects a pass's losses, predictions and labels, as the arguments say."""
        model, args = self.model, self.session.args
        return Collected(
            hf_data.label_names(model, args),
            ignore_keys if ignore_keys is not None else ignored_keys(model),
            self.compute_metrics,
            list(hf_optim.arg(args, "include_for_metrics", []) or []),
            nan_filter=bool(hf_optim.arg(args, "logging_nan_inf_filter", True)),
            keep_predictions=self.keep_predictions,
            preprocess=self.preprocess_logits,
            batch_metrics=bool(hf_optim.arg(args, "batch_eval_metrics", False)),
        )

    def _predict_batches(
        self,
        loader: Any,
        kind: str,
        collected: Collected,
        loss_only: bool,
        ignore_keys: list[str] | None,
    ) -> None:
        """``prediction_step`` on each batch, between the pass's events."""
        ctx, hooks, fire, model = self.ctx, self.hooks, self.fire, self.model
        if hooks[f"on_{kind}_start"]:
            fire(f"on_{kind}_start", ctx)
        for batch, last in _with_last(itertools.islice(loader, self.max_batches)):
            if hooks[f"on_{kind}_step_start"]:
                ctx.batch = batch
                fire(f"on_{kind}_step_start", ctx)
            inputs = move_to(batch, self.device)
            loss, logits, labels = self.prediction_step(model, inputs, loss_only, ignore_keys)
            collected.add(inputs, loss, logits, labels, last=last)
            if hooks[f"on_{kind}_step_end"]:
                ctx.batch, ctx.outputs, ctx.loss = batch, logits, loss
                fire(f"on_{kind}_step_end", ctx)
            ctx.batch = ctx.outputs = ctx.loss = None

    def _metrics(self, collected: Collected, prefix: str, started: float) -> dict[str, Any]:
        """The pass's metrics with HF's model preparation time and speed keys (prefixed,
        the time from ``started`` to now, ``compute_metrics`` included), before
        on_evaluate / on_predict see them."""
        metrics = collected.metrics(prefix)
        session = self.session
        if session.model_preparation_time is None and not session.trained:
            session.model_preparation_time = 0.0  # the loop placed the model when built
        if session.model_preparation_time is not None:
            metrics[f"{prefix}_model_preparation_time"] = session.model_preparation_time
        per_batch = max(int(hf_optim.arg(session.args, "per_device_eval_batch_size", 8)), 1)
        steps = math.ceil(collected.samples / per_batch)
        flow.speed_into(metrics, prefix, time.monotonic() - started, collected.samples, steps)
        return metrics

    def _report(self, kind: str, metrics: dict[str, Any]) -> None:
        """What transformers' ``evaluate()`` does with the metrics before on_evaluate:
        ``log()`` adds the epoch, and a subclass's ``Trainer.log`` sees them."""
        if kind != "eval":
            return
        session = self.session
        session.refresh(self.ctx, "on_eval_end")
        metrics["epoch"] = session.state.epoch
        if session.tokens is not None:
            session.tokens.add_to_log(metrics)
        if self.log_hook is not None:
            # the evaluation's own log event (on_eval_end) then publishes them.
            session.evaluating = True
            try:
                self.log_hook(metrics)
            finally:
                session.evaluating = False

    def step_metric_scheduler(self, metrics: dict[str, Any]) -> None:
        """HF steps a ``ReduceLROnPlateau`` after each evaluation in training, on
        ``metric_for_best_model`` (``eval_``-prefixed), once ``on_evaluate`` has run."""
        scheduler = self.scheduler
        if not steps_on_a_metric(scheduler) or self.session.evaluating_at_start:
            return  # as transformers: eval_on_start's evaluation steps no schedule
        key = eval_key(hf_optim.arg(self.session.args, "metric_for_best_model", None) or "loss")
        if key not in metrics:
            raise KeyError(
                f"metric_for_best_model names {key!r}, which the evaluation did not report "
                f"(it reported {', '.join(sorted(metrics))}); the {type(scheduler).__name__} "
                "scheduler steps on it"
            )
        scheduler.step(metrics[key])


def _with_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item, and whether it is the last (one item read ahead)."""
    it = iter(items)
    try:
        held = next(it)
    except StopIteration:
        return
    for item in it:
        yield held, False
        held = item
    yield held, True
