"""Switch optimizers that keep two sets of weights between their train and eval modes.

Schedule-free optimizers (``schedulefree.AdamWScheduleFree``, ``SGDScheduleFree``
…) and a few others (SPlus) train on one point of their iterate sequence and
should be evaluated on another: ``optimizer.eval()`` swaps the evaluation
weights into the model, ``optimizer.train()`` swaps them back. Forget the
first and validation measures the wrong weights; forget the second and the
next step raises (or silently trains from the wrong point).

For an optimizer without ``train()``/``eval()`` (AdamW, SGD) every handler
does nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.state import CallbackContext


def has_modes(optimizer: Any, model: Any = None) -> bool:
    """Whether ``optimizer`` has its own ``train()``/``eval()`` to call.

    A module (the model passed by mistake, or a wrapper) also has both methods,
    so modules and ``model`` itself are refused.
    """
    if optimizer is None or optimizer is model or isinstance(optimizer, torch.nn.Module):
        return False
    return callable(getattr(optimizer, "train", None)) and callable(
        getattr(optimizer, "eval", None)
    )


class OptimizerMode(Callback):
    """``optimizer.train()`` while training, ``optimizer.eval()`` while evaluating.

    - ``on_train_start`` and every ``on_epoch_start``: train mode (the optimizer
      must be in train mode before its first step).
    - ``on_eval_start``: eval mode, so evaluation sees the eval weights;
      ``on_eval_end``: back to train mode if a training run is in progress.
    - ``on_train_end``: eval mode if ``eval_after_training`` (default), so the
      model left behind holds the weights to evaluate and deploy. The final
      checkpoint is written before this, in train mode, so a resume continues
      exactly; a later ``train()`` switches back at its start.

    Checkpoints taken during training hold the train-mode weights together with
    the optimizer state (including its mode), which is what an exact resume needs.
    """

    priority = 10

    def __init__(self, *, eval_after_training: bool = True) -> None:
        if not isinstance(eval_after_training, bool):
            raise ValueError(
                f"eval_after_training must be True or False, got {eval_after_training!r}"
            )
        self.eval_after_training = eval_after_training

    def _switch(self, ctx: CallbackContext, mode: str) -> None:
        if has_modes(ctx.optimizer, ctx.model):
            getattr(ctx.optimizer, mode)()

    def on_train_start(self, ctx: CallbackContext) -> None:
        self._switch(ctx, "train")

    def on_epoch_start(self, ctx: CallbackContext) -> None:
        self._switch(ctx, "train")

    def on_eval_start(self, ctx: CallbackContext) -> None:
        self._switch(ctx, "eval")

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if ctx.state.in_training:  # a direct evaluate() outside training stays in eval mode
            self._switch(ctx, "train")

    def on_train_end(self, ctx: CallbackContext) -> None:
        if self.eval_after_training:
            self._switch(ctx, "eval")

    def __repr__(self) -> str:
        return f"OptimizerMode(eval_after_training={self.eval_after_training})"
