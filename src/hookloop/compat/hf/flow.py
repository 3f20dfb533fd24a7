"""HF's flow: what ``transformers.Trainer`` decides at the boundaries of a step and an epoch.

When ``TrainingArguments`` decide a dialect run, the decisions are HF's, not the
native schedule's:

- ``DefaultFlowCallback``: after each step (and each epoch) the flags
  ``should_log`` / ``should_evaluate`` / ``should_save`` / ``should_training_stop``
  are set *before* any user callback sees them, so a callback may read or clear
  them (:func:`flag_step_end`, :func:`flag_epoch_end`).
- ``_maybe_log_save_evaluate``: the flags still set after the handlers decide
  the log, then the evaluation, then the save (the dialect Trainer calls it).
- the end of training: a summary log (``train_runtime``, ``train_loss``, ...)
  and the best checkpoint reloaded before ``on_train_end``.

The log and metric dicts carry HF's keys.
"""

from __future__ import annotations

from typing import Any


def flag_step_end(args: Any, state: Any, control: Any) -> None:
    """``DefaultFlowCallback.on_step_end``, as transformers 5.x decides it."""
    step = state.global_step
    if step == 1 and getattr(args, "logging_first_step", False):
        control.should_log = True
    if strategy(args, "logging_strategy") == "steps" and step % state.logging_steps == 0:
        control.should_log = True
    eval_steps_due = strategy(args, "eval_strategy") == "steps" and _after_delay(args, step)
    if eval_steps_due and step % state.eval_steps == 0:
        control.should_evaluate = True
    save_steps = strategy(args, "save_strategy") == "steps"
    if save_steps and state.save_steps > 0 and step % state.save_steps == 0:
        control.should_save = True
    if state.max_steps and step >= state.max_steps:
        control.should_training_stop = True
        if eval_steps_due and step % state.eval_steps != 0:
            control.should_evaluate = True  # 5.x: the last step is always evaluated
        if save_steps:
            control.should_save = True


def flag_epoch_end(args: Any, state: Any, control: Any) -> None:
    """``DefaultFlowCallback.on_epoch_end``."""
    if strategy(args, "logging_strategy") == "epoch":
        control.should_log = True
    if strategy(args, "eval_strategy") == "epoch" and _after_delay(args, state.epoch):
        control.should_evaluate = True
    if strategy(args, "save_strategy") == "epoch":
        control.should_save = True


def strategy(args: Any, name: str) -> str:
    """A strategy as a plain string (transformers passes an enum)."""
    value = getattr(args, name, "no")
    return str(getattr(value, "value", value)).lower()


def _after_delay(args: Any, progress: float) -> bool:
    return (getattr(args, "eval_delay", 0) or 0) <= progress


def eval_speed(metrics: dict[str, Any], seconds: float, samples: int, batches: int) -> None:
    """HF's ``eval_runtime`` / ``eval_samples_per_second`` / ``eval_steps_per_second``."""
    metrics.update(_speed("eval", seconds, samples, batches))


def speed_into(
    metrics: dict[str, Any], prefix: str, seconds: float, samples: int, batches: int
) -> None:
    """``{prefix}_runtime`` / ``_samples_per_second`` / ``_steps_per_second``."""
    metrics.update(_speed(prefix, seconds, samples, batches))


def train_summary(
    seconds: float, samples: float, steps: int, total_flos: float, train_loss: float
) -> dict[str, float]:
    """The end-of-training log of ``transformers.Trainer``."""
    return {
        **_speed("train", seconds, samples, steps),
        "total_flos": float(total_flos),
        "train_loss": float(train_loss),
    }


def _speed(prefix: str, seconds: float, samples: float, steps: int) -> dict[str, float]:
    seconds = max(seconds, 1e-9)
    return {
        f"{prefix}_runtime": round(seconds, 4),
        f"{prefix}_samples_per_second": round(samples / seconds, 3),
        f"{prefix}_steps_per_second": round(steps / seconds, 3),
    }
