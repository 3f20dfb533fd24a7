"""The ``trainer`` an HPO-trainer hook receives inside a hookloop run.

HPO-trainer callbacks talk to each other through attributes on the trainer: a
producer writes ``trainer._max_grad_norm``, a consumer checks
``hasattr(trainer, "_max_grad_norm")``. hookloop callbacks talk through
``ctx.user_state`` instead, and the native Trainer has no such attributes. So
the hook gets an :class:`HpoTrainer`, a view of the run's ``ctx`` where

- the everyday parts read through: ``model``, ``optimizer``, ``scheduler``,
  ``config``, ``device``, ``epoch``, ``step``, ``max_epochs``, ``state``,
  ``control``, and ``native`` (the hookloop Trainer itself);
- ``trainer._<name>`` reads and writes ``ctx.user_state["<name>"]``, so a value a
  HPO-trainer callback writes lasts across events and is visible to native callbacks,
  and what native callbacks publish there is visible to HPO-trainer callbacks;
- the HPO trainer's three producer attributes (:data:`CONVENTION`) are served from
  what the native built-ins publish. As in the HPO trainer, each reads None while its
  producer is registered but has no value yet, and does not exist (``hasattr``
  is False) when the producer is not registered at all.

Values stored this way are saved in checkpoints with ``user_state``, so they
must be plain data (numbers, strings, tensors, lists, dicts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hookloop.callbacks.grad_monitor import GradientMonitor
from hookloop.callbacks.loss_prediction import LossPrediction
from hookloop.callbacks.overfit import OverfitDetection

if TYPE_CHECKING:
    from hookloop.state import CallbackContext

#: HPO-trainer attribute -> (``ctx.user_state`` key, the native callback that publishes it).
CONVENTION: dict[str, tuple[str, type]] = {
    "_max_grad_norm": ("max_grad_norm", GradientMonitor),
    "_overfit_gap_ratio": ("overfit_gap_ratio", OverfitDetection),
    "_loss_prediction": ("predicted_final_loss", LossPrediction),
}

#: The public attributes an HPO-trainer hook may read from its ``trainer``.
READABLE = (
    "model",
    "optimizer",
    "scheduler",
    "config",
    "device",
    "epoch",
    "step",
    "max_epochs",
    "state",
    "control",
    "native",
)


def user_state_key(attribute: str) -> str:
    """The ``ctx.user_state`` key behind ``trainer.<attribute>`` (``_best`` -> ``best``).

    >>> user_state_key("_best_val_loss"), user_state_key("_loss_prediction")
    ('best_val_loss', 'predicted_final_loss')
    """
    entry = CONVENTION.get(attribute)
    return entry[0] if entry is not None else attribute[1:]


def _is_shared(name: str) -> bool:
    """``_name`` is a shared value; public names and dunders are not."""
    return len(name) > 1 and name.startswith("_") and not name.startswith("__")


class HpoTrainer:
    """The HPO trainer's ``trainer``, backed by a ``CallbackContext`` (see the module docstring).

    ``written`` collects the ``user_state`` keys this view has stored, so the
    adapter can hand them on to loggers.
    """

    __slots__ = ("_hpo_ctx", "_hpo_written")

    def __init__(self, ctx: CallbackContext, written: dict[str, None] | None = None) -> None:
        object.__setattr__(self, "_hpo_ctx", ctx)
        object.__setattr__(self, "_hpo_written", written if written is not None else {})

    # -- what reads through --------------------------------------------------
    @property
    def model(self) -> Any:
        return self._hpo_ctx.model

    @property
    def optimizer(self) -> Any:
        return self._hpo_ctx.optimizer

    @property
    def scheduler(self) -> Any:
        return self._hpo_ctx.scheduler

    @property
    def config(self) -> Any:
        """The hookloop ``Config`` of the run."""
        return self._hpo_ctx.config

    @property
    def device(self) -> Any:
        return self._hpo_ctx.run.device

    @property
    def epoch(self) -> int:
        """The epoch in progress, 0-based."""
        return self._hpo_ctx.state.epoch

    @property
    def step(self) -> int:
        """Optimizer steps so far."""
        return self._hpo_ctx.state.step

    @property
    def max_epochs(self) -> int | None:
        return self._hpo_ctx.state.num_epochs

    @property
    def state(self) -> Any:
        """hookloop's ``TrainState`` (read-only counters)."""
        return self._hpo_ctx.state

    @property
    def control(self) -> Any:
        """hookloop's ``Control``: ``request_stop(reason)``, ``request_save()`` ..."""
        return self._hpo_ctx.control

    @property
    def native(self) -> Any:
        """The hookloop ``Trainer`` running this callback."""
        return self._hpo_ctx.trainer

    # -- shared values: trainer._<name> <-> ctx.user_state["<name>"] -----------
    def __getattr__(self, name: str) -> Any:
        # Called only for names that are not found above.
        if not _is_shared(name):
            raise AttributeError(
                f"the HPO trainer's trainer view has no attribute {name!r}; it offers "
                f"{', '.join(READABLE)}, and shared values as trainer._<name>"
            )
        ctx = self._hpo_ctx
        key = user_state_key(name)
        if key in ctx.user_state:
            return ctx.user_state[key]
        entry = CONVENTION.get(name)
        if entry is None:
            raise AttributeError(
                f"trainer.{name} is not set: no callback has written it "
                f"(it is ctx.user_state[{key!r}])"
            )
        if _registered(ctx, entry[1]):
            return None  # its producer is there but has nothing to say yet
        raise AttributeError(
            f"trainer.{name} is not set: it comes from {entry[1].__name__}, which is not "
            "registered with this trainer"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if not _is_shared(name):
            shown = name.lstrip("_")
            raise AttributeError(
                f"trainer.{name} cannot be set by an HPO-trainer callback: the trainer's own "
                f"attributes are read-only. Share a value as trainer._{shown} instead "
                f"(native callbacks see it as ctx.user_state[{shown!r}])"
            )
        key = user_state_key(name)
        self._hpo_ctx.user_state[key] = value
        self._hpo_written[key] = None

    def __delattr__(self, name: str) -> None:
        key = user_state_key(name) if _is_shared(name) else None
        if key is None or key not in self._hpo_ctx.user_state:
            raise AttributeError(f"trainer.{name} is not set, so it cannot be deleted")
        del self._hpo_ctx.user_state[key]
        self._hpo_written.pop(key, None)

    def __dir__(self) -> list[str]:
        shared = [f"_{key}" for key in self._hpo_ctx.user_state]
        return sorted({*READABLE, *shared, *CONVENTION})

    def __repr__(self) -> str:
        state = self._hpo_ctx.state
        return f"HpoTrainer(step={state.step}, epoch={state.epoch})"


def _registered(ctx: CallbackContext, cls: type) -> bool:
    """Whether an instance of ``cls`` is registered with the trainer behind ``ctx``."""
    if ctx.trainer is None:
        return False
    return any(isinstance(cb, cls) for cb in ctx.trainer.callbacks.callbacks)


def context_of(view: HpoTrainer) -> CallbackContext:
    """The run context ``view`` reads through (its adapter makes a new view per run)."""
    return object.__getattribute__(view, "_hpo_ctx")
