"""Forgather's ``DivergenceDetector`` (and its older names): the native detector under
Forgather's constructor, direct-call events and checkpoint keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hookloop.callbacks import divergence as _divergence
from hookloop.compat.forgather.callbacks.common import log
from hookloop.compat.forgather.events import answers_transformers_events

__all__ = [
    "DivergenceDetector",
    "DualTimeScaleDivergenceDetector",
    "DualWindowDivergenceDetector",
]


@answers_transformers_events
class DivergenceDetector(_divergence.DivergenceDetector):
    """The native detector under Forgather's positional order (``action`` third from last)."""

    def __init__(
        self,
        smoothing: float = 0.3,
        threshold: float | None = 1.0,  # an absolute rise over the best smoothed value
        relative_threshold: float | None = None,  # or a factor of it
        patience: int = 3,
        warmup: int = 10,
        action: str = "stop",
        use_eval_loss: bool = False,
        metric_key: str | None = None,
    ) -> None:
        _check_divergence_numbers(smoothing, threshold, relative_threshold, patience, warmup)
        super().__init__(
            smoothing,
            threshold=threshold,
            relative_threshold=relative_threshold,
            patience=patience,
            warmup=warmup,
            metric_key=metric_key,
            use_eval_loss=use_eval_loss,
            action=action,  # type: ignore[arg-type]
        )

    def hf_on_log(
        self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
    ) -> Any:
        """Forgather's ``on_log`` called directly: the watched value feeds the detector."""
        return self._observe_directly(state, control, logs)

    def hf_on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> Any:
        """Forgather's ``on_evaluate`` called directly: the watched value feeds the detector."""
        return self._observe_directly(state, control, metrics)

    def _observe_directly(self, state: Any, control: Any, values: Any) -> Any:
        """A divergence sets ``control.should_training_stop`` (and, for ``action="abort"``,
        ``should_abort_without_save`` where the control has it), as Forgather's does."""
        value = (values or {}).get(self.key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return control
        why = self.tracker.update(value)
        if why is None:
            return control
        self.triggered = why
        if getattr(state, "is_world_process_zero", True):
            log.error("divergence: %s %s; action: %s", self.key, why, self.action)
        control.should_training_stop = True
        if self.action == "abort" and hasattr(control, "should_abort_without_save"):
            control.should_abort_without_save = True
        return control

    def state_dict(self) -> dict[str, Any]:
        """Forgather's keys (``smoothed_loss``, ``best_smoothed_loss``, ``observation_count``,
        ``consecutive_above``), so a checkpoint resumes on either side; plus hookloop's
        ``healthy_step``."""
        native = super().state_dict()
        return {
            "smoothed_loss": native["smoothed"],
            "best_smoothed_loss": native["best"],
            "observation_count": native["observations"],
            "consecutive_above": native["consecutive"],
            "healthy_step": native.get("healthy_step", 0),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Forgather's keys, or the native ones an older hookloop checkpoint holds."""
        if not isinstance(state, Mapping):
            raise ValueError(f"DivergenceDetector state must be a dict, got {state!r}")
        if "smoothed" in state:  # written before the keys were Forgather's
            super().load_state_dict(dict(state))
            return
        missing = [k for k in _DIVERGENCE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"DivergenceDetector state lacks {', '.join(missing)}; it holds "
                f"{', '.join(map(str, state)) or 'nothing'} "
                f"(expected {', '.join(_DIVERGENCE_KEYS)})"
            )
        super().load_state_dict(
            {
                "smoothed": state["smoothed_loss"],
                "best": state["best_smoothed_loss"],
                "observations": state["observation_count"],
                "consecutive": state["consecutive_above"],
                "healthy_step": state.get("healthy_step", 0),
            }
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_divergence_numbers(
    smoothing: Any, threshold: Any, relative_threshold: Any, patience: Any, warmup: Any
) -> None:
    """Forgather's range checks, with its messages (other mistakes get the native ones)."""
    if _is_number(smoothing) and not 0 < smoothing <= 1:
        raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
    if _is_number(threshold) and threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    if _is_number(relative_threshold) and relative_threshold <= 1:
        raise ValueError(f"relative_threshold must be > 1, got {relative_threshold}")
    if threshold is None and relative_threshold is None:
        raise ValueError("At least one of threshold or relative_threshold must be set")
    if _is_number(patience) and patience < 1:
        raise ValueError(f"patience must be >= 1, got {patience}")
    if _is_number(warmup) and warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


_DIVERGENCE_KEYS = ("smoothed_loss", "best_smoothed_loss", "observation_count", "consecutive_above")

#: Forgather keeps its older detectors' names for :class:`DivergenceDetector`.
DualTimeScaleDivergenceDetector = DivergenceDetector
DualWindowDivergenceDetector = DivergenceDetector
