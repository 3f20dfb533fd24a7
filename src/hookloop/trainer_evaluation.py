"""The Trainer's evaluation side: ``evaluate()``, ``test()``, ``predict()`` and the
evaluations run during training.

A mixin of :class:`hookloop.trainer.Trainer`, kept apart so that the training loop
in ``trainer.py`` reads top to bottom; it uses the Trainer's attributes freely.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch

from hookloop.step import LossReducer, to_float


class TrainerEvaluation:
    """Evaluation methods of the Trainer (see the module doc)."""

    def _evaluate_in_training(self) -> None:
        self._t_eval.start()
        self._gc.at_eval()  # train.gc_every with gc_eval: the evaluation's garbage goes at once
        self.evaluate()
        self._gc.at_eval()
        self._t_eval.stop()
        self._last_eval_step = self.state._step
        self.model.train()

    def _evaluated_now(self) -> bool:
        """Whether an evaluation already ran at this step (e.g. eval_every hit the epoch end)."""
        return self._last_eval_step == self.state._step

    def evaluate(self, data: Iterable[Any] | None = None) -> dict[str, float]:
        """Average the loss (and meta metrics) over evaluation data; keys are ``eval_*``."""
        loader = self._loader(data, train=False) if data is not None else self.eval_loader
        if loader is None:
            raise ValueError(
                "evaluate() needs eval data: pass eval_data to Trainer or to evaluate()"
            )
        return self._run_eval_loop(loader, "eval")

    def test(self, data: Iterable[Any] | None = None) -> dict[str, float]:
        """Like ``evaluate()`` on test data, firing the ``on_test_*`` events; keys ``test_*``."""
        loader = self._loader(data, train=False) if data is not None else self.test_loader
        if loader is None:
            raise ValueError("test() needs test data: pass test_data to Trainer or to test()")
        return self._run_eval_loop(loader, "test")

    def _run_eval_loop(self, loader: Iterable[Any], kind: str) -> dict[str, float]:
        st, ctx, hooks = self.state, self.ctx, self._hooks
        start, step_start, step_end, end = (
            f"on_{kind}_start",
            f"on_{kind}_step_start",
            f"on_{kind}_step_end",
            f"on_{kind}_end",
        )
        was_training = self.model.training
        self.model.eval()
        self._fire(start)
        reducer, limit = LossReducer(), self.config.train.eval_max_batches
        with torch.no_grad():
            for batch in itertools.islice(loader, limit):
                if hooks[step_start]:
                    ctx.batch = batch
                    self.callbacks.fire(step_start, ctx)
                with self.precision.autocast():
                    output, loss_func = self._forward(st, iter((batch,)), self.model)
                    loss, _ = reducer.add(loss_func(output))
                if hooks[step_end]:
                    ctx.batch, ctx.outputs, ctx.loss = batch, output, loss
                    self.callbacks.fire(step_end, ctx)
                ctx.batch = ctx.outputs = ctx.loss = None
            if self.non_loss_data_func is not None:  # seed 003's hook (evaluation and test)
                ctx.non_loss_data = self.non_loss_data_func(self.model)
        if st._world_size > 1:
            reducer.reduce_across_ranks(self.device)  # each rank evaluated its own share
        metrics = {f"{kind}_{k}": to_float(v) for k, v in reducer.result().items()}
        if kind == "eval":
            st._last_eval = metrics
        ctx.metrics = metrics
        self._fire(end)
        ctx.metrics = ctx.non_loss_data = None
        self.model.train(was_training)
        return metrics

    def predict(self, data: Iterable[Any]) -> list[Any]:
        """Forward only; collect whatever ``loss_func`` returns (the inference pattern)."""
        loader = self._loader(data, train=False)
        was_training = self.model.training
        self.model.eval()
        results = []
        with torch.no_grad():
            for batch in loader:  # type: ignore[union-attr]
                with self.precision.autocast():
                    output, loss_func = self._forward(self.state, iter((batch,)), self.model)
                    results.append(loss_func(output))
        self.model.train(was_training)
        return results
