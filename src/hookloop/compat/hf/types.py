"""The objects an HF-style handler receives: ``args``, ``state`` and ``control``.

They carry HuggingFace's field names so that callbacks written for
``transformers.Trainer`` (or Forgather's trainer) read them unmodified. They are views for
the dialect only: the engine's own counters stay in :class:`hookloop.TrainState`
and its requests in :class:`hookloop.Control`; the adapter copies one way into
``TrainerState`` and turns ``TrainerControl`` flags into native requests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from hookloop.state import TrainState


def fraction_of(steps: float, max_steps: int) -> Any:
    """An interval below 1 is that fraction of the run, rounded up (HF's rule); while the
    run's length is unknown (0) the fraction stays as given."""
    if steps < 1:
        return math.ceil(max_steps * steps) if max_steps > 0 else steps
    return int(steps)


def eval_key(metric: str) -> str:
    """HF names the best-model metric with or without the ``eval_`` prefix."""
    return metric if metric.startswith("eval_") else f"eval_{metric}"


@dataclass
class TrainerState:
    """HF's view of the run's progress, refreshed from the native ``TrainState``.

    ``global_step`` counts completed optimizer steps, as in HF: during the events
    inside a step (``on_step_begin`` … ``on_optimizer_step``) it is one less than
    the native ``state.step``. ``log_history`` gets every log and evaluation dict;
    ``best_metric`` is updated after each evaluation, once every ``on_evaluate``
    handler has seen the previous best.
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    #: (micro-batches per epoch, per step) when ``epoch`` counts micro-batches, as HF
    #: counts it (set by the dialect's budget); not part of HF's saved state.
    epoch_batches: ClassVar[tuple[int, int] | None] = None

    def refresh(self, native: TrainState, *, inside_step: bool) -> None:
        """Copy the counters that move during a run from the native state."""
        done = native.step - 1 if inside_step else native.step
        self.global_step = done
        per_epoch = native.steps_per_epoch
        epoch_done = native.epoch_step - 1 if inside_step else native.epoch_step
        batches = self.epoch_batches  # (micro-batches per epoch, per step), or None
        if batches:  # HF counts an epoch in micro-batches (the last group may be partial)
            total, k = batches
            self.epoch = native.epoch + min(epoch_done * k, total) / total
        else:
            self.epoch = native.epoch + (epoch_done / per_epoch if per_epoch else 0.0)
        self.num_input_tokens_seen = native.tokens
        self.total_flos = float(native.flops)

    def count_epochs_in_batches(self, batches_per_epoch: int, grad_accum: int) -> None:
        """Count ``epoch`` as HF does: micro-batches seen over the epoch's batches."""
        self.epoch_batches = (batches_per_epoch, grad_accum)

    def set_budget(self, native: TrainState, args: Any) -> None:
        """The fields fixed for a run (read at init and again at train begin)."""
        self.max_steps = native.max_steps or 0
        self.num_train_epochs = native.num_epochs or 0
        per_epoch = native.steps_per_epoch
        if not self.num_train_epochs and self.max_steps and per_epoch:  # HF: epochs max_steps spans
            self.num_train_epochs = math.ceil(self.max_steps / per_epoch)
        self.is_local_process_zero = native.local_rank == 0
        self.is_world_process_zero = native.rank == 0
        self.logging_steps = getattr(args, "logging_steps", None) or 500
        self.eval_steps = getattr(args, "eval_steps", None) or self.logging_steps
        self.save_steps = getattr(args, "save_steps", None) or 500
        for kind in ("logging", "eval", "save"):  # below 1: a fraction of the run (HF's rule)
            setattr(
                self, f"{kind}_steps", fraction_of(getattr(self, f"{kind}_steps"), self.max_steps)
            )
        self.train_batch_size = getattr(args, "per_device_train_batch_size", None)

    def resumable(self) -> dict[str, Any]:
        """What a hookloop checkpoint keeps of this state (the rest is re-derived)."""
        return {
            "log_history": [dict(entry) for entry in self.log_history],
            "best_metric": self.best_metric,
            "best_global_step": self.best_global_step,
            "best_model_checkpoint": self.best_model_checkpoint,
            "num_input_tokens_seen": self.num_input_tokens_seen,
        }

    def restore(self, saved: dict[str, Any]) -> None:
        """``saved`` (from :meth:`resumable`) restored. Its log entries' keys come back
        sorted, as transformers reads them from ``trainer_state.json``: the model card's
        tables after a resume take their columns from that order."""
        for key, value in saved.items():
            if key == "log_history":
                value = [dict(sorted(entry.items())) for entry in value]
            if key in {f.name for f in dataclasses.fields(self)}:
                setattr(self, key, value)

    def save_to_json(self, json_path: str | os.PathLike[str]) -> None:
        """This state as JSON (HF's ``trainer_state.json``)."""
        text = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(text)

    @classmethod
    def load_from_json(cls, json_path: str | os.PathLike[str]) -> TrainerState:
        """A state read back from :meth:`save_to_json`'s file (or HF's)."""
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """``logging_steps`` / ``eval_steps`` / ``save_steps`` from ``args``; a value
        below 1 is a fraction of ``max_steps``, as in HF."""
        for kind in ("logging", "eval", "save"):
            steps = getattr(args, f"{kind}_steps", None)
            if steps is not None:
                if steps < 1:
                    steps = math.ceil(max_steps * steps)
                setattr(self, f"{kind}_steps", steps)


#: Every flag a handler may set, in the order the adapter acts on them.
CONTROL_FLAGS = (
    "should_training_stop",
    "should_epoch_stop",
    "should_save",
    "should_evaluate",
    "should_log",
    "should_abort_without_save",
)


@dataclass
class TrainerControl:
    """HF's five flags plus Forgather's ``should_abort_without_save``.

    A handler sets a flag; the adapter files the matching native request
    (stop, save, evaluate, log, abort) as soon as the handler returns. As in
    HF, the flags are cleared at defined points: ``should_training_stop`` at
    train begin, ``should_epoch_stop`` at epoch begin, the other three at each
    step begin, and each of save/evaluate/log once it has been done.
    """

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False
    should_abort_without_save: bool = False

    def new_training(self) -> None:
        """Training begins: the stop flags are cleared."""
        self.should_training_stop = False
        self.should_abort_without_save = False

    def new_epoch(self) -> None:
        """An epoch begins: ``should_epoch_stop`` is cleared."""
        self.should_epoch_stop = False

    def new_step(self) -> None:
        """A step begins: the save, evaluate and log flags are cleared."""
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    # transformers' names for the three, for code that calls them
    _new_training, _new_epoch, _new_step = new_training, new_epoch, new_step

    def flags(self) -> tuple[bool, ...]:
        """The flags as a tuple, in ``CONTROL_FLAGS`` order."""
        return tuple(getattr(self, name) for name in CONTROL_FLAGS)

    def state(self) -> dict[str, Any]:
        """HF's ``ExportableState`` form: the flags are the constructor's arguments."""
        return {"args": {name: getattr(self, name) for name in _HF_FLAGS}, "attributes": {}}


_HF_FLAGS = CONTROL_FLAGS[:5]  # transformers' five (Forgather's abort is never saved set)
