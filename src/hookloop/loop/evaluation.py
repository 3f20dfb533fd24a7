"""Evaluation, test and prediction passes over held-out data.

:meth:`Evaluation.run` averages the loss (and every meta value ``loss_func``
returns) over the data, under ``torch.no_grad()`` and the run's autocast, firing
``on_<kind>_start``, ``on_<kind>_step_start`` / ``_end`` for each batch and
``on_<kind>_end`` with ``ctx.metrics`` (keys ``eval_*`` or ``test_*``). With several
ranks each evaluates its own share and the sums are reduced before the mean. A
dialect evaluates its own way (transformers' Trainer: ``compute_metrics`` over the
predictions) by replacing :meth:`Evaluation.run`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hookloop.loop.records import Compute, Events
from hookloop.state import Progress
from hookloop.step import LossReducer, to_float


class Evaluation:
    """Runs evaluation, test and prediction passes with the run's model and forward step.

    ``non_loss_data_func(model)`` (Megatron's hook), when set, runs after each pass;
    handlers of ``on_eval_end`` / ``on_test_end`` see its result as ``ctx.non_loss_data``.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        compute: Compute,
        events: Events,
        progress: Progress,
        max_batches: int | None,
        non_loss_data_func: Callable[[Any], Any] | None = None,
    ) -> None:
        self.model, self.forward, self.state = model, compute.forward, compute.state
        self.precision, self.device = compute.precision, compute.device
        self.ctx, self.hooks, self.fire = events.ctx, events.hooks, events.fire
        self.progress, self.max_batches = progress, max_batches
        self.non_loss_data_func = non_loss_data_func

    def run(self, loader: Iterable[Any], kind: str) -> dict[str, float]:
        """One pass of ``kind`` (``"eval"`` or ``"test"``) over ``loader``; its metrics."""
        ctx, hooks, fire, model = self.ctx, self.hooks, self.fire, self.model
        step_start, step_end = f"on_{kind}_step_start", f"on_{kind}_step_end"
        was_training = model.training
        model.eval()
        self._fire(f"on_{kind}_start")
        reducer = LossReducer()
        with torch.no_grad():
            for batch in itertools.islice(loader, self.max_batches):
                if hooks[step_start]:
                    ctx.batch = batch
                    fire(step_start, ctx)
                with self.precision.autocast():
                    output, loss_func = self.forward(self.state, iter((batch,)), model)
                    loss, _ = reducer.add(loss_func(output))
                if hooks[step_end]:
                    ctx.batch, ctx.outputs, ctx.loss = batch, output, loss
                    fire(step_end, ctx)
                ctx.batch = ctx.outputs = ctx.loss = None
            if self.non_loss_data_func is not None:  # Megatron's hook (evaluation and test)
                ctx.non_loss_data = self.non_loss_data_func(model)
        if self.progress.world_size > 1:
            reducer.reduce_across_ranks(self.device)  # each rank evaluated its own share
        metrics = {f"{kind}_{k}": to_float(v) for k, v in reducer.result().items()}
        self.finish(kind, metrics)
        model.train(was_training)
        return metrics

    def finish(self, kind: str, metrics: dict[str, Any]) -> None:
        """Record and announce a pass's metrics: ``state.last_eval`` for an evaluation,
        then ``on_<kind>_end`` with ``ctx.metrics``."""
        if kind == "eval":
            self.progress.record_eval(metrics)
        self.ctx.metrics = metrics
        self._fire(f"on_{kind}_end")
        self.ctx.metrics = self.ctx.non_loss_data = None

    def predict(self, loader: Iterable[Any]) -> list[Any]:
        """Forward only; collect whatever ``loss_func`` returns (the inference pattern)."""
        model = self.model
        was_training = model.training
        model.eval()
        results = []
        with torch.no_grad():
            for batch in loader:
                with self.precision.autocast():
                    output, loss_func = self.forward(self.state, iter((batch,)), model)
                    results.append(loss_func(output))
        model.train(was_training)
        return results

    def _fire(self, event: str) -> None:
        if self.hooks[event]:
            self.fire(event, self.ctx)
