"""One answer to "did this metric improve?", shared by every callback that watches one.

Early stopping, best-checkpoint tracking and anything else that follows a
metric ask the same question with the same knobs (a direction, a minimum
change), so they share :class:`MetricTracker` and agree on what "better" means.
It is plain Python over plain numbers: no torch, no callback context.

>>> tracker = MetricTracker("min", min_delta=0.1)
>>> [tracker.update(v) for v in (1.0, 0.95, 0.85, 0.9)]
[True, False, True, False]
>>> tracker.best, tracker.bad_count
(0.85, 1)
"""

from __future__ import annotations

import math
from typing import Any

MODES = ("min", "max")
THRESHOLD_MODES = ("abs", "rel")


def check_mode(mode: object, what: str = "mode") -> str:
    """Return ``mode`` if it is ``"min"`` or ``"max"``; else raise ``ValueError`` naming it."""
    if mode not in MODES:
        raise ValueError(f"{what} must be 'min' or 'max', got {mode!r}")
    return mode


def check_metric_name(name: object, what: str = "monitor") -> str:
    """Return ``name`` if it is a non-empty string, else raise ``ValueError`` naming ``what``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a metric name such as 'eval_loss', got {name!r}")
    return name


def as_float(value: Any) -> float | None:
    """``value`` as a float if it is a real number (or a 0-dim tensor), else None."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class MetricTracker:
    """Follows one metric: its best value and how many updates in a row failed to beat it.

    ``mode`` says which direction is better. A new value counts as an
    improvement when it beats the best by more than ``min_delta``: an absolute
    amount (``threshold_mode="abs"``, the default) or a fraction of the best
    (``"rel"``: ``min_delta=1e-4`` asks for 0.01 % better). The first finite
    value always improves. NaN and ±Inf never improve; they count as bad.
    """

    def __init__(self, mode: str = "min", min_delta: float = 0.0, threshold_mode: str = "abs"):
        self.mode = check_mode(mode)
        if (
            isinstance(min_delta, bool)
            or not isinstance(min_delta, (int, float))
            or not min_delta >= 0
            or math.isinf(min_delta)
        ):
            raise ValueError(f"min_delta must be a finite number >= 0, got {min_delta!r}")
        if threshold_mode not in THRESHOLD_MODES:
            raise ValueError(f"threshold_mode must be 'abs' or 'rel', got {threshold_mode!r}")
        self.min_delta = float(min_delta)
        self.threshold_mode = threshold_mode
        self.best: float | None = None
        self.bad_count = 0
        self.updates = 0

    def is_better(self, value: float, best: float | None) -> bool:
        """Whether ``value`` improves on ``best`` under this tracker's rules (pure)."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        delta = self.min_delta * (abs(best) if self.threshold_mode == "rel" else 1.0)
        if self.mode == "min":
            return value < best - delta
        return value > best + delta

    def update(self, value: float) -> bool:
        """Record ``value``; return True if it is the new best (and reset the bad count)."""
        value = float(value)
        self.updates += 1
        if self.is_better(value, self.best):
            self.best = value
            self.bad_count = 0
            return True
        self.bad_count += 1
        return False

    def reset(self) -> None:
        self.best = None
        self.bad_count = 0
        self.updates = 0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_count": self.bad_count, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state.get("best") is None else float(state["best"])
        self.bad_count = int(state.get("bad_count", 0))
        self.updates = int(state.get("updates", 0))

    def __repr__(self) -> str:
        return (
            f"MetricTracker(mode={self.mode!r}, min_delta={self.min_delta}, "
            f"threshold_mode={self.threshold_mode!r}, best={self.best}, "
            f"bad_count={self.bad_count})"
        )
