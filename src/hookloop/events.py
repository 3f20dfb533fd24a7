"""The event vocabulary: every point in the loop where callbacks may run.

The Trainer fires these events, in this order (``k`` = ``train.grad_accum``)::

    Trainer(...)                                    on_init_end
    train()
      (resume: state restored)                      on_checkpoint_load
      model, optimizer, checkpoint ready            on_data_init_start
      model.train()                                 on_train_start
      for each epoch:                               on_epoch_start
        for each optimizer step:                    on_train_step_start
          repeat k times:                           on_micro_step_start
            forward, loss, backward                 on_micro_step_end
          unscale, clip (grad norm kept a tensor)   on_before_optimizer_step
          optimizer.step(), scheduler.step()        on_after_optimizer_step
          step counters advanced                    on_train_step_end
          if a live `set` is agreed (hookloop.loop.live): on_settings_change (ctx.changes)
          if logging is due or requested:           on_before_log  (producers fill ctx.logs)
                                                    on_log         (loggers read ctx.logs)
          if evaluation is due or requested:        on_eval_start
            for each eval batch:                    on_eval_step_start / on_eval_step_end
                                                    on_eval_end    (ctx.metrics)
          if a rewind is requested (hookloop.checkpoint.rewind): on_checkpoint_load (ctx.rewind)
          if a checkpoint is due or requested:      on_checkpoint_save
          stop / abort requests and exit conditions are acted on here
        evaluation at the end of the epoch (before on_epoch_end)
                                                    on_epoch_end
      on any exception (once, then re-raised):      on_exception
                                                    on_train_end
    test()                                          on_test_start, on_test_step_start,
                                                    on_test_step_end, on_test_end

``evaluate()`` called directly fires the ``on_eval_*`` events alone.

Names are plain strings (``"on_train_start"``); :class:`Event` lists them as an
enum for discovery and type hints. A misspelt name raises with a suggestion.
"""

from __future__ import annotations

import difflib
from enum import Enum


class Event(str, Enum):
    """Every event the Trainer fires. Members compare equal to their string names."""

    INIT_END = "on_init_end"
    DATA_INIT_START = "on_data_init_start"
    TRAIN_START = "on_train_start"
    EPOCH_START = "on_epoch_start"
    TRAIN_STEP_START = "on_train_step_start"
    MICRO_STEP_START = "on_micro_step_start"
    MICRO_STEP_END = "on_micro_step_end"
    BEFORE_OPTIMIZER_STEP = "on_before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "on_after_optimizer_step"
    TRAIN_STEP_END = "on_train_step_end"
    SETTINGS_CHANGE = "on_settings_change"
    BEFORE_LOG = "on_before_log"
    LOG = "on_log"
    EVAL_START = "on_eval_start"
    EVAL_STEP_START = "on_eval_step_start"
    EVAL_STEP_END = "on_eval_step_end"
    EVAL_END = "on_eval_end"
    TEST_START = "on_test_start"
    TEST_STEP_START = "on_test_step_start"
    TEST_STEP_END = "on_test_step_end"
    TEST_END = "on_test_end"
    EPOCH_END = "on_epoch_end"
    CHECKPOINT_SAVE = "on_checkpoint_save"
    CHECKPOINT_LOAD = "on_checkpoint_load"
    EXCEPTION = "on_exception"
    TRAIN_END = "on_train_end"

    __hash__ = str.__hash__  # hash like the plain name, so either works as a dict key

    def __str__(self) -> str:
        return self.value


#: Every valid event name, in firing order.
EVENT_NAMES: tuple[str, ...] = tuple(e.value for e in Event)
EVENTS: frozenset[str] = frozenset(EVENT_NAMES)

#: Events fired inside one optimizer step; ``every=N`` counts these by ``state.step``.
STEP_EVENTS: frozenset[str] = frozenset(
    {
        "on_train_step_start",
        "on_micro_step_start",
        "on_micro_step_end",
        "on_before_optimizer_step",
        "on_after_optimizer_step",
        "on_train_step_end",
        "on_before_log",
        "on_log",
    }
)
#: Events fired once per epoch; ``every=N`` counts these by epoch number (1-based).
EPOCH_EVENTS: frozenset[str] = frozenset({"on_epoch_start", "on_epoch_end"})

#: Set-up and tear-down events: filters given to ``CallbackManager.add`` never skip them,
#: so a callback added with ``every=N`` still opens and closes its resources.
LIFECYCLE_EVENTS: frozenset[str] = frozenset(
    {
        "on_init_end",
        "on_data_init_start",
        "on_train_start",
        "on_train_end",
        "on_exception",
        "on_checkpoint_save",
        "on_checkpoint_load",
        "on_settings_change",
    }
)

#: Which per-event context fields are set during which events (all others are None).
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "on_micro_step_start": ("batch",),
    "on_micro_step_end": ("batch", "outputs", "loss"),
    "on_before_optimizer_step": ("loss_dict", "grad_norm"),
    "on_after_optimizer_step": ("loss_dict", "grad_norm", "skipped_iter"),
    "on_train_step_end": ("loss_dict", "grad_norm", "skipped_iter"),
    "on_before_log": ("logs",),
    "on_log": ("logs",),
    "on_eval_step_start": ("batch",),
    "on_eval_step_end": ("batch", "outputs", "loss"),
    "on_eval_end": ("metrics", "total_loss_dict", "non_loss_data"),
    "on_test_step_start": ("batch",),
    "on_test_step_end": ("batch", "outputs", "loss"),
    "on_test_end": ("metrics", "total_loss_dict", "non_loss_data"),
    "on_checkpoint_save": ("checkpoint_path", "checkpoint_timing"),
    "on_checkpoint_load": ("checkpoint_path", "rewind"),
    "on_settings_change": ("changes",),
    "on_exception": ("exception",),
}


def check_event(name: object) -> str:
    """Return ``name`` as a plain event string, or raise ``ValueError`` with a suggestion."""
    if isinstance(name, Event):
        return name.value
    if isinstance(name, str) and name in EVENTS:
        return name
    raise ValueError(unknown_event_message(name))


def unknown_event_message(name: object, what: str = "event") -> str:
    hint = ""
    if isinstance(name, str):
        close = difflib.get_close_matches(name, EVENT_NAMES, n=1, cutoff=0.6)
        if close:
            hint = f" Did you mean {close[0]!r}?"
    return f"unknown {what} {name!r}.{hint} Valid events: {', '.join(EVENT_NAMES)}."
